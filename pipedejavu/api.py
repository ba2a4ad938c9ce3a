"""The public entry point: ``solve(problem, method=...)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .problem import Plan, Problem, ProblemError

__all__ = ["METHODS", "solve"]


def _dp(
    problem: Problem,
    *,
    alpa_compatible: bool = False,
    progress_fn: Callable[[int, int, int], None] | None = None,
) -> Plan:
    if alpa_compatible:
        from baselines.alpa_dp import alpa_training_dp

        return alpa_training_dp(problem, progress_fn=progress_fn)
    from baselines.exact_dp import exact_dp

    return exact_dp(problem)


def _brute_force(problem: Problem) -> Plan:
    from baselines.brute_force import brute_force

    return brute_force(problem)


#: method name -> (solver, accepted options, one-line description)
METHODS: dict[str, tuple[Callable[..., Plan], frozenset[str], str]] = {
    "dp": (
        _dp,
        frozenset({"alpa_compatible", "progress_fn"}),
        "Alpa's inter-op DP, exact (alpa_compatible=True: Alpa's own answer)",
    ),
    "brute_force": (
        _brute_force,
        frozenset(),
        "every plan enumerated; tiny problems only",
    ),
}


def solve(problem: Problem, method: str = "dp", **options: Any) -> Plan:
    """Find a plan for ``problem`` with the named method.

    Args:
        problem: the instance.
        method: one of :data:`METHODS` (``"dp"``, ``"brute_force"``).
        **options: method options. ``"dp"``: ``alpa_compatible=True`` for Alpa's
            own answer (its full cap scan), and ``progress_fn(position,
            num_candidates, num_evaluated)`` called after each cap of that scan.

    Returns:
        A valid :class:`Plan` whose ``cost`` equals ``evaluate(problem, plan)``.

    Raises:
        ProblemError: unknown method or option.
        InfeasibleProblemError: no feasible plan; the message says why.
    """
    if method not in METHODS:
        raise ProblemError(
            f"unknown method {method!r}; choose one of {', '.join(METHODS)}"
        )
    solver, accepted, _ = METHODS[method]
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ProblemError(
            f"method {method!r} takes no option {', '.join(unknown)}"
            + (f" (it takes: {', '.join(sorted(accepted))})" if accepted else "")
        )
    return solver(problem, **options)
