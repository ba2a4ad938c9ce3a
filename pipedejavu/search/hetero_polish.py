"""Polishing placed plans on the true objective: local moves and exact windows.

Two phases, both exact on the true cost (:func:`pipedejavu.search.hetero_assign.quick_cost`,
the arithmetic of :func:`pipedejavu.hetero.evaluate_hetero`):

* :func:`local_search` (milliseconds per pass), until no move improves:
  boundary hill climbing with every stage's slot fixed; the best boundaries for
  the current ``(submesh, type)`` sequence (:func:`~search.hetero_assign.partition`);
  the best slots for the current boundaries, and for one merge, one split in two
  or in three (:func:`~search.hetero_assign.assign`: change a stage's type,
  submesh or config, swap types, re-pack); and sequence moves priced with their
  best boundaries (swap two stages' slots, split a stage into two of half its
  devices, merge two neighbours of one type).
* :func:`exact_polish`: :func:`pipedejavu.search.hetero_exact.hetero_exact` restricted to
  spans near the current boundaries and stage midpoints
  (:func:`pipedejavu.search.engine._neighbourhood`), started from the incumbent's cost;
  after an improvement the local search runs again; the window doubles (up to
  ``widest``) when the DP finds nothing better.
"""

from __future__ import annotations

import itertools
import math
import time

from pipedejavu.hetero import HeteroProblem
from pipedejavu.problem import InfeasibleProblemError

from .engine import _neighbourhood
from .hetero_assign import Stages, assign, partition, quick_cost

__all__ = ["exact_polish", "local_search"]

_IMPROVES = 1 - 1e-12  # a move must beat the incumbent by more than rounding


def boundaries_of(stages: Stages) -> list[int]:
    """``[0, stop_0, ..., L]`` of ``(start, stop, submesh, config, type)`` stages."""
    return [stages[0][0]] + [stop for _, stop, _, _, _ in stages]


def _shift_boundaries(
    problem: HeteroProblem, stages: Stages, cost: float, window: int
) -> tuple[float, Stages]:
    """Move one boundary at a time to its best position within ``window``
    layers, every stage keeping its slot, until no move improves."""
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
                value = quick_cost(problem, trial)
                if value < best:
                    best, best_trial = value, trial
            if best_trial is not None and best < cost * _IMPROVES:
                cost, stages, improved = best, best_trial, True
    return cost, stages


