"""The exact DP with a per-stage tail: ``sum t + (B - 1) max t + max tail``.

A Megatron-style plan pays, after its pipeline, each stage's data-parallel
gradient all-reduce and optimizer step; the slowest stage's counts
(:attr:`pipedejavu.Problem.stage_tail_cost`). This module adds that term to
the exact machinery of :mod:`pipedejavu.search.alpa.exact` without changing it:

Let ``V(P)`` be a plan's pipeline objective and ``tau(P)`` its largest tail.
Solve the tail-free problem restricted to stages with tail ``< limit`` (the
others masked as unprofiled), starting with ``limit = inf``: its optimum ``P``
has the least ``V`` among the admissible plans, so every admissible plan whose
largest tail is ``>= tau(P)`` costs at least ``V(P) + tau(P)``; only plans with
every tail ``< tau(P)`` can still be cheaper, so set ``limit = tau(P)`` and
repeat. Each round is a branch and bound started from the incumbent (a plan
must have ``V < best - least remaining tail``), so the loop stops as soon as no
admissible plan can win, or nothing is admissible. The result is exact: every
plan lies in one round's window ``[tau(P_k), limit_k)``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, make_plan
from pipedejavu.search.alpa.caps import cheaper_plan, explain_infeasible

__all__ = ["cheaper_plan_with_tail", "exact_dp_with_tail"]


def cheaper_plan_with_tail(
    problem: Problem, incumbent: float = math.inf
) -> tuple[float, list[tuple[int, int, int, int]] | None, dict]:
    """The optimal plan of ``problem`` (tails included) if it costs less than
    ``incumbent``, else ``None`` (module docstring).

    Returns:
        ``(cost, stages or None, stats)``; ``stats["rounds"]`` counts the
        tail-free solves.

    Raises:
        InfeasibleProblemError: the problem has no feasible plan at all.
    """
    tail = problem.stage_tail_cost
    base = problem.replace(stage_tail_cost=None)
    if tail is None:
        return cheaper_plan(base, incumbent)
    cost = base.compute_cost
    finite = np.isfinite(cost)
    best, best_stages = float(incumbent), None
    limit = math.inf
    rounds = 0
    feasible = False
    while True:
        allowed = finite & (tail < limit)
        if not allowed.any():
            break
        least_tail = float(tail[allowed].min())
        masked = base.replace(compute_cost=np.where(allowed, cost, np.inf))
        rounds += 1
        try:
            value, stages, _ = cheaper_plan(masked, best - least_tail)
        except InfeasibleProblemError:
            break
        feasible = True
        if stages is None:
            break
        plan_tail = max(tail[a, b - 1, m, k] for a, b, m, k in stages)
        if value + plan_tail < best:
            best, best_stages = value + plan_tail, stages
        limit = float(plan_tail)
    if not feasible and best_stages is None and math.isinf(incumbent):
        raise InfeasibleProblemError(explain_infeasible(base))
    return best, best_stages, {"rounds": rounds}


def exact_dp_with_tail(problem: Problem) -> Plan:
    """The optimal plan of ``sum t + (B - 1) max t + max tail``.

    Raises:
        InfeasibleProblemError: no plan satisfies the rules; the message says why.
    """
    started = time.perf_counter()
    _, stages, stats = cheaper_plan_with_tail(problem)
    if stages is None:  # pragma: no cover - a feasible problem yields a plan
        raise InfeasibleProblemError(explain_infeasible(problem))
    return make_plan(
        problem,
        stages,
        method="dp",
        search_time_s=time.perf_counter() - started,
        info=stats,
    )
