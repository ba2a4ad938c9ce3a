"""Exact sub-solvers for placed plans with fixed stage boundaries.

Given the layer boundaries ``0 = b_0 < ... < b_S = L`` of a plan on a
:class:`~pipedejavu.hetero.HeteroProblem`, :func:`assign` picks every stage's
``(submesh, config, device type)`` to minimize the true objective
``sum t + sum c + (B - 1) * max(max t, max c)`` under all the rules of the
canonical placement (:func:`pipedejavu.hetero.place`): each type's devices used
exactly, no stage straddling a host, the memory rule with ``S - 1 - s``
followers. It is the engine's rounding repair (an exact knapsack of submesh
sizes per type, with placement and transfers) and its cheapest polish move.

The state after stage ``s`` is the vector ``u`` of devices used per type (a
flat grid of ``prod_t (D_t + 1)`` cells) and the type of stage ``s``: under the
canonical placement that fixes where the next stage of each type starts, hence
whether stage ``s`` ends mid-host (``u[type] % devices_per_host != 0``), which
decides the link to the next stage (intra-host if the next stage has the same
type and stage ``s`` ends mid-host, else the inter-host link of the two types).
For a cap on every stage and transfer time, one pass over the stages gives the
least ``sum t + sum c``; a best-first branch and bound over the sorted caps
(as in :func:`pipedejavu.search.exact.cheaper_plan`) finds the optimum of the objective.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.hetero import HeteroProblem

from .exact import search_caps

__all__ = ["TypeGrid", "assign", "links", "quick_cost", "type_grid"]

Stages = list[tuple[int, int, int, int, int]]


class TypeGrid(NamedTuple):
    """Devices used per type as a flat grid, with placement rules precomputed.

    Attributes:
        counts: i64[T] devices of each type ``D_t``.
        strides: i64[T] flat-index stride of each type's axis.
        used: i64[G, T] devices used per type in each cell, ``G = prod(D_t + 1)``.
        full: flat index of ``used == counts``.
        mid: bool[G, T] a stage of type t ending at ``used[:, t]`` ends mid-host.
        fits: bool[M, T, G] a stage on submesh m, type t, may start at the cell
            (no host straddled, enough devices of the type left).
        shift: i64[M, T] flat-index step of placing submesh m on type t.
    """

    counts: NDArray[np.int64]
    strides: NDArray[np.int64]
    used: NDArray[np.int64]
    full: int
    mid: NDArray[np.bool_]
    fits: NDArray[np.bool_]
    shift: NDArray[np.int64]


_GRIDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def type_grid(problem: HeteroProblem) -> TypeGrid:
    """The :class:`TypeGrid` of a problem (cached per problem object)."""
    cached = _GRIDS.get(problem)
    if cached is not None:
        return cached
    cluster = problem.cluster
    dph = cluster.devices_per_host
    counts = np.asarray(cluster.devices_of_type(), dtype=np.int64)
    dims = tuple(int(c) + 1 for c in counts)
    strides = np.asarray(
        [int(np.prod(dims[t + 1 :], dtype=np.int64)) for t in range(len(dims))],
        dtype=np.int64,
    )
    size = int(np.prod(dims, dtype=np.int64))
    used = np.stack(np.unravel_index(np.arange(size), dims), axis=1).astype(np.int64)
    shapes = problem.submesh_shapes
    fits = np.zeros((len(shapes), len(counts), size), dtype=bool)
    shift = np.zeros((len(shapes), len(counts)), dtype=np.int64)
    for m, (hosts, devices) in enumerate(shapes.tolist()):
        for t in range(len(counts)):
            offset = used[:, t]
            within = offset % dph
            fits[m, t] = (
                (offset + hosts * devices <= counts[t])
                & (within + devices <= dph)
                & ((hosts == 1) | (within == 0))
            )
            shift[m, t] = hosts * devices * strides[t]
    grid = TypeGrid(
        counts=counts,
        strides=strides,
        used=used,
        full=int(counts @ strides),
        mid=(used % dph) != 0,
        fits=fits,
        shift=shift,
    )
    _GRIDS[problem] = grid
    return grid


def links(problem: HeteroProblem) -> tuple[NDArray, NDArray, NDArray, NDArray]:
    """Link arrays: intra latency f64[T] (s), intra bandwidth f64[T] (bytes/s),
    inter latency f64[T, T], inter bandwidth f64[T, T] (inf = free)."""
    cluster = problem.cluster
    intra_latency = np.asarray([x.latency_s for x in cluster.intra_host])
    intra_bandwidth = np.asarray([x.bandwidth for x in cluster.intra_host])
    inter_latency = np.asarray([[x.latency_s for x in r] for r in cluster.inter_host])
    inter_bandwidth = np.asarray([[x.bandwidth for x in r] for r in cluster.inter_host])
    return intra_latency, intra_bandwidth, inter_latency, inter_bandwidth


def transfer_table(
    problem: HeteroProblem, boundary_layers: NDArray[np.int64]
) -> NDArray[np.float64]:
    """Round-trip transfer seconds at stage boundaries, by link.

    Args:
        problem: the instance.
        boundary_layers: i64[N] the last layer before each boundary (0..L-2).

    Returns:
        f64[N, T, T, 2] ``[n, p, t, mid]``: from a stage of type p to one of
        type t; ``mid`` = the first ends mid-host (matters only when p == t).
    """
    intra_latency, intra_bandwidth, inter_latency, inter_bandwidth = links(problem)
    sent = problem.boundary_bytes[boundary_layers][:, None, None]
    inter = 2.0 * (inter_latency + sent / inter_bandwidth)  # [N, T, T]
    intra = 2.0 * (intra_latency + sent[:, :, 0] / intra_bandwidth)  # [N, T]
    table = np.stack([inter, inter.copy()], axis=-1)
    types = np.arange(problem.num_types)
    table[:, types, types, 1] = intra
    return table


def stage_table(
    problem: HeteroProblem, boundaries: Sequence[int]
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Cheapest memory-admissible config per stage, submesh and type.

    Returns:
        cost: f64[S, M, T] seconds (inf = none admissible);
        config: i64[S, M, T] the config achieving it.
    """
    starts = np.asarray(boundaries[:-1], dtype=np.int64)
    ends = np.asarray(boundaries[1:], dtype=np.int64) - 1
    num_stages = len(starts)
    cost = problem.compute_cost[starts, ends]  # [S, M, K, T]
    followers = num_stages - 1 - np.arange(num_stages)
    memory = problem.max_n_succ_stages[starts, ends]
    cost = np.where(memory >= followers[:, None, None, None], cost, np.inf)
    config = cost.argmin(axis=2)
    return np.take_along_axis(cost, config[:, :, None], 2)[:, :, 0], config


