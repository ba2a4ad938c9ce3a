"""The pipeline phase of a plan under Megatron-LM's interleaved 1F1B schedule.

With ``V > 1`` model chunks per pipeline rank (``--num-layers-per-virtual-
pipeline-stage``), Megatron-LM splits the transformer blocks into ``P V`` equal
chunks (or, with ``--pipeline-model-parallel-layout``, the chunks it spells
out, of any sizes) and gives rank ``r`` the chunks ``r, r + P, ..., r + (V -
1) P``; the embedding belongs to chunk 0 and the final norm with the LM head
(and the MTP depths) to chunk ``P V - 1``. A plan for it is a
:class:`~pipedejavu.core.plan3d.Plan3D` of ``P`` stages (the ranks); its
stages' layer ranges are then only the per-rank totals, and
:func:`chunk_layers` gives each rank's chunks: of an even split, or of the
virtual stages' sizes a layout gives.

:func:`interleaved_pipelines` times every pipeline on
:func:`~pipedejavu.simulation.interleaved.simulate_interleaved`: a chunk's
forward (backward) is the sum of its layers' times plus the per-instruction
overhead; the transfer over link ``r -> r + 1`` (and the wrap-around ``P - 1 ->
0``) is the slower of the activation and the gradient priced as for the
non-interleaved schedule; a chunk's stash per micro-batch is its layers'
``act_mem`` and the input it received.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.layout import PIPELINE_SPLITS, split_blocks
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.long_pipelines import (
    PipelineSummary,
    pipeline_summary,
)
from pipedejavu.costmodel.megatron.rules import (
    message_bytes,
    span_act_mem,
    span_backward,
    stash_bytes,
)
from pipedejavu.costmodel.megatron.sailor_data import LayerTimes, ModelInfo
from pipedejavu.costmodel.megatron.zero_bubble import stage_weight_grad
from pipedejavu.simulation.interleaved import (
    InterleavedResult,
    peak_in_flight_count,
    simulate_interleaved,
)
from pipedejavu.simulation.timeline import Bar, timeline_bars
from pipedejavu.simulation.zero_bubble import (
    ZeroBubbleResult,
    simulate_zero_bubble,
    zero_bubble_warmup,
)

__all__ = [
    "InterleavedPipelines",
    "chunk_layers",
    "chunk_stash",
    "interleaved_pipelines",
    "profile_chunks",
    "rank_layers",
    "virtual_stage_layers",
    "warmup_stash",
]


def profile_chunks(blocks: Sequence[int]) -> list[int]:
    """Profile layers of each virtual stage holding ``blocks`` transformer
    layers (in virtual-stage order): the embedding is the first profile layer
    and the head (with the MTP depths) the last, so the first virtual stage
    holds one more, and the last one more (a stage of no blocks, a layout's
    ``"mL"``, holds the head alone)."""
    last = len(blocks) - 1
    return [held + (k == 0) + (k == last) for k, held in enumerate(blocks)]


def virtual_stage_layers(
    blocks: int, stages: int, embedding: bool = False, loss: bool = False
) -> list[int] | None:
    """Profile layers of each of ``stages`` virtual stages (in virtual-stage
    order) when ``blocks`` transformer layers split evenly as Megatron-LM
    splits them: equal blocks, or with ``--account-for-embedding-in-pipeline-
    split`` (``embedding``) / ``--account-for-loss-in-pipeline-split``
    (``loss``) the embedding (the loss) counted as one layer of the first
    (last) virtual stage (:func:`profile_chunks`). ``None``: they do not
    split evenly."""
    held = split_blocks(blocks, stages, embedding, loss)
    return None if held is None else profile_chunks(held)


def chunk_layers(
    plan: Plan3D,
    num_chunks: int,
    v_shape: bool = False,
    sizes: Sequence[int] | None = None,
) -> list[list[tuple[int, int]]]:
    """``[rank][chunk] -> (start, stop)`` profile layers of each model chunk:
    chunk ``c`` of rank ``r`` is virtual stage ``c P + r``, or with
    ``v_shape`` (two chunks, ZB-V) ``r`` and ``2 P - 1 - r``: rank 0 then
    holds the embedding and the head.

    ``sizes``: the transformer layers of each virtual stage, in their order
    (a ``--pipeline-model-parallel-layout``'s, any counts: :func:`profile_chunks`
    adds the embedding and the head). Without them the virtual stages split
    the layers evenly as Megatron-LM does (:func:`virtual_stage_layers`):
    equal transformer layers, or, where the plan's stages hold what that
    gives, the embedding and/or the loss counted as a layer
    (``--account-for-embedding/loss-in-pipeline-split``; the default split is
    read first where both fit).

    Raises:
        ProblemError: the layers do not split into ``P V`` even model chunks
            the plan's stages hold, or ``sizes`` are not ``P V`` counts of the
            plan's blocks whose chunks its stages hold.
    """
    if v_shape and num_chunks != 2:
        raise ProblemError(f"the V placement needs 2 chunks per rank, not {num_chunks}")
    ranks = plan.num_stages
    blocks = plan.num_layers - 2
    if ranks < 2:
        raise ProblemError(
            "the interleaved schedule needs at least 2 pipeline stages, got 1"
        )
    count = ranks * num_chunks
    held = [stage.stop - stage.start for stage in plan.stages]

    def virtual(r: int, c: int) -> int:
        return (2 * ranks - 1 - r if c else r) if v_shape else c * ranks + r

    def ranks_hold(layers: list[int], grouped: bool = False) -> bool:
        """The plan's stages hold each rank's chunks (``grouped``: counted as
        if each rank held consecutive virtual stages, as the planner's stages
        count an even split's, ZB-V's too: the same counts without V)."""
        return held == [
            sum(
                layers[r * num_chunks + c] if grouped else layers[virtual(r, c)]
                for c in range(num_chunks)
            )
            for r in range(ranks)
        ]

    if sizes is not None:
        if len(sizes) != count or min(sizes) < 0 or sum(sizes) != blocks:
            raise ProblemError(
                f"the virtual stages' layers {list(sizes)} are not {ranks} x "
                f"{num_chunks} counts of the plan's {blocks} transformer layers"
            )
        layers = profile_chunks(sizes)
        if not ranks_hold(layers):
            raise ProblemError(
                f"the plan's stages hold {held} layers, not the chunks of the "
                f"virtual stages' {list(sizes)} transformer layers"
            )
        return _spans(layers, ranks, num_chunks, virtual)
    for split in PIPELINE_SPLITS:  # Megatron-LM's default first
        layers = virtual_stage_layers(blocks, count, *split)
        if layers is not None and ranks_hold(layers, grouped=True):
            return _spans(layers, ranks, num_chunks, virtual)
    if blocks % count:
        raise ProblemError(
            f"{blocks} transformer layers do not split into {ranks} x "
            f"{num_chunks} equal model chunks (Megatron-LM's interleaved "
            "schedule needs that, the embedding and loss counted or not)"
        )
    size = blocks // count
    raise ProblemError(
        f"the plan's stages hold {held} layers; the interleaved schedule "
        f"gives every rank {num_chunks} chunks of {size} transformer layers"
    )


def _spans(
    layers: list[int], ranks: int, num_chunks: int, virtual: Callable[[int, int], int]
) -> list[list[tuple[int, int]]]:
    firsts = [0]
    for size in layers:
        firsts.append(firsts[-1] + size)
    return [
        [(firsts[virtual(r, c)], firsts[virtual(r, c) + 1]) for c in range(num_chunks)]
        for r in range(ranks)
    ]


def rank_layers(plan: Plan3D, v_shape: bool = False) -> list[list[tuple[int, int]]]:
    """``[rank] -> [(start, stop), ...]``: the layers each rank holds, for its
    parameters, all-reduce and optimizer step: its stage, or with ``v_shape``
    (ZB-V) its two chunks of the V (:func:`chunk_layers`). Megatron-LM's
    interleaved chunks hold the stage's layers in total, so its stage serves.

    Raises:
        ProblemError: as :func:`chunk_layers`.
    """
    if v_shape:
        return chunk_layers(plan, 2, v_shape=True)
    return [[(stage.start, stage.stop)] for stage in plan.stages]


def chunk_stash(
    plan: Plan3D, info: ModelInfo, chunks: list[list[tuple[int, int]]], pipeline: int
) -> NDArray[np.float64]:
    """``f64[P, V]``: the activation bytes one micro-batch stashes on each chunk
    of ``pipeline`` (its layers' ``act_mem`` and the input it received, as
    :func:`~pipedejavu.costmodel.megatron.rules.stash_bytes` counts them);
    ``chunks``: :func:`chunk_layers`."""
    out = np.zeros((len(chunks), len(chunks[0])))
    for r, row in enumerate(chunks):
        tp = plan.stages[r].replicas[pipeline].tp
        for c, (start, stop) in enumerate(row):
            act = span_act_mem(info, tp, start, stop)
            received = float(info.act_output[tp][start - 1]) if start else 0
            out[r, c] = stash_bytes(info, act, received, plan.mbs)
    return out


def warmup_stash(
    plan: Plan3D,
    info: ModelInfo,
    num_chunks: int,
    zero_bubble: bool = False,
    v_shape: bool = False,
) -> NDArray[np.float64]:
    """``f64[P]``: the activation bytes each rank holds (the most over the
    pipelines) when its first backward starts: the forwards of its warm-up and
    the one after it, every one still in flight
    (:func:`~pipedejavu.simulation.interleaved.peak_in_flight_count` of them, in
    Megatron-LM's order: ``P`` micro-batches per chunk, chunk by chunk; with
    ``zero_bubble`` the warm-up of
    :func:`~pipedejavu.simulation.zero_bubble.zero_bubble_warmup`, the same
    table; with ``v_shape``, ZB-V's ``min(2 P - r - 1, M)`` chunk-0 and
    ``min(r + 1, M)`` chunk-1 forwards). The schedule's peak
    (:attr:`InterleavedPipelines.stash_bytes`) is at least this, with no
    simulation (``tests/test_interleaved.py``).

    Raises:
        ProblemError: as :func:`chunk_layers`.
    """
    chunks = chunk_layers(plan, num_chunks, v_shape)
    ranks, count = plan.num_stages, plan.num_microbatches
    out = np.zeros(ranks)
    seen = set()  # pipelines of the same degrees stash alike
    for j in range(plan.dp):
        degrees = tuple(stage.replicas[j].tp for stage in plan.stages)
        if degrees in seen:
            continue
        seen.add(degrees)
        memory = chunk_stash(plan, info, chunks, j)
        for r in range(ranks):
            if v_shape:
                per_chunk = np.array([min(2 * ranks - r - 1, count), min(r + 1, count)])
                out[r] = max(out[r], float(per_chunk @ memory[r]))
                continue
            if zero_bubble:
                warmup = zero_bubble_warmup(r, ranks, count, num_chunks)
                held = min(warmup + 1, num_chunks * count)
            else:
                held = peak_in_flight_count(r, ranks, num_chunks, count)
            per_chunk = np.bincount(
                (np.arange(held) // ranks) % num_chunks, minlength=num_chunks
            )
            out[r] = max(out[r], float(per_chunk @ memory[r]))
    return out


class InterleavedPipelines(NamedTuple):
    """What :func:`interleaved_pipelines` returns.

    Attributes:
        ends: f64[P, dp] seconds at which each rank of each pipeline ends its
            last backward (with ``zero_bubble``: its last ``B`` or ``W``).
        busy_s: seconds all GPUs compute, summed.
        peak_in_flight: i64[P] most micro-batch-chunks a rank holds.
        stash_bytes: f64[P] the most activation bytes a rank holds at once.
        forward_s, backward_s: f64[P, dp] seconds per micro-batch of each rank
            (all its chunks; the backward whole, ``B`` and ``W`` with one
            overhead).
        transfer_s: f64[P, dp] seconds per micro-batch per direction over the
            link after each rank (``P - 1``: the wrap-around).
        timeline: the slowest pipeline's bars, simulated in full when called.
    """

    ends: NDArray[np.float64]
    busy_s: float
    peak_in_flight: NDArray[np.int64]
    stash_bytes: NDArray[np.float64]
    forward_s: NDArray[np.float64]
    backward_s: NDArray[np.float64]
    transfer_s: NDArray[np.float64]
    timeline: Callable[[], tuple[Bar, ...]]


def interleaved_pipelines(
    plan: Plan3D,
    info: ModelInfo,
    num_chunks: int,
    times: Mapping[tuple[str, int], LayerTimes],
    overhead_s: float,
    transfer_fn: Callable[[int, int, float, Hashable, Hashable], float],
    nodes: Sequence[Sequence[Hashable]],
    zero_bubble: bool = False,
    v_shape: bool = False,
    sizes: Sequence[int] | None = None,
) -> InterleavedPipelines:
    """Time every pipeline of ``plan`` under the interleaved schedule, or with
    ``zero_bubble`` under the interleaved zero-bubble schedule
    (:mod:`pipedejavu.simulation.zero_bubble`: each chunk's backward split
    into ``B`` and ``W``, ``W`` its layers' weight-gradient operations plus one
    instruction overhead, as ZB-H1 prices them), and with ``v_shape`` (two
    chunks) under ZB-V, whose turn on rank ``P - 1`` uses no link (link ``P -
    1`` is unused and priced 0).

    Args:
        plan: ``P`` stages, each holding its rank's chunks (:func:`chunk_layers`).
        info: the model's sizes.
        num_chunks: ``V`` >= 2.
        times: layer times by ``(gpu_type, tp)`` of every replica kind.
        overhead_s: seconds each forward or backward instruction adds.
        transfer_fn: ``(rank, pipeline, nbytes, sender_node, receiver_node)`` ->
            seconds per direction over the link after ``rank``.
        nodes: ``[rank][pipeline]`` node keys.
        sizes: the transformer layers of each virtual stage (a layout's;
            ``None``: Megatron-LM's even split; :func:`chunk_layers`).

    Raises:
        ProblemError: the chunks do not divide (or do not match ``sizes``),
            the micro-batch count is not a multiple of ``P`` (Megatron-LM
            requires it), or (``zero_bubble``) the times do not split the
            backward.
    """
    if v_shape and not zero_bubble:
        raise ProblemError("the V placement runs the zero-bubble schedule ZB-V only")
    chunks = chunk_layers(plan, num_chunks, v_shape, sizes)
    ranks, dp, count, mbs = plan.num_stages, plan.dp, plan.num_microbatches, plan.mbs
    step = 1 if v_shape else ranks
    if count % step:
        raise ProblemError(
            f"the interleaved schedule needs the micro-batch count ({count}) to be "
            f"a multiple of the pipeline stages ({ranks})"
        )
    ends = np.zeros((ranks, dp))
    forward_s = np.zeros((ranks, dp))
    backward_s = np.zeros((ranks, dp))
    transfer_s = np.zeros((ranks, dp))
    peak = np.zeros(ranks, dtype=np.int64)
    stash = np.zeros(ranks)
    busy = 0.0
    simulated: dict[bytes, PipelineSummary] = {}  # pipelines with the same inputs agree
    inputs = []  # each pipeline's

    def simulate(args: tuple, m: int) -> InterleavedResult | ZeroBubbleResult:
        f, b, links, stash, w = args
        if zero_bubble:
            return simulate_zero_bubble(
                f, b - w, w + overhead_s, m,
                transfer=links[:-1] if v_shape else links,
                memory_per_microbatch=stash, v_shape=v_shape,
            )  # fmt: skip
        return simulate_interleaved(
            f, b, m, transfer=links, memory_per_microbatch=stash
        )

    for j in range(dp):
        forward = np.zeros((ranks, num_chunks))
        backward = np.zeros((ranks, num_chunks))
        weight = np.zeros((ranks, num_chunks))
        transfer = np.zeros(ranks)
        memory = chunk_stash(plan, info, chunks, j)
        for r in range(ranks):
            replica = plan.stages[r].replicas[j]
            entry = times[(replica.gpu_type, replica.tp)]
            for c, (start, stop) in enumerate(chunks[r]):
                forward[r, c] = float(entry.forward[start:stop].sum()) + overhead_s
                backward[r, c] = span_backward(info, entry, start, stop) + overhead_s
                if zero_bubble:
                    weight[r, c] = stage_weight_grad(entry, start, stop)
            last_layer = chunks[r][0][1] - 1
            nbytes = float(message_bytes(info, replica.tp, last_layer, mbs))
            receiver = (r + 1) % ranks
            if v_shape and receiver == 0:
                continue  # the V turns on this rank
            transfer[r] = transfer_fn(r, j, nbytes, nodes[r][j], nodes[receiver][j])
        columns = (forward, backward, transfer, memory, weight)
        inputs.append(columns)
        key = b"".join(a.tobytes() for a in columns)
        if key not in simulated and zero_bubble:

            def run(m: int, args=columns):
                result = simulate(args, m)
                return PipelineSummary(
                    np.maximum(
                        result.input_grad_end.max(axis=(1, 2)),
                        result.weight_grad_end.max(axis=(1, 2)),
                    ),
                    float(result.busy_time.sum()),
                    result.peak_in_flight,
                    result.peak_memory,
                )

            simulated[key] = pipeline_summary(run, count, num_stages=ranks, step=step)
        elif key not in simulated:

            def run(m: int, args=columns):
                result = simulate(args, m)
                return PipelineSummary(
                    result.backward_end.max(axis=(1, 2)),
                    float(result.busy_time.sum()),
                    result.peak_in_flight,
                    result.peak_memory,
                )

            simulated[key] = pipeline_summary(run, count, num_stages=ranks, step=ranks)
        summary = simulated[key]
        ends[:, j] = summary.ends
        forward_s[:, j] = forward.sum(axis=1)
        backward_s[:, j] = backward.sum(axis=1)
        transfer_s[:, j] = transfer
        busy += summary.busy_s
        peak = np.maximum(peak, summary.peak_in_flight)
        assert summary.peak_memory is not None  # memory_per_microbatch was given
        stash = np.maximum(stash, summary.peak_memory)
    slowest = inputs[int(np.argmax(ends.max(axis=0)))]

    def timeline() -> tuple[Bar, ...]:
        f, b, _, _, w = slowest
        durations = (f, b - w, w + overhead_s) if zero_bubble else None
        return timeline_bars(simulate(slowest, count), durations)

    return InterleavedPipelines(
        ends, busy, peak, stash, forward_s, backward_s, transfer_s, timeline
    )
