"""Goodput mode: choose the global batch together with the Megatron-style plan.

Pollux (Qiao et al., OSDI 2021) picks the batch size that maximizes *goodput*:
throughput x statistical efficiency, with the throughput from its fitted
data-parallel step-time model. Here the throughput is the predicted iteration
time of the best pipeline plan for that batch (:func:`~pipedejavu.planning.training.
plan_training`, unchanged: one planning model), and the efficiency is Pollux's
(:func:`pipedejavu.costmodel.goodput.model.efficiency`)::

    goodput(B) = B / T*(B) x efficiency(B),   T*(B) = plan_training(..., B).

:func:`plan_goodput` maximizes it exactly over a finite set of candidate global
batches (by default every multiple of ``batch_multiple`` between the initial and
the maximum batch) with bound and prune: every batch gets an upper bound on its
goodput from :func:`throughput_upper_bound` (a lower bound on the predicted
iteration time of *any* plan of that batch on the pool), batches are planned in
decreasing order of the bound, and the search stops when the next bound cannot
beat the best goodput found. Ties go to the smaller batch. The result equals
plain enumeration (planning every candidate) whenever the bound is valid; the
search checks it on every batch it plans and raises if a plan beats its bound.

The bound (seconds per iteration; the predictor's own layer times, see
:mod:`pipedejavu.costmodel.megatron.predictor`): with micro-batch size ``m`` (``m``
divides ``B``; ``B / m`` micro-batches in all), a GPU's forward and backward
passes run one after the other, each costing its layers' profiled times plus
``op_overhead_s``, so the iteration lasts at least the GPU-seconds of compute
divided by the GPUs of the pool, ``(B / m) x W(m) / G`` with ``W(m)`` the least
GPU-seconds of one micro-batch through every layer (each layer at its cheapest
profiled TP degree and GPU type, ``tp x time``) plus the two instruction
overheads of one TP group; and at least the chain of one micro-batch through
every stage forward and back, ``C(m)`` (each layer at its fastest entry, plus
two overheads). So ``T*(B) >= min over m of max((B / m) W(m) / G, C(m))``.
Transfers, all-reduces, the optimizer and the bubble only add to it. It holds
for plans that leave GPUs idle and for plans that mix GPU types.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.training import TrainingPlan, parse_gpu_pool, plan_training

__all__ = [
    "MAX_CANDIDATE_BATCHES",
    "BatchRecord",
    "GoodputPlan",
    "candidate_batches",
    "efficiency",
    "grad_params_from_noise_scale",
    "maximize_over_batches",
    "plan_goodput",
    "throughput_upper_bound",
]

#: Most candidate global batches goodput mode considers (each may need a plan
#: search; the bound prunes most, but a search is still linear in them).
MAX_CANDIDATE_BATCHES = 1024
#: Relative slack when checking a planned batch against its bound (float noise).
BOUND_SLACK = 1e-9


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProblemError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ProblemError(f"{name} must be >= 1, got {value}")
    return int(value)


def _grad(grad_params: Any) -> tuple[float, float]:
    try:
        sqr, var = (float(x) for x in grad_params)
    except (TypeError, ValueError):
        raise ProblemError(
            f"grad_params must be two numbers (sqr, var), got {grad_params!r}"
        ) from None
    if not (math.isfinite(sqr) and math.isfinite(var)) or sqr < 0 or var < 0:
        raise ProblemError(
            f"grad_params (sqr, var) must be finite and >= 0, got ({sqr}, {var})"
        )
    if sqr == 0 and var == 0:
        raise ProblemError("grad_params (sqr, var) must not both be 0")
    return sqr, var


def grad_params_from_noise_scale(noise_scale: float, init_batch: int):
    """``GradParams`` whose gradient noise scale is ``noise_scale`` samples.

    Pollux's efficiency is ``(phi + B0) / (phi + B)`` with ``phi = B0 var / sqr``
    (the noise scale; McCandlish et al. 2018's ``B_noise``, whose per-sample
    efficiency ``E_min / E = (1 + B0 / B_noise) / (1 + B / B_noise)`` relative
    to ``B0`` is the same formula). So ``sqr = 1``, ``var = phi / B0``.
    """
    from pipedejavu.costmodel.goodput.model import GradParams

    if not (math.isfinite(noise_scale) and noise_scale >= 0):
        raise ProblemError(f"noise_scale must be finite and >= 0, got {noise_scale}")
    init = _positive_int(init_batch, "init_batch")
    return GradParams(1.0, float(noise_scale) / init)


def efficiency(grad_params: Any, init_batch: int, batches: Sequence[int]):
    """Pollux's statistical efficiency of each batch (float64 numpy array).

    Calls :func:`pipedejavu.costmodel.goodput.model.efficiency` (the port), in
    float64.
    """
    import jax

    from pipedejavu.costmodel.goodput.model import GradParams
    from pipedejavu.costmodel.goodput.model import efficiency as _efficiency

    sqr, var = _grad(grad_params)
    with jax.enable_x64(True):
        values = _efficiency(
            GradParams(sqr, var),
            float(init_batch),
            np.asarray(batches, dtype=np.float64),
        )
        return np.asarray(values, dtype=np.float64)


def candidate_batches(
    init_batch: int, max_global_batch: int, batch_multiple: int = 1
) -> list[int]:
    """Every multiple of ``batch_multiple`` in ``[init_batch, max_global_batch]``.

    Raises:
        ProblemError: a non-positive argument, or an empty range.
    """
    low = _positive_int(init_batch, "init_batch")
    high = _positive_int(max_global_batch, "max_global_batch")
    step = _positive_int(batch_multiple, "batch_multiple")
    for name, value in (("init_batch", low), ("max_global_batch", high)):
        if value > MAX_GLOBAL_BATCH:
            raise ProblemError(
                f"{name} must be in [1, {MAX_GLOBAL_BATCH}] samples, got {value}"
            )
    first = -(-low // step) * step
    count = len(range(first, high + 1, step))  # computed, not listed
    if count > MAX_CANDIDATE_BATCHES:
        raise ProblemError(
            f"at most {MAX_CANDIDATE_BATCHES} candidate global batches, got {count} "
            f"multiples of {step} in [{low}, {high}]; raise the batch multiple or "
            "narrow the range"
        )
    out = list(range(first, high + 1, step))
    if not out:
        raise ProblemError(
            f"no multiple of {step} between init batch {low} and max global batch "
            f"{high}"
        )
    return out


def _bound_terms(data, model: str, pool: Mapping[str, int], constants, mbs_values):
    """``{mbs: (chain_s, work_gpu_s)}``: C(m) and W(m) of the module docstring."""
    info = data.model_info(model)
    overhead = constants.op_overhead_s
    best: dict[int, list] = {}
    for gpu, count in pool.items():
        spec = data.gpu_spec(gpu)
        for mbs, tp in data.profile(model, gpu):
            if mbs_values is not None and mbs not in mbs_values:
                continue
            if tp not in info.tp_values or spec.gpus_per_node % tp or tp > count:
                continue
            times = data.layer_times(
                model, gpu, mbs, tp, smooth=constants.smooth_profiles
            )
            layer = np.asarray(times.forward + times.backward, dtype=np.float64)
            if mbs not in best:
                best[mbs] = [layer.copy(), tp * layer, tp]
            else:
                entry = best[mbs]
                entry[0] = np.minimum(entry[0], layer)
                entry[1] = np.minimum(entry[1], tp * layer)
                entry[2] = min(entry[2], tp)
    return {
        mbs: (
            float(chain.sum()) + 2 * overhead,
            float(work.sum()) + 2 * overhead * least_tp,
        )
        for mbs, (chain, work, least_tp) in best.items()
    }


def throughput_upper_bound(
    model: str,
    gpus: Mapping[str, int] | Sequence[str],
    batches: Sequence[int],
    *,
    profiles: Any = None,
    mbs_values: Sequence[int] | None = None,
    constants: Any = None,
) -> NDArray[np.float64]:
    """Samples per second that no plan of each global batch can exceed.

    ``B / T_low(B)`` with ``T_low`` the lower bound of the module docstring,
    under the predictor of :mod:`pipedejavu.costmodel.megatron.predictor` with
    ``constants``; 0 where no profiled micro-batch size divides ``B``.

    Args:
        model: the model's profile name.
        gpus: the pool, ``{type: count}`` or ``["GH-96:64", ...]``.
        batches: global batches, samples.
        profiles: the profile folder (``None``: bundled).
        mbs_values: micro-batch sizes allowed (``None``: all profiled).
        constants: predictor constants (``None``: the fitted ones).

    Returns:
        f64[len(batches)] samples per second.
    """

    pool = parse_gpu_pool(gpus) if not isinstance(gpus, Mapping) else dict(gpus)
    data = load_sailor_data(profiles)
    terms = _bound_terms(data, model, pool, constants or FITTED_CONSTANTS, mbs_values)
    total = sum(pool.values())
    out = np.zeros(len(batches))
    for index, batch in enumerate(batches):
        lows = [
            max(batch // mbs * work / total, chain)
            for mbs, (chain, work) in terms.items()
            if batch % mbs == 0
        ]
        if lows:
            out[index] = batch / min(lows)
    return out


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """What the search did with one candidate batch.

    Attributes:
        batch: the global batch, samples.
        bound: upper bound on its goodput (or objective), per second.
        status: ``"planned"``, ``"infeasible"`` (planned, no plan fits) or
            ``"pruned"`` (its bound could not beat the best found).
        value: its goodput where planned and feasible, else ``None``.
    """

    batch: int
    bound: float
    status: str
    value: float | None = None


def maximize_over_batches(
    batches: Sequence[int],
    bounds: Sequence[float],
    evaluate_fn: Callable[[int], tuple[float, Any] | None],
    *,
    progress_fn: Callable[[BatchRecord], None] | None = None,
) -> tuple[int | None, Any, list[BatchRecord]]:
    """The batch of largest value, exactly, by bound and prune.

    Args:
        batches: candidate batches.
        bounds: an upper bound on each batch's value.
        evaluate_fn: ``batch -> (value, payload)``, or ``None`` where the batch
            has no feasible plan.
        progress_fn: called with each planned batch's record.

    Returns:
        ``(best batch or None, its payload, records)``; ties go to the smaller
        batch, as plain enumeration in increasing batch order with a strict
        ``>`` would pick.

    Raises:
        RuntimeError: a batch's value exceeds its bound (the bound is invalid,
            so the pruning could be wrong).
    """
    order = sorted(range(len(batches)), key=lambda i: (-bounds[i], batches[i]))
    best_value, best_batch, best_payload = -math.inf, None, None
    records: list[BatchRecord] = []
    for position, i in enumerate(order):
        batch, bound = int(batches[i]), float(bounds[i])
        # A value may exceed its bound by float noise (BOUND_SLACK), so prune
        # only what cannot beat (or tie with a smaller batch) the incumbent.
        reach = bound * (1 + BOUND_SLACK)
        if best_batch is not None and (
            reach < best_value or (reach == best_value and batch > best_batch)
        ):
            records += [
                BatchRecord(int(batches[j]), float(bounds[j]), "pruned")
                for j in order[position:]
            ]
            break
        result = evaluate_fn(batch)
        if result is None:
            record = BatchRecord(batch, bound, "infeasible")
        else:
            value, payload = result
            if value > bound * (1 + BOUND_SLACK):
                raise RuntimeError(
                    f"batch {batch}: the planned value {value} exceeds its upper "
                    f"bound {bound}; the bound is invalid"
                )
            record = BatchRecord(batch, bound, "planned", float(value))
            if value > best_value or (value == best_value and batch < best_batch):
                best_value, best_batch, best_payload = value, batch, payload
        records.append(record)
        if progress_fn is not None:
            progress_fn(record)
    return best_batch, best_payload, records


@dataclasses.dataclass(frozen=True, eq=False)
class GoodputPlan:
    """The goodput-optimal global batch and its plan (see :func:`plan_goodput`).

    Attributes:
        training: the plan of the chosen batch (:class:`TrainingPlan`).
        global_batch: the chosen batch, samples.
        goodput: useful samples per second (throughput x efficiency).
        throughput: samples per second, ``global_batch / iteration_time_s``.
        efficiency: Pollux's statistical efficiency of the batch.
        grad_params: ``(sqr, var)``; init_batch: the batch they refer to.
        records: one :class:`BatchRecord` per candidate batch.
        search_time_s: wall-clock seconds of the whole search.
    """

    training: TrainingPlan
    global_batch: int
    goodput: float
    throughput: float
    efficiency: float
    grad_params: tuple[float, float]
    init_batch: int
    records: tuple[BatchRecord, ...]
    search_time_s: float

    @property
    def planned(self) -> int:
        """Candidate batches planned (feasible or not)."""
        return sum(r.status != "pruned" for r in self.records)

    @property
    def pruned(self) -> int:
        """Candidate batches skipped by their bound."""
        return sum(r.status == "pruned" for r in self.records)

    def to_json(self) -> dict[str, Any]:
        """The plan JSON of :meth:`TrainingPlan.to_json` plus the batch search."""
        out = self.training.to_json()
        out["goodput"] = {
            "global_batch": self.global_batch,
            "goodput": self.goodput,
            "throughput": self.throughput,
            "efficiency": self.efficiency,
            "grad_params": list(self.grad_params),
            "init_batch": self.init_batch,
            "noise_scale": _noise_scale(self.grad_params, self.init_batch),
            "candidates": len(self.records),
            "planned": self.planned,
            "pruned": self.pruned,
            "search_time_s": self.search_time_s,
        }
        return out


def _noise_scale(grad_params: tuple[float, float], init_batch: int) -> float | None:
    sqr, var = grad_params
    return init_batch * var / sqr if sqr > 0 else None


def plan_goodput(
    model: str,
    gpus: Mapping[str, int] | Sequence[str],
    grad_params: Any,
    init_batch: int,
    max_global_batch: int,
    *,
    batches: Sequence[int] | None = None,
    batch_multiple: int = 1,
    profiles: Any = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mbs_values: Sequence[int] | None = None,
    constants: Any = None,
    progress_fn: Callable[[BatchRecord], None] | None = None,
) -> GoodputPlan:
    """The global batch and plan of largest goodput (module docstring).

    Args:
        model, gpus, profiles, method, uniform_tp, allow_fewer_gpus, mbs_values,
            constants: as for :func:`~pipedejavu.planning.training.plan_training`.
        grad_params: Pollux's ``GradParams`` or ``(sqr, var)``, measured at
            ``init_batch``.
        init_batch: the batch the gradient statistics refer to (and the
            smallest candidate), samples.
        max_global_batch: the largest candidate, samples.
        batches: the candidate global batches (default: :func:`candidate_batches`
            of ``init_batch``, ``max_global_batch``, ``batch_multiple``); each
            must lie in ``[init_batch, max_global_batch]``.
        batch_multiple: step of the default candidates.
        progress_fn: called with each planned batch's :class:`BatchRecord`.

    Raises:
        ProblemError: bad arguments.
        InfeasibleProblemError: no candidate batch has a plan that fits.
    """
    started = time.perf_counter()
    sqr, var = _grad(grad_params)
    init = _positive_int(init_batch, "init_batch")
    high = _positive_int(max_global_batch, "max_global_batch")
    if batches is None:
        batches = candidate_batches(init, high, batch_multiple)
    else:
        if len(batches) > MAX_CANDIDATE_BATCHES:
            raise ProblemError(
                f"at most {MAX_CANDIDATE_BATCHES} candidate batches, got {len(batches)}"
            )
        batches = sorted({_positive_int(b, "each candidate batch") for b in batches})
        outside = [b for b in batches if not init <= b <= high]
        if outside or not batches:
            raise ProblemError(
                f"candidate batches must lie in [init_batch, max_global_batch] = "
                f"[{init}, {high}], got {outside or 'none'}"
            )
    pool = parse_gpu_pool(gpus) if not isinstance(gpus, Mapping) else dict(gpus)
    speed = throughput_upper_bound(
        model,
        pool,
        batches,
        profiles=profiles,
        mbs_values=mbs_values,
        constants=constants,
    )
    gains = efficiency((sqr, var), init, batches)
    options = dict(
        profiles=profiles,
        method=method,
        uniform_tp=uniform_tp,
        allow_fewer_gpus=allow_fewer_gpus,
        mbs_values=mbs_values,
        constants=constants,
    )
    gain_of = dict(zip(batches, gains.tolist(), strict=True))

    def evaluate(batch: int):
        try:
            plan = plan_training(model, pool, batch, **options)
        except InfeasibleProblemError:
            return None
        return batch / plan.iteration_time_s * gain_of[batch], plan

    best, plan, records = maximize_over_batches(
        batches, (speed * gains).tolist(), evaluate, progress_fn=progress_fn
    )
    if best is None:
        raise InfeasibleProblemError(
            f"no candidate global batch in [{batches[0]}, {batches[-1]}] has a plan "
            f"of {model} that fits {pool}"
        )
    throughput = best / plan.iteration_time_s
    return GoodputPlan(
        training=plan,
        global_batch=best,
        goodput=throughput * gain_of[best],
        throughput=throughput,
        efficiency=gain_of[best],
        grad_params=(sqr, var),
        init_batch=init,
        records=tuple(sorted(records, key=lambda r: r.batch)),
        search_time_s=time.perf_counter() - started,
    )
