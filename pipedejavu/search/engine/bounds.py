"""A certified lower bound on the optimal pipeline latency, cheap at any size.

Every plan of a :class:`~pipedejavu.core.problem.Problem` costs
``T = sum_s t_s + (B - 1) * max_s t_s``. The bound relaxes the problem in three
valid ways and solves the relaxation almost exactly, so it is ``<= T`` for every
feasible plan, hence ``<=`` the optimum:

1. **Memory, in buckets.** A stage with ``r`` stages after it may use an entry
   only if ``max_n_succ_stages >= r``. The shortest paths below run backwards
   over layers with ``R`` follower buckets, ``r = 0..R-2`` exact and ``r >= R-1``
   lumped (admitting ``max_n_succ_stages >= R - 1``, a relaxation unless ``R`` is
   one more than the largest binding limit, as in the exact DP). Before that,
   entries are dropped that no feasible plan can use: a stage ending at ``j`` has
   at least ``f(j)`` followers (the fewest usable spans covering ``j+1..L-1``),
   one starting at ``i`` at least ``g(i)`` predecessors, and all of those hold
   ``>= min_size`` devices, so its submesh holds at most
   ``D - (f(j) + g(i)) * min_size``.
2. **Devices, by a Lagrangian.** For every real ``lam`` and every plan using
   exactly ``D`` devices, ``sum_s t_s = sum_s (t_s + lam * n_s) - lam * D``.
   Minimizing the right side over *all* contiguous partitions (any device total)
   is a shortest path over layer boundaries with span cost
   ``min_m (c[i, j, m] + lam * size_m)``: ``O(L^2 M R)``, no device axis. So
   ``phi_t(lam) = min_paths(...) - lam * D <= S_D(t)``, the least stage-latency
   sum of any feasible plan whose stages all take ``<= t``. ``phi_t`` is concave
   and piecewise linear with supergradient ``devices(path) - D``; it is
   maximized by bracketing and cutting planes (two supporting lines meet above
   the maximum, so the remaining gap is known).
3. **The slowest stage, by caps.** Giving each stage the cheapest config its
   bucket admits keeps a plan relaxed-feasible and lowers every ``t_s``, so it
   suffices to bound plans whose stage costs are values of the reduced tables:
   the sorted *caps*. ``H(t) = max_lam phi_t(lam)`` is non-increasing in ``t``.
   A plan whose slowest stage lies in ``(t_a, t_b]`` (two evaluated caps;
   ``t_a'`` the next cap above ``t_a``) has ``T >= (B - 1) * t_a' + H(t_b)`` and
   ``T >= B * t_a'``. The bound is the least of these over a partition of the
   caps from ``t_0`` up; splitting the weakest interval first tightens it (the
   exact DP's branch and bound, with ``S_D`` replaced by ``H``). ``t_0`` is the
   least cap at which some cover of the layers with stages ``<= t_0`` uses at
   most ``D`` devices and some uses at least ``D`` (both monotone in the cap): no
   feasible plan has a faster slowest stage.

The two textbook bounds are special cases, reported by :func:`bound_details`:
(a) *bottleneck*: layer ``l`` lies in some stage, which costs at least ``m_l``,
the least usable entry covering ``l``, so ``T >= B * max_l m_l``; (b)
*device-free sum*: ``T >= S_0 + (B - 1) * max_l m_l`` with ``S_0`` the least
stage-latency sum of any partition. ``t_0 >= max_l m_l`` and ``H >= S_0`` (take
``lam = 0``), so the returned bound is at least both.

Floating point: each ``phi`` is re-summed on its path with ``math.fsum`` and
lowered by a rounding margin, and the result by a relative ``16 (L + 4) eps``.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import Problem

__all__ = ["BoundDetails", "bound_details", "lower_bound"]

_EPS = float(np.finfo(np.float64).eps)


class BoundDetails(NamedTuple):
    """The bound and its parts (seconds unless noted).

    Attributes:
        bound: the certified lower bound on the optimal ``T``; ``inf`` only when
            the relaxation proves that no plan exists.
        bottleneck: bound (a), ``B * max_l m_l``.
        device_free: bound (b), ``S_0 + (B - 1) * max_l m_l``.
        min_cap: ``t_0``, a lower bound on the slowest stage of any plan.
        num_buckets: ``R``, the follower buckets used (1 when memory never binds).
        num_caps: caps at which ``H`` was evaluated.
        num_paths: shortest-path passes in all.
        time_s: wall time.
    """

    bound: float
    bottleneck: float
    device_free: float
    min_cap: float
    num_buckets: int
    num_caps: int
    num_paths: int
    time_s: float


def _offsets(num_layers: int) -> NDArray[np.int64]:
    """i64[L + 1] row starts of the packed span layout.

    Spans ``(i, j)`` (inclusive, ``i <= j``) are packed start-major: entry
    ``offsets[i] + j - i``, ``P = L (L + 1) / 2`` entries in all.
    """
    starts = np.arange(num_layers + 1, dtype=np.int64)
    return starts * num_layers - starts * (starts - 1) // 2


def _shortest_path(
    span: NDArray[np.float64],
) -> tuple[float, NDArray[np.int64], NDArray[np.int64]]:
    """Least-cost cover of layers ``0..L-1`` by spans, with follower buckets.

    Bucket ``r < R - 1`` holds the stages with exactly ``r`` followers, bucket
    ``R - 1`` those with ``>= R - 1`` (all of them when ``R == 1``).

    Args:
        span: f64[R, P] packed span costs per bucket (see :func:`_offsets`);
            inf = unusable; negative costs are fine (the graph is acyclic).

    Returns:
        The least total (inf if no cover), then i64[S] the packed span and
        i64[S] the bucket of each stage of that cover, in order.
    """
    num_buckets, size = span.shape
    num_layers = (math.isqrt(8 * size + 1) - 1) // 2
    offsets = _offsets(num_layers)
    rows = np.arange(num_buckets)
    best = np.full((num_buckets, num_layers + 1), np.inf)
    # hand[r, k]: best value a stage in bucket r can hand over to at layer k.
    hand = np.full((num_buckets, num_layers + 1), np.inf)
    hand_bucket = np.full((num_buckets, num_layers + 1), -1, dtype=np.int64)
    hand[0, num_layers] = 0.0
    end = np.zeros((num_buckets, num_layers), dtype=np.int64)
    for start in range(num_layers - 1, -1, -1):
        totals = span[:, offsets[start] : offsets[start + 1]] + hand[:, start + 1 :]
        pick = totals.argmin(axis=1)
        best[:, start] = totals[rows, pick]
        end[:, start] = start + pick
        if num_buckets == 1:
            hand[0, start], hand_bucket[0, start] = best[0, start], 0
            continue
        hand[1:-1, start] = best[:-2, start]
        hand_bucket[1:-1, start] = rows[:-2]
        own = best[-1, start] < best[-2, start]  # ties: fewer stages
        hand[-1, start] = best[-1 if own else -2, start]
        hand_bucket[-1, start] = num_buckets - 1 if own else num_buckets - 2
    bucket = int(best[:, 0].argmin())
    total = float(best[bucket, 0])
    spans, buckets = [], []
    if math.isfinite(total):
        start = 0
        while start < num_layers:
            stop = int(end[bucket, start]) + 1
            spans.append(offsets[start] + stop - 1 - start)
            buckets.append(bucket)
            bucket, start = int(hand_bucket[bucket, stop]), stop
    return total, np.asarray(spans, np.int64), np.asarray(buckets, np.int64)


def fewest_stages(usable: NDArray[np.bool_]) -> NDArray[np.float64]:
    """f64[L + 1] fewest usable spans covering layers ``l..L-1``, per ``l``.

    Args:
        usable: bool[L, L] indexed ``[start, end]``.
    """
    num_layers = usable.shape[0]
    fewest = np.full(num_layers + 1, np.inf)
    fewest[num_layers] = 0.0
    for start in range(num_layers - 1, -1, -1):
        ends = np.flatnonzero(usable[start, start:]) + start
        if ends.size:
            fewest[start] = 1.0 + fewest[ends + 1].min()
    return fewest


def _usable_entries(problem: Problem) -> NDArray[np.bool_]:
    """bool[L, L, M, K] the entries a feasible plan could use (relaxation 1)."""
    memory = problem.max_n_succ_stages
    sizes = problem.submesh_sizes
    usable = np.isfinite(problem.compute_cost) & (memory >= 0)
    for _ in range(problem.num_layers + 1):  # shrinks monotonically to a fixpoint
        spans = usable.any(axis=(2, 3))
        followers = fewest_stages(spans)[1:]  # [L] by end layer
        preceding = fewest_stages(spans[::-1, ::-1].T)[::-1][:-1]  # by start
        needed = followers[None, :] + preceding[:, None]  # [start, end]
        room = problem.num_devices - needed * sizes.min()
        refined = (
            usable
            & (memory >= followers[None, :, None, None])
            & (sizes[None, None, :, None] <= room[:, :, None, None])
        )
        if np.array_equal(refined, usable):
            break
        usable = refined
    return usable


def _full_buckets(problem: Problem, usable: NDArray[np.bool_]) -> int:
    """Buckets that make the memory rule exact: one more than the largest limit
    that can bind (a stage has at most ``min(L, D / min_size) - 1`` followers)."""
    most_followers = (
        min(problem.num_layers, problem.num_devices // problem.submesh_sizes.min()) - 1
    )
    limits = problem.max_n_succ_stages[usable]
    binding = limits[limits < most_followers]
    return int(binding.max()) + 2 if binding.size else 1


#: Seconds between progress lines of a long bound computation.
_REPORT_EVERY_S = 1.5


class _Relaxation:
    """The relaxed problem: packed bucket tables, feasibility and dual values.

    Args:
        problem: the instance.
        max_buckets: most follower buckets ``R`` (see :func:`_shortest_path`).
    """

    def __init__(self, problem: Problem, max_buckets: int):
        usable = _usable_entries(problem)
        self.num_buckets = min(_full_buckets(problem, usable), max_buckets)
        starts_of, ends_of = np.triu_indices(problem.num_layers)  # start-major
        # Packed [K, M, P] so that reductions run along long contiguous rows.
        cost = np.where(usable, problem.compute_cost, np.inf)[starts_of, ends_of]
        cost = np.ascontiguousarray(cost.transpose(2, 1, 0))
        memory = problem.max_n_succ_stages[starts_of, ends_of].transpose(2, 1, 0)
        # table[r, m, p]: cheapest config admissible with r followers.
        self.table = np.stack(
            [
                np.where(memory >= bucket, cost, np.inf).min(axis=0)
                for bucket in range(self.num_buckets)
            ]
        )
        self.sizes = problem.submesh_sizes.astype(np.float64)
        self.by_size = np.argsort(self.sizes, kind="stable")
        self.num_devices = problem.num_devices
        self.most_devices = problem.num_layers * float(self.sizes.max())
        self.margin = 8.0 * (problem.num_layers + 4) * _EPS
        self.num_paths = 0

    def path(
        self, span: NDArray[np.float64]
    ) -> tuple[float, NDArray[np.int64], NDArray[np.int64]]:
        self.num_paths += 1
        return _shortest_path(span)

    def feasible(self, cap: float) -> bool:
        """Whether some cover with stages ``<= cap`` uses at most ``D`` devices
        and some uses at least ``D`` (necessary for a plan with that cap)."""
        allowed = self.table <= cap  # [R, M, P]
        fewest = np.full(allowed.shape[::2], np.inf)  # [R, P]
        most = np.full(allowed.shape[::2], np.inf)  # minus the largest size
        for small, large in zip(self.by_size[::-1], self.by_size, strict=True):
            fewest = np.where(allowed[:, small], self.sizes[small], fewest)
            most = np.where(allowed[:, large], -self.sizes[large], most)
        low, _, _ = self.path(fewest)
        high, _, _ = self.path(most)
        return low <= self.num_devices <= -high

    def dual(self, capped: NDArray[np.float64], lam: float) -> tuple[float, float]:
        """``phi(lam)`` lowered by its rounding margin, and its supergradient
        ``devices(path) - D``; ``(-inf, 0)`` when no path exists."""
        span = capped[:, 0] + lam * self.sizes[0]  # [R, P]
        choice = np.zeros(span.shape, dtype=np.int64)
        for mesh in range(1, len(self.sizes)):
            priced = capped[:, mesh] + lam * self.sizes[mesh]
            better = priced < span
            span = np.where(better, priced, span)
            choice[better] = mesh
        total, spans, buckets = self.path(span)
        if not math.isfinite(total):
            return -math.inf, 0.0
        meshes = choice[buckets, spans]
        base = math.fsum(capped[buckets, meshes, spans].tolist())
        excess = float(self.sizes[meshes].sum()) - self.num_devices
        # Bounds the terms' absolute sum on this path and on the exact minimizer
        # (its device total is at most most_devices when lam < 0).
        devices = excess + self.num_devices if lam >= 0 else self.most_devices
        magnitude = base + abs(lam) * (devices + self.num_devices)
        return base + lam * excess - self.margin * magnitude, excess

    def max_dual(
        self, cap: float, lam: float, step: float, rtol: float
    ) -> tuple[float, float]:
        """``H(cap)`` from below (to relative gap ``rtol``) and the best ``lam``.

        Walks against the supergradient with doubling steps until it turns, then
        evaluates where the two bracketing supporting lines meet (their meeting
        point lies above the maximum, so the gap is known) until it closes.
        """
        capped = np.where(self.table <= cap, self.table, np.inf)
        value, slope = self.dual(capped, lam)
        best, best_lam = value, lam
        if slope == 0:
            return best, best_lam
        direction = 1.0 if slope > 0 else -1.0
        near = (lam, value, slope)
        for _ in range(200):  # a turn exists since min devices <= D <= max
            lam = near[0] + direction * step
            value, slope = self.dual(capped, lam)
            if value > best:
                best, best_lam = value, lam
            if slope == 0:
                return best, best_lam
            if (slope > 0) != (direction > 0):
                break
            near, step = (lam, value, slope), 2.0 * step
        low, high = sorted([near, (lam, value, slope)])
        for _ in range(100):
            (lam_a, value_a, slope_a), (lam_b, value_b, slope_b) = low, high
            meet = (value_b - value_a + slope_a * lam_a - slope_b * lam_b) / (
                slope_a - slope_b
            )
            ceiling = value_a + slope_a * (meet - lam_a)
            if ceiling - best <= rtol * abs(best) or not lam_a < meet < lam_b:
                break
            value, slope = self.dual(capped, meet)
            if value > best:
                best, best_lam = value, meet
            if slope == 0:
                break
            if slope > 0:
                low = (meet, value, slope)
            else:
                high = (meet, value, slope)
        return best, best_lam


def bound_details(
    problem: Problem,
    *,
    max_caps: int = 48,
    max_buckets: int = 8,
    rtol: float = 1e-4,
    progress_fn: Callable[[str], None] | None = None,
) -> BoundDetails:
    """The lower bound of the module docstring, with its parts.

    Args:
        problem: the instance.
        max_caps: most caps at which ``H`` is evaluated.
        max_buckets: most follower buckets ``R`` (cost grows linearly with it;
            fewer only weakens the memory part of the bound).
        rtol: relative gap at which the dual search and the cap refinement stop.
        progress_fn: receives a line (caps evaluated, the bound proven so far,
            seconds) about every 1.5 s once the computation takes that long.

    Returns:
        :class:`BoundDetails`; ``bound <= T`` of every feasible plan.
    """
    started = time.perf_counter()
    num_microbatches = problem.num_microbatches
    relax = _Relaxation(problem, max_buckets)
    proven = [0.0]  # the bound so far (every part found is a valid bound)

    def report(what: str) -> None:
        if progress_fn is None:
            return
        now = time.perf_counter()
        if now - reported[0] >= _REPORT_EVERY_S:
            reported[0] = now
            progress_fn(
                f"lower bound: {what}, {len(values)} caps evaluated, bound so far "
                f"{proven[0] * (1.0 - 2.0 * relax.margin):.6g} s, "
                f"{now - started:.1f} s"
            )

    reported = [started]

    def details(bound: float, *parts: float) -> BoundDetails:
        bound *= 1.0 - 2.0 * relax.margin
        return BoundDetails(
            bound,
            *parts,
            relax.num_buckets,
            len(values),
            relax.num_paths,
            time.perf_counter() - started,
        )

    values: dict[int, float] = {}
    cheapest = relax.table[0].min(axis=0)  # [P] least usable entry per span
    if not np.isfinite(cheapest).any():
        return details(math.inf, math.inf, math.inf, math.inf)
    num_layers = problem.num_layers
    dense = np.full((num_layers, num_layers), np.inf)  # [start, end]
    dense[np.triu_indices(num_layers)] = cheapest
    # m_l = min over spans i <= l <= j: suffix minimum over ends, then over i <= l.
    suffix = np.minimum.accumulate(dense[:, ::-1], axis=1)[:, ::-1]
    covering = np.where(np.triu(np.ones_like(dense, dtype=bool)), suffix, np.inf)
    bottleneck_cap = float(covering.min(axis=0).max())
    free_sum, _, _ = relax.path(relax.table.min(axis=1))
    bottleneck = num_microbatches * bottleneck_cap
    device_free = free_sum + (num_microbatches - 1) * bottleneck_cap
    proven[0] = max(bottleneck, device_free)

    # Every relaxed plan's slowest stage is one of these (all buckets: memory can
    # force a config that is not the cheapest).
    caps = np.unique(relax.table[np.isfinite(relax.table)])
    if not relax.feasible(float(caps[-1])):
        return details(math.inf, bottleneck, device_free, math.inf)
    low, high = int(np.searchsorted(caps, bottleneck_cap)), len(caps) - 1
    while low < high:  # the smallest feasible cap (feasibility is monotone)
        report(f"smallest feasible cap, {high - low} candidates left")
        middle = (low + high) // 2
        if relax.feasible(float(caps[middle])):
            high = middle
        else:
            low = middle + 1
    first, last = low, len(caps) - 1

    step = max(free_sum, _EPS) / problem.num_devices
    lams: dict[int, float] = {}

    def evaluate(index: int) -> float:
        """``T``-bound for plans whose slowest stage is exactly ``caps[index]``."""
        nearest = min(lams, key=lambda known: abs(known - index), default=None)
        lam = 0.0 if nearest is None else lams[nearest]
        values[index], lams[index] = relax.max_dual(float(caps[index]), lam, step, rtol)
        cap = float(caps[index])
        report(f"cap {len(values)} of at most {max_caps}")
        return max(num_microbatches * cap, (num_microbatches - 1) * cap + values[index])

    def interval(low: int, high: int) -> tuple[float, int, int]:
        """Bound for plans whose slowest stage is in ``(caps[low], caps[high]]``."""
        slowest = float(caps[low + 1])
        floor = (num_microbatches - 1) * slowest + values[high]
        return max(num_microbatches * slowest, floor), low, high

    point = evaluate(first)  # plans whose slowest stage is caps[first]
    ceiling = point  # no refinement of these caps can beat it
    heap = []
    if last > first:
        ceiling = min(ceiling, evaluate(last))
        heap.append(interval(first, last))
    while heap and heap[0][0] < point and len(values) < max_caps:
        weakest, low, high = heap[0]
        proven[0] = max(min(point, weakest), bottleneck, device_free)
        if high - low < 2 or weakest >= (1.0 - rtol) * ceiling:
            break
        heapq.heappop(heap)
        middle = (low + high) // 2
        ceiling = min(ceiling, evaluate(middle))
        heapq.heappush(heap, interval(low, middle))
        heapq.heappush(heap, interval(middle, high))
    bound = min(point, heap[0][0]) if heap else point
    return details(
        max(bound, bottleneck, device_free),
        bottleneck,
        device_free,
        float(caps[first]),
    )


def lower_bound(
    problem: Problem, *, progress_fn: Callable[[str], None] | None = None
) -> float:
    """A certified lower bound (s) on the optimal ``T`` of ``problem``.

    ``lower_bound(problem) <= sum_s t_s + (B - 1) * max_s t_s`` for every
    feasible plan; ``inf`` only when the relaxation proves that no plan exists.
    See the module docstring for the proof and :func:`bound_details` for parts.

    Args:
        problem: the instance; any time unit.
        progress_fn: receives progress lines (see :func:`bound_details`).

    Returns:
        The bound, in the unit of ``problem.compute_cost``.
    """
    return bound_details(problem, progress_fn=progress_fn).bound
