"""The exact oracle for hardware-aware stage construction, over every valid plan.

The plan space is :func:`pipedejavu.core.hetero_rules.check_hetero_plan`'s: any stages
on any hosts (a stage spanning hosts of several types is priced at its slowest
type and obeys the memory rule of each), any placement, host sharing decided by
the links. It is exact for the all-in-flight objective
``T = sum t + sum c + (B - 1) * max(max t, max c)``
(:func:`pipedejavu.core.hetero_rules.hetero_bound`), a lower bound on the
planner's 1F1B objective (:func:`~pipedejavu.core.hetero_rules.hetero_objective`)
of every plan, equal to it with free links. Every plan it solves for is priced
on the 1F1B objective and the cheapest kept; ``info["lower_bound"]`` is the
optimum of ``T`` (certified: the evaluated caps and the intervals between them)
and ``info["proven"]`` says ``"optimal"`` when the plan's objective meets it,
else ``"bounded"`` (``info["gap"]`` the certified gap):
:func:`pipedejavu.search.hetero.polish.exact_then_polish` (``solve(..., "dp")``)
then improves the plan by local moves on the 1F1B objective.

**Reduction (proved in the modules below).** Device windows and host identity
never change a cost: links depend on the hosts' types, and any partial stages
whose widths add up to a host's size fit side by side. So a plan is a sequence
of *units* -- blocks (maximal runs of partial stages of one type sharing a
host, intra-host transfers inside) and whole-host stages (a composition of
hosts per type, a first and a last host type) -- with inter-host transfers
between units, and it is valid iff every type's blocks pack onto the hosts its
whole stages leave (:mod:`pipedejavu.search.hetero.place`).

**Algorithm.** For a cap ``t`` on every stage and transfer time, the least
``sum t + sum c`` of the plans under it, ``S(t)``, is found in two steps:

1. the relaxation R (:mod:`pipedejavu.search.hetero.dp`): a DP over layers whose
   state is the devices used per type and the type the last unit ends on. R
   admits every valid plan at its exact cost, so ``S_R(t) <= S(t)``;
2. if R's optimal plan packs onto the hosts, ``S(t) = S_R(t)`` and that plan is
   optimal under the cap. Otherwise an A* search over units with every host's
   fill in its state, guided by R's values (a consistent heuristic), finds the
   optimum under the cap exactly.

``T(t) = S(t) + (B - 1) t`` bounds the plans whose bottleneck is ``<= t`` and
is attained at the optimum's bottleneck; the best-first branch and bound over
the sorted caps is :func:`pipedejavu.search.alpa.caps.search_caps` (a plan with its
bottleneck in ``[t_a, t_b]`` costs ``>= max(S(t_b) + (B - 1) t_a, B t_a)``).
The smallest feasible cap comes from the min-max version of the same two steps.
Memory buckets deepen 1, 2, 4, ... until the plan obeys Alpa's rule.

**Boundary of exactness.** The result is exact whenever it returns. The cost
grows with the device grid ``prod_t (N_t dph + 1)`` (as the canonical DP did)
and, when R's plans do not pack, with the number of host-fill states A*
visits; past ``time_limit_s`` a :class:`HeteroTimeoutError` carries the best
plan and a lower bound. Measured costs: ``benchmarks/hetero_vs_alpa.py``.

**Homogeneous reduction.** On ``Cluster.homogeneous(H, D)`` with free links
(or zero ``boundary_bytes``) every Alpa plan that some placement packs is a
plan here at Alpa's cost, so the optimum equals
:func:`pipedejavu.search.alpa.exact.exact_dp`'s whenever an optimal Alpa plan packs
(always on one host, and with power-of-two submeshes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import make_hetero_plan
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.search.alpa.caps import search_caps
from pipedejavu.search.hetero.dp import Interrupted, Unit, solve_relaxed
from pipedejavu.search.hetero.place import astar, realize, stage_tuples
from pipedejavu.search.hetero.units import Setup, build, candidate_caps, span_mask

__all__ = [
    "HeteroTimeoutError",
    "between_caps_bound",
    "explain_infeasible",
    "hetero_exact",
]


class HeteroTimeoutError(TimeoutError):
    """``time_limit_s`` passed; carries what was found so far.

    Attributes:
        best_plan: the best plan found (``None`` if none beat the incumbent).
        lower_bound: seconds; no plan costs less (``-inf`` if unknown yet).
        caps_evaluated, num_candidates: progress of the cap search.
    """

    def __init__(
        self,
        message: str,
        *,
        best_plan: HeteroPlan | None,
        lower_bound: float,
        caps_evaluated: int,
        num_candidates: int,
    ):
        super().__init__(message)
        self.best_plan = best_plan
        self.lower_bound = lower_bound
        self.caps_evaluated = caps_evaluated
        self.num_candidates = num_candidates


def memory_ok(setup: Setup, units: list[Unit]) -> bool:
    """Alpa's memory rule on every stage of a relaxed plan."""
    keys = []
    for unit in units:
        for start, stop, m, k in unit.stages:
            key = ("p", m, unit.type) if unit.kind == "block" else ("w", unit.whole)
            keys.append((key, start, stop - 1 - start, k))
    return all(
        len(keys) - 1 - s <= setup.unit_memory[key][i, j, k]
        for s, (key, i, j, k) in enumerate(keys)
    )