def _pass(
    grid: TypeGrid,
    cost: NDArray[np.float64],
    transfer: NDArray[np.float64],
    cap: float,
    combine: np.ufunc,
) -> tuple[float, list[tuple[int, int]] | None]:
    """One DP pass over the stages (min-sum or min-max, every term <= cap).

    Returns the optimal value and ``(submesh, type)`` per stage, or (inf, None).
    """
    num_stages, num_submeshes, num_types = cost.shape
    cells = grid.used.shape[0]
    allowed = np.where(transfer <= cap, transfer, np.inf)
    value = np.full((cells, num_types), np.inf)
    back_mesh = np.zeros((num_stages, cells, num_types), dtype=np.int16)
    back_type = np.zeros((num_stages, cells, num_types), dtype=np.int16)
    enter = np.full(cells, np.inf)
    enter[0] = 0.0
    previous = np.zeros(cells, dtype=np.int16)
    for stage in range(num_stages):
        new = np.full((cells, num_types), np.inf)
        for t in range(num_types):
            if stage > 0:
                link = np.where(
                    grid.mid, allowed[stage - 1, :, t, 1], allowed[stage - 1, :, t, 0]
                )
                candidates = combine(value, link)  # [G, T(previous)]
                previous = candidates.argmin(axis=1).astype(np.int16)
                enter = candidates[np.arange(cells), previous]
            reachable = np.isfinite(enter)
            for m in range(num_submeshes):
                stage_cost = cost[stage, m, t]
                if not stage_cost <= cap:
                    continue
                source = np.flatnonzero(reachable & grid.fits[m, t])
                if source.size == 0:
                    continue
                target = source + grid.shift[m, t]
                total = combine(enter[source], stage_cost)
                better = total < new[target, t]
                target = target[better]
                new[target, t] = total[better]
                back_mesh[stage, target, t] = m
                back_type[stage, target, t] = previous[source[better]]
        value = new
    finals = value[grid.full]
    if not np.isfinite(finals).any():
        return math.inf, None
    t = int(finals.argmin())
    cell, chosen = grid.full, []
    for stage in range(num_stages - 1, -1, -1):
        m = int(back_mesh[stage, cell, t])
        chosen.append((m, t))
        prior = int(back_type[stage, cell, t])
        cell, t = cell - int(grid.shift[m, t]), prior
    return float(finals.min()), chosen[::-1]


