"""Compile a Megatron-style planning configuration into the planning model's tables.

One configuration fixes the GPU type, the micro-batch size ``mbs``, the number of
replicas ``dp`` (hence ``B = gbs / (mbs dp)`` micro-batches) and the TP degrees a
stage may use. The tables are those of :class:`pipedejavu.Problem`, indexed
``[i, j, m, 0]`` for the stage of layers ``i..j`` (inclusive) at the ``m``-th TP
degree:

* ``compute_cost``: the stage's busy time per micro-batch under the predictor
  (:mod:`pipedejavu.costmodel.megatron.predictor`): its layers' forward and
  backward (the affine-in-mbs profile), two instruction overheads, and - for each of its
  boundaries whose message blocks (larger than NCCL's buffer per GPU) - the
  activation and gradient transfer it takes part in;
* ``max_n_succ_stages``: how many stages may follow before the predicted memory
  of its in-flight micro-batches (``min(stages after + 1, B)``) exceeds the GPU;
* ``stage_tail_cost``: what it pays once after the pipeline - the tied-embedding
  all-reduce (a stage holding the first or the last layer, not both), its
  bucketed ring all-reduce over the ``dp`` replicas, and its optimizer step.

With these, ``sum c + (B - 1) max c + max tail`` is the planning objective of a
plan (the closed form of the pipeline; the predictor's simulation re-scores).

Placement (the canonical Megatron/DeepSpeed rank order: TP innermost, then
data, then pipeline; :func:`~pipedejavu.core.plan3d.canonical_nodes`): a stage
whose ``dp x tp`` GPUs fill whole nodes talks to its neighbours across nodes,
``gpus_per_node / tp`` replicas at once; a smaller stage shares its node with
its neighbours (intra-node links). The predictor prices each plan with its
exact placement.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.layout import ParallelLayout, StageAxes, experts_fit
from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    RANK_ORDERS,
    Plan3D,
    Replica,
    ReplicaRow,
    Stage3D,
    canonical_nodes,
    rank_nodes,
    replica_of,
)
from pipedejavu.core.validation import UNLIMITED_SUCCEEDING_STAGES
from pipedejavu.costmodel.megatron.comm import (
    p2p_time,
    ring_allreduce_times,
    ring_hops,
)
from pipedejavu.costmodel.megatron.constants import (
    BUCKET_ELEMENTS,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.rules import (
    add_to_bucket,
    expert_ring,
    gradient_sync,
    held_params,
    in_flight_capacity,
    is_blocking,
    message_bytes,
    model_state_bytes,
    optimizer_time,
    span_sums,
    spans_recompute,
    spans_stash,
    tied_allreduce_time,
)
from pipedejavu.costmodel.megatron.sailor_data import (
    ModelInfo,
    NetworkTables,
    SailorData,
)
from pipedejavu.costmodel.megatron.stage_recompute import rerun_counts

__all__ = [
    "StageTables",
    "boundary_time",
    "compile_tables",
    "plan_tables",
    "plan_from_mixed_stages",
    "plan_from_stages",
    "span_allreduce",
    "span_expert_allreduce",
    "span_expert_params",
    "span_largest_bucket",
    "stage_entry",
    "usable_degrees",
]


@dataclasses.dataclass(frozen=True, eq=False)
class StageTables:
    """The tables of one configuration (module docstring).

    Attributes:
        gpu_type, mbs, dp, num_microbatches: the configuration.
        tps: the TP degree of each submesh index ``m``.
        compute_cost: f64[L, L, M, K] seconds per micro-batch (inf: no stage);
            ``K = 1``, or with per-stage recomputation one configuration per
            count of ``options.recompute_choices``, fewest blocks first
            (:mod:`pipedejavu.costmodel.megatron.stage_recompute`).
        max_n_succ_stages: i64[L, L, M, K].
        stage_tail_cost: f64[L, L, M, K] seconds once per iteration.
        work: f64[L] the least GPU-seconds per micro-batch of each layer over the
            TP degrees (``tp x (forward + backward)``), for lower bounds.
    """

    gpu_type: str
    mbs: int
    dp: int
    num_microbatches: int
    tps: tuple[int, ...]
    compute_cost: NDArray[np.float64]
    max_n_succ_stages: NDArray[np.int64]
    stage_tail_cost: NDArray[np.float64]
    work: NDArray[np.float64]


def usable_degrees(
    data: SailorData, model: str, gpu: str, mbs: int, count: int | None = None
) -> list[int]:
    """The TP degrees a stage of ``model`` may have on ``gpu`` at ``mbs`` with
    ``count`` GPUs: profiled at that mbs, dividing the GPUs of a node, at most
    ``count`` (``None``: any)."""
    table = data.profile(model, gpu)
    gpn = data.gpu_spec(gpu).gpus_per_node
    return [
        t
        for t in data.model_info(model).tp_values
        if (mbs, t) in table and gpn % t == 0 and (count is None or t <= count)
    ]


def boundary_time(
    network: NetworkTables,
    gpu_type: str,
    tp: int,
    dp: int,
    gpus_per_node: int,
    nbytes: float,
    *,
    same_node: bool,
    zone: str,
) -> float:
    """The tables' price of one transfer over a boundary between two stages of
    ``tp`` on ``gpu_type``: ``gpus_per_node / tp`` replicas (at most ``dp``)
    move their tensors over one node pair at once."""
    replica = Replica(gpu_type, tp, zone=zone)
    concurrent = min(dp, max(gpus_per_node // tp, 1))
    return p2p_time(
        network, replica, replica, nbytes, same_node=same_node, concurrent=concurrent
    )


def plan_from_stages(
    stages: Sequence[tuple[int, int, int]],
    *,
    gpu_type: str,
    dp: int,
    mbs: int,
    gbs: int,
    model: str,
    gpus_per_node: int,
    zone: str,
    node_offset: int = 0,
    rank_order: str = RANK_ORDERS[0],
    experts: tuple[int, int | None] = (1, None),
) -> Plan3D:
    """A :class:`Plan3D` from ``(start, stop, tp)`` stages, placed in
    ``rank_order`` (:func:`~pipedejavu.core.plan3d.canonical_nodes`), its
    expert layers over ``experts`` = ``(ep, etp)`` (the costs'
    ``ModelInfo.expert_axes``)."""
    tps = [tp for _, _, tp in stages]
    nodes = canonical_nodes(tps, dp, gpus_per_node, rank_order)
    return Plan3D(
        stages=tuple(
            Stage3D(
                start,
                stop,
                ReplicaRow(
                    replica_of(gpu_type, tp, zone), [node_offset + n for n in nodes[s]]
                ),
            )
            for s, (start, stop, tp) in enumerate(stages)
        ),
        mbs=mbs,
        gbs=gbs,
        model=model,
        layout=ParallelLayout(
            tuple(StageAxes(tp, *experts) for tp in tps), dp, order=rank_order
        ),
    )


def plan_from_mixed_stages(
    stages: Sequence[tuple[int, int, int, str]],
    *,
    dp: int,
    mbs: int,
    gbs: int,
    model: str,
    pool: Mapping[str, int],
    gpus_per_node: Mapping[str, int],
    zone: str,
    experts: tuple[int, int | None] = (1, None),
) -> Plan3D:
    """A :class:`Plan3D` from ``(start, stop, tp, gpu_type)`` stages whose types
    may differ: each type's stages take its GPUs in Megatron's rank order (TP
    innermost, then data, then pipeline) on nodes of their own; the nodes are
    numbered type after type in the pool's order (``ceil(count / gpus per
    node)`` per type)."""
    bases, offset = {}, 0
    for gpu, count in pool.items():
        bases[gpu] = offset
        offset += -(-count // gpus_per_node[gpu])
    used = dict.fromkeys(pool, 0)
    out = []
    for start, stop, tp, gpu in stages:
        nodes = rank_nodes(used[gpu], dp, tp, gpus_per_node[gpu])
        replicas = ReplicaRow(
            replica_of(gpu, tp, zone), [bases[gpu] + n for n in nodes]
        )
        used[gpu] += dp * tp
        out.append(Stage3D(start, stop, replicas))
    layout = ParallelLayout(
        tuple(StageAxes(tp, *experts) for _, _, tp, _ in stages), dp
    )
    return Plan3D(stages=tuple(out), mbs=mbs, gbs=gbs, model=model, layout=layout)


def span_allreduce(
    hops,
    dp: int,
    info: ModelInfo,
    tp: int,
    held: NDArray[np.float64],
    starts: NDArray[np.int64],
    ends: NDArray[np.int64],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Seconds of the bucketed ring all-reduce over ``dp`` replicas (ring
    ``hops``) of each span ``starts[n]..ends[n]`` (inclusive; ``held``: its
    parameters), and its largest bucket (elements): DeepSpeed's buckets, whole
    layers added until a bucket holds more than ``BUCKET_ELEMENTS``
    (:func:`~pipedejavu.costmodel.megatron.rules.add_to_bucket`). A mixture
    of experts' expert parameters are not in it: they are reduced over the
    expert data-parallel GPUs (:func:`span_expert_allreduce`)."""
    held = held - span_expert_params(info, tp, starts, ends + 1)
    buckets = _span_buckets(info, tp, starts, ends)
    if buckets is None:  # one bucket per stage
        return ring_allreduce_times(hops, dp, held * info.gradient_bytes), held
    open_size, largest, closed_sizes, closed_span = buckets
    largest = largest.copy()
    allreduce = ring_allreduce_times(hops, dp, open_size * info.gradient_bytes)
    if len(closed_sizes):
        closed = ring_allreduce_times(hops, dp, closed_sizes * info.gradient_bytes)
        np.add.at(allreduce, closed_span, closed)
    return allreduce, largest


