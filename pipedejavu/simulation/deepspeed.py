"""DeepSpeed's pipeline schedule (``TrainSchedule``) with blocking transfers.

Used by :func:`pipedejavu.simulation.simulate.simulate` for ``schedule="deepspeed"``.

**The command stream.** DeepSpeed's pipeline engine runs ``2 (B + S - 1)`` steps
on every stage. On step ``k`` stage ``s`` works forward when ``k + s`` is even and
backward otherwise, on micro-batch

* forward: ``k // 2 - s // 2`` (``k`` even) or ``(k - 1) // 2 - s // 2`` (odd);
* backward: ``k // 2 - S + (s + 1) // 2`` (``k`` even) or
  ``(k - 1) // 2 - S + 1 + s // 2`` (odd);

(ids outside ``0..B-1`` mean "nothing this step"). A forward step first sends the
gradient of the previous step's micro-batch back (``SendGrad``) and receives this
micro-batch's activation (``RecvActivation``); a backward step first receives the
gradient (``RecvGrad``) and then sends the activation of the previous step's
micro-batch on (``SendActivation``); then it computes. The compute order this
gives is 1F1B: ``min(S - s, B)`` warm-up forwards, then one backward and one
forward alternately, then the remaining backwards.

**Transfers.** DeepSpeed's point-to-point ops are synchronous NCCL calls on the
stage's stream. A *blocking* link (a message larger than the library's buffer)
is a rendezvous: the transfer starts when *both* stages have reached it, lasts
``transfer[l]`` (activation) or ``gradient_transfer[l]`` (gradient) seconds on
link ``l``, and keeps both stages busy. On a *buffered* link the sender hands
the message over and goes on (waiting only while the previous message in that
direction has not been taken), the message arrives ``transfer[l]`` seconds
later, and the receiver waits only for its arrival. Compute never overlaps a
stage's own rendezvous. (Contrast the ``"1f1b"`` schedule of
:mod:`pipedejavu.simulation.schedules`, where links are separate resources.)

**Two ways to run it.** :func:`run_deepspeed` runs a program of ops in an
order that respects every wait, one op at a time; for pipelines of 16 stages
or more (or many micro-batches) whose links all block or all buffer it runs
one DeepSpeed step of all stages at once with numpy (:func:`run_by_steps`:
the steps pair the stages up, see the note above it), with the same times.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

# Command codes.
FORWARD, BACKWARD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = range(6)
_MATCH = {
    SEND_ACT: RECV_ACT,
    RECV_ACT: SEND_ACT,
    SEND_GRAD: RECV_GRAD,
    RECV_GRAD: SEND_GRAD,
}


def _microbatches(
    num_stages: int, count: int, stages: NDArray[np.int64] | None = None
) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """i64[K, S'] the micro-batch each stage works on at each of the ``K = 2
    (B + S - 1)`` steps (the module docstring's formulas; outside ``0 .. B -
    1``: nothing), and bool[K, S'] whether that step is a forward, for
    ``stages`` (``None``: every stage)."""
    step = np.arange(2 * (count + num_stages - 1))[:, None]
    stage = np.arange(num_stages) if stages is None else np.asarray(stages)
    stage = stage[None, :]
    forward = (step + stage) % 2 == 0
    half = step // 2  # (k - 1) // 2 == k // 2 for odd k
    backward = np.where(
        step % 2 == 1,
        half - num_stages + 1 + stage // 2,
        half - num_stages + (stage + 1) // 2,
    )
    return np.where(forward, half - stage // 2, backward), forward


def deepspeed_commands(
    stage: int, num_stages: int, num_microbatches: int
) -> list[tuple[int, int]]:
    """The ``(code, micro-batch)`` commands stage ``stage`` runs, in order.

    Codes: :data:`FORWARD`, :data:`BACKWARD`, :data:`SEND_ACT` (to ``stage + 1``),
    :data:`RECV_ACT` (from ``stage - 1``), :data:`SEND_GRAD` (to ``stage - 1``),
    :data:`RECV_GRAD` (from ``stage + 1``).
    """
    count = num_microbatches
    has_prev, has_next = stage > 0, stage < num_stages - 1
    commands: list[tuple[int, int]] = []
    previous = -1
    ids, forwards = _microbatches(num_stages, count, np.array([stage]))
    for current, forward in zip(
        ids[:, 0].tolist(), forwards[:, 0].tolist(), strict=True
    ):
        current_ok, previous_ok = 0 <= current < count, 0 <= previous < count
        if forward:
            if previous_ok and has_prev:
                commands.append((SEND_GRAD, previous))
            if current_ok and has_prev:
                commands.append((RECV_ACT, current))
            if current_ok:
                commands.append((FORWARD, current))
        else:
            if current_ok and has_next:
                commands.append((RECV_GRAD, current))
            if previous_ok and has_next:
                commands.append((SEND_ACT, previous))
            if current_ok:
                commands.append((BACKWARD, current))
        previous = current
    return commands


def compute_order(
    commands: Sequence[tuple[int, int]], num_microbatches: int
) -> list[int]:
    """The compute commands as op codes of :mod:`pipedejavu.simulation.schedules`
    (``b`` = forward of ``b``, ``B + b`` = backward of ``b``)."""
    return [
        b if code == FORWARD else num_microbatches + b
        for code, b in commands
        if code in (FORWARD, BACKWARD)
    ]


def run_deepspeed(
    forward,
    backward,
    transfer,
    gradient_transfer,
    blocking,
    num_microbatches,
    *,
    method: str = "auto",
):
    """Simulate the command streams.

    Args:
        forward, backward: lists of S seconds per micro-batch.
        transfer, gradient_transfer: lists of S - 1 seconds per link.
        blocking: list of S - 1 bools per link: ``True`` = rendezvous (both
            stages busy for the transfer), ``False`` = buffered (module doc).
        num_microbatches: B.
        method: ``"program"`` (op by op), ``"steps"`` (:func:`run_by_steps`;
            links must all block or all buffer) or ``"auto"``: by steps for 16
            stages or more, or past the cached programs' size, when the links
            allow it.

    Returns:
        ``(orders, grids)``: per stage its compute order (see
        :func:`compute_order`) and the eight ``[S][B]`` / ``[S - 1][B]`` grids of
        :mod:`pipedejavu.simulation.schedules` (transfers recorded even when they take
        0 s): lists, or numpy arrays when the pipeline runs by steps
        (:func:`run_by_steps`, for long pipelines whose links all block or all
        buffer; the same numbers).
    """
    count = num_microbatches
    num_stages = len(forward)
    modes = tuple(bool(x) for x in blocking)
    if method not in ("auto", "program", "steps"):
        raise ValueError(f"method must be auto, program or steps, got {method!r}")
    if method == "steps" and len(set(modes)) > 1:
        raise ValueError("by steps, the links must all block or all buffer")
    long = num_stages >= _BY_STEPS_STAGES or num_stages * count > _CACHED_SIZE
    if method == "steps" or (method == "auto" and len(set(modes)) <= 1 and long):
        return run_by_steps(
            forward, backward, transfer, gradient_transfer, all(modes), count
        )
    if num_stages * count <= _CACHED_SIZE:
        program, orders = _cached_program(num_stages, count, modes)
    elif num_stages * count <= _LARGE_CACHED_SIZE:  # the last two large ones
        program, orders = _large_cached_program(num_stages, count, modes)
    else:  # larger: built for this call only (a program holds 4 to 6 S B ops)
        program, orders = _program(num_stages, count, modes)

    def grid(rows):
        return [[math.nan] * count for _ in range(rows)]

    f_start, f_end, b_start, b_end = (grid(num_stages) for _ in range(4))
    a_start, a_end, g_start, g_end = (grid(num_stages - 1) for _ in range(4))
    grids = {0: (a_start, a_end), 1: (g_start, g_end)}
    seconds = {0: transfer, 1: gradient_transfer}
    clock = [0.0] * num_stages
    # Buffered links, per (link, direction): arrival time of each message sent,
    # and when the last message was taken.
    arrival: dict = {}
    taken: dict = {}
    for op in program:
        kind, s, b = op[0], op[1], op[2]
        if kind == _FORWARD_OP:
            start = clock[s]
            clock[s] = start + forward[s]
            f_start[s][b], f_end[s][b] = start, clock[s]
        elif kind == _BACKWARD_OP:
            start = clock[s]
            clock[s] = start + backward[s]
            b_start[s][b], b_end[s][b] = start, clock[s]
        elif kind == _RENDEZVOUS_OP:
            _, s, b, peer, link, direction = op
            start = max(clock[s], clock[peer])
            end = start + seconds[direction][link]
            starts, ends = grids[direction]
            starts[link][b], ends[link][b] = start, end
            clock[s] = clock[peer] = end
        elif kind == _SEND_OP:
            _, s, b, link, direction = op
            start = max(clock[s], taken.get((link, direction), 0.0))
            clock[s] = start
            end = start + seconds[direction][link]
            starts, ends = grids[direction]
            starts[link][b], ends[link][b] = start, end
            arrival[(link, direction, b)] = end
        else:  # _RECEIVE_OP
            _, s, b, link, direction = op
            clock[s] = max(clock[s], arrival.pop((link, direction, b)))
            taken[(link, direction)] = clock[s]
    orders = [list(order) for order in orders]
    return orders, (f_start, f_end, b_start, b_end, a_start, a_end, g_start, g_end)


# From this many stages, or past the cached programs' size, links that all
# block or all buffer run by steps (:func:`run_by_steps`): a vectorized step of
# every stage costs a few microseconds whatever the stages, an op of a cached
# program under one, with 4 to 6 ops per (stage, micro-batch), and building a
# program costs 4 to 5 times more than running it. At 8 stages a cached
# program still runs faster, from 16 the steps do
# (``benchmarks/simulator_speed.py``).
_BY_STEPS_STAGES = 16

# Ops of a compiled program (:func:`_program`).
_FORWARD_OP, _BACKWARD_OP, _RENDEZVOUS_OP, _SEND_OP, _RECEIVE_OP = range(5)


# Shapes up to this many (stage, micro-batch) pairs keep their program cached
# (at most 16 programs of 4 (blocking links) to 6 (buffered) x 8192 ops: under
# 80 MB).
_CACHED_SIZE = 8192
# Larger shapes up to this many pairs: the last two programs (28 MB blocking,
# 39 MB buffered at 65536 pairs, measured: under 80 MB together); building one
# takes most of a prediction of a 64-stage pipeline of 512 micro-batches.
_LARGE_CACHED_SIZE = 65536


def _program(num_stages: int, count: int, blocking: tuple[bool, ...]) -> tuple:
    """The order in which the command streams advance, as a flat program.

    Which command can go next depends only on the streams' positions (a
    rendezvous waits for the peer to reach its match; a buffered send waits for
    the previous message in its direction to be taken, a receive for its
    message to be sent), never on the times, so a sweep over the stages
    (alternating direction, each stage as far as it can go) gives an order in
    which every op comes after what it waits for. Running that order with the
    times (:func:`run_deepspeed`) computes each op's start as the max of its
    stage's clock and what it waits for: the times of an event-by-event
    simulation (the previous implementation, which this one matched bit for
    bit on 3,000 random pipelines). Returns ``(ops, compute orders)``.
    """
    streams = tuple(
        tuple(deepspeed_commands(s, num_stages, count)) for s in range(num_stages)
    )
    orders = tuple(tuple(compute_order(x, count)) for x in streams)
    pointer = [0] * num_stages
    sent: set = set()  # (link, direction, micro-batch) sent, not yet received
    pending: set = set()  # (link, direction) whose buffer holds a message
    program: list[tuple] = []
    remaining = sum(len(stream) for stream in streams)
    sweep = 0
    while remaining:
        progressed = 0
        order = range(num_stages) if sweep % 2 == 0 else range(num_stages - 1, -1, -1)
        for s in order:
            stream = streams[s]
            while pointer[s] < len(stream):
                code, b = stream[pointer[s]]
                if code == FORWARD or code == BACKWARD:
                    op = _FORWARD_OP if code == FORWARD else _BACKWARD_OP
                    program.append((op, s, b))
                    pointer[s] += 1
                    progressed += 1
                    continue
                peer = s + 1 if code in (SEND_ACT, RECV_GRAD) else s - 1
                link = min(s, peer)
                direction = 0 if code in (SEND_ACT, RECV_ACT) else 1
                if not blocking[link]:
                    if code in (SEND_ACT, SEND_GRAD):
                        if (link, direction) in pending:
                            break  # the previous message still fills the buffer
                        pending.add((link, direction))
                        sent.add((link, direction, b))
                        program.append((_SEND_OP, s, b, link, direction))
                    else:
                        if (link, direction, b) not in sent:
                            break  # not sent yet
                        sent.discard((link, direction, b))
                        pending.discard((link, direction))
                        program.append((_RECEIVE_OP, s, b, link, direction))
                    pointer[s] += 1
                    progressed += 1
                    continue
                peer_stream = streams[peer]
                if pointer[peer] >= len(peer_stream) or peer_stream[pointer[peer]] != (
                    _MATCH[code],
                    b,
                ):
                    break  # wait: the peer matches when it reaches its command
                program.append((_RENDEZVOUS_OP, s, b, peer, link, direction))
                pointer[s] += 1
                pointer[peer] += 1
                progressed += 2
        if not progressed:  # pragma: no cover - DeepSpeed's order is deadlock-free
            raise RuntimeError("the DeepSpeed schedule deadlocked")
        remaining -= progressed
        sweep += 1
    return tuple(program), orders


_cached_program = functools.lru_cache(maxsize=16)(_program)
_large_cached_program = functools.lru_cache(maxsize=2)(_program)


# ---------------------------------------------------------------- by steps
#
# DeepSpeed's steps pair the stages up. On step ``k`` a stage ``w`` with
# ``k + w`` even works forward and exchanges only with ``w - 1`` (SendGrad,
# RecvActivation), and ``u = w - 1`` works backward and exchanges only with
# ``w`` (RecvGrad, SendActivation). The pairs ``(u, u + 1)`` of one step are
# disjoint, the two stages of a pair exchange what the other expects on the
# same step (the gradient first, then the activation), and nothing waits for a
# later step: :func:`run_by_steps` computes a step of all pairs at once, with
# the max and + of :func:`run_deepspeed`'s program on the same numbers (the
# same times, bit for bit: tests/test_deepspeed_schedule.py).


def _pairs(width: int, parity: int) -> NDArray[np.int64]:
    """Stage ``u`` of each pair of a step of ``parity`` (``u + 1 = parity``
    mod 2) in :func:`run_by_steps`'s clock layout (stage ``s`` at ``s + 1``, a
    dummy stage at each end; stage -1 and ``S`` are dummies)."""
    if parity == 0:  # clock.reshape(-1, 2): (0, 1), (2, 3), ...
        return 2 * np.arange(width // 2) - 1
    return 2 * np.arange(width // 2 - 1)  # clock[1:-1]: (1, 2), (3, 4), ...


class StepTables(NamedTuple):
    """What :func:`run_by_steps` reads of a pipeline's shape: i64[K, S]
    micro-batch of each (step, stage) and of the step before, bool[K, S]
    forward step and valid micro-batch, the clock ``width`` (stages plus
    dummies), and per parity ``(u, link, grad, act)``: its pairs' ``u``, whether
    that is a link, and bool[steps of that parity, pairs] gradient and
    activation exchanges."""

    current: NDArray[np.int64]
    previous: NDArray[np.int64]
    forward: NDArray[np.bool_]
    valid: NDArray[np.bool_]
    width: int
    parities: tuple


def step_tables(num_stages: int, count: int) -> StepTables:
    """What :func:`run_by_steps` reads for a shape (the times apart): the
    micro-batch, forward and valid flags of each (step, stage), and per parity
    its pairs' ``u`` and the bool[steps of that parity, pairs] gradient and
    activation exchanges."""
    current, forward = _microbatches(num_stages, count)
    step = np.arange(current.shape[0])[:, None]
    previous = np.vstack([np.full((1, num_stages), -1), current[:-1]])
    valid = (current >= 0) & (current < count)
    had = (previous >= 0) & (previous < count)
    width = 2 * ((num_stages + 4) // 2)
    tables = []
    for parity in (0, 1):
        u = _pairs(width, parity)
        link = (u >= 0) & (u < num_stages - 1)
        lo, hi = np.where(link, u, 0), np.where(link, u + 1, 0)
        rows = step[parity::2, 0][:, None]
        # RecvGrad of u's own micro-batch meets SendGrad of w's previous one;
        # SendActivation of u's previous one meets RecvActivation of w's own.
        grad = link & valid[rows, lo] & ~forward[rows, lo]
        act = link & had[rows, lo] & ~forward[rows, lo]
        if not (
            np.array_equal(grad, link & had[rows, hi] & forward[rows, hi])
            and np.array_equal(act, link & valid[rows, hi] & forward[rows, hi])
            and np.all((current[rows, lo] == previous[rows, hi])[grad])
            and np.all((previous[rows, lo] == current[rows, hi])[act])
        ):  # pragma: no cover - DeepSpeed's steps pair up (module note above)
            raise RuntimeError("DeepSpeed's exchanges do not pair up by step")
        tables.append((u, link, grad, act))
    return StepTables(current, previous, forward, valid, width, tuple(tables))


# Tables of shapes up to the large programs' size stay cached (19 bytes per
# (step, stage), measured: at most 16 x 5 MB at 65536 (stage, micro-batch)
# pairs).
_cached_step_tables = functools.lru_cache(maxsize=16)(step_tables)


def run_by_steps(
    forward, backward, transfer, gradient_transfer, blocking: bool, num_microbatches
):
    """:func:`run_deepspeed` when every link blocks (``blocking``) or every
    link buffers; the same ``(orders, grids)``, as numpy arrays."""
    count = num_microbatches
    forward = np.asarray(forward, dtype=np.float64)
    num_stages = forward.shape[0]
    if num_stages * count <= _LARGE_CACHED_SIZE:
        steps = _cached_step_tables(num_stages, count)
    else:
        steps = step_tables(num_stages, count)
    tables, width = steps.parities, steps.width
    num_steps = steps.current.shape[0]
    work = np.zeros((num_steps, width))  # seconds of each (step, padded stage)
    work[:, 1 : num_stages + 1] = np.where(
        steps.valid,
        np.where(steps.forward, forward, np.asarray(backward, np.float64)),
        0.0,
    )
    seconds = []  # per parity: (gradient, activation) seconds of each pair's link
    for u, link, _, _ in tables:
        on = np.where(link, u, 0)
        seconds.append(
            tuple(
                np.where(link, np.asarray(x, np.float64)[on], 0.0)
                if num_stages > 1
                else np.zeros(len(u))
                for x in (gradient_transfer, transfer)
            )
        )
    masks = [(list(t[2]), list(t[3])) for t in tables]
    clock = np.zeros(width)
    views = []
    for pairs in (clock.reshape(-1, 2), clock[1:-1].reshape(-1, 2)):
        views.append((pairs[:, 0], pairs[:, 1]))
    # Every clock before the step (row k), after its gradient exchange, its
    # activation exchange and its compute (row k + 1).
    after = np.zeros((num_steps + 1, 3, width))
    sends = np.zeros((num_steps, 2, width // 2))  # buffered: send starts
    # Buffered: when each link's last message was taken, per direction, at
    # its u's place (as the clocks).
    held_at = [np.zeros(width), np.zeros(width)]
    taken = [
        [(x.reshape(-1, 2)[:, 0], x[1:-1].reshape(-1, 2)[:, 0])[p] for p in (0, 1)]
        for x in held_at
    ]
    for k in range(num_steps):
        parity, row = k % 2, k // 2
        u, w = views[parity]
        for phase in (0, 1):
            mask = masks[parity][phase][row]
            if blocking:  # a rendezvous: both wait, both are busy
                end = np.maximum(u, w)
                end += seconds[parity][phase]
                np.copyto(u, end, where=mask)
                np.copyto(w, end, where=mask)
            else:  # hand over (after the last one was taken), then receive
                sender, receiver = (w, u) if phase == 0 else (u, w)
                held = taken[phase][parity]
                start = np.maximum(sender, held)
                sends[k, phase, : len(u)] = start
                np.copyto(sender, start, where=mask)
                arrival = start + seconds[parity][phase]
                np.maximum(receiver, arrival, out=arrival)
                np.copyto(receiver, arrival, where=mask)
                np.copyto(held, receiver, where=mask)
            after[k + 1, phase] = clock
        clock += work[k]
        after[k + 1, 2] = clock
    return _step_grids(steps, count, seconds, (after, sends), blocking)


def _step_grids(steps: StepTables, count, seconds, clocks, blocking):
    """:func:`run_by_steps`'s orders and eight grids, read off its clocks."""
    after, sends = clocks
    current, previous, tables = steps.current, steps.previous, steps.parities
    is_forward, valid = steps.forward, steps.valid
    num_stages = current.shape[1]
    codes = np.where(is_forward, current, count + current)
    orders = codes.T[valid.T].reshape(num_stages, 2 * count)

    def grid(rows):
        return np.full((rows, count), np.nan)

    f_start, f_end, b_start, b_end = (grid(num_stages) for _ in range(4))
    for is_f, (start, end) in ((True, (f_start, f_end)), (False, (b_start, b_end))):
        k, s = np.nonzero(valid & (is_forward == is_f))
        b = current[k, s]
        start[s, b] = after[k + 1, 1, s + 1]
        end[s, b] = after[k + 1, 2, s + 1]
    transfers = []  # (start, end) of activations, then gradients
    for phase, microbatch in ((1, previous), (0, current)):
        start_grid, end_grid = grid(num_stages - 1), grid(num_stages - 1)
        for parity, (u, _, grad, act) in enumerate(tables):
            row, j = np.nonzero(act if phase == 1 else grad)
            k = 2 * row + parity
            link = u[j]
            if blocking:  # the later of the two clocks before the exchange
                rows, before = (k + 1, 0) if phase == 1 else (k, 2)
                start = np.maximum(
                    after[rows, before, link + 1], after[rows, before, link + 2]
                )
            else:
                start = sends[k, phase, j]
            b = microbatch[k, link]
            start_grid[link, b] = start
            end_grid[link, b] = start + seconds[parity][phase][j]
        transfers += [start_grid, end_grid]
    return orders, (f_start, f_end, b_start, b_end, *transfers)


def clear_caches() -> None:
    """Forget the programs and step tables kept per shape (to time a cold
    start: ``benchmarks/simulator_speed.py``)."""
    _cached_program.cache_clear()
    _large_cached_program.cache_clear()
    _cached_step_tables.cache_clear()
