"""A certified lower bound for hardware-aware stage construction.

:func:`hetero_lower_bound` is ``<=`` the all-in-flight objective
``T = sum t + sum c + (B - 1) * max(max t, max c)``
(:func:`~pipedejavu.core.hetero_rules.hetero_bound`) of **every** plan that
:func:`pipedejavu.core.hetero_rules.check_hetero_plan` accepts (any explicit placement,
mixed-type stages included), hence ``<=`` its optimum and ``<=`` the 1F1B
objective (:func:`~pipedejavu.core.hetero_rules.hetero_objective`) of every
plan. Proof, for a plan with
stages ``s = 0..S-1``, stage ``s`` on layers ``i_s..j_s``, submesh ``m_s`` of
``n_s`` devices, priced type ``tau_s`` (the slowest type of its hosts):

1. **Speed levels.** Every device of stage ``s`` is at least as fast as
   ``tau_s``. So for each speed ``v`` the stages priced at speed ``>= v`` use
   only devices of speed ``>= v``: ``sum_{s: speed(tau_s) >= v} n_s <= D_{>=v}``;
   and ``sum_s n_s = D`` (every device used once). Let ``x_v`` be the devices of
   the stages priced at speed exactly ``v``; the vector ``x`` obeys these
   nested constraints. (Canonical plans use each type's devices exactly; they
   satisfy them too.)
2. **Stage costs.** ``t_s = cost[i_s, j_s, m_s, k_s, tau_s] >= a(i_s, j_s, m_s,
   v)``, the least entry over the configs and the types of speed ``v =
   speed(tau_s)`` admissible under memory (below).
3. **Memory.** ``S - 1 - s <= max_n_succ[..., tau_s]`` and ``S - 1 - s >=
   f(j_s + 1)``, the fewest spans with a finite entry covering layers
   ``j_s + 1..L-1``; entries with ``max_n_succ < f(j + 1)`` are dropped.
4. **Transfers.** ``c_s = 2 link.time(bytes[j_s])`` on some link of the
   cluster, so ``c_s >= l(j_s)``, the least such time over all links (intra-host
   links of the types present, inter-host links of host pairs present).
   Moreover, if the cluster has ``H >= 2`` hosts and ``S >= 2``, some boundary is
   inter-host: a multi-host stage uses every device of its hosts, so it shares
   no host with a neighbour; if all stages are single-host and every neighbour
   pair shared a host, all would sit on one host, leaving the others unused.
   So ``sum_s c_s >= sum_s l(j_s) + delta`` with ``delta`` the least
   ``(inter-host time - l)`` over boundaries (clipped at 0), and
   ``max_s c_s >= gamma``, the least inter-host time over boundaries.
5. **The max term, by caps** (as :mod:`pipedejavu.search.alpa.exact`). Let ``r`` be
   the largest of the plan's ``a`` and ``l`` values: ``max(max t, max c) >= r``. Let
   ``Q(cap)`` be the least ``sum a + sum l`` over the *relaxed plans*
   (contiguous spans, levels and submeshes with the constraints of 1 and 3,
   every ``a`` and ``l`` ``<= cap``): a DP over layers with the vector ``x`` as
   state (:func:`_relaxed_dp`), exact for the relaxation. ``Q`` is
   non-increasing, so a plan with ``r`` in ``(cap_a, cap_b]`` (consecutive
   candidate caps ``cap_a < cap_a' <= cap_b``) and ``S >= 2`` stages has
   ``T >= Q(cap_b) + delta + (B - 1) g`` and ``T >= B g`` with
   ``g = max(cap_a', gamma)``; below the least feasible cap no plan exists,
   and a plan with ``r`` above ``incumbent / B`` costs ``>= B r``. A best-first
   bisection (halving the cap values) refines the weakest interval. A
   one-stage plan costs exactly ``B t_0 >= B min a(0, L-1, .)``; the bound is
   the least of the two cases.

6. **Large grids: a Lagrangian dual.** When the ``x`` grid has more than
   ``max_cells`` cells, ``Q(cap)`` is replaced by a lower bound on it
   (:func:`_dual_bound`): the nested constraints ``X_w = sum_{v <= w} x_v <=
   C_w`` (``w < V - 1``) are priced by ``lam_w >= 0``; for every relaxed plan
   that meets them, ``sum a + sum l >= sum a + sum l + sum_w lam_w (X_w -
   C_w)``, and the right side is ``>=`` its least value over the larger set of
   plans that only use all ``D`` devices (a DP with the total device count as
   state, :func:`_priced_dp`, exact for that set). So ``phi(lam) <= Q(cap)`` for
   every ``lam >= 0`` (weak duality), whatever ``lam`` the cutting planes
   reach; and the least feasible cap of that larger set is ``<=`` the
   relaxation's. Step 5's interval arguments only need lower bounds on ``Q``.
7. **Whole-host stages (large grids).** A submesh ``(h, d)`` with ``h > 1``
   has ``d`` devices per host equal to the host's, and ``(1, d)`` with ``d``
   the host's size is a whole host: a stage of ``n >= devices per host``
   devices holds every device of its hosts, so its neighbours share no host
   with it and both its boundaries are inter-host: ``c >= i(j)``, the least
   inter-host round trip at that boundary (``inf`` with one host, where such a
   stage is alone). The DP of rule 6 charges ``i(j)`` there and ``l(j)``
   elsewhere (its state also says whether the last stage is whole-host), and
   the candidate caps include the ``i`` values (``r`` is the largest charged
   term). It drops the surcharge ``delta`` of rule 4 (an all-partial plan
   may have its single inter-host hop anywhere).

8. **The block relaxation.** On device grids up to ``max_relaxed_cells``
   cells, the result is also at least the bound of
   :mod:`pipedejavu.search.hetero.rbound`: the relaxation R of the exact
   oracle (every valid plan at its exact cost, only the packing of partial
   stages onto hosts forgotten) under the cap branch and bound. It equals the
   optimum whenever R's optimal plan packs, which is usual. Without a time
   limit it is computed first, and the refinement of rule 5 stops once the
   best point bound (which its result never exceeds) is at most this one
   (plus ``gap_rtol`` times its distance to the incumbent: what is left could
   narrow the distance from the incumbent by no more than that share of it,
   as in R's own refinement,
   :func:`~pipedejavu.search.hetero.rbound.relaxed_bound`): fewer DP passes.
   With a limit it gets the time the anytime refinement leaves.

The result is also at least :func:`pipedejavu.search.engine.bounds.lower_bound` of the
homogeneous relaxation (costs the least over types, memory the largest over
types, links dropped; valid by 2-4 with ``D`` devices in all).

9. **Anytime.** The least feasible cap ``r_0`` (step 5's ``np.maximum`` DP) is
   computed first, before the time limit is looked at: every plan of several
   stages with ``r <= incumbent / B`` costs ``>= B r_0`` (one with a larger
   ``r``, ``>= B r_+``, ``r_+`` the least candidate value above ``incumbent /
   B``), so the *cheap bound* ``max(min(B r_0, B r_+, one-stage cost),
   homogeneous bound)`` holds at once.
   Every later result is ``max``-ed with it: a bound cut short by the time
   limit is never below the cheap one (after one solved cap, plans with a
   larger ``r`` cost ``>= B`` times the next cap). Floating point: the result
   is lowered by a relative ``16 (L + 4) eps``.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.problem import Problem, ProblemError
from pipedejavu.search.engine.bounds import fewest_stages, lower_bound
from pipedejavu.search.hetero.assign import links
from pipedejavu.search.hetero.rbound import relaxed_bound

__all__ = ["hetero_lower_bound"]

_EPS = float(np.finfo(np.float64).eps)


class _Levels:
    """The relaxation's data: entries by speed level, the ``x`` grid, links.

    Attributes:
        table: f64[L, L, M, V] least admissible entry per span, submesh, level.
        capacity: i64[V] devices of speed ``>=`` each level (fastest first).
        exact: whether the ``x`` grid (``cells`` cells) is small enough for
            the exact DP; otherwise rules 6-7 apply and no grid is built.
        grid: the flat grid of ``x`` (devices per level), its valid cells
            (nested constraints hold), the accepting cells (all devices used),
            and per (m, v) the source and target cells of placing submesh m.
        low: f64[L + 1] ``l`` at the boundary before layer i (0 at i = 0).
        inter: f64[L + 1] ``i`` of rule 7 at the boundary before layer i (0 at
            i = 0, inf with one host); whole: devices per host.
        delta: the inter-host surcharge of rule 4.
        gamma: the least inter-host round trip at any boundary (rule 4: a plan
            of several stages has one, so its bottleneck is at least this).
    """

    def __init__(self, problem: HeteroProblem, max_cells: int):
        cluster = problem.cluster
        counts = np.asarray(cluster.devices_of_type())
        present = counts > 0
        speeds = np.asarray(cluster.speeds)
        levels = np.unique(speeds[present])[::-1]  # fastest first
        level_of = {
            t: int(np.flatnonzero(levels == speeds[t])[0])
            for t in np.flatnonzero(present).tolist()
        }
        # Devices of speed >= each level (the nested capacities).
        per_level = np.asarray([counts[speeds == v].sum() for v in levels])
        capacity = np.cumsum(per_level)
        num_layers = problem.num_layers
        spans = np.isfinite(problem.compute_cost).any(axis=(2, 3, 4))
        followers = fewest_stages(spans)[1:]  # [L] by end layer
        admissible = problem.max_n_succ_stages >= followers[None, :, None, None, None]
        cost = np.where(admissible, problem.compute_cost, np.inf).min(axis=3)
        table = np.full(
            (num_layers, num_layers, problem.num_submeshes, len(levels)), np.inf
        )
        for t, v in level_of.items():
            table[..., v] = np.minimum(table[..., v], cost[..., t])
        sizes = problem.submesh_sizes
        # A stage priced at level v holds at most the devices of speed >= v.
        too_big = sizes[:, None] > capacity[None, :]  # [M, V]
        table[:, :, too_big] = np.inf
        self.table = table
        self.sizes = sizes
        self.capacity = capacity
        dims = tuple(int(c) + 1 for c in capacity)
        # Too many cells: the Lagrangian DP over total devices (grid not built).
        self.cells = int(np.prod(dims))
        self.exact = self.cells <= max_cells
        if self.exact:
            self._build_grid(dims)
        # Transfers: least time over every link present, and the inter-host one.
        intra_latency, intra_bandwidth, inter_latency, inter_bandwidth = links(problem)
        sent = problem.boundary_bytes  # [L - 1]
        hosts = np.asarray([len(cluster.hosts_of_type(t)) for t in range(len(counts))])
        intra = [
            2.0 * (intra_latency[t] + sent / intra_bandwidth[t])
            for t in np.flatnonzero(hosts > 0)
        ]
        inter = [
            2.0 * (inter_latency[a, b] + sent / inter_bandwidth[a, b])
            for a in range(len(hosts))
            for b in range(len(hosts))
            if hosts[a] > 0 and hosts[b] > (a == b)
        ]
        least = np.min(intra + inter, axis=0) if num_layers > 1 else np.zeros(0)
        self.low = np.concatenate([[0.0], least, [0.0]])
        self.delta = self.gamma = 0.0
        # Next to a whole-host stage a boundary is inter-host (rule 7).
        self.whole = cluster.devices_per_host
        self.inter = np.full(num_layers + 1, np.inf)
        self.inter[0] = 0.0
        if cluster.num_hosts >= 2 and num_layers > 1:
            self.inter[1:num_layers] = np.min(inter, axis=0)
            surcharge = np.min(inter, axis=0) - least
            self.delta = max(float(surcharge.min()), 0.0)
            self.gamma = float(np.min(inter))
        # One stage holds all D devices, so it is priced at a level holding D.
        whole = table[0, num_layers - 1][
            np.ix_(sizes == capacity[-1], capacity >= capacity[-1])
        ]
        self.one_stage = float(whole.min(initial=np.inf))

    def _build_grid(self, dims: tuple[int, ...]) -> None:
        """The valid cells of the ``x`` grid and the moves of every (m, v)."""
        capacity, sizes = self.capacity, self.sizes
        # The x grid, valid cells only (x only grows, so invalid cells never
        # lead to an accepting one).
        grid = np.stack(np.unravel_index(np.arange(int(np.prod(dims))), dims), axis=1)
        used = grid[(np.cumsum(grid, axis=1) <= capacity[None, :]).all(axis=1)]
        strides = np.asarray([int(np.prod(dims[v + 1 :])) for v in range(len(dims))])
        flat = used @ strides
        self.accept = used.sum(axis=1) == capacity[-1]
        self.moves = {}
        for m, size in enumerate(sizes.tolist()):
            for v in range(len(capacity)):
                moved = used.copy()
                moved[:, v] += size
                ok = (np.cumsum(moved, axis=1) <= capacity[None, :]).all(axis=1)
                source = np.flatnonzero(ok)
                target = np.searchsorted(flat, moved[ok] @ strides)
                self.moves[m, v] = (source, target)
        self.cells = len(used)


def _relaxed_dp(levels: _Levels, cap: float, combine: np.ufunc) -> float:
    """``Q(cap)`` (``np.add``) or the least feasible cap (``np.maximum``)."""
    table = np.where(levels.table <= cap, levels.table, np.inf)
    low = np.where(levels.low <= cap, levels.low, np.inf)
    num_layers, _, num_submeshes, num_levels = table.shape
    value = np.full((num_layers + 1, levels.cells), np.inf)
    value[0, 0] = 0.0
    live = np.isfinite(table).any(axis=(2, 3))  # [start, end]
    moves = [(m * num_levels + v, *move) for (m, v), move in levels.moves.items()]
    for stop in range(1, num_layers + 1):
        starts = np.flatnonzero(live[:stop, stop - 1] & np.isfinite(low[:stop]))
        if starts.size == 0:
            continue
        entering = combine(value[starts], low[starts][:, None])  # [n, cells]
        stage = table[starts, stop - 1].reshape(starts.size, -1)  # [n, M * V]
        row = value[stop]
        for column, source, target in moves:
            finite = np.flatnonzero(np.isfinite(stage[:, column]))
            if finite.size == 0 or source.size == 0:
                continue
            # Each (submesh, level) is finite on its own starts only.
            if finite.size == starts.size:
                best = combine(entering, stage[:, column, None]).min(axis=0)
            else:
                best = combine(entering[finite], stage[finite, column, None]).min(
                    axis=0
                )
            row[target] = np.minimum(row[target], best[source])
    return float(value[num_layers][levels.accept].min(initial=np.inf))


def _capped_spans(levels: _Levels, cap: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per end layer, the starts of the spans with an entry ``<= cap`` and
    their entries (others inf), f64[n, M, V]; the last cap's are cached."""
    cached = getattr(levels, "_spans", None)
    if cached is not None and cached[0] == cap:
        return cached[1]
    capped = np.where(levels.table <= cap, levels.table, np.inf)
    live = np.isfinite(capped).any(axis=(2, 3))  # [start, end]
    spans = []
    for stop in range(1, capped.shape[0] + 1):
        starts = np.flatnonzero(live[:stop, stop - 1])
        spans.append((starts, capped[starts, stop - 1]))
    levels._spans = (cap, spans)
    return spans


