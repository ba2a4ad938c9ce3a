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
  ``P - 1`` is the wrap-around. As in :func:`simulate`'s event loop, a link is
  half duplex, carries one transfer at a time for ``transfer[l]`` seconds, first
  come first served (a gradient first at a tie), and sends are buffered: a rank
  computes on while its output travels.
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
import heapq
import math
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

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
    for name, value in (
        ("num_ranks", num_ranks),
        ("num_chunks", num_chunks),
        ("num_microbatches", num_microbatches),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
        raise ValueError(f"rank must be an int, got {rank!r}")
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


def run_interleaved(
    forward, backward, transfer, orders, num_microbatches, weight=None, v_shape=False
):
    """The event loop: ``forward``/``backward`` ``[P][V]`` seconds, ``transfer``
    ``[P]`` seconds, ``orders`` ``[P]`` lists of :class:`Op`, ``weight``
    ``[P][V]`` seconds of the ``W`` commands (``None``: the orders have none).
    Returns ten ``[P][V][M]`` grids: forward start/end, backward start/end,
    activation transfer start/end (of ``F(r, c, b)``'s output), gradient
    transfer start/end (of ``B(r, c, b)``'s output; NaN where no transfer is
    modelled), weight-gradient start/end (NaN without ``W`` commands). A ``W``
    follows its own rank's ``B`` (the order puts it later) and sends nothing.

    ``v_shape`` (``V = 2``): the zero-bubble V placement instead of the loop,
    chunk 0 of rank ``r`` is virtual stage ``r`` and chunk 1 is ``2 P - 1 -
    r``: activations run down the ranks on chunk 0, pass from chunk 0 to chunk
    1 on rank ``P - 1`` without a link, and run back up on chunk 1 (link ``l``
    still joins ranks ``l`` and ``l + 1``; link ``P - 1`` is unused); the last
    virtual stage is chunk 1 of rank 0."""
    num_ranks, num_chunks, count = len(orders), len(forward[0]), num_microbatches
    last_rank = num_ranks - 1
    if v_shape:
        routes = _v_routes(num_ranks)
        return _run(forward, backward, transfer, orders, count, weight, routes, 0)
    routes = _loop_routes(num_ranks, num_chunks)
    return _run(forward, backward, transfer, orders, count, weight, routes, last_rank)


Route = tuple[int, int, int | None] | None


def _loop_routes(num_ranks: int, num_chunks: int):
    """``(after_forward, after_backward)``: ``[r][c] -> (rank, chunk, link)``
    the output of ``F(r, c)`` / ``B(r, c)`` goes to (``link`` ``None``: on
    the same rank), ``None`` at the pipeline's end; the loop placement."""
    last_rank, last_chunk = num_ranks - 1, num_chunks - 1
    after_f: list[list[Route]] = [[None] * num_chunks for _ in range(num_ranks)]
    after_b: list[list[Route]] = [[None] * num_chunks for _ in range(num_ranks)]
    for r in range(num_ranks):
        for c in range(num_chunks):
            if r < last_rank:
                after_f[r][c] = (r + 1, c, r)
            elif c < last_chunk:
                after_f[r][c] = (0, c + 1, r)
            if r > 0:
                after_b[r][c] = (r - 1, c, r - 1)
            elif c > 0:
                after_b[r][c] = (last_rank, c - 1, last_rank)
    return after_f, after_b


def _v_routes(num_ranks: int):
    """:func:`_loop_routes` for the V placement (two chunks per rank)."""
    last_rank = num_ranks - 1
    after_f: list[list[Route]] = [[None, None] for _ in range(num_ranks)]
    after_b: list[list[Route]] = [[None, None] for _ in range(num_ranks)]
    for r in range(num_ranks):
        after_f[r][0] = (r + 1, 0, r) if r < last_rank else (r, 1, None)
        after_f[r][1] = (r - 1, 1, r - 1) if r > 0 else None
        after_b[r][1] = (r + 1, 1, r) if r < last_rank else (r, 0, None)
        after_b[r][0] = (r - 1, 0, r - 1) if r > 0 else None
    return after_f, after_b


def _run(forward, backward, transfer, orders, count, weight, routes, end_rank):
    """:func:`run_interleaved`'s loop over ``routes``; the last virtual stage
    is the last chunk of ``end_rank``."""
    num_ranks, num_chunks = len(orders), len(forward[0])
    last_chunk = num_chunks - 1
    after_f, after_b = routes

    def grid(fill):
        return [[[fill] * count for _ in range(num_chunks)] for _ in range(num_ranks)]

    f_start, f_end, b_start, b_end = grid(0.0), grid(0.0), grid(0.0), grid(0.0)
    a_start, a_end, g_start, g_end, w_start, w_end = (grid(math.nan) for _ in range(6))
    f_ready, b_ready = grid(None), grid(None)
    f_ready[0][0] = [0.0] * count
    b_ready[end_rank][last_chunk] = [0.0] * count
    pointer = [0] * num_ranks
    lengths = [len(order) for order in orders]
    free = [0.0] * num_ranks
    idle = [True] * num_ranks
    link_free = [0.0] * num_ranks
    heap: list[tuple[float, bool, int, int]] = []
    counter = 0

    def try_start(r):
        nonlocal counter
        if not idle[r] or pointer[r] == lengths[r]:
            return
        is_backward, chunk, microbatch, is_weight = orders[r][pointer[r]]
        if is_weight:
            ready = free[r]  # its B ran earlier on this rank
        else:
            ready = (b_ready if is_backward else f_ready)[r][chunk][microbatch]
            if ready is None:
                return
        start = ready if ready > free[r] else free[r]
        if is_weight:
            w_start[r][chunk][microbatch] = start
            end = start + weight[r][chunk]
        elif is_backward:
            b_start[r][chunk][microbatch] = start
            end = start + backward[r][chunk]
        else:
            f_start[r][chunk][microbatch] = start
            end = start + forward[r][chunk]
        idle[r] = False
        counter += 1
        # At equal end times backwards pop first, so a gradient claims a link
        # before an activation requested at the same instant.
        heapq.heappush(heap, (end, not is_backward, counter, r))

    def send(link, now):
        if transfer[link] <= 0:
            return now, math.nan, math.nan
        start = now if now > link_free[link] else link_free[link]
        link_free[link] = start + transfer[link]
        return link_free[link], start, link_free[link]

    for r in range(num_ranks):
        try_start(r)
    while heap:
        now, _, _, r = heapq.heappop(heap)
        is_backward, chunk, microbatch, is_weight = orders[r][pointer[r]]
        pointer[r] += 1
        free[r] = now
        idle[r] = True
        if is_weight:
            w_end[r][chunk][microbatch] = now
        else:  # its output (activation or gradient) goes on
            if is_backward:
                b_end[r][chunk][microbatch] = now
                route, sent, ready = after_b[r][chunk], (g_start, g_end), b_ready
            else:
                f_end[r][chunk][microbatch] = now
                route, sent, ready = after_f[r][chunk], (a_start, a_end), f_ready
            if route is not None:
                to, to_chunk, link = route
                arrival = now
                if link is not None:
                    arrival, start, end = send(link, now)
                    sent[0][r][chunk][microbatch] = start
                    sent[1][r][chunk][microbatch] = end
                ready[to][to_chunk][microbatch] = arrival
                if idle[to]:  # (a busy rank starts nothing)
                    try_start(to)
        try_start(r)
    if pointer != lengths:
        raise RuntimeError("the interleaved schedule deadlocked")  # pragma: no cover
    return (
        f_start,
        f_end,
        b_start,
        b_end,
        a_start,
        a_end,
        g_start,
        g_end,
        w_start,
        w_end,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class InterleavedResult:
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

    num_microbatches: int
    iteration_time: float
    forward: NDArray[np.float64]
    backward: NDArray[np.float64]
    transfer: NDArray[np.float64]
    orders: tuple[tuple[Op, ...], ...]
    forward_start: NDArray[np.float64]
    forward_end: NDArray[np.float64]
    backward_start: NDArray[np.float64]
    backward_end: NDArray[np.float64]
    activation_start: NDArray[np.float64]
    activation_end: NDArray[np.float64]
    gradient_start: NDArray[np.float64]
    gradient_end: NDArray[np.float64]
    busy_time: NDArray[np.float64]
    idle_fraction: NDArray[np.float64]
    peak_in_flight: NDArray[np.int64]
    peak_memory: NDArray[np.float64] | None

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


def checked_array(
    value: ArrayLike, name: str, shape: tuple[int, ...]
) -> NDArray[np.float64]:
    """``value`` as f64 of ``shape``, finite and >= 0.

    Raises:
        ValueError: naming ``name``, what was expected and what arrived.
    """
    array = np.asarray(value)
    if array.dtype == object or not (
        np.issubdtype(array.dtype, np.floating)
        or np.issubdtype(array.dtype, np.integer)
    ):
        raise ValueError(f"{name} must be numeric, got dtype {array.dtype}")
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    array = array.astype(np.float64)
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be finite and >= 0, got {array[index]} at index {index}"
        )
    return array


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
    if isinstance(num_microbatches, bool) or not isinstance(
        num_microbatches, int | np.integer
    ):
        raise ValueError(f"num_microbatches must be an int, got {num_microbatches!r}")
    count = int(num_microbatches)
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
    arrays = [np.array(g, dtype=np.float64) for g in grids]
    iteration_time = float(max(arrays[1].max(), arrays[3].max()))
    busy = count * (forward + backward).sum(axis=1)
    idle = 1.0 - busy / iteration_time if iteration_time > 0 else np.zeros(num_ranks)
    signs, chunks = _order_arrays(num_ranks, num_chunks, count)
    peak = np.cumsum(signs, axis=1).max(axis=1).astype(np.int64)
    peak_memory = None
    if memory is not None:
        held = np.cumsum(signs * np.take_along_axis(memory, chunks, axis=1), axis=1)
        peak_memory = held.max(axis=1)
    return InterleavedResult(
        num_microbatches=count,
        iteration_time=iteration_time,
        forward=forward,
        backward=backward,
        transfer=links,
        orders=tuple(tuple(o) for o in orders),
        forward_start=arrays[0],
        forward_end=arrays[1],
        backward_start=arrays[2],
        backward_end=arrays[3],
        activation_start=arrays[4],
        activation_end=arrays[5],
        gradient_start=arrays[6],
        gradient_end=arrays[7],
        busy_time=busy,
        idle_fraction=idle,
        peak_in_flight=peak,
        peak_memory=peak_memory,
    )
