"""The differentiable engine on typed devices with costly links (method "diff").

The homogeneous engine's discipline (:mod:`pipedejavu.search.engine.driver`), extended:

1. Fit the linear latency model (:mod:`pipedejavu.costmodel.stage.linear`) per device
   type, giving one ``(submesh, config, type)`` slot per fitted table column,
   plus a slot per config of every whole-host submesh over hosts of several
   types (its slowest type's model, its devices shared by type).
2. Optimize the relaxed objective of :mod:`pipedejavu.search.hetero.relax` (soft
   boundaries, a softmax over slots per stage, per-type device budgets as an
   annealed penalty, soft transfers on the soft boundaries, smooth max over
   stages and transfers) with optax Adam for ``num_restarts`` initializations at
   once: ``jax.vmap`` inside one jitted ``lax.scan``, compiled ahead of time and
   cached, the restarts sharded over the JAX devices when there are several.
3. Round the ``num_polished`` best distinct restarts' soft ends to boundaries
   and repair them exactly: :func:`pipedejavu.search.hetero.assign.assign`
   picks every stage's submesh, config, type and hosts over every valid plan
   (the exact oracle on exactly those spans).
4. Polish on the objective (:mod:`pipedejavu.search.hetero.polish`): the local
   search's moves that need no oracle call (boundary shifts, the best
   boundaries for the stages' places, swaps, reorders, splits and merges of
   places) from every repaired restart. Every step searches the oracle's
   space: any placement, stages over hosts of several types.
5. Certify: :func:`pipedejavu.search.hetero.bounds.hetero_lower_bound` (valid
   over every valid plan); ``plan.info`` carries the bound and the gap
   ``cost / bound - 1``. On device grids small enough for its block relaxation
   (rule 8), the relaxation's optimal plans under each cap that pack onto the
   hosts are valid plans too; the best of them replaces the polished plan when
   cheaper (``info["from_bound"]``). It is optimal for the all-in-flight
   objective that the bound bounds, not for the 1F1B objective: while the gap
   is open it goes through the moves of step 4 as one more start.
6. While the certified gap is open, from the ``num_exact_polished`` best
   distinct local optima: every local move (those that call the oracle too:
   exact places for the boundaries, merges, splits), then
   :func:`pipedejavu.search.hetero.exact.hetero_exact` restricted to spans near
   the boundaries and midpoints, from its cost
   (:func:`pipedejavu.search.hetero.polish.exact_polish`).

Every sub-solver is exact for the all-in-flight objective and prices what it
finds on the 1F1B one, so under the 1F1B objective the local moves do the work
the exact steps did alone before (the gap rarely closes: the bound is on the
all-in-flight objective). Without ``time_budget_s`` nothing is cut short.

The plan's cost is always :func:`pipedejavu.core.hetero_rules.evaluate_hetero` of it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import make_hetero_plan
from pipedejavu.core.problem import InfeasibleProblemError, Problem, ProblemError
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.engine.restarts import (
    compiled_chunk,
    geometric,
    random_starts,
    shard,
)
from pipedejavu.search.hetero.assign import assign, links, split
from pipedejavu.search.hetero.bounds import hetero_lower_bound
from pipedejavu.search.hetero.exact import explain_infeasible
from pipedejavu.search.hetero.polish import boundaries_of, exact_polish, local_search
from pipedejavu.search.hetero.relax import (
    HeteroRelaxedParams,
    HeteroRelaxedProblem,
    Temperatures,
    hetero_relaxed_loss,
)
from pipedejavu.search.hetero.units import build

__all__ = ["HeteroSearchConfig", "hetero_search"]

#: Share of the budget left after the optimization that the polish leaves to
#: the bound (and the windowed exact polish after it).
_BOUND_SHARE = 0.4
#: Least time (s) the bound gets when the polish used up the budget.
_BOUND_FLOOR_S = 0.5


@dataclasses.dataclass(frozen=True)
class HeteroSearchConfig(SearchConfig):
    """:class:`pipedejavu.search.engine.driver.SearchConfig`, retuned, plus the polish's
    settings.

    Attributes:
        penalty: (start, end) weight of the per-type device-budget penalty
            (stronger than the homogeneous engine's: more devices always lower
            the relaxed latencies, and the rounding needs budgets that hold).
        max_stages: stage slots of the relaxation (None: min(L, D, 16)).
        num_polished: distinct rounded restarts taken through the local search
            (its moves that need no oracle call).
        num_exact_polished: best local optima then taken through every local
            move and the windowed exact DP while the gap is open (0: none).
        exact_time_limit_s: wall-clock limit of one windowed exact DP call.
    """

    penalty: tuple[float, float] = (100.0, 1e5)
    num_polished: int = 8
    num_exact_polished: int = 1
    exact_time_limit_s: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_exact_polished, int) or self.num_exact_polished < 0:
            raise ValueError(
                "num_exact_polished must be an integer >= 0, got "
                f"{self.num_exact_polished!r}"
            )
        if not self.exact_time_limit_s > 0:
            raise ValueError(
                f"exact_time_limit_s must be > 0, got {self.exact_time_limit_s}"
            )


def _prepare(problem: HeteroProblem) -> tuple[HeteroRelaxedProblem | None, int]:
    """Fit the linear model per type; the relaxed data (None when no slot could
    be fitted) and the number of usable slots."""
    from pipedejavu.costmodel.stage.linear import fit_linear_model

    counts = np.asarray(problem.cluster.devices_of_type())
    slots, per_layer, intercept = [], [], []  # slot: (m, k, type share f[T])
    models = {}
    for t in range(problem.num_types):
        try:
            view = Problem(
                compute_cost=problem.compute_cost[..., t],
                max_n_succ_stages=None,
                submesh_shapes=problem.submesh_shapes,
                cluster_shape=problem.cluster.shape,
                num_microbatches=problem.num_microbatches,
            )
        except ProblemError:  # no device combination fits: nothing to relax
            return None, 0
        model = models[t] = fit_linear_model(view)
        usable = np.asarray(model.usable) & (
            problem.submesh_sizes[:, None] <= counts[t]
        )
        for m, k in np.argwhere(usable).tolist():
            slots.append((m, k, np.eye(problem.num_types)[t]))
            per_layer.append(np.asarray(model.per_layer[:, m, k], np.float64))
            intercept.append(float(model.intercept[m, k]))
    # Whole-host stages over several types: the slowest type's model, devices
    # shared by the composition.

    for unit in build(problem).wholes:
        if len(unit.present) < 2:
            continue
        model = models[unit.price[0]]
        share = np.asarray(unit.composition, np.float64) / sum(unit.composition)
        for k in np.flatnonzero(np.asarray(model.usable)[unit.m]).tolist():
            slots.append((unit.m, k, share))
            per_layer.append(np.asarray(model.per_layer[:, unit.m, k], np.float64))
            intercept.append(float(model.intercept[unit.m, k]))
    if not slots:
        return None, 0
    finite = problem.compute_cost[np.isfinite(problem.compute_cost)]
    scale = float(np.median(finite)) if finite.size else 1.0
    scale = scale if scale > 0 else 1.0
    # Pad to a power of two with slots too slow to pick: fewer compilations.
    padded = max(4, 1 << (len(slots) - 1).bit_length())
    num_layers, num_types = problem.num_layers, problem.num_types
    table = np.zeros((num_layers, padded))
    table[:, : len(slots)] = np.stack(per_layer, axis=1) / scale
    offsets = np.full(padded, 1e3)
    offsets[: len(slots)] = np.asarray(intercept) / scale
    devices = np.ones(padded)
    types = np.zeros((padded, num_types))
    for index, (m, _, share) in enumerate(slots):
        devices[index] = problem.submesh_sizes[m]
        types[index] = share

    intra_latency, intra_bandwidth, inter_latency, inter_bandwidth = links(problem)
    sent = np.zeros(max(num_layers - 1, 1))
    sent[: num_layers - 1] = problem.boundary_bytes
    intra = 2.0 * (intra_latency + sent[:, None] / intra_bandwidth) / scale
    inter = 2.0 * (inter_latency + sent[:, None, None] / inter_bandwidth) / scale
    if num_layers == 1:  # no boundary: keep the shapes, weigh nothing
        intra, inter = np.zeros_like(intra), np.zeros_like(inter)
    as32 = partial(jnp.asarray, dtype=jnp.float32)
    data = HeteroRelaxedProblem(
        per_layer=as32(table),
        intercept=as32(offsets),
        slot_devices=as32(devices),
        slot_types=as32(types),
        type_devices=as32(counts),
        intra_time=as32(intra[: max(num_layers - 1, 0)]),
        inter_time=as32(inter[: max(num_layers - 1, 0)]),
        devices_per_host=as32(problem.cluster.devices_per_host),
        num_microbatches=as32(problem.num_microbatches),
    )
    return data, len(slots)


def _initial_params(
    key: jax.Array,
    data: HeteroRelaxedProblem,
    num_restarts: int,
    num_stages: int,
    num_slots: int,
) -> tuple[HeteroRelaxedParams, jax.Array]:
    """Random restarts, each with its own number (1..num_stages, log-uniform) of
    active stage slots; slot logits favour submeshes of about D / (active
    stages) devices, plus noise (which also spreads the types):
    :func:`~pipedejavu.search.engine.restarts.random_starts`."""
    boundary, logits, mask = random_starts(
        key,
        data.type_devices.sum(),
        data.slot_devices,
        num_restarts,
        num_stages,
        num_slots,
        0.7,
    )
    return HeteroRelaxedParams(boundary, logits), mask


#: How often :func:`_run_chunk` has been traced (a test checks it stays put).
TRACE_COUNT = [0]


def _schedule(config: SearchConfig) -> tuple:
    """The settings the optimization reads (the static key of its compilation:
    polish and time settings do not recompile it)."""
    return (
        config.learning_rate,
        config.boundary_temperature,
        config.slot_temperature,
        config.max_temperature,
        config.penalty,
    )


def _temperatures(schedule: tuple, fraction: jax.Array) -> Temperatures:
    return Temperatures(*(geometric(pair, fraction) for pair in schedule[1:]))


@partial(jax.jit, static_argnames=("chunk", "total", "schedule"))
def _run_chunk(params, opt_state, first_step, data, mask, *, chunk, total, schedule):
    TRACE_COUNT[0] += 1  # runs at trace time only
    optimizer = optax.adam(schedule[0])
    batched_loss = jax.vmap(hetero_relaxed_loss, in_axes=(0, None, 0, None))

    def total_loss(batched, temps):
        losses = batched_loss(batched, data, mask, temps)
        return jnp.sum(losses), losses

    def step(carry, index):
        params, opt_state = carry
        temps = _temperatures(schedule, index / max(total - 1, 1))
        grads, losses = jax.grad(total_loss, has_aux=True)(params, temps)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jnp.min(losses)

    steps = first_step + jnp.arange(chunk)
    (params, opt_state), best = jax.lax.scan(step, (params, opt_state), steps)
    losses = batched_loss(params, data, mask, _temperatures(schedule, jnp.float32(1)))
    return params, opt_state, best, losses


_COMPILED: dict[Any, Any] = {}


def _rounded(logits: np.ndarray, mask: np.ndarray, num_layers: int) -> list[int]:
    """Boundaries ``0 = b_0 < ... < b_S = L`` from one restart's soft ends."""
    logits = np.where(mask, np.asarray(logits, np.float64), -1e4)
    shares = np.exp(logits - logits.max())
    ends = num_layers * np.cumsum(shares / shares.sum())
    boundaries = [0]
    for end in np.clip(np.rint(ends).astype(int), 0, num_layers).tolist():
        if end > boundaries[-1]:
            boundaries.append(end)
    if boundaries[-1] != num_layers:
        boundaries.append(num_layers)
    return boundaries


