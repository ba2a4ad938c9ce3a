"""The differentiable engine: relax, optimize many restarts at once, round, polish.

1. Fit the linear latency model (:mod:`pipedejavu.search.linear`) to the table.
2. Optimize the relaxed objective (:mod:`pipedejavu.search.relax`) with optax Adam for
   ``num_restarts`` random initializations at once (``jax.vmap`` inside one
   jitted ``lax.scan``; the restarts are sharded over all JAX devices when there
   are several), annealing the boundary, slot and max temperatures and raising
   the device-budget penalty geometrically.
3. Round the best restarts to contiguous partitions (the soft stage ends,
   rounded) and polish each exactly on the true table: the exact DP
   (:mod:`pipedejavu.search.exact`) restricted to plans whose stage boundaries lie
   within ``polish_window`` layers of the current ones or of their stages' midpoints
   (so boundaries move, stages split and merge), which also picks the optimal
   submesh and config of every stage under the all-devices and memory rules;
   re-centre on the result until it stops improving.
4. Report the plan with a certified lower bound (:mod:`pipedejavu.search.bounds`).

The returned cost is always ``evaluate(problem, plan)`` on the true table.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedejavu.problem import (
    InfeasibleProblemError,
    Plan,
    Problem,
    ProblemError,
    make_plan,
)

from ._labels import label_dp
from .exact import explain_infeasible
from .relax import RelaxedParams, RelaxedProblem, Temperatures, relaxed_loss

__all__ = ["SearchConfig", "SearchResult", "differentiable", "search"]


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Static settings of the engine (hashable; validated on construction).

    Attributes:
        num_restarts: random initializations optimized at once (vmap).
        num_steps: Adam steps per restart.
        max_stages: stage slots S of the relaxation (None: min(L, D, 32)).
        learning_rate: Adam step size on the logits.
        boundary_temperature: (start, end) of the boundary sharpness, layers.
        slot_temperature: (start, end) of the slot softmax temperature.
        max_temperature: (start, end) of the smooth-max temperature, relative to
            a typical stage latency.
        penalty: (start, end) weight of the device-budget penalty.
        num_polished: best rounded restarts polished exactly (up to as many
            again while the lower bound does not prove the best plan optimal).
        polish_window: layers a boundary may move in one polish round.
        max_polish_rounds: polish rounds per restart at most.
        num_chunks: the steps run in this many jitted chunks; progress is
            reported between chunks.
        time_budget_s: polishing starts no round that would (judging by the
            previous round) end past this many seconds from the start, once a
            plan is found; the fit, optimization and lower bound come on top.
            None: no limit.
        memory_limit_gb: the restarts run in batches that each need at most
            this much memory (estimated by :func:`restart_bytes`); their
            parameters, all kept at once, must fit in it too.
    """

    num_restarts: int = 64
    num_steps: int = 300
    max_stages: int | None = None
    learning_rate: float = 0.1
    boundary_temperature: tuple[float, float] = (2.0, 0.05)
    slot_temperature: tuple[float, float] = (1.0, 0.05)
    max_temperature: tuple[float, float] = (0.3, 0.003)
    penalty: tuple[float, float] = (1.0, 1000.0)
    num_polished: int = 4
    polish_window: int = 2
    max_polish_rounds: int = 20
    num_chunks: int = 10
    time_budget_s: float | None = None
    memory_limit_gb: float = 2.0

    def __post_init__(self) -> None:
        if not self.memory_limit_gb > 0:
            raise ValueError(f"memory_limit_gb must be > 0, got {self.memory_limit_gb}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
        for name in (
            "num_restarts",
            "num_steps",
            "num_polished",
            "num_chunks",
            "max_polish_rounds",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.polish_window < 0:
            raise ValueError(f"polish_window must be >= 0, got {self.polish_window}")
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1, got {self.max_stages}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in (
            "boundary_temperature",
            "slot_temperature",
            "max_temperature",
            "penalty",
        ):
            pair = getattr(self, name)
            if len(pair) != 2 or not all(x > 0 for x in pair):
                raise ValueError(f"{name} must be two positive numbers, got {pair}")
        if self.num_steps % self.num_chunks:
            raise ValueError(
                f"num_steps ({self.num_steps}) must be a multiple of num_chunks "
                f"({self.num_chunks})"
            )


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """A plan and how the search got there.

    Attributes:
        plan: the best plan (its ``info`` holds the scalar fields below too).
        lower_bound: certified lower bound on the optimum (seconds).
        loss_curve: f[num_steps] seconds: the best relaxed loss over all
            restarts so far, at the final temperatures and penalty (the loss
            that is rounded), evaluated after each chunk of steps and held over
            the chunk; never rises.
        final_losses: f[num_restarts] relaxed loss of each restart at the end.
        polished_costs: exact cost reached from each polished restart.
        best_restart: index of the restart that produced the plan.
        fraction_best: fraction of polished restarts that reached the best cost.
        compile_time_s: tracing + XLA compilation (0 when cached).
        run_time_s: total wall time of the search.
    """

    plan: Plan
    lower_bound: float
    loss_curve: np.ndarray
    final_losses: np.ndarray
    polished_costs: dict[int, float]
    best_restart: int
    fraction_best: float
    compile_time_s: float
    run_time_s: float


def _geometric(pair: tuple[float, float], fraction: jax.Array) -> jax.Array:
    start, end = pair
    return start * (end / start) ** fraction


def bucket(size: int) -> int:
    """The padded size shared by similar sizes: the next of 4, 6, 8, 12, 16,
    24, 32, 48, ... (at most 1.5x the size), so compiled code is reused."""
    padded = 4
    while padded < size:
        padded = padded * 3 // 2 if padded & (padded - 1) == 0 else padded * 4 // 3
    return padded


def _prepare(problem: Problem) -> tuple[RelaxedProblem | None, int, float]:
    """Fit the linear model; returns the relaxed data (None when no slot could be
    fitted), the number of usable (submesh, config) slots and the latency scale
    the relaxed quantities are divided by (seconds). The layer axis is padded
    to :func:`bucket` rows."""
    from .linear import fit_linear_model

    model = fit_linear_model(problem)
    usable = np.asarray(model.usable)
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
    per_layer[:num_layers, : len(slots)] = np.asarray(model.per_layer)[
        :, slots[:, 0], slots[:, 1]
    ]
    per_layer[:num_layers, : len(slots)] /= scale
    intercept[: len(slots)] = (
        np.asarray(model.intercept)[slots[:, 0], slots[:, 1]] / scale
    )
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


def _initial_params(
    key: jax.Array,
    data: RelaxedProblem,
    num_restarts: int,
    num_stages: int,
    num_slots: int,
) -> tuple[RelaxedParams, jax.Array]:
    """Random restarts, each with its own number (1..num_stages, log-uniform) of
    active stage slots out of ``num_slots``; slot logits favour submeshes of
    about D / (active stages) devices."""
    key_count, key_boundary, key_slot = jax.random.split(key, 3)
    uniform = jax.random.uniform(key_count, (num_restarts,))
    active = jnp.floor(jnp.exp(uniform * jnp.log(num_stages + 0.999)))
    active = active.clip(1, num_stages)
    mask = jnp.arange(num_slots)[None, :] < active[:, None]
    boundary = 0.3 * jax.random.normal(key_boundary, (num_restarts, num_slots))
    target = jnp.log2(data.num_devices / active)[:, None, None]
    closeness = -2.0 * jnp.abs(jnp.log2(data.slot_devices)[None, None, :] - target)
    noise = 0.5 * jax.random.normal(
        key_slot, (num_restarts, num_slots, data.slot_devices.shape[0])
    )
    return RelaxedParams(boundary, closeness + noise), mask


@partial(jax.jit, static_argnames=("num_restarts", "num_stages", "num_slots"))
def _start(key, data, *, num_restarts, num_stages, num_slots):
    """Initial restarts in one compiled function (cached on disk) instead of a
    dozen eager operations compiled one by one."""
    return _initial_params(key, data, num_restarts, num_stages, num_slots)


@jax.jit
def _fresh_state(params: RelaxedParams) -> Any:
    """Adam's initial state (the learning rate is not part of it)."""
    return optax.adam(1.0).init(params)


class _Schedule(NamedTuple):
    """The settings the compiled optimization depends on (its static key):
    other fields of :class:`SearchConfig` do not cause a compilation."""

    num_steps: int
    learning_rate: float
    boundary_temperature: tuple[float, float]
    slot_temperature: tuple[float, float]
    max_temperature: tuple[float, float]
    penalty: tuple[float, float]

    @classmethod
    def of(cls, config: SearchConfig) -> _Schedule:
        return cls(*(getattr(config, name) for name in cls._fields))


#: How often :func:`_run_chunk` has been traced (a test checks it stays put).
TRACE_COUNT = [0]


@partial(jax.jit, static_argnames=("chunk", "total", "config"))
def _run_chunk(params, opt_state, first_step, data, mask, *, chunk, total, config):
    TRACE_COUNT[0] += 1  # runs at trace time only
    optimizer = optax.adam(config.learning_rate)

    def total_loss(batched, temps):
        losses = jax.vmap(relaxed_loss, in_axes=(0, None, 0, None))(
            batched, data, mask, temps
        )
        return jnp.sum(losses), losses

    final = Temperatures(
        boundary=jnp.float32(config.boundary_temperature[1]),
        slot=jnp.float32(config.slot_temperature[1]),
        max=jnp.float32(config.max_temperature[1]),
        penalty=jnp.float32(config.penalty[1]),
    )

    def final_losses(batched):
        return jax.vmap(relaxed_loss, in_axes=(0, None, 0, None))(
            batched, data, mask, final
        )

    def step(carry, index):
        params, opt_state = carry
        fraction = index / max(total - 1, 1)
        temps = Temperatures(
            boundary=_geometric(config.boundary_temperature, fraction),
            slot=_geometric(config.slot_temperature, fraction),
            max=_geometric(config.max_temperature, fraction),
            penalty=_geometric(config.penalty, fraction),
        )
        grads, _ = jax.grad(total_loss, has_aux=True)(params, temps)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    steps = first_step + jnp.arange(chunk)
    (params, opt_state), _ = jax.lax.scan(step, (params, opt_state), steps)
    # The loss that is rounded (final temperatures and penalty) costs about two
    # steps to evaluate: once per chunk, its best held over the chunk's steps.
    losses = final_losses(params)
    return params, opt_state, jnp.full(chunk, jnp.min(losses)), losses


# Compiled optimization chunks, by (config, parameter and data shapes/shardings).
_COMPILED: dict[Any, Any] = {}


def _shard(tree: Any, num_restarts: int) -> Any:
    """Split the restart axis over all devices (no-op on one device)."""
    devices = jax.devices()
    if len(devices) == 1 or num_restarts % len(devices):
        return tree
    mesh = jax.sharding.Mesh(np.array(devices), ("restarts",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("restarts"))
    return jax.device_put(tree, sharding)


def _rounded_boundaries(
    params: RelaxedParams, mask: np.ndarray, num_layers: int
) -> list[int]:
    """Integer stage boundaries ``0 = b_0 < ... < b_S = L`` of one restart: its
    soft ends rounded, empty stages dropped."""
    logits = np.where(mask, np.asarray(params.boundary_logits, np.float64), -1e4)
    shares = np.exp(logits - logits.max())
    ends = num_layers * np.cumsum(shares / shares.sum())
    rounded = np.clip(np.rint(ends).astype(int), 0, num_layers)
    rounded[-1] = num_layers
    boundaries = [0]
    for end in rounded.tolist():
        if end > boundaries[-1]:
            boundaries.append(end)
    return boundaries


def _neighbourhood(boundaries: list[int], num_layers: int, window: int) -> np.ndarray:
    """bool[L, L]: spans (start, end inclusive) the polish DP may use."""
    anchors = [boundaries[0]]
    for left, right in zip(boundaries[:-1], boundaries[1:], strict=True):
        if right - left >= 2:
            anchors.append((left + right) // 2)
        anchors.append(right)
    groups = [
        np.arange(max(a - window, 0), min(a + window, num_layers) + 1)
        if 0 < a < num_layers
        else np.array([a])
        for a in anchors
    ]
    allowed = np.zeros((num_layers, num_layers), dtype=bool)
    for first in range(len(groups)):
        for last in range(first + 1, min(first + 5, len(groups))):
            starts = groups[first][groups[first] < num_layers]
            stops = groups[last][groups[last] > 0]
            start_grid, stop_grid = np.meshgrid(starts, stops, indexing="ij")
            keep = start_grid < stop_grid
            allowed[start_grid[keep], stop_grid[keep] - 1] = True
    return allowed


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
        allowed = _neighbourhood(boundaries, problem.num_layers, window)
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


def compiled_chunk(
    run_chunk: Any,
    cache: dict,
    static_key: Any,
    operands: tuple,
    **static: Any,
) -> tuple[Any, float]:
    """``run_chunk`` compiled ahead of time once per static settings, operand
    shapes/dtypes and restart sharding; returns it and the compile seconds
    (0 when cached). ``operands`` = ``(params, opt_state, data, mask)``; the
    first step index is a traced int32. Shared with the hardware-aware engine.
    """
    params, opt_state, data, mask = operands
    signature = (
        static_key,
        jax.tree_util.tree_map(lambda x: (x.shape, x.dtype, str(x.sharding)), params),
        jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), data),
    )
    compiled = cache.get(signature)
    if compiled is not None:
        return compiled, 0.0
    started = time.perf_counter()
    compiled = run_chunk.lower(
        params, opt_state, jnp.int32(0), data, mask, **static
    ).compile()
    cache[signature] = compiled
    return compiled, time.perf_counter() - started


def restart_bytes(num_rows: int, num_slots: int, num_choices: int) -> tuple[int, int]:
    """Memory of one restart (bytes): while its steps run, and for its
    parameters and Adam state alone (kept for all restarts at once).

    ``num_rows`` padded layers, ``num_slots`` stage slots, ``num_choices``
    (submesh, config) slots, float32. The working set counts the soft
    assignment (``rows x slots``) and the slot tables (``slots x choices``)
    with their temporaries and gradients; the factors (about 5.3 and 11 floats)
    were fitted to the peak resident memory of 8k-32k restarts at L = 32 and
    L = 64 on CPU (25 and 36 KB per restart) and rounded up.
    """
    state = 4 * 3 * num_slots * (1 + num_choices)  # params, Adam mu and nu
    work = 4 * (6 * num_rows * num_slots + 12 * num_slots * num_choices)
    return state + work, state


def _batches(config: SearchConfig, per_restart: int, state: int) -> int:
    """How many batches the restarts run in to stay within the memory limit.

    Raises:
        ProblemError: the restarts' parameters alone exceed the limit.
    """
    limit = config.memory_limit_gb * 2**30
    if state * config.num_restarts > limit:
        raise ProblemError(
            f"num_restarts = {config.num_restarts} needs "
            f"{state * config.num_restarts / 2**30:.1f} GiB for the restarts' "
            f"parameters alone, over the limit memory_limit_gb = "
            f"{config.memory_limit_gb:g} (SearchConfig); use fewer restarts"
        )
    per_batch = max(1, int(limit // per_restart))
    return -(-config.num_restarts // per_batch)


def _optimize(
    problem: Problem,
    data: RelaxedProblem,
    config: SearchConfig,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None,
    scale: float,
) -> tuple[list[tuple[int, list[int]]], list[np.ndarray], np.ndarray, float]:
    """Run the restarts; returns up to ``num_polished`` distinct rounded
    partitions ``(restart, boundaries)`` best relaxed loss first, the loss
    curve chunks (per step, the best loss over restarts at the final
    temperatures, / ``scale``), the final relaxed losses and the compile time
    (every compilation, of the initialization and the steps).

    Restarts whose working memory together exceeds ``config.memory_limit_gb``
    run in equal batches, one after the other, through one compiled function.
    """
    from . import _jax_cache

    num_stages = config.max_stages or min(problem.num_layers, problem.num_devices, 32)
    num_stages = min(num_stages, problem.num_layers)
    num_slots = 1 << (num_stages - 1).bit_length()  # padded: fewer compilations
    per_restart, state = restart_bytes(
        data.per_layer.shape[0], num_slots, data.per_layer.shape[1]
    )
    num_batches = _batches(config, per_restart, state)
    batch = -(-config.num_restarts // num_batches)
    total_steps = num_batches * config.num_steps
    if num_batches > 1 and progress_fn is not None:
        progress_fn(0, total_steps, math.inf)  # a long run: say so at once
    started = time.perf_counter()
    known = _start._cache_size()
    with _jax_cache.compiling():
        everything, all_masks = _start(
            key,
            data,
            num_restarts=config.num_restarts,
            num_stages=num_stages,
            num_slots=num_slots,
        )
        jax.block_until_ready(everything)
        # Compilation (or a disk-cache load) only when the shapes were new.
        compile_time = (
            time.perf_counter() - started if _start._cache_size() > known else 0.0
        )
    chunk = config.num_steps // config.num_chunks
    schedule = _Schedule.of(config)
    curve = np.full(config.num_steps, np.inf)
    best_so_far = math.inf
    final_losses = np.zeros(config.num_restarts)
    host_params = RelaxedParams(
        np.zeros(everything.boundary_logits.shape, np.float32),
        np.zeros(everything.slot_logits.shape, np.float32),
    )
    for number in range(num_batches):
        # The last batch is topped up with the first restarts (results dropped).
        index = np.arange(number * batch, (number + 1) * batch) % config.num_restarts
        if num_batches == 1:
            params, mask = everything, all_masks
        else:
            params = RelaxedParams(
                everything.boundary_logits[index], everything.slot_logits[index]
            )
            mask = all_masks[index]
        params, mask = _shard((params, mask), batch)
        with _jax_cache.compiling():
            opt_state = _fresh_state(params)
            compiled, seconds = compiled_chunk(
                _run_chunk,
                _COMPILED,
                schedule,
                (params, opt_state, data, mask),
                chunk=chunk,
                total=config.num_steps,
                config=schedule,
            )
        compile_time += seconds
        for step in range(config.num_chunks):
            params, opt_state, best, losses = compiled(
                params, opt_state, jnp.int32(step * chunk), data, mask
            )
            part = slice(step * chunk, (step + 1) * chunk)
            curve[part] = np.minimum(curve[part], np.asarray(best))
            best_so_far = min(best_so_far, float(np.min(curve[part])))
            if progress_fn is not None:
                done = number * config.num_steps + (step + 1) * chunk
                progress_fn(done, total_steps, best_so_far * scale)
        own = slice(number * batch, min((number + 1) * batch, config.num_restarts))
        count = own.stop - own.start
        final_losses[own] = np.asarray(losses, dtype=np.float64)[:count]
        host_params.boundary_logits[own] = np.asarray(params.boundary_logits)[:count]
        host_params.slot_logits[own] = np.asarray(params.slot_logits)[:count]
    host_mask = np.asarray(all_masks)
    candidates, seen = [], set()
    for restart in np.argsort(final_losses, kind="stable").tolist():
        if len(candidates) >= 2 * config.num_polished:
            break
        one = RelaxedParams(
            host_params.boundary_logits[restart], host_params.slot_logits[restart]
        )
        boundaries = _rounded_boundaries(one, host_mask[restart], problem.num_layers)
        if tuple(boundaries) not in seen:  # same rounding: same polish
            seen.add(tuple(boundaries))
            candidates.append((restart, boundaries))
    return candidates, [curve], final_losses, compile_time


def search(
    problem: Problem,
    config: SearchConfig = SearchConfig(),
    *,
    key: jax.Array,
    progress_fn: Callable[[int, int, float], None] | None = None,
    message_fn: Callable[[str], None] | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
) -> SearchResult:
    """Run the engine; see the module docstring.

    Args:
        problem: the instance.
        config: static settings.
        key: a ``jax.random`` key; the same key gives the same plan.
        progress_fn: called after each chunk of steps with ``(steps done,
            total steps, best relaxed loss so far in seconds)``; once with
            ``(0, total, inf)`` first when the restarts run in batches.
        message_fn: receives a line about the polish (restart, best plan,
            lower bound) about every 1.5 s once the polish takes that long.
        cache_dir: where compiled code is kept between processes
            (:mod:`pipedejavu.search._jax_cache`): a folder, ``False`` for
            none, ``None`` for ``$PIPEDEJAVU_CACHE_DIR`` or the user's cache
            folder. The first call in a process decides.

    Raises:
        InfeasibleProblemError: no plan satisfies the rules; the message says why.
    """
    from . import _jax_cache
    from .bounds import lower_bound

    started = time.perf_counter()
    # Refuse hopeless restart counts before any fitting or compiling (the
    # slots are at most M K, padded).
    num_stages = config.max_stages or min(problem.num_layers, problem.num_devices, 32)
    most_slots = max(
        4, 1 << (problem.num_submeshes * problem.num_configs - 1).bit_length()
    )
    _batches(
        config,
        *restart_bytes(
            bucket(problem.num_layers),
            1 << (min(num_stages, problem.num_layers) - 1).bit_length(),
            most_slots,
        ),
    )
    _jax_cache.enable(cache_dir)
    with _jax_cache.compiling():
        data, num_usable_slots, scale = _prepare(problem)
    if data is None:  # nothing to relax: polish from one stage (window widens)
        candidates, curve, final_losses, compile_time = (
            [(0, [0, problem.num_layers])],
            [],
            [],
            0.0,
        )
    else:
        candidates, curve, final_losses, compile_time = _optimize(
            problem, data, config, key, progress_fn, scale
        )
    # The bound first: a plan that reaches it is optimal, and polishing stops.
    bound = lower_bound(problem)
    proven = bound * (1 + 1e-9)
    deadline = started + (config.time_budget_s or math.inf)
    polished: dict[int, float] = {}
    best_cost, best_stages, best_restart = math.inf, None, -1
    trace: list[tuple[float, float]] = []

    from .exact import _Reporter

    report = _Reporter(message_fn)
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
    cache_dir: str | os.PathLike | bool | None = None,
) -> Plan:
    """The engine's plan (``search(...).plan``); ``plan.info`` carries the lower
    bound, gap, best restart, fraction of restarts at the best, and times."""
    return search(
        problem,
        config,
        key=key,
        progress_fn=progress_fn,
        message_fn=message_fn,
        cache_dir=cache_dir,
    ).plan
