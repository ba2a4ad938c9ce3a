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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

# Command codes.
FORWARD, BACKWARD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = range(6)
_MATCH = {
    SEND_ACT: RECV_ACT,
    RECV_ACT: SEND_ACT,
    SEND_GRAD: RECV_GRAD,
    RECV_GRAD: SEND_GRAD,
}


def _microbatch(step: int, stage: int, num_stages: int) -> tuple[int, bool]:
    forward = (step + stage) % 2 == 0
    if forward:
        base = step // 2 if step % 2 == 0 else (step - 1) // 2
        return base - stage // 2, True
    if step % 2 == 0:
        return step // 2 - num_stages + (stage + 1) // 2, False
    return (step - 1) // 2 - num_stages + 1 + stage // 2, False


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
    for step in range(2 * (count + num_stages - 1)):
        current, forward = _microbatch(step, stage, num_stages)
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
    forward, backward, transfer, gradient_transfer, blocking, num_microbatches
):
    """Simulate the command streams.

    Args:
        forward, backward: lists of S seconds per micro-batch.
        transfer, gradient_transfer: lists of S - 1 seconds per link.
        blocking: list of S - 1 bools per link: ``True`` = rendezvous (both
            stages busy for the transfer), ``False`` = buffered (module doc).
        num_microbatches: B.

    Returns:
        ``(orders, grids)``: per stage its compute order (see
        :func:`compute_order`) and the eight ``[S][B]`` / ``[S - 1][B]`` grids of
        :mod:`pipedejavu.simulation.schedules` (transfers recorded even when they take
        0 s).
    """
    count = num_microbatches
    num_stages = len(forward)
    modes = tuple(bool(x) for x in blocking)
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
