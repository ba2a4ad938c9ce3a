"""Sub-solvers for placed plans: fixed boundaries, or a fixed placement.

A *placed plan* is ``(stages, placement)``: ``(start, stop, submesh, config,
type)`` per stage and ``(hosts, first_device)`` per stage, any placement
:func:`pipedejavu.core.hetero_rules.check_hetero_plan` accepts. Two sub-solvers
serve the engine's rounding repair and its polish, both exact for the
all-in-flight objective (:func:`~pipedejavu.core.hetero_rules.hetero_bound`)
and pricing every plan they solve for on the 1F1B objective
(:func:`~pipedejavu.core.hetero_rules.hetero_objective`, which a cap on the
slowest stage or link does not capture: its loops add up neighbours):

* :func:`assign` -- given the layer boundaries ``0 = b_0 < ... < b_S = L``, the
  best submesh, config, type and placement of every stage over *every* valid
  plan: :func:`pipedejavu.search.hetero.exact.hetero_exact` restricted to
  exactly those spans (its DP then runs over ``S`` stages only).
* :func:`partition` -- given the stages' submeshes and hosts in order (a
  placement is valid whatever the layers), the best boundaries, configs and
  price types: the links are fixed by the hosts, so each stage's cost is a
  table over its span (the cheapest memory-admissible config on a tied slowest
  type of its hosts) and each transfer a function of where its stage ends; a
  DP over stages and end layers per cap gives the least-sum plan under it, and
  a scan down the caps solves each distinct such plan once, skipping the caps
  whose :func:`objective_floor` reaches the incumbent.

:func:`quick_cost` is :func:`pipedejavu.core.hetero_rules.evaluate_hetero`'s arithmetic
for a placed plan whose placement is known to be valid (only latencies and
memory are checked), without building the plan.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.hetero_rules import hetero_objective
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.search.hetero.exact import hetero_exact

__all__ = [
    "Placement",
    "Slot",
    "Stages",
    "assign",
    "links",
    "objective_floor",
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


def objective_floor(
    round_trip: float, largest: float, num_stages: int, num_microbatches: int
) -> float:
    """Least 1F1B objective (:func:`~pipedejavu.core.hetero_rules.hetero_objective`)
    of a plan of ``num_stages`` stages whose ``R_0 = sum t + sum c`` is at
    least ``round_trip`` and whose largest stage or transfer time is at least
    ``largest`` (seconds).

    ``T = R_0 + (B - 1) P`` with ``P >= max t, max c``; when ``S < B`` the loop
    through every stage (``t_0 + c_0 + ... + c_{S-2} + t_{S-1} = R_0``, shared
    by ``S`` micro-batches) gives ``P >= R_0 / S`` too (``= t_0`` for one
    stage). The all-in-flight bound ``R_0 + (B - 1) max`` leaves that loop out:
    with costly links ``R_0 / S`` is the larger (the plans of
    ``benchmarks/hetero_vs_alpa.py``), and a cap search pruned by it alone
    solves nearly every cap below the incumbent.
    """
    period = largest
    if num_stages < num_microbatches:
        period = max(period, round_trip / num_stages)
    return round_trip + (num_microbatches - 1) * period


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


class _Band(NamedTuple):
    """A slot's spans of at most ``W`` layers, by end layer ``j`` (row).

    Attributes:
        cost: f64[L, W] its cost on the span ``[starts[j, d], j]`` (inclusive;
            inf where that start would be negative).
        starts: i64[L, W] the spans' first layers, increasing in ``d``.
        before: i64[L, W] the previous stage's last layer (``L`` where the
            span starts at layer 0 or before).
        first: f64[L] the cost of the span ``[0, j]`` (inf past ``W`` layers).
    """

    cost: NDArray[np.float64]
    starts: NDArray[np.int64]
    before: NDArray[np.int64]
    first: NDArray[np.float64]


def _band(table: NDArray[np.float64], width: int) -> _Band:
    num_layers = table.shape[0]
    ends = np.arange(num_layers)[:, None]
    starts = ends - width + 1 + np.arange(width)[None, :]  # [L, W]
    cost = np.where(starts >= 0, table[np.maximum(starts, 0), ends], np.inf)
    before = np.where(starts >= 1, starts - 1, num_layers)
    first = np.where(np.arange(num_layers) < width, table[0], np.inf)
    return _Band(cost, starts, before, first)


def _partition_pass(
    bands: list[_Band],
    transfer: NDArray[np.float64],
    cap: float,
    combine: np.ufunc,
) -> tuple[float, list[int] | None]:
    """Best boundaries for fixed stage slots, every term <= cap.

    Args:
        bands: per slot, its spans (:class:`_Band`, each its own width).
        transfer: f64[S - 1, L] transfer after slot s when it ends at layer j.

    Returns:
        The optimal value and the stops ``b_1 < ... < b_S = L``, or (inf, None).
    """
    num_stages, num_layers = len(bands), bands[0].cost.shape[0]
    sends = np.where(transfer <= cap, transfer, np.inf)
    value = np.where(bands[0].first <= cap, bands[0].first, np.inf)  # by end
    rows = np.arange(num_layers)
    entering = np.full(num_layers + 1, np.inf)  # [L] inf: nothing before
    back = np.zeros((num_stages, num_layers), dtype=np.int64)
    for stage in range(1, num_stages):
        band = bands[stage]
        entering[:num_layers] = combine(value, sends[stage - 1])  # by its end
        capped = np.where(band.cost <= cap, band.cost, np.inf)
        totals = combine(entering[band.before], capped)  # [L, W]
        # the first least entry: the smallest start among ties
        chosen = totals.argmin(axis=1)
        back[stage] = band.starts[rows, chosen]
        value = totals[rows, chosen]
    total = float(value[num_layers - 1])
    if not math.isfinite(total):
        return math.inf, None
    stops, end = [num_layers], num_layers - 1
    for stage in range(num_stages - 1, 0, -1):
        end = int(back[stage, end]) - 1
        stops.append(end + 1)
    return total, stops[::-1]


#: Per problem, the slot tables last built (a local search prices the same
#: places over and over): (types, submesh, followers) -> (table, choice,
#: shortest), ``shortest[n - 1]`` the least entry of a span of ``n`` layers.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Bytes of tables kept per problem (each ``12 L^2``: 0.8 MB at L = 256).
_TABLE_BYTES = 128 * 2**20


def _slot_table(problem: HeteroProblem, hosts, m: int, followers: int):
    """f64[L, L] the least cost of a stage on these hosts over configs and tied
    slowest types admissible under memory; i16[L, L, 2] its (config, type);
    f64[L] the least of its spans of each length. Only the hosts' types
    matter; the last tables built are reused."""
    cluster = problem.cluster
    types = sorted({cluster.host_types[x] for x in hosts})
    cache = _TABLES.setdefault(problem, {})
    key = (tuple(types), m, followers)
    if key in cache:
        cache[key] = cache.pop(key)  # most recently used last
        return cache[key]
    while cache and len(cache) * 12 * problem.num_layers**2 >= _TABLE_BYTES:
        del cache[next(iter(cache))]  # the least recently used
    table, choice = _build_slot_table(problem, types, m, followers)
    shortest = np.array(
        [np.diagonal(table, n).min() for n in range(problem.num_layers)]
    )
    cache[key] = (table, choice, shortest)
    return cache[key]


def _build_slot_table(problem: HeteroProblem, types: list[int], m: int, followers):
    cluster = problem.cluster
    slowest = min(cluster.device_types[t].speed for t in types)
    memory = problem.max_n_succ_stages[:, :, m]  # [L, L, K, T]
    ok = np.all(memory[..., types] >= followers, axis=-1)  # [L, L, K]
    shape = problem.compute_cost.shape[:2]
    best = np.full(shape, np.inf)
    choice = np.zeros(shape + (2,), dtype=np.int16)
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
    """The best boundaries, configs and types for stages placed on ``slots``
    (module docstring): the cheapest objective among the least-sum plans of
    every cap, exact for the all-in-flight objective.

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
    transfer = np.zeros((max(num_stages - 1, 0), num_layers))
    for index, link in enumerate(_links(problem, placement)):
        sent = problem.boundary_bytes
        transfer[index, : num_layers - 1] = 2.0 * (
            link.latency_s + sent / link.bandwidth
        )
        transfer[index, num_layers - 1] = np.inf  # nothing may follow L - 1
    # A plan with a term above incumbent / B costs more than the incumbent:
    # only each slot's spans with an entry up to there matter.
    reach = incumbent / num_microbatches
    bands = []
    for table, _, shortest in tables:
        fits = np.flatnonzero(shortest <= reach)
        if fits.size == 0:
            return incumbent, None, None
        bands.append(_band(table, int(fits[-1]) + 1))
    smallest, _ = _partition_pass(bands, transfer, math.inf, np.maximum)
    if not smallest < reach:
        return incumbent, None, None
    values = np.concatenate([band.cost.ravel() for band in bands] + [transfer.ravel()])
    caps = np.unique(values[(values >= smallest) & (values < reach)])
    best: list = [incumbent, None]
    # Every distinct least-sum plan that may beat the incumbent, from the
    # largest useful cap down. The least-sum plan under a cap stays the
    # least-sum plan down to its own bottleneck, and a plan whose bottleneck
    # lies in [x, cap] costs at least objective_floor(S(cap), x); so the next
    # cap solved is the largest candidate below both the bottleneck and the x
    # at which that floor reaches the incumbent (one DP pass per distinct plan
    # at most), and the scan stops once the floor at the least cap does.
    index = caps.size - 1
    while index >= 0:
        cap = float(caps[index])
        total, stops = _partition_pass(bands, transfer, cap, np.add)
        if stops is None or not (
            objective_floor(total, smallest, num_stages, num_microbatches) < best[0]
        ):
            break
        firsts = [0] + stops[:-1]
        stages, latencies = [], []
        for s, (a, b, (m, _, _)) in enumerate(zip(firsts, stops, slots, strict=True)):
            k, t = (int(x) for x in tables[s][1][a, b - 1])
            stages.append((a, b, m, k, t))
            latencies.append(float(tables[s][0][a, b - 1]))
        transfers = [float(transfer[s, b - 1]) for s, b in enumerate(stops[:-1])]
        bottleneck = max(latencies + transfers)
        # quick_cost's arithmetic: the tables hold only admissible entries
        value = hetero_objective(latencies, transfers, num_microbatches)
        if value < best[0]:
            best[:] = [value, stages]
        # beaten: every plan whose bottleneck is at least this
        beaten = math.inf
        if num_microbatches > 1:
            beaten = (best[0] - total) / (num_microbatches - 1)
        below = np.searchsorted(caps, min(bottleneck, beaten))
        index = min(int(below), index) - 1
    if best[1] is None:
        return incumbent, None, None
    return best[0], best[1], placement
