"""Brute-force oracle for tiny instances: every plan, checked by the same rules."""

from __future__ import annotations

import math
import time

import numpy as np

from pipedejavu.problem import (
    InfeasibleProblemError,
    Plan,
    Problem,
    ProblemError,
    make_plan,
)

__all__ = ["brute_force"]


def brute_force(problem: Problem, *, max_plans: int = 5_000_000) -> Plan:
    """Enumerate every contiguous partition x submesh x config; keep the best.

    Independent of the DP on purpose: plain recursion over stage boundaries, no
    caps, no buckets. Among equal costs the first plan in enumeration order
    (shorter first stage first) wins. Only for tiny problems (L <= ~8).

    Raises:
        InfeasibleProblemError: no plan satisfies the rules.
        ProblemError: more than ``max_plans`` partial plans would be visited
            (the problem is too large to enumerate).
    """
    started = time.perf_counter()
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes.tolist()
    table, memory = problem.compute_cost, problem.max_n_succ_stages
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
