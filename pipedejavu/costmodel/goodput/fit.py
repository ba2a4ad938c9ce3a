"""Fitting Pollux's step-time model (:class:`PerfParams`) to measured step times.

AdaptDL's ``fit_perf_params`` minimizes, with scipy's L-BFGS-B and bounds,

    RMSE(log predicted accum time, log measured accum time)
    + RMSE(log predicted optim time, log measured optim time)
    + 1e-3 (gamma - 1)^2 + 1e-2 ((beta_n / alpha_n)^2 + (beta_r / alpha_r)^2)

(the RMSEs are not squared) from ``x0 = (0.1, 0.01) x 3 + (1.001,)`` within
``[1e-8, inf)`` (gamma in ``[1, 10]``), pinning what the data cannot identify:
``alpha_c = mean(accum time) / 2`` for a single atomic batch size, the
inter-node pair without multi-node points, the intra-node pair without
single-node multi-replica points, both retrogression terms without more than two
replicas. Without multi-node points it then enforces the prior
``alpha_n >= 1.1 alpha_r``, ``beta_n >= 1.1 beta_r``. This port keeps all of
that, with the gradient from ``jax.grad`` in float64.

One L-BFGS-B run from AdaptDL's start often stops far from the best fit (the
objective is not convex, and the run is chaotic: last-bit differences in the
arithmetic send it to different minima). By default 32 seeded random starts are
first screened at once (a vmapped Adam in an unconstrained space, 150 steps),
L-BFGS-B then also runs from the best ``num_restarts`` of them, and the lowest
objective after the prior wins, so the result is never worse than AdaptDL's
start alone and often much better; ``num_restarts=0`` gives the single run. The
L-BFGS-B runs stop at a tighter tolerance than scipy's default, whose test is
absolute below 1 (noise-free measurements have objectives near 0). Where an RMSE
is exactly 0 its gradient is taken as 0 (a valid subgradient) rather than
AdaptDL's NaN, which stopped its optimizer at the start.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.optimize
from jax.typing import ArrayLike

from pipedejavu.costmodel.goodput.model import (
    PerfParams,
    predict_accum_time,
    predict_log_optim_time,
    predict_network_time,
)

MAX_POINTS = 1_000_000  # measurements accepted by fit_perf_params
_X0 = (0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.001)
_LOWER = (1e-8, 1e-8, 1e-8, 1e-8, 1e-8, 1e-8, 1.0)
_UPPER = (np.inf, np.inf, np.inf, np.inf, np.inf, np.inf, 10.0)
# Tighter than scipy's defaults, whose stopping test is absolute for objectives
# below 1: noise-free measurements have objectives near 0 and would stop early.
_OPTIONS = {"ftol": 1e-13, "gtol": 1e-10}


def _weighted_rmse(pred: jax.Array, true: jax.Array, weights: jax.Array) -> jax.Array:
    mean_square = jnp.sum(weights * (pred - true) ** 2) / jnp.sum(weights)
    positive = mean_square > 0
    # sqrt's derivative is infinite at 0; use 0 there (a subgradient).
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, mean_square, 1.0)), 0.0)


def perf_objective(
    params: ArrayLike,
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_step_time: ArrayLike,
    optim_step_time: ArrayLike,
    weights: ArrayLike | None = None,
) -> jax.Array:
    """AdaptDL's fitting objective (its ``_obj_fn``) at ``params``.

    Args:
        params: f[7] in :class:`PerfParams` order (or a PerfParams).
        num_nodes, num_replicas, atomic_bsz: f[N] configurations of the
            measurements.
        accum_step_time: f[N] seconds of an accumulation (non-optimizer) step.
        optim_step_time: f[N] seconds of an optimizer step.
        weights: f[N] of 0/1 (default all 1): 0 drops a point (padding).

    Returns:
        f[] the objective: two RMSEs of log times plus the two regularizers.
    """
    params = PerfParams(*params)
    if weights is None:
        weights = jnp.ones(jnp.shape(accum_step_time))
    pred_accum = predict_accum_time(params, atomic_bsz)
    pred_network = predict_network_time(params, num_nodes, num_replicas)
    pred_log_optim = predict_log_optim_time(params, pred_accum, pred_network)
    err_accum = _weighted_rmse(jnp.log(pred_accum), jnp.log(accum_step_time), weights)
    err_optim = _weighted_rmse(pred_log_optim, jnp.log(optim_step_time), weights)
    reg_gamma = 1e-3 * (params.gamma - 1) ** 2
    reg_retrogress = 1e-2 * (
        (params.beta_n / params.alpha_n) ** 2 + (params.beta_r / params.alpha_r) ** 2
    )
    return err_accum + err_optim + reg_gamma + reg_retrogress


@jax.jit
def _value_and_grad(x, data):
    return jax.value_and_grad(perf_objective)(x, *data)


def _measurements(
    num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time
) -> tuple[np.ndarray, ...]:
    names = (
        "num_nodes",
        "num_replicas",
        "atomic_bsz",
        "accum_step_time",
        "optim_step_time",
    )
    arrays = []
    for name, value in zip(
        names,
        (num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time),
        strict=True,
    ):
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an array of numbers") from None
        if array.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{name} must be finite")
        arrays.append(array)
    size = arrays[0].size
    for name, array in zip(names, arrays, strict=True):
        if array.size != size:
            raise ValueError(
                f"{name} has {array.size} values but num_nodes has {size}; all five "
                "arrays must have one value per measurement"
            )
    if size == 0:
        raise ValueError("fit_perf_params needs at least one measurement, got none")
    if size > MAX_POINTS:
        raise ValueError(f"at most {MAX_POINTS} measurements, got {size}")
    for name, array, least in zip(names, arrays, (1, 1, 0, 0, 0), strict=True):
        if least and np.any(array < least):
            raise ValueError(f"{name} must be >= {least}, got {array.min()}")
        if not least and np.any(array <= 0):
            raise ValueError(f"{name} must be positive, got {array.min()}")
    return tuple(arrays)


def _padded(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Pads to a power of two (>= 64) with weight-0 points: fewer compilations."""
    size = arrays[0].size
    padded_size = max(64, 1 << (size - 1).bit_length())
    out = [np.ones(padded_size) for _ in range(len(arrays) + 1)]
    for column, array in zip(out, (*arrays, np.ones(size)), strict=True):
        column[:size] = array
    out[-1][size:] = 0.0
    return tuple(out)


