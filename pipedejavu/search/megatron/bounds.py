"""Per-stage lower bounds on the predicted time: the tables of every span of
layers the proof reads (:mod:`pipedejavu.search.megatron.certify`, whose
module docstring derives the bounds; :mod:`~pipedejavu.search.megatron.chains`
reads them at each stage's position and enumerates the chains).

Every term a bound reads is the predictor's own rule
(:mod:`pipedejavu.costmodel.megatron.rules`: parameters held, optimizer step,
buckets and their all-reduce, model state, stashed activations, reserve,
transfers), evaluated on all spans of layers at once; a bound relaxes only
what depends on the rest of the plan (placement, neighbours, the schedule).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.layout import ParallelLayout, StageAxes
from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    RANK_ORDERS,
    Replica,
    rank_nodes,
)
from pipedejavu.costmodel.megatron.comm import ring_hops
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.rules import (
    held_params,
    in_flight_capacity,
    least_gradient_sync,
    model_state_bytes,
    optimizer_time,
    span_sums,
    spans_recompute,
    spans_stash,
)
from pipedejavu.costmodel.megatron.sailor_data import LayerTimes, ModelInfo, SailorData
from pipedejavu.costmodel.megatron.stage_recompute import bound_counts, rerun_counts
from pipedejavu.costmodel.megatron.tables import (
    span_allreduce,
    span_expert_largest_bucket,
    span_expert_params,
    span_largest_bucket,
)
from pipedejavu.search.megatron.space import (
    ConfigGroup,
    chain_counts,
    cover_counts,
    nested_capacities,
)
from pipedejavu.search.megatron.transfers import (
    BoundCache,
    Kind,
    blocking_transfers,
    kind_times,
    layer_bounds,
    link_rows,
    links_key,
)
from pipedejavu.search.megatron.zero_bubble_paths import PathTimes, path_times
from pipedejavu.simulation.zero_bubble import zero_bubble_in_flight

__all__ = [
    "EITHER_ORDER",
    "StageTable",
    "kind_bounds",
    "least_rerun",
    "later_pairs",
    "memory_counts",
    "span_capacity",
    "span_experts",
    "stage_bounds",
    "zero_bubble_round_trip",
]

Table = NDArray[np.float64]
#: A ``rank_order`` for :func:`stage_bounds`: transfers and all-reduces least
#: over the placements of both :data:`~pipedejavu.core.plan3d.RANK_ORDERS`.
EITHER_ORDER = "either"


class StageTable(NamedTuple):
    """Bounds of a stage of layers ``a..b-1`` of one kind, ``[a, b]`` indexed
    (``f64[L + 1, L + 1]``).

    Attributes:
        w: the first lower bound of the proof (``inf`` off the upper triangle).
        cap: how many micro-batches in flight fit in its GPUs' memory beside
            its model state (at most ``B``; ``-1``: not even the model state).
        late, fwd: the parts of the warm-up bound, ``late - k fwd`` with ``k``
            forwards before the first backward (``fwd``: a forward and the
            blocking pairs over both boundaries, which follow the first
            backward ``B - k`` times). Under ZB-H1 the round trip's backward
            is the input gradients ``B`` (:func:`zero_bubble_round_trip`).
        variants: with per-stage recomputation, the tables of each count of
            blocks rerun (this table relaxes them all: the fewest reruns'
            time, the most reruns' memory); ``None`` otherwise.
        chain: where stage 0's last backward ends at the earliest, by this
            stage's (``F + B busy - r + G``; ``-inf`` under ZB-H1, which has
            no gradient chain bound); :func:`chains` adds stage 0's own tail.
        warm_chain: the same by the warm-up bound, ``late`` with ``G`` for
            the stage's tail, before the ``k fwd`` and the stages after are
            counted (:meth:`StageBounds.row`).
        back: ``G`` by first layer (``f64[L + 1]``): the backward of the
            layers before it, plus an overhead.
        earlier: by first layer ``a`` (``f64[L + 1]``), the least blocking
            pair over a boundary before it: each stage before adds one to the
            first forward's way there and the last gradient's way back
            (:meth:`StageBounds.row`; 0 under ZB-H1 and in placed tables).
        rerun: the least a stage holding a block adds to its backward by
            Megatron's block method (the least block's forward, when every
            stage reruns at least one; else 0): each stage the first
            micro-batch's way back and the last gradient's run through adds
            it (:meth:`StageBounds.warm_up`).
        recomputed: what the block method adds to each micro-batch's backward
            of the stage (the fewest reruns' under per-stage recomputation):
            the last gradient's way back through a known stage adds it
            (:meth:`StageBounds.row`).
        tail: the stage's all-reduce and optimizer step (least over its
            placements).
        later: by stop ``b`` (``f64[L + 1]``), the least blocking pair over a
            boundary after the next stage's first layer: what each stage after
            the next adds to the warm-up bound's round trip (0 where no
            such boundary; under ZB-H1 and placed tables, 0).
    """

    w: Table
    cap: Table
    late: Table
    fwd: Table
    variants: tuple[StageTable, ...] | None = None
    chain: Table | None = None
    tail: Table | None = None
    later: NDArray[np.float64] | None = None
    warm_chain: Table | None = None
    back: NDArray[np.float64] | None = None
    earlier: NDArray[np.float64] | None = None
    rerun: float = 0.0
    recomputed: Table | None = None
    paths: PathTimes | None = None


def stage_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: ConfigGroup,
    cache: BoundCache | None = None,
    rank_order: str = RANK_ORDERS[0],
) -> dict[int, StageTable]:
    """``{tp: StageTable}`` of the group's GPU type (:func:`kind_bounds`) for
    plans placed in ``rank_order`` (``tp-pp-dp``: the transfers and all-reduces
    least over the group's pipeline sizes as strides; :data:`EITHER_ORDER`:
    least over both orders' placements, a bound on the plans of both)."""
    kinds = [(group.gpu, t) for t in group.tps]
    strides: tuple[int | None, ...] | None = None
    if rank_order == RANK_ORDERS[1]:
        strides = tuple(group.sizes)
    elif rank_order == EITHER_ORDER:
        strides = (None, *group.sizes)
    out = kind_bounds(
        data,
        model,
        constants,
        kinds,
        group.mbs,
        group.dp,
        group.steps,
        cache,
        strides=strides,
    )
    return {t: out[(group.gpu, t)] for t in group.tps}


def kind_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[Kind],
    mbs: int,
    dp: int,
    steps: int,
    cache: BoundCache | None = None,
    *,
    with_sends: bool = True,
    placed: dict[str, int] | None = None,
    strides: tuple[int | None, ...] | None = None,
) -> dict[Kind, StageTable]:
    """``{(gpu, tp): StageTable}`` for a stage of each kind (GPU type, TP
    degree) that stages of a plan may have. The layers before and after a
    stage are counted at the fastest kind. ``placed``: ``{type: rank}`` where a
    type's stage starts (its all-reduce priced there exactly); ``w`` then
    leaves out the blocking transfers on both sides, which the caller adds for
    known neighbours. ``strides``: the ``tp-pp-dp`` rank order
    (:func:`~pipedejavu.search.megatron.transfers.blocking_transfers`; a
    ``None`` among them: Megatron's default order too)."""
    info = data.model_info(model)
    num_layers = info.num_layers
    overhead = constants.op_overhead_s
    # ZB-H1 (the source's options): sends do not block, each stage runs a third
    # command per micro-batch, and a stage's last command may be a W pass
    # after which no other stage waits: the gradient-chain and link bounds
    # (1F1B's) are left out, the warm-up's round trip is forward and input
    # gradient (zero_bubble_round_trip), the others hold (certify's docstring).
    zero_bubble = bool(data.options.zero_bubble)
    times = kind_times(data, model, constants, kinds, mbs)
    layers = layer_bounds(times, overhead)
    before_f, before_b, after_fb = layers
    if zero_bubble:
        after_fb = zero_bubble_round_trip(times)
    starts, ends = np.nonzero(np.triu(np.ones((num_layers, num_layers), dtype=bool)))
    stops = ends + 1
    cache = BoundCache() if cache is None else cache  # shared by one proof
    priced_by = links_key(data, cache)
    transfers = blocking_transfers(
        data, model, constants, kinds, mbs, dp, cache, strides
    )
    sends, receives = transfers.sends, transfers.receives
    hops = {k: float(row.min(initial=np.inf)) / 2 for k, row in receives.items()}
    links = link_rows(transfers.links, layers, times, steps)
    if not with_sends or placed is not None or zero_bubble:  # the caller adds them
        sends = {kind: np.zeros_like(row) for kind, row in sends.items()}
    if placed is not None or zero_bubble:
        receives = {kind: np.zeros_like(row) for kind, row in receives.items()}
    later, earlier = later_pairs(receives)
    least_block = least_rerun(data, info, times)
    out = {}
    for kind in kinds:
        gpu, t = kind
        spec = data.gpu_spec(gpu)
        entry = times[kind]
        stage_f = span_sums(entry.forward, starts, stops) + overhead
        base = span_sums(entry.forward + entry.backward, starts, stops)
        pair_in = np.where(starts > 0, receives[kind][np.maximum(starts - 1, 0)], 0.0)
        pair_out = np.where(
            stops < num_layers, sends[kind][np.minimum(ends, num_layers - 2)], 0.0
        )
        held = held_params(
            info, t, starts, stops, span_sums(info.params[t], starts, stops)
        )
        # The least all-reduce over the offsets the stage can have in a node
        # (or at the one it has).
        spots = None if placed is None else (placed[gpu] % spec.gpus_per_node,)
        key = (
            gpu,
            t,
            dp,
            spots,
            strides,
            priced_by,
            info.gradient_bytes,
            hash(held.tobytes()),
            hash(info.params[t].tobytes()),  # the buckets follow the layers
        )
        if key not in cache.allreduce:
            cache.allreduce[key] = least_allreduce(
                data, model, gpu, t, dp, held, starts, ends, spots, strides
            )
        allreduce, largest = cache.allreduce[key]
        sync = least_gradient_sync(allreduce, held, dp, data.options)
        experts, edp = span_experts(info, t, dp, starts, stops)
        step = optimizer_time(float(entry.update[0]), held, info, t, dp, experts, edp)
        tail = sync + step
        last = tail if zero_bubble else np.maximum(tail, before_b[starts])
        if with_sends and not zero_bubble:  # the boundary after the stage
            least_link = np.min([links[(kind, other)] for other in kinds], axis=0)
        else:
            least_link = None

        # per-stage recomputation: the relaxed table (the fewest reruns' time,
        # the most reruns' memory) and one per count, which StageBounds reads
        # at each position (the least count that fits it there); else one
        # table with the options' own rule
        counts = rerun_counts(data, info)
        # what the counts do not change, shared by their tables (read only)
        shape = (num_layers + 1, num_layers + 1)
        fwd, after = np.zeros(shape), np.full(shape, np.inf)
        pairs = pair_in + pair_out  # 0 under ZB-H1 and in placed tables
        fwd[starts, stops] = stage_f + pairs
        after[starts, stops] = tail
        built = []
        paths = None
        for rerun, kept in [bound_counts(data, info), *((n, n) for n in counts)]:
            again = spans_recompute(info, entry, starts, stops, rerun)
            if zero_bubble and paths is None and entry.weight_grad is not None:
                paths = path_times(entry, starts, stops, again, overhead, hops[kind])
            recomputed = np.zeros(shape)
            recomputed[starts, stops] = again
            compute = base + again
            compute = compute + (3 if zero_bubble else 2) * overhead
            busy = compute + pair_in
            busy += pair_out
            fits = span_capacity(
                data, model, constants, kind, mbs, dp, steps, (starts, stops),
                held, largest, kept,
            )  # fmt: skip
            # The gradient of the last micro-batch goes back over the boundary
            # before the stage after its last backward, which ends the stage's
            # pipeline for the predictor: one receive pair less (found on
            # OPT-350, 3 stages on one A100-40 node: the bound was one transfer
            # too high).
            head = before_f[starts] + steps * busy - pair_in
            w, cap = np.full(shape, np.inf), np.full(shape, -1.0)
            late = np.full(shape, np.inf)
            w[starts, stops] = head + last
            if least_link is not None:
                w = np.maximum(w, least_link[None, :])
            cap[starts, stops] = fits
            # The warm-up bound less k forwards (see StageBounds.weights): the
            # first micro-batch's round trip crosses the boundary after the
            # stage both ways (pair_out), and each micro-batch's pairs follow
            # the first backward but those of the k warm-up forwards (1F1B's;
            # under ZB-H1 no pairs, the round trip's backward is B alone, and
            # every B and W follows the first B: zero_bubble_round_trip).
            if after_fb is None:  # ZB-H1 on times that do not split backward
                late[starts, stops] = -np.inf
            else:
                late[starts, stops] = (
                    before_f[starts]
                    + stage_f
                    + pair_out
                    + after_fb[stops]
                    + steps * (compute + pairs)
                    + last
                )
            chain = np.full(shape, -np.inf)
            warm_chain = np.full(shape, -np.inf)
            if not zero_bubble:
                chain[starts, stops] = head + before_b[starts]
                warm_chain[starts, stops] = (
                    late[starts, stops] - last + before_b[starts]
                )
            built.append(
                StageTable(
                    w,
                    cap,
                    late,
                    fwd,
                    chain=chain,
                    tail=after,
                    later=later,
                    warm_chain=warm_chain,
                    back=before_b,
                    earlier=earlier,
                    rerun=least_block,
                    recomputed=recomputed,
                )
            )
        out[kind] = built[0]._replace(variants=tuple(built[1:]) or None, paths=paths)
    return out