def span_expert_params(
    info: ModelInfo, tp: int, starts: NDArray[np.int64], stops: NDArray[np.int64]
) -> NDArray[np.float64] | float:
    """Expert parameters per GPU of each span ``starts[n]..stops[n] - 1`` (0
    for a dense model)."""
    if info.expert_params is None:
        return 0.0
    return span_sums(info.expert_params[tp], starts, stops)


def span_expert_largest_bucket(
    info: ModelInfo, tp: int, starts: NDArray[np.int64], ends: NDArray[np.int64]
) -> NDArray[np.float64] | float:
    """The largest bucket (elements) of each span's expert gradients
    (``starts[n]..ends[n]``, inclusive), filled as
    :func:`~pipedejavu.costmodel.megatron.rules.expert_allreduce` fills them;
    0 for a dense model."""
    if info.expert_params is None:
        return 0.0
    row = np.asarray(info.expert_params[tp], dtype=np.float64)
    if float(row.sum()) <= BUCKET_ELEMENTS:
        return span_sums(row, starts, ends + 1)
    return _buckets(
        row.tobytes(),
        float(row[-1]),
        np.asarray(starts, dtype=np.int64).tobytes(),
        np.asarray(ends, dtype=np.int64).tobytes(),
    )[1].copy()


def span_expert_allreduce(
    network,
    info: ModelInfo,
    gpu_type: str,
    tp: int,
    dp: int,
    gpus_per_node: int,
    experts: NDArray[np.float64] | float,
    zone: str,
) -> tuple[NDArray[np.float64] | float, int]:
    """``(seconds, edp)``: each span's expert gradients (``experts``
    elements per GPU) all-reduced over the expert data-parallel GPUs of a
    stage of ``tp x dp`` GPUs placed as the layout places them, in one bucket
    (no more than the predictor's buckets cost:
    :func:`~pipedejavu.costmodel.megatron.rules.expert_allreduce`); ``edp`` the
    expert data-parallel degree."""
    if info.expert_params is None:
        return 0.0, 1
    ep, etp = info.expert_axes
    if not experts_fit(tp, 1, dp, ep, etp):  # no such stage (config_groups)
        return np.inf, 1
    layout = ParallelLayout((StageAxes(tp, ep, etp),), dp)
    edp = layout.edp(0)
    if edp <= 1:
        return 0.0, edp
    nodes = canonical_nodes([tp], dp, gpus_per_node)[0]
    replicas = [Replica(gpu_type, tp, zone=zone)] * dp
    members, ring = expert_ring(layout, 0, replicas, nodes)
    hops = ring_hops(network, members, ring)
    nbytes = np.asarray(experts, dtype=np.float64) * info.gradient_bytes
    return ring_allreduce_times(hops, edp, nbytes), edp