def _optimize(
    problem: HeteroProblem,
    data: HeteroRelaxedProblem,
    config: HeteroSearchConfig,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None,
) -> tuple[list[tuple[int, list[int]]], np.ndarray, np.ndarray, float]:
    """Run the restarts; up to ``num_polished`` distinct rounded boundary lists
    ``(restart, boundaries)`` best relaxed loss first, the loss curve, the final
    relaxed losses and the compile time."""
    num_stages = config.max_stages or min(problem.num_layers, problem.num_devices, 16)
    num_stages = min(num_stages, problem.num_layers)
    num_slots = 1 << (num_stages - 1).bit_length()
    params, mask = _initial_params(
        key, data, config.num_restarts, num_stages, num_slots
    )
    params, mask = shard((params, mask), config.num_restarts)
    opt_state = optax.adam(config.learning_rate).init(params)
    chunk = config.num_steps // config.num_chunks
    compiled, compile_time = compiled_chunk(
        _run_chunk,
        _COMPILED,
        (_schedule(config), config.num_steps, config.num_chunks),
        (params, opt_state, data, mask),
        chunk=chunk,
        total=config.num_steps,
        schedule=_schedule(config),
    )
    curve = []
    for index in range(config.num_chunks):
        params, opt_state, best, losses = compiled(
            params, opt_state, jnp.int32(index * chunk), data, mask
        )
        curve.append(np.asarray(best))
        if progress_fn is not None:
            progress_fn((index + 1) * chunk, config.num_steps, float(np.min(best)))
    final_losses = np.asarray(losses, dtype=np.float64)
    logits, host_mask = np.asarray(params.boundary_logits), np.asarray(mask)
    candidates, seen = [], set()
    for restart in np.argsort(final_losses, kind="stable").tolist():
        if len(candidates) >= config.num_polished:
            break
        boundaries = _rounded(logits[restart], host_mask[restart], problem.num_layers)
        if tuple(boundaries) not in seen:
            seen.add(tuple(boundaries))
            candidates.append((restart, boundaries))
    return candidates, np.concatenate(curve), final_losses, compile_time