def zero_bubble_round_trip(
    times: Mapping[Kind, LayerTimes],
) -> NDArray[np.float64] | None:
    """ZB-H1's ``StageTable.late`` round trip by stop ``b`` (``f64[L + 1]``):
    the forward and the input gradient ``B`` (the backward less its weight
    gradient, :func:`~pipedejavu.costmodel.megatron.zero_bubble.
    stage_weight_grad`; any recomputation stays in it) of every layer from
    ``b`` on, least over the kinds. A stage's first ``B`` waits for the first
    micro-batch's forward through the stages after it and their ``B`` back
    (:func:`~pipedejavu.simulation.zero_bubble.zero_bubble_order`: each rank
    runs its commands in order, the first ``B`` after ``min(P - r, M)``
    forwards, every ``B`` and ``W`` after it). ``None`` where a kind's times
    do not split the backward (the predictor refuses those plans)."""
    if any(x.weight_grad is None for x in times.values()):
        return None
    fastest = np.min(
        [x.forward + x.backward - x.weight_grad for x in times.values()], axis=0
    )
    return np.concatenate([np.cumsum(fastest[::-1])[::-1], [0.0]])


def least_rerun(
    data: SailorData, info: ModelInfo, times: Mapping[Kind, LayerTimes]
) -> float:
    """``StageTable.rerun``: with Megatron's block method (or per-stage
    recomputation whose fewest reruns are at least one block), the least
    forward of a block any kind reruns; 0 otherwise."""
    least = bound_counts(data, info)[0]
    if least is None:
        least = info.recompute_layers
    if not least or info.blocks is None:
        return 0.0
    first, stop = info.blocks
    reruns = [
        x.recompute[first:stop] for x in times.values() if x.recompute is not None
    ]
    if not reruns or stop <= first:
        return 0.0
    return float(min(np.min(each) for each in reruns))


