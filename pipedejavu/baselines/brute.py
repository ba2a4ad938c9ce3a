"""Brute-force oracle for tiny instances: every plan, checked by the same rules."""

from __future__ import annotations

import math
import time

import numpy as np

from pipedejavu.core.problem import (
    InfeasibleProblemError,
    Plan,
    Problem,
    ProblemError,
    make_plan,
)

__all__ = ["brute_force", "count_partial_plans"]


def count_partial_plans(problem: Problem, *, limit: float = math.inf) -> float:
    """How many partial plans :func:`brute_force` visits, counted without
    visiting them (a DP over ``(next layer, devices used)``).

    Every call of the enumeration is one ``(layer, devices)`` state reached
    through one chain of ``(stage, submesh, config)`` choices with a finite
    cost and at most ``D`` devices, so the count obeys
    ``N(layer, d) = 1 + sum_{stop, (m, k) finite} N(stop, d + size_m)``
    (``size_m <= D - d``), and the enumeration visits ``N(0, 0)``. Counting
    stops early (returns a value above ``limit``) once the count exceeds it.
    """
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes
    finite = np.isfinite(problem.compute_cost)  # [L, L, M, K]
    options = finite.sum(axis=3)  # [start, end, M]: configs per submesh
    counts = np.zeros((num_layers + 1, num_devices + 1))  # N(layer, devices)
    counts[num_layers] = 1.0
    for layer in range(num_layers - 1, -1, -1):
        row = np.ones(num_devices + 1)
        for stop in range(layer + 1, num_layers + 1):
            for m in np.flatnonzero(options[layer, stop - 1]).tolist():
                size = int(sizes[m])
                if size <= num_devices:
                    row[: num_devices + 1 - size] += (
                        options[layer, stop - 1, m] * counts[stop, size:]
                    )
        counts[layer] = row
        if row[0] > limit:
            return float(row[0])
    return float(counts[0, 0])


def brute_force(problem: Problem, *, max_plans: int = 5_000_000) -> Plan:
    """Enumerate every contiguous partition x submesh x config; keep the best.

    Independent of the DP on purpose: plain recursion over stage boundaries, no
    caps, no buckets. Among equal costs the first plan in enumeration order
    (shorter first stage first) wins. Only for tiny problems (L <= ~8).

    Raises:
        InfeasibleProblemError: no plan satisfies the rules.
        ProblemError: more than ``max_plans`` partial plans would be visited
            (the problem is too large to enumerate); counted up front by
            :func:`count_partial_plans`, before any enumeration.
    """
    started = time.perf_counter()
    visits = count_partial_plans(problem, limit=max_plans)
    if visits > max_plans:
        raise ProblemError(
            f"too large for brute force: it would visit {visits:.3g} partial "
            f"plans, more than {max_plans} (L = {problem.num_layers}, "
            f"D = {problem.num_devices}); use the dp method"
        )
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes.tolist()
    table, memory = problem.compute_cost, problem.max_n_succ_stages
    tails = problem.stage_tail_cost
    options = {
        (start, stop): [
            (int(m), int(k), float(table[start, stop - 1, m, k]))
            for m, k in zip(
                *np.nonzero(np.isfinite(table[start, stop - 1])), strict=True
            )
        ]
        for start in range(num_layers)
        for stop in range(start + 1, num_layers + 1)
    }
    best = [math.inf, None]
    visited = 0

    def extend(layer: int, devices: int, chosen: list) -> None:
        nonlocal visited
        visited += 1
        if visited > max_plans:
            raise ProblemError(
                f"too large for brute force: gave up after {max_plans} partial "
                f"plans (L = {num_layers}); use the dp method"
            )
        if layer == num_layers:
            if devices != num_devices:
                return
            num_stages = len(chosen)
            for index, (start, stop, m, k, _) in enumerate(chosen):
                if num_stages - 1 - index > memory[start, stop - 1, m, k]:
                    return
            latencies = [latency for *_, latency in chosen]
            cost = math.fsum(latencies) + (problem.num_microbatches - 1) * max(
                latencies
            )
            if tails is not None:  # Megatron-style plans: + the largest tail
                cost += max(
                    tails[start, stop - 1, m, k] for start, stop, m, k, _ in chosen
                )
            if cost < best[0]:
                best[0], best[1] = cost, [c[:4] for c in chosen]
            return
        for stop in range(layer + 1, num_layers + 1):
            for m, k, latency in options[(layer, stop)]:
                if devices + sizes[m] <= num_devices:
                    chosen.append((layer, stop, m, k, latency))
                    extend(stop, devices + sizes[m], chosen)
                    chosen.pop()

    extend(0, 0, [])
    if best[1] is None:
        raise InfeasibleProblemError("no plan satisfies the rules (brute force)")
    return make_plan(
        problem,
        best[1],
        method="brute_force",
        search_time_s=time.perf_counter() - started,
    )
