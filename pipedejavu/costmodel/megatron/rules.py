"""The Megatron-style predictor's rules, each defined once.

:func:`~pipedejavu.costmodel.megatron.predictor.predict_plan` scores one plan
with them; :func:`~pipedejavu.costmodel.megatron.tables.compile_tables` and the
proof's bounds (:mod:`pipedejavu.search.megatron.bounds`) evaluate the same
functions on every span of layers at once (numpy arrays in place of floats),
so a change of a rule or of a constant reaches the prediction, the planning
tables and the proof together (``tests/test_megatron_rules.py``).

Spans: ``starts``/``stops`` are the first layer and one past the last one;
``layer_sum`` is what the caller summed over the span's layers (the predictor
sums one slice, the tables difference prefix sums).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import Replica
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.comm import p2p_time, ring_allreduce_time, ring_hops
from pipedejavu.costmodel.megatron.constants import (
    BUCKET_ELEMENTS,
    FLOAT_BYTES,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.options import (
    optimizer_update_fraction,
    param_gather_share,
)
from pipedejavu.costmodel.megatron.sailor_data import (
    LayerTimes,
    ModelInfo,
    NetworkTables,
)

__all__ = [
    "add_to_bucket",
    "buckets",
    "expert_allreduce",
    "expert_ring",
    "fill_buckets",
    "gradient_sync",
    "held_params",
    "in_flight_capacity",
    "least_gradient_sync",
    "is_blocking",
    "memory_bytes",
    "message_bytes",
    "model_state_bytes",
    "rank_expert_params",
    "optimizer_share",
    "optimizer_time",
    "overlap_bucket_elements",
    "p2p_pair",
    "profiling_params",
    "recomputed_layers",
    "span_act_mem",
    "span_backward",
    "span_sums",
    "spans_act_mem",
    "spans_recompute",
    "spans_stash",
    "stage_allreduce",
    "stage_params",
    "state_terms",
    "stash_bytes",
    "tied_allreduce_time",
]

Number = Any  # a float, or an array of one value per span


# ------------------------------------------------------------- parameters
def span_sums(
    values: NDArray[np.float64], starts: NDArray[np.int64], stops: NDArray[np.int64]
) -> NDArray[np.float64]:
    """The sum of ``values[a:b]`` for every span (prefix-sum differences)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[stops] - prefix[starts]


def held_params(
    info: ModelInfo, tp: int, starts: Number, stops: Number, layer_sum: Number
) -> Number:
    """Parameters per GPU a stage holds: its layers' (``layer_sum``), the tied
    embedding once when the stage holds both the first and the last layer."""
    whole = np.logical_and(np.equal(starts, 0), np.equal(stops, info.num_layers))
    return layer_sum - np.where(whole, info.tied_params(tp), 0.0)


def stage_params(info: ModelInfo, tp: int, start: int, stop: int) -> float:
    """:func:`held_params` of one stage."""
    return rank_params(info, tp, ((start, stop),))


def rank_params(info: ModelInfo, tp: int, spans: Sequence[tuple[int, int]]) -> float:
    """Parameters per GPU of a rank holding the layer ``spans`` (one stage:
    one span; a ZB-V rank: its two chunks): theirs, the tied embedding once
    when it holds both the first and the last layer."""
    total = sum(float(info.params[tp][a:b].sum()) for a, b in spans)
    first = any(a == 0 for a, _ in spans)
    last = any(b == info.num_layers for _, b in spans)
    return float(total - info.tied_params(tp)) if first and last else total


def profiling_params(info: ModelInfo, tp: int) -> float:
    """Parameters of the profile's two-transformer-layer model (embedding, two
    layers, head; the tied embedding once): what its optimizer time updates."""
    params = info.params[tp]
    return float(params[0] + params[1] + params[2] + params[-1]) - info.tied_params(tp)


def optimizer_share(info: ModelInfo, dp: Number = 1) -> Number:
    """The share of its stage's parameters a GPU's optimizer step updates:
    ``1 / dp`` with the distributed optimizer (each replica steps its shard),
    1 without."""
    return optimizer_update_fraction(info.distributed_optimizer, dp)