def assign(
    problem: HeteroProblem,
    boundaries: Sequence[int],
    incumbent: float = math.inf,
) -> tuple[float, Stages | None]:
    """The best ``(submesh, config, type)`` per stage for fixed boundaries.

    Args:
        problem: the instance.
        boundaries: ``0 = b_0 < b_1 < ... < b_S = L``.
        incumbent: only a plan cheaper than this is returned.

    Returns:
        ``(cost, [(start, stop, submesh, config, type), ...])`` of the optimal
        canonical plan with these boundaries, or ``(incumbent, None)`` when none
        is cheaper (or none exists). ``cost`` is the objective as summed here;
        :func:`pipedejavu.hetero.make_hetero_plan` re-evaluates it exactly.
    """
    bounds = [int(b) for b in boundaries]
    num_microbatches = problem.num_microbatches
    grid = type_grid(problem)
    cost, config = stage_table(problem, bounds)
    transfer = transfer_table(problem, np.asarray(bounds[1:-1], np.int64) - 1)
    smallest, _ = _pass(grid, cost, transfer, math.inf, np.maximum)
    if not smallest < incumbent / num_microbatches:
        return incumbent, None
    values = np.concatenate([cost.ravel(), transfer.ravel()])
    caps = np.unique(values[np.isfinite(values) & (values >= smallest)])
    best: list = [incumbent, None]

    def solve_at(index: int) -> float:
        total, chosen = _pass(grid, cost, transfer, float(caps[index]), np.add)
        if chosen is None:
            return total
        stages = [
            (bounds[s], bounds[s + 1], m, int(config[s, m, t]), t)
            for s, (m, t) in enumerate(chosen)
        ]
        value = quick_cost(problem, stages)
        if value < best[0]:
            best[:] = [value, stages]
        return total

    search_caps(caps, solve_at, lambda: best[0], num_microbatches)
    return best[0], best[1]


def quick_cost(problem: HeteroProblem, stages: Stages) -> float:
    """The objective of ``(start, stop, submesh, config, type)`` stages under
    the canonical placement, or inf when a rule breaks (contiguity and coverage
    are assumed). The same arithmetic as :func:`pipedejavu.hetero.evaluate_hetero`
    without building the plan; the engine's local moves use it."""
    grid = type_grid(problem)
    cluster = problem.cluster
    dph = cluster.devices_per_host
    shapes = problem.submesh_shapes
    used = [0] * problem.num_types
    latencies, transfers = [], []
    num_stages = len(stages)
    previous_type, previous_mid = -1, False
    for index, (start, stop, m, k, t) in enumerate(stages):
        latency = float(problem.compute_cost[start, stop - 1, m, k, t])
        memory = problem.max_n_succ_stages[start, stop - 1, m, k, t]
        hosts, devices = int(shapes[m, 0]), int(shapes[m, 1])
        within = used[t] % dph
        if (
            not math.isfinite(latency)
            or memory < num_stages - 1 - index
            or used[t] + hosts * devices > grid.counts[t]
            or within + devices > dph
            or (hosts > 1 and within)
        ):
            return math.inf
        if index > 0:
            if previous_type == t and previous_mid:
                link = cluster.intra_host[t]
            else:
                link = cluster.inter_host[previous_type][t]
            transfers.append(2.0 * link.time(float(problem.boundary_bytes[start - 1])))
        latencies.append(latency)
        used[t] += hosts * devices
        previous_type, previous_mid = t, used[t] % dph != 0
    if used != grid.counts.tolist():
        return math.inf
    bottleneck = max(max(latencies), max(transfers, default=0.0))
    return (
        math.fsum(latencies)
        + math.fsum(transfers)
        + (problem.num_microbatches - 1) * bottleneck
    )


