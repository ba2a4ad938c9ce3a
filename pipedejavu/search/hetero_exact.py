"""The exact oracle for hardware-aware stage construction (canonical placements).

The plan space is :mod:`pipedejavu.hetero`'s: stages ``(start, stop, m, k, type)``
whose devices come from :func:`pipedejavu.hetero.place` (each type's stages packed
in pipeline order onto its hosts, no stage straddling a host boundary, every
device used), priced by ``T = sum t + sum c + (B - 1) * max(max t, max c)``.

**The DP** (:mod:`pipedejavu.search._hetero_dp`). Going backward over layers, a state is
``(s, i, u, a)``: ``s`` stages still to place from layer ``i`` (Alpa's memory rule
``s - 1 <= max_n_succ``; a single lumped bucket when no limit binds), ``u`` the
devices already used of every type (a grid of ``prod_t (N_t + 1)`` cells, the axis
numpy vectorizes over) and ``a`` the type of the stage that ended at ``i``.
Canonical packing makes the transfer into the stage at ``i`` a function of the
state: with the same type the two stages share a host exactly when
``u_a % devices_per_host != 0`` (the previous stage ended inside a host), otherwise
the inter-host link between the two types carries it. A stage of type ``b`` on
submesh ``(h, d)`` is placeable at ``u_b`` when ``u_b % dph + d <= dph``
(``h == 1``) or ``u_b % dph == 0``.

**The max term.** Every cap ``t`` among the sorted distinct stage latencies and
transfer times gets a min-sum DP with every stage and transfer ``<= t``;
``T(t) = S(t) + (B - 1) t`` bounds the plans whose bottleneck is ``<= t`` and is
attained at the optimum's bottleneck. ``S`` is non-increasing, so plans with
bottleneck in ``[t_a, t_b]`` cost ``>= max(S(t_b) + (B - 1) t_a, B t_a)``; a
best-first bisection over the caps (as :mod:`pipedejavu.search.exact`) solves only caps
whose bound can still beat the best plan. The smallest feasible cap comes from
one min-max DP. Memory buckets deepen 1, 2, 4, ... until the plan obeys the rule.

**Cost.** One pass is Theta(L^2 M T prod_t (N_t + 1)) (fewer spans under tight
caps or ``allowed_boundaries``); 15-35 caps are solved. Measured on 2 CPU cores,
generated GPT instances: 2 + 2 hosts x 8 at L = 128 in 1-3 s; three types on
1 + 1 + 2 hosts in 4-6 s, on 2 + 2 + 4 in 15-33 s (128 s at L = 256), on
4 + 4 + 8 (128 devices) in 240 s.

**Homogeneous reduction.** On ``Cluster.homogeneous(H, D)`` with free links (or
zero ``boundary_bytes``) the plan space is the subset of Alpa's plans whose
stages pack in pipeline order without straddling, so the optimum is ``>=``
:func:`pipedejavu.search.exact.exact_dp`'s, with equality on one host (everything packs)
and whenever some optimal Alpa plan packs.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.hetero import HeteroPlan, HeteroProblem, make_hetero_plan
from pipedejavu.problem import InfeasibleProblemError

from ._hetero_dp import StageTuple, _Interrupted, _Setup, _setup, _solve_cap, _span_mask

__all__ = ["HeteroTimeoutError", "explain_infeasible", "hetero_exact"]


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


def _plan_cost(setup: _Setup, problem: HeteroProblem, stages) -> float:
    latencies = [setup.table[a, b - 1, m, k, t] for a, b, m, k, t in stages]
    transfers, used = [], [0] * len(setup.grid)
    for (_, stop, m, _, t), (_, _, _, _, nt) in zip(stages, stages[1:], strict=False):
        used[t] += setup.heights[m] * setup.widths[m]
        transfers.append(setup.transfer[stop, t, nt, int(used[t] % setup.dph != 0)])
    bottleneck = max(max(latencies), max(transfers, default=0.0))
    return float(
        math.fsum(latencies)
        + math.fsum(transfers)
        + (problem.num_microbatches - 1) * bottleneck
    )


def explain_infeasible(problem: HeteroProblem, allowed_boundaries: Any = None) -> str:
    """Why no canonical plan exists, in one sentence."""
    setup = _setup(problem, allowed_boundaries)
    restricted = "" if allowed_boundaries is None else " within allowed_boundaries"
    finite = np.isfinite(
        np.where(
            _span_mask(problem, allowed_boundaries)[:, :, None, None, None],
            problem.compute_cost,
            np.inf,
        )
    )
    if not finite.any():
        return f"no stage has a profiled (finite) cost{restricted}"
    if not np.isfinite(setup.table).any():
        return f"every profiled stage is over its memory limit{restricted}"
    spans = np.isfinite(setup.table).any(axis=(2, 3, 4))
    reach = np.zeros(problem.num_layers + 1, dtype=bool)
    reach[0] = True
    for start in range(problem.num_layers):
        if reach[start]:
            reach[start + 1 :] |= spans[start, start:]
    if not reach[-1]:
        return (
            f"no chain of profiled stages{restricted} covers all "
            f"{problem.num_layers} layers (they reach layer "
            f"{int(np.flatnonzero(reach).max())})"
        )
    unlimited = np.iinfo(np.int64).max // 2
    relaxed = setup._replace(
        full_buckets=1,
        memory=np.where(np.isfinite(setup.table), unlimited, -1),
        span_memory=np.where(np.isfinite(setup.span_table), unlimited, -1),
    )
    if not math.isfinite(_solve_cap(relaxed, math.inf, np.maximum, math.inf)[0]):
        return (
            f"no chain of stages{restricted} packs exactly the devices of each "
            f"type {problem.cluster.devices_of_type()} without straddling hosts "
            f"({problem.cluster.describe()})"
        )
    return (
        "every plan that covers all layers with all devices breaks a memory limit "
        "(too many stages after a stage: max_n_succ_stages)"
    )


def _candidates(setup: _Setup, smallest: float) -> NDArray[np.float64]:
    values = np.concatenate(
        [
            setup.table[np.isfinite(setup.table)],
            setup.transfer[np.isfinite(setup.transfer)],
        ]
    )
    values = np.unique(values)
    return values[values >= smallest]


def hetero_exact(
    problem: HeteroProblem,
    *,
    allowed_boundaries: Collection[int] | NDArray[np.bool_] | None = None,
    incumbent_cost: float | None = None,
    time_limit_s: float | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> HeteroPlan | None:
    """The optimal canonically placed plan (module doc), transfers included.

    Args:
        problem: the instance.
        allowed_boundaries: restrict where stages may end: stage stops (half-open,
            in ``1..L - 1``; the stop ``L`` is always allowed, stages start at 0
            or an allowed stop), or a bool[L, L] mask of allowed spans
            ``[start, end]`` (inclusive, like :mod:`pipedejavu.search.engine`'s
            neighbourhood). The result is optimal within the restriction.
        incumbent_cost: seconds of a known plan; only cheaper plans are sought.
        time_limit_s: wall-clock budget; past it :class:`HeteroTimeoutError`.
        progress_fn: called after each cap with a dict (``caps_evaluated``,
            ``num_candidates``, ``best_cost``, ``lower_bound``, ``elapsed_s``).

    Returns:
        The plan (``info``: ``num_candidates``, ``num_evaluated``, ``t_max``),
        or ``None`` when ``incumbent_cost`` is given and no plan is cheaper.

    Raises:
        InfeasibleProblemError: no plan (within the restriction); says why.
        HeteroTimeoutError: the time limit passed (a :class:`TimeoutError`).
    """
    started = time.perf_counter()
    deadline = math.inf if time_limit_s is None else started + float(time_limit_s)
    setup = _setup(problem, allowed_boundaries)
    num_microbatches = problem.num_microbatches
    best_cost = math.inf if incumbent_cost is None else float(incumbent_cost)
    best_stages: list[StageTuple] | None = None
    best_cap = math.nan
    sums: dict[int, float] = {}
    heap: list[tuple[float, int, int]] = []
    candidates = np.zeros(0)
    # Bound of the caps not yet covered by the heap (the interval being solved,
    # or before the bisection starts, every cap: each plan costs >= B * its max).
    open_bound = -math.inf

    def lower_bound() -> float:
        return min([best_cost, open_bound] + [bound for bound, _, _ in heap])

    def finish(method_info: dict[str, Any]) -> HeteroPlan | None:
        if best_stages is None:
            return None
        return make_hetero_plan(
            problem,
            best_stages,
            method="hetero_exact",
            search_time_s=time.perf_counter() - started,
            info=method_info,
        )

    def info() -> dict[str, Any]:
        return {
            "num_candidates": int(candidates.size),
            "num_evaluated": len(sums) + 1,
            "t_max": best_cap,
        }

    try:
        smallest, _ = _solve_cap(setup, math.inf, np.maximum, deadline)
        if not math.isfinite(smallest):
            raise InfeasibleProblemError(
                explain_infeasible(problem, allowed_boundaries)
            )
        candidates = _candidates(setup, smallest)
        open_bound = num_microbatches * float(candidates[0])

        def solve_at(index: int) -> None:
            nonlocal best_cost, best_stages, best_cap
            cap = float(candidates[index])
            total, stages = _solve_cap(setup, cap, np.add, deadline)
            sums[index] = total
            if stages is not None:
                cost = _plan_cost(setup, problem, stages)
                if cost < best_cost:
                    best_cost, best_stages, best_cap = cost, stages, cap
            if progress_fn is not None:
                progress_fn(
                    {
                        "caps_evaluated": len(sums),
                        "num_candidates": int(candidates.size),
                        "best_cost": best_cost,
                        "lower_bound": lower_bound(),
                        "elapsed_s": time.perf_counter() - started,
                    }
                )

        def push(low: int, high: int) -> None:
            if high - low < 2:
                return
            floor_cap = float(candidates[low + 1])
            bound = max(
                sums[high] + (num_microbatches - 1) * floor_cap,
                num_microbatches * floor_cap,
            )
            if bound < best_cost:
                heapq.heappush(heap, (bound, low, high))

        # Caps with B * t >= best cannot help: every plan costs >= B * its max.
        last = int(np.searchsorted(candidates, best_cost / num_microbatches)) - 1
        if last >= 0:
            solve_at(0)
            last = int(np.searchsorted(candidates, best_cost / num_microbatches)) - 1
            last = min(max(last, 0), candidates.size - 1)
            if last > 0:
                solve_at(last)
                push(0, last)
        open_bound = math.inf
        while heap:
            bound, low, high = heapq.heappop(heap)
            if bound >= best_cost:
                continue
            middle = (low + high) // 2
            open_bound = bound
            solve_at(middle)
            push(low, middle)
            push(middle, high)
            open_bound = math.inf
    except _Interrupted:
        plan = finish(info())
        raise HeteroTimeoutError(
            f"hetero_exact: time limit of {time_limit_s} s passed after "
            f"{len(sums)} of {candidates.size} candidate caps (best so far "
            f"{best_cost:.6g} s, lower bound {lower_bound():.6g} s)",
            best_plan=plan,
            lower_bound=lower_bound(),
            caps_evaluated=len(sums),
            num_candidates=int(candidates.size),
        ) from None
    return finish(info())