def optimizer_time(
    update_s: float,
    held: Number,
    info: ModelInfo,
    tp: int,
    dp: Number = 1,
    expert_held: Number = 0.0,
    edp: Number = 1,
) -> Number:
    """Adam's step on ``held`` parameters: memory-bound, so the profile's step
    (``update_s``) scaled by the parameters it updates
    (:func:`optimizer_share` of them: of the ``expert_held`` experts', over
    the ``edp`` expert data-parallel GPUs)."""
    updated = (held - expert_held) * optimizer_share(info, dp)
    updated = updated + expert_held * optimizer_share(info, edp)
    return update_s * updated / profiling_params(info, tp)


# ------------------------------------------------ data-parallel gradient sync
def overlap_bucket_elements(dp: Number) -> Number:
    """Elements of a gradient bucket with Megatron-LM's
    ``--overlap-grad-reduce``: ``max(40M, 1M x DP)`` (its
    ``DistributedDataParallel`` default; read in core_v0.16.1)."""
    return np.maximum(4e7, 1e6 * np.asarray(dp, dtype=np.float64))


def gradient_sync(
    allreduce: Number,
    held: Number,
    dp: Number,
    backward: Number,
    forward: Number,
    options: TrainingOptions,
) -> Number:
    """Seconds of a stage's data-parallel gradient sync that its iteration
    waits for: all of ``allreduce`` (the ring all-reduce of its gradients),
    unless overlapped.

    With the distributed optimizer the all-reduce is a reduce-scatter of the
    gradients before the optimizer step, half its time, and an all-gather of
    the parameters after it, that time scaled by the bytes gathered over those
    reduced (:func:`~pipedejavu.costmodel.megatron.options.param_gather_share`:
    bf16 weights gathered, fp32 gradients reduced: half). ``options``'
    ``overlap_grad_reduce`` (Megatron-LM's ``--overlap-grad-reduce``): the
    reduction runs beside the stage's last backward pass (``backward``, one
    micro-batch's), bucket by bucket as the gradients come, and only what
    outlasts that pass is waited for, never less than its last bucket
    (``held`` parameters in buckets of :func:`overlap_bucket_elements`).
    ``overlap_param_gather`` (``--overlap-param-gather``): the all-gather runs
    beside the next iteration's first forward pass (``forward``) the same
    way. With infinite passes only the last bucket's share is left: the
    proof's lower bound of this (:func:`least_gradient_sync`).
    """
    distributed = options.distributed_optimizer
    grad = allreduce / 2 if distributed else allreduce
    share = 0.0
    if distributed:
        share = param_gather_share(
            options.precision, bf16_grads=options.grad_reduce_in_bf16
        )
    gather = grad * share
    last = np.minimum(1.0, overlap_bucket_elements(dp) / np.maximum(held, 1.0))
    if options.overlap_grad_reduce:
        grad = np.maximum(grad - backward, grad * last)
    if options.overlap_param_gather:
        gather = np.maximum(gather - forward, gather * last)
    return grad + gather


def least_gradient_sync(
    allreduce: Number, held: Number, dp: Number, options: TrainingOptions
) -> Number:
    """The least of :func:`gradient_sync` over every pass it may overlap (the
    passes taken as long as any): the proof's bound of it."""
    return gradient_sync(allreduce, held, dp, np.inf, np.inf, options)


# ------------------------------------------- recomputation (block method)
def recomputed_layers(
    info: ModelInfo, starts: Number, stops: Number, layers: Number | None = None
) -> tuple:
    """``(a, b)``: the layers ``[a, b)`` of each span ``starts..stops-1`` (a
    stage, or a model chunk) that Megatron's ``block`` method recomputes: its
    first ``info.recompute_layers`` transformer blocks, or ``layers`` of them
    (per span; per-stage recomputation) when given (``a == b``: none, or no
    partial recomputation priced)."""
    count = info.recompute_layers if layers is None else layers
    if count is None or info.blocks is None:
        return starts, starts
    first = np.maximum(starts, info.blocks[0])
    end = np.minimum(stops, info.blocks[1])
    some = first < end
    a = np.where(some, first, starts)
    b = np.where(some, np.minimum(end, first + count), starts)
    return a, b


def span_backward(
    info: ModelInfo, times: LayerTimes, start: int, stop: int, layers=None
) -> float:
    """Seconds of the backward passes of layers ``start..stop-1`` (one stage
    or model chunk), with the forwards :func:`recomputed_layers` reruns
    (``layers``: as there)."""
    total = float(times.backward[start:stop].sum())
    a, b = recomputed_layers(info, start, stop, layers)
    if b > a and times.recompute is not None:
        total += float(times.recompute[a:b].sum())
    return total


