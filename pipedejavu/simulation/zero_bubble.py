"""The zero-bubble pipeline schedules ZB-H1, its interleaved form and ZB-V on
the discrete-event simulator.

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism") split each backward
into ``B`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradient, which nobody waits for). ZB-H1 keeps 1F1B's warm-up and
defers the ``W`` passes so that they fill the cool-down, where 1F1B's ranks wait
for gradients. This is the order of PyTorch's
``ScheduleInterleavedZeroBubble`` (``torch.distributed.pipelining``, the
paper's ZB-1p), which torchtitan launches as ``InterleavedZeroBubble``, with
``V`` model chunks per rank (``V = 1``: ZB-H1; chunk ``c`` of rank ``r`` is
virtual stage ``c P + r``, as in :mod:`pipedejavu.simulation.interleaved`):

* rank ``r`` of ``P`` runs ``min((V - 1) P + P - r - 1, V M)`` warm-up
  forwards (one per rank closer to the end, where Megatron-LM's interleaved
  1F1B runs two);
* the forwards are taken in groups of ``P`` micro-batches, chunk by chunk
  (micro-batches ``0 .. P - 1`` on chunk 0, then on chunk 1, ...), the
  backwards from the same table with the chunk reversed (PyTorch's order with
  ``M`` a multiple of ``P``, which ``V > 1`` needs here; with ``V = 1`` any
  ``M``);
* then per step one forward and one ``B``; after its ``j``-th ``B`` (from 0) it
  runs the oldest pending ``W`` once ``j >= r`` (rank ``r`` keeps ``r`` weight
  passes pending, which the cool-down then fills in);
* then the remaining ``B`` passes with the same rule, then the remaining ``W``.

**ZB-V** (the paper's Section 6; PyTorch's ``ScheduleZBVZeroBubble``,
torchtitan's ``ZBVZeroBubble``; :func:`zbv_order`): two chunks per rank
placed in a V, chunk 0 of rank ``r`` virtual stage ``r`` and chunk 1 virtual
stage ``2 P - 1 - r``, so a micro-batch runs down the ranks and back up, and
the turn on rank ``P - 1`` needs no link. Rank ``r`` runs ``2 (P - r) - 1``
chunk-0 forwards, then ``r`` pairs of chunk-1 and chunk-0 forwards, then ``P -
r`` times a chunk-1 ``F``, ``B``, ``W``; in the steady state a chunk-0 ``F``,
``B``, ``W`` and a chunk-1 ``F``, ``B``, ``W``; it cools down with ``r``
pairs of input gradients, then ``P - r`` chunk-0 ``B``/``W`` pairs, then the
pending ``W`` passes (chunk 1's first). PyTorch plans at least ``2 P - 1``
micro-batches and drops the commands of the missing ones; so does this
order. With ``F = B = W`` on every chunk and ``M >= 2 P - 1`` the last rank
starts after ``P - 1`` forwards and never waits again: the least time any
schedule can take; without ``W`` (per-rank ``f``, ``b``) the bubble is ``(P -
1) max(f, b)`` (tests).

The event loop is :func:`pipedejavu.simulation.schedules.run_interleaved`
(links, buffered sends and first-come-first-served as there); a ``W`` runs on
its rank after its ``B`` and sends nothing.

**Closed form** (``tests/test_zero_bubble.py``): equal stages ``f``, ``b``,
``w`` with ``w <= f`` and ``w <= b <= w + f`` (the paper's ``F = B = W`` among
them), ``V = 1`` and free links, ``M >= P``: the iteration takes
``M (f + b + w) + (P - 1)(f + b - w)``, against 1F1B's ``M (f + b + w) + (P -
1)(f + b + w)`` with the backward whole: the bubble shrinks by ``2 (P - 1) w``.
Outside that regime it is longer (with ``w > b`` the last rank ends at ``(P -
1) f + M (f + b + w)``: its ``P - 1`` pending ``W`` passes run after its last
``B``).

**Memory.** A micro-batch-chunk counts as in flight from its forward to its
``W`` (:attr:`ZeroBubbleResult.peak_in_flight`), holding all its stashed
activations until then: an upper bound (after ``B`` the real runtime keeps
only what ``W`` needs, the inputs of the linear layers and their output
gradients). With ``V = 1`` rank ``r`` peaks at ``min(P, M)`` micro-batches,
every rank as many as 1F1B's first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pipedejavu.simulation.interleaved import Op, round_commands
from pipedejavu.simulation.schedules import (
    checked_array,
    checked_count,
    run_interleaved,
)

__all__ = [
    "ZeroBubbleResult",
    "simulate_zero_bubble",
    "held_by_order",
    "zero_bubble_in_flight",
    "zero_bubble_order",
    "zero_bubble_warmup",
    "zbv_order",
]


def _check_bool(value, name: str) -> None:
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _sizes(rank, num_ranks, num_microbatches, num_chunks) -> tuple[int, int, int, int]:
    ranks = checked_count(num_ranks, "num_ranks", 1)
    count = checked_count(num_microbatches, "num_microbatches", 1)
    chunks = checked_count(num_chunks, "num_chunks", 1)
    rank = checked_count(rank, "rank", 0)
    if rank >= ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    if chunks > 1 and count % ranks:
        raise ValueError(
            f"the interleaved zero-bubble schedule needs num_microbatches to be a "
            f"multiple of the pipeline size {ranks}, got {count}"
        )
    return rank, ranks, count, chunks


def zero_bubble_warmup(
    rank: int, num_ranks: int, num_microbatches: int, num_chunks: int = 1
) -> int:
    """Forwards rank ``rank`` runs before its first ``B``: ``min((V - 1) P + P -
    r - 1, V M)`` (module docstring).

    Raises:
        ValueError: a size below 1, ``rank`` outside ``[0, num_ranks)``, or
            ``V > 1`` with ``M`` not a multiple of ``P``.
    """
    rank, ranks, count, chunks = _sizes(rank, num_ranks, num_microbatches, num_chunks)
    return min((chunks - 1) * ranks + ranks - rank - 1, chunks * count)


def zero_bubble_in_flight(num_ranks: int, num_microbatches: int) -> int:
    """The most micro-batches any rank holds in flight (forward done, ``W`` not
    yet) under :func:`zero_bubble_order` with one chunk per rank: ``min(P,
    M)``, on every rank (``tests/test_zero_bubble.py`` checks it against the
    order)."""
    return min(
        checked_count(num_ranks, "num_ranks", 1),
        checked_count(num_microbatches, "num_microbatches", 1),
    )


def zero_bubble_order(
    rank: int, num_ranks: int, num_microbatches: int, num_chunks: int = 1
) -> list[Op]:
    """The commands of rank ``rank`` in run order (module docstring), with
    ``num_chunks`` model chunks per rank.

    Example:
        >>> ops = zero_bubble_order(1, 2, 3)
        >>> " ".join("FBW"[o.backward + o.weight] + str(o.microbatch) for o in ops)
        'F0 B0 F1 B1 W0 F2 B2 W1 W2'

    Raises:
        ValueError: as :func:`zero_bubble_warmup`.
    """
    warmup = zero_bubble_warmup(rank, num_ranks, num_microbatches, num_chunks)
    ranks, count, chunks = int(num_ranks), int(num_microbatches), int(num_chunks)
    forwards, inputs, weights = _commands(ranks, chunks, count)
    order = list(forwards[:warmup])
    pending = 0  # the oldest B whose W has not run
    for j in range(len(forwards)):
        if warmup + j < len(forwards):
            order.append(forwards[warmup + j])
        order.append(inputs[j])
        if j >= rank:
            order.append(weights[pending])
            pending += 1
    return order + list(weights[pending:])


@functools.lru_cache(maxsize=8)
def _commands(ranks: int, chunks: int, count: int) -> tuple[tuple[Op, ...], ...]:
    """A rank's ``F``, ``B`` and ``W`` commands, each in run order (the same on
    every rank): built once for all of a pipeline's ranks."""
    forwards, inputs = round_commands(ranks, chunks, count)
    weights = tuple(Op(True, op.chunk, op.microbatch, True) for op in inputs)
    return forwards, inputs, weights


