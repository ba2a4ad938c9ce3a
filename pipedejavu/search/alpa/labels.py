"""The exact DP as label setting: Pareto sets of (sum, slowest stage), no cap scan.

States are those of the cap-scan DP (:mod:`pipedejavu.search.alpa.exact`), built
backwards: a *label* at layer ``i`` is a plan of the suffix ``i..L-1`` with
``s`` stages on ``d`` devices, summarized by the sum and the slowest of its
stage latencies. A stage prepended to it has ``s`` stages after it, so its
memory rule is known when it is added (the cheapest config whose
``max_n_succ_stages >= s``). Labels are built in rounds of equal ``s`` (a round
prepends one stage to every label of the previous one), so a pass takes as many
vectorized rounds as the longest plan has stages, not one per layer.

Per state ``(i, d)`` only Pareto-optimal labels are kept: label ``k`` drops
label ``j`` when ``s_k <= s_j`` (fewer stages after a prefix stage only relax
its memory rule), ``max_k <= max_j`` and ``(sum, s, order)_k < (sum, s,
order)_j`` — the cap DP's preference: least sum, then fewest stages, then Alpa's
loop order (longer first stage, smaller submesh, smaller config).

Bounds. A plan of cost ``T <= cap`` has every stage at most ``theta = (cap -
Sigma) / (B - 1)`` (``Sigma``: least stage-latency sum of any plan), so entries
above ``theta`` are dropped, and ``Sigma`` recomputed without them tightens
``theta`` again. A label is dropped when ``sum + P_sum + (B - 1) max(max, P_max)
> cap``, with ``P_sum`` / ``P_max`` the least sum / least slowest stage of any
cover of the remaining prefix with exactly the remaining devices by entries
``<= theta`` (memory relaxed to "a stage follows"; once a pass keeps many
labels, the tables also follow the memory rule along the prefix: its last stage
has at least ``s + 1`` stages after it, the one before ``s + 2``, and so on, up
to :data:`~pipedejavu.search.alpa.label_tables.MAX_LEVELS` levels). Every plan of
cost at most the cap therefore survives (or a label as good as its suffix does),
so a pass whose cap reaches the optimum returns it; a pass that fails proves the
optimum above its cap.
The caps start at the tables' bound and grow geometrically, or jump to the
bound of the tables built for a cap when that bound rules the cap out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import Problem, objective
from pipedejavu.search.alpa.label_tables import (
    CheapestByFollowers,
    PrefixTables,
    StageGroups,
    follower_levels,
    prefix_tables,
    stage_groups,
    times_or_inf,
)

__all__ = ["LabelResult", "label_dp"]

_EPS = float(np.finfo(np.float64).eps)


#: Prefix tables built per cap (each lowers theta further).
THETA_ROUNDS = 1

#: Labels in a failed pass above which the tables add follower levels (0:
#: from the first pass on).
MANY_LABELS = 2000

#: Multi-level tables are built for caps this much above the asked one and
#: reused by the passes below it.
LEVEL_SLACK = 0.04


class _Round(NamedTuple):
    """The labels of one round (parallel arrays; all have the same stage count)."""

    layer: NDArray[np.int64]  # first layer of the suffix
    devices: NDArray[np.int64]
    total: NDArray[np.float64]  # stage-latency sum (seconds)
    slowest: NDArray[np.float64]  # slowest stage (seconds)
    bound: NDArray[np.float64]  # least cost of a completion (seconds)
    parent: NDArray[np.int64]  # index in the previous round
    group: NDArray[np.int64]  # the first stage's group
    config: NDArray[np.int64]  # the first stage's config
    order: NDArray[np.int64]  # rank in the loop order (within a layer)

    def take(self, index: NDArray[np.int64]) -> _Round:
        return _Round(*(field[index] for field in self))


class _Pass(NamedTuple):
    """A pass's outcome: the plan (or None), its cost, labels kept, and the
    least bound it dropped (a lower bound on the optimum when no plan came)."""

    cost: float
    stages: list[tuple[int, int, int, int]] | None
    num_labels: int
    least_dropped: float


def _run_pass(
    problem: Problem,
    tables: PrefixTables,
    cap: float,
    tick: Callable[[str], None] | None = None,
) -> _Pass:
    """All rounds under ``cap`` (seconds); ``tick`` gets a line per round."""
    groups = tables.groups
    num_layers, num_devices = problem.num_layers, problem.num_devices
    width = num_devices + 1
    factor = problem.num_microbatches - 1
    cap *= 1.0 + 8.0 * (num_layers + 4) * _EPS  # ties with the cap survive rounding
    zero, none = np.zeros(1, np.int64), np.full(1, -1, np.int64)
    current = _Round(
        np.full(1, num_layers), zero, np.zeros(1), np.zeros(1), np.zeros(1),
        none, none, none, zero,
    )  # fmt: skip
    rounds = [current]
    # Labels kept in earlier rounds, as (state, total, slowest) for dominance.
    seen_state = np.zeros(0, np.int64)
    seen_total, seen_slowest = np.zeros(0), np.zeros(0)
    least_dropped, num_labels = math.inf, 0
    # fitting[e, r]: groups ending at layer e with at most r devices.
    keys = groups.end * width + groups.size
    fitting = (
        np.searchsorted(
            keys, (np.arange(num_layers)[:, None] * width + np.arange(width)), "right"
        )
        - groups.by_end[:-1, None]
    )  # [L, W]
    cheapest = CheapestByFollowers(groups)
    # Flat views of the tables: one take per lookup.
    least_sum = tables.least_sum.reshape(tables.least_sum.shape[0], -1)
    least_max = tables.least_max.reshape(tables.least_max.shape[0], -1)
    for followers in range(min(num_layers, num_devices)):
        live = current.layer > 0
        if not live.any():
            break
        # Every (label, group ending just before the label's first layer and
        # fitting in the devices left) pair.
        label = np.flatnonzero(live)
        before = current.layer[label] - 1
        count = fitting[before, num_devices - current.devices[label]]
        first = groups.by_end[before]
        label = np.repeat(label, count)
        offsets = np.cumsum(count) - count
        group = np.repeat(first - offsets, count) + np.arange(count.sum())
        cost, config = cheapest(followers)
        cost = cost.take(group)
        allowed = cost < np.inf
        if not allowed.all():
            label, group, cost = label[allowed], group[allowed], cost[allowed]
        config = config.take(group)
        devices = current.devices.take(label) + groups.size.take(group)
        start = groups.start.take(group)
        cell = start * width + (num_devices - devices)  # (start, devices left)
        total = current.total.take(label) + cost
        slowest = np.maximum(current.slowest.take(label), cost)
        level = min(followers, tables.least_sum.shape[0] - 1)  # prefix: >= +1
        bound = (
            total
            + least_sum[level].take(cell)
            + times_or_inf(factor, np.maximum(slowest, least_max[level].take(cell)))
        )
        keep = bound <= cap
        dropped = bound[~keep]
        if dropped.size:
            least_dropped = min(least_dropped, float(dropped.min()))
        if not keep.any():
            break
        new = _Round(
            start[keep], devices[keep], total[keep], slowest[keep], bound[keep],
            label[keep], group[keep], config[keep], np.zeros(int(keep.sum()), np.int64),
        )  # fmt: skip
        # Loop order: longer first stage, smaller submesh, smaller config, then
        # the rest of the plan (the parents' order, within their layer).
        stop = groups.end[new.group] + 1
        index = np.lexsort(
            (current.order[new.parent], new.config, groups.submesh[new.group], -stop,
             new.layer)
        )  # fmt: skip
        order = np.empty(index.size, np.int64)
        order[index] = np.arange(index.size)
        new = new._replace(order=order)
        new = new.take(_undominated(new, new.layer * width + new.devices,
                                    seen_state, seen_total, seen_slowest))  # fmt: skip
        complete = new.layer == 0
        if complete.any():  # a plan: nothing costlier can be optimal
            cap = min(cap, float(new.bound[complete].min()) * (1 + 1e-12))
        state = new.layer * width + new.devices
        seen_state = np.concatenate([seen_state, state])
        seen_total = np.concatenate([seen_total, new.total])
        seen_slowest = np.concatenate([seen_slowest, new.slowest])
        num_labels += new.layer.size
        rounds.append(new)
        current = new
        if tick is not None:
            tick(
                f"exact DP (labels): cap {cap:.6g} s, plans of {followers + 1} "
                f"stages, {num_labels} labels"
            )
    stages, cost = _best(problem, tables, rounds, cap)
    return _Pass(cost, stages, num_labels, least_dropped)


def _undominated(
    new: _Round,
    state: NDArray[np.int64],
    seen_state: NDArray[np.int64],
    seen_total: NDArray[np.float64],
    seen_slowest: NDArray[np.float64],
) -> NDArray[np.int64]:
    """Indices of the new labels that no earlier label of their state drops.

    Earlier rounds' labels have fewer stages, so they drop a new label with no
    larger sum and slowest stage; new labels drop each other in the order
    (sum, loop order) when their slowest stage is no larger.
    """
    count_new = state.size
    states = np.concatenate([seen_state, state])
    totals = np.concatenate([seen_total, new.total])
    # Earlier labels first on equal sums (fewer stages), then loop order.
    rank = np.concatenate([np.full(seen_state.size, -1), new.order])
    index = np.lexsort((rank, totals, states))
    slowest = np.concatenate([seen_slowest, new.slowest])[index]
    states = states[index]
    level = np.unique(slowest, return_inverse=True)[1]
    size = index.size
    first = np.r_[True, states[1:] != states[:-1]]
    segment = np.cumsum(first) - 1
    key = level - segment * (size + 1)  # later segments sort below earlier ones
    running = np.minimum.accumulate(key)
    earlier = np.empty(size, np.int64)
    earlier[0] = size + 1
    earlier[1:] = running[:-1] + segment[1:] * (size + 1)
    earlier[first] = size + 1
    is_new = index >= seen_state.size
    kept = is_new & (earlier > level)
    return np.sort(index[kept] - seen_state.size) if count_new else index[:0]


def _best(
    problem: Problem, tables: PrefixTables, rounds: list[_Round], cap: float
) -> tuple[list[tuple[int, int, int, int]] | None, float]:
    """The cheapest complete plan (fewest stages, then loop order, on ties)."""
    options = []
    for number, labels in enumerate(rounds[1:], start=1):
        complete = np.flatnonzero(
            (labels.layer == 0) & (labels.devices == problem.num_devices)
        )
        for index in complete.tolist():
            if labels.bound[index] > cap:
                continue
            stages = _backtrack(tables.groups, rounds, number, index)
            latencies = [problem.compute_cost[a, b - 1, m, k] for a, b, m, k in stages]
            cost = objective(latencies, problem.num_microbatches)
            options.append((cost, number, int(labels.order[index]), stages))
    if not options:
        return None, math.inf
    cost, _, _, stages = min(options, key=lambda option: option[:3])
    return stages, cost


def _backtrack(
    groups: StageGroups, rounds: list[_Round], number: int, index: int
) -> list[tuple[int, int, int, int]]:
    stages = []
    while number > 0:
        labels = rounds[number]
        group = int(labels.group[index])
        stages.append(
            (
                int(labels.layer[index]),
                int(groups.end[group]) + 1,
                int(groups.submesh[group]),
                int(labels.config[index]),
            )
        )
        index, number = int(labels.parent[index]), number - 1
    return stages


class LabelResult(NamedTuple):
    """The optimal plan found by :func:`label_dp` and what it took."""

    cost: float
    stages: list[tuple[int, int, int, int]] | None
    num_passes: int
    num_labels: int
    lower_bound: float


def label_dp(
    problem: Problem,
    *,
    incumbent: float = math.inf,
    growth: float = 0.0025,
    progress_fn: Callable[[str], None] | None = None,
) -> LabelResult:
    """The optimal plan of Alpa's formulation by label setting.

    Args:
        problem: the instance.
        incumbent: a known plan's cost (seconds): only a cheaper plan is
            returned (``stages`` None if none exists).
        growth: after a failed pass the cap grows to ``1 + growth`` times the
            proven lower bound; ``growth`` doubles after each failure.
        progress_fn: receives a line after each pass (cap, labels, bound).

    Returns:
        :class:`LabelResult`; ``cost`` inf and ``stages`` None when no plan
        (cheaper than ``incumbent``) exists.
    """
    started = time.perf_counter()
    everything = stage_groups(problem)
    # One follower level until a pass keeps many labels: then the memory rule
    # is what the relaxation misses, and the tables distinguish more levels.
    memory_levels = follower_levels(problem, everything)
    levels = memory_levels if MANY_LABELS == 0 else 1
    full = prefix_tables(problem, everything, 1)
    factor = problem.num_microbatches - 1
    finite = everything.cost[np.isfinite(everything.cost)]
    ceiling = (problem.num_layers + factor + 1) * float(finite.max(initial=0.0))
    ceiling = min(ceiling * (1 + 1e-9), incumbent)
    passes = labels = 0
    lower = full.lower

    built: list = [math.nan, None]  # the multi-level tables' cap, the tables

    def screen(cap: float) -> tuple[PrefixTables, bool]:
        """Tables for the cap, and whether they prove that no plan costs at
        most the cap (their ``lower`` is then a guess of the optimum).

        Multi-level tables cost several times more, so they are built for a
        cap ``1 + LEVEL_SLACK`` above the asked one and reused while the caps
        stay below it (tables for a larger cap bound every smaller one)."""
        if levels > 1 and cap <= built[0]:
            return built[1], built[1].lower > cap
        reach = cap * (1 + LEVEL_SLACK) if levels > 1 else cap
        tables, theta = full, math.inf
        for _ in range(THETA_ROUNDS):  # plans within the cap: stages <= theta
            tighter = (reach - tables.sigma) / factor if factor else reach
            if tighter >= theta * (1 - 1e-3):
                break
            theta = tighter
            tables = prefix_tables(
                problem,
                everything.below(theta * (1 + 1e-9), problem.num_layers),
                levels,
            )
            if tables.lower > reach:
                break
        if levels > 1 and tables.lower <= cap:
            built[:] = [reach, tables]
        return tables, tables.lower > cap

    # The optimum is >= lower, and > lower once a cap was ruled out. The caps
    # grow geometrically (the step doubling), or jump to the tables' bound when
    # that rules a cap out by more (a guess: plans with stages above theta are
    # only known to cost more than the cap).
    step, cap = growth, lower
    while math.isfinite(lower) and lower <= ceiling:
        cap = min(cap, ceiling)
        tables, ruled_out = screen(cap)
        if ruled_out:
            lower = max(lower, cap)
            if cap >= ceiling:  # not even the costliest plan: none exists
                break
            if tables.lower > cap * (1 + step):
                cap = tables.lower * (1 + growth)
            else:
                cap, step = cap * (1 + step), 2 * step
            continue
        outcome = _run_pass(problem, tables, cap, progress_fn)
        passes += 1
        labels += outcome.num_labels
        if progress_fn is not None:
            progress_fn(
                f"exact DP (labels): pass {passes}, cap {cap:.6g} s, "
                f"{outcome.num_labels} labels, lower bound {lower:.6g} s, "
                f"{time.perf_counter() - started:.1f} s"
            )
        if outcome.stages is not None:
            if outcome.cost >= incumbent:
                break
            return LabelResult(outcome.cost, outcome.stages, passes, labels, lower)
        if cap >= ceiling:
            break
        # Passes just below the optimum are cheap, far above it costly.
        lower, cap = cap, cap * (1 + growth * 2.0**passes)
        if outcome.num_labels >= MANY_LABELS:
            levels = memory_levels
    return LabelResult(math.inf, None, passes, labels, lower)