def _bounds(nodes, replicas, atomic_bsz, accum_time):
    x0, lower, upper = list(_X0), list(_LOWER), list(_UPPER)

    def pin(index: int, value: float) -> None:
        x0[index] = lower[index] = upper[index] = value

    if len(np.unique(atomic_bsz)) == 1:
        pin(0, float(np.mean(accum_time)) / 2)
    if not np.any(nodes > 1):
        pin(2, _LOWER[2])
        pin(3, _LOWER[3])
    if not np.any((nodes == 1) & (replicas > 1)):
        pin(4, _LOWER[4])
        pin(5, _LOWER[5])
    if not np.any(replicas > 2):
        pin(3, _LOWER[3])
        pin(5, _LOWER[5])
    return np.array(x0), np.array(lower), np.array(upper)


def _to_params(z: jax.Array, x0: jax.Array, lower: jax.Array, free: jax.Array):
    """Unconstrained z -> parameters within the bounds (pinned ones stay x0)."""
    positive = lower[:6] + jnp.exp(z[:6])
    gamma = 1.0 + 9.0 * jax.nn.sigmoid(z[6:])
    return jnp.where(free, jnp.concatenate([positive, gamma]), x0)


@functools.partial(jax.jit, static_argnames="num_steps")
def _screen(z_starts, x0, lower, free, data, num_steps: int = 150):
    """Adam on every start at once (vmapped), in an unconstrained space.

    Returns the parameters reached and their objective: f[S, 7], f[S].
    """
    optimizer = optax.adam(0.05)

    def loss(z):
        return perf_objective(_to_params(z, x0, lower, free), *data)

    def run(z):
        def step(_, carry):
            z, state = carry
            grad = jax.grad(loss)(z)
            grad = jnp.where(jnp.isfinite(grad), grad, 0.0)
            updates, state = optimizer.update(grad, state)
            return optax.apply_updates(z, updates), state

        z, _ = jax.lax.fori_loop(0, num_steps, step, (z, optimizer.init(z)))
        return _to_params(z, x0, lower, free), loss(z)

    return jax.vmap(run)(z_starts)


