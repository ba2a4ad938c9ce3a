"""Benchmark reference only: the exact oracle as it was before issue 17.

It searched *canonical* placements only (each type's stages packed in pipeline
order onto its hosts, one type per stage): the "today's" oracle that
``hetero_vs_alpa.py`` times side by side with the current one, and whose
optimum it reports next to the true one. Kept verbatim in logic (merged from
the former ``search/_hetero_dp.py`` and ``search/hetero_exact.py``); not part
of the package.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import make_hetero_plan
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.search.hetero.exact import HeteroTimeoutError
from pipedejavu.search.hetero.units import span_mask

__all__ = ["canonical_exact"]

#: ``(start, stop, submesh, config, type)`` of one stage, half-open layers.
StageTuple = tuple[int, int, int, int, int]


class _Setup(NamedTuple):
    table: NDArray[np.float64]  # [L, L, M, K, T] restricted, inf = excluded
    memory: NDArray[np.int64]  # [L, L, M, K, T]
    transfer: NDArray[np.float64]  # [L + 1, T, T, 2] (prev ended inside a host)
    starts: NDArray[np.int64]  # layers where some stage may start, ascending
    grid: tuple[int, ...]  # (N_t + 1) per type
    heights: tuple[int, ...]  # [M]
    widths: tuple[int, ...]  # [M]
    dph: int
    full_buckets: int
    placeable: NDArray[np.bool_]  # [M, max N_t + 1] a stage on m may start at u
    span_start: NDArray[np.int64]  # [P] spans with some finite entry
    span_end: NDArray[np.int64]  # [P] inclusive
    span_table: NDArray[np.float64]  # [P, M, K, T]
    span_memory: NDArray[np.int64]  # [P, M, K, T]


class _Interrupted(Exception):
    """The deadline passed during a DP pass."""


def _setup(problem: HeteroProblem, allowed: Any) -> _Setup:
    cluster = problem.cluster
    mask = span_mask(problem, allowed)
    table = np.where(
        mask[:, :, None, None, None] & (problem.max_n_succ_stages >= 0),
        problem.compute_cost,
        np.inf,
    )
    num_layers, num_types = problem.num_layers, problem.num_types
    transfer = np.full((num_layers + 1, num_types, num_types, 2), np.inf)
    ends = np.flatnonzero(np.isfinite(table).any(axis=(0, 2, 3, 4)))
    for stop in (ends + 1).tolist():
        if stop == num_layers:
            continue
        size = float(problem.boundary_bytes[stop - 1])
        for a in range(num_types):
            for b in range(num_types):
                inter = 2.0 * cluster.inter_host[a][b].time(size)
                transfer[stop, a, b, 0] = inter
                transfer[stop, a, b, 1] = (
                    2.0 * cluster.intra_host[a].time(size) if a == b else inter
                )
    max_stages = min(num_layers, problem.num_devices)
    limits = problem.max_n_succ_stages[np.isfinite(table)] + 1
    binding = limits[(limits >= 1) & (limits < max_stages)]
    span_start, span_end = np.nonzero(np.isfinite(table).any(axis=(2, 3, 4)))
    dph = cluster.devices_per_host
    offset = np.arange(max(cluster.devices_of_type()) + 1) % dph
    heights, widths = problem.submesh_shapes[:, 0], problem.submesh_shapes[:, 1]
    placeable = np.where(
        heights[:, None] > 1,
        offset[None, :] == 0,
        offset[None, :] + widths[:, None] <= dph,
    )
    return _Setup(
        table=table,
        memory=problem.max_n_succ_stages,
        transfer=transfer,
        starts=np.flatnonzero(np.isfinite(table).any(axis=(1, 2, 3, 4))),
        grid=tuple(n + 1 for n in cluster.devices_of_type()),
        heights=tuple(int(x) for x in problem.submesh_shapes[:, 0]),
        widths=tuple(int(x) for x in problem.submesh_shapes[:, 1]),
        dph=cluster.devices_per_host,
        full_buckets=int(binding.max()) + 1 if binding.size else 1,
        placeable=placeable,
        span_start=span_start,
        span_end=span_end,
        span_table=table[span_start, span_end],
        span_memory=problem.max_n_succ_stages[span_start, span_end],
    )


def _stage_costs(setup: _Setup, cap: float, num_buckets: int) -> NDArray:
    """f64[NB + 1, L, L, M, T]: the cheapest admissible config (row 0 unused).

    Bucket ``s`` admits ``max_n_succ_stages >= s - 1``; the last, lumped bucket
    stands for every ``s >= num_buckets`` with the same threshold (a relaxation
    unless ``num_buckets`` is ``full_buckets``). Work is proportional to the
    spans in use, not to L^2.
    """
    num_layers, _, num_submeshes, _, num_types = setup.table.shape
    cost = np.full(
        (num_buckets + 1, num_layers, num_layers, num_submeshes, num_types), np.inf
    )
    table = np.where(setup.span_table <= cap, setup.span_table, np.inf)
    for bucket in range(1, num_buckets + 1):
        admitted = np.where(setup.span_memory >= bucket - 1, table, np.inf)
        cost[bucket, setup.span_start, setup.span_end] = admitted.min(axis=2)
    return cost


def _placeable(setup: _Setup, m: int, length: int) -> NDArray[np.bool_]:
    """bool[length]: where a stage on submesh ``m`` may start (devices used)."""
    return setup.placeable[m, :length]


def _axis_shape(num_axes: int, axis: int, length: int) -> tuple[int, ...]:
    shape = [1] * num_axes
    shape[axis] = length
    return tuple(shape)


def _transfer_into(setup: _Setup, layer: int, a: int, b: int, cap: float):
    """Transfer seconds into a stage of type ``b`` at ``layer`` after one of type
    ``a``, broadcastable over the device grid; inf above the cap."""
    row = setup.transfer[layer, a, b]
    if a != b:
        return row[0] if row[0] <= cap else math.inf
    inside = np.arange(setup.grid[a]) % setup.dph != 0
    values = np.where(inside, row[1], row[0])
    values = np.where(values <= cap, values, np.inf)
    return values.reshape(_axis_shape(len(setup.grid), a, setup.grid[a]))


def _hand_over(w_layer: NDArray, num_buckets: int) -> NDArray:
    """Row ``s - 1`` (bucket ``s``): ``W[s - 1]`` for ``s < NB``, and
    ``min(W[NB - 1], W[NB])`` for the lumped bucket ``NB``."""
    succ = w_layer[:num_buckets].copy()
    np.minimum(succ[-1], w_layer[num_buckets], out=succ[-1])
    return succ


def _dp(
    setup: _Setup,
    stage_cost: NDArray,
    num_buckets: int,
    combine: np.ufunc,
    cap: float,
    deadline: float,
) -> tuple[NDArray, NDArray]:
    """One DP pass. Returns ``succ`` f64[NB, L + 1, *grid, T] (the value of
    the layers from ``l`` on with ``s`` stages, the previous stage of type ``a``
    ending at ``l``, transfer into ``l`` included; lumped as in
    :func:`_hand_over`) and ``v0`` f64[NB + 1, *grid, T] (stage at layer 0 of
    type ``b``, no transfer into it)."""
    num_layers = setup.table.shape[0]
    grid, num_types = setup.grid, len(setup.grid)
    succ = np.full((num_buckets, num_layers + 1) + grid + (num_types,), np.inf)
    terminal = np.full((num_buckets + 1,) + grid + (num_types,), np.inf)
    terminal[(0,) + tuple(n - 1 for n in grid)] = 0.0
    succ[:, num_layers] = _hand_over(terminal, num_buckets)
    v_layer = np.full((num_buckets + 1,) + grid + (num_types,), np.inf)
    for start in setup.starts[::-1].tolist():
        if time.perf_counter() > deadline:
            raise _Interrupted
        v_layer = np.full_like(v_layer, np.inf)
        for b in range(num_types):
            succ_b = succ[..., b]  # [NB, L + 1, *grid] (row s - 1 = bucket s)
            target = v_layer[1:, ..., b]  # [NB, *grid]
            for m in range(len(setup.heights)):
                size = setup.heights[m] * setup.widths[m]
                if size >= grid[b]:
                    continue
                costs = stage_cost[1:, start, :, m, b]  # [NB, L] by end layer
                ends = np.flatnonzero(np.isfinite(costs).any(axis=0))
                if ends.size == 0:
                    continue
                source = [slice(None)] * (2 + num_types)
                source[2 + b] = slice(size, None)
                gathered = succ_b[:, ends + 1][tuple(source)]
                candidates = combine(
                    costs[:, ends].reshape(costs.shape[0], ends.size, *[1] * num_types),
                    gathered,
                )
                best = candidates.min(axis=1)
                length = grid[b] - size
                ok = _placeable(setup, m, length)
                best = np.where(
                    ok.reshape(_axis_shape(1 + num_types, 1 + b, length)), best, np.inf
                )
                window = [slice(None)] * (1 + num_types)
                window[1 + b] = slice(0, length)
                view = target[tuple(window)]
                np.minimum(view, best, out=view)
        if start == 0:
            break
        w_layer = np.full_like(v_layer, np.inf)
        for a in range(num_types):
            for b in range(num_types):
                into = _transfer_into(setup, start, a, b, cap)
                np.minimum(
                    w_layer[..., a], combine(into, v_layer[..., b]), out=w_layer[..., a]
                )
        succ[:, start] = _hand_over(w_layer, num_buckets)
    if setup.starts.size == 0 or setup.starts[0] != 0:
        v_layer = np.full_like(v_layer, np.inf)
    return succ, v_layer


class _Tracer:
    """Backtracking by recomputation: re-derive each choice whose value equals the
    stored one exactly (same floating-point operations as the pass)."""

    def __init__(self, setup, stage_cost, succ, num_buckets, combine, cap):
        self.setup, self.stage_cost, self.succ = setup, stage_cost, succ
        self.num_buckets, self.combine, self.cap = num_buckets, combine, cap

    def stage_values(self, bucket: int, start: int, used: tuple[int, ...], b: int):
        """(value, end, m) options of a type-``b`` stage at ``start``."""
        setup = self.setup
        num_layers = setup.table.shape[0]
        for end in range(num_layers - 1, start - 1, -1):
            for m in range(len(setup.heights)):
                cost = self.stage_cost[bucket, start, end, m, b]
                size = setup.heights[m] * setup.widths[m]
                if not math.isfinite(cost) or used[b] + size >= setup.grid[b]:
                    continue
                if not setup.placeable[m, used[b]]:
                    continue
                after = list(used)
                after[b] += size
                tail = self.succ[(bucket - 1, end + 1) + tuple(after) + (b,)]
                yield float(self.combine(cost, tail)), end, m

    def stage_value(self, bucket, start, used, b) -> float:
        return min(
            (v for v, _, _ in self.stage_values(bucket, start, used, b)),
            default=math.inf,
        )

    def trace(self, bucket: int, b: int) -> list[tuple[int, int, int, int, int]]:
        """``(start, stop, m, type, bucket)`` per stage from a root state."""
        setup, num_buckets = self.setup, self.num_buckets
        num_layers = setup.table.shape[0]
        num_types = len(setup.grid)
        plan = []
        start, used = 0, tuple(0 for _ in setup.grid)
        while True:
            target = self.stage_value(bucket, start, used, b)
            end, m = next(
                (e, mm)
                for v, e, mm in self.stage_values(bucket, start, used, b)
                if v == target
            )
            plan.append((start, end + 1, m, b, bucket))
            after = list(used)
            after[b] += setup.heights[m] * setup.widths[m]
            start, used = end + 1, tuple(after)
            if start == num_layers:
                return plan
            wanted = self.succ[(bucket - 1, start) + used + (b,)]
            buckets = (
                [bucket - 1] if bucket < num_buckets else [num_buckets - 1, bucket]
            )
            found = None
            for next_bucket in buckets:
                if next_bucket < 1:
                    continue
                for nb in range(num_types):
                    into = setup.transfer[start, b, nb, int(used[b] % setup.dph != 0)]
                    if into > self.cap:
                        continue
                    value = self.combine(
                        into, self.stage_value(next_bucket, start, used, nb)
                    )
                    if value == wanted:
                        found = (next_bucket, nb)
                        break
                if found:
                    break
            if found is None:  # pragma: no cover - internal invariant
                raise RuntimeError("backtracking lost the optimal path")
            bucket, b = found


def _memory_ok(setup: _Setup, stages: list[StageTuple]) -> bool:
    return all(
        len(stages) - 1 - index <= setup.memory[start, stop - 1, m, k, t]
        for index, (start, stop, m, k, t) in enumerate(stages)
    )


def _solve_cap(
    setup: _Setup, cap: float, combine: np.ufunc, deadline: float
) -> tuple[float, list[StageTuple] | None]:
    """The DP under one cap, deepening the memory buckets only as needed."""
    num_buckets = 1
    while True:
        num_buckets = min(num_buckets, setup.full_buckets)
        stage_cost = _stage_costs(setup, cap, num_buckets)
        succ, v0 = _dp(setup, stage_cost, num_buckets, combine, cap, deadline)
        roots = v0[(slice(1, None),) + tuple(0 for _ in setup.grid)]  # [NB, T]
        if not np.isfinite(roots).any():
            return math.inf, None
        bucket, b = np.unravel_index(int(np.argmin(roots)), roots.shape)
        tracer = _Tracer(setup, stage_cost, succ, num_buckets, combine, cap)
        traced = tracer.trace(int(bucket) + 1, int(b))
        stages = []
        for start, stop, m, t, bucket_of in traced:
            costs = setup.table[start, stop - 1, m, :, t]
            memory = setup.memory[start, stop - 1, m, :, t]
            admissible = np.where(
                (costs <= cap) & (memory >= bucket_of - 1), costs, np.inf
            )
            stages.append((start, stop, m, int(np.argmin(admissible)), t))
        if num_buckets == setup.full_buckets or _memory_ok(setup, stages):
            return float(roots.min()), stages
        num_buckets *= 2


class CanonicalTimeoutError(HeteroTimeoutError):
    """``time_limit_s`` passed in the canonical oracle; carries what was found
    so far (the attributes of the package's :class:`HeteroTimeoutError`)."""


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
            span_mask(problem, allowed_boundaries)[:, :, None, None, None],
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


def canonical_exact(
    problem: HeteroProblem,
    *,
    allowed_boundaries: Collection[int] | NDArray[np.bool_] | None = None,
    incumbent_cost: float | None = None,
    time_limit_s: float | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> HeteroPlan | None:
    """The optimal canonically placed plan (module doc), transfers included.

    The arguments, the ``None`` return and :class:`InfeasibleProblemError` are
    those of :func:`pipedejavu.search.hetero.exact.hetero_exact` (the
    signature is kept alike so that ``hetero_vs_alpa.py`` calls both the same
    way), except that the plan's ``info`` holds only ``num_candidates``,
    ``num_evaluated`` and ``t_max``, and that past ``time_limit_s`` it raises
    :class:`CanonicalTimeoutError` (a :class:`TimeoutError`).
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
            method="canonical_exact",
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

        # The cap search of before issue 17, kept rather than calling the
        # package's pipedejavu.search.alpa.caps.search_caps: it solves the same
        # caps in the same order, but its open intervals (``heap``,
        # ``open_bound``) feed the lower bound reported to progress_fn and in
        # CanonicalTimeoutError, which search_caps does not expose.
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
        raise CanonicalTimeoutError(
            f"hetero_exact: time limit of {time_limit_s} s passed after "
            f"{len(sums)} of {candidates.size} candidate caps (best so far "
            f"{best_cost:.6g} s, lower bound {lower_bound():.6g} s)",
            best_plan=plan,
            lower_bound=lower_bound(),
            caps_evaluated=len(sums),
            num_candidates=int(candidates.size),
        ) from None
    return finish(info())