def span_largest_bucket(
    info: ModelInfo,
    tp: int,
    held: NDArray[np.float64],
    starts: NDArray[np.int64],
    ends: NDArray[np.int64],
) -> NDArray[np.float64]:
    """The largest bucket (elements) of each span's all-reduce
    (:func:`span_allreduce`'s second value, which does not depend on the
    ring)."""
    buckets = _span_buckets(info, tp, starts, ends)
    return held if buckets is None else buckets[1].copy()


def _span_buckets(
    info: ModelInfo, tp: int, starts: NDArray[np.int64], ends: NDArray[np.int64]
) -> tuple[NDArray[np.float64], ...] | None:
    """:func:`_buckets` of the spans (``None``: the whole model fits one
    bucket, each span's is its parameters held)."""
    params = info.dense_params(tp)
    num_layers = len(params)
    if float(params.sum()) <= BUCKET_ELEMENTS:
        return None
    # the last layer of the span of every layer holds the tied embedding once
    whole_last = float(held_params(info, tp, 0, num_layers, float(params[-1])))
    return _buckets(
        np.asarray(params, dtype=np.float64).tobytes(),
        whole_last,
        np.asarray(starts, dtype=np.int64).tobytes(),
        np.asarray(ends, dtype=np.int64).tobytes(),
    )


