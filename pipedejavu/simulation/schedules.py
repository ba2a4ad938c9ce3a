"""The run loops of :func:`pipedejavu.simulation.simulate.simulate`: one iteration's
schedule.

Both take per-stage op orders from :func:`command_order` (op code ``b`` is ``F(s, b)``,
``B + b`` is ``B(s, b)``) and return eight grids of seconds, lists of
``[S][B]`` (stages) or ``[S - 1][B]`` (links): forward start/end, backward
start/end, activation transfer start/end, gradient transfer start/end (NaN where
no transfer is modelled). :func:`run_fixed_order` handles free links by
sweeping the stages; :func:`run_events` shares each link first come first served
in a discrete-event loop. The model is :mod:`pipedejavu.simulation.simulate`'s.
"""

from __future__ import annotations

import heapq
import math


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
    serves its requests first come first served."""
    count = num_microbatches
    num_stages = len(orders)
    last = num_stages - 1
    num_ops = 2 * count

    def grid(rows, fill):
        return [[fill] * count for _ in range(rows)]

    f_start, f_end = grid(num_stages, 0.0), grid(num_stages, 0.0)
    b_start, b_end = grid(num_stages, 0.0), grid(num_stages, 0.0)
    a_start, a_end = grid(last, math.nan), grid(last, math.nan)
    g_start, g_end = grid(last, math.nan), grid(last, math.nan)
    # Arrival of each input (None = not yet); stage 0's activations and the last
    # stage's gradients (its own forward, ordered before) are there from the start.
    f_ready = [[0.0] * count] + grid(last, None)
    b_ready = grid(last, None) + [[0.0] * count]
    pointer = [0] * num_stages
    free = [0.0] * num_stages
    idle = [True] * num_stages
    link_free = [0.0] * last
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def try_start(s):
        nonlocal counter
        k = pointer[s]
        if k == num_ops:
            return
        code = orders[s][k]
        if code < count:
            ready = f_ready[s][code]
            if ready is None:
                return
            start = ready if ready > free[s] else free[s]
            f_start[s][code] = start
            end = start + forward[s]
        else:
            ready = b_ready[s][code - count]
            if ready is None:
                return
            start = ready if ready > free[s] else free[s]
            b_start[s][code - count] = start
            end = start + backward[s]
        idle[s] = False
        counter += 1
        # At equal end times backwards pop first, so a gradient claims a link
        # before an activation requested at the same instant.
        heapq.heappush(heap, (end, code < count, counter, s))

    for s in range(num_stages):
        try_start(s)
    while heap:
        now, _, _, s = heapq.heappop(heap)
        code = orders[s][pointer[s]]
        pointer[s] += 1
        free[s] = now
        idle[s] = True
        if code < count:
            f_end[s][code] = now
            if s < last:
                arrival = now
                if transfer[s] > 0:
                    start = now if now > link_free[s] else link_free[s]
                    arrival = link_free[s] = start + transfer[s]
                    a_start[s][code], a_end[s][code] = start, arrival
                f_ready[s + 1][code] = arrival
                if idle[s + 1]:
                    try_start(s + 1)
        else:
            code -= count
            b_end[s][code] = now
            if s:
                arrival = now
                if transfer[s - 1] > 0:
                    start = now if now > link_free[s - 1] else link_free[s - 1]
                    arrival = link_free[s - 1] = start + transfer[s - 1]
                    g_start[s - 1][code], g_end[s - 1][code] = start, arrival
                b_ready[s - 1][code] = arrival
                if idle[s - 1]:
                    try_start(s - 1)
        try_start(s)
    if any(k != num_ops for k in pointer):  # pragma: no cover - deadlock-free
        raise RuntimeError("the schedule deadlocked")
    return f_start, f_end, b_start, b_end, a_start, a_end, g_start, g_end
