"""Polishing placed plans on the true objective: local moves and exact windows.

Both phases search the space of :func:`pipedejavu.core.hetero_rules.check_hetero_plan`
(any placement, stages over hosts of several types) and price every move
exactly (:func:`pipedejavu.search.hetero.assign.quick_cost`, the arithmetic of
:func:`pipedejavu.core.hetero_rules.evaluate_hetero`):

* :func:`local_search` (milliseconds per pass on short models, seconds at
  L = 256), until no move improves: boundary hill climbing with every stage's
  place fixed; the best boundaries for the current sequence of places
  (:func:`~pipedejavu.search.hetero.assign.partition`); moves on the sequence
  of places, each priced with its best boundaries: reorder runs of one host
  type, swap two stages' places, split a stage's devices in two (a partial
  stage into two halves of its window, a whole stage into two groups of its
  hosts), merge two neighbours whose devices together form a submesh; and,
  unless ``exact_moves=False``, the best submeshes, configs, types and
  placement for the current boundaries and for one merge or one split in two
  or three (:func:`~pipedejavu.search.hetero.assign.assign`, the exact oracle
  on those spans, the costliest moves).
* :func:`exact_polish`: :func:`pipedejavu.search.hetero.exact.hetero_exact`
  restricted to spans near the current boundaries and stage midpoints
  (:func:`pipedejavu.search.engine.neighbourhood.neighbourhood`), started from the
  incumbent's cost; after an improvement the local search runs again; the
  window doubles (up to ``widest``) when the DP finds nothing better.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import make_hetero_plan
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.search.engine.neighbourhood import neighbourhood
from pipedejavu.search.hetero.assign import (
    Placement,
    Slot,
    Stages,
    assign,
    partition,
    quick_cost,
    split,
)
from pipedejavu.search.hetero.exact import HeteroTimeoutError, hetero_exact

__all__ = ["exact_polish", "exact_then_polish", "local_search"]

_IMPROVES = 1 - 1e-12  # a move must beat the incumbent by more than rounding


def boundaries_of(stages: Stages) -> list[int]:
    """``[0, stop_0, ..., L]`` of ``(start, stop, submesh, config, type)`` stages."""
    return [stages[0][0]] + [stop for _, stop, _, _, _ in stages]


def slots_of(stages: Stages, placement: Placement) -> list[Slot]:
    return [
        (s[2], hosts, first)
        for s, (hosts, first) in zip(stages, placement, strict=True)
    ]


def _shift_boundaries(problem, stages, placement, cost, window):
    """Move one boundary at a time to its best position within ``window``
    layers, every stage keeping its place, until no move improves."""
    improved = True
    while improved:
        improved = False
        for index in range(len(stages) - 1):
            left, right = stages[index], stages[index + 1]
            best, best_trial = cost, None
            low = max(left[0] + 1, left[1] - window)
            high = min(right[1] - 1, left[1] + window)
            for stop in range(low, high + 1):
                if stop == left[1]:
                    continue
                trial = list(stages)
                trial[index] = (left[0], stop, *left[2:])
                trial[index + 1] = (stop, right[1], *right[2:])
                value = quick_cost(problem, trial, placement)
                if value < best:
                    best, best_trial = value, trial
            if best_trial is not None and best < cost * _IMPROVES:
                cost, stages, improved = best, best_trial, True
    return cost, stages


def _boundary_moves(problem, stages, placement, cost, deadline, splits=True):
    """Exact places for the current boundaries and for every boundary list one
    merge or one split (in halves or thirds) away; the first improvement wins."""
    bounds = boundaries_of(stages)
    trials = [bounds]
    if splits:
        trials += [bounds[:i] + bounds[i + 1 :] for i in range(1, len(stages))]
        for i in range(len(stages)):
            start, stop = bounds[i], bounds[i + 1]
            if stop - start >= 2:
                middle = (start + stop) // 2
                trials.append(bounds[: i + 1] + [middle] + bounds[i + 1 :])
            if stop - start >= 3:
                cuts = [start + (stop - start) // 3, start + 2 * (stop - start) // 3]
                trials.append(bounds[: i + 1] + cuts + bounds[i + 1 :])
    for trial in trials:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        value, found, where = assign(problem, trial, cost * _IMPROVES)
        if found is not None:  # first improvement: the caller starts over
            return value, found, where
    return cost, stages, placement


def _submesh_index(problem: HeteroProblem) -> dict[tuple[int, int], int]:
    return {tuple(s): m for m, s in enumerate(problem.submesh_shapes.tolist())}


def _split_slot(problem, slot: Slot, index_of) -> list[list[Slot]]:
    """Ways to run a stage's devices as two stages."""
    m, hosts, first = slot
    h, d = (int(x) for x in problem.submesh_shapes[m])
    ways = []
    if h == 1 and d % 2 == 0 and (1, d // 2) in index_of:
        half = index_of[1, d // 2]
        ways.append([(half, hosts, first), (half, hosts, first + d // 2)])
    if h > 1:
        for cut in range(1, h):
            if (cut, d) in index_of and (h - cut, d) in index_of:
                ways.append(
                    [
                        (index_of[cut, d], hosts[:cut], 0),
                        (index_of[h - cut, d], hosts[cut:], 0),
                    ]
                )
    return ways


def _merge_slots(problem, left: Slot, right: Slot, index_of) -> Slot | None:
    """One stage on the devices of two neighbours, when they form a submesh."""
    (m1, hosts1, first1), (m2, hosts2, first2) = left, right
    h1, d1 = (int(x) for x in problem.submesh_shapes[m1])
    h2, d2 = (int(x) for x in problem.submesh_shapes[m2])
    dph = problem.cluster.devices_per_host
    if h1 == h2 == 1 and hosts1 == hosts2 and d1 + d2 < dph:
        low, high = sorted([(first1, d1), (first2, d2)])
        if low[0] + low[1] == high[0] and (1, d1 + d2) in index_of:
            return (index_of[1, d1 + d2], hosts1, low[0])
    if d1 == d2 == dph and (h1 + h2, dph) in index_of:
        return (index_of[h1 + h2, dph], hosts1 + hosts2, 0)
    return None


def _sequence_moves(problem, stages, placement, cost, deadline):
    """Moves on the sequence of places, each priced with its best boundaries
    (module docstring); the best improvement wins."""
    slots = slots_of(stages, placement)
    host_types = problem.cluster.host_types
    index_of = _submesh_index(problem)
    # Reorder whole runs of one host type (e.g. reverse the pipeline's type
    # order): single swaps cannot move a run of several stages at once.
    runs: list[list[Slot]] = []
    for slot in slots:
        kind = tuple(sorted({host_types[x] for x in slot[1]}))
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(slot)
        else:
            runs.append((kind, [slot]))
    orders = (
        itertools.permutations(range(len(runs)))
        if len(runs) <= 4
        else [tuple(range(len(runs)))[::-1]]
    )
    trials = [
        [slot for index in order for slot in runs[index][1]]
        for order in orders
        if list(order) != sorted(order)
    ]
    for i in range(len(slots)):
        for j in range(i + 1, len(slots)):
            if slots[i] != slots[j]:
                trial = list(slots)
                trial[i], trial[j] = trial[j], trial[i]
                trials.append(trial)
        for pair in _split_slot(problem, slots[i], index_of):
            trials.append(slots[:i] + pair + slots[i + 1 :])
        if i + 1 < len(slots):
            merged = _merge_slots(problem, slots[i], slots[i + 1], index_of)
            if merged is not None:
                trials.append(slots[:i] + [merged] + slots[i + 2 :])
    best = (cost, stages, placement)
    for trial in trials:
        if time.perf_counter() > deadline:
            break
        value, found, where = partition(problem, trial, best[0] * _IMPROVES)
        if found is not None:
            best = (value, found, where)
    return best


def local_search(
    problem: HeteroProblem,
    stages: Stages,
    placement: Placement,
    cost: float,
    *,
    window: int = 8,
    deadline: float = math.inf,
    exact_moves: bool = True,
) -> tuple[float, Stages, Placement]:
    """The local moves of the module docstring until none improves.

    Args:
        problem: the instance.
        stages, placement: a valid placed plan.
        cost: its objective (seconds).
        window: layers a boundary may move in one hill-climbing step.
        deadline: ``time.perf_counter()`` value after which no pass starts.
        exact_moves: also the moves that call the exact oracle (the exact
            places for the current boundaries, one merge, one split), the
            costliest by far on long models.

    Returns:
        ``(cost, stages, placement)`` of a plan no worse than the input.
    """
    while time.perf_counter() < deadline:
        before = cost
        cost, stages = _shift_boundaries(problem, stages, placement, cost, window)
        value, found, where = partition(
            problem, slots_of(stages, placement), cost * _IMPROVES
        )
        if found is not None:
            cost, stages, placement = value, found, where
        if exact_moves:
            cost, stages, placement = _boundary_moves(
                problem, stages, placement, cost, deadline, False
            )
        if cost < before * _IMPROVES:
            continue
        cost, stages, placement = _sequence_moves(
            problem, stages, placement, cost, deadline
        )
        if cost < before * _IMPROVES:
            continue
        if not exact_moves:
            break
        # The costliest moves (an exact assignment each) only when all else fails.
        cost, stages, placement = _boundary_moves(
            problem, stages, placement, cost, deadline
        )
        if not cost < before * _IMPROVES:
            break
    return cost, stages, placement


def _exact_window(problem, boundaries, window, incumbent, time_limit):
    """The exact DP on spans near the boundaries and stage midpoints: the best
    plan there if cheaper than ``incumbent``, and whether the DP finished."""

    # A window of L layers is the full DP (the neighbourhood of a few anchors
    # misses spans between two anchors' groups, e.g. every one-layer stage).
    allowed = None
    if window < problem.num_layers:
        allowed = neighbourhood(boundaries, problem.num_layers, window)
    finished = True
    try:
        plan = hetero_exact(
            problem,
            allowed_boundaries=allowed,
            incumbent_cost=None if math.isinf(incumbent) else incumbent,
            time_limit_s=max(time_limit, 1e-3),
        )
    except HeteroTimeoutError as error:
        plan, finished = error.best_plan, False
    except InfeasibleProblemError:
        return incumbent, None, None, True
    if plan is None or not plan.cost < incumbent:
        return incumbent, None, None, finished
    return plan.cost, *split(plan.stages), finished


def exact_polish(
    problem: HeteroProblem,
    boundaries: list[int],
    stages: Stages | None,
    placement: Placement | None,
    cost: float,
    *,
    window: int = 2,
    widest: int | None = None,
    max_rounds: int = 20,
    time_limit_s: float = 20.0,
    deadline: float = math.inf,
) -> tuple[float, Stages | None, Placement | None]:
    """Windowed exact DPs around the plan (or around ``boundaries`` while no plan
    is known: then the window widens up to ``L``, i.e. the full DP).

    Args:
        problem: the instance.
        boundaries: where to centre the first window when ``stages`` is None.
        stages, placement, cost: the incumbent (None, None, inf: none yet).
        window: the first window (layers).
        widest: the window doubles up to this (default ``2 * window``) while
            the DP finds nothing better.
        max_rounds: exact DP calls at most.
        time_limit_s: wall-clock limit of one call.
        deadline: no call starts past it once a plan is known.

    Returns:
        ``(cost, stages, placement)``; ``stages`` is None only if no plan was
        found.
    """
    widest = max(2 * window if widest is None else widest, window, 1)
    for _ in range(max_rounds):
        left = deadline - time.perf_counter()
        if stages is not None and left <= 0:
            break
        anchor = boundaries if stages is None else boundaries_of(stages)
        limit = time_limit_s if stages is None else min(time_limit_s, left)
        value, found, where, finished = _exact_window(
            problem, anchor, window, cost, limit
        )
        if found is not None:
            cost, stages, placement = local_search(
                problem, found, where, value, deadline=deadline
            )
            continue
        if not finished or window >= (
            widest if stages is not None else problem.num_layers
        ):
            break
        window = max(2 * window, 1)
    return cost, stages, placement


def exact_then_polish(
    problem: HeteroProblem,
    *,
    time_limit_s: float | None = None,
    progress_fn=None,
) -> HeteroPlan:
    """:func:`hetero_exact`, then :func:`local_search` on the objective when
    the oracle could not prove its plan optimal.

    The oracle's caps bound :func:`~pipedejavu.core.hetero_rules.hetero_bound`
    exactly, a lower bound on the 1F1B objective of every plan; its plan is
    optimal when its objective meets that bound (always with free links).
    Otherwise the local moves improve it on the objective and ``info`` says
    so: ``proven`` (``"optimal"`` or ``"bounded"``), ``lower_bound`` (seconds,
    certified over every valid plan), ``gap`` (cost / lower_bound - 1) and
    ``polished_from`` (the oracle's cost, when the moves improved it).
    """
    started = time.perf_counter()
    plan = hetero_exact(problem, time_limit_s=time_limit_s, progress_fn=progress_fn)
    if plan.info["proven"] == "optimal":
        return plan
    deadline = math.inf if time_limit_s is None else started + float(time_limit_s)
    stages, placement = split(plan.stages)
    cost, stages, placement = local_search(
        problem, stages, placement, plan.cost, deadline=deadline
    )
    if not cost < plan.cost:
        return plan
    bound = plan.info["lower_bound"]
    info = dict(plan.info, polished_from=plan.cost)
    polished = make_hetero_plan(
        problem, stages, method=plan.method, placement=placement, info=info
    )
    info.update(
        gap=polished.cost / bound - 1 if bound > 0 else 0.0,
        proven="optimal" if polished.cost <= bound else "bounded",
    )
    return dataclasses.replace(
        polished, info=info, search_time_s=time.perf_counter() - started
    )
