"""The public entry point: ``solve(problem, method=...)``."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

from pipedejavu.baselines.alpa_dp import alpa_training_dp
from pipedejavu.baselines.annealing import anneal
from pipedejavu.baselines.brute import brute_force
from pipedejavu.baselines.hetero import alpa_homogeneous, hetero_brute_force
from pipedejavu.baselines.heuristics import greedy, random_search, uniform
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.problem import Plan, Problem
from pipedejavu.planning.inputs import load_problem
from pipedejavu.search.alpa.exact import exact_dp
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.hetero.polish import exact_then_polish

__all__ = ["HETERO_METHODS", "METHODS", "solve"]


def _dp(
    problem: Problem,
    *,
    alpa_compatible: bool = False,
    progress_fn: Callable[..., None] | None = None,
) -> Plan:
    # progress_fn: (position, caps, evaluated) for Alpa's scan, a line for ours.
    if alpa_compatible:
        return alpa_training_dp(problem, progress_fn=progress_fn)
    return exact_dp(problem, progress_fn=progress_fn)


def _diff(
    problem: Problem,
    *,
    config: Any = None,
    num_restarts: int | None = None,
    num_steps: int | None = None,
    seed: int = 0,
    key: Any = None,
    progress_fn: Callable[[int, int, float], None] | None = None,
    message_fn: Callable[[str], None] | None = None,
) -> Plan:
    import jax  # the engine needs JAX; `import pipedejavu` does not

    from pipedejavu.search.engine.driver import differentiable

    config = config or SearchConfig()
    changes = {}
    if num_restarts is not None:
        changes["num_restarts"] = num_restarts
    if num_steps is not None:
        changes["num_steps"] = num_steps
        changes["num_chunks"] = math.gcd(num_steps, config.num_chunks)
    try:
        config = dataclasses.replace(config, **changes)
    except ValueError as error:
        raise ProblemError(str(error)) from None
    key = jax.random.key(seed) if key is None else key
    return differentiable(
        problem,
        config,
        key=key,
        progress_fn=progress_fn,
        message_fn=message_fn,
    )


def _brute_force(problem: Problem) -> Plan:
    return brute_force(problem)


def _heuristic(name: str) -> Callable[..., Plan]:
    def solver(problem: Problem, **options: Any) -> Plan:
        planner = {
            "anneal": anneal,
            "uniform": uniform,
            "greedy": greedy,
            "random": random_search,
        }[name]
        try:
            return planner(problem, **options)
        except ValueError as error:  # bad num_steps, temperature, ...
            if isinstance(error, ProblemError):
                raise
            raise ProblemError(str(error)) from None

    return solver


#: method name -> (solver, accepted options, one-line description)
METHODS: dict[str, tuple[Callable[..., Plan], frozenset[str], str]] = {
    "dp": (
        _dp,
        frozenset({"alpa_compatible", "progress_fn"}),
        "Alpa's inter-op DP, exact (alpa_compatible=True: Alpa's own answer)",
    ),
    "diff": (
        _diff,
        frozenset(
            {
                "config",
                "num_restarts",
                "num_steps",
                "seed",
                "key",
                "progress_fn",
                "message_fn",
            }
        ),
        "the differentiable engine: relaxed search + exact polish, lower bound",
    ),
    "brute_force": (
        _brute_force,
        frozenset(),
        "every plan enumerated; tiny problems only",
    ),
    "uniform": (
        _heuristic("uniform"),
        frozenset(),
        "best plan with equal layers and devices per stage",
    ),
    "greedy": (
        _heuristic("greedy"),
        frozenset(),
        "balanced layer partition by per-layer cost (heuristic)",
    ),
    "random": (
        _heuristic("random"),
        frozenset({"num_samples", "seed"}),
        "best of random valid plans",
    ),
    "anneal": (
        _heuristic("anneal"),
        frozenset(
            {
                "num_steps",
                "seed",
                "initial",
                "initial_temperature",
                "final_temperature",
                "score_fn",
                "progress_fn",
                "time_budget_s",
            }
        ),
        "simulated annealing (MCMC) over plans; anytime trace in plan.info",
    ),
}


def _hetero_dp(problem: Any, *, time_limit_s: float | None = None, progress_fn=None):
    return exact_then_polish(
        problem, time_limit_s=time_limit_s, progress_fn=progress_fn
    )


def _hetero_diff(
    problem: Any,
    *,
    config: Any = None,
    seed: int = 0,
    key: Any = None,
    progress_fn: Callable | None = None,
    time_budget_s: float | None = None,
):
    import jax  # the engine needs JAX; `import pipedejavu` does not

    from pipedejavu.search.hetero.engine import hetero_search

    key = jax.random.key(seed) if key is None else key
    return hetero_search(
        problem, config, key=key, progress_fn=progress_fn, time_budget_s=time_budget_s
    )


def _hetero_alpa(problem: Any):
    return alpa_homogeneous(problem)


def _hetero_brute_force(problem: Any):
    return hetero_brute_force(problem)


#: methods for a :class:`pipedejavu.HeteroProblem` (typed devices, links).
HETERO_METHODS: dict[str, tuple[Callable[..., Any], frozenset[str], str]] = {
    "dp": (
        _hetero_dp,
        frozenset({"time_limit_s", "progress_fn"}),
        "exact oracle over every valid plan (any placement, mixed-type stages)",
    ),
    "diff": (
        _hetero_diff,
        frozenset({"config", "seed", "key", "progress_fn", "time_budget_s"}),
        "the differentiable engine over the same space, certified lower bound",
    ),
    "alpa": (
        _hetero_alpa,
        frozenset(),
        "Alpa's way: its DP at the average speed, no links, placed as Alpa "
        "places stages on hosts (pipeline order, or its runtime slicing)",
    ),
    "brute_force": (
        _hetero_brute_force,
        frozenset(),
        "every valid plan enumerated; tiny problems only",
    ),
}


def solve(
    problem: Problem | HeteroProblem | str | os.PathLike,
    method: str = "dp",
    **options: Any,
) -> Plan | HeteroPlan:
    """Find a plan for ``problem`` with the named method.

    Args:
        problem: the instance: a :class:`Problem` (Alpa's formulation; methods
            :data:`METHODS`) or a :class:`pipedejavu.HeteroProblem` (typed
            devices and links; methods :data:`HETERO_METHODS`, which return a
            :class:`pipedejavu.HeteroPlan`); or a problem file or example name,
            read with :func:`pipedejavu.load_problem` (an Alpa ``.npy`` needs
            its run settings: load it with ``load_problem`` first).
        method: a method name, e.g. ``"dp"``, ``"diff"``.
        **options: method options. ``"dp"``: ``alpa_compatible=True`` for Alpa's
            own answer (its full cap scan), and ``progress_fn(position,
            num_candidates, num_evaluated)`` called after each cap of that scan.
            ``"diff"``: ``config`` (a ``search.SearchConfig``), ``num_restarts``,
            ``num_steps``, ``seed`` (or a ``key``), ``progress_fn(steps done,
            total, best relaxed loss)``. ``"random"``: ``num_samples``,
            ``seed``. ``"anneal"``: ``num_steps``, ``seed``, ``initial``,
            ``initial_temperature``, ``final_temperature``, ``score_fn(plan)``
            (e.g. a simulator; default the objective), ``progress_fn``,
            ``time_budget_s``.

    Returns:
        A valid :class:`Plan` whose ``cost`` equals ``evaluate(problem, plan)``.

    Raises:
        ProblemError: unknown method or option, or an unreadable file.
        InfeasibleProblemError: no feasible plan; the message says why.
    """
    if isinstance(problem, (str, os.PathLike)):
        problem = load_problem(problem)
    elif not isinstance(problem, (Problem, HeteroProblem)):
        raise ProblemError(
            "problem must be a Problem, a HeteroProblem, or a problem file path "
            f"or example name, got {type(problem).__name__}"
        )
    hetero = isinstance(problem, HeteroProblem)
    if hetero and "alpa_compatible" in options and method == "dp":
        raise ProblemError(
            "alpa_compatible reproduces Alpa's training_dp on a homogeneous "
            "Problem; for a HeteroProblem use method 'alpa' (Alpa's way)"
        )
    table = HETERO_METHODS if hetero else METHODS
    if method not in table:
        kind = "a heterogeneous problem" if table is HETERO_METHODS else "a problem"
        raise ProblemError(
            f"unknown method {method!r} for {kind}; choose one of {', '.join(table)}"
        )
    solver, accepted, _ = table[method]
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ProblemError(
            f"method {method!r} takes no option {', '.join(unknown)}"
            + (f" (it takes: {', '.join(sorted(accepted))})" if accepted else "")
        )
    return solver(problem, **options)