def hetero_search(
    problem: HeteroProblem,
    config: HeteroSearchConfig | None = None,
    *,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None = None,
    time_budget_s: float | None = None,
) -> HeteroPlan:
    """The engine's plan for a heterogeneous problem (module docstring).

    Args:
        problem: the instance.
        config: static settings (default :class:`HeteroSearchConfig()`).
        key: a ``jax.random`` key; the same key gives the same plan.
        progress_fn: called after each chunk of optimization steps with
            ``(steps done, total steps, best relaxed loss)``.
        time_budget_s: overrides ``config.time_budget_s``: the whole search
            (optimization, polish, bound) keeps to it, within the time of one
            polish step: the local search stops at 60% of what the
            optimization left, the bound may use all that is then left (at
            least 0.5 s; it stops once within its tolerance of the plan), the
            windowed exact polish gets what the bound leaves and stops at the
            budget.

    Returns:
        A :class:`HeteroPlan` (``method="diff"``) whose ``info`` holds
        ``lower_bound`` and ``gap`` (certified: ``cost / lower_bound - 1``),
        ``best_restart``, ``fraction_best`` (of the polished restarts),
        ``polished_costs`` (restart -> cost), ``compile_time_s``,
        ``optimize_time_s``, ``polish_time_s``, ``bound_time_s``,
        ``num_restarts``, ``num_slots``, ``trace`` ((seconds, best cost) at each
        improvement), ``loss_curve`` (best relaxed loss per step, in units of
        a typical stage latency) and ``from_bound`` (the plan came from the
        bound's relaxation, module docstring step 5).

    Raises:
        InfeasibleProblemError: no plan satisfies the rules; the message says why.
    """
    config = HeteroSearchConfig() if config is None else config
    if time_budget_s is not None:
        config = dataclasses.replace(config, time_budget_s=time_budget_s)
    started = time.perf_counter()
    data, num_slots = _prepare(problem)
    candidates: list[tuple[int, list[int]]] = [(0, [0, problem.num_layers])]
    compile_time, curve = 0.0, np.zeros(0)
    if data is not None:
        candidates, curve, _, compile_time = _optimize(
            problem, data, config, key, progress_fn
        )
    optimized = time.perf_counter()
    budget_end = started + (config.time_budget_s or math.inf)
    # The bound gets a share of what is left (it prunes with the incumbent).
    # Without a budget there is no deadline (inf - inf would be NaN, and every
    # comparison with NaN is false: the local search would never start).
    deadline = math.inf
    if math.isfinite(budget_end):
        deadline = budget_end - _BOUND_SHARE * max(budget_end - optimized, 0.0)
    trace: list[tuple[float, float]] = []
    best = [math.inf]

    def record(cost: float) -> None:
        if cost < best[0]:
            best[0] = cost
            trace.append((time.perf_counter() - started, cost))

    def cheap_moves(stages, placement, cost, until):
        """The local moves that need no oracle call (module docstring, 4)."""
        return local_search(
            problem,
            stages,
            placement,
            cost,
            window=4 * max(config.polish_window, 1),
            deadline=until,
            exact_moves=False,
        )

    # Round and repair every candidate, then the cheap local search.
    results = []  # [cost, restart, boundaries, stages, placement]
    for restart, boundaries in candidates:
        if math.isfinite(best[0]) and time.perf_counter() > deadline:
            break
        cost, stages, placement = assign(problem, boundaries)
        if stages is not None:
            cost, stages, placement = cheap_moves(stages, placement, cost, deadline)
            record(cost)
        results.append([cost, restart, boundaries, stages, placement])
    results.sort(key=lambda r: r[0])
    found = [r for r in results if r[3] is not None]
    if not found:  # nothing rounded to a plan: the exact DP from one stage
        cost, stages, placement = exact_polish(
            problem,
            [0, problem.num_layers],
            None,
            None,
            math.inf,
            window=max(config.polish_window, 1),
            time_limit_s=config.exact_time_limit_s,
        )
        if stages is None:
            raise InfeasibleProblemError(explain_infeasible(problem))
        found = [[cost, candidates[0][0], candidates[0][1], stages, placement]]
        record(cost)
    best_cost, best_restart, _, best_stages, best_placement = found[0]
    polished = {restart: cost for cost, restart, _, _, _ in results}
    searched = time.perf_counter()

    # Certify (the bound's relaxation may hand over a cheaper valid plan). The
    # bound gets all that is left, at least a floor: it stops by itself once
    # within its tolerance of the incumbent, and what it leaves goes to the
    # windowed exact polish (cut short, the bound falls back to coarser pieces
    # that are much weaker than the polish can gain).
    bound_limit = None
    if math.isfinite(budget_end):
        bound_limit = max(budget_end - searched, _BOUND_FLOOR_S)
    from_bound: list = []

    def keep(plan) -> None:
        if plan.cost < min([best_cost] + [p.cost for p in from_bound]):
            from_bound.append(plan)
            record(plan.cost)

    bound = hetero_lower_bound(
        problem, incumbent_cost=best_cost, time_limit_s=bound_limit, plan_fn=keep
    )
    if from_bound:
        best_cost = from_bound[-1].cost
        best_stages, best_placement = split(from_bound[-1].stages)
    bounded = time.perf_counter()
    if from_bound and best_cost > bound * (1 + 1e-9):
        # The bound's plan is optimal for hetero_bound, not for the objective:
        # one more start for the local moves.
        cost, stages, placement = cheap_moves(
            best_stages, best_placement, best_cost, budget_end
        )
        found.append([cost, None, boundaries_of(stages), stages, placement])
        found.sort(key=lambda r: r[0])
        if cost < best_cost:
            best_cost, best_stages, best_placement = cost, stages, placement
            record(cost)

    # While the certified gap is open: every local move (the exact ones too)
    # and the windowed exact DP from the best distinct local optima.
    seen = set()
    for result in found:
        if best_cost <= bound * (1 + 1e-9) or len(seen) >= config.num_exact_polished:
            break
        cost, _, boundaries, stages, placement = result
        signature = (tuple(stages), tuple(placement))
        if signature in seen:
            continue
        seen.add(signature)
        if time.perf_counter() > budget_end:
            break
        cost, stages, placement = local_search(
            problem, stages, placement, cost, deadline=budget_end
        )
        cost, stages, placement = exact_polish(
            problem,
            boundaries,
            stages,
            placement,
            cost,
            window=config.polish_window,
            widest=config.polish_window,
            max_rounds=config.max_polish_rounds,
            time_limit_s=config.exact_time_limit_s,
            deadline=budget_end,
        )
        if cost < best_cost:
            best_cost, best_stages, best_placement = cost, stages, placement
            record(cost)
    finished_polish = time.perf_counter()
    run_time = time.perf_counter() - started
    reached = [c for c in polished.values() if c <= best_cost * (1 + 1e-9)]
    info = {
        "lower_bound": bound,
        "best_restart": best_restart,
        "fraction_best": len(reached) / max(len(polished), 1),
        "polished_costs": polished,
        "compile_time_s": compile_time,
        "optimize_time_s": optimized - started,
        "polish_time_s": (searched - optimized) + (finished_polish - bounded),
        "bound_time_s": bounded - searched,
        "num_restarts": config.num_restarts,
        "num_slots": num_slots,
        "trace": trace,
        "loss_curve": curve.tolist(),
        "from_bound": bool(from_bound),
    }
    plan = make_hetero_plan(
        problem,
        best_stages,
        method="diff",
        placement=best_placement,
        search_time_s=run_time,
        info=info,
    )
    plan.info["gap"] = plan.cost / bound - 1 if bound > 0 else math.inf
    return plan