def later_pairs(
    receives: dict[Kind, NDArray[np.float64]],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``(StageTable.later, StageTable.earlier)``: by stop ``b``, the least
    blocking pair (any kind, any pipeline) over the boundaries after layers
    ``b..L - 2``; by start ``a``, over those after layers ``0..a - 1``; 0
    where there is none."""
    least = np.min(list(receives.values()), axis=0)  # f64[L - 1]
    suffix = np.minimum.accumulate(least[::-1])[::-1]
    prefix = np.minimum.accumulate(least)
    return (
        np.concatenate([suffix, [0.0, 0.0]]),
        np.concatenate([[0.0], prefix, [prefix[-1] if len(prefix) else 0.0]]),
    )


def span_experts(
    info: ModelInfo,
    tp: int,
    dp: int,
    starts: NDArray[np.int64],
    stops: NDArray[np.int64],
) -> tuple[NDArray[np.float64] | float, int]:
    """``(experts, edp)``: each span's expert parameters per GPU at degree
    ``tp`` and the expert data-parallel degree of a stage of ``tp x dp`` GPUs
    (:meth:`~pipedejavu.core.layout.ParallelLayout.edp` of the costs' EP and
    expert TP), over which the predictor shards the experts' optimizer state
    and step (:func:`~pipedejavu.costmodel.megatron.rules.model_state_bytes`,
    :func:`~pipedejavu.costmodel.megatron.rules.optimizer_time`; 0 and 1 for
    a dense model)."""
    if info.expert_params is None:
        return 0.0, 1
    ep, etp = info.expert_axes
    edp = ParallelLayout((StageAxes(tp, ep, etp),), dp).edp(0)
    return span_expert_params(info, tp, starts, stops), edp


def span_capacity(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kind: Kind,
    mbs: int,
    dp: int,
    steps: int,
    spans: tuple[NDArray[np.int64], NDArray[np.int64]],
    held: NDArray[np.float64],
    largest: NDArray[np.float64],
    layers: int | None = None,
) -> NDArray[np.float64]:
    """How many micro-batches' stashes fit beside the model state of each span
    ``starts[n]..stops[n] - 1`` (``spans``) of layers on a GPU of ``kind`` (at
    most ``steps``; -1: not even the model state): the predictor's memory
    rules (``held``: the span's parameters per GPU, ``largest``: its largest
    bucket of dense gradients; ``layers``: blocks rerun, per-stage
    recomputation's count, by default its most). A mixture of experts' state
    is the predictor's: the experts' share sharded over the expert
    data-parallel degree (:func:`span_experts`), their largest bucket counted
    where they are all-reduced (``edp > 1``)."""
    info = data.model_info(model)
    gpu, t = kind
    if layers is None:
        layers = bound_counts(data, info)[1]  # per-stage: the most reruns
    starts, stops = spans
    experts, edp = span_experts(info, t, dp, starts, stops)
    if edp > 1:
        expert_bucket = span_expert_largest_bucket(info, t, starts, stops - 1)
        largest = np.maximum(largest, expert_bucket)
    fits = in_flight_capacity(
        data.gpu_spec(gpu).memory_bytes,
        model_state_bytes(info, held, largest, dp, experts, edp),
        spans_stash(info, t, *spans, mbs, layers),
        constants,
        gpu,
    )
    return np.minimum(fits, float(steps))


def memory_counts(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: ConfigGroup,
    cache: BoundCache | None = None,
) -> NDArray[np.bool_] | None:
    """``fits[k]``: some chain of exactly ``k`` stages of a one-degree group
    meets the proof's memory rule (:meth:`StageBounds.weights`: a stage with
    ``n`` stages after it holds ``min(n + 1, B)`` micro-batches; under ZB-H1
    every stage of ``k`` holds ``min(k, B)``, :meth:`StageBounds.pipeline`),
    read off the stages' capacities alone: where it is ``False`` the group's
    bound on ``k`` stages is infinite, with no transfer, all-reduce or time
    table built. ``None`` with several TP degrees. ``cache``: the answer is
    kept by the source's, the constants' and the group's identity (both rank
    orders' proofs ask it), the reachability by the rule's digest (choices
    that differ in the schedule only ask the same)."""
    if len(group.tps) != 1:
        return None
    key = (id(data), model, id(constants), group)
    if cache is not None and key in cache.fitting:
        return cache.fitting[key][2]
    (t,) = group.tps
    info = data.model_info(model)
    num_layers = info.num_layers
    starts, ends = np.nonzero(np.triu(np.ones((num_layers, num_layers), dtype=bool)))
    stops = ends + 1
    held = held_params(info, t, starts, stops, span_sums(info.params[t], starts, stops))
    largest = span_largest_bucket(info, t, held, starts, ends)
    cap = span_capacity(
        data,
        model,
        constants,
        (group.gpu, t),
        group.mbs,
        group.dp,
        group.steps,
        (starts, stops),
        held,
        largest,
    )
    most = max(group.sizes) // t

    def reachable(admits: NDArray[np.float64]) -> NDArray[np.bool_]:
        """:func:`chain_counts` of the stages after each span admits."""
        memory = np.full((num_layers, num_layers), -1, dtype=np.int64)
        memory[starts, ends] = admits
        if cache is None:
            return chain_counts(memory, most)
        digest = (hashlib.blake2b(memory.tobytes(), digest_size=16).digest(), most)
        if digest not in cache.counts:
            cache.counts[digest] = chain_counts(memory, most)
        return cache.counts[digest]

    if data.options.zero_bubble:
        # every stage of k holds min(k, B): per count, the spans that hold it
        # admit any number of stages after them, the others none
        fits = np.zeros(most + 1, dtype=bool)
        needs = [zero_bubble_in_flight(k, group.steps) for k in range(1, most + 1)]
        table = np.full((num_layers, num_layers), -1.0)
        table[starts, ends] = cap
        nested = nested_capacities(table)
        for need in sorted(set(needs)):
            if nested:
                counts = cover_counts(table, need, most)
            else:
                counts = reachable(np.where(cap >= need, most, -1))
            for k, asked in enumerate(needs, start=1):
                if asked == need:
                    fits[k] = counts[k]
    else:
        # stages after it that a stage admits: any number once it holds all B
        fits = reachable(np.where(cap >= group.steps, most, cap - 1))
    if cache is not None:
        cache.fitting[key] = (data, constants, fits)  # ids kept
    return fits


def least_allreduce(
    data: SailorData,
    model: str,
    gpu: str,
    tp: int,
    dp: int,
    held: NDArray[np.float64],
    starts: NDArray[np.int64],
    ends: NDArray[np.int64],
    spots: tuple[int, ...] | None,
    strides: tuple[int | None, ...] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The bucketed all-reduce of every span, least over the offsets of its
    replicas within a node (``spots``; ``None``: every offset) and, in the
    ``tp-pp-dp`` rank order, over the ``strides`` between them (a pipeline's
    GPUs; ``None``: the default order's), and its largest bucket."""
    info = data.model_info(model)
    gpn = data.gpu_spec(gpu).gpus_per_node
    replicas = [Replica(gpu, tp, zone=DEFAULT_ZONE)] * dp
    allreduce, largest, seen = None, None, set()
    placements = [
        (offset, stride)
        for offset in (range(gpn) if spots is None else spots)
        for stride in (strides or (None,))
    ]
    for offset, stride in placements:
        nodes = rank_nodes(offset, dp, tp, gpn, stride)
        hops = ring_hops(data.network, replicas, nodes) if dp > 1 else []
        if tuple(hops) in seen:
            continue
        seen.add(tuple(hops))
        times, largest = span_allreduce(hops, dp, info, tp, held, starts, ends)
        allreduce = times if allreduce is None else np.minimum(allreduce, times)
    return allreduce, largest
