"""The shared core of the pipeline simulators: the op orders of
:func:`pipedejavu.simulation.simulate.simulate`, the run loops of one iteration's
schedule, and the checks of their arguments.

:func:`run_fixed_order` and :func:`run_events` take per-stage op orders from
:func:`command_order` (op code ``b`` is ``F(s, b)``, ``B + b`` is ``B(s, b)``) and
return eight grids of seconds, lists of ``[S][B]`` (stages) or ``[S - 1][B]``
(links): forward start/end, backward start/end, activation transfer start/end,
gradient transfer start/end (NaN where no transfer is modelled).
:func:`run_fixed_order` handles free links by sweeping the stages;
:func:`run_events` shares each link first come first served in the discrete-event
loop :func:`run_interleaved`, which also runs the interleaved
(:mod:`pipedejavu.simulation.interleaved`) and zero-bubble
(:mod:`pipedejavu.simulation.zero_bubble`) schedules: the plain schedule is its
case of one chunk per rank. The model is :mod:`pipedejavu.simulation.simulate`'s.

:func:`checked_array`, :func:`checked_vector` and :func:`checked_count` check
the simulators' arguments, with the error messages they raise.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: The eight time grids every simulator's result holds, in the order the run
#: loops return them.
GRID_FIELDS = (
    "forward_start",
    "forward_end",
    "backward_start",
    "backward_end",
    "activation_start",
    "activation_end",
    "gradient_start",
    "gradient_end",
)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TimedSchedule:
    """The fields every simulated schedule's result holds (the plain
    schedules' :class:`~pipedejavu.simulation.simulate.SimulationResult` and
    the interleaved one's :class:`~pipedejavu.simulation.interleaved.
    InterleavedResult` document their shapes): the micro-batch count, the
    iteration's seconds, the per-micro-batch times given, the eight time
    grids (:data:`GRID_FIELDS`), each stage's busy seconds and idle share
    (:func:`timed_fields`), the most micro-batches in flight and the bytes
    they hold (``None`` without a memory per micro-batch)."""

    num_microbatches: int
    iteration_time: float
    forward: NDArray[np.float64]
    backward: NDArray[np.float64]
    transfer: NDArray[np.float64]
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


def checked_count(value, name: str, least: int | None = None) -> int:
    """``value`` as an int (a Python or numpy integer, not a bool), at least
    ``least`` (``None``: any).

    Raises:
        ValueError: naming ``name``, what was expected and what arrived.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def checked_array(
    value: ArrayLike, name: str, shape: tuple[int, ...]
) -> NDArray[np.float64]:
    """``value`` as f64 of ``shape``, finite and >= 0 (a bad entry is named by
    its index tuple).

    Raises:
        ValueError: naming ``name``, what was expected and what arrived.
    """
    return _checked(value, name, shape, str(shape), flat=False)


def checked_vector(
    value: ArrayLike, name: str, length: int | None
) -> NDArray[np.float64]:
    """``value`` as f64 of shape ``(length,)`` (``None``: any length, ``(S,)``
    in the error), finite and >= 0 (a bad entry is named by its int index).

    Raises:
        ValueError: naming ``name``, what was expected and what arrived.
    """
    expected = "(S,)" if length is None else f"({length},)"
    return _checked(value, name, (length,), expected, flat=True)


def _checked(value, name, shape, expected, flat):
    """:func:`checked_array`'s checks; ``None`` in ``shape`` is any size."""
    array = np.asarray(value)
    if array.dtype == object or not (
        np.issubdtype(array.dtype, np.floating)
        or np.issubdtype(array.dtype, np.integer)
    ):
        raise ValueError(f"{name} must be numeric, got dtype {array.dtype}")
    if array.ndim != len(shape) or any(
        size is not None and size != got
        for size, got in zip(shape, array.shape, strict=True)
    ):
        raise ValueError(f"{name} must have shape {expected}, got {array.shape}")
    array = array.astype(np.float64)
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        if flat:
            index = int(np.argmax(bad))
        else:
            index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be finite and >= 0, got {array[index]} at index {index}"
        )
    return array


def timed_fields(grids, busy: NDArray[np.float64], shape: tuple[int, ...]) -> dict:
    """The fields a result shares with every simulator's: the first eight
    ``grids`` as f64 arrays reshaped to ``shape`` (:data:`GRID_FIELDS`),
    ``iteration_time`` (the last forward or backward end), ``busy_time``
    (``busy``, f64[S] seconds each stage computes) and ``idle_fraction``
    (``1 - busy / iteration_time``; zeros for an iteration of 0 s)."""
    arrays = [np.array(g, dtype=np.float64).reshape(shape) for g in grids[:8]]
    iteration_time = float(max(arrays[1].max(), arrays[3].max()))
    if iteration_time > 0:
        idle = 1.0 - busy / iteration_time
    else:
        idle = np.zeros(busy.shape[0])
    return dict(
        zip(GRID_FIELDS, arrays, strict=True),
        iteration_time=iteration_time,
        busy_time=busy,
        idle_fraction=idle,
    )


def command_order(schedule: str, stage: int, num_stages: int, num_microbatches: int):
    """Op codes of a stage in run order: ``b`` is ``F(b)``, ``B + b`` is ``B(b)``."""
    count = num_microbatches
    if schedule == "gpipe":
        return list(range(2 * count))
    warmup = min(num_stages - stage, count)
    order = list(range(warmup))
    for i in range(count - warmup):
        order += [count + i, warmup + i]
    order += [count + i for i in range(count - warmup, count)]
    return order


def run_fixed_order(forward, backward, orders, num_microbatches):
    """Free links: every start is ``max(stage free, producer end)``, computed by
    sweeping the stages in alternating directions (no event queue needed: with no
    shared link nothing depends on the order in which events happen)."""
    count = num_microbatches
    num_stages = len(orders)
    last = num_stages - 1
    num_ops = 2 * count
    f_start = [[0.0] * count for _ in range(num_stages)]
    f_end = [[0.0] * count for _ in range(num_stages)]
    b_start = [[0.0] * count for _ in range(num_stages)]
    b_end = [[0.0] * count for _ in range(num_stages)]
    done_f = [0] * num_stages  # forwards (and backwards) finish in micro-batch order
    done_b = [0] * num_stages
    pointer = [0] * num_stages
    free = [0.0] * num_stages
    remaining = num_stages * num_ops
    ascending = list(range(num_stages))
    sweeps = (ascending, ascending[::-1])
    sweep = 0
    while remaining:
        progressed = 0
        for s in sweeps[sweep & 1]:
            k = pointer[s]
            if k == num_ops:
                continue
            order, t = orders[s], free[s]
            f, b_time = forward[s], backward[s]
            fs, fe, bs, be = f_start[s], f_end[s], b_start[s], b_end[s]
            nf, nb = done_f[s], done_b[s]
            upstream_done = done_f[s - 1] if s else count
            upstream_end = f_end[s - 1]
            downstream_done = done_b[s + 1] if s < last else count
            downstream_end = b_end[s + 1] if s < last else None
            start_k = k
            while k < num_ops:
                code = order[k]
                if code < count:
                    if code >= upstream_done:
                        break
                    if s and upstream_end[code] > t:
                        t = upstream_end[code]
                    fs[code] = t
                    t += f
                    fe[code] = t
                    nf += 1
                else:
                    code -= count
                    if code >= downstream_done:
                        break
                    if s < last and downstream_end[code] > t:
                        t = downstream_end[code]
                    bs[code] = t
                    t += b_time
                    be[code] = t
                    nb += 1
                k += 1
            pointer[s], free[s], done_f[s], done_b[s] = k, t, nf, nb
            progressed += k - start_k
        if not progressed:  # pragma: no cover - the orders are deadlock-free
            raise RuntimeError("the schedule deadlocked")
        remaining -= progressed
        sweep += 1
    nan = [[math.nan] * count for _ in range(last)]
    return f_start, f_end, b_start, b_end, nan, nan, nan, nan


def run_events(forward, backward, transfer, orders, num_microbatches):
    """Shared links: a discrete-event simulation in time order, so that each link
    serves its requests first come first served (:func:`run_interleaved` with
    one chunk per rank and no wrap-around link)."""
    count = num_microbatches
    codes = [(False, 0, b, False) for b in range(count)]
    codes += [(True, 0, b, False) for b in range(count)]
    ops = [[codes[c] for c in order] for order in orders]
    per_rank = [[[t] for t in times] for times in (forward, backward)]
    grids = run_interleaved(*per_rank, [*transfer, 0.0], ops, count)
    stages = [[row[0] for row in g] for g in grids[:8]]
    # rank l sends its activations, rank l + 1 its gradients, over link l
    return (*stages[:4], *(g[:-1] for g in stages[4:6]), *(g[1:] for g in stages[6:]))


def run_interleaved(
    forward, backward, transfer, orders, num_microbatches, weight=None, v_shape=False
):
    """The event loop: ``forward``/``backward`` ``[P][V]`` seconds, ``transfer``
    ``[P]`` seconds, ``orders`` ``[P]`` lists of
    :class:`~pipedejavu.simulation.interleaved.Op` (or such 4-tuples), ``weight``
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
                route, sent_start, sent_end = after_b[r][chunk], g_start, g_end
                ready = b_ready
            else:
                f_end[r][chunk][microbatch] = now
                route, sent_start, sent_end = after_f[r][chunk], a_start, a_end
                ready = f_ready
            if route is not None:
                to, to_chunk, link = route
                arrival = now
                # the link carries it (first come first served) unless free
                if link is not None and not transfer[link] <= 0:
                    start = now if now > link_free[link] else link_free[link]
                    arrival = link_free[link] = start + transfer[link]
                    sent_start[r][chunk][microbatch] = start
                    sent_end[r][chunk][microbatch] = arrival
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