def _priced_dp(
    levels: _Levels, cap: float, prices: np.ndarray, combine: np.ufunc = np.add
) -> tuple[float, np.ndarray]:
    """The relaxation of rule 6 (nested constraints dropped, all ``D`` devices
    used exactly), a stage at level ``v`` paying ``size * prices[v]``, the
    boundaries next to whole-host stages at the inter-host time (rule 7): a DP
    over layers with the total device count and "the last stage is whole-host"
    as state.

    Returns:
        The least ``sum (a + size * price) + sum l'`` (``np.add``; with
        ``np.maximum`` the least largest ``a`` or ``l'``, prices ignored) and
        i64[V] the devices per level of a best plan (zeros when none).
    """
    spans = _capped_spans(levels, cap)
    low = np.where(levels.low <= cap, levels.low, np.inf)
    inter = np.where(levels.inter <= cap, levels.inter, np.inf)
    charge = levels.sizes[:, None] * prices[None, :] if combine is np.add else 0.0
    num_layers, _, num_submeshes, _ = levels.table.shape
    total = int(levels.capacity[-1])
    num_levels = len(levels.capacity)
    value = np.full((num_layers + 1, 2, total + 1), np.inf)  # [stop, whole, D + 1]
    value[0, 0, 0] = 0.0
    counts = np.zeros((num_layers + 1, 2, total + 1, num_levels), np.int64)
    sizes = levels.sizes.tolist()
    kind = (levels.sizes >= levels.whole).astype(np.int64)  # [M] whole-host
    fitting = [m for m in range(num_submeshes) if sizes[m] <= total]
    for stop in range(1, num_layers + 1):
        starts, rows = spans[stop - 1]  # [n], f64[n, M, V]
        if starts.size == 0:
            continue
        priced = rows + charge
        stage_level = priced.argmin(axis=2)  # [n, M]
        after_part = value[starts, 0]  # [n, D + 1], last stage not whole-host
        after_whole = combine(value[starts, 1], inter[starts][:, None])
        # Entering a partial (0) or whole-host (1) stage: value, and whether
        # the best way in comes after a whole-host stage.
        ways = [combine(after_part, hop[starts][:, None]) for hop in (low, inter)]
        enter = np.stack([np.minimum(way, after_whole) for way in ways])
        came = np.stack([way > after_whole for way in ways]).astype(np.int64)
        columns = priced.min(axis=2).T  # [M, n]
        trial = combine(enter[kind], columns[:, :, None])  # [M, n, D + 1]
        pick = trial.argmin(axis=1)  # [M, D + 1]
        best = np.take_along_axis(trial, pick[:, None, :], axis=1)[:, 0]
        for m in fitting:
            size, whole = sizes[m], int(kind[m])
            better = np.flatnonzero(
                best[m, : total + 1 - size] < value[stop, whole, size:]
            )
            if better.size == 0:
                continue
            chosen = pick[m, better]
            value[stop, whole, size + better] = best[m, better]
            added = np.zeros((better.size, num_levels), np.int64)
            added[np.arange(better.size), stage_level[chosen, m]] = size
            counts[stop, whole, size + better] = (
                counts[starts[chosen], came[whole, chosen, better], better] + added
            )
    last = int(np.argmin(value[num_layers, :, total]))
    return float(value[num_layers, last, total]), counts[num_layers, last, total]