def _boundary_moves(
    problem: HeteroProblem,
    stages: Stages,
    cost: float,
    deadline: float,
    splits: bool = True,
) -> tuple[float, Stages]:
    """Exact slots for the current boundaries and for every boundary list one
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
        if time.perf_counter() > deadline:
            break
        value, found = assign(problem, trial, cost * _IMPROVES)
        if found is not None:  # first improvement: the caller starts over
            return value, found
    return cost, stages


def _sequence_moves(
    problem: HeteroProblem, stages: Stages, cost: float, deadline: float
) -> tuple[float, Stages]:
    """Moves on the ``(submesh, type)`` sequence, each priced with its best
    boundaries: reorder the runs of one type, swap two stages' slots, split a
    stage into two of half its devices, merge two neighbours of one type; the
    best improvement wins."""
    slots = [(m, t) for _, _, m, _, t in stages]
    sizes = problem.submesh_sizes.tolist()
    by_size: dict[int, list[int]] = {}
    for m, size in enumerate(sizes):
        by_size.setdefault(size, []).append(m)
    # Reorder whole runs of one type (e.g. reverse the pipeline's type order):
    # single swaps cannot move a run of several stages at once.
    runs: list[list[tuple[int, int]]] = []
    for slot in slots:
        if runs and runs[-1][-1][1] == slot[1]:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    orders = (
        itertools.permutations(range(len(runs)))
        if len(runs) <= 4
        else [tuple(range(len(runs)))[::-1]]
    )
    trials = [
        [slot for index in order for slot in runs[index]]
        for order in orders
        if list(order) != sorted(order)
    ]
    for i, (m, t) in enumerate(slots):
        for j in range(i + 1, len(slots)):
            if slots[i] != slots[j]:
                trial = list(slots)
                trial[i], trial[j] = trial[j], trial[i]
                trials.append(trial)
        if sizes[m] % 2 == 0:
            for half in by_size.get(sizes[m] // 2, []):
                trials.append(slots[:i] + [(half, t), (half, t)] + slots[i + 1 :])
        if i + 1 < len(slots) and slots[i + 1][1] == t:
            for merged in by_size.get(sizes[m] + sizes[slots[i + 1][0]], []):
                trials.append(slots[:i] + [(merged, t)] + slots[i + 2 :])
    best, best_stages = cost, stages
    for trial in trials:
        if time.perf_counter() > deadline:
            break
        value, found = partition(problem, trial, best * _IMPROVES)
        if found is not None:
            best, best_stages = value, found
    return best, best_stages


def local_search(
    problem: HeteroProblem,
    stages: Stages,
    cost: float,
    *,
    window: int = 8,
    deadline: float = math.inf,
) -> tuple[float, Stages]:
    """The local moves of the module docstring until none improves.

    Args:
        problem: the instance.
        stages: a valid plan as ``(start, stop, submesh, config, type)`` tuples.
        cost: its objective (seconds).
        window: layers a boundary may move in one hill-climbing step.
        deadline: ``time.perf_counter()`` value after which no pass starts.

    Returns:
        ``(cost, stages)`` of a plan no worse than the input.
    """
    while time.perf_counter() < deadline:
        before = cost
        cost, stages = _shift_boundaries(problem, stages, cost, window)
        slots = [(m, t) for _, _, m, _, t in stages]
        value, found = partition(problem, slots, cost * _IMPROVES)
        if found is not None:
            cost, stages = value, found
        cost, stages = _boundary_moves(problem, stages, cost, deadline, False)
        if cost < before * _IMPROVES:
            continue
        cost, stages = _sequence_moves(problem, stages, cost, deadline)
        if cost < before * _IMPROVES:
            continue
        # The costliest moves (an exact assignment each) only when all else fails.
        cost, stages = _boundary_moves(problem, stages, cost, deadline)
        if not cost < before * _IMPROVES:
            break
    return cost, stages


def _exact_window(
    problem: HeteroProblem,
    boundaries: list[int],
    window: int,
    incumbent: float,
    time_limit: float,
) -> tuple[float, Stages | None, bool]:
    """The exact DP on spans near the boundaries and stage midpoints: the best
    plan there if cheaper than ``incumbent``, and whether the DP finished."""
    from .hetero_exact import HeteroTimeoutError, hetero_exact

    allowed = _neighbourhood(boundaries, problem.num_layers, window)
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
        return incumbent, None, True
    if plan is None or not plan.cost < incumbent:
        return incumbent, None, finished
    stages = [
        (s.start, s.stop, s.submesh_index, s.config_index, s.device_type)
        for s in plan.stages
    ]
    return plan.cost, stages, finished


def exact_polish(
    problem: HeteroProblem,
    boundaries: list[int],
    stages: Stages | None,
    cost: float,
    *,
    window: int = 2,
    widest: int | None = None,
    max_rounds: int = 20,
    time_limit_s: float = 20.0,
    deadline: float = math.inf,
) -> tuple[float, Stages | None]:
    """Windowed exact DPs around the plan (or around ``boundaries`` while no plan
    is known: then the window widens up to ``L``, i.e. the full DP).

    Args:
        problem: the instance.
        boundaries: where to centre the first window when ``stages`` is None.
        stages, cost: the incumbent (None, inf: none yet).
        window: the first window (layers).
        widest: the window doubles up to this (default ``2 * window``) while
            the DP finds nothing better.
        max_rounds: exact DP calls at most.
        time_limit_s: wall-clock limit of one call.
        deadline: no call starts past it once a plan is known.

    Returns:
        ``(cost, stages)``; ``stages`` is None only if no plan was found.
    """
    widest = max(2 * window if widest is None else widest, window, 1)
    for _ in range(max_rounds):
        left = deadline - time.perf_counter()
        if stages is not None and left <= 0:
            break
        anchor = boundaries if stages is None else boundaries_of(stages)
        limit = time_limit_s if stages is None else min(time_limit_s, left)
        value, found, finished = _exact_window(problem, anchor, window, cost, limit)
        if found is not None:
            cost, stages = local_search(problem, found, value, deadline=deadline)
            continue
        if not finished or window >= (
            widest if stages is not None else problem.num_layers
        ):
            break
        window = max(2 * window, 1)
    return cost, stages
