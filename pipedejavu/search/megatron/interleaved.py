"""Search plans for Megatron-LM's interleaved 1F1B schedule, proven under the
predictor.

Megatron-LM's interleaved schedule (``--num-layers-per-virtual-pipeline-stage``)
splits the transformer blocks into ``P V`` equal chunks, ``V >= 2`` per
pipeline rank (:mod:`pipedejavu.costmodel.megatron.interleaving`), and needs the
micro-batch count to be a multiple of ``P``. With
``--account-for-embedding-in-pipeline-split`` and/or
``--account-for-loss-in-pipeline-split`` the embedding (the loss) counts as one
layer of the split, so the first (last) chunk holds one block fewer: the
published recipes of 94-layer Qwen3-235B-A22B split 96 units this way. Its
plans are therefore few: per GPU type, mbs, TP degree, ``P`` dividing the
blocks (with the embedding and/or the loss counted), ``V`` dividing each rank's
units (at least 2 per chunk where one is counted, so every chunk holds a
block), and ``dp`` (one TP degree for every stage; the embedding on rank 0 and
the final norm with the LM head on rank ``P - 1``, as Megatron places them).
The zero-bubble schedules (PyTorch's) split equally only.

**Bound.** Whatever the chunks' order, a rank runs every forward and backward
of its layers for each of the ``B`` micro-batches, one after another, as ``2
V`` instructions (each with the predictor's per-instruction overhead), so the
pipeline phase lasts at least ``B`` times the busiest rank's layer times and
overheads (the predictor's own per-layer times; transfers, the optimizer step
and the all-reduces only add). The busiest rank works at least the mean over
ranks, and at least rank 0's embedding (rank ``P - 1``'s head) plus its blocks
at their least. And rank ``P - 1`` cannot start before the forwards of the
model chunks ``0 .. P - 2`` of the first micro-batch, nor finish before its
last backward is followed by those chunks' backwards (its last operation is a
backward of some chunk ``c >= P - 1``, after which the backwards of chunks ``c
- 1 .. 0`` of that micro-batch remain): that adds the forward and backward of
``P - 1`` chunks (the embedding with the first) and their ``2 (P - 1)``
instructions to its work, the interleaved schedule's least bubble.
Each rank's gradient all-reduce and optimizer step follow its last backward
(the predictor's own rules, exact for the candidate's plan): the busiest rank
adds at least the least of them, rank 0 its own, rank ``P - 1`` its own.

**Memory.** When a rank starts its first backward it holds every forward of
its warm-up and the one after (Megatron-LM's order, chunk by chunk:
:func:`~pipedejavu.costmodel.megatron.interleaving.warmup_stash`); the
schedule's peak is at least that, so a candidate whose model state and that
stash exceed a GPU fits in no run and is settled unpredicted.

**Interleaved zero bubble.** With ``data.options.zero_bubble`` the same
plans run PyTorch's ``ScheduleInterleavedZeroBubble``
(:mod:`pipedejavu.simulation.zero_bubble`): each rank runs ``3 V``
instructions per micro-batch (``F``, ``B``, ``W``); rank ``P - 1`` still
waits for the forwards of the chunks before its first, but its ``W`` passes
may run after its last ``B``, so no backward tail is added; the stash at the
first ``B`` counts that schedule's warm-up (one forward per rank closer to
the end).

Candidates are taken in increasing order of the first bound; the first time a
candidate comes up, its tails and memory are priced and it goes back at the
larger bound (or is settled); the second time it is predicted. The search stops
when the least bound reaches the best predicted time (or a ``cutoff_s`` reached
elsewhere), so the best plan found is the predictor's optimum over these plans.
The plans are placed in one of Megatron-LM's rank orders (``rank_order``):
neither bound nor the memory test depends on it, and the tails are priced on
the placed plan.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.layout import (
    PIPELINE_SPLITS,
    chunks_hold_blocks,
    experts_fit,
)
from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import usable_degrees
from pipedejavu.search.megatron.interleaved_floor import (
    Candidate,
    candidate_fits,
    candidate_floor,
    candidate_plan,
)
from pipedejavu.search.megatron.settings import check_plan_size
from pipedejavu.search.megatron.space import divisors

__all__ = [
    "InterleavedMemo",
    "InterleavedResult",
    "interleaved_candidates",
    "search_interleaved",
]


@dataclasses.dataclass
class InterleavedMemo:
    """What :func:`search_interleaved` finds that does not depend on the rank
    order, for its searches in the other orders.

    Attributes:
        candidates: the candidates by (source ``id``, model, pool, batch,
            constants ``id``, settings), with the source and constants kept
            alive (their ``id`` not reused).
        fits: the memory test (:func:`candidate_fits`) by what it reads:
            the sizes (``ModelInfo.content_key``), model, batch, constants
            ``id``, schedule, and the candidate's type and its memory, TP,
            stages, dp, split, mbs and chunks (sources of equal sizes share
            it: one memo serves a search over expert layouts).
        states: the same test of the model state alone (no stash), by the
            same key less mbs and chunks (but ZB-V's chunks).
    """

    candidates: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    fits: dict[tuple, bool] = dataclasses.field(default_factory=dict)
    states: dict[tuple, bool] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class InterleavedResult:
    """What :func:`search_interleaved` established.

    Attributes:
        plan, prediction, chunks: the best plan found below the cutoff, its
            prediction and its ``V`` (``None`` each: none found).
        lower_bound_s: no interleaved plan that fits is faster than this
            (``min(best, cutoff)`` when ``proven``).
        proven: every candidate settled.
        candidates, predicted: plans in the space, predictor calls.
        time_s: wall-clock seconds.
    """

    plan: Plan3D | None
    prediction: Prediction | None
    chunks: int | None
    lower_bound_s: float
    proven: bool
    candidates: int
    predicted: int
    time_s: float


@functools.lru_cache(maxsize=4096)
def held_chunk_counts(
    blocks: int, ranks: int, embedding: int, loss: int, max_chunks: int | None
) -> tuple[int, ...]:
    """The chunk counts ``V >= 2`` (at most ``max_chunks``) into which
    ``ranks`` ranks can split ``blocks`` blocks with the ``embedding`` and
    ``loss`` layers counted (:func:`~pipedejavu.core.layout.chunks_hold_blocks`;
    ``V`` divides each rank's units)."""
    per_rank = (blocks + embedding + loss) // ranks
    return tuple(
        v
        for v in divisors(per_rank)
        if v >= 2
        and chunks_hold_blocks(blocks, ranks, v, embedding, loss)
        and (max_chunks is None or v <= max_chunks)
    )


def interleaved_candidates(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    *,
    allow_fewer_gpus: bool = True,
    mbs_values: Sequence[int] | None = None,
    max_chunks: int | None = None,
    dp_alone: bool = False,
) -> list[Candidate]:
    """Every interleaved plan of the space (module docstring) with its bound
    (``dp_alone``: at dp 1 only, as these plans have two stages or more)."""
    info = data.model_info(model)
    blocks = info.num_layers - 2
    overhead = constants.op_overhead_s
    zero_bubble = bool(data.options.zero_bubble)
    v_shape = bool(data.options.v_shape)  # ZB-V: two chunks, any M
    splits = PIPELINE_SPLITS[:1] if zero_bubble or v_shape else PIPELINE_SPLITS
    out: list[Candidate] = []
    for gpu, count in gpus.items():
        table = data.profile(model, gpu)
        for mbs in sorted({m for m, _ in table}):
            if global_batch % mbs or (mbs_values is not None and mbs not in mbs_values):
                continue
            samples = global_batch // mbs
            for tp in usable_degrees(data, model, gpu, mbs, count):
                times = data.layer_times(
                    model, gpu, mbs, tp, smooth=constants.smooth_profiles
                )
                work = times.forward + times.backward
                least = float(work[1 : blocks + 1].min())
                # zero bubble: rank P - 1's W passes may follow its last B, so
                # only the forwards before its first command count
                ahead = times.forward if zero_bubble else work
                ahead_least = float(ahead[1 : blocks + 1].min())
                total = float(work.sum())
                first, last = float(work[0]), float(work[-1])
                ranks_tried = sorted(
                    {r for split in splits for r in divisors(blocks + sum(split))}
                )
                for ranks, (embedding, loss) in itertools.product(ranks_tried, splits):
                    units = blocks + embedding + loss
                    if ranks < 2 or ranks * tp > count or units % ranks:
                        continue
                    per_rank = units // ranks  # (the counted layers included)
                    chunk_counts = list(
                        held_chunk_counts(blocks, ranks, embedding, loss, max_chunks)
                    )
                    if v_shape:
                        chunk_counts = [2] if 2 in chunk_counts else []
                    if not chunk_counts:
                        continue
                    # the busiest rank works at least the mean, and rank 0
                    # (P - 1) runs the embedding (head) beside its blocks
                    # (ZB-V: rank 0 runs both, rank P - 1 neither)
                    mean_s = total / ranks
                    first_rank_s = first + (per_rank - embedding) * least
                    first_rank_s += v_shape * last
                    last_rank_s = (not v_shape) * last + (per_rank - loss) * least
                    most = count // (ranks * tp)
                    for dp in range(1, 1 + (1 if dp_alone else most)):
                        if samples % dp or not (allow_fewer_gpus or dp == most):
                            continue
                        if not experts_fit(tp, 1, dp, *info.expert_axes):
                            continue
                        steps = samples // dp
                        if steps % ranks and not v_shape:
                            continue
                        for v in chunk_counts:
                            # every rank runs 2 V instructions per micro-batch
                            # (3 V with zero bubble: F, B and W)
                            ops = (3 if zero_bubble else 2) * v * overhead
                            # rank P - 1 waits for the model chunks before its
                            # first (forward) and after its last (backward;
                            # with zero bubble: before its first only): the
                            # blocks of chunks 0 .. P - 2
                            before = (ranks - 1) * (per_rank // v) - embedding
                            ramp = float(ahead[0]) + before * ahead_least
                            ramp += (1 if zero_bubble else 2) * (ranks - 1) * overhead
                            parts = (
                                steps * (mean_s + ops),
                                steps * (first_rank_s + ops),
                                steps * (last_rank_s + ops) + ramp,
                            )
                            out.append(
                                Candidate(
                                    max(parts),
                                    gpu,
                                    mbs,
                                    tp,
                                    ranks,
                                    dp,
                                    v,
                                    parts,
                                    split=(embedding, loss),
                                )
                            )
    return out


def search_interleaved(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    *,
    cutoff_s: float = math.inf,
    allow_fewer_gpus: bool = True,
    mbs_values: Sequence[int] | None = None,
    max_chunks: int | None = None,
    max_plans: int = 3000,
    rank_order: str = RANK_ORDERS[0],
    memo: InterleavedMemo | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    dp_alone: bool = False,
) -> InterleavedResult:
    """The fastest interleaved plan below ``cutoff_s`` (module docstring),
    placed in ``rank_order``.

    Args:
        data, model, gpus, global_batch, constants: as for the 1F1B search.
        cutoff_s: a predicted time reached elsewhere; only faster plans count.
        allow_fewer_gpus: plans may leave GPUs idle.
        mbs_values: micro-batch sizes to consider (``None``: all offered).
        max_chunks: the most chunks per rank (``None``: any that divide).
        dp_alone: data parallelism only without TP or PP beside it
            (torchtitan's DDP): no interleaved plan has it, so dp 1 only.
        max_plans: most predictor calls; beyond, the least bound left is a
            certified lower bound instead of a proof.
        rank_order: the plans' placement
            (:data:`~pipedejavu.core.plan3d.RANK_ORDERS`; the bounds hold for
            any: the tails are priced on the placed plan).
        memo: what does not depend on the placement (the candidates and
            their memory test), kept for the searches of other rank orders
            (its keys name the source, model, pool and settings).
        progress_fn: called about every second with ``{"phase":
            "interleaved", "predicted", "best", "bound"}``.
    """
    started = time.perf_counter()
    memo = InterleavedMemo() if memo is None else memo
    check_plan_size(data, model)
    mbs_key = None if mbs_values is None else tuple(mbs_values)
    space = (id(data), model, tuple(gpus.items()), global_batch, id(constants))
    space += (allow_fewer_gpus, mbs_key, max_chunks, dp_alone)
    if space not in memo.candidates:
        found_items = interleaved_candidates(
            data,
            model,
            gpus,
            global_batch,
            constants,
            allow_fewer_gpus=allow_fewer_gpus,
            mbs_values=mbs_values,
            max_chunks=max_chunks,
            dp_alone=dp_alone,
        )
        memo.candidates[space] = (data, constants, found_items)  # ids kept alive
    items = list(memo.candidates[space][2])
    # the memory test reads the sizes, the schedule and the GPUs' memory
    # alone: sources of equal sizes share it (a memo over expert layouts)
    sizes = (data.model_info(model).content_key(), model, global_batch)
    sizes += (id(constants), bool(data.options.zero_bubble))
    v_shape = bool(data.options.v_shape)
    sizes += (v_shape,)
    heapq.heapify(items)
    total = len(items)
    best = cutoff_s
    found: tuple[Plan3D, Prediction, int] | None = None
    predicted = 0
    lower = math.inf
    reported = time.perf_counter()
    while items:
        item = heapq.heappop(items)
        if item.bound >= best:
            break
        if predicted >= max_plans:
            lower = item.bound
            break
        limit = data.gpu_spec(item.gpu).memory_bytes
        rank = (sizes, item.gpu, limit, item.tp, item.ranks, item.dp, item.split)
        shape = (*rank, item.mbs, item.chunks)
        if shape not in memo.fits:  # (one pipeline's test)
            # the model state alone first: the same for every micro-batch
            # size (and chunk count, but ZB-V's, whose chunks hold the state)
            held = (*rank, item.chunks if v_shape else 0)
            if held not in memo.states:
                memo.states[held] = candidate_fits(
                    data, model, constants, global_batch, item, stash=False
                )
            memo.fits[shape] = memo.states[held] and candidate_fits(
                data, model, constants, global_batch, item
            )
        if not memo.fits.get(shape, True):  # memory: whatever the placement
            continue
        plan = candidate_plan(data, model, global_batch, item, rank_order)
        if not item.tails:
            try:
                fits, tails = candidate_floor(data, model, constants, plan, item.chunks)
            except ProblemError:  # a link the network tables do not price
                continue
            memo.fits[shape] = fits
            if fits:
                parts = item.parts
                bound = max(
                    item.bound,
                    parts[0] + float(tails.min()),
                    parts[1] + float(tails[0]),
                    parts[2] + float(tails[-1]),
                )
                heapq.heappush(
                    items, dataclasses.replace(item, bound=bound, tails=True)
                )
            continue
        predicted += 1
        try:
            prediction = predict_plan(
                plan, data, constants=constants, virtual_stages=item.chunks
            )
        except ProblemError:  # a link the network tables do not price
            continue
        if prediction.fits_memory and prediction.iteration_time_s < best:
            best = prediction.iteration_time_s
            found = (plan, prediction, item.chunks)
        if progress_fn is not None and time.perf_counter() - reported > 1.0:
            reported = time.perf_counter()
            progress_fn(
                {
                    "phase": "interleaved",
                    "predicted": predicted,
                    "best": best,
                    "bound": item.bound,
                }
            )
    return InterleavedResult(
        plan=None if found is None else found[0],
        prediction=None if found is None else found[1],
        chunks=None if found is None else found[2],
        lower_bound_s=min(lower, best),
        proven=not math.isfinite(lower),
        candidates=total,
        predicted=predicted,
        time_s=time.perf_counter() - started,
    )