def zbv_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Op]:
    """The commands of rank ``rank`` under the ZB-V schedule (module
    docstring; chunk 0 is virtual stage ``r``, chunk 1 is ``2 P - 1 - r``).

    Example:
        >>> ops = zbv_order(0, 1, 2)
        >>> " ".join("FBW"[o.backward + o.weight] + str(o.chunk) for o in ops)
        'F0 F1 B1 W1 F0 B0 W0 F1 B1 W1 B0 W0'

    Raises:
        ValueError: a size below 1, or ``rank`` outside ``[0, num_ranks)``.
    """
    rank, ranks, count, _ = _sizes(rank, num_ranks, num_microbatches, 1)
    rounds = max(2 * ranks - 1, count)  # then the extra micro-batches dropped
    done = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}
    order: list[Op] = []
    commands = _v_commands(count)

    def run(kind: str, chunk: int) -> None:
        b = done[kind][chunk]
        done[kind][chunk] += 1
        if b < count:
            order.append(commands[kind][chunk][b])

    for _ in range(2 * (ranks - rank) - 1):  # warm-up: chunk 0's forwards
        run("F", 0)
    for _ in range(rank):  # then both chunks
        run("F", 1)
        run("F", 0)
    for _ in range(ranks - rank):  # chunk 1 turns round
        run("F", 1)
        run("B", 1)
        run("W", 1)
    while done["F"][1] < done["F"][0] or done["F"][0] < rounds:  # steady
        if done["F"][0] < rounds:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        run("F", 1)
        run("B", 1)
        run("W", 1)
    for _ in range(rank):  # cool-down: input gradients first
        run("B", 0)
        run("B", 1)
    for _ in range(ranks - rank):
        run("B", 0)
        run("W", 0)
    while done["W"][1] < done["B"][1]:
        run("W", 1)
    while done["W"][0] < done["B"][0]:
        run("W", 0)
    return order


