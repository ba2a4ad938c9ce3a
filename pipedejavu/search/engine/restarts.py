"""The engine's relaxed phase: many restarts optimized at once, then rounded.

Random restarts (:func:`_initial_params`, one compiled function), optax Adam
on the relaxed objective (:mod:`pipedejavu.search.engine.relax`) inside one jitted
``lax.scan`` per chunk of steps, ``jax.vmap`` over the restarts (sharded over
all JAX devices when there are several), run in memory-limited batches
(:func:`restart_bytes`), and the best restarts rounded to contiguous partitions
for :mod:`pipedejavu.search.engine.driver` to polish. Compiled functions are keyed by
shapes and the schedule only, and layers are padded to :func:`bucket` sizes,
so that problems of similar sizes share compiled code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedejavu.core.problem import Problem, ProblemError
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.engine.relax import (
    RelaxedParams,
    RelaxedProblem,
    Temperatures,
    relaxed_loss,
)


def geometric(pair: tuple[float, float], fraction: jax.Array) -> jax.Array:
    start, end = pair
    return start * (end / start) ** fraction


def bucket(size: int) -> int:
    """The padded size shared by similar sizes: the next of 4, 6, 8, 12, 16,
    24, 32, 48, ... (at most 1.5x the size), so compiled code is reused."""
    padded = 4
    while padded < size:
        padded = padded * 3 // 2 if padded & (padded - 1) == 0 else padded * 4 // 3
    return padded


def random_starts(
    key: jax.Array,
    num_devices: jax.Array,
    slot_devices: jax.Array,
    num_restarts: int,
    num_stages: int,
    num_slots: int,
    noise: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(boundary logits, slot logits, mask)`` of ``num_restarts`` random
    restarts, each with its own number (1..num_stages, log-uniform) of active
    stage slots out of ``num_slots`` (``mask``); slot logits favour the slots
    (``slot_devices``: each slot's devices) of about ``num_devices`` / (active
    stages) devices, plus ``noise`` times a standard normal draw. The
    homogeneous and the heterogeneous engines' initial restarts."""
    key_count, key_boundary, key_slot = jax.random.split(key, 3)
    uniform = jax.random.uniform(key_count, (num_restarts,))
    active = jnp.floor(jnp.exp(uniform * jnp.log(num_stages + 0.999)))
    active = active.clip(1, num_stages)
    mask = jnp.arange(num_slots)[None, :] < active[:, None]
    boundary = 0.3 * jax.random.normal(key_boundary, (num_restarts, num_slots))
    target = jnp.log2(num_devices / active)[:, None, None]
    closeness = -2.0 * jnp.abs(jnp.log2(slot_devices)[None, None, :] - target)
    scatter = noise * jax.random.normal(
        key_slot, (num_restarts, num_slots, slot_devices.shape[0])
    )
    return boundary, closeness + scatter, mask


def _initial_params(
    key: jax.Array,
    data: RelaxedProblem,
    num_restarts: int,
    num_stages: int,
    num_slots: int,
) -> tuple[RelaxedParams, jax.Array]:
    """Random restarts (:func:`random_starts`), each with its own number
    (1..num_stages, log-uniform) of active stage slots out of ``num_slots``;
    slot logits favour submeshes of about D / (active stages) devices."""
    boundary, logits, mask = random_starts(
        key,
        data.num_devices,
        data.slot_devices,
        num_restarts,
        num_stages,
        num_slots,
        0.5,
    )
    return RelaxedParams(boundary, logits), mask


#: ``[n]``: times :func:`_start` was traced (each new trace is compiled or
#: loaded from the persistent cache).
START_TRACES = [0]


@partial(jax.jit, static_argnames=("num_restarts", "num_stages", "num_slots"))
def _start(key, data, *, num_restarts, num_stages, num_slots):
    """Initial restarts in one compiled function (cached on disk) instead of a
    dozen eager operations compiled one by one."""
    START_TRACES[0] += 1  # a Python side effect: runs once per trace
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
            boundary=geometric(config.boundary_temperature, fraction),
            slot=geometric(config.slot_temperature, fraction),
            max=geometric(config.max_temperature, fraction),
            penalty=geometric(config.penalty, fraction),
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
COMPILED: dict[Any, Any] = {}


def shard(tree: Any, num_restarts: int) -> Any:
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


def count_batches(config: SearchConfig, per_restart: int, state: int) -> int:
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


def optimize(
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
    num_stages = config.max_stages or min(problem.num_layers, problem.num_devices, 32)
    num_stages = min(num_stages, problem.num_layers)
    num_slots = 1 << (num_stages - 1).bit_length()  # padded: fewer compilations
    per_restart, state = restart_bytes(
        data.per_layer.shape[0], num_slots, data.per_layer.shape[1]
    )
    num_batches = count_batches(config, per_restart, state)
    batch = -(-config.num_restarts // num_batches)
    total_steps = num_batches * config.num_steps
    big = num_batches > 1 or per_restart * config.num_restarts > 2**28
    if big and progress_fn is not None:
        progress_fn(0, total_steps, math.inf)  # a long run: say so at once
    started = time.perf_counter()
    known = START_TRACES[0]
    everything, all_masks = _start(
        key,
        data,
        num_restarts=config.num_restarts,
        num_stages=num_stages,
        num_slots=num_slots,
    )
    jax.block_until_ready(everything)
    # Compilation (or a disk-cache load) only when the shapes were new: a new
    # trace of ``_start`` (its body runs in Python only when JAX traces it).
    compile_time = time.perf_counter() - started if START_TRACES[0] > known else 0.0
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
        params, mask = shard((params, mask), batch)
        opt_state = _fresh_state(params)
        compiled, seconds = compiled_chunk(
            _run_chunk,
            COMPILED,
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