def span_act_mem(info: ModelInfo, tp: int, start: int, stop: int, layers=None) -> float:
    """Floats (at mbs 1) that layers ``start..stop-1`` of one stage or model
    chunk keep for their backward: ``act_mem``, but a layer
    :func:`recomputed_layers` reruns keeps only ``recomputed_mem``."""
    total = float(info.act_mem[tp][start:stop].sum())
    a, b = recomputed_layers(info, start, stop, layers)
    if b > a and info.recomputed_mem is not None:
        kept = info.recomputed_mem[tp][a:b].sum() - info.act_mem[tp][a:b].sum()
        total += float(kept)
    return total


def spans_recompute(
    info: ModelInfo,
    times: LayerTimes,
    starts: NDArray[np.int64],
    stops: NDArray[np.int64],
    layers=None,
) -> NDArray[np.float64]:
    """:func:`span_backward`'s recomputation of every span at once (the
    tables' and bounds' form; zeros without the block method)."""
    if times.recompute is None:
        return np.zeros(len(starts))
    a, b = recomputed_layers(info, starts, stops, layers)
    return span_sums(times.recompute, a, b)


def spans_act_mem(
    info: ModelInfo,
    tp: int,
    starts: NDArray[np.int64],
    stops: NDArray[np.int64],
    layers=None,
) -> NDArray[np.float64]:
    """:func:`span_act_mem` of every span at once."""
    total = span_sums(info.act_mem[tp], starts, stops)
    if info.recomputed_mem is None:
        return total
    a, b = recomputed_layers(info, starts, stops, layers)
    return total + span_sums(info.recomputed_mem[tp] - info.act_mem[tp], a, b)


def spans_stash(
    info: ModelInfo,
    tp: int,
    starts: NDArray[np.int64],
    stops: NDArray[np.int64],
    mbs: int,
    layers=None,
) -> NDArray[np.float64]:
    """:func:`stash_bytes` of one micro-batch of ``mbs`` samples on every span
    at once: its :func:`spans_act_mem` and the input it received (the
    tables' and bounds' form of the predictor's stage stash)."""
    received = np.where(starts > 0, info.act_output[tp][np.maximum(starts - 1, 0)], 0.0)
    act = spans_act_mem(info, tp, starts, stops, layers)
    return stash_bytes(info, act, received, mbs)


# ----------------------------------------------------------------- buckets
def add_to_bucket(current: float, size: float) -> tuple[float, float]:
    """DeepSpeed's gradient buckets: whole tensors (here layers) are added
    until a bucket holds more than ``BUCKET_ELEMENTS``. Returns ``(open bucket,
    closed bucket)`` after adding ``size`` (0: none closed)."""
    current += size
    if current > BUCKET_ELEMENTS:
        return 0.0, current
    return current, 0.0


def fill_buckets(sizes) -> list[float]:
    """The buckets (elements) layers of ``sizes`` fill, in order, by
    :func:`add_to_bucket`."""
    out, current = [], 0.0
    for size in sizes:
        current, closed = add_to_bucket(current, size)
        if closed:
            out.append(closed)
    if current > 0:
        out.append(current)
    return out


def layer_sizes(info: ModelInfo, tp: int, start: int, stop: int) -> list[float]:
    """Parameters per layer of a stage, the tied embedding once (taken off its
    last layer when it holds every layer)."""
    sizes = [float(x) for x in info.dense_params(tp)[start:stop]]
    sizes[-1] = float(held_params(info, tp, start, stop, sizes[-1]))
    return sizes


def buckets(
    info: ModelInfo, tp: int, start: int, stop: int, more: Sequence = ()
) -> list[float]:
    """The stage's all-reduce buckets (elements), filled by
    :func:`add_to_bucket`; ``more``: further ``(start, stop)`` spans the rank
    holds (a ZB-V rank's second chunk), filled after the first."""
    spans = ((start, stop), *more)
    sizes = [s for a, b in spans for s in layer_sizes(info, tp, a, b)]
    first = any(a == 0 for a, _ in spans)
    if more and first and any(b == info.num_layers for _, b in spans):
        sizes[-1] -= float(info.tied_params(tp))  # the tied embedding once
    return fill_buckets(sizes)


# ------------------------------------------------------------------ memory
#: The model state's parts (:func:`state_terms`), and which of them each ZeRO
#: stage shards.
STATE_TERMS = ("parameters", "gradients", "optimizer")
_SHARDED = {0: (), 1: ("optimizer",), 2: ("gradients", "optimizer"), 3: STATE_TERMS}


