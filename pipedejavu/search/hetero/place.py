"""Hosts for relaxed plans: packing, and the exact search when packing fails.

**Packing** (:func:`realize`). A relaxed plan (:mod:`pipedejavu.search.hetero.dp`)
fixes its units; it is valid iff, for every type ``t``, its blocks fit the
``N_t`` hosts of the type left by its whole stages (every host filled exactly:
the devices add up, so fitting is filling), where two consecutive blocks of
type ``t`` must sit on different hosts when the intra-host link is strictly
slower than the inter-host one at their boundary. (When it is not slower, two
such blocks may share a host: the transfer then takes the intra-host link,
which costs no more, so the plan is valid and no dearer than R priced it;
since R's value is a lower bound, it costs exactly that.) Device windows are
laid side by side on each host; whole stages take hosts of their composition
with a host of their first type first and one of their last type last.

**Exact search** (:func:`astar`). When R's plan does not pack, the optimum
under the cap is found by A* over units whose state also holds every host's
fill (a multiset per type; hosts of one type are interchangeable) and, for the
conflict rule above, the host the last block sits on. R's values are the
heuristic: every continuation of an explicit state is a relaxed continuation
of its totals at the same cost, so the heuristic is consistent and the first
finished plan popped is optimal (min-sum: ``f = g + h``; min-max:
``f = max(g, h)``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Any

import numpy as np

from pipedejavu.search.hetero.dp import (
    Interrupted,
    Relaxed,
    Unit,
    following,
    trace_block,
    whole_unit,
)
from pipedejavu.search.hetero.units import Setup, layer_row

__all__ = ["astar", "realize", "stage_tuples"]

Placement = list[tuple[tuple[int, ...], int]]


def stage_tuples(units: list[Unit]) -> list[tuple[int, int, int, int, int]]:
    """``(start, stop, submesh, config, type)`` of every stage, in order."""
    return [
        (start, stop, m, k, unit.price)
        for unit in units
        for start, stop, m, k in unit.stages
    ]


def _pack(widths, neighbours, num_bins, capacity):
    """Bins (one per block) filling ``num_bins`` bins of ``capacity`` exactly
    with no two neighbours in one bin, or None."""
    count = len(widths)
    if sum(widths) != num_bins * capacity:
        return None
    order = sorted(range(count), key=lambda i: -widths[i])
    where = [-1] * count
    room = [capacity] * num_bins

    def place(position: int) -> bool:
        if position == count:
            return True
        item = order[position]
        tried_empty = set()
        for slot in range(num_bins):
            if room[slot] < widths[item]:
                continue
            if room[slot] == capacity:  # empty bins are interchangeable
                if tried_empty:
                    continue
                tried_empty.add(slot)
            if any(where[j] == slot for j in neighbours[item]):
                continue
            where[item] = slot
            room[slot] -= widths[item]
            if place(position + 1):
                return True
            room[slot] += widths[item]
            where[item] = -1
        return False

    return where if place(0) else None


def _whole_hosts(pool: dict[int, list[int]], setup: Setup, unit: Unit) -> tuple:
    """Hosts for a whole stage from ``pool`` (type -> free host ids), first one
    of its first type, last one of its last type."""
    whole = setup.wholes[unit.whole]
    taken = {
        t: [pool[t].pop() for _ in range(c)] for t, c in enumerate(whole.composition)
    }
    first = taken[unit.first].pop(0)
    if sum(whole.composition) == 1:
        return (first,)
    last = taken[unit.last].pop(0)
    middle = [x for t in sorted(taken) for x in taken[t]]
    return (first, *middle, last)


def realize(problem, setup: Setup, units: list[Unit]) -> Placement | None:
    """Hosts and first devices of every stage of ``units``, or None when its
    blocks cannot be packed (module docstring)."""
    cluster = problem.cluster
    pool = {t: list(cluster.hosts_of_type(t))[::-1] for t in range(setup.num_types)}
    placement: list[Any] = [None] * len(units)
    for index, unit in enumerate(units):
        if unit.kind == "whole":
            placement[index] = (_whole_hosts(pool, setup, unit), 0)
    for t in range(setup.num_types):
        blocks = [i for i, u in enumerate(units) if u.kind == "block" and u.type == t]
        if not blocks:
            continue
        position = {unit: n for n, unit in enumerate(blocks)}
        neighbours: list[list[int]] = [[] for _ in blocks]
        for n, i in enumerate(blocks):
            following_unit = i + 1
            if (
                following_unit in position
                and setup.conflict[units[following_unit].stages[0][0], t]
            ):
                j = position[following_unit]
                neighbours[n].append(j)
                neighbours[j].append(n)
        widths = [units[i].width for i in blocks]
        bins = _pack(widths, neighbours, len(pool[t]), setup.dph)
        if bins is None:
            return None
        hosts = pool[t][::-1]
        offset = [0] * len(hosts)
        for n, i in enumerate(blocks):
            placement[i] = (hosts[bins[n]], offset[bins[n]])
            offset[bins[n]] += units[i].width
    stages: Placement = []
    for unit, (hosts, first) in zip(units, placement, strict=True):
        if unit.kind == "whole":
            stages.append((hosts, 0))
            continue
        for _start, _stop, m, _ in unit.stages:
            stages.append(((hosts,), first))
            first += int(problem.submesh_shapes[m, 1])
    return stages


def _replace(fills: tuple, t: int, old: int, new: int) -> tuple:
    row = list(fills[t])
    row.remove(old)
    row.append(new)
    return fills[:t] + (tuple(sorted(row)),) + fills[t + 1 :]


def astar(
    problem,
    setup: Setup,
    relaxed: Relaxed,
    *,
    threshold: float = math.inf,
    deadline: float = math.inf,
) -> tuple[float, list[Unit] | None, Placement | None]:
    """The optimum of the exact problem under ``relaxed``'s cap and buckets.

    Returns:
        ``(value, units, placement)`` of an optimal plan whose value is below
        ``threshold``, or ``(bound, None, None)`` with ``bound`` a lower bound on
        every plan (``>= threshold``; inf when none exists).
    """
    tables = relaxed.tables
    combine = tables.combine
    counter = itertools.count()
    heap: list = []
    nodes: list = []  # (state, g, parent, step)
    closed: set = set()
    rejected = [math.inf]

    def push(state, g, h, parent, step):
        f = float(combine(g, h))
        if not f < threshold:
            rejected[0] = min(rejected[0], f)
            return
        nodes.append((state, g, parent, step))
        heapq.heappush(heap, (f, -state[0], next(counter), len(nodes) - 1))

    start_fills = tuple((0,) * n for n in setup.hosts)
    for bucket in range(1, tables.num_buckets + 1):
        push((0, bucket, start_fills, -1, None), 0.0, 0.0, -1, None)
    while heap:
        if time.perf_counter() > deadline:
            raise Interrupted
        f, _, _, node = heapq.heappop(heap)
        state, g, _, _ = nodes[node]
        if state in closed:
            continue
        closed.add(state)
        if state[0] == setup.num_layers:
            return f, *_path(problem, setup, tables, nodes, node)
        _expand(setup, relaxed, state, g, node, push)
    return rejected[0], None, None


def _expand(setup: Setup, relaxed: Relaxed, state, g, node, push) -> None:
    """Push every successor of one state (blocks on each distinct host fill,
    whole stages on fresh hosts)."""
    tables, values = relaxed.tables, relaxed.values
    combine = tables.combine
    num_layers, dph, num_types = setup.num_layers, setup.dph, setup.num_types
    start, bucket, fills, last_type, last_block = state

    def cell(new_fills) -> int:
        totals = tuple(sum(row) for row in new_fills)
        return int(np.ravel_multi_index(totals, setup.grid)) * num_types

    for (t, first), table in tables.blocks.items():
        if first != bucket:
            continue
        enter = 0.0 if start == 0 else tables.inter[start, last_type, t]
        if not math.isfinite(enter):
            continue
        for (width, after), block in table.items():
            lengths = np.flatnonzero(np.isfinite(block[start]))
            if after == 0:
                lengths = lengths[lengths == num_layers - 1 - start]
            if lengths.size == 0:
                continue
            for fill in sorted(set(fills[t])):
                if fill + width > dph or (
                    last_block == (t, fill)
                    and setup.conflict[start, t]
                    and fills[t].count(fill) == 1
                ):
                    continue
                new_fills = _replace(fills, t, fill, fill + width)
                landed = cell(new_fills) + t
                for d in lengths.tolist():
                    end = start + d
                    g2 = combine(combine(g, enter), block[start, d])
                    h = values[after, layer_row(setup, end + 1), landed]
                    new_state = (end + 1, after, new_fills, t, (t, fill + width))
                    step = ("block", t, first, width, after, start, end, fill)
                    push(new_state, g2, h, node, step)
    for index, whole in enumerate(setup.wholes):
        row = tables.stage["w", index][bucket][0][start]
        lengths = np.flatnonzero(np.isfinite(row))
        if lengths.size == 0:
            continue
        if any(fills[t].count(0) < c for t, c in enumerate(whole.composition)):
            continue
        new_fills = fills
        for t, c in enumerate(whole.composition):
            for _ in range(c):
                new_fills = _replace(new_fills, t, 0, dph)
        landed = cell(new_fills)
        for after in following(bucket, tables.num_buckets):
            usable = (
                lengths[lengths == num_layers - 1 - start] if after == 0 else lengths
            )
            for x, y in whole.pairs:
                enter = 0.0 if start == 0 else tables.inter[start, last_type, x]
                if not math.isfinite(enter):
                    continue
                for d in usable.tolist():
                    end = start + d
                    g2 = combine(combine(g, enter), row[d])
                    h = values[after, layer_row(setup, end + 1), landed + y]
                    new_state = (end + 1, after, new_fills, y, None)
                    step = ("whole", index, bucket, x, y, after, start, end)
                    push(new_state, g2, h, node, step)


def _path(problem, setup: Setup, tables, nodes, node):
    """Units and placement of the plan ending at ``node``."""
    steps = []
    while node >= 0:
        _, _, parent, step = nodes[node]
        if step is not None:
            steps.append(step)
        node = parent
    steps.reverse()
    units: list[Unit] = []
    fills = {t: [0] * n for t, n in enumerate(setup.hosts)}
    hosts_of = {t: list(problem.cluster.hosts_of_type(t)) for t in fills}
    placement: Placement = []
    last_host = None
    for step in steps:
        if step[0] == "block":
            _, t, first, width, after, start, end, fill = step
            stages, buckets = trace_block(
                setup, tables, t, first, width, after, start, end
            )
            units.append(Unit("block", t, width, -1, stages, t, t, t, buckets))
            slots = [i for i, f in enumerate(fills[t]) if f == fill]
            others = [i for i in slots if hosts_of[t][i] != last_host]
            slot = (others or slots)[0]
            host, offset = hosts_of[t][slot], fills[t][slot]
            for _, _, m, _ in stages:
                placement.append(((host,), offset))
                offset += int(problem.submesh_shapes[m, 1])
            fills[t][slot] = fill + width
            last_host = host
        else:
            _, index, bucket, x, y, after, start, end = step
            whole = setup.wholes[index]
            units.append(whole_unit(setup, tables, index, bucket, x, y, start, end))
            taken = {}
            for t, c in enumerate(whole.composition):
                slots = [i for i, f in enumerate(fills[t]) if f == 0][:c]
                for i in slots:
                    fills[t][i] = setup.dph
                taken[t] = [hosts_of[t][i] for i in slots]
            first_host = taken[x].pop(0)
            if sum(whole.composition) == 1:
                hosts = (first_host,)
            else:
                last = taken[y].pop(0)
                middle = [h for t in sorted(taken) for h in taken[t]]
                hosts = (first_host, *middle, last)
            placement.append((hosts, 0))
            last_host = None
    return units, placement