def _dual_bound(
    levels: _Levels,
    cap: float,
    start: np.ndarray,
    *,
    enough: float,
    deadline: float,
    iterations: int = 12,
    rtol: float = 1e-4,
) -> tuple[float, np.ndarray]:
    """A lower bound on ``Q(cap)`` by Lagrangian relaxation of the nested
    constraints; the best prices found.

    With multipliers ``lam_w >= 0`` on ``sum_{v <= w} x_v <= C_w`` (``w < V -
    1``; ``C_w`` the devices of speed ``>=`` level ``w``), every relaxed plan
    satisfying them costs ``>= sum (a + l) + sum_w lam_w (X_w - C_w)`` with
    ``X_w = sum_{v <= w} x_v``; this is ``sum (a + size * p_v) + l - lam . C``
    with ``p_v = sum_{w >= v} lam_w``, whose least value over plans using all
    ``D`` devices (nested constraints dropped) is :func:`_priced_dp`: weak
    duality gives ``phi(lam) <= Q(cap)`` for every ``lam >= 0``. ``phi`` is
    concave with supergradient ``X_w - C_w`` at the DP's plan: maximised by
    Kelley's cutting planes in a box (any ``lam`` found stays valid).

    Args:
        start: f64[V - 1] first multipliers (warm start).
        enough: stop once ``phi`` reaches it.
        deadline: ``time.perf_counter()`` past which no DP starts.
    """
    from scipy.optimize import linprog

    capacity = levels.capacity[:-1].astype(np.float64)
    lam = np.clip(np.asarray(start, np.float64), 0.0, None)
    best, best_lam = -math.inf, lam
    cuts: list[tuple[float, np.ndarray, np.ndarray]] = []
    box = None
    for _ in range(iterations if capacity.size else 1):
        prices = np.concatenate([np.cumsum(lam[::-1])[::-1], [0.0]])
        value, counts = _priced_dp(levels, cap, prices)
        if not math.isfinite(value):
            return math.inf, lam  # no relaxed plan at all: Q(cap) = inf
        slack = np.cumsum(counts)[:-1] - capacity
        phi = value - float(lam @ capacity)
        if phi > best:
            best, best_lam = phi, lam
        # A plan meeting the constraints with complementary slackness: exact.
        if best >= enough or ((slack <= 0).all() and float(lam @ slack) == 0.0):
            break
        if time.perf_counter() > deadline:
            break
        cuts.append((phi, slack.astype(np.float64), lam))
        if box is None:  # a price above the plan's whole cost is never needed
            box = max(abs(value), cap, 1e-30)
        # Kelley: max z s.t. z <= phi_k + g_k (lam - lam_k), 0 <= lam <= box.
        a_ub = np.array([np.concatenate([-g, [1.0]]) for _, g, _ in cuts])
        b_ub = np.array([p - g @ point for p, g, point in cuts])
        result = linprog(
            np.concatenate([np.zeros(capacity.size), [-1.0]]),
            A_ub=a_ub,
            b_ub=b_ub,
            bounds=[(0.0, box)] * capacity.size + [(None, None)],
        )
        if not result.success:
            break
        if -result.fun - best <= rtol * max(abs(best), 1e-30):
            break
        lam = np.asarray(result.x[:-1])
    return best, best_lam


