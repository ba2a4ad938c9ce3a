"""Megatron-LM's interleaved 1F1B schedule on the discrete-event simulator.

With interleaving each of the ``P`` pipeline ranks holds ``V`` model chunks
(virtual stages): chunk ``c`` of rank ``r`` is virtual stage ``c P + r`` of a
``V P``-stage pipeline. A micro-batch's forward runs chunk 0 on ranks ``0 ..
P - 1``, then wraps around from the last rank to chunk 1 of rank 0, and so on;
its backward runs the same path in reverse.

Model (that of :func:`pipedejavu.simulation.simulate.simulate`, one level
finer):

* Each rank is one resource that runs, in the order of :func:`interleaved_order`,
  ``F(r, c, b)`` (forward of chunk ``c`` for micro-batch ``b``, lasting
  ``forward[r, c]``) and ``B(r, c, b)`` (``backward[r, c]``).
* ``F(r, c, b)`` needs the activation of ``F(r - 1, c, b)``, or for ``r = 0``
  and ``c > 0`` that of ``F(P - 1, c - 1, b)`` (the wrap-around transfer);
  ``B(r, c, b)`` needs the gradient of ``B(r + 1, c, b)``, or for ``r = P - 1``
  and ``c < V - 1`` that of ``B(0, c + 1, b)``. The last virtual stage's
  backward follows its own forward (the order puts it later).
* **Links.** Link ``l`` joins rank ``l`` to rank ``(l + 1) mod P``; link
  ``P - 1`` is the wrap-around. As in :func:`simulate` (whose shared links run
  on the same event loop, :func:`pipedejavu.simulation.schedules.run_interleaved`),
  a link is half duplex, carries one transfer at a time for ``transfer[l]``
  seconds, first come first served (a gradient first at a tie), and sends are
  buffered: a rank computes on while its output travels.
* **Order** (Megatron-LM's ``forward_backward_pipelining_with_interleaving``
  with ``microbatch_group_size_per_vp_stage = P``): the ``V M`` forwards of a
  rank are taken in groups of ``P`` micro-batches, chunk by chunk (micro-batches
  ``0 .. P - 1`` on chunk 0, the same on chunk 1, ..., then micro-batches ``P ..
  2P - 1``); the ``k``-th backward is the ``k``-th entry of the same table with
  its chunk reversed (``V - 1 - c``). A rank runs :func:`warmup_count` forwards,
  then alternately one forward and one backward, then the remaining backwards.
  With ``V = 1`` this is Megatron's non-interleaved 1F1B, whose warm-up is
  ``P - r - 1``: the same command order as the ``"1f1b"`` schedule of
  :func:`simulate`. Megatron requires ``M`` to be a multiple of ``P`` when
  ``V > 1``.
* **In flight** at a rank: forwards done minus backwards done, counted in
  micro-batch-chunks (each holds one chunk's activations of one micro-batch);
  its peak is ``min(warmup_count + 1, V M)`` (:func:`peak_in_flight_count`).

With equal chunks (``f / V`` and ``b / V`` for per-rank times ``f`` and ``b``)
and free links the iteration takes ``M (f + b) + (P - 1) (f + b) / V``: the
bubble of the non-interleaved schedule divided by ``V``, a fraction ``(P - 1) /
(V M)`` of the ideal time (``tests/test_interleaved.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pipedejavu.simulation.schedules import (
    TimedSchedule,
    checked_array,
    checked_count,
    run_interleaved,
    timed_fields,
)

__all__ = [
    "InterleavedResult",
    "Op",
    "checked_array",
    "interleaved_order",
    "peak_in_flight_count",
    "round_commands",
    "round_table",
    "simulate_interleaved",
    "warmup_count",
]


class Op(NamedTuple):
    """One command of a rank: ``F(chunk, microbatch)``, ``B(chunk, microbatch)``
    or, with ``weight`` (zero-bubble schedules,
    :mod:`pipedejavu.simulation.zero_bubble`), ``W(chunk, microbatch)``: the
    weight-gradient half of a backward split in two (``backward`` is then
    ``True`` too, and the ``B`` before it computes the input gradient only)."""

    backward: bool
    chunk: int
    microbatch: int
    weight: bool = False


def _check_sizes(rank: int, num_ranks: int, num_chunks: int, num_microbatches: int):
    checked_count(num_ranks, "num_ranks", 1)
    checked_count(num_chunks, "num_chunks", 1)
    checked_count(num_microbatches, "num_microbatches", 1)
    checked_count(rank, "rank")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    if num_chunks > 1 and num_microbatches % num_ranks:
        raise ValueError(
            "the interleaved schedule needs num_microbatches to be a multiple of "
            f"the pipeline size {num_ranks} (Megatron-LM's rule), got "
            f"{num_microbatches}"
        )


def warmup_count(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> int:
    """Forwards a rank runs before its first backward, as Megatron-LM counts them.

    ``V = 1`` (non-interleaved): ``P - r - 1``. ``V > 1``: ``2 (P - r - 1) + (V -
    1) P``. Either is capped at the rank's ``V M`` forwards (then every forward
    precedes every backward).

    Args:
        rank: the pipeline rank ``r`` in ``[0, P)``.
        num_ranks: the pipeline size ``P``.
        num_chunks: model chunks per rank ``V``.
        num_microbatches: ``M`` (a multiple of ``P`` when ``V > 1``).

    Raises:
        ValueError: a bad size, or ``M`` not a multiple of ``P`` with ``V > 1``.
    """
    _check_sizes(rank, num_ranks, num_chunks, num_microbatches)
    later = num_ranks - rank - 1
    if num_chunks == 1:
        count = later
    else:
        count = 2 * later + (num_chunks - 1) * num_ranks
    return min(count, num_chunks * num_microbatches)


def peak_in_flight_count(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> int:
    """The most micro-batch-chunks a rank holds forwarded but not yet backwarded
    under :func:`interleaved_order`: ``min(warmup + 1, V M)``.

    Rank 0 with ``V M >= V P + P - 1`` holds ``V P + P - 1`` of them, each one
    chunk (``1 / V`` of the rank's layers): Megatron-LM's interleaving memory
    penalty ``1 + (P - 1) / (P V)`` times the ``P`` micro-batches of the
    non-interleaved schedule.

    Args and Raises: as :func:`warmup_count`.
    """
    warmup = warmup_count(rank, num_ranks, num_chunks, num_microbatches)
    return min(warmup + 1, num_chunks * num_microbatches)


def round_table(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` of a rank's forwards in run order: rounds of
    ``P`` micro-batches, chunk by chunk (Megatron-LM's order, and PyTorch's
    for ``M`` a multiple of ``P``); its backwards take the same table with
    the chunk reversed."""
    return [
        (microbatch, chunk)
        for group in range(0, num_microbatches, num_ranks)
        for chunk in range(num_chunks)
        for microbatch in range(group, min(group + num_ranks, num_microbatches))
    ]


def interleaved_order(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> list[Op]:
    """The commands of a rank in run order (see the module docstring).

    Args and Raises: as :func:`warmup_count`.

    Example:
        >>> ops = interleaved_order(1, 2, 2, 2)
        >>> " ".join("FB"[o.backward] + f"{o.chunk}.{o.microbatch}" for o in ops[:4])
        'F0.0 F0.1 F1.0 B1.0'
    """
    warmup_count(rank, num_ranks, num_chunks, num_microbatches)  # checks them
    if 2 * num_chunks * num_microbatches <= _CACHED_ORDER_OPS:
        return list(_cached_order(rank, num_ranks, num_chunks, num_microbatches))
    return _order(rank, num_ranks, num_chunks, num_microbatches)


#: A rank's order of at most this many commands is kept (at most 128 of them,
#: under 100 MB): the planner and the fits predict the same shapes many times.
_CACHED_ORDER_OPS = 8192


@functools.lru_cache(maxsize=8)
def round_commands(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """A rank's forwards and its backwards, each in run order
    (:func:`round_table`; the backwards with the chunk reversed): the same on
    every rank, so built once for all of a pipeline's ranks."""
    table = round_table(num_ranks, num_chunks, num_microbatches)
    forwards = tuple(Op(False, chunk, microbatch) for microbatch, chunk in table)
    backwards = tuple(
        Op(True, num_chunks - 1 - chunk, microbatch) for microbatch, chunk in table
    )
    return forwards, backwards


def _order(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> list[Op]:
    warmup = warmup_count(rank, num_ranks, num_chunks, num_microbatches)
    forwards, backwards = round_commands(num_ranks, num_chunks, num_microbatches)
    steady = len(forwards) - warmup  # one forward, then one backward
    middle: list[Op] = [forwards[0]] * (2 * steady)
    middle[0::2] = forwards[warmup:]
    middle[1::2] = backwards[:steady]
    return [*forwards[:warmup], *middle, *backwards[steady:]]


@functools.lru_cache(maxsize=128)
def _cached_order(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> tuple[Op, ...]:
    return tuple(_order(rank, num_ranks, num_chunks, num_microbatches))


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class InterleavedResult(TimedSchedule):
    """The timed interleaved schedule of one iteration.

    Attributes:
        num_microbatches: M.
        iteration_time: seconds until the last event ends.
        forward, backward: f64[P, V] seconds per micro-batch of each chunk.
        transfer: f64[P] seconds per micro-batch per direction of each link
            (``P - 1``: the wrap-around).
        orders: per rank, its :class:`Op` commands in run order.
        forward_start, forward_end, backward_start, backward_end: f64[P, V, M]
            seconds; ``[r, c, b]`` is ``F(r, c, b)`` / ``B(r, c, b)``.
        activation_start, activation_end: f64[P, V, M] seconds, the transfer of
            ``F(r, c, b)``'s output; gradient_start, gradient_end: that of
            ``B(r, c, b)``'s (NaN where none is modelled).
        busy_time: f64[P] seconds each rank computes, ``M * sum_c (f + b)``.
        idle_fraction: f64[P] ``1 - busy_time / iteration_time``.
        peak_in_flight: i64[P] most micro-batch-chunks forwarded but not yet
            backwarded at each rank.
        peak_memory: f64[P] bytes, the most that the in-flight micro-batch-chunks
            hold at once (``memory_per_microbatch[r, c]`` each), or ``None``.
    """

    orders: tuple[tuple[Op, ...], ...]

    @property
    def num_ranks(self) -> int:
        """P."""
        return self.forward.shape[0]

    @property
    def num_chunks(self) -> int:
        """V."""
        return self.forward.shape[1]


def _order_arrays(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """i64[P, 2 V M] +1 for each forward, -1 for each backward of each
    rank's :func:`interleaved_order`, and each command's chunk; kept for
    shapes of up to 2^18 commands (4 MB, 8 shapes)."""
    if num_ranks * 2 * num_chunks * num_microbatches <= 1 << 18:
        return _cached_order_arrays(num_ranks, num_chunks, num_microbatches)
    return _build_order_arrays(num_ranks, num_chunks, num_microbatches)


def _build_order_arrays(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    orders = [
        interleaved_order(r, num_ranks, num_chunks, num_microbatches)
        for r in range(num_ranks)
    ]
    signs = np.array([[-1 if op.backward else 1 for op in o] for o in orders])
    chunks = np.array([[op.chunk for op in o] for o in orders])
    signs.flags.writeable = chunks.flags.writeable = False
    return signs, chunks


_cached_order_arrays = functools.lru_cache(maxsize=8)(_build_order_arrays)


def simulate_interleaved(
    forward: ArrayLike,
    backward: ArrayLike,
    num_microbatches: int,
    *,
    transfer: ArrayLike | None = None,
    memory_per_microbatch: ArrayLike | None = None,
) -> InterleavedResult:
    """Simulate one iteration of Megatron-LM's interleaved 1F1B schedule (see the
    module docstring); ``V`` is ``forward.shape[1]``.

    Args:
        forward: f64[P, V] seconds per micro-batch of the forward of chunk ``c``
            on rank ``r`` (``V = 1``: the non-interleaved schedule).
        backward: f64[P, V] seconds per micro-batch of the backwards.
        num_microbatches: M >= 1, a multiple of ``P`` when ``V > 1``.
        transfer: f64[P] seconds per micro-batch per direction over link ``l``
            (rank ``l`` to rank ``(l + 1) mod P``; ``l = P - 1`` is the
            wrap-around, unused when ``V = 1``). ``None``: free links.
        memory_per_microbatch: f64[P, V] bytes one micro-batch's activations of
            chunk ``c`` hold on rank ``r`` until its backward (``None``: no
            memory report).

    Returns:
        The :class:`InterleavedResult`.

    Raises:
        ValueError: naming the bad argument, what was expected and what arrived.

    Example:
        >>> # P = 2, V = 2, per-rank f = 1, b = 2: M (f + b) + (P - 1)(f + b) / V
        >>> simulate_interleaved([[0.5, 0.5]] * 2, [[1.0, 1.0]] * 2, 4).iteration_time
        13.5
    """
    array = np.asarray(forward)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(
            f"forward must have shape (P, V) with P, V >= 1, got {array.shape}"
        )
    shape = array.shape
    num_ranks, num_chunks = shape
    count = checked_count(num_microbatches, "num_microbatches", 1)
    orders = [
        interleaved_order(r, num_ranks, num_chunks, count) for r in range(num_ranks)
    ]
    forward = checked_array(forward, "forward", shape)
    backward = checked_array(backward, "backward", shape)
    links = (
        np.zeros(num_ranks)
        if transfer is None
        else checked_array(transfer, "transfer", (num_ranks,))
    )
    memory = (
        None
        if memory_per_microbatch is None
        else checked_array(memory_per_microbatch, "memory_per_microbatch", shape)
    )
    grids = run_interleaved(
        forward.tolist(), backward.tolist(), links.tolist(), orders, count
    )
    busy = count * (forward + backward).sum(axis=1)
    signs, chunks = _order_arrays(num_ranks, num_chunks, count)
    peak = np.cumsum(signs, axis=1).max(axis=1).astype(np.int64)
    peak_memory = None
    if memory is not None:
        held = np.cumsum(signs * np.take_along_axis(memory, chunks, axis=1), axis=1)
        peak_memory = held.max(axis=1)
    return InterleavedResult(
        num_microbatches=count,
        forward=forward,
        backward=backward,
        transfer=links,
        orders=tuple(tuple(o) for o in orders),
        peak_in_flight=peak,
        peak_memory=peak_memory,
        **timed_fields(grids, busy, (num_ranks, num_chunks, count)),
    )