@functools.lru_cache(maxsize=64)
def _buckets(
    params: bytes, whole_last: float, starts: bytes, ends: bytes
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64], NDArray]:
    """The buckets of every span (:func:`span_allreduce`), which depend on the
    layers' sizes and the spans only, not on the ring: ``(open bucket, largest
    bucket)`` per span and the closed buckets with their span's index.
    Cached: the proof asks again for every replica count and ring offset."""
    sizes = np.frombuffer(params, dtype=np.float64).tolist()
    num_layers = len(sizes)
    first = np.frombuffer(starts, dtype=np.int64).tolist()
    last = np.frombuffer(ends, dtype=np.int64).tolist()
    index = {(i, j): n for n, (i, j) in enumerate(zip(first, last, strict=True))}
    open_size, largest = np.zeros(len(first)), np.zeros(len(first))
    closed_sizes: list[float] = []
    closed_span: list[int] = []
    for i in range(num_layers):
        current, biggest = 0.0, 0.0
        done: list[float] = []
        for j in range(i, num_layers):
            size = whole_last if i == 0 and j == num_layers - 1 else sizes[j]
            current, closed = add_to_bucket(current, size)
            if closed:
                done.append(closed)
                biggest = max(biggest, closed)
            n = index[(i, j)]
            closed_sizes += done
            closed_span += [n] * len(done)
            open_size[n] = current
            largest[n] = max(biggest, current)
    for array in (open_size, largest):
        array.flags.writeable = False
    return (
        open_size,
        largest,
        np.array(closed_sizes, dtype=np.float64),
        np.array(closed_span, dtype=np.int64),
    )


def compile_tables(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    *,
    gpu_type: str,
    mbs: int,
    dp: int,
    num_microbatches: int,
    tps: Sequence[int],
    zone: str,
    pipeline_gpus: int | None = None,
) -> StageTables:
    """The tables of one configuration (module docstring).

    ``pipeline_gpus``: GPUs of one pipeline, when known. A stage of ``dp x tp <
    GPUs per node`` shares its node with its neighbours only while the whole
    pipeline's ``dp x pipeline_gpus`` fit on one node; beyond that some of its
    boundaries cross nodes, and the tables price every boundary as crossing
    (the predictor re-scores the exact placement).

    Raises:
        ProblemError: a TP degree or the mbs has no profile entry.
    """
    info = data.model_info(model)
    spec = data.gpu_spec(gpu_type)
    network = data.network
    num_layers = info.num_layers
    variants = _variants(data, info)
    shape = (num_layers, num_layers, len(tps), len(variants))
    cost = np.full(shape, np.inf)
    memory = np.full(shape, -1, dtype=np.int64)
    tail = np.zeros(shape)
    work = np.full(num_layers, np.inf)
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    starts, ends = np.nonzero(upper)
    overhead = constants.op_overhead_s
    gpn = spec.gpus_per_node
    for m, tp in enumerate(tps):
        times = data.layer_times(
            model, gpu_type, mbs, tp, smooth=constants.smooth_profiles
        )
        info.check_tp(tp)
        layer = times.forward + times.backward
        work = np.minimum(work, tp * layer)
        prefix = np.concatenate([[0.0], np.cumsum(layer)])
        base = prefix[ends + 1] - prefix[starts] + 2 * overhead
        busy = [
            base + spans_recompute(info, times, starts, ends + 1, n) for n in variants
        ]
        # Boundary b (after layer b): the transfer a stage takes part in.
        replica = Replica(gpu_type, tp, zone=zone)
        one_node = pipeline_gpus is not None and dp * pipeline_gpus <= gpn
        whole_nodes = dp * tp >= gpn or not one_node
        boundary = np.zeros(num_layers)
        for b in range(num_layers - 1):
            nbytes = float(message_bytes(info, tp, b, mbs))
            if is_blocking(nbytes, tp, tp, constants):
                boundary[b] = 2 * boundary_time(
                    network,
                    gpu_type,
                    tp,
                    dp,
                    gpn,
                    nbytes,
                    same_node=not whole_nodes,
                    zone=zone,
                )
        for k, row in enumerate(busy):
            row = row + np.where(starts > 0, boundary[starts - 1], 0.0)
            row = row + np.where(ends < num_layers - 1, boundary[ends], 0.0)
            cost[starts, ends, m, k] = row

        # Memory: model state + (1 + overhead) x in-flight stash + reserve.
        stops = ends + 1
        held = held_params(
            info, tp, starts, stops, span_sums(info.params[tp], starts, stops)
        )

        # Largest bucket, layer by layer, and the tail of each span.
        nodes = canonical_nodes([tp], dp, gpn)[0]
        replicas = [replica] * dp
        hops = ring_hops(network, replicas, nodes) if dp > 1 else []
        pair_nodes = [0, 0] if not whole_nodes else [0, 1]
        tied_time = tied_allreduce_time(network, info, replica, replica, pair_nodes)
        has_tie = (starts == 0) != (ends == num_layers - 1)
        allreduce, largest = span_allreduce(hops, dp, info, tp, held, starts, ends)
        experts = span_expert_params(info, tp, starts, stops)
        expert_sync, edp = span_expert_allreduce(
            network, info, gpu_type, tp, dp, gpn, experts, zone
        )
        allreduce = allreduce + expert_sync
        if edp > 1:  # a bucket only where they are all-reduced (the predictor's)
            largest = np.maximum(
                largest, span_expert_largest_bucket(info, tp, starts, ends)
            )
        optimizer = optimizer_time(
            float(times.update[0]), held, info, tp, dp, experts, edp
        )
        once = optimizer + np.where(has_tie, tied_time, 0.0)
        state = model_state_bytes(info, held, largest, dp, experts, edp)
        forward_prefix = np.concatenate([[0.0], np.cumsum(times.forward)])
        forward = forward_prefix[ends + 1] - forward_prefix[starts] + overhead
        for k, n in enumerate(variants):
            tail[starts, ends, m, k] = once + gradient_sync(
                allreduce,
                held,
                dp,
                busy[k] - forward,  # the span's backward pass, as the predictor's
                forward,
                data.options,
            )
            per_microbatch = spans_stash(info, tp, starts, stops, mbs, n)
            in_flight = in_flight_capacity(
                spec.memory_bytes, state, per_microbatch, constants, gpu_type
            )
            limit = np.where(
                in_flight >= min(num_microbatches, num_layers),
                UNLIMITED_SUCCEEDING_STAGES,
                in_flight - 1,
            )
            memory[starts, ends, m, k] = np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES)
    return StageTables(
        gpu_type=gpu_type,
        mbs=mbs,
        dp=dp,
        num_microbatches=num_microbatches,
        tps=tuple(tps),
        compute_cost=cost,
        max_n_succ_stages=memory,
        stage_tail_cost=tail,
        work=work,
    )


