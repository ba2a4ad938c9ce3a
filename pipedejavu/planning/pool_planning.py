"""One GPU pool planned for one model and global batch, as ``pipedejavu
plan --model M --gpus TYPE:N`` plans it: what a capacity question
(:mod:`pipedejavu.planning.capacity`) and a sweep
(:mod:`pipedejavu.planning.plan_sweep`) read of each pool, and the GPU types
a model cannot be priced on at all (their pools are not planned)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.knob_order import CutoffReached
from pipedejavu.planning.plan_model import plan_model

__all__ = [
    "PoolPlan",
    "plan_pool",
    "plan_shape",
    "planning_options",
    "tokens_per_sample",
    "unpriced_pools",
    "unpriced_types",
]


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One pool planned for one model and global batch (what a capacity
    question and a sweep read of it).

    Attributes:
        used: the GPUs the best plan uses (``None``: no plan fits).
        iteration_s: its predicted seconds per iteration (``inf``: none).
        tokens_per_sample: the sequence length planned for.
        proven: the plan is proven optimal under the predictor.
        plan: the plan, as ``plan --json`` writes it (``None``: none).
        reason: why there is no plan (``None``: there is one).
        search_s: seconds the planning took.
        shape: the plan's parallelism in words (``""``: no plan).
        lower_s: the certified least seconds per iteration of any plan of
            the pool (its time where proven; ``inf``: no plan fits).
    """

    used: Mapping[str, int] | None
    iteration_s: float
    tokens_per_sample: int
    proven: bool
    plan: Mapping[str, Any] | None
    reason: str | None
    search_s: float
    shape: str = ""
    lower_s: float = math.inf

    @classmethod
    def none(cls, reason: str, search_s: float = 0.0) -> PoolPlan:
        """No plan, and why (``search_s``: the seconds it took to find out)."""
        return cls(None, math.inf, 0, False, None, reason, search_s)

    def train_seconds(self, tokens: float, global_batch: int) -> float:
        """Seconds to train on ``tokens``: the whole iterations of
        ``global_batch`` samples they take, at the plan's seconds per
        iteration (``inf`` without a plan)."""
        if self.used is None:
            return math.inf
        samples = global_batch * self.tokens_per_sample
        return math.ceil(tokens / samples) * self.iteration_s


def planning_options(question: Any) -> dict[str, Any]:
    """The options :func:`plan_pool` takes besides the model, batch and pool
    (sequence length, precision, GPU sheet, profiles), read off a capacity
    question or a sweep, which both hold them."""
    return {
        "seq_length": question.seq_length,
        "precision": question.precision,
        "gpu_sheet": question.gpu_sheet,
        "profiles": question.profiles,
    }


def tokens_per_sample(seq_length: int | None, choice: Any) -> int:
    """Tokens per sample: ``seq_length``, or the model's of ``choice``."""
    if seq_length is not None:
        return seq_length
    spec = choice.spec
    if spec is None:
        spec = load_model_spec(choice.model)  # (a Sailor model's description)
    return spec.seq_length


def plan_pool(
    model: str,
    global_batch: int,
    pool: Mapping[str, int],
    *,
    seq_length: int | None = None,
    precision: str | None = None,
    gpu_sheet: str | None = None,
    profiles: str | None = None,
    cutoff_s: float = math.inf,
) -> PoolPlan:
    """``pool`` planned as ``pipedejavu plan --model ... --gpus ...`` plans
    it (:func:`~pipedejavu.planning.plan_model.plan_model`; a pool of
    several types with ``--mixed-types``: a type per stage); a pool with no
    plan that fits is a :class:`PoolPlan` with its reason, not an error.
    ``cutoff_s``: seconds per iteration below which plans are wanted
    (``plan_model``'s): where no plan is faster, the search stops once its
    certified bound (``lower_s``) reaches it: with the best plan found, or,
    where no plan was needed to show it, with none (``used`` ``None``, an
    empty ``reason``)."""
    started = time.perf_counter()
    try:
        knobs = plan_model(
            model,
            dict(pool),
            global_batch,
            mixed_types=len(pool) > 1,
            seq_length=seq_length,
            precision=precision,
            gpu_sheet=gpu_sheet,
            profiles=profiles,
            cutoff_s=cutoff_s,
        )
    except CutoffReached as reached:  # no plan needed to show it
        seconds = time.perf_counter() - started
        return dataclasses.replace(PoolPlan.none("", seconds), lower_s=reached.lower_s)
    except InfeasibleProblemError as error:
        return PoolPlan.none(str(error), time.perf_counter() - started)
    result = knobs.result
    return PoolPlan(
        used=result.plan.gpus_by_type(),
        iteration_s=result.prediction.iteration_time_s,
        tokens_per_sample=tokens_per_sample(seq_length, knobs.choice),
        proven=bool(result.proven),
        plan=knobs.to_json(),
        reason=None,
        search_s=time.perf_counter() - started,
        shape=plan_shape(result.plan, result.options),
        lower_s=min(result.predicted_lower_bound_s, result.iteration_time_s),
    )


def unpriced_types(
    model: str,
    types: Sequence[str],
    *,
    seq_length: int | None = None,
    precision: str | None = None,
    gpu_sheet: str | None = None,
    profiles: str | None = None,
) -> dict[str, str]:
    """``{type: reason}`` for the GPU types ``model`` cannot be priced on at
    all (its layers at one micro-batch and TP 1, the least a plan asks: e.g.
    a V100 has no bf16 peak): their pools are outcomes with the reason,
    planned on no GPU. Where no type can be priced the reason is the
    question's own (a model not found, a bad option).

    Raises:
        ProblemError: the first type's reason, when every type has one.
    """
    reasons = {}
    for gpu in types:
        try:
            choice = choose_cost_source(
                model,
                [gpu],
                precision=precision,
                seq_length=seq_length,
                gpu_sheet=gpu_sheet,
                profiles=profiles,
            )
            choice.data.layer_times(choice.model, gpu, 1, 1)
        except ProblemError as error:
            reasons[gpu] = str(error)
    if types and len(reasons) == len(types):
        raise ProblemError(reasons[types[0]])
    return reasons


def unpriced_pools(
    model: str, pools: Sequence[Mapping[str, int]], **options: Any
) -> list[str | None]:
    """For each pool, why ``model`` cannot be priced on it
    (:func:`unpriced_types` of the pools' types, ``options`` as
    :func:`plan_pool` takes them), or ``None`` where it can.

    Raises:
        ProblemError: as :func:`unpriced_types`.
    """
    types = list(dict.fromkeys(gpu for pool in pools for gpu in pool))
    refused = unpriced_types(model, types, **options)
    return [next((refused[g] for g in pool if g in refused), None) for pool in pools]


def plan_shape(plan: Any, options: Any) -> str:
    """``pp 4, tp 8, dp 16, mbs 1`` and the knobs that are not the default:
    a plan's parallelism in words."""
    tps = sorted({r.tp for stage in plan.stages for r in stage.replicas})
    words = [f"pp {len(plan.stages)}", f"tp {'/'.join(map(str, tps))}"]
    if plan.layout.cp > 1:
        words.append(f"cp {plan.layout.cp}")
    words += [f"dp {plan.dp}", f"mbs {plan.mbs}"]
    if options.virtual_stages > 1:
        words.append(f"vp {options.virtual_stages}")
    if options.recompute != "none":
        words.append(f"recompute {options.recompute}")
    if options.zero_stage:
        words.append(f"ZeRO-{options.zero_stage}")
    return ", ".join(words)