def _solve(
    problem: HeteroProblem,
    setup: Setup,
    cap: float,
    combine: Any,
    full: int,
    threshold: float,
    deadline: float,
    counters: dict[str, int],
):
    """The exact optimum under ``cap`` (module docstring): ``(value, units,
    placement)``, or ``(bound, None, None)`` when no plan is below
    ``threshold`` (``bound`` a lower bound; inf when no plan exists)."""
    num_buckets = 1
    while True:
        num_buckets = min(num_buckets, full)
        relaxed = solve_relaxed(setup, cap, combine, num_buckets, deadline)
        if not math.isfinite(relaxed.value):
            return math.inf, None, None
        exact = num_buckets == full
        if exact or memory_ok(setup, relaxed.units):
            placement = realize(problem, setup, relaxed.units)
            if placement is not None:
                return relaxed.value, relaxed.units, placement
            counters["searched"] += 1
            value, units, placement = astar(
                problem, setup, relaxed, threshold=threshold, deadline=deadline
            )
            if units is None or exact or memory_ok(setup, units):
                return value, units, placement
        num_buckets *= 2


def _unlimited(setup: Setup) -> Setup:
    big = np.iinfo(np.int64).max // 4
    memory = {
        key: np.where(np.isfinite(setup.unit_cost[key][0]), big, -1)
        for key in setup.unit_memory
    }
    return setup._replace(unit_memory=memory)


def explain_infeasible(problem: HeteroProblem, allowed_boundaries: Any = None) -> str:
    """Why no valid plan exists, in one sentence."""
    setup = build(problem, allowed_boundaries)
    restricted = "" if allowed_boundaries is None else " within allowed_boundaries"
    spans = span_mask(problem, allowed_boundaries)[
        :, :, None, None, None
    ] & np.isfinite(problem.compute_cost)
    if not spans.any():
        return f"no stage has a profiled (finite) cost{restricted}"
    usable = {
        key: setup.mask & np.isfinite(cost).any(axis=2)
        for key, (cost, _) in setup.unit_cost.items()
    }
    if not any(u.any() for u in usable.values()):
        return (
            f"no profiled stage{restricted} fits the cluster's devices within its "
            f"memory limit ({problem.cluster.describe()})"
        )
    covered = np.logical_or.reduce(list(usable.values()))  # [start, length - 1]
    reach = np.zeros(problem.num_layers + 1, dtype=bool)
    reach[0] = True
    for start in range(problem.num_layers):
        if reach[start]:
            reach[start + 1 :] |= covered[start, : problem.num_layers - start]
    if not reach[-1]:
        return (
            f"no chain of profiled stages{restricted} covers all "
            f"{problem.num_layers} layers (they reach layer "
            f"{int(np.flatnonzero(reach).max())})"
        )
    free = _unlimited(setup)
    counters = {"searched": 0}
    relaxed = solve_relaxed(free, math.inf, np.maximum, 1)
    if not math.isfinite(relaxed.value):
        return (
            f"no chain of stages{restricted} uses exactly the devices of each type "
            f"{problem.cluster.devices_of_type()} ({problem.cluster.describe()})"
        )
    value, _, _ = _solve(
        problem, free, math.inf, np.maximum, 1, math.inf, math.inf, counters
    )
    if not math.isfinite(value):
        return (
            f"no chain of stages{restricted} fits the hosts: every chain that uses "
            "each type's devices exactly has partial stages that cannot be laid "
            f"out on hosts of {problem.cluster.devices_per_host} devices without "
            "straddling two hosts"
        )
    return (
        f"every plan{restricted} that covers all layers with all devices breaks a "
        "memory limit (too many stages after a stage: max_n_succ_stages)"
    )