def _screen_starts(x0, lower, num_starts: int, seed: int) -> np.ndarray:
    """Log-uniform random starts (and AdaptDL's x0 first), as unconstrained z."""
    rng = np.random.default_rng(seed)
    x = np.empty((num_starts, 7))
    x[:, [0, 2, 4]] = 10.0 ** rng.uniform(-4, 0, (num_starts, 3))
    x[:, [1, 3, 5]] = 10.0 ** rng.uniform(-7, -1, (num_starts, 3))
    x[:, 6] = rng.uniform(1.0, 10.0, num_starts)
    x[0] = x0
    z = np.empty_like(x)
    z[:, :6] = np.log(np.maximum(x[:, :6] - lower[:6], 1e-300))
    gamma = np.clip((x[:, 6] - 1.0) / 9.0, 1e-6, 1 - 1e-6)
    z[:, 6] = np.log(gamma / (1 - gamma))
    return z


@functools.cache
def _blas_controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _single_threaded_blas():
    """scipy's L-BFGS-B calls BLAS on 7-vectors; threads there only cost (30x on a
    busy machine), so the fit limits BLAS to one thread while it runs."""
    return _blas_controller().limit(limits=1, user_api="blas")


def _with_prior(params: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """AdaptDL's prior without multi-node data: inter-node no faster than intra."""
    if not np.any(nodes > 1):
        params[2] = max(params[2], params[4] * 1.1)
        params[3] = max(params[3], params[5] * 1.1)
    return params


def fit_perf_params(
    num_nodes: ArrayLike,
    num_replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_step_time: ArrayLike,
    optim_step_time: ArrayLike,
    *,
    num_restarts: int = 4,
    seed: int = 0,
) -> PerfParams:
    """Fits :class:`PerfParams` to measured step times (AdaptDL's fit).

    Args:
        num_nodes: int[N] nodes of each measured configuration, >= 1.
        num_replicas: int[N] replicas (GPUs) of each, >= 1.
        atomic_bsz: int[N] samples per replica per micro-step, > 0.
        accum_step_time: f[N] seconds of a step without the optimizer, > 0.
        optim_step_time: f[N] seconds of an optimizer step (with all-reduce), > 0.
        num_restarts: L-BFGS-B runs beyond AdaptDL's start; the lowest objective
            wins (0: AdaptDL's single run).
        seed: seeds the restarts' starting points.

    Returns:
        The fitted parameters (Python floats), the prior applied.

    Raises:
        ValueError: arrays of different lengths, empty, not finite, or out of range.
    """
    if num_restarts < 0:
        raise ValueError(f"num_restarts must be >= 0, got {num_restarts}")
    arrays = _measurements(
        num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time
    )
    nodes, replicas, atomic, accum_time, _ = arrays
    x0, lower, upper = _bounds(nodes, replicas, atomic, accum_time)
    bounds = scipy.optimize.Bounds(lower, upper, keep_feasible=True)
    with jax.enable_x64(True), _single_threaded_blas():
        data = tuple(jnp.asarray(a) for a in _padded(arrays))

        def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = jax.device_get(_value_and_grad(x, data))
            return float(value), np.asarray(grad, dtype=np.float64)

        starts = [x0]
        if num_restarts > 0:
            # Screen many starts cheaply, then polish the best few like AdaptDL.
            free = lower < upper
            screened, values = _screen(
                jnp.asarray(_screen_starts(x0, lower, 32, seed)),
                jnp.asarray(x0),
                jnp.asarray(lower),
                jnp.asarray(free),
                data,
            )
            values = np.where(np.isfinite(values), values, np.inf)
            for index in np.argsort(values)[:num_restarts]:
                starts.append(np.clip(np.asarray(screened[index]), lower, upper))
        best, best_value = x0, np.inf
        for start in starts:
            with warnings.catch_warnings():
                # L-BFGS-B may probe a step past a bound; scipy clips and warns.
                warnings.simplefilter("ignore", RuntimeWarning)
                result = scipy.optimize.minimize(
                    fun, start, jac=True, bounds=bounds, options=_OPTIONS
                )
            # Judge each run by what would be returned: after the prior.
            params = _with_prior(np.asarray(result.x, dtype=np.float64), nodes)
            value = fun(params)[0]
            if value < best_value:
                best, best_value = params, value
    params = best if np.isfinite(best_value) else _with_prior(x0.copy(), nodes)
    return PerfParams(*(float(v) for v in params))
