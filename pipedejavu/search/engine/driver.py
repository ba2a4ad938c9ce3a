"""The differentiable engine: relax, optimize many restarts at once, round, polish.

1. Fit the linear latency model (:mod:`pipedejavu.costmodel.stage.linear`) to the
   table.
2. Optimize the relaxed objective (:mod:`pipedejavu.search.engine.relax`) with optax
   Adam for ``num_restarts`` random initializations at once (``jax.vmap`` inside one
   jitted ``lax.scan``; the restarts are sharded over all JAX devices when there
   are several), annealing the boundary, slot and max temperatures and raising
   the device-budget penalty geometrically.
3. Round the best restarts to contiguous partitions (the soft stage ends,
   rounded) and polish each exactly on the true table: the exact DP
   (:mod:`pipedejavu.search.alpa.exact`) restricted to plans whose stage boundaries lie
   within ``polish_window`` layers of the current ones or of their stages' midpoints
   (so boundaries move, stages split and merge), which also picks the optimal
   submesh and config of every stage under the all-devices and memory rules;
   re-centre on the result until it stops improving.
4. Report the plan with a certified lower bound
   (:mod:`pipedejavu.search.engine.bounds`).

The returned cost is always ``evaluate(problem, plan)`` on the true table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, make_plan
from pipedejavu.search.alpa.caps import Reporter, explain_infeasible
from pipedejavu.search.alpa.labels import label_dp
from pipedejavu.search.engine.bounds import lower_bound
from pipedejavu.search.engine.config import SearchConfig, SearchResult
from pipedejavu.search.engine.neighbourhood import neighbourhood
from pipedejavu.search.engine.relax import RelaxedProblem
from pipedejavu.search.engine.restarts import (
    bucket,
    count_batches,
    optimize,
    restart_bytes,
)

__all__ = ["SearchConfig", "SearchResult", "differentiable", "search"]


def _prepare(problem: Problem) -> tuple[RelaxedProblem | None, int, float]:
    """Fit the linear model; returns the relaxed data (None when no slot could be
    fitted), the number of usable (submesh, config) slots and the latency scale
    the relaxed quantities are divided by (seconds). The layer axis is padded
    to :func:`bucket` rows."""
    from pipedejavu.costmodel.stage.linear import fit_linear_numpy

    # The NumPy fit: a new process traces and compiles nothing for it. Its
    # values are rounded to JAX's default float dtype, as fit_linear_model's.
    model_per_layer, model_intercept, usable = fit_linear_numpy(problem)
    out_dtype = np.float64 if jax.config.jax_enable_x64 else np.float32
    model_per_layer = model_per_layer.astype(out_dtype).astype(np.float64)
    model_intercept = model_intercept.astype(out_dtype).astype(np.float64)
    slots = np.argwhere(usable)  # [C, 2] (submesh, config)
    if slots.size == 0:  # too few profiled entries to fit any slot
        return None, 0, 1.0
    finite = problem.compute_cost[np.isfinite(problem.compute_cost)]
    scale = float(np.median(finite)) if finite.size else 1.0
    scale = scale if scale > 0 else 1.0
    # Pad the slots to a power of two with slots too slow to pick, so problems
    # of one size share one compiled function.
    padded = max(4, 1 << (len(slots) - 1).bit_length())
    per_layer = np.zeros((bucket(problem.num_layers), padded))
    intercept = np.full(padded, 1e3)
    devices = np.ones(padded)
    num_layers = problem.num_layers
    per_layer[:num_layers, : len(slots)] = model_per_layer[:, slots[:, 0], slots[:, 1]]
    per_layer[:num_layers, : len(slots)] /= scale
    intercept[: len(slots)] = model_intercept[slots[:, 0], slots[:, 1]] / scale
    devices[: len(slots)] = problem.submesh_sizes[slots[:, 0]]
    data = RelaxedProblem(
        per_layer=jnp.asarray(per_layer, dtype=jnp.float32),
        intercept=jnp.asarray(intercept, dtype=jnp.float32),
        slot_devices=jnp.asarray(devices, jnp.float32),
        num_devices=jnp.asarray(problem.num_devices, jnp.float32),
        num_microbatches=jnp.asarray(problem.num_microbatches, jnp.float32),
        num_layers=jnp.asarray(num_layers, jnp.float32),
    )
    return data, len(slots), scale


def _polish(
    problem: Problem,
    boundaries: list[int],
    config: SearchConfig,
    deadline: float = math.inf,
    improved_fn: Callable[[float], None] | None = None,
    proven: float = -math.inf,
) -> tuple[float, list[tuple[int, int, int, int]] | None, int]:
    """Exact DP over the neighbourhood of the boundaries, re-centred on each
    improvement. The window doubles (up to ``4 * polish_window``) when the
    neighbourhood has no plan or no better one, to escape local optima; at its
    widest, no improvement ends the polish, and so does a plan costing at most
    ``proven`` (a lower bound: nothing is cheaper)."""
    table = problem.compute_cost
    best_cost, best_stages = math.inf, None
    window, rounds = config.polish_window, 0
    widest = max(4 * config.polish_window, 1)
    last_round, previous_start = 0.0, None
    while rounds < config.max_polish_rounds:
        now = time.perf_counter()
        if previous_start is not None:
            last_round = now - previous_start
        previous_start = now
        # Stop when the next round (about as long as the last) would overrun.
        if best_stages is not None and now + last_round > deadline:
            break
        rounds += 1
        allowed = neighbourhood(boundaries, problem.num_layers, window)
        restricted = problem.replace(
            compute_cost=np.where(allowed[:, :, None, None], table, np.inf)
        )
        found = label_dp(restricted, incumbent=best_cost)
        cost, stages = found.cost, found.stages
        if stages is None and best_stages is None:  # no plan at all here
            if window >= problem.num_layers:
                break
            window = max(2 * window, 1)
            continue
        if stages is None:  # nothing cheaper in this neighbourhood
            if window >= widest:
                break
            window = min(2 * window, widest)
            continue
        best_cost, best_stages = cost, stages
        if improved_fn is not None:
            improved_fn(cost)
        if cost <= proven:
            break
        boundaries = [0] + [stop for _, stop, _, _ in stages]
    return best_cost, best_stages, rounds


def search(
    problem: Problem,
    config: SearchConfig = SearchConfig(),
    *,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None = None,
    message_fn: Callable[[str], None] | None = None,
) -> SearchResult:
    """Run the engine; see the module docstring.

    Args:
        problem: the instance.
        config: static settings.
        key: a ``jax.random`` key; the same key gives the same plan.
        progress_fn: called after each chunk of steps with ``(steps done,
            total steps, best relaxed loss so far in seconds)``; once with
            ``(0, total, inf)`` first when the restarts need over 256 MiB or
            run in batches (a long run).
        message_fn: receives a line about the polish (restart, best plan,
            lower bound) about every 1.5 s once the polish takes that long.

    Raises:
        InfeasibleProblemError: no plan satisfies the rules; the message says why.
    """

    started = time.perf_counter()
    # Refuse hopeless restart counts before any fitting or compiling (the
    # slots are at most M K, padded).
    num_stages = config.max_stages or min(problem.num_layers, problem.num_devices, 32)
    most_slots = max(
        4, 1 << (problem.num_submeshes * problem.num_configs - 1).bit_length()
    )
    count_batches(
        config,
        *restart_bytes(
            bucket(problem.num_layers),
            1 << (min(num_stages, problem.num_layers) - 1).bit_length(),
            most_slots,
        ),
    )
    data, num_usable_slots, scale = _prepare(problem)
    if data is None:  # nothing to relax: polish from one stage (window widens)
        candidates, curve, final_losses, compile_time = (
            [(0, [0, problem.num_layers])],
            [],
            [],
            0.0,
        )
    else:
        candidates, curve, final_losses, compile_time = optimize(
            problem, data, config, key, progress_fn, scale
        )
    # The bound first: a plan that reaches it is optimal, and polishing stops.
    bound = lower_bound(
        problem,
        progress_fn=None
        if message_fn is None
        else lambda line: message_fn(f"diff: {line}"),
    )
    proven = bound * (1 + 1e-9)
    deadline = started + (config.time_budget_s or math.inf)
    polished: dict[int, float] = {}
    best_cost, best_stages, best_restart = math.inf, None, -1
    trace: list[tuple[float, float]] = []

    report = Reporter(message_fn)
    polishing = [0]  # the candidate being polished (1-based)

    def improved(cost: float) -> None:
        if not trace or cost < trace[-1][1]:
            trace.append((time.perf_counter() - started, cost))
        report(
            lambda: (
                f"diff: polishing candidate {polishing[0]} of {len(candidates)}, "
                f"best plan {trace[-1][1]:.6g} s, lower bound {bound:.6g} s"
            )
        )

    for polishing[0], (restart, boundaries) in enumerate(candidates, start=1):
        if best_stages is not None and (
            time.perf_counter() > deadline or best_cost <= proven
        ):
            break
        # Candidates beyond num_polished (up to as many again) are polished
        # only while the bound leaves a gap (the check above).
        cost, stages, _ = _polish(
            problem, boundaries, config, deadline, improved, proven
        )
        polished[restart] = cost
        if cost < best_cost:
            best_cost, best_stages, best_restart = cost, stages, restart
    if best_stages is None:
        # No neighbourhood held a plan (e.g. one that needs more stages than
        # the roundings had anchors for): the exact DP on the whole problem.
        found = label_dp(problem)
        if found.stages is None:
            raise InfeasibleProblemError(explain_infeasible(problem))
        best_cost, best_stages = found.cost, found.stages
        improved(best_cost)

    run_time = time.perf_counter() - started
    reached = [c for c in polished.values() if c <= best_cost * (1 + 1e-9)]
    # Per step: the best relaxed loss so far over all restarts, at the final
    # temperatures and penalty (what is rounded; evaluated after each chunk),
    # in seconds; never rises.
    losses = (
        np.minimum.accumulate(np.concatenate(curve)).astype(np.float64) * scale
        if curve
        else np.zeros(0)
    )
    info = {
        "lower_bound": bound,
        "gap": best_cost / bound - 1 if bound > 0 else math.inf,
        "proven_optimal": bool(best_cost <= proven),
        "best_restart": best_restart,
        "fraction_best": len(reached) / len(polished),
        "compile_time_s": compile_time,
        "run_time_s": run_time,
        "num_restarts": config.num_restarts,
        "num_slots": num_usable_slots,
        "trace": trace,
        "loss_curve": losses.tolist(),
    }
    plan = make_plan(
        problem, best_stages, method="diff", search_time_s=run_time, info=info
    )
    return SearchResult(
        plan=plan,
        lower_bound=bound,
        loss_curve=losses,
        final_losses=np.asarray(final_losses, dtype=np.float64),
        polished_costs=polished,
        best_restart=best_restart,
        fraction_best=info["fraction_best"],
        compile_time_s=compile_time,
        run_time_s=run_time,
    )


def differentiable(
    problem: Problem,
    config: SearchConfig = SearchConfig(),
    *,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None = None,
    message_fn: Callable[[str], None] | None = None,
) -> Plan:
    """The engine's plan (``search(...).plan``); ``plan.info`` carries the lower
    bound, gap, best restart, fraction of restarts at the best, and times."""
    return search(
        problem,
        config,
        key=key,
        progress_fn=progress_fn,
        message_fn=message_fn,
    ).plan
