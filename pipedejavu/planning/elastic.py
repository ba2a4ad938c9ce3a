"""Elastic mode: plans for every GPU count of an elastic job, and one global batch.

An elastic job (DeepSpeed's elasticity, :mod:`pipedejavu.planning.deepspeed_elastic`)
may get any
GPU count in a range. Each count has its own best plan and best global batch
(:func:`~pipedejavu.planning.batch.plan_goodput`: largest goodput, or largest
throughput without gradient statistics). But the job keeps one global batch
across restarts so that its optimization does not change with the cluster;
DeepSpeed's rule (version 0.2) picks that batch from the micro-batch sizes, the
maximum batch, the GPU range, the GPUs per node and the model-parallel size.

:func:`plan_elastic` does both and prices the difference:

1. every count ``n`` of the range: :func:`plan_goodput` over the candidate
   batches; the per-count best is the best of that and of the plans at the
   DeepSpeed batches of step 3 (so it is never beaten at its count, and no
   price is negative);
2. for each model-parallel size ``mp`` that DeepSpeed v0.2 allows (a divisor of
   the GPUs per node), each ``prefer_larger_batch`` and each maximum batch (the
   given one and every per-count best batch: where a user would set
   ``max_train_batch_size``), the batch ``B_mp`` its rule returns,
   with the counts it is valid for (``n / mp`` among its data-parallel sizes);
3. every count planned at each ``B_mp`` (:func:`~pipedejavu.planning.training.
   plan_training`); each plan is checked against DeepSpeed's rule with its own
   model-parallel size (TP x pipeline stages) on the GPUs it uses
   (:func:`~pipedejavu.planning.deepspeed_elastic.is_valid_world_size`) and must fit in
   memory. Counts are whole nodes, but a plan may leave GPUs idle (with
   ``allow_fewer_gpus``, the default): a batch that does not split over all
   ``n`` GPUs (e.g. 3360 over 32) is planned on fewer (30 data-parallel
   replicas); the table shows the GPUs a plan uses when they are fewer;
4. the common batch is the ``B_mp`` valid for the most counts (all, when one
   is), then of largest mean goodput ratio to the per-count best; its *price*
   is ``1 -`` that ratio (mean and worst count). Counts it is not valid for are
   flagged (``deepspeed_valid``).

Plots (:func:`plot_elastic`) need matplotlib (``pip install pipedejavu[plot]``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning import deepspeed_elastic as elastic
from pipedejavu.planning.batch import (
    GoodputPlan,
    candidate_batches,
    efficiency,
    plan_goodput,
)
from pipedejavu.planning.deepspeed_elastic import is_valid_world_size
from pipedejavu.planning.training import plan_training

__all__ = [
    "CommonBatch",
    "ElasticRow",
    "ElasticPlan",
    "elastic_counts",
    "parse_gpu_range",
    "plan_elastic",
]

_RANGE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*:\s*(\d+)\s*\.\.\s*(\d+)\s*$")
#: Gradient statistics of efficiency 1 at every batch (throughput mode).
THROUGHPUT_ONLY = (0.0, 1.0)
#: The DeepSpeed version the rule is evaluated for (any >= 0.3.8 gives the same).
DEEPSPEED_VERSION = "0.16.5"


def parse_gpu_range(text: str) -> tuple[str, int, int]:
    """``"GH-96:16..128"`` -> ``("GH-96", 16, 128)``.

    Raises:
        ProblemError: not TYPE:LOW..HIGH with 1 <= LOW <= HIGH.
    """
    match = _RANGE.match(text)
    if not match or not 1 <= int(match.group(2)) <= int(match.group(3)):
        raise ProblemError(
            f"--gpus for --elastic must look like TYPE:LOW..HIGH with "
            f"1 <= LOW <= HIGH, e.g. GH-96:16..128; got {text!r}"
        )
    return match.group(1), int(match.group(2)), int(match.group(3))


def elastic_counts(low: int, high: int, step: int) -> list[int]:
    """Multiples of ``step`` (whole nodes) in ``[low, high]``.

    Raises:
        ProblemError: no multiple of ``step`` in the range.
    """
    first = -(-low // step) * step
    counts = list(range(first, high + 1, step))
    if not counts:
        raise ProblemError(
            f"no GPU count in [{low}, {high}] is a multiple of {step} (whole nodes)"
        )
    return counts


@dataclasses.dataclass(frozen=True, eq=False)
class ElasticRow:
    """One GPU count: its best plan and its plan at the common batch.

    Attributes:
        gpus: the GPU count.
        best: the per-count best (:class:`GoodputPlan`).
        common: the plan at the common batch (``TrainingPlan``), or ``None``.
        common_goodput: its goodput (throughput x efficiency), samples/s.
        common_valid: DeepSpeed's rule holds for the common batch on the GPUs
            the plan uses with its model-parallel size (TP x stages).
        deepspeed_valid: the count itself is among those DeepSpeed's rule made
            the common batch valid for (with the rule's model-parallel size).
    """

    gpus: int
    best: GoodputPlan
    common: Any
    common_goodput: float
    common_valid: bool
    deepspeed_valid: bool

    @property
    def common_throughput(self) -> float:
        if self.common is None:
            return 0.0
        return self.common.plan.gbs / self.common.iteration_time_s


@dataclasses.dataclass(frozen=True)
class CommonBatch:
    """DeepSpeed's v0.2 batch for one model-parallel size, and its price.

    Attributes:
        max_train_batch_size: the maximum given to the rule.
        model_parallel_size: the ``model_parallel_size`` given to the rule.
        prefer_larger: its ``prefer_larger_batch``.
        batch: the batch it returns, samples.
        valid_dp_sizes: the data-parallel sizes it is valid for.
        valid_for_all: valid for every count of the range.
        valid_counts: how many counts of the range it is valid for.
        mean_ratio: mean over counts of goodput at ``batch`` / per-count best
            (``None`` where not planned).
    """

    max_train_batch_size: int
    model_parallel_size: int
    prefer_larger: bool
    batch: int
    valid_dp_sizes: tuple[int, ...]
    valid_for_all: bool
    valid_counts: int
    mean_ratio: float | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ElasticPlan:
    """The result of :func:`plan_elastic`.

    Attributes:
        model, gpu_type: what was planned.
        micro_batch_sizes: the micro-batch sizes given to DeepSpeed's rule.
        max_global_batch: DeepSpeed's ``max_train_batch_size``.
        gpus_per_node: of the GPU type.
        grad_params, init_batch: the gradient statistics (``None``: throughput).
        rows: one :class:`ElasticRow` per count.
        candidates: DeepSpeed's batch per model-parallel size.
        common_batch: the chosen common batch (``None``: DeepSpeed's rule gave
            no batch).
        common_choice: the DeepSpeed setting that gave it.
    """

    model: str
    gpu_type: str
    micro_batch_sizes: tuple[int, ...]
    max_global_batch: int
    gpus_per_node: int
    grad_params: tuple[float, float] | None
    init_batch: int
    rows: tuple[ElasticRow, ...]
    candidates: tuple[CommonBatch, ...]
    common_batch: int | None
    common_choice: CommonBatch | None = None

    def price(self) -> tuple[float, float]:
        """(mean, worst) fraction of the per-count best goodput lost."""
        # The per-count best is the best plan considered there, the common
        # batch's included: no loss is negative.
        losses = [max(0.0, 1 - r.common_goodput / r.best.goodput) for r in self.rows]
        return float(np.mean(losses)), float(max(losses))

    def to_json(self) -> dict[str, Any]:
        mean, worst = self.price() if self.common_batch else (None, None)
        return {
            "model": self.model,
            "gpu_type": self.gpu_type,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "max_global_batch": self.max_global_batch,
            "gpus_per_node": self.gpus_per_node,
            "grad_params": None if self.grad_params is None else list(self.grad_params),
            "init_batch": self.init_batch,
            "common_batch": self.common_batch,
            "common_valid_for_all": None
            if self.common_choice is None
            else self.common_choice.valid_for_all,
            "price_mean": mean,
            "price_worst": worst,
            "deepspeed_candidates": [dataclasses.asdict(c) for c in self.candidates],
            "rows": [
                {
                    "gpus": r.gpus,
                    "best_batch": r.best.global_batch,
                    "best_plan": r.best.training.plan.describe(),
                    "best_throughput": r.best.throughput,
                    "best_goodput": r.best.goodput,
                    "common_plan": None
                    if r.common is None
                    else r.common.plan.describe(),
                    "common_model_parallel": None
                    if r.common is None
                    else _model_parallel(r.common),
                    "common_throughput": r.common_throughput,
                    "common_goodput": r.common_goodput,
                    "common_valid": r.common_valid,
                    "deepspeed_valid": r.deepspeed_valid,
                    "common_fits_memory": None
                    if r.common is None
                    else bool(r.common.prediction.fits_memory),
                }
                for r in self.rows
            ],
        }


def _model_parallel(training) -> int:
    plan = training.plan
    return plan.num_stages * plan.stages[0].replicas[0].tp


def _deepspeed_batch(
    mbs, max_batch, low, high, gpn, mp, prefer_larger
) -> tuple[int, tuple] | None:
    """DeepSpeed v0.2's (batch, valid dp sizes), or None where it has none.

    Only micro-batch sizes that fit a node's share of the maximum batch are
    given (DeepSpeed rejects the others).
    """

    usable = [m for m in mbs if m <= max_batch // max(gpn // mp, 1)]
    if not usable:
        return None
    try:
        batch, dp_sizes, _ = elastic._get_compatible_gpus_v02(
            usable,
            max_batch,
            low,
            min_gpus=low,
            max_gpus=high,
            prefer_larger=prefer_larger,
            num_gpus_per_node=gpn,
            model_parallel_size=mp,
        )
    except (elastic.ElasticityError, TypeError, ValueError):
        return None
    return int(batch), tuple(int(d) for d in dp_sizes)


def _plan_or_none(plan_training, model, pool, batch, options):
    try:
        return plan_training(model, pool, batch, **options)
    except InfeasibleProblemError:
        return None


def _best_of(best, index, plans_at, gain_at, grad, init) -> GoodputPlan:
    """``best``, or the plan of a DeepSpeed batch at this count that beats it."""
    for batch, plans in plans_at.items():
        plan = plans[index]
        if plan is None:
            continue
        throughput = batch / plan.iteration_time_s
        if throughput * gain_at[batch] > best.goodput:
            best = dataclasses.replace(
                best,
                training=plan,
                global_batch=batch,
                goodput=throughput * gain_at[batch],
                throughput=throughput,
                efficiency=gain_at[batch],
            )
    return best


def plan_elastic(
    model: str,
    gpu_type: str,
    counts: Sequence[int],
    max_global_batch: int,
    *,
    grad_params: Any = None,
    init_batch: int | None = None,
    batch_multiple: int | None = None,
    mbs_values: Sequence[int] | None = None,
    profiles: Any = None,
    constants: Any = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    progress_fn: Callable[[str], None] | None = None,
) -> ElasticPlan:
    """Best plan per GPU count, and DeepSpeed's common batch (module docstring).

    Args:
        model: the model's profile name.
        gpu_type: the GPU type of every count.
        counts: GPU counts (e.g. :func:`elastic_counts`).
        max_global_batch: the largest batch (DeepSpeed's max_train_batch_size).
        grad_params: ``(sqr, var)`` at ``init_batch`` (``None``: throughput).
        init_batch: smallest candidate batch (default: ``batch_multiple``).
        batch_multiple: step of the per-count candidates (default: the GPUs
            per node).
        mbs_values: micro-batch sizes (default: every profiled one).
        profiles, constants, method, uniform_tp, allow_fewer_gpus: as for
            :func:`~pipedejavu.planning.training.plan_training`.
        progress_fn: called with an estimate up front, a line per planned
            count and per DeepSpeed batch (with elapsed seconds and estimates).

    Raises:
        ProblemError: bad arguments; InfeasibleProblemError: a count has no plan.
    """

    data = load_sailor_data(profiles)
    gpn = data.gpu_spec(gpu_type).gpus_per_node
    profiled = sorted({m for m, _ in data.profile(model, gpu_type)})
    mbs = [m for m in profiled if mbs_values is None or m in mbs_values]
    if not mbs:
        raise ProblemError(
            f"no micro-batch size of {mbs_values} is profiled: {profiled}"
        )
    counts = sorted({int(n) for n in counts})
    if not counts or counts[0] < 1:
        raise ProblemError(f"GPU counts must be >= 1, got {counts}")
    step = batch_multiple or gpn
    init = init_batch or step
    grad = THROUGHPUT_ONLY if grad_params is None else grad_params
    say = progress_fn or (lambda line: None)
    options = dict(
        profiles=profiles,
        mbs_values=mbs,
        constants=constants,
        method=method,
        uniform_tp=uniform_tp,
        allow_fewer_gpus=allow_fewer_gpus,
    )

    candidate_batches(init, max_global_batch, step)  # refused before any work
    started = time.perf_counter()
    say(
        f"elastic mode: {model} on {gpu_type}, counts {counts}: {len(counts)} GPU "
        "counts; each searched over its candidate "
        f"batches (multiples of {step} up to {max_global_batch}), then every "
        "count planned at each DeepSpeed batch; estimates follow"
    )
    rows_best, plans_made = [], 0
    for done, n in enumerate(counts, 1):
        best = plan_goodput(
            model,
            {gpu_type: n},
            grad,
            init,
            max_global_batch,
            batch_multiple=step,
            **options,
        )
        plans_made += max(best.planned, 1)
        elapsed = time.perf_counter() - started
        left = elapsed / done * (len(counts) - done)
        say(
            f"[{done}/{len(counts)}] {n} GPUs: best batch {best.global_batch}, "
            f"{best.training.plan.describe()} ({elapsed:.0f} s, about {left:.0f} s "
            "left for the per-count search)"
        )
        rows_best.append(best)
    per_plan = (time.perf_counter() - started) / max(plans_made, 1)

    candidates = []
    limits = sorted({int(max_global_batch)} | {b.global_batch for b in rows_best})
    settings = [
        (limit, mp, prefer)
        for limit in limits
        for mp in range(1, gpn + 1)
        if gpn % mp == 0
        for prefer in (True, False)
    ]
    for limit, mp, prefer_larger in settings:
        found = _deepspeed_batch(
            mbs, limit, counts[0], counts[-1], gpn, mp, prefer_larger
        )
        if found is None:
            continue
        batch, dp_sizes = found
        valid = sum(n % mp == 0 and n // mp in dp_sizes for n in counts)
        candidates.append(
            CommonBatch(
                limit, mp, prefer_larger, batch, dp_sizes, valid == len(counts), valid
            )
        )
    batches = sorted({c.batch for c in candidates})
    say(
        f"{len(batches)} DeepSpeed batch(es) x {len(counts)} counts to plan, about "
        f"{per_plan * len(batches) * len(counts):.0f} s more "
        f"({per_plan:.2f} s per plan so far)"
    )
    plans_at = {}
    for index, batch in enumerate(batches, 1):
        plans_at[batch] = [
            _plan_or_none(plan_training, model, {gpu_type: n}, batch, options)
            for n in counts
        ]
        sizes = sorted({c.model_parallel_size for c in candidates if c.batch == batch})
        say(
            f"[{index}/{len(batches)}] DeepSpeed batch {batch} (model-parallel "
            f"size(s) {', '.join(map(str, sizes))}) planned at every count "
            f"({time.perf_counter() - started:.0f} s)"
        )

    gain_at = {batch: float(efficiency(grad, init, [batch])[0]) for batch in plans_at}
    # The per-count best is the best plan considered at the count: a DeepSpeed
    # batch off the candidate grid may beat the grid's best.
    rows_best = [
        _best_of(best, i, plans_at, gain_at, grad, init)
        for i, best in enumerate(rows_best)
    ]
    ratios = {}
    for batch, plans in plans_at.items():
        values = [
            0.0 if p is None else batch / p.iteration_time_s * gain_at[batch]
            for p in plans
        ]
        ratios[batch] = float(
            np.mean([v / b.goodput for v, b in zip(values, rows_best, strict=True)])
        )
    candidates = [
        dataclasses.replace(c, mean_ratio=ratios.get(c.batch)) for c in candidates
    ]
    # Valid for every count first (else for the most), then the best mean ratio.
    choice = (
        max(candidates, key=lambda c: (c.valid_counts, c.mean_ratio, -c.batch))
        if candidates
        else None
    )
    common = None if choice is None else choice.batch
    rows = []
    for i, (n, best) in enumerate(zip(counts, rows_best, strict=True)):
        plan = None if common is None else plans_at[common][i]
        value = (
            0.0 if plan is None else common / plan.iteration_time_s * gain_at[common]
        )
        valid = plan is not None and is_valid_world_size(
            common, mbs, plan.plan.num_gpus, _model_parallel(plan)
        )
        mp = 0 if choice is None else choice.model_parallel_size
        listed = mp and n % mp == 0 and n // mp in choice.valid_dp_sizes
        rows.append(ElasticRow(n, best, plan, value, bool(valid), bool(listed)))
    return ElasticPlan(
        model=model,
        gpu_type=gpu_type,
        micro_batch_sizes=tuple(mbs),
        max_global_batch=int(max_global_batch),
        gpus_per_node=gpn,
        grad_params=None if grad_params is None else tuple(map(float, grad)),
        init_batch=init,
        rows=tuple(rows),
        candidates=tuple(candidates),
        common_batch=common,
        common_choice=choice,
    )