@functools.lru_cache(maxsize=8)
def _v_commands(count: int) -> dict[str, tuple[tuple[Op, ...], tuple[Op, ...]]]:
    """``[kind][chunk][b]``: the ``F``, ``B`` and ``W`` command of micro-batch
    ``b`` on each chunk, built once for all ranks of a ZB-V pipeline."""
    return {
        kind: tuple(
            tuple(Op(kind != "F", chunk, b, kind == "W") for b in range(count))
            for chunk in (0, 1)
        )
        for kind in "FBW"
    }


@functools.lru_cache(maxsize=4096)
def _order(
    rank: int, num_ranks: int, num_microbatches: int, chunks: int, v_shape: bool
) -> tuple[Op, ...]:
    """:func:`zero_bubble_order` or :func:`zbv_order`, kept (the predictor
    asks for the same orders over and over)."""
    if v_shape:
        return tuple(zbv_order(rank, num_ranks, num_microbatches))
    return tuple(zero_bubble_order(rank, num_ranks, num_microbatches, chunks))


def held_by_order(order: Sequence[Op], memory: Sequence[float]) -> float:
    """The most bytes a rank holds at once under ``order`` when one
    micro-batch's chunk ``c`` holds ``memory[c]`` from its forward to its
    ``W``: the zero-bubble schedules' stash, shared by the simulator and the
    planners' memory tests."""
    held = peak = 0.0
    for op in order:
        if not op.backward:
            held += memory[op.chunk]
            peak = max(peak, held)
        elif op.weight:
            held -= memory[op.chunk]
    return peak


@functools.lru_cache(maxsize=4096)
def _peak(
    rank: int, num_ranks: int, num_microbatches: int, chunks: int, v_shape: bool
) -> int:
    """The most micro-batch-chunks the rank holds between a forward and its
    ``W`` under its order."""
    order = _order(rank, num_ranks, num_microbatches, chunks, v_shape)
    return int(held_by_order(order, [1.0] * chunks))


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroBubbleResult:
    """The timed zero-bubble schedule of one iteration.

    Attributes:
        num_microbatches: M.
        iteration_time: seconds until the last command ends.
        forward_end, input_grad_end, weight_grad_end: seconds at which each
            rank ends ``F``, ``B`` and ``W`` of each micro-batch: f64[P, M]
            with one chunk per rank (1-D times), f64[P, V, M] with ``V`` (2-D).
        busy_time: f64[P] seconds each rank computes, ``M sum_c (f + b + w)``.
        peak_in_flight: i64[P] most micro-batch-chunks forwarded whose ``W``
            has not yet run.
        peak_memory: f64[P] the most bytes the in-flight micro-batch-chunks
            hold at once (:func:`held_by_order`), or ``None``.
    """

    num_microbatches: int
    iteration_time: float
    forward_end: NDArray[np.float64]
    input_grad_end: NDArray[np.float64]
    weight_grad_end: NDArray[np.float64]
    busy_time: NDArray[np.float64]
    peak_in_flight: NDArray[np.int64]
    peak_memory: NDArray[np.float64] | None