def _partition_pass(
    stage_cost: NDArray[np.float64],
    transfer: NDArray[np.float64],
    cap: float,
    combine: np.ufunc,
) -> tuple[float, list[int] | None]:
    """Best boundaries for fixed stage slots, every term <= cap.

    Args:
        stage_cost: f64[S, L, L] cost of slot s on span ``[i, j]`` (inclusive).
        transfer: f64[S - 1, L] transfer after slot s when it ends at layer j.

    Returns:
        The optimal value and the stops ``b_1 < ... < b_S = L``, or (inf, None).
    """
    num_stages, num_layers, _ = stage_cost.shape
    costs = np.where(stage_cost <= cap, stage_cost, np.inf)
    sends = np.where(transfer <= cap, transfer, np.inf)
    value = costs[0, 0].copy()  # [L] by end layer
    back = np.zeros((num_stages, num_layers), dtype=np.int64)
    for stage in range(1, num_stages):
        entering = combine(value, sends[stage - 1])  # by the previous end
        # Stage s on [i, j] follows an end at i - 1.
        shifted = np.concatenate([[np.inf], entering[:-1]])  # by start i
        totals = combine(shifted[:, None], costs[stage])  # [i, j]
        back[stage] = totals.argmin(axis=0)
        value = totals[back[stage], np.arange(num_layers)]
    total = float(value[num_layers - 1])
    if not math.isfinite(total):
        return math.inf, None
    stops, end = [num_layers], num_layers - 1
    for stage in range(num_stages - 1, 0, -1):
        end = int(back[stage, end]) - 1
        stops.append(end + 1)
    return total, stops[::-1]


def partition(
    problem: HeteroProblem,
    slots: Sequence[tuple[int, int]],
    incumbent: float = math.inf,
) -> tuple[float, Stages | None]:
    """The best boundaries for a fixed sequence of ``(submesh, type)`` stages.

    The placement (hence every link) depends on the sequence only, so each
    stage's cost is a table over its span (cheapest memory-admissible config)
    and each transfer a function of where its stage ends: a DP over stages and
    end layers per cap, and the branch and bound of :func:`assign` over caps.

    Returns:
        ``(cost, stages)`` of the best such plan if cheaper than ``incumbent``,
        else ``(incumbent, None)``.
    """
    num_layers, num_stages = problem.num_layers, len(slots)
    num_microbatches = problem.num_microbatches
    if num_stages > num_layers:
        return incumbent, None
    dph = problem.cluster.devices_per_host
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    stage_cost = np.full((num_stages, num_layers, num_layers), np.inf)
    configs = np.zeros((num_stages, num_layers, num_layers), dtype=np.int64)
    transfer = np.zeros((max(num_stages - 1, 0), num_layers))
    used = [0] * problem.num_types
    mids = []
    for index, (m, t) in enumerate(slots):
        table = problem.compute_cost[:, :, m, :, t]  # [L, L, K]
        memory = problem.max_n_succ_stages[:, :, m, :, t]
        table = np.where(memory >= num_stages - 1 - index, table, np.inf)
        configs[index] = table.argmin(axis=2)
        stage_cost[index] = np.where(upper, table.min(axis=2), np.inf)
        used[t] += int(problem.submesh_sizes[m])
        mids.append(used[t] % dph != 0)
    if num_stages > 1:
        table = transfer_table(problem, np.arange(num_layers - 1))  # [L-1,T,T,2]
        for index in range(num_stages - 1):
            p, t = slots[index][1], slots[index + 1][1]
            transfer[index, : num_layers - 1] = table[:, p, t, int(mids[index])]
            transfer[index, num_layers - 1] = np.inf  # nothing may follow L - 1
    smallest, _ = _partition_pass(stage_cost, transfer, math.inf, np.maximum)
    if not smallest < incumbent / num_microbatches:
        return incumbent, None
    values = np.concatenate([stage_cost.ravel(), transfer.ravel()])
    caps = np.unique(values[np.isfinite(values) & (values >= smallest)])
    best: list = [incumbent, None]

    def solve_at(index: int) -> float:
        total, stops = _partition_pass(stage_cost, transfer, float(caps[index]), np.add)
        if stops is None:
            return total
        starts = [0] + stops[:-1]
        stages = [
            (a, b, m, int(configs[s, a, b - 1]), t)
            for s, (a, b, (m, t)) in enumerate(zip(starts, stops, slots, strict=True))
        ]
        value = quick_cost(problem, stages)
        if value < best[0]:
            best[:] = [value, stages]
        return total

    search_caps(caps, solve_at, lambda: best[0], num_microbatches)
    return best[0], best[1]
