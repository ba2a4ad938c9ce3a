"""Sharded data parallelism and context parallelism searched: every
single-stage plan of FSDP2 / HSDP (ZeRO-3) with TP and CP, predicted.

:func:`search_sharded` enumerates, on ``N`` GPUs of one type, every
combination of

* ``tp``: a divisor of the GPUs of a node that divides the model
  (``--tp`` values, default every one);
* ``cp``: context parallelism, ``2 cp`` dividing the sequence (torchtitan's
  and Transformer Engine's load-balanced split), up to ``max_cp``;
* ``dp = N / (tp cp)`` replicas, of which ``dp_shard`` shard the model state
  (every divisor of ``dp``: FSDP when it is ``dp``, HSDP below);
* the micro-batch (a divisor of the global batch's share of a replica; the
  rest is gradient accumulation);
* the recomputation of ``recompute`` (none, full, or a selective policy),

prices each with the predictor
(:func:`~pipedejavu.costmodel.megatron.predictor.predict_plan`, through the
same plan builder as a torchtitan job:
:func:`~pipedejavu.planning.torchtitan_launch.sharded_plan`) and keeps the
fastest that fits its GPUs. Every plan of the space is priced, so the answer
is optimal under the predictor over that space (``proven``); a space is
bounded (:data:`MAX_SHARDED_PLANS`) and its size said. Pipelines with
sharded parameters are not searched here (the predictor prices ZeRO-3 with
1F1B; the proven pipeline search does not yet).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH, Plan3D
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import TORCHTITAN_OP, TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.roofline import AnalyticalConstants
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.sailor_data import NetworkTables
from pipedejavu.planning.any_model import CostChoice
from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.knobs import KnobPlan
from pipedejavu.planning.torchtitan_launch import sharded_plan
from pipedejavu.planning.training import TrainingPlan
from pipedejavu.search.megatron.settings import bound_reaches

__all__ = [
    "MAX_SHARDED_PLANS",
    "TORCHTITAN_RECOMPUTE",
    "best_sharded",
    "join_sharded",
    "least_sharded_work",
    "share_source",
    "ShardedPlan",
    "search_sharded",
    "sharded_candidates",
]

#: The most plans one search prices (a space larger than this is refused:
#: narrow ``tp``, ``max_cp`` or the recomputation).
MAX_SHARDED_PLANS = 20_000


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """The fastest sharded plan found.

    Attributes:
        plan: the plan as priced (context parallelism as sequence shares:
            ``cp x`` the replicas and samples, shard groups of ``dp_shard x
            cp`` of them).
        options: its training options (``zero_stage`` 3).
        prediction: its prediction.
        tp, cp, dp, dp_shard: its degrees (``dp`` the data-parallel replicas
            of whole sequences).
        searched: plans priced; ``fit``: of them, those that fit.
        search_time_s: seconds the search took.
        source: the cost source that priced ``plan``.
    """

    plan: Plan3D
    options: TrainingOptions
    prediction: Prediction
    tp: int
    cp: int
    dp: int
    dp_shard: int
    searched: int
    fit: int
    search_time_s: float
    source: AnalyticalSource | None = None

    @property
    def proven(self) -> bool:
        """Every plan of the space was priced: optimal under the predictor."""
        return True

    def describe(self) -> str:
        hsdp = (
            ""
            if self.dp_shard == self.dp
            else f" (HSDP: {self.dp // self.dp_shard} groups)"
        )
        return (
            f"FSDP over dp_shard {self.dp_shard} x cp {self.cp}{hsdp}, tp {self.tp}, "
            f"dp {self.dp}, mbs {self.plan.mbs}, {self.options.recompute} "
            "recomputation"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _node_tps(
    spec: TransformerSpec, gpus_per_node: int, values: Sequence[int] | None = None
) -> list[int]:
    """The TP degrees of the space: ``values`` (default every divisor of a
    node's GPUs) that divide a node and the model's heads and query groups."""
    return [
        t
        for t in values or _divisors(gpus_per_node)
        if gpus_per_node % t == 0
        and spec.num_attention_heads % t == 0
        and spec.num_query_groups % t == 0
    ]


def _sharded_options(base: TrainingOptions, tp: int) -> TrainingOptions:
    """How a sharded plan of TP ``tp`` trains: ZeRO-3, sequence parallelism
    with TP, no TP communication overlap."""
    return dataclasses.replace(
        base, zero_stage=3, sequence_parallel=tp > 1, tp_comm_overlap=False
    )


def sharded_candidates(
    spec: TransformerSpec,
    num_gpus: int,
    gpus_per_node: int,
    global_batch: int,
    *,
    tp_values: Sequence[int] | None = None,
    max_cp: int = 64,
    recompute: Sequence[TrainingOptions] = (),
    tp_splits_sequence: bool = False,
) -> list[tuple[int, int, int, int, TrainingOptions]]:
    """Every ``(tp, cp, dp_shard, mbs, options)`` of the space (module
    docstring); ``recompute``: the options of each recomputation searched;
    ``tp_splits_sequence``: the sequence must split over ``tp x 2 cp``
    (torchtitan's rule, at every CP).

    Raises:
        ProblemError: more than :data:`MAX_SHARDED_PLANS` of them.
    """
    tps = [t for t in _node_tps(spec, gpus_per_node, tp_values) if num_gpus % t == 0]
    out = []
    for tp in tps:
        for cp in _divisors(num_gpus // tp):
            if cp > max_cp or (cp > 1 and spec.seq_length % (2 * cp)):
                continue
            if tp_splits_sequence and spec.seq_length % (2 * tp * cp):
                continue
            if global_batch * cp > MAX_GLOBAL_BATCH:  # the shares priced
                continue
            dp = num_gpus // (tp * cp)
            if global_batch % dp:
                continue
            for mbs in _divisors(global_batch // dp):
                for shard in _divisors(dp):
                    out.extend((tp, cp, shard, mbs, o) for o in recompute)
                    if len(out) > MAX_SHARDED_PLANS:
                        raise ProblemError(
                            f"the sharded space of {num_gpus} GPUs holds more than "
                            f"{MAX_SHARDED_PLANS} plans: give fewer TP degrees, a "
                            "smaller largest CP or fewer recomputations"
                        )
    return out


def search_sharded(
    spec: TransformerSpec,
    gpu_type: str,
    num_gpus: int,
    global_batch: int,
    sheet: Mapping[str, GpuSheetEntry],
    options: TrainingOptions,
    *,
    constants: AnalyticalConstants | None = None,
    recompute: Sequence[TrainingOptions] | None = None,
    tp_values: Sequence[int] | None = None,
    max_cp: int = 64,
    memory_headroom: MemoryHeadroom | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    tp_splits_sequence: bool = False,
    eager: bool = False,
    measured_links: NetworkTables | None = None,
) -> ShardedPlan:
    """The fastest plan of the sharded space (module docstring) of ``spec``
    (at its sequence length) on ``num_gpus`` GPUs of ``gpu_type``, trained
    with ``options`` (its precision, kernels; the search sets the ZeRO stage,
    sequence parallelism with TP, and ``recompute``'s recomputation: default
    none, the attention core and full); ``measured_links``: the cluster's
    links where they hold a fit (a calibration's; ``None``: the sheet's).

    Raises:
        ProblemError: an unknown GPU type, a space too large.
        InfeasibleProblemError: no plan of the space fits.
    """
    started = time.perf_counter()
    if gpu_type not in sheet:
        raise ProblemError(f"GPU type {gpu_type!r} is not on the GPU sheet")
    entry = sheet[gpu_type]
    if not options.flash_attention:  # context parallelism needs fused attention
        max_cp = 1
    if recompute is None:
        recompute = [
            dataclasses.replace(options, recompute=r, recompute_num_layers=None)
            for r in ("none", "selective", "full")
        ]
    candidates = sharded_candidates(
        spec,
        num_gpus,
        entry.gpus_per_node,
        global_batch,
        tp_values=tp_values,
        max_cp=max_cp,
        recompute=recompute,
        tp_splits_sequence=tp_splits_sequence,
    )
    sources: dict[tuple, AnalyticalSource] = {}
    best: tuple[float, Plan3D, TrainingOptions, Prediction, tuple] | None = None
    fit = 0
    blocks = [spec.num_layers]
    for k, (tp, cp, shard, mbs, base) in enumerate(candidates):
        planned = _sharded_options(base, tp)
        key = (cp, planned)
        if key not in sources:
            sources[key] = share_source(
                spec, sheet, planned, cp, constants=constants, eager=eager,
                measured_links=measured_links, memory_headroom=memory_headroom,
            )  # fmt: skip
        dp = num_gpus // (tp * cp)
        plan = sharded_plan(
            spec, gpu_type, blocks, mbs, global_batch, entry.gpus_per_node,
            tp=tp, pp=1, dp=dp, cp=cp, dp_shard=shard,
        )  # fmt: skip
        prediction = predict_plan(plan, sources[key])
        if prediction.fits_memory:
            fit += 1
            seconds = prediction.iteration_time_s
            if best is None or seconds < best[0]:
                best = (seconds, plan, planned, prediction, (tp, cp, dp, shard))
        if progress_fn is not None and k % 200 == 0:
            progress_fn(
                {
                    "phase": "sharded",
                    "priced": k + 1,
                    "of": len(candidates),
                    "best_s": math.inf if best is None else best[0],
                }
            )
    if best is None:
        rule = " (torchtitan splits each sequence over tp x 2 cp)"
        raise InfeasibleProblemError(
            f"no sharded single-stage plan of {spec.name} fits {num_gpus} "
            f"{gpu_type} with global batch {global_batch} ({len(candidates)} "
            f"priced{rule if tp_splits_sequence and not candidates else ''})"
        )
    _, plan, planned, prediction, (tp, cp, dp, shard) = best
    source = sources[(cp, planned)]
    return ShardedPlan(
        plan,
        planned,
        prediction,
        tp,
        cp,
        dp,
        shard,
        len(candidates),
        fit,
        time.perf_counter() - started,
        source,
    )


def share_source(
    spec: TransformerSpec,
    sheet: Mapping[str, GpuSheetEntry],
    planned: TrainingOptions,
    cp: int,
    *,
    constants: AnalyticalConstants | None = None,
    eager: bool = False,
    measured_links: NetworkTables | None = None,
    memory_headroom: MemoryHeadroom | None = None,
) -> AnalyticalSource:
    """The source that prices a sharded plan of ``spec`` with context
    parallelism ``cp`` trained with ``planned``: each GPU's share of a
    sequence (``seq_length / cp`` tokens) priced analytically."""
    share = dataclasses.replace(spec, seq_length=spec.seq_length // cp)
    source = AnalyticalSource(
        share,
        sheet,
        planned,
        context_parallel=cp,
        constants=constants,
        eager=eager,
        measured_links=measured_links,
    )
    if memory_headroom is not None:
        source = source.with_memory_headroom(memory_headroom)
    return source


def least_sharded_work(
    choice: CostChoice, global_batch: int, max_cp: int = 64
) -> NDArray[np.float64]:
    """Per layer, the least GPU-seconds of one iteration of any sharded plan
    :func:`best_sharded` prices for ``choice`` (any GPU count): over every TP
    degree of a node, CP up to ``max_cp`` and micro-batch dividing
    ``global_batch``, ``tp x cp x (global_batch / mbs)`` times the layer's
    forward and backward on one GPU, without recomputation (which only adds
    to the backward). A sharded plan keeps every GPU of a replica busy at
    least that long (a floor on its cost:
    :mod:`~pipedejavu.planning.capacity_pruning`)."""
    ((gpu, name),) = choice.gpu_types.items()
    source, spec = choice.data, choice.spec
    entry = source.sheet[name]
    tps = _node_tps(spec, entry.gpus_per_node)
    cps = [c for c in range(1, max_cp + 1) if c == 1 or spec.seq_length % (2 * c) == 0]
    options = dataclasses.replace(
        choice.options, recompute="none", recompute_num_layers=None
    )
    best = None
    for cp in cps:
        for tp in tps:
            priced = share_source(
                spec, source.sheet, _sharded_options(options, tp), cp,
                constants=source.constants_of(name),
                measured_links=source.measured_links,
            )  # fmt: skip
            for mbs in _divisors(global_batch):
                times = priced.layer_times(choice.model, name, mbs, tp)
                work = (
                    tp * cp * (global_batch // mbs) * (times.forward + times.backward)
                )
                best = work if best is None else np.minimum(best, work)
    return best


#: torchtitan's recomputations: none, its per-operation policy, full.
TORCHTITAN_RECOMPUTE = ("none", (TORCHTITAN_OP,), "full")


def _recomputing(
    options: TrainingOptions, how: str | tuple[str, ...]
) -> TrainingOptions:
    """``options`` recomputing ``how``: a granularity, or selective modules."""
    if isinstance(how, tuple):
        return dataclasses.replace(
            options, recompute="selective", recompute_modules=how,
            recompute_num_layers=None,
        )  # fmt: skip
    return dataclasses.replace(options, recompute=how, recompute_num_layers=None)


def best_sharded(
    choice: CostChoice,
    pool: Mapping[str, int],
    global_batch: int,
    space: KnobSpace,
    *,
    recompute: Sequence[str | tuple[str, ...]] | None = None,
    tp_splits_sequence: bool = False,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    constants: AnalyticalConstants | None = None,
    eager: bool = False,
) -> ShardedPlan:
    """:func:`search_sharded`'s best plan on the pool's one GPU type, every
    GPU used, with ``space``'s recomputations; priced with ``constants``
    (``None``: the choice's source's; ``eager``: element-wise kernels
    unfused, as a job without ``torch.compile`` runs them). Its time is a
    cutoff the pipelines' proofs may take
    (:func:`~pipedejavu.planning.knobs.plan_with_knobs`' ``outside_s``).

    Raises:
        InfeasibleProblemError: no sharded plan fits.
    """
    ((gpu, count),) = choice.pool(pool).items()
    source = choice.data
    modes = space.recompute if recompute is None else recompute
    recompute = [_recomputing(choice.options, r) for r in modes]
    return search_sharded(
        choice.spec, gpu, count, global_batch, source.sheet, choice.options,
        constants=constants or source.constants_of(gpu), recompute=recompute,
        measured_links=source.measured_links,
        memory_headroom=source.memory_headroom,
        tp_splits_sequence=tp_splits_sequence, progress_fn=progress_fn,
        eager=eager,
    )  # fmt: skip


def join_sharded(
    regular: KnobPlan | None,
    found: ShardedPlan,
    choice: CostChoice,
    pool: Mapping[str, int],
    space: KnobSpace,
    *,
    started: float,
    pipelines_lower: float = math.inf,
) -> KnobPlan:
    """The faster of ``regular`` (the proven pipeline search's plan, ``None``
    where no plan of its space fits) and ``found`` (:func:`best_sharded`),
    its note added to the choice's (``space``: the knobs searched). Proven
    when ``regular`` is (both spaces are searched exactly), or, where
    ``found`` wins, when ``regular``'s certified lower bound over every
    pipeline reaches ``found``'s time. ``pipelines_lower``: that bound where
    the pipelines' search stopped with no plan at its cutoff
    (:class:`~pipedejavu.planning.knob_order.CutoffReached`; ``regular``
    ``None``).
    """
    note = (
        f"sharded single-stage plans searched (FSDP2/HSDP x TP x CP, every GPU): "
        f"{found.searched} priced, best {found.describe()} at "
        f"{found.prediction.iteration_time_s:.4f} s"
    )
    seconds = found.prediction.iteration_time_s
    if regular is not None and regular.result.iteration_time_s <= seconds:
        kept = dataclasses.replace(regular.choice, notes=(*regular.choice.notes, note))
        return dataclasses.replace(regular, choice=kept)
    bound = min(seconds, pipelines_lower)
    proven = bound_reaches(pipelines_lower, seconds)
    if regular is not None:
        lower = regular.result.predicted_lower_bound_s
        bound = min(bound, lower)
        # no pipeline is faster than the certified bound: where it reaches
        # the sharded plan's time, the sharded plan is the optimum
        proven = regular.result.proven or bound_reaches(lower, seconds)
    result = TrainingPlan(
        plan=found.plan,
        prediction=found.prediction,
        objective_s=math.nan,
        optimum_s=math.nan,
        lower_bound_s=math.nan,
        gap=math.nan,
        gpus_available=dict(choice.pool(pool)),
        search_time_s=time.perf_counter() - started,
        method="enumeration",
        configurations=found.searched,
        solved=found.searched,
        predicted_lower_bound_s=bound,
        proven=proven,
        cost_source="analytical",
        options=found.options,
    )
    won = dataclasses.replace(
        choice,
        data=found.source,
        options=found.options,
        notes=(*choice.notes, note),
    )
    outcomes = () if regular is None else regular.outcomes
    return KnobPlan(result, won, space, outcomes)