def simulate_zero_bubble(
    forward: ArrayLike,
    input_grad: ArrayLike,
    weight_grad: ArrayLike,
    num_microbatches: int,
    *,
    transfer: ArrayLike | None = None,
    memory_per_microbatch: ArrayLike | None = None,
    v_shape: bool = False,
) -> ZeroBubbleResult:
    """Simulate one iteration of ZB-H1, of its interleaved form with 2-D
    times, or of ZB-V with ``v_shape`` (module docstring).

    Args:
        forward: f64[P] seconds of each rank's forward per micro-batch, or
            f64[P, V] of each of its ``V`` chunks (``V > 1`` needs ``M`` a
            multiple of ``P``).
        input_grad: the same shape, seconds of its ``B`` (input gradient; any
            recomputation belongs here).
        weight_grad: the same shape, seconds of its ``W``.
        num_microbatches: M >= 1.
        transfer: seconds per micro-batch per direction over the link after
            each rank: f64[P - 1] with 1-D times or ``v_shape`` (no
            wrap-around), f64[P] with 2-D times (link ``P - 1`` is the
            wrap-around to rank 0). ``None``: free links.
        memory_per_microbatch: the shape of ``forward``, bytes one
            micro-batch holds on a rank's chunk from its forward to its ``W``
            (``None``: no memory report).
        v_shape: ZB-V (:func:`zbv_order`): 2-D times of two chunks per rank,
            chunk 0 virtual stage ``r`` and chunk 1 ``2 P - 1 - r``, any ``M``.

    Raises:
        ValueError: naming the bad argument, what was expected and what arrived.

    Example:
        >>> # P = 4, f = b = w = 1, M = 8: M (f + b + w) + (P - 1)(f + b - w)
        >>> simulate_zero_bubble([1.0] * 4, [1.0] * 4, [1.0] * 4, 8).iteration_time
        27.0
    """
    array = np.asarray(forward)
    if array.ndim not in (1, 2) or 0 in array.shape:
        raise ValueError(
            f"forward must have shape (P,) or (P, V) with P, V >= 1, got {array.shape}"
        )
    flat = array.ndim == 1
    shape = array.shape
    ranks, chunks = (shape[0], 1) if flat else shape
    count = checked_count(num_microbatches, "num_microbatches", 1)
    _check_bool(v_shape, "v_shape")
    if v_shape and chunks != 2:
        raise ValueError(f"v_shape needs times of shape (P, 2), got {shape}")
    if chunks > 1 and count % ranks and not v_shape:
        raise ValueError(
            f"the interleaved zero-bubble schedule needs num_microbatches to be a "
            f"multiple of the pipeline size {ranks}, got {count}"
        )
    f, b, w = (
        checked_array(value, name, shape).reshape(ranks, chunks)
        for value, name in (
            (forward, "forward"),
            (input_grad, "input_grad"),
            (weight_grad, "weight_grad"),
        )
    )
    links = np.zeros(ranks)
    if transfer is not None:
        if flat or v_shape:
            links[:-1] = checked_array(transfer, "transfer", (ranks - 1,))
        else:
            links[:] = checked_array(transfer, "transfer", (ranks,))
    orders = [_order(r, ranks, count, chunks, v_shape) for r in range(ranks)]
    grids = run_interleaved(
        f.tolist(),
        b.tolist(),
        links.tolist(),
        orders,
        count,
        weight=w.tolist(),
        v_shape=v_shape,
    )
    f_end, b_end, w_end = (np.array(grids[k]) for k in (1, 3, 9))
    iteration = float(max(f_end.max(), b_end.max(), w_end.max()))
    if flat:
        f_end, b_end, w_end = f_end[:, 0, :], b_end[:, 0, :], w_end[:, 0, :]
    peak = np.array(
        [_peak(r, ranks, count, chunks, v_shape) for r in range(ranks)],
        dtype=np.int64,
    )
    memory = None
    if memory_per_microbatch is not None:
        per_chunk = checked_array(
            memory_per_microbatch, "memory_per_microbatch", shape
        ).reshape(ranks, chunks)
        memory = np.array(
            [held_by_order(orders[r], per_chunk[r].tolist()) for r in range(ranks)]
        )
    return ZeroBubbleResult(
        num_microbatches=count,
        iteration_time=iteration,
        forward_end=f_end,
        input_grad_end=b_end,
        weight_grad_end=w_end,
        busy_time=count * (f + b + w).sum(axis=1),
        peak_in_flight=peak,
        peak_memory=memory,
    )
