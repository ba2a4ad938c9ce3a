"""Alpa's ``training_dp``, reproduced answer for answer (``alpa_compatible=True``).

What Alpa does (``alpa/pipeline_parallel/stage_construction.py``), and so what this
module does:

* Candidate caps ``t_max``: ``np.sort(np.unique(compute_cost))``, ascending.
  A candidate is skipped when it is less than ``gap = 1e-6`` above the last
  *evaluated* one (the last starts at 0.0, so every cap below 1e-6 is skipped);
  the scan stops at the first cap with ``t_max * B >= best``.
* Under each cap, ``f[s, i, j]`` = least stage-latency sum of layers ``i..L-1``
  in ``s`` stages on ``j`` devices, every stage ``<= t_max`` and admissible for
  memory (``s - 1 <= max_n_succ_stages``). The loops run over ``s``, ``i``,
  ``j``, then stage ends ``k = L .. i+1`` (longest stage first), submeshes and
  configs, with strict ``<`` updates. ``f`` and the recorded slowest stage
  ``f_stage_max`` (of the *chosen* path, not minimized) are float32 arrays;
  the candidate sums are float64. The number of stages is the smallest ``s``
  among equal ``f[s, 0, D]``; the plan's cost is ``f + (B - 1) * f_stage_max``,
  and a cap's plan replaces the best only when strictly cheaper.

The float32 storage makes Alpa's tie-breaking depend on rounding: a candidate
equal to the stored (rounded-up) value still compares ``<`` and wins. The
sequential rule is reproduced exactly without a scalar loop: with ``F`` the
float32 rounding of the least candidate, the winner is the last candidate after
the first one that rounds to ``F`` whose float64 value is below ``F`` (or that
first one). The loops are vectorized over devices and over all admissible
stages of the same start layer; the work per cap stays Alpa's
``Theta(L * E * D)`` for ``E`` admissible (stage, submesh, config) entries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, make_plan
from pipedejavu.search.alpa.caps import explain_infeasible
from pipedejavu.search.alpa.exact import exact_dp

__all__ = ["ALPA_GAP", "ScanTimeout", "alpa_training_dp"]

#: Alpa's absolute candidate gap, in the table's unit (Alpa: seconds).
ALPA_GAP = 1e-6


def _dp_under_cap(
    problem: Problem, cap: float
) -> tuple[float, list[tuple[int, int, int, int]] | None]:
    """Alpa's ``training_dp_impl`` under one cap: (float64 cost, stages) or (inf,
    None)."""
    num_layers, num_devices = problem.num_layers, problem.num_devices
    table, memory = problem.compute_cost, problem.max_n_succ_stages
    sizes = problem.submesh_sizes
    starts, ends, submeshes, configs = np.nonzero(table <= cap)
    # Alpa's candidate order per (s, i, j): k = end + 1 descending, m, config.
    order = np.lexsort((configs, submeshes, -ends, starts))
    starts, ends, submeshes, configs = (
        starts[order],
        ends[order],
        submeshes[order],
        configs[order],
    )
    costs = table[starts, ends, submeshes, configs]
    limits = memory[starts, ends, submeshes, configs]
    entry_sizes = sizes[submeshes]
    width = num_devices + 1
    shape = (num_layers + 1, num_layers + 1, width)
    f = np.full(shape, np.inf, dtype=np.float32)
    f_stage_max = np.zeros(shape, dtype=np.float32)
    f_argmin = np.full((*shape, 3), -1, dtype=np.int64)
    f[0, num_layers, 0] = 0.0
    devices = np.arange(width)
    for s in range(1, num_layers + 1):
        chosen = np.flatnonzero(limits >= s - 1)
        if chosen.size == 0 or not np.isfinite(f[s - 1]).any():
            break
        stops = ends[chosen] + 1
        left = devices[None, :] - entry_sizes[chosen][:, None]  # [E, D+1]
        fits = left >= 0
        previous = np.where(
            fits, f[s - 1][stops[:, None], np.maximum(left, 0)], np.inf
        ).astype(np.float64)
        candidates = previous + costs[chosen][:, None]  # float32 + float64 in f64
        group_start = np.flatnonzero(
            np.r_[True, starts[chosen][1:] != starts[chosen][:-1]]
        )
        group = np.cumsum(np.r_[True, starts[chosen][1:] != starts[chosen][:-1]]) - 1
        rounded = np.minimum.reduceat(candidates, group_start, axis=0).astype(
            np.float32
        )
        index = np.arange(chosen.size)[:, None]
        sentinel = chosen.size
        first = np.minimum.reduceat(
            np.where(candidates.astype(np.float32) == rounded[group], index, sentinel),
            group_start,
            axis=0,
        )
        later = (index > first[group]) & (
            candidates < rounded[group].astype(np.float64)
        )
        winner = np.maximum.reduceat(np.where(later, index, -1), group_start, axis=0)
        winner = np.where(winner >= 0, winner, first)
        found = np.isfinite(rounded)
        rows = starts[chosen][group_start]
        winner = np.where(found, winner, 0)
        entry = chosen[winner]  # [G, D+1]
        stop = ends[entry] + 1
        rest = devices[None, :] - entry_sizes[entry]
        stage_max = np.maximum(
            f_stage_max[s - 1][stop, np.maximum(rest, 0)].astype(np.float64),
            costs[entry],
        ).astype(np.float32)
        f[s, rows] = np.where(found, rounded, np.inf)
        f_stage_max[s, rows] = np.where(found, stage_max, 0.0)
        f_argmin[s, rows] = np.where(
            found[..., None],
            np.stack([stop, submeshes[entry], configs[entry]], axis=-1),
            -1,
        )

    finals = f[1:, 0, num_devices]
    if not np.isfinite(finals).any():
        return math.inf, None
    best_s = int(np.argmin(finals)) + 1  # first (smallest s) of the least value
    cost = float(f[best_s, 0, num_devices]) + (problem.num_microbatches - 1) * float(
        f_stage_max[best_s, 0, num_devices]
    )
    stages = []
    s, layer, left_devices = best_s, 0, num_devices
    while s > 0:
        stop, submesh, config = (int(x) for x in f_argmin[s, layer, left_devices])
        stages.append((layer, stop, submesh, config))
        s, layer, left_devices = s - 1, stop, left_devices - int(sizes[submesh])
    return cost, stages


class ScanTimeout(TimeoutError):
    """Alpa's cap scan ran past its time limit.

    Attributes:
        num_evaluated: caps solved before the limit.
        num_candidates: distinct finite stage costs (Alpa's caps).
        position: how far the scan got through the sorted candidates.
    """

    def __init__(
        self, num_evaluated: int, num_candidates: int, position: int, elapsed_s: float
    ):
        super().__init__(
            f"Alpa's cap scan stopped after {elapsed_s:.1f} s: {num_evaluated} caps "
            f"evaluated, {position} of {num_candidates} candidates passed"
        )
        self.num_evaluated = num_evaluated
        self.num_candidates = num_candidates
        self.position = position


def alpa_training_dp(
    problem: Problem,
    *,
    gap: float = ALPA_GAP,
    time_limit_s: float | None = None,
    progress_fn: Callable[[int, int, int], None] | None = None,
) -> Plan:
    """Alpa's ``training_dp`` answer: same plan, same (float32-accumulated) cost.

    Args:
        problem: the instance (costs in seconds, as Alpa assumes for its gap).
        gap: Alpa's candidate gap (1e-6 in Alpa).
        time_limit_s: stop with :class:`ScanTimeout` past this many seconds.
        progress_fn: called after every evaluated cap with
            ``(position, num_candidates, num_evaluated)``.

    Returns:
        Alpa's plan. ``plan.cost`` is the exact float64 objective of that plan;
        ``info["alpa_cost"]`` is the cost Alpa itself reports, and
        ``num_candidates`` / ``num_evaluated`` / ``num_skipped_gap`` /
        ``num_not_reached`` count the cap scan; ``trace`` lists
        ``(seconds, Alpa's cost)`` each time the scan found a cheaper plan.

    Raises:
        InfeasibleProblemError: Alpa finds no solution (also when the gap skip
            discards every cap that has one, e.g. all costs below 1e-6).
        ScanTimeout: past ``time_limit_s``.
    """
    started = time.perf_counter()
    candidates = np.sort(np.unique(problem.compute_cost))
    finite = int(np.isfinite(candidates).sum())
    best_cost, best_stages = math.inf, None
    trace: list[tuple[float, float]] = []
    last_cap = 0.0
    evaluated = skipped = 0
    position = 0
    for position, cap in enumerate(candidates.tolist()):
        if cap * problem.num_microbatches >= best_cost:
            break
        if cap - last_cap < gap:
            skipped += 1
            continue
        cost, stages = _dp_under_cap(problem, cap)
        evaluated += 1
        if cost < best_cost:
            best_cost, best_stages = cost, stages
            trace.append((time.perf_counter() - started, cost))
        last_cap = cap
        if progress_fn is not None:
            progress_fn(position, finite, evaluated)
        elapsed = time.perf_counter() - started
        if time_limit_s is not None and elapsed > time_limit_s:
            raise ScanTimeout(evaluated, finite, position + 1, elapsed)
    else:
        position = len(candidates)
    if best_stages is None:
        reason = explain_infeasible_alpa(problem, candidates, gap)
        raise InfeasibleProblemError(reason)
    return make_plan(
        problem,
        best_stages,
        method="dp-alpa",
        search_time_s=time.perf_counter() - started,
        info={
            "alpa_cost": best_cost,
            "num_candidates": finite,
            "num_evaluated": evaluated,
            "num_skipped_gap": skipped,
            "num_not_reached": max(finite - position, 0),
            "trace": trace,
        },
    )


def explain_infeasible_alpa(
    problem: Problem, candidates: NDArray[np.float64], gap: float
) -> str:
    """Why Alpa's DP returns no solution: the problem, or Alpa's gap skip."""
    finite = candidates[np.isfinite(candidates)]
    if finite.size and finite.max() < gap:
        return (
            f"Alpa's DP evaluates no cap: every stage cost is below its {gap:g} "
            "candidate gap (the exact DP, without --alpa-compatible, solves this)"
        )
    try:
        exact_dp(problem)
    except InfeasibleProblemError:
        return explain_infeasible(problem)
    return (
        f"Alpa's DP finds no solution because its {gap:g} candidate gap skipped "
        "every feasible cap (the exact DP, without --alpa-compatible, solves this)"
    )