def _variants(data: SailorData, info: ModelInfo) -> list[int | None]:
    """The tables' configurations: ``[None]`` (the options' one rule), or
    each count of per-stage recomputation, fewest blocks first
    (:func:`~pipedejavu.costmodel.megatron.stage_recompute.rerun_counts`)."""
    return list(rerun_counts(data, info)) or [None]


def stage_entry(
    tables: StageTables, start: int, end: int, m: int, after: int
) -> tuple[float, float, bool]:
    """``(cost, tail, fits)`` of the stage of layers ``start..end`` at TP index
    ``m`` with ``after`` stages after it: its cheapest configuration whose
    memory allows that many (the last one, not fitting, when none does)."""
    memory = tables.max_n_succ_stages[start, end, m]
    cost = tables.compute_cost[start, end, m]
    fitting = [k for k in range(len(cost)) if after <= memory[k]]
    k = min(fitting, key=lambda i: cost[i]) if fitting else len(cost) - 1
    return (
        float(cost[k]),
        float(tables.stage_tail_cost[start, end, m, k]),
        bool(fitting),
    )


def plan_tables(
    data: SailorData, model: str, constants: PredictorConstants, plan: Plan3D
) -> tuple[StageTables, list[tuple[int, int, int]]]:
    """The tables of a one-type plan's configuration, as the search compiles
    them, and each stage's entry ``(start, end inclusive, TP-degree index)``."""
    gpu = plan.stages[0].replicas[0].gpu_type
    degrees = [stage.replicas[0].tp for stage in plan.stages]
    one_node = plan.dp * sum(degrees) <= data.gpu_spec(gpu).gpus_per_node
    tps = tuple(sorted(set(degrees)))
    tables = compile_tables(
        data,
        model,
        constants,
        gpu_type=gpu,
        mbs=plan.mbs,
        dp=plan.dp,
        num_microbatches=plan.num_microbatches,
        tps=tps,
        zone=DEFAULT_ZONE,
        pipeline_gpus=sum(degrees) if one_node else None,
    )
    spans = [
        (stage.start, stage.stop - 1, tps.index(tp))
        for stage, tp in zip(plan.stages, degrees, strict=True)
    ]
    return tables, spans