def state_terms(
    info: ModelInfo,
    held: Number,
    dp: Number = 1,
    expert_held: Number = 0.0,
    edp: Number = 1,
) -> dict[str, Number]:
    """The weights, gradients and optimizer state a GPU holds of ``held``
    parameters: ``info.weight_bytes`` (fp32 shards at ZeRO-3, FSDP2's),
    ``info.gradient_bytes`` and the rest of ``info``'s bytes per parameter
    (fp32 master weights, Adam's moments), each replicated or, as
    ``info.zero_stage`` shards it (``_SHARDED``), divided over the ``dp``
    replicas of a shard group (the ``expert_held`` of them that are experts'
    over the ``edp`` expert data-parallel GPUs)."""
    total = info.state_bytes_per_param + info.sharded_state_bytes_per_param
    weight = FLOAT_BYTES if info.zero_stage == 3 else info.weight_bytes
    per_param = {
        "parameters": weight,
        "gradients": info.gradient_bytes,
        "optimizer": total - weight - info.gradient_bytes,
    }
    dense = held - expert_held
    share = dense / dp + expert_held / edp
    sharded = _SHARDED[info.zero_stage]
    return {
        name: per_param[name] * (share if name in sharded else held)
        for name in STATE_TERMS
    }


def model_state_bytes(
    info: ModelInfo,
    held: Number,
    largest_bucket: Number,
    dp: Number = 1,
    expert_held: Number = 0.0,
    edp: Number = 1,
) -> Number:
    """Weights, gradients and optimizer state (:func:`state_terms`: 16 bytes
    per parameter for fp32 Adam, the sharded parts divided over the ``dp``
    replicas of a shard group or the ``edp`` expert data-parallel GPUs) and
    the largest bucket, which DeepSpeed flattens into a new buffer of
    gradient elements."""
    terms = state_terms(info, held, dp, expert_held, edp)
    return sum(terms.values()) + info.gradient_bytes * largest_bucket


def stash_bytes(
    info: ModelInfo, act_elements: Number, received_elements: Number, count: Number
) -> Number:
    """Activations ``count`` micro-batch samples stash on a stage (``count``:
    micro-batches in flight x ``mbs``): its layers' ``act_mem`` and the input it
    received (0 on the first stage), ``info.activation_bytes`` each."""
    return count * (act_elements + received_elements) * info.activation_bytes


def memory_bytes(
    state: Number, stash: Number, constants: PredictorConstants, gpu_type: str
) -> Number:
    """Device memory of a GPU: model state, the stashed activations with their
    overhead (temporaries, allocator), the type's reserve."""
    return (
        state
        + (1.0 + constants.activation_overhead) * stash
        + constants.reserve(gpu_type)
    )


def in_flight_capacity(
    limit_bytes: float,
    state: Number,
    stash_per_microbatch: Number,
    constants: PredictorConstants,
    gpu_type: str,
) -> Number:
    """The most micro-batches in flight whose :func:`memory_bytes` stays within
    ``limit_bytes`` (-1: not even the model state fits)."""
    room = limit_bytes - constants.reserve(gpu_type) - state
    per_microbatch = (1.0 + constants.activation_overhead) * stash_per_microbatch
    fits = np.floor(room / np.maximum(per_microbatch, 1e-30))
    return np.maximum(fits, -1.0)


# --------------------------------------------------------------- transfers
def message_bytes(info: ModelInfo, tp: int, last_layer: Any, mbs: int) -> Number:
    """Bytes a boundary after ``last_layer`` moves per micro-batch (the output
    activation, or its gradient, ``info.activation_bytes`` an element)."""
    output = np.asarray(info.act_output[tp], dtype=float)[last_layer]
    return output * mbs * info.activation_bytes


def is_blocking(
    nbytes: Number, sender_tp: int, receiver_tp: int, constants: PredictorConstants
) -> Number:
    """A message of more than ``buffered_message_bytes`` per sending GPU (the
    tensor is split over ``min(tp)`` GPUs) is a rendezvous."""
    return nbytes / min(sender_tp, receiver_tp) > constants.buffered_message_bytes


