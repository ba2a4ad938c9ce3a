"""Pollux's goodput model as pure JAX functions (the core of :mod:`.goodput`).

Pollux (Qiao et al., OSDI 2021; AdaptDL's ``adaptdl/goodput.py``) predicts the
time of one data-parallel optimizer step from seven parameters (:class:`PerfParams`)
and discounts the throughput by the statistical efficiency of the batch size,
computed from the gradient noise (:class:`GradParams`):

* accumulation step (forward + backward of one atomic batch of ``m`` samples per
  replica): ``T_acc = alpha_c + beta_c * m``;
* gradient all-reduce: ``T_net = alpha + beta * max(replicas - 2, 1e-8)`` with
  the inter-node ``(alpha_n, beta_n)`` if ``nodes > 1``, else the intra-node
  ``(alpha_r, beta_r)`` if ``replicas > 1``, else ``1e-8`` for both;
* optimizer step (last micro-step overlapped with the all-reduce, a p-norm with
  ``p = gamma``): ``T_opt = (T_acc^gamma + T_net^gamma)^(1/gamma)``;
* step time ``s * T_acc + T_opt`` for ``s`` extra accumulation steps, and
  throughput ``replicas * m * (s + 1) / step time`` samples per second;
* efficiency of a global batch ``B`` against the initial batch ``B0``:
  ``(var + sqr) / (var / (B/B0) + sqr) / (B/B0)`` = ``(PGNS + B0) / (PGNS + B)``
  with the gradient noise scale ``PGNS = B0 * var / sqr`` (1/scale if the
  denominator is not positive).

Every function here broadcasts like numpy, is jit-compatible and vmappable, and
differentiates with ``jax.grad``. Use float64 (``jax.enable_x64``) to reproduce
AdaptDL's numbers; :class:`.goodput.GoodputFunction` does that for you.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

NUM_BATCH_SAMPLES = 50  # numpy.geomspace's default, what Pollux samples
EPS = 1e-8  # Pollux's absolute tolerance for its floor/ceil operations


class PerfParams(NamedTuple):
    """Pollux's step-time model; times in seconds, batch sizes in samples.

    Attributes:
        alpha_c: constant term of the accumulation (compute) time.
        beta_c: compute time per sample of the atomic batch.
        alpha_n: constant term of the inter-node all-reduce time.
        beta_n: inter-node retrogression per replica beyond 2.
        alpha_r: constant term of the intra-node all-reduce time.
        beta_r: intra-node retrogression per replica beyond 2.
        gamma: overlap of compute and network, in [1, 10] (1: none, 10: ~max).
    """

    alpha_c: ArrayLike
    beta_c: ArrayLike
    alpha_n: ArrayLike
    beta_n: ArrayLike
    alpha_r: ArrayLike
    beta_r: ArrayLike
    gamma: ArrayLike


class GradParams(NamedTuple):
    """Gradient statistics: ``sqr`` = |E g|^2 and ``var`` = trace of Var g.

    Both are measured at the initial batch size; ``var / sqr`` times that batch
    size is the gradient noise scale.
    """

    sqr: ArrayLike
    var: ArrayLike


def predict_accum_time(params: PerfParams, atomic_bsz: ArrayLike) -> jax.Array:
    """Time of one forward + backward pass of ``atomic_bsz`` samples, seconds."""
    return params.alpha_c + params.beta_c * atomic_bsz


def predict_network_time(
    params: PerfParams, num_nodes: ArrayLike, num_replicas: ArrayLike
) -> jax.Array:
    """All-reduce time, seconds, over the slowest link the replicas use.

    Inter-node if ``num_nodes > 1``, intra-node if ``num_replicas > 1``, else
    ``1e-8 + 1e-16`` (Pollux never returns exactly 0).
    """
    num_nodes = jnp.asarray(num_nodes)
    num_replicas = jnp.asarray(num_replicas)
    conditions = [num_nodes > 1, num_replicas > 1]
    bottleneck = jnp.select(conditions, [params.alpha_n, params.alpha_r], EPS)
    retrogress = jnp.select(conditions, [params.beta_n, params.beta_r], EPS)
    return bottleneck + retrogress * jnp.maximum(num_replicas - 2, EPS)


def predict_log_optim_time(
    params: PerfParams, accum_time: ArrayLike, network_time: ArrayLike
) -> jax.Array:
    """log of the optimizer-step time, ``log(acc^gamma + net^gamma) / gamma``."""
    gamma = params.gamma
    return jnp.log(accum_time**gamma + network_time**gamma) / gamma


def predict_step_time(
    params: PerfParams,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_steps: ArrayLike,
) -> jax.Array:
    """Time of one optimizer step with ``accum_steps`` extra micro-steps, seconds."""
    accum_time = predict_accum_time(params, atomic_bsz)
    network_time = predict_network_time(params, num_nodes, num_replicas)
    optim_time = jnp.exp(predict_log_optim_time(params, accum_time, network_time))
    return accum_steps * accum_time + optim_time


def global_batch(
    num_replicas: ArrayLike, atomic_bsz: ArrayLike, accum_steps: ArrayLike
) -> ArrayLike:
    """Samples per optimizer step: ``replicas * atomic_bsz * (accum_steps + 1)``
    (the global batch every goodput and its checks are about)."""
    return num_replicas * atomic_bsz * (accum_steps + 1)


def throughput(
    params: PerfParams,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_steps: ArrayLike,
) -> jax.Array:
    """Samples per second: ``replicas * atomic_bsz * (accum_steps + 1) / step``."""
    batch_size = global_batch(num_replicas, atomic_bsz, accum_steps)
    step = predict_step_time(params, num_nodes, num_replicas, atomic_bsz, accum_steps)
    return batch_size / step


def efficiency(
    grad_params: GradParams, init_batch_size: ArrayLike, batch_size: ArrayLike
) -> jax.Array:
    """Statistical efficiency of ``batch_size`` relative to ``init_batch_size``.

    The progress per sample at ``batch_size``, as a fraction of the progress per
    sample at ``init_batch_size`` (1 there, ``(PGNS + B0) / (PGNS + B)`` in
    general). Defined for any positive batch size.
    """
    scale = batch_size / init_batch_size
    denom = grad_params.var / scale + grad_params.sqr
    positive = denom > 0
    # Divide by a safe value where denom <= 0 so that gradients stay finite.
    gain = jnp.where(
        positive,
        (grad_params.var + grad_params.sqr) / jnp.where(positive, denom, 1.0),
        1.0,
    )
    return gain / scale


def goodput(
    params: PerfParams,
    grad_params: GradParams,
    init_batch_size: ArrayLike,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_steps: ArrayLike,
) -> jax.Array:
    """Throughput x efficiency: useful samples per second (no input checks)."""
    batch_size = global_batch(num_replicas, atomic_bsz, accum_steps)
    return throughput(
        params, num_nodes, num_replicas, atomic_bsz, accum_steps
    ) * efficiency(grad_params, init_batch_size, batch_size)


def goodput_from_step_time(
    grad_params: GradParams,
    init_batch_size: ArrayLike,
    batch_size: ArrayLike,
    step_time: ArrayLike,
) -> jax.Array:
    """Goodput of any step-time predictor: ``batch / step_time x efficiency``.

    For planners whose iteration time is not Pollux's data-parallel model (a
    pipeline's predicted iteration time per global batch and micro-batch size).

    Args:
        grad_params: gradient statistics at ``init_batch_size``.
        init_batch_size: the batch size the statistics were measured at, samples.
        batch_size: global batch, samples; any shape broadcasting with step_time.
        step_time: seconds per optimizer step at that batch.
    """
    return batch_size / step_time * efficiency(grad_params, init_batch_size, batch_size)


def geomspace(start: ArrayLike, stop: ArrayLike, num: int = NUM_BATCH_SAMPLES):
    """``numpy.geomspace(start, stop, num)`` for positive scalars, same arithmetic.

    The first and last points are exactly ``start`` and ``stop``; the sequence
    decreases if ``start > stop``. Shape ``(num,)``.
    """
    start = jnp.asarray(start, dtype=jnp.result_type(float))
    stop = jnp.asarray(stop, dtype=start.dtype)
    log_start, log_stop = jnp.log10(start), jnp.log10(stop)
    delta = log_stop - log_start
    div = num - 1
    ramp = jnp.arange(num, dtype=start.dtype)
    step = delta / div
    exponents = jnp.where(step == 0, ramp / div * delta, ramp * step) + log_start
    values = 10.0 ** exponents.at[-1].set(log_stop)
    return values.at[0].set(start).at[-1].set(stop)


def candidate_configs(
    init_batch_size: ArrayLike,
    num_replicas: ArrayLike,
    max_batch_size: ArrayLike,
    min_atomic_bsz: ArrayLike,
    max_atomic_bsz: ArrayLike,
    accumulation: bool,
) -> tuple[jax.Array, jax.Array]:
    """Pollux's 50 candidate ``(atomic_bsz, accum_steps)`` for one replica count.

    Global batches are sampled geometrically from ``max(init, min_atomic_bsz *
    num_replicas)`` to ``max_batch_size``. With ``accumulation`` the local batch
    is split into ``ceil(local / max_atomic_bsz) - 1`` extra steps (at least one
    for a single replica past the initial batch, whose gradient statistics need
    two micro-batches); without it there are none. ``atomic_bsz =
    ceil(local / (accum_steps + 1))``. Both ceilings subtract 1e-8 first.

    Args:
        init_batch_size, num_replicas, max_batch_size, min_atomic_bsz,
            max_atomic_bsz: scalars (vmap for several replica counts).
        accumulation: static; allow gradient accumulation.

    Returns:
        ``(atomic_bsz, accum_steps)``: int[50] each (int64 under x64).
    """
    int_dtype = jnp.result_type(int)
    start = jnp.maximum(init_batch_size, min_atomic_bsz * num_replicas)
    batch_size = geomspace(start, max_batch_size)
    local_bsz = batch_size / num_replicas
    if accumulation:
        accum_steps = jnp.ceil(local_bsz / max_atomic_bsz - EPS) - 1
        single = (num_replicas == 1) & (local_bsz > init_batch_size + EPS)
        accum_steps = jnp.where(single, jnp.maximum(accum_steps, 1), accum_steps)
        accum_steps = accum_steps.astype(int_dtype)
    else:
        accum_steps = jnp.zeros(local_bsz.shape, int_dtype)
    atomic_bsz = jnp.ceil(local_bsz / (accum_steps + 1) - EPS).astype(int_dtype)
    return atomic_bsz, accum_steps


def optimize_one(
    params: PerfParams,
    grad_params: GradParams,
    init_batch_size: ArrayLike,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    max_batch_size: ArrayLike,
    min_atomic_bsz: ArrayLike,
    max_atomic_bsz: ArrayLike,
    accumulation: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pollux's ``optimize`` for one ``(num_nodes, num_replicas)``, no input checks.

    Returns:
        ``(goodput, atomic_bsz, accum_steps, batches_ok)``: the best of the 50
        candidates (the first one on ties; goodput 0 and candidate 0 if no
        candidate's atomic batch is within ``[min_atomic_bsz, max_atomic_bsz]``),
        and whether every candidate's global batch is at least the initial one
        (Pollux's ``evaluate`` asserts that).
    """
    atomic_bsz, accum_steps = candidate_configs(
        init_batch_size,
        num_replicas,
        max_batch_size,
        min_atomic_bsz,
        max_atomic_bsz,
        accumulation,
    )
    values = goodput(
        params,
        grad_params,
        init_batch_size,
        num_nodes,
        num_replicas,
        atomic_bsz,
        accum_steps,
    )
    valid = (min_atomic_bsz <= atomic_bsz) & (atomic_bsz <= max_atomic_bsz)
    values = jnp.where(valid, values, 0.0)
    best = jnp.argmax(values)
    batches_ok = jnp.all(
        init_batch_size <= global_batch(num_replicas, atomic_bsz, accum_steps)
    )
    return values[best], atomic_bsz[best], accum_steps[best], batches_ok
