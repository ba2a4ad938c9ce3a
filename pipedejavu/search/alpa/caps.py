"""The cap scan of the exact stage-construction DP (Alpa's formulation, solved exactly).

Alpa's ``training_dp`` scans every distinct stage cost as a cap ``t_max`` on the
slowest stage, solves a min-sum DP under each cap and keeps the best
``sum + (B - 1) * max``. That is exact (the optimal plan's slowest stage is one of
the candidates) except where Alpa's absolute ``1e-6`` candidate gap skips the
candidate holding the optimum; this module keeps Alpa's model and answers but not
that skip, and evaluates far fewer caps:

* ``S(t)``, the least stage-latency sum with every stage ``<= t``, is
  non-increasing in ``t``; the objective of any plan whose slowest stage lies in
  ``[t_a, t_b]`` is at least ``S(t_b) + (B - 1) * t_a`` and at least ``B * t_a``.
  A best-first branch and bound over the sorted candidates evaluates ``S`` only
  where that bound can still beat the best plan found so far.
* The smallest feasible cap comes from one min-max DP, not from a scan.
* Each DP pass is vectorized over devices, submeshes, stage ends and memory
  buckets; configs are reduced beforehand (only the cheapest admissible config
  of a stage can matter).

Memory: a stage with ``s - 1`` stages after it is admissible only if
``s - 1 <= max_n_succ_stages``. Instead of Alpa's full ``s = 1..L`` axis the DP
keeps one bucket per *binding* limit ``s = 1..R`` plus one bucket for every
``s > R`` (where each entry is either always or never admissible); with no
binding limit that is a single bucket.

Ties: among plans of equal stage-latency sum under a cap the DP takes the fewest
stages (as Alpa does), then the longer first stage, the smaller submesh index
and the smaller config index (Alpa's loop order).
"""

from __future__ import annotations

import heapq
import math
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    InfeasibleProblemError,
    Problem,
    objective,
)

__all__ = [
    "Reporter",
    "cheaper_plan",
    "explain_infeasible",
    "min_sum_plan",
    "search_caps",
]

_NO_COUNT = np.iinfo(np.int64).max // 4


def _full_buckets(problem: Problem) -> int:
    """Buckets for the exact memory rule: one per binding limit ``s = 1..R``, plus
    the lumped bucket ``s > R`` (1 when no limit binds)."""
    max_stages = min(problem.num_layers, problem.num_devices)
    limits = problem.max_n_succ_stages[np.isfinite(problem.compute_cost)] + 1
    binding = limits[(limits >= 1) & (limits < max_stages)]
    return int(binding.max()) + 1 if binding.size else 1


class _Entries(NamedTuple):
    """The finite entries of a problem, grouped by (start, end, submesh).

    Entries are in C order (start, end, submesh, config), so each group is a
    run and ``group_first`` marks where it begins; ``start_pointer[i]`` is the
    first group starting at layer ``i`` (groups of one start are contiguous).
    """

    cost: NDArray[np.float64]  # [E]
    memory: NDArray[np.int64]  # [E]
    config: NDArray[np.int64]  # [E]
    group: NDArray[np.int64]  # [E] group of each entry
    group_first: NDArray[np.int64]  # [G]
    group_start: NDArray[np.int64]  # [G]
    group_end: NDArray[np.int64]  # [G] inclusive
    group_submesh: NDArray[np.int64]  # [G]
    group_key: NDArray[np.int64]  # [G] sorted (start * L + end) * M + submesh
    start_pointer: NDArray[np.int64]  # [L + 1]


_ENTRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _entries(problem: Problem) -> _Entries:
    cached = _ENTRIES.get(problem)
    if cached is not None:
        return cached
    table = problem.compute_cost
    starts, ends, submeshes, configs = np.nonzero(np.isfinite(table))
    new_group = np.ones(starts.size, dtype=bool)
    new_group[1:] = (
        (starts[1:] != starts[:-1])
        | (ends[1:] != ends[:-1])
        | (submeshes[1:] != submeshes[:-1])
    )
    first = np.flatnonzero(new_group)
    group_start = starts[first]
    entries = _Entries(
        cost=table[starts, ends, submeshes, configs],
        memory=problem.max_n_succ_stages[starts, ends, submeshes, configs],
        config=configs,
        group=np.cumsum(new_group) - 1,
        group_first=first,
        group_start=group_start,
        group_end=ends[first],
        group_submesh=submeshes[first],
        group_key=(group_start * problem.num_layers + ends[first])
        * problem.num_submeshes
        + submeshes[first],
        start_pointer=np.searchsorted(group_start, np.arange(problem.num_layers + 1)),
    )
    _ENTRIES[problem] = entries
    return entries


_STARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _starts(problem: Problem, usable: NDArray[np.bool_]) -> list:
    """Per start layer, the usable groups that start there and their candidate
    stage ends, longest stage first (Alpa's loop order): ``(groups, stops,
    position of each group's stop, submesh of each group)``, or ``None`` where
    nothing usable starts. Cached per problem and set of usable groups."""
    by_usable = _STARTS.setdefault(problem, {})
    key = usable.tobytes()
    if key in by_usable:
        return by_usable[key]
    entries = _entries(problem)
    out: list = []
    for start in range(problem.num_layers):
        groups = np.arange(
            entries.start_pointer[start], entries.start_pointer[start + 1]
        )
        groups = groups[usable[groups]]
        if groups.size == 0:  # nothing starts here: the rows stay inf
            out.append(None)
            continue
        ascending = np.unique(entries.group_end[groups]) + 1
        stops = ascending[::-1]
        position = (
            stops.size - 1 - np.searchsorted(ascending, entries.group_end[groups] + 1)
        )
        out.append((groups, stops, position, entries.group_submesh[groups]))
    if len(by_usable) >= 8:  # a handful of usable sets per problem in practice
        by_usable.clear()
    by_usable[key] = out
    return out


def _stage_tables(
    problem: Problem, cap: float, num_buckets: int
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Cheapest admissible config per (bucket, stage group) under a cap.

    Bucket ``b < num_buckets`` admits entries with ``max_n_succ_stages >= b - 1``
    (exactly ``b`` stages from here); the last, lumped bucket stands for every
    ``s >= num_buckets`` and admits ``max_n_succ_stages >= num_buckets - 1``,
    which relaxes the rule unless ``num_buckets`` is :func:`_full_buckets`.
    Work is proportional to the finite entries, not to L^2 M K.

    Returns:
        cost: f64[NB + 1, G] seconds per group of :func:`_entries` (row 0
            unused); inf = none admissible.
        config: i64[NB + 1, G] the config index achieving it (smallest on ties).
    """
    entries = _entries(problem)
    num_groups = entries.group_first.size
    cost = np.full((num_buckets + 1, num_groups), np.inf)
    config = np.zeros((num_buckets + 1, num_groups), dtype=np.int64)
    if num_groups == 0:
        return cost, config
    under = entries.cost <= cap
    index = np.arange(entries.cost.size)
    previous = None
    for bucket in range(1, num_buckets + 1):
        admissible = under & (entries.memory >= bucket - 1)
        if previous is not None and np.array_equal(admissible, previous):
            cost[bucket], config[bucket] = cost[bucket - 1], config[bucket - 1]
            continue
        values = np.where(admissible, entries.cost, np.inf)
        least = np.minimum.reduceat(values, entries.group_first)
        winner = np.minimum.reduceat(
            np.where(values == least[entries.group], index, index.size),
            entries.group_first,
        )
        cost[bucket] = least
        config[bucket] = entries.config[np.minimum(winner, index.size - 1)]
        previous = admissible
    return cost, config


def _dp(
    problem: Problem,
    stage_cost: NDArray[np.float64],
    stage_config: NDArray[np.int64],
    num_buckets: int,
    combine: np.ufunc,
) -> tuple[float, list[tuple[int, int, int, int]] | None]:
    """One DP pass; ``combine`` is ``np.add`` (min-sum) or ``np.maximum`` (min-max).

    Returns the optimal value from layer 0 with all devices and the plan as
    ``(start, stop, submesh, config)`` tuples, or ``(inf, None)``.
    """
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes
    width = num_devices + 1
    shape = (num_buckets + 1, num_layers + 1, width)
    value = np.full(shape, np.inf)
    count = np.full(shape, _NO_COUNT, dtype=np.int64)
    choice_stop = np.zeros(shape, dtype=np.int64)
    choice_submesh = np.zeros(shape, dtype=np.int64)
    choice_next = np.zeros(shape, dtype=np.int64)
    # succ_*[b, k, j]: best state a stage in bucket b can hand over to at layer k
    # with j devices left (its value, stage count and bucket).
    succ_value = np.full(shape, np.inf)
    succ_count = np.full(shape, _NO_COUNT, dtype=np.int64)
    succ_bucket = np.zeros(shape, dtype=np.int64)
    value[0, num_layers, 0] = 0.0
    count[0, num_layers, 0] = 0
    below = np.arange(num_buckets)[:, None]  # the bucket each one follows
    columns = np.arange(width)[None, :]

    def hand_over(layer: int) -> None:
        # Buckets 1..NB-1 follow bucket b-1; the lumped bucket follows bucket
        # NB-1 or itself, whichever is better (fewer stages on equal value).
        succ_value[1:, layer] = value[:-1, layer]
        succ_count[1:, layer] = count[:-1, layer]
        succ_bucket[1:, layer] = below
        lumped = num_buckets
        better = (value[lumped, layer] < succ_value[lumped, layer]) | (
            (value[lumped, layer] == succ_value[lumped, layer])
            & (count[lumped, layer] < succ_count[lumped, layer])
        )
        succ_value[lumped, layer] = np.where(
            better, value[lumped, layer], succ_value[lumped, layer]
        )
        succ_count[lumped, layer] = np.where(
            better, count[lumped, layer], succ_count[lumped, layer]
        )
        succ_bucket[lumped, layer] = np.where(
            better, lumped, succ_bucket[lumped, layer]
        )

    hand_over(num_layers)
    entries = _entries(problem)
    usable = np.isfinite(stage_cost[1:]).any(axis=0)  # [G]
    starts = _starts(problem, usable)
    for start in range(num_layers - 1, -1, -1):
        if starts[start] is None:  # nothing starts here: the rows stay inf
            continue
        groups, stops, position, group_submesh = starts[start]
        costs = np.full((num_buckets, stops.size, len(sizes)), np.inf)
        costs[:, position, group_submesh] = stage_cost[1:, groups]
        candidates = np.full((num_buckets, stops.size, len(sizes), width), np.inf)
        counts = np.full(candidates.shape, _NO_COUNT, dtype=np.int64)
        for submesh, size in enumerate(sizes.tolist()):
            if size > num_devices:
                continue
            candidates[:, :, submesh, size:] = combine(
                costs[:, :, submesh, None], succ_value[1:, stops, : width - size]
            )
            counts[:, :, submesh, size:] = succ_count[1:, stops, : width - size] + 1
        candidates = candidates.reshape(num_buckets, -1, width)
        counts = counts.reshape(num_buckets, -1, width)
        best = candidates.min(axis=1)
        tied = candidates == best[:, None, :]
        pick = np.where(tied, counts, _NO_COUNT + 1).argmin(axis=1)  # first of fewest
        found = np.isfinite(best)
        stop_index, submesh = np.divmod(pick, len(sizes))
        chosen_stop = stops[stop_index]
        devices_left = columns - sizes[submesh]
        rows = np.arange(num_buckets)[:, None] + 1
        value[1:, start] = best
        count[1:, start] = np.where(found, counts[rows - 1, pick, columns], _NO_COUNT)
        choice_stop[1:, start] = chosen_stop
        choice_submesh[1:, start] = submesh
        choice_next[1:, start] = np.where(
            found,
            succ_bucket[rows, chosen_stop, np.maximum(devices_left, 0)],
            0,
        )
        hand_over(start)

    finals = value[1:, 0, num_devices]
    if not np.isfinite(finals).any():
        return math.inf, None
    final_counts = count[1:, 0, num_devices]
    tied = finals == finals.min()
    bucket = int(np.where(tied, final_counts, _NO_COUNT + 1).argmin()) + 1
    plan = []
    layer, devices = 0, num_devices
    while bucket != 0:
        stop = int(choice_stop[bucket, layer, devices])
        submesh = int(choice_submesh[bucket, layer, devices])
        key = (layer * num_layers + stop - 1) * problem.num_submeshes + submesh
        group = int(np.searchsorted(entries.group_key, key))
        config = int(stage_config[bucket, group])
        plan.append((layer, stop, submesh, config))
        bucket = int(choice_next[bucket, layer, devices])
        layer, devices = stop, devices - int(sizes[submesh])
    if layer != num_layers or devices != 0:  # pragma: no cover - internal invariant
        raise RuntimeError("DP backtracking did not end at the terminal state")
    return float(finals.min()), plan


def _memory_ok(problem: Problem, stages: list[tuple[int, int, int, int]]) -> bool:
    memory = problem.max_n_succ_stages
    return all(
        len(stages) - 1 - index <= memory[start, stop - 1, submesh, config]
        for index, (start, stop, submesh, config) in enumerate(stages)
    )


def _solve_cap(
    problem: Problem, cap: float, full_buckets: int, combine: np.ufunc
) -> tuple[float, list[tuple[int, int, int, int]] | None]:
    """The DP under one cap, deepening the memory relaxation only as needed.

    With fewer buckets than :func:`_full_buckets` the lumped bucket relaxes the
    memory rule, so its optimum is a lower bound; when that optimal plan obeys
    the rule anyway it is optimal for the exact rule too (and fewest-stages among
    equal values, since every exactly optimal plan is relaxed-optimal). Plans
    rarely need many stages, so 1, 2, 4, ... buckets usually stop early.
    """
    num_buckets = 1
    while True:
        num_buckets = min(num_buckets, full_buckets)
        tables = _stage_tables(problem, cap, num_buckets)
        value, stages = _dp(problem, *tables, num_buckets, combine)
        if stages is None or num_buckets == full_buckets or _memory_ok(problem, stages):
            return value, stages
        num_buckets *= 2


def min_sum_plan(
    problem: Problem, cap: float = math.inf
) -> tuple[float, list[tuple[int, int, int, int]] | None]:
    """The least stage-latency sum over plans whose stages all take ``<= cap``.

    Returns:
        ``(sum seconds, [(start, stop, submesh, config), ...])`` or ``(inf, None)``.
    """
    return _solve_cap(problem, cap, _full_buckets(problem), np.add)


def explain_infeasible(problem: Problem) -> str:
    """Why a problem has no feasible plan, in one sentence."""
    finite = np.isfinite(problem.compute_cost)
    if not finite.any():
        return "no stage has a profiled (finite) cost"
    admissible = finite & (problem.max_n_succ_stages >= 0)
    if not admissible.any():
        return "every profiled stage is over its memory limit (max_n_succ_stages = -1)"
    spans = finite.any(axis=(2, 3))
    reach = np.zeros(problem.num_layers + 1, dtype=bool)
    reach[0] = True
    for start in range(problem.num_layers):
        if reach[start]:
            reach[start + 1 :] |= spans[start, start:]
    if not reach[problem.num_layers]:
        furthest = int(np.flatnonzero(reach).max())
        return (
            f"no chain of profiled stages covers all {problem.num_layers} layers: "
            f"they reach layer {furthest} and no profiled stage starts there"
        )
    relaxed = problem.replace(
        max_n_succ_stages=np.where(finite, UNLIMITED_SUCCEEDING_STAGES, -1)
    )
    if not math.isfinite(min_sum_plan(relaxed)[0]):
        return (
            "profiled stages cover all layers, but no chain of them uses exactly the "
            f"{problem.num_devices} devices of the {problem.cluster_shape[0]}x"
            f"{problem.cluster_shape[1]} cluster"
        )
    return (
        "every plan that covers all layers with exactly all devices breaks a "
        "memory limit (too many stages after a stage: max_n_succ_stages)"
    )


def search_caps(
    caps: NDArray[np.float64],
    solve_at: Callable[[int], float],
    best_cost: Callable[[], float],
    num_microbatches: int,
    *,
    keep_ties: bool = False,
) -> dict[int, float]:
    """Best-first branch and bound over sorted candidate caps on the max term.

    ``solve_at(index)`` solves the min-sum problem under ``caps[index]``,
    updates the caller's incumbent (read back through ``best_cost()``) and
    returns the least sum (``inf`` when nothing fits). A plan whose max lies in
    ``[caps[a], caps[b]]`` costs at least ``S(caps[b]) + (B - 1) caps[a]`` and
    ``B caps[a]`` (``S``, the least sum under a cap, does not increase with
    the cap), so an interval whose bound reaches the incumbent is dropped;
    caps with ``B * cap >= best`` are never solved. Shared by the exact DP and
    the hardware-aware sub-solvers. ``keep_ties``: drop only intervals whose
    bound exceeds the incumbent, so that plans tied with it are still seen.

    Returns:
        ``{index: least sum}`` for every cap solved.
    """
    sums: dict[int, float] = {}
    side = "right" if keep_ties else "left"

    def solve(index: int) -> None:
        sums[index] = solve_at(index)

    def beaten(bound: float) -> bool:
        return bound > best_cost() if keep_ties else bound >= best_cost()

    last = int(np.searchsorted(caps, best_cost() / num_microbatches, side)) - 1
    if last >= 0:
        solve(0)
        last = int(np.searchsorted(caps, best_cost() / num_microbatches, side)) - 1
        last = min(max(last, 0), len(caps) - 1)
        if last > 0:
            solve(last)
    heap: list[tuple[float, int, int]] = []

    def push(low: int, high: int) -> None:
        if high - low < 2:
            return
        floor_cap = float(caps[low + 1])
        bound = max(
            sums[high] + (num_microbatches - 1) * floor_cap,
            num_microbatches * floor_cap,
        )
        if not beaten(bound):
            heapq.heappush(heap, (bound, low, high))

    if last > 0:
        push(0, last)
    while heap:
        bound, low, high = heapq.heappop(heap)
        if beaten(bound):
            continue
        middle = (low + high) // 2
        solve(middle)
        push(low, middle)
        push(middle, high)
    return sums


def _tie_key(stages: list[tuple[int, int, int, int]]) -> tuple:
    """Preference among plans of equal cost: fewest stages, then Alpa's loop
    order (longer first stage, smaller submesh, smaller config, and so on)."""
    order = [(-stop, submesh, config) for _, stop, submesh, config in stages]
    return len(stages), order


def cheaper_plan(
    problem: Problem,
    incumbent: float = math.inf,
    *,
    trace: list[tuple[float, float]] | None = None,
    progress_fn: Callable[[str], None] | None = None,
    keep_ties: bool = False,
) -> tuple[float, list[tuple[int, int, int, int]] | None, dict]:
    """The optimal plan if it costs less than ``incumbent``, else ``None``.

    The cap scan's branch and bound, started from a known plan's cost so that
    it prunes from the first cap on (the engine's polish uses this).
    ``trace``, if given, receives ``(seconds since the call, best cost)`` each
    time a cheaper plan is found (the anytime curve). ``keep_ties``: among
    plans of equal cost return the one :func:`_tie_key` prefers (what
    :func:`exact_dp` needs for answers independent of the method).

    Returns:
        ``(cost, [(start, stop, submesh, config), ...] or None, stats)``.

    Raises:
        InfeasibleProblemError: the problem has no feasible plan at all.
    """
    started = time.perf_counter()
    num_microbatches = problem.num_microbatches
    buckets = _full_buckets(problem)
    smallest_cap, _ = _solve_cap(problem, math.inf, buckets, np.maximum)
    if not math.isfinite(smallest_cap):
        raise InfeasibleProblemError(explain_infeasible(problem))
    table = problem.compute_cost
    all_caps = np.unique(table[np.isfinite(table)])
    candidates = all_caps[all_caps >= smallest_cap]

    best_cost, best_stages, best_cap = incumbent, None, math.nan
    report = Reporter(progress_fn)

    def solve_at(index: int) -> float:
        nonlocal best_cost, best_stages, best_cap
        cap = float(candidates[index])
        total, stages = _solve_cap(problem, cap, buckets, np.add)
        if stages is not None:
            latencies = [table[a, b - 1, m, k] for a, b, m, k in stages]
            cost = objective(latencies, num_microbatches)
            tied = (
                keep_ties
                and cost == best_cost
                and best_stages is not None
                and _tie_key(stages) < _tie_key(best_stages)
            )
            if cost < best_cost or tied:
                best_cost, best_stages, best_cap = cost, stages, cap
                if trace is not None:
                    trace.append((time.perf_counter() - started, cost))
        report(
            lambda: (
                f"exact DP (caps): {len(sums_seen)} of {len(candidates)} caps "
                f"solved, cap {cap:.6g} s, best {best_cost:.6g} s"
            )
        )
        sums_seen.append(index)
        return total

    sums_seen: list[int] = []
    sums = search_caps(
        candidates, solve_at, lambda: best_cost, num_microbatches, keep_ties=keep_ties
    )
    stats = {
        "num_candidates": int(len(all_caps)),
        "num_evaluated": len(sums) + 1,
        "t_max": best_cap,
    }
    return best_cost, best_stages, stats


#: Seconds between two progress lines of the exact DPs.
REPORT_EVERY_S = 1.5


class Reporter:
    """Calls ``progress_fn`` with a line at most every ``every`` seconds (and
    only once the run has taken that long); the line is built lazily."""

    def __init__(
        self, progress_fn: Callable[[str], None] | None, every: float | None = None
    ):
        self.progress_fn = progress_fn
        self.every = REPORT_EVERY_S if every is None else every
        self.last = time.perf_counter()

    def __call__(self, line: Callable[[], str]) -> None:
        if self.progress_fn is None:
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.progress_fn(line())