def p2p_pair(
    network: NetworkTables,
    sender: Replica,
    receiver: Replica,
    nbytes: float,
    *,
    same_node: bool,
    concurrent: int,
) -> tuple[float, float]:
    """``(activation, gradient)`` seconds over a boundary: the activation from
    ``sender`` to ``receiver``, its gradient back."""
    there = p2p_time(
        network, sender, receiver, nbytes, same_node=same_node, concurrent=concurrent
    )
    back = p2p_time(
        network, receiver, sender, nbytes, same_node=same_node, concurrent=concurrent
    )
    return there, back


def tied_allreduce_time(
    network: NetworkTables,
    info: ModelInfo,
    first: Replica,
    last: Replica,
    nodes: list,
) -> float:
    """The word-embedding gradient all-reduced between a pipeline's first and
    last stage (on ``nodes``)."""
    nbytes = info.tied_params(first.tp) * info.gradient_bytes
    return ring_allreduce_time(network, [first, last], nodes, nbytes)


def rank_expert_params(
    info: ModelInfo, tp: int, spans: Sequence[tuple[int, int]]
) -> float:
    """Expert parameters per GPU of a rank holding the layer ``spans`` (0 for
    a dense model)."""
    if info.expert_params is None:
        return 0.0
    return sum(float(info.expert_params[tp][a:b].sum()) for a, b in spans)


def expert_ring(
    layout: Any, stage: int, replicas: Sequence[Replica], nodes: Sequence
) -> tuple[list[Replica], list]:
    """The expert data-parallel ring of ``stage`` of a ``layout``
    (:class:`~pipedejavu.core.layout.ParallelLayout`) whose replicas are
    ``replicas`` on ``nodes``: one member per block of ``etp x ep`` GPUs (a
    :class:`Replica` of that many GPUs, where the block's first GPU is) and
    its node."""
    owners = layout.expert_replicas(stage)
    block = layout.expert_block(stage)
    members = [_with_tp(replicas[j], block) for j in owners]
    return members, [nodes[j] for j in owners]


@functools.lru_cache(maxsize=4096)
def _with_tp(replica: Replica, tp: int) -> Replica:
    """``replica`` with ``tp`` GPUs (frozen: shared by every ring that asks)."""
    return dataclasses.replace(replica, tp=tp)


def expert_buckets(
    info: ModelInfo, tp: int, spans: Sequence[tuple[int, int]]
) -> list[float]:
    """The expert gradients' all-reduce buckets (elements) of a rank at TP
    ``tp`` holding the layer ``spans``, filled by :func:`add_to_bucket`."""
    if info.expert_params is None:
        return []
    row = info.expert_params[tp]
    return fill_buckets(float(x) for a, b in spans for x in row[a:b])


def expert_allreduce(
    network: NetworkTables,
    info: ModelInfo,
    tp: int,
    members: list[Replica],
    nodes: list,
    spans: Sequence[tuple[int, int]],
) -> tuple[float, float]:
    """``(seconds, largest bucket)``: the expert gradients of a rank at TP
    ``tp`` holding the layer ``spans``, all-reduced over the expert
    data-parallel ``members`` (one per block of ``etp x ep`` GPUs, that many
    as the member's ``tp``: their rings run side by side, one per GPU of a
    block) in buckets filled by :func:`add_to_bucket`."""
    if info.expert_params is None or len(members) <= 1:
        return 0.0, 0.0
    out = expert_buckets(info, tp, spans)
    hops = ring_hops(network, members, nodes)
    seconds = sum(
        ring_allreduce_time(
            network, members, nodes, elements * info.gradient_bytes, hops=hops
        )
        for elements in out
    )
    return seconds, max(out, default=0.0)


def stage_allreduce(
    network: NetworkTables,
    info: ModelInfo,
    replicas: Sequence[Replica],
    nodes: list,
    start: int,
    stop: int,
    more: Sequence = (),
) -> tuple[float, float]:
    """``(seconds, largest bucket)``: the data-parallel all-reduce of a stage
    of layers ``start..stop-1`` (and the spans ``more``, as :func:`buckets`)
    over its ``replicas`` (on ``nodes``), one ring per :func:`buckets` entry,
    and that entry's largest (elements)."""
    tp = replicas[0].tp
    sizes = buckets(info, tp, start, stop, more)
    hops = ring_hops(network, replicas, nodes) if len(replicas) > 1 else []
    seconds = sum(
        ring_allreduce_time(
            network, replicas, nodes, elements * info.gradient_bytes, hops=hops
        )
        for elements in sizes
    )
    return seconds, max(sizes)
