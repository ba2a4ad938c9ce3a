"""Per-stage lower bounds on the predicted time, and the one-type branch and
bound of the proof (:mod:`pipedejavu.search.megatron.certify`, whose module
docstring derives the bounds).

Every term a bound reads is the predictor's own rule
(:mod:`pipedejavu.costmodel.megatron.rules`: parameters held, optimizer step,
buckets and their all-reduce, model state, stashed activations, reserve,
transfers), evaluated on all spans of layers at once; a bound relaxes only
what depends on the rest of the plan (placement, neighbours, the schedule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    RANK_ORDERS,
    Plan3D,
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
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.stage_recompute import bound_counts, rerun_counts
from pipedejavu.costmodel.megatron.tables import (
    plan_from_stages,
    span_allreduce,
    span_largest_bucket,
)
from pipedejavu.search.megatron.space import ConfigGroup, chain_counts
from pipedejavu.search.megatron.transfers import (
    BoundCache,
    Kind,
    SendRow,
    blocking_transfers,
    kind_times,
    layer_bounds,
    link_rows,
    links_key,
)

__all__ = [
    "EITHER_ORDER",
    "Incumbent",
    "StageBounds",
    "StageTable",
    "chains",
    "kind_bounds",
    "memory_counts",
    "single_plans",
    "span_capacity",
    "stage_bounds",
]

Table = NDArray[np.float64]
#: A ``rank_order`` for :func:`stage_bounds`: transfers and all-reduces least
#: over the placements of both :data:`~pipedejavu.core.plan3d.RANK_ORDERS`.
EITHER_ORDER = "either"


@dataclasses.dataclass
class Incumbent:
    """The best predicted time known; it falls as the proof finds better plans
    (the enumerations read it at each step)."""

    time_s: float


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
            backward ``B - k`` times).
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
    # after which no other stage waits: the gradient-chain, link and warm-up
    # bounds (1F1B's) are left out, the others hold (certify's docstring).
    zero_bubble = bool(data.options.zero_bubble)
    times = kind_times(data, model, constants, kinds, mbs)
    layers = layer_bounds(times, overhead)
    before_f, before_b, after_fb = layers
    starts, ends = np.nonzero(np.triu(np.ones((num_layers, num_layers), dtype=bool)))
    stops = ends + 1
    cache = BoundCache() if cache is None else cache  # shared by one proof
    priced_by = links_key(data, cache)
    transfers = blocking_transfers(
        data, model, constants, kinds, mbs, dp, cache, strides
    )
    sends, receives = transfers.sends, transfers.receives
    links = link_rows(transfers.links, layers, times, steps)
    if not with_sends or placed is not None or zero_bubble:  # the caller adds them
        sends = {kind: np.zeros_like(row) for kind, row in sends.items()}
    if placed is not None or zero_bubble:
        receives = {kind: np.zeros_like(row) for kind, row in receives.items()}
    later, earlier = later_pairs(receives)
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
        tail = sync + optimizer_time(float(entry.update[0]), held, info, t, dp)
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
        for rerun, kept in [bound_counts(data, info), *((n, n) for n in counts)]:
            compute = base + spans_recompute(info, entry, starts, stops, rerun)
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
            # The warm-up bound less k forwards (see StageBounds.weights; 1F1B's):
            # the first micro-batch's round trip crosses the boundary after
            # the stage both ways (pair_out), and each micro-batch's pairs
            # follow the first backward but those of the k warm-up forwards.
            if zero_bubble:
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
                )
            )
        out[kind] = built[0]._replace(variants=tuple(built[1:]) or None)
    return out


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
    bucket; ``layers``: blocks rerun, per-stage recomputation's count, by
    default its most)."""
    info = data.model_info(model)
    gpu, t = kind
    if layers is None:
        layers = bound_counts(data, info)[1]  # per-stage: the most reruns
    fits = in_flight_capacity(
        data.gpu_spec(gpu).memory_bytes,
        model_state_bytes(info, held, largest, dp),
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
    ``n`` stages after it holds ``min(n + 1, B)`` micro-batches), read off the
    stages' capacities alone: where it is ``False`` the group's bound on
    ``k`` stages is infinite, with no transfer, all-reduce or time table
    built. ``None`` with several TP degrees. ``cache``: the answer is kept by
    the source's, the constants' and the group's identity (both rank orders'
    proofs ask it), the reachability by the rule's digest (choices that differ
    in the schedule only ask the same)."""
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
    memory = np.full((num_layers, num_layers), -1, dtype=np.int64)
    # stages after it that a stage admits: any number once it holds all B
    memory[starts, ends] = np.where(cap >= group.steps, most, cap - 1)
    if cache is None:
        return chain_counts(memory, most)
    digest = (hashlib.blake2b(memory.tobytes(), digest_size=16).digest(), most)
    if digest not in cache.counts:
        cache.counts[digest] = chain_counts(memory, most)
    cache.fitting[key] = (data, constants, cache.counts[digest])  # ids kept
    return cache.counts[digest]


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


def stages_after(group: ConfigGroup, tp: int, left: int) -> tuple[int, int]:
    """Least and most stages after a stage at degree ``tp`` when it and the
    stages after it have ``left`` GPUs."""
    rest = left - tp
    return -(-rest // max(group.tps)), rest // min(group.tps)


class StageBounds:
    """A group's stage bounds for a stage with ``left`` GPUs for it and the
    stages after it (memory and the warm-up depend on how many follow)."""

    def __init__(
        self, group: ConfigGroup, tables: dict[int, StageTable], overhead: float
    ) -> None:
        self.group, self.tables, self.overhead = group, tables, overhead
        self._weights: dict[tuple[int, int, Any], Table] = {}
        self._chain_weights: dict[tuple[int, int], Table] = {}
        self._chain_g: dict[int, NDArray[np.float64]] = {}

    def weights(
        self, tp: int, left: int, send: tuple[Any, SendRow] | None = None
    ) -> Table:
        """``w[a, b]`` of a stage at degree ``tp`` followed by ``left - tp``
        GPUs of stages: ``inf`` where its memory cannot hold the micro-batches
        in flight. The warm-up bound: the stage's first backward waits for one
        micro-batch's forward to it (``F``), its own forward, the blocking
        pair over the boundary after it and the forward and backward of every
        layer after it (an overhead each per stage, and the least pair over
        each later boundary, ``StageTable.later``); before it the stage runs
        at most ``k = min(stages after + 1, B)`` forwards (the schedule's peak
        in flight), so ``B`` backwards, ``B - k`` forwards and their ``B - k``
        pairs over both boundaries follow (DeepSpeed's command stream:
        ``tests/test_megatron_certify.py`` checks the bound below every
        prediction). ``send``: ``(name, SendRow)`` for a known next stage: its
        blocking transfers added to the first bound, and its link's bound."""
        key = (tp, left, None if send is None else send[0])
        if key not in self._weights:
            table = self.tables[tp]
            fewest, k, crossed = self.warm_up(tp, left)
            need = min(fewest + 1, self.group.steps)
            # per-stage recomputation: the least over the counts that fit
            out = None
            for one in table.variants or (table,):
                bound = one.late + 2 * self.overhead * fewest
                bound -= k * one.fwd  # (in place: the bottleneck's hot loop)
                if crossed is not None:
                    bound += crossed[None, :]
                if send is None:
                    np.maximum(one.w, bound, out=bound)
                else:
                    add, link = send[1]
                    np.maximum(one.w + add[None, :], bound, out=bound)
                    np.maximum(bound, link[None, :], out=bound)
                np.putmask(bound, one.cap < need, np.inf)
                out = bound if out is None else np.minimum(out, bound, out=out)
            self._weights[key] = out
        return self._weights[key]

    def warm_up(
        self, tp: int, left: int
    ) -> tuple[int, int, NDArray[np.float64] | None]:
        """What the warm-up bound of a stage at degree ``tp`` with ``left``
        GPUs for it and the stages after reads of its position: the fewest
        stages after it, the most forwards ``k`` before its first backward,
        and by stop the pairs over the boundaries the round trip crosses after
        the next stage's (``None``: none counted)."""
        fewest, most = stages_after(self.group, tp, left)
        k = min(most + 1, self.group.steps)
        later = self.tables[tp].later
        crossed = None
        if fewest > 1 and later is not None:
            crossed = (fewest - 1) * later
        return fewest, k, crossed

    def row(
        self, tp: int, left: int, start: int, tails: Sequence[float] = ()
    ) -> NDArray[np.float64]:
        """``weights(tp, left)[start]``, and with ``tails`` (the
        :meth:`tail_after` of each stage before it, in order) at least the
        stage's gradient chain (``StageTable.chain``, and by the warm-up bound
        ``StageTable.warm_chain``) to an earlier stage ``r``, plus ``r``'s
        all-reduce and optimizer step, which follow its last backward.

        The chains count the layers' times and one overhead each way; the
        first forward crosses the ``n`` boundaries before the stage and runs
        on ``n`` stages, the last gradient crosses ``n - r`` boundaries back
        to ``r`` and runs backward on ``n - r`` stages, each with an overhead
        and (both ways over a boundary) at least its least blocking pair
        (``StageTable.earlier``)."""
        stage = self.weights(tp, left)[start]
        table = self.tables[tp]
        n = len(tails)
        if n == 0 or table.chain is None or start == 0:
            return stage
        pair = 0.0 if table.earlier is None else float(table.earlier[start])
        o = self.overhead
        # the largest tail and what the way to its stage crosses
        reach = max(
            tail + (n - r) * pair + (n - 1 + n - r - (r == 0)) * o
            for r, tail in enumerate(tails)
        )
        chain = table.chain[start]
        if table.warm_chain is not None:
            fewest, k, crossed = self.warm_up(tp, left)
            warm = table.warm_chain[start] + 2 * o * fewest
            warm -= k * table.fwd[start]
            if crossed is not None:
                warm += crossed
            chain = np.maximum(chain, warm)
        return np.maximum(stage, chain + reach)

    def tail_row(self, tp: int, start: int) -> NDArray[np.float64]:
        """:meth:`tail_after` of every stop at once (``-inf`` where not
        tabled; ``inf`` off the stages)."""
        table = self.tables[tp]
        if table.tail is None:
            return np.full(table.w.shape[1], -np.inf)
        back = 0.0 if table.back is None else float(table.back[start])
        return table.tail[start] - back

    def tail_after(self, tp: int, start: int, stop: int) -> float:
        """A stage ``start..stop - 1`` at degree ``tp``: its least all-reduce
        and optimizer step less the backward of the layers before it
        (``StageTable.back``), what a later stage's gradient chain to stage 0
        adds for it (:meth:`row`; ``-inf``: not tabled)."""
        table = self.tables[tp]
        if table.tail is None:
            return -math.inf
        back = 0.0 if table.back is None else float(table.back[start])
        return float(table.tail[start, stop]) - back

    def bottleneck(self, most_gpus: int, chain: bool = False) -> NDArray[np.float64]:
        """``g[u, p]``: the least ``max w`` over chains of stages covering
        layers ``p..`` to the end on exactly ``u`` GPUs (sum of the stages' TP
        degrees); with ``chain``, of their gradient chains instead
        (:meth:`chain_weights`: what :func:`chains` adds to the tails of the
        stages before ``p``)."""
        if chain and most_gpus in self._chain_g:
            return self._chain_g[most_gpus]
        weight = self.chain_weights if chain else self.weights
        size = next(iter(self.tables.values())).w.shape[0]
        g = np.full((most_gpus + 1, size), np.inf)
        g[0, size - 1] = -np.inf  # nothing left to cover, no GPU used
        for u in range(1, most_gpus + 1):
            best = g[u]
            for t in self.tables:
                # a stage a..b-1 at degree t, the rest from b on u - t GPUs
                # (none where no chain covers any rest on u - t GPUs: with one
                # degree, every u not a multiple of it)
                if t <= u and (g[u - t] < np.inf).any():
                    stage = weight(t, u)
                    rest = np.maximum(stage, g[u - t][None, :]).min(axis=1)
                    best = np.minimum(best, rest)
            g[u] = best
        if chain:
            self._chain_g[most_gpus] = g
        return g

    def chain_weights(self, tp: int, left: int) -> Table:
        """The gradient chains of :meth:`row` before the reach is added (the
        larger of ``StageTable.chain`` and the warm-up's), ``inf`` where
        :meth:`weights` is (memory), ``-inf`` where none is tabled."""
        key = (tp, left)
        if key not in self._chain_weights:
            table = self.tables[tp]
            stage = self.weights(tp, left)
            if table.chain is None:
                out = np.where(np.isinf(stage), stage, -np.inf)
            else:
                out = table.chain.copy()
                if table.warm_chain is not None:
                    fewest, k, crossed = self.warm_up(tp, left)
                    warm = table.warm_chain + 2 * self.overhead * fewest
                    warm -= k * table.fwd
                    if crossed is not None:
                        warm += crossed[None, :]
                    np.maximum(out, warm, out=out)
                out[0, :] = -np.inf  # stage 0 has no chain before it
                out[np.isposinf(stage)] = np.inf
            self._chain_weights[key] = out
        return self._chain_weights[key]

    def least_pair(self) -> float:
        """The least blocking pair over any boundary (``StageTable.earlier``
        at the last layer; 0 where none is tabled)."""
        least = [t.earlier[-1] for t in self.tables.values() if t.earlier is not None]
        return float(min(least)) if least else 0.0


