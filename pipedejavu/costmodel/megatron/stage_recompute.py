"""Per-stage recomputation: how many blocks each pipeline stage reruns.

Megatron-LM's ``--recompute-method block --recompute-num-layers N`` reruns the
first ``N`` blocks of every stage alike. Under 1F1B the first stage holds the
most micro-batches in flight and the last the fewest, so a count that lets the
first stage fit makes the later stages rerun blocks they could have kept
(AdaPipe, ASPLOS'24, re-balances for this). With
``TrainingOptions.recompute_choices`` each stage instead reruns the least of
those counts with which it fits its GPUs (:func:`stage_recompute_counts`).

Why the least one: a stage's count changes only its own backward time (more
blocks rerun, longer) and its own stash (more, smaller); the schedule's
command order does not depend on the times, so no stage or pipeline ends
later when one stage's backward is shorter. For a given plan the least fitting
count per stage is therefore the fastest assignment that fits
(``tests/test_stage_recompute.py`` checks it against every assignment). The
planning tables offer each count as a configuration of the stage
(:func:`~pipedejavu.costmodel.megatron.tables.compile_tables`), whose DP picks
the cheapest that fits its stages after it: the same count.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import kinds_of
from pipedejavu.costmodel.megatron.comm import node_key
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.rules import (
    buckets,
    expert_allreduce,
    expert_ring,
    memory_bytes,
    model_state_bytes,
    rank_expert_params,
    span_act_mem,
    stage_params,
    stash_bytes,
)
from pipedejavu.costmodel.megatron.sailor_data import ModelInfo, SailorData
from pipedejavu.simulation.zero_bubble import zero_bubble_in_flight

__all__ = [
    "as_layers",
    "bound_counts",
    "check_one_chunk",
    "ordered_choices",
    "rerun_count",
    "rerun_counts",
    "stage_in_flight",
    "stage_recompute_counts",
]


def rerun_count(info: ModelInfo, count: int | None) -> int:
    """A count as :func:`~pipedejavu.costmodel.megatron.rules.
    recomputed_layers` takes it: ``None`` (every block) as the model's layer
    count."""
    return int(info.num_layers if count is None else count)


def ordered_choices(choices: Sequence[int | None]) -> list[int | None]:
    """The counts from fewest blocks rerun to most (``None``, every block,
    last)."""
    some = sorted(n for n in choices if n is not None)
    return some + ([None] if None in choices else [])


def stage_in_flight(
    stage: int, num_stages: int, num_microbatches: int, zero_bubble: bool
) -> int:
    """The most micro-batches stage ``stage`` holds: ``min(P - s, M)`` under
    1F1B, ``min(P, M)`` under ZB-H1 (each schedule's simulated peak)."""
    if zero_bubble:
        return zero_bubble_in_flight(num_stages, num_microbatches)
    return min(num_stages - stage, num_microbatches)


def stage_recompute_counts(
    plan: Plan3D,
    data: SailorData,
    info: ModelInfo,
    constants: PredictorConstants,
    zero_bubble: bool,
) -> tuple[int | None, ...] | None:
    """Each stage's recomputed blocks under ``data.options``: the given
    ``recompute_stage_layers``, or the least ``recompute_choices`` count with
    which the stage fits its GPUs (the most when none does: the prediction
    then reports that it does not fit), or ``None`` (no per-stage counts).

    Raises:
        ProblemError: given counts for another number of stages.
    """
    options = data.options
    if options.recompute_stage_layers is not None:
        counts = options.recompute_stage_layers
        if len(counts) != plan.num_stages:
            raise ProblemError(
                f"recompute_stage_layers gives {len(counts)} counts for a plan of "
                f"{plan.num_stages} stages"
            )
        return tuple(counts)
    if options.recompute_choices is None:
        return None
    choices = ordered_choices(options.recompute_choices)
    out: list[int | None] = []
    for s, stage in enumerate(plan.stages):
        held = (
            stage_in_flight(s, plan.num_stages, plan.num_microbatches, zero_bubble)
            * plan.mbs
        )
        # what does not depend on the count: per TP degree, the model state
        # (a mixture of experts': theirs over expert data parallelism, their
        # largest bucket beside the dense ones, as the predictor's), the
        # input received and the GPU types
        kinds = []
        kinds_here = kinds_of(stage.replicas)
        for tp in sorted({kind.tp for kind in kinds_here}):
            params = stage_params(info, tp, stage.start, stage.stop)
            largest = max(buckets(info, tp, stage.start, stage.stop))
            span = ((stage.start, stage.stop),)
            experts, edp = rank_expert_params(info, tp, span), 1
            if experts:
                edp = plan.layout.edp(s)
                replicas = list(stage.replicas)
                nodes = [node_key(r, s, j) for j, r in enumerate(replicas)]
                members, ring = expert_ring(plan.layout, s, replicas, nodes)
                _, biggest = expert_allreduce(
                    data.network, info, tp, members, ring, span
                )
                largest = max(largest, biggest)
            state = model_state_bytes(info, params, largest, plan.dp, experts, edp)
            received = float(info.act_output[tp][stage.start - 1]) if s else 0.0
            gpus = sorted({k.gpu_type for k in kinds_here if k.tp == tp})
            kinds.append((tp, state, received, gpus))
        fitting = choices[-1]
        for n in choices:
            if _fits(stage, data, info, constants, kinds, held, rerun_count(info, n)):
                fitting = n
                break
        out.append(fitting)
    return tuple(out)


def _fits(stage, data, info, constants, kinds, held, layers) -> bool:
    """Whether every GPU of ``stage`` fits its memory with ``layers`` blocks
    rerun (the predictor's memory rule; ``kinds``: per TP degree its model
    state, input received and GPU types)."""
    for tp, state, received, gpus in kinds:
        act = span_act_mem(info, tp, stage.start, stage.stop, layers)
        stash = stash_bytes(info, act, received, held)
        for gpu in gpus:
            used = memory_bytes(state, stash, constants, gpu)
            if used > data.gpu_spec(gpu).memory_bytes:
                return False
    return True


def as_layers(info: ModelInfo, counts: Sequence[int | None] | None, stage: int):
    """Stage ``stage``'s count as :func:`~pipedejavu.costmodel.megatron.rules.
    recomputed_layers` takes it (``None``: the uniform rule)."""
    return None if counts is None else rerun_count(info, counts[stage])


def bound_counts(data: SailorData, info: ModelInfo) -> tuple:
    """``(least, most)``: the fewest and the most blocks any stage may rerun
    under per-stage recomputation (``(None, None)``: the options' one rule),
    as :func:`~pipedejavu.costmodel.megatron.rules.recomputed_layers` takes
    them. The proof's bounds price time with the least (no stage is faster)
    and memory with the most (no stage holds less)."""
    options = data.options
    counts = options.recompute_stage_layers
    if counts is None:
        counts = options.recompute_choices
    if counts is None:
        return None, None
    as_int = [rerun_count(info, n) for n in counts]
    return min(as_int), max(as_int)


def rerun_counts(data: SailorData, info: ModelInfo) -> list[int]:
    """The counts a stage may rerun under per-stage recomputation, fewest
    first, as :func:`~pipedejavu.costmodel.megatron.rules.recomputed_layers`
    takes them (every block: the model's layer count); ``[]`` without it."""
    choices = data.options.recompute_choices
    if choices is None:
        return []
    return [rerun_count(info, n) for n in ordered_choices(choices)]


def check_one_chunk(options, virtual_stages: int) -> None:
    """Per-stage counts price stages of one chunk per rank only."""
    if options.per_stage_recompute and virtual_stages > 1:
        raise ProblemError(
            "per-stage recomputation prices one model chunk per rank, not "
            f"{virtual_stages}"
        )
