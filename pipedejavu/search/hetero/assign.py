"""Exact sub-solvers for placed plans: fixed boundaries, or a fixed placement.

A *placed plan* is ``(stages, placement)``: ``(start, stop, submesh, config,
type)`` per stage and ``(hosts, first_device)`` per stage, any placement
:func:`pipedejavu.core.hetero_rules.check_hetero_plan` accepts. Two exact sub-solvers
serve the engine's rounding repair and its polish:

* :func:`assign` -- given the layer boundaries ``0 = b_0 < ... < b_S = L``, the
  best submesh, config, type and placement of every stage over *every* valid
  plan: :func:`pipedejavu.search.hetero.exact.hetero_exact` restricted to
  exactly those spans (its DP then runs over ``S`` stages only).
* :func:`partition` -- given the stages' submeshes and hosts in order (a
  placement is valid whatever the layers), the best boundaries, configs and
  price types: the links are fixed by the hosts, so each stage's cost is a
  table over its span (the cheapest memory-admissible config on a tied slowest
  type of its hosts) and each transfer a function of where its stage ends; a
  DP over stages and end layers per cap and the branch and bound of
  :func:`pipedejavu.search.alpa.exact.search_caps` over caps.

:func:`quick_cost` is :func:`pipedejavu.core.hetero_rules.evaluate_hetero`'s arithmetic
for a placed plan whose placement is known to be valid (only latencies and
memory are checked), without building the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.hetero_rules import hetero_objective
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.search.alpa.caps import search_caps
from pipedejavu.search.hetero.exact import hetero_exact

__all__ = [
    "Placement",
    "Slot",
    "Stages",
    "assign",
    "links",
    "partition",
    "quick_cost",
    "split",
]

#: ``(start, stop, submesh, config, type)`` per stage.
Stages = list[tuple[int, int, int, int, int]]
#: ``(hosts, first_device)`` per stage.
Placement = list[tuple[tuple[int, ...], int]]
#: ``(submesh, hosts, first_device)``: a stage's place, whatever its layers.
Slot = tuple[int, tuple[int, ...], int]


def links(problem: HeteroProblem) -> tuple[NDArray, NDArray, NDArray, NDArray]:
    """Link arrays: intra latency f64[T] (s), intra bandwidth f64[T] (bytes/s),
    inter latency f64[T, T], inter bandwidth f64[T, T] (inf = free)."""
    cluster = problem.cluster
    intra_latency = np.asarray([x.latency_s for x in cluster.intra_host])
    intra_bandwidth = np.asarray([x.bandwidth for x in cluster.intra_host])
    inter_latency = np.asarray([[x.latency_s for x in r] for r in cluster.inter_host])
    inter_bandwidth = np.asarray([[x.bandwidth for x in r] for r in cluster.inter_host])
    return intra_latency, intra_bandwidth, inter_latency, inter_bandwidth


def _links(problem: HeteroProblem, placement: Placement):
    """The link after each stage (by its hosts and the next stage's)."""
    cluster = problem.cluster
    links = []
    for (left, _), (right, _) in zip(placement, placement[1:], strict=False):
        shared = [x for x in left if x in right]
        links.append(
            cluster.link(shared[0], shared[0])
            if shared
            else cluster.link(left[-1], right[0])
        )
    return links


def quick_cost(problem: HeteroProblem, stages: Stages, placement: Placement) -> float:
    """The objective of a placed plan, or inf when a latency is not finite, the
    type is not a tied slowest type of the stage's hosts, or the memory rule
    breaks on one of its hosts' types (the placement itself is assumed valid;
    contiguity and coverage too)."""
    cluster = problem.cluster
    num_stages = len(stages)
    latencies = []
    for index, ((start, stop, m, k, t), (hosts, _)) in enumerate(
        zip(stages, placement, strict=True)
    ):
        types = {cluster.host_types[x] for x in hosts}
        slowest = min(cluster.device_types[u].speed for u in types)
        if t not in types or cluster.device_types[t].speed != slowest:
            return math.inf
        latency = float(problem.compute_cost[start, stop - 1, m, k, t])
        limits = problem.max_n_succ_stages[start, stop - 1, m, k]
        if not math.isfinite(latency) or any(
            limits[u] < num_stages - 1 - index for u in types
        ):
            return math.inf
        latencies.append(latency)
    transfers = [
        2.0 * link.time(float(problem.boundary_bytes[stop - 1]))
        for link, (_, stop, _, _, _) in zip(
            _links(problem, placement), stages, strict=False
        )
    ]
    return hetero_objective(latencies, transfers, problem.num_microbatches)


def assign(
    problem: HeteroProblem,
    boundaries: Sequence[int],
    incumbent: float = math.inf,
    *,
    time_limit_s: float | None = None,
) -> tuple[float, Stages | None, Placement | None]:
    """The best plan over every valid plan with these stage boundaries.

    Args:
        problem: the instance.
        boundaries: ``0 = b_0 < b_1 < ... < b_S = L``.
        incumbent: only a plan cheaper than this is returned.
        time_limit_s: passed to the oracle (its timeout propagates).

    Returns:
        ``(cost, stages, placement)`` of the optimal plan with these boundaries,
        or ``(incumbent, None, None)`` when none is cheaper (or none exists).
    """

    bounds = [int(b) for b in boundaries]
    mask = np.zeros((problem.num_layers,) * 2, dtype=bool)
    mask[bounds[:-1], np.asarray(bounds[1:]) - 1] = True
    try:
        plan = hetero_exact(
            problem,
            allowed_boundaries=mask,
            incumbent_cost=None if math.isinf(incumbent) else incumbent,
            time_limit_s=time_limit_s,
        )
    except InfeasibleProblemError:
        return incumbent, None, None
    if plan is None or not plan.cost < incumbent:
        return incumbent, None, None
    return plan.cost, *split(plan.stages)


def split(stages) -> tuple[Stages, Placement]:
    """``HeteroStage`` objects -> ``(stages, placement)``."""
    return (
        [
            (s.start, s.stop, s.submesh_index, s.config_index, s.device_type)
            for s in stages
        ],
        [(tuple(s.hosts), s.first_device) for s in stages],
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


def _slot_table(problem: HeteroProblem, hosts, m: int, followers: int):
    """f64[L, L] the least cost of a stage on these hosts over configs and tied
    slowest types admissible under memory; i64[L, L, 2] its (config, type)."""
    cluster = problem.cluster
    types = sorted({cluster.host_types[x] for x in hosts})
    slowest = min(cluster.device_types[t].speed for t in types)
    memory = problem.max_n_succ_stages[:, :, m]  # [L, L, K, T]
    ok = np.all(memory[..., types] >= followers, axis=-1)  # [L, L, K]
    shape = problem.compute_cost.shape[:2]
    best = np.full(shape, np.inf)
    choice = np.zeros(shape + (2,), dtype=np.int64)
    for t in types:
        if cluster.device_types[t].speed != slowest:
            continue
        values = np.where(ok, problem.compute_cost[:, :, m, :, t], np.inf)
        k = values.argmin(axis=2)
        v = np.take_along_axis(values, k[..., None], 2)[..., 0]
        better = v < best
        best = np.where(better, v, best)
        choice[better] = np.stack([k[better], np.full(int(better.sum()), t)], axis=-1)
    return best, choice


def partition(
    problem: HeteroProblem,
    slots: Sequence[Slot],
    incumbent: float = math.inf,
) -> tuple[float, Stages | None, Placement | None]:
    """The best boundaries, configs and types for stages placed on ``slots``.

    Returns:
        ``(cost, stages, placement)`` of the best such plan if cheaper than
        ``incumbent``, else ``(incumbent, None, None)``.
    """
    num_layers, num_stages = problem.num_layers, len(slots)
    num_microbatches = problem.num_microbatches
    if num_stages > num_layers:
        return incumbent, None, None
    placement = [(tuple(hosts), first) for _, hosts, first in slots]
    tables = [
        _slot_table(problem, hosts, m, num_stages - 1 - index)
        for index, (m, hosts, _) in enumerate(slots)
    ]
    stage_cost = np.stack([table for table, _ in tables])
    transfer = np.zeros((max(num_stages - 1, 0), num_layers))
    for index, link in enumerate(_links(problem, placement)):
        sent = problem.boundary_bytes
        transfer[index, : num_layers - 1] = 2.0 * (
            link.latency_s + sent / link.bandwidth
        )
        transfer[index, num_layers - 1] = np.inf  # nothing may follow L - 1
    smallest, _ = _partition_pass(stage_cost, transfer, math.inf, np.maximum)
    if not smallest < incumbent / num_microbatches:
        return incumbent, None, None
    values = np.concatenate([stage_cost.ravel(), transfer.ravel()])
    caps = np.unique(values[np.isfinite(values) & (values >= smallest)])
    best: list = [incumbent, None]

    def solve_at(index: int) -> float:
        total, stops = _partition_pass(stage_cost, transfer, float(caps[index]), np.add)
        if stops is None:
            return total
        starts = [0] + stops[:-1]
        stages = []
        for s, (a, b, (m, _, _)) in enumerate(zip(starts, stops, slots, strict=True)):
            k, t = (int(x) for x in tables[s][1][a, b - 1])
            stages.append((a, b, m, k, t))
        value = quick_cost(problem, stages, placement)
        if value < best[0]:
            best[:] = [value, stages]
        return total

    search_caps(caps, solve_at, lambda: best[0], num_microbatches)
    if best[1] is None:
        return incumbent, None, None
    return best[0], best[1], placement