def between_caps_bound(sums: dict[int, float], caps: NDArray, batches: int) -> float:
    """The least cost of a plan whose bottleneck lies strictly between two
    solved caps, below the first or above the last (``inf`` when every cap is
    solved).

    ``sums`` maps solved indices of the sorted ``caps`` to the least sum under
    that cap, ``batches`` is ``B``: a plan with its bottleneck between solved
    caps ``c_a < c_b`` costs ``>= max(S(c_b) + (B - 1) c_a', B c_a')`` (``c_a'``
    the next candidate), one above the last solved cap ``>= B c_a'``. Shared
    by :func:`hetero_exact` and :func:`pipedejavu.search.hetero.rbound.relaxed_bound`.
    """
    bound = math.inf
    solved = sorted(sums)
    for low, high in zip([-1] + solved, solved + [caps.size], strict=True):
        if high - low < 2:
            continue
        floor = float(caps[low + 1])
        if high < caps.size:
            part = max(sums[high] + (batches - 1) * floor, batches * floor)
        else:
            part = batches * floor
        bound = min(bound, part)
    return bound


def _lower_bound(
    sums: dict[int, float], caps: NDArray, best: float, batches: int
) -> float:
    """No plan costs less: the incumbent, or a plan whose bottleneck lies
    between two solved caps, below the first or above the last."""
    return min(best, between_caps_bound(sums, caps, batches))


