"""The exact stage-construction DP: Alpa's formulation, solved to the true optimum.

Two exact methods share one answer: the label-setting DP
(:mod:`pipedejavu.search.alpa.labels`, the default) and the cap scan
(:mod:`pipedejavu.search.alpa.caps`); a problem with stage tails goes through
:mod:`pipedejavu.search.alpa.tail`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, make_plan
from pipedejavu.search.alpa.caps import Reporter, cheaper_plan, explain_infeasible
from pipedejavu.search.alpa.labels import label_dp
from pipedejavu.search.alpa.tail import exact_dp_with_tail

__all__ = ["EXACT_METHODS", "exact_dp"]


#: ``exact_dp`` methods: the label-setting DP and the cap scan.
EXACT_METHODS = ("labels", "caps")


def exact_dp(
    problem: Problem,
    *,
    method: str = "labels",
    progress_fn: Callable[[str], None] | None = None,
) -> Plan:
    """The optimal plan of Alpa's formulation, ``min sum + (B - 1) * max``.

    Two exact methods give the same plan (ties: fewest stages, then Alpa's
    loop order): ``"labels"`` (default; :mod:`pipedejavu.search.alpa.labels`), a
    label-setting DP over Pareto sets of (sum, slowest stage) whose work does
    not grow with the number of memory limits, and ``"caps"``, the branch and
    bound over caps on the slowest stage (module docstring), kept as a second,
    independent solver.

    Args:
        problem: the instance; any cost unit works (no absolute gaps are used).
        method: ``"labels"`` or ``"caps"``.
        progress_fn: receives a line of progress (caps or labels, bounds, best
            cost) about every 1.5 s once the run takes that long.

    Returns:
        The plan, with ``info``: ``method``; ``num_candidates`` (distinct
        finite stage costs, Alpa's caps); ``num_evaluated`` (caps solved by the
        cap scan, plus its min-max DP; passes of the label DP); ``num_labels``
        (label DP); ``t_max`` (the plan's slowest stage); ``trace`` (``(seconds,
        best cost so far)`` at each improvement).

    Raises:
        InfeasibleProblemError: no plan satisfies the rules; the message says why.
        ValueError: an unknown ``method``.
    """
    if method not in EXACT_METHODS:
        raise ValueError(f"method must be one of {EXACT_METHODS}, got {method!r}")
    if problem.stage_tail_cost is not None:  # + max tail: a loop around this DP
        return exact_dp_with_tail(problem)
    started = time.perf_counter()
    trace: list[tuple[float, float]] = []
    if method == "caps":
        _, best_stages, stats = cheaper_plan(
            problem, trace=trace, progress_fn=progress_fn, keep_ties=True
        )
        stats["num_labels"] = 0
    else:
        report = Reporter(progress_fn)
        result = label_dp(problem, progress_fn=lambda line: report(lambda: line))
        if result.stages is None:
            raise InfeasibleProblemError(explain_infeasible(problem))
        best_stages = result.stages
        trace.append((time.perf_counter() - started, result.cost))
        table = problem.compute_cost
        stats = {
            "num_candidates": int(np.unique(table[np.isfinite(table)]).size),
            "num_evaluated": result.num_passes,
            "num_labels": result.num_labels,
            "t_max": max(table[a, b - 1, m, k] for a, b, m, k in best_stages),
        }
    assert best_stages is not None  # the smallest feasible cap always yields a plan
    stats["method"] = method
    stats["trace"] = trace
    return make_plan(
        problem,
        best_stages,
        method="dp",
        search_time_s=time.perf_counter() - started,
        info=stats,
    )