def chains(
    bounds: StageBounds,
    g: NDArray[np.float64],
    size: int,
    best: Incumbent,
    least_first: bool = False,
) -> Iterator[list[tuple[int, int, int]]]:
    """Chains of ``(start, stop, tp)`` stages on exactly ``size`` GPUs whose every
    stage bound, and the bound of the rest, stay below ``best.time_s`` (read at
    each step: it falls as better plans are found). Depth first, the next
    stage shortest first (front stages hold the most micro-batches in flight
    under 1F1B: on GPT-3 175B this finds the best plans early, which lowers
    ``best``, a seventh of the plans against least bound first) or, with
    ``least_first``, of least bound (with the rest's) first: the first chain
    is then the bottleneck DP's."""
    last = g.shape[1] - 1
    top = float(g[size, 0])
    h = bounds.bottleneck(size, chain=True)
    pair, o = bounds.least_pair(), bounds.overhead
    stack: list[tuple[int, int, tuple, float, tuple]] = [(0, size, (), top, ())]
    while stack:
        start, left, stages, bound, tails = stack.pop()
        if bound >= best.time_s:
            continue
        if start == last:
            if left == 0:
                yield list(stages)
            continue
        # the stages after the next one: their gradient chains (h) plus the
        # least reach of the tails before them (StageBounds.row with the
        # least pair of any boundary)
        n = len(tails)
        earlier = max(
            (
                tail + (n + 1 - r) * pair + (2 * n + 1 - r - (r == 0)) * o
                for r, tail in enumerate(tails)
            ),
            default=-np.inf,
        )
        children = []
        for t in bounds.tables:
            if t > left:
                continue
            stage = bounds.row(t, left, start, tails)
            row = np.maximum(stage, g[left - t])
            reach = np.maximum(
                earlier, bounds.tail_row(t, start) + pair + (n + 1 - (n == 0)) * o
            )
            with np.errstate(invalid="ignore"):  # inf - inf: no such stage
                rest = h[left - t] + reach
            np.maximum(row, np.where(np.isnan(rest), np.inf, rest), out=row)
            for stop in np.flatnonzero(row < best.time_s).tolist()[::-1]:
                children.append((float(row[stop]), stop, t))
        if least_first:  # else the shortest is popped first
            children.sort(reverse=True)  # the least bound is popped first
        for value, stop, t in children:
            chain = (*stages, (start, stop, t))
            more = (*tails, bounds.tail_after(t, start, stop))
            stack.append((stop, left - t, chain, max(bound, value), more))


def single_plans(
    data: SailorData,
    model: str,
    gbs: int,
    group: ConfigGroup,
    bounds: StageBounds,
    g: NDArray[np.float64],
    size: int,
    best: Incumbent,
    rank_order: str = RANK_ORDERS[0],
    least_first: bool = False,
) -> Iterator[Plan3D]:
    """The plans of a one-type configuration left to predict, placed in
    ``rank_order`` (``least_first``: as :func:`chains`)."""
    spec = data.gpu_spec(group.gpu)
    for stages in chains(bounds, g, size, best, least_first):
        yield plan_from_stages(
            stages,
            gpu_type=group.gpu,
            dp=group.dp,
            mbs=group.mbs,
            gbs=gbs,
            model=model,
            gpus_per_node=spec.gpus_per_node,
            zone=DEFAULT_ZONE,
            rank_order=rank_order,
        )