def hetero_exact(
    problem: HeteroProblem,
    *,
    allowed_boundaries: Collection[int] | NDArray[np.bool_] | None = None,
    incumbent_cost: float | None = None,
    time_limit_s: float | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> HeteroPlan | None:
    """The optimal plan over every valid plan (module doc), transfers included.

    Args:
        problem: the instance.
        allowed_boundaries: restrict where stages may end: stage stops (half-open,
            in ``1..L - 1``; the stop ``L`` is always allowed, stages start at 0
            or an allowed stop), or a bool[L, L] mask of allowed spans
            ``[start, end]`` (inclusive, like :mod:`pipedejavu.search.engine.driver`'s
            neighbourhood). The result is optimal within the restriction.
        incumbent_cost: seconds of a known plan; only cheaper plans are sought.
        time_limit_s: wall-clock budget; past it :class:`HeteroTimeoutError`.
        progress_fn: called after each cap with a dict (``caps_evaluated``,
            ``num_candidates``, ``best_cost``, ``lower_bound``, ``elapsed_s``).

    Returns:
        The plan (``info``: ``num_candidates``; ``num_evaluated``, the caps
        the branch and bound evaluated plus the min-max one; ``num_solved``,
        those that needed a DP pass (the others were known from a plan found
        at a larger cap); ``num_searched``, solves whose relaxed optimum did
        not pack and went to A*; ``t_max``, the cap of the best plan), or
        ``None`` when ``incumbent_cost`` is given and no plan is cheaper.

    Raises:
        InfeasibleProblemError: no plan (within the restriction); says why.
        HeteroTimeoutError: the time limit passed (a :class:`TimeoutError`).
    """
    started = time.perf_counter()
    deadline = math.inf if time_limit_s is None else started + float(time_limit_s)
    setup = build(problem, allowed_boundaries)
    batches = problem.num_microbatches
    full = setup.full_buckets
    best: dict[str, Any] = {
        "cost": math.inf if incumbent_cost is None else float(incumbent_cost),
        "plan": None,
        "cap": math.nan,
    }
    sums: dict[int, float] = {}
    counters = {"searched": 0, "solved": 1}
    caps = np.zeros(0)

    def certified() -> float:
        # every plan's objective is >= its hetero_bound, >= S(c) + (B - 1) c at
        # its bottleneck c: an evaluated cap, or one between them
        evaluated = [sums[i] + (batches - 1) * float(caps[i]) for i in sums]
        return min([_lower_bound(sums, caps, best["cost"], batches)] + evaluated)

    def info() -> dict[str, Any]:
        bound = certified()
        return {
            "num_candidates": int(caps.size),
            "num_evaluated": len(sums) + 1,
            "t_max": best["cap"],
            "num_solved": counters["solved"],
            "num_searched": counters["searched"],
            "lower_bound": bound,
            "gap": best["cost"] / bound - 1 if bound > 0 else 0.0,
            "proven": "optimal" if best["cost"] <= bound else "bounded",
        }

    def finish() -> HeteroPlan | None:
        plan = best["plan"]
        if plan is None:
            return None
        return dataclasses.replace(
            plan, search_time_s=time.perf_counter() - started, info=info()
        )

    def consider(units: list[Unit], placement, cap: float) -> HeteroPlan:
        plan = make_hetero_plan(
            problem, stage_tuples(units), method="hetero_exact", placement=placement
        )
        if plan.cost < best["cost"]:
            best.update(cost=plan.cost, plan=plan, cap=cap)
        return plan

    try:
        smallest, units, placement = _solve(
            problem, setup, math.inf, np.maximum, full, math.inf, deadline, counters
        )
        if units is None:
            raise InfeasibleProblemError(
                explain_infeasible(problem, allowed_boundaries)
            )
        caps = candidate_caps(setup, smallest)
        if batches * smallest >= best["cost"]:
            return None

        # (cap, least sum, the bottleneck of the plan attaining it): S is
        # non-increasing, so S(c') = S(c) whenever that plan fits under c' <= c.
        known: list[tuple[float, float, float]] = []

        def solve_at(index: int) -> float:
            cap = float(caps[index])
            cached = [
                total
                for solved_cap, total, bottleneck in known
                if bottleneck <= cap <= solved_cap
            ]
            if cached:
                sums[index] = cached[0]
            else:
                threshold = best["cost"] - (batches - 1) * float(caps[0])
                value, found, where = _solve(
                    problem, setup, cap, np.add, full, threshold, deadline, counters
                )
                counters["solved"] += 1
                sums[index] = value
                if found is not None:
                    plan = consider(found, where, cap)
                    bottleneck = max(
                        max(plan.transfers, default=0.0),
                        max(stage.latency for stage in plan.stages),
                    )
                    known.append((cap, value, bottleneck))
            if progress_fn is not None:
                progress_fn(
                    {
                        "caps_evaluated": len(sums),
                        "num_candidates": int(caps.size),
                        "best_cost": best["cost"],
                        "lower_bound": _lower_bound(sums, caps, best["cost"], batches),
                        "elapsed_s": time.perf_counter() - started,
                    }
                )
            return sums[index]

        search_caps(caps, solve_at, lambda: best["cost"], batches)
    except Interrupted:
        bound = certified()
        raise HeteroTimeoutError(
            f"hetero_exact: time limit of {time_limit_s} s passed after "
            f"{len(sums)} of {caps.size} candidate caps (best so far "
            f"{best['cost']:.6g} s, lower bound {bound:.6g} s)",
            best_plan=finish(),
            lower_bound=bound if caps.size else -math.inf,
            caps_evaluated=len(sums),
            num_candidates=int(caps.size),
        ) from None
    return finish()