def _homogeneous_bound(problem: HeteroProblem) -> float:
    """:func:`pipedejavu.search.engine.bounds.lower_bound` of the homogeneous
    relaxation."""

    try:
        relaxed = Problem(
            compute_cost=problem.compute_cost.min(axis=4),
            max_n_succ_stages=problem.max_n_succ_stages.max(axis=4),
            submesh_shapes=problem.submesh_shapes,
            cluster_shape=problem.cluster.shape,
            num_microbatches=problem.num_microbatches,
        )
    except ProblemError:  # no device combination fits: no plan at all
        return math.inf
    return lower_bound(relaxed)


def hetero_lower_bound(
    problem: HeteroProblem,
    *,
    incumbent_cost: float | None = None,
    time_limit_s: float | None = 30.0,
    max_caps: int = 40,
    rtol: float = 1e-3,
    max_cells: int = 20_000,
    max_relaxed_cells: int = 20_000,
    plan_fn=None,
    gap_rtol: float = 0.05,
) -> float:
    """A certified lower bound (s) on every plan's objective (module docstring).

    Args:
        problem: the instance.
        incumbent_cost: seconds of a known plan: intervals whose bound reaches it
            are not refined (the bound stays valid, it just stops improving).
        time_limit_s: refinement stops past it (0: the cheap bound of rule 9
            only); a bound cut short is still ``>=`` the cheap bound. None: no
            limit.
        max_caps: most caps at which ``Q`` is solved.
        rtol: the refinement stops when the weakest interval is within this
            relative distance of the best point bound (or the incumbent).
        max_cells: largest ``x`` grid solved exactly; past it ``Q`` is bounded
            by the Lagrangian dual of the DP over total devices
            (:func:`_dual_bound`).
        max_relaxed_cells: largest device grid ``prod_t (N_t dph + 1)`` on which
            the block relaxation's bound (rule 8) is also computed (first
            without a time limit, else in the time left).
        plan_fn: receives the valid plans rule 8 finds on the way
            (:class:`~pipedejavu.core.hetero.HeteroPlan`; the engine keeps the best).
        gap_rtol: the refinements stop once they could narrow the distance
            from ``incumbent_cost`` (or a cheaper plan found) by no more than
            this share of it (rule 8; 0: refine to the end). Without a known
            plan it does nothing.

    Returns:
        The bound in seconds; ``inf`` only when no plan can exist.
    """
    started = time.perf_counter()
    deadline = math.inf if time_limit_s is None else started + time_limit_s
    margin = 16.0 * (problem.num_layers + 4) * _EPS
    simple = _homogeneous_bound(problem)
    if not math.isfinite(simple):
        return simple
    levels = _Levels(problem, max_cells)
    batches = problem.num_microbatches
    one_stage = batches * levels.one_stage
    ceiling = math.inf if incumbent_cost is None else float(incumbent_cost)

    # Without a time limit the block relaxation (rule 8), usually the tighter,
    # comes first: the refinement below stops once it cannot beat it. With a
    # limit it comes last, in the time the anytime refinement leaves.
    def block_bound() -> float:
        return _block_bound(
            problem, ceiling, deadline, max_relaxed_cells, plan_fn, gap_rtol
        )

    block = block_bound() if time_limit_s is None else None
    # Plans whose largest relaxed term r exceeds ceiling / B cost > ceiling:
    # the DP only needs the entries up to there (sparser, hence faster).
    reach = ceiling / batches
    if levels.exact:
        smallest = _relaxed_dp(levels, reach, np.maximum)
    else:  # nested constraints dropped: a smaller cap, still a lower one
        smallest = _priced_dp(levels, reach, np.zeros(0), np.maximum)[0]
    values = np.concatenate([levels.table.ravel(), levels.low, levels.inter])
    caps = np.unique(values[np.isfinite(values)])
    above = caps[caps > reach]
    tail = batches * float(above[0]) if above.size else math.inf
    if not math.isfinite(smallest):  # every plan has r > reach (or none exists)
        bound = max(min(tail, one_stage), simple)
        block = block_bound() if block is None else block
        return max(bound, block) * (1.0 - margin)
    caps = caps[(caps >= smallest) & (caps <= reach)]
    # The cheap bound, before any cap is solved: every plan of several stages
    # has r >= smallest (or r > reach); one stage costs one_stage.
    cheap = max(min(batches * float(caps[0]), tail, one_stage), simple)
    sums: dict[int, float] = {}
    best_point = [math.inf]
    prices = [np.zeros(len(levels.capacity) - 1)]  # warm start of the duals
    floor = max(float(caps[0]), levels.gamma) if caps.size else 0.0
    # Rule 7 charges the inter-host hops itself: no surcharge on top of it.
    delta = levels.delta if levels.exact else 0.0
    enough = ceiling - delta - (batches - 1) * floor

    def solve(index: int) -> None:
        if levels.exact:
            sums[index] = _relaxed_dp(levels, float(caps[index]), np.add)
        else:
            sums[index], prices[0] = _dual_bound(
                levels, float(caps[index]), prices[0], enough=enough, deadline=deadline
            )
        cap = max(float(caps[index]), levels.gamma)
        point = max(sums[index] + delta + (batches - 1) * cap, batches * cap)
        best_point[0] = min(best_point[0], point)

    def interval(low: int, high: int) -> tuple[float, int, int]:
        floor = max(float(caps[low + 1]), levels.gamma)
        value = sums[high] + delta + (batches - 1) * floor
        return max(value, batches * floor), low, high

    first, last = 0, len(caps) - 1
    if time.perf_counter() > deadline:
        return cheap * (1.0 - margin)
    solve(first)
    lowest = best_point[0]  # plans whose r is caps[first] exactly
    heap = []
    if last > first:
        if time.perf_counter() > deadline:  # r above caps[first]: B r at least
            above_first = batches * max(float(caps[first + 1]), levels.gamma)
            relaxed = min(lowest, above_first, tail)
            return max(min(relaxed, one_stage), cheap) * (1.0 - margin)
        solve(last)
        heap.append(interval(first, last))
    while heap and len(sums) < max_caps and time.perf_counter() < deadline:
        weakest, low, high = heap[0]
        if high - low < 2 or weakest >= (1.0 - rtol) * min(best_point[0], ceiling):
            break
        # the result is at most the best point bound: past the block bound,
        # refining gains nothing
        if block is not None and min(best_point[0], ceiling) <= block + gap_rtol * (
            max(ceiling - block, 0.0) if math.isfinite(ceiling) else 0.0
        ):
            break
        heapq.heappop(heap)
        # Bisect the cap values (an interval's slack is (B - 1) times its width).
        halfway = 0.5 * (caps[low] + caps[high])
        middle = int(np.clip(np.searchsorted(caps, halfway), low + 1, high - 1))
        solve(middle)
        for part in (interval(low, middle), interval(middle, high)):
            heapq.heappush(heap, part)
    relaxed = min([lowest, tail] + [bound for bound, _, _ in heap])
    bound = max(min(relaxed, one_stage), cheap)
    block = block_bound() if block is None else block
    return max(bound, block) * (1.0 - margin)


def _block_bound(problem, ceiling, deadline, max_cells, plan_fn, gap_rtol) -> float:
    """Rule 8, when the device grid is small enough and time is left."""
    cells = 1
    for count in problem.cluster.devices_of_type():
        cells *= count + 1
    if cells > max_cells or time.perf_counter() > deadline:
        return -math.inf

    return relaxed_bound(
        problem,
        incumbent=ceiling,
        deadline=deadline,
        plan_fn=plan_fn,
        gap_rtol=gap_rtol,
    )
