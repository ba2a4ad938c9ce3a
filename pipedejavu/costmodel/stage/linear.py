"""The linear stage-latency model, fit by relative least squares (JAX, jitted).

For each (submesh ``m``, config ``k``) slot the latency of the stage holding
layers ``i..j`` (inclusive, Alpa's indexing) is modelled as

    t(i..j, m, k) ~= intercept[m, k] + sum_{l=i..j} per_layer[l, m, k],

fit to the finite entries of ``problem.compute_cost`` by least squares on the
*relative* error ``(prediction - observed) / observed`` (rows weighted by
``1 / observed``), so one-layer and whole-model stages fit alike. Zero-second
entries carry no relative information and are left out.

The normal equations never materialize the design matrix: with row weights
``w[i, j] = 1 / c[i, j]^2`` the Gram entry of layers ``p <= q`` is the sum of
``w`` over the spans ``i <= p, j >= q``, a 2-D cumulative sum ``C[p, q]``; the
intercept column is ``C[l, l]`` and the right-hand side the same sums of
``1 / c``. So a slot costs ``O(L^2)`` memory and time whatever its number of
entries, and an ``(L + 1)``-square Cholesky solve (``jax.vmap`` over the
``M * K`` slots) finishes the fit; L = 512, M = 11, K = 2 takes about a second
on two CPU cores. A ridge of ``1e-8 * trace / (L + 1)`` keeps the Gram matrix
definite; two steps of iterative refinement then remove its bias, which lands on
the minimum-norm least-squares solution. A layer that no fitted entry covers gets
``per_layer = 0`` from the ridge; it is then set to the median ``per_layer`` of
the slot's covered layers, so predictions for spans over it stay finite.

The fit runs in float64 (under ``jax.enable_x64``, without touching the global
setting) and returns arrays of JAX's default float dtype: float32 unless x64 is
enabled globally.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import ArrayLike
from numpy.typing import NDArray

from pipedejavu.core.problem import Problem

__all__ = [
    "LinearStageModel",
    "fit_linear_model",
    "predict_spans",
    "predict_table",
]

#: A slot needs at least this many fitted entries to be ``usable``.
MIN_ENTRIES = 2
_RIDGE = 1e-8
_REFINEMENTS = 2
_fit_traces = 0  # incremented each time the jitted fit is traced (tests)


class LinearStageModel(NamedTuple):
    """The fitted model (a pytree); ``M`` submeshes, ``K`` configs, ``L`` layers.

    Attributes:
        intercept: f[M, K] seconds per stage on each slot.
        per_layer: f[L, M, K] seconds per layer on each slot.
        usable: bool[M, K] the slot had at least :data:`MIN_ENTRIES` fitted
            entries; unusable slots have zero parameters and predict ``inf``.
        relative_rms: f[M, K] root-mean-square of ``(prediction - observed) /
            observed`` over the slot's fitted entries (0 for unusable slots).
    """

    intercept: jax.Array
    per_layer: jax.Array
    usable: jax.Array
    relative_rms: jax.Array


def _fit_slot(
    weight: jax.Array, target: jax.Array, real_layers: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Solve one slot's weighted normal equations.

    Args:
        weight: f64[L, L] ``1 / c^2`` on fitted entries ``[i, j]``, else 0.
        target: f64[L, L] ``1 / c`` on fitted entries, else 0.
        real_layers: the layers before padding (sets the ridge).

    Returns:
        f64[L] per-layer seconds (uncovered layers: median of the covered ones)
        and f64[] intercept seconds.
    """
    num_layers = weight.shape[0]

    def spans_over(values: jax.Array) -> jax.Array:
        # C[p, q] = sum_{i <= p, j >= q} values[i, j]
        return jnp.cumsum(jnp.cumsum(values, axis=0)[:, ::-1], axis=1)[:, ::-1]

    cumulative = spans_over(weight)
    upper = jnp.triu(cumulative)  # Gram entry of layers p <= q is C[p, q]
    coverage = jnp.diagonal(cumulative)  # Gram entry (layer l, intercept)
    gram = jnp.concatenate(
        [
            jnp.concatenate([upper + jnp.triu(cumulative, 1).T, coverage[:, None]], 1),
            jnp.append(coverage, weight.sum())[None, :],
        ]
    )
    rhs = jnp.concatenate([jnp.diagonal(spans_over(target)), target.sum()[None]])
    trace = jnp.trace(gram)
    ridge = jnp.where(trace > 0, _RIDGE * trace / (real_layers + 1), 1.0)
    factor = jax.scipy.linalg.cho_factor(gram + ridge * jnp.eye(num_layers + 1))
    solution = jax.scipy.linalg.cho_solve(factor, rhs)
    for _ in range(_REFINEMENTS):
        solution = solution + jax.scipy.linalg.cho_solve(factor, rhs - gram @ solution)
    per_layer, intercept = solution[:-1], solution[-1]
    covered = coverage > 0
    median = jnp.nanmedian(jnp.where(covered, per_layer, jnp.nan))
    per_layer = jnp.where(covered, per_layer, jnp.where(covered.any(), median, 0.0))
    return per_layer, intercept


@functools.partial(jax.jit, static_argnames=("max_entries", "out_dtype"))
def _fit(
    cost: jax.Array,
    key: jax.Array,
    *,
    max_entries: int | None,
    out_dtype: type,
    real_layers: jax.Array,
) -> LinearStageModel:
    """The jitted fit; ``cost`` f64[Lp, Lp, M, K] seconds, inf = unprofiled,
    of which the first ``real_layers`` (traced) are the problem's layers."""
    global _fit_traces
    _fit_traces += 1
    num_layers, _, num_submeshes, num_configs = cost.shape
    slots = jnp.moveaxis(cost.reshape(num_layers, num_layers, -1), 2, 0)  # [S, L, L]
    upper = jnp.triu(jnp.ones((num_layers, num_layers), dtype=bool))
    fitted = jnp.isfinite(slots) & (slots > 0) & upper
    if max_entries is not None and max_entries < num_layers * (num_layers + 1) // 2:
        # Keep the max_entries fitted entries with the smallest uniform draws.
        draws = jnp.where(fitted, jr.uniform(key, slots.shape), 2.0)
        flat = draws.reshape(draws.shape[0], -1)
        threshold = jnp.sort(flat, axis=1)[:, max_entries - 1]
        fitted = fitted & (draws <= threshold[:, None, None])
    safe = jnp.where(fitted, slots, 1.0)
    inverse = jnp.where(fitted, 1.0 / safe, 0.0)
    per_layer, intercept = jax.vmap(_fit_slot, in_axes=(0, 0, None))(
        inverse**2, inverse, real_layers
    )  # [S, L], [S]
    count = fitted.sum(axis=(1, 2))
    usable = count >= MIN_ENTRIES
    prefix = jnp.concatenate(
        [jnp.zeros((per_layer.shape[0], 1)), jnp.cumsum(per_layer, axis=1)], axis=1
    )
    predicted = intercept[:, None, None] + prefix[:, None, 1:] - prefix[:, :-1, None]
    relative = jnp.where(fitted, (predicted - safe) / safe, 0.0)
    rms = jnp.sqrt((relative**2).sum(axis=(1, 2)) / jnp.maximum(count, 1))
    per_layer = jnp.where(usable[:, None], per_layer, 0.0)
    intercept = jnp.where(usable, intercept, 0.0)
    rms = jnp.where(usable, rms, 0.0)
    shape = (num_submeshes, num_configs)
    return LinearStageModel(
        intercept=intercept.reshape(shape).astype(out_dtype),
        per_layer=per_layer.T.reshape(num_layers, *shape).astype(out_dtype),
        usable=usable.reshape(shape),
        relative_rms=rms.reshape(shape).astype(out_dtype),
    )


def fit_linear_model(
    problem: Problem,
    *,
    max_entries_per_slot: int | None = None,
    key: jax.Array | None = None,
) -> LinearStageModel:
    """Fit the linear stage-latency model to ``problem.compute_cost``.

    Args:
        problem: the instance; its finite, positive entries are the data.
        max_entries_per_slot: fit each slot on at most this many of its entries,
            drawn uniformly with ``key`` (e.g. to predict unprofiled entries from
            a fraction of them). ``None``: all of them, which costs no more
            memory (the fit works on ``O(L^2)`` cumulative sums per slot).
        key: PRNG key for the draw; default ``jax.random.key(0)``.

    Returns:
        The :class:`LinearStageModel`, in JAX's default float dtype.

    Raises:
        ValueError: ``max_entries_per_slot`` is not a positive integer.

    Example:
        >>> model = fit_linear_model(problem)
        >>> predict_spans(model, jnp.array([0]), jnp.array([4]), 1, 0)  # layers 0..3
    """
    if max_entries_per_slot is not None and (
        isinstance(max_entries_per_slot, bool)
        or not isinstance(max_entries_per_slot, (int, np.integer))
        or max_entries_per_slot < 1
    ):
        raise ValueError(
            "max_entries_per_slot must be a positive integer or None, got "
            f"{max_entries_per_slot!r}"
        )
    if key is None:
        key = jr.key(0)
    out_dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    # Unprofiled padding layers (a layer count shared by similar sizes) let
    # problems of similar sizes share one compiled fit; they cover no entry, so
    # they change no fitted value and are cut off again.
    num_layers = problem.num_layers
    # (A subsample draws over the table's shape: left unpadded, it stays the
    # same draw for a given key.)
    padded = num_layers if max_entries_per_slot is not None else _bucket(num_layers)
    cost = np.full((padded, padded, *problem.compute_cost.shape[2:]), np.inf)
    cost[:num_layers, :num_layers] = problem.compute_cost
    with jax.enable_x64(True):
        model = _fit(
            jnp.asarray(cost, dtype=jnp.float64),
            key,
            max_entries=None
            if max_entries_per_slot is None
            else int(max_entries_per_slot),
            out_dtype=out_dtype,
            real_layers=num_layers,
        )
    return model._replace(per_layer=model.per_layer[:num_layers])


def _bucket(size: int) -> int:
    """The next of 4, 6, 8, 12, 16, 24, 32, 48, ... (at most 1.5x ``size``)."""
    padded = 4
    while padded < size:
        padded = padded * 3 // 2 if padded & (padded - 1) == 0 else padded * 4 // 3
    return padded


def predict_spans(
    model: LinearStageModel,
    starts: ArrayLike,
    stops: ArrayLike,
    submesh: ArrayLike,
    config: ArrayLike,
) -> jax.Array:
    """Predicted latency (s) of the stages holding layers ``start..stop-1``.

    Half-open ranges like :class:`~pipedejavu.core.problem.Stage`: the stage
    ``(start, stop)`` is the table entry ``[start, stop - 1]``. Pure JAX: works
    under ``jax.jit``/``jax.vmap`` and is differentiable in ``model.intercept`` and
    ``model.per_layer``.

    Args:
        model: a fitted :class:`LinearStageModel`.
        starts: int[...] first layer, ``0 <= start < stop``.
        stops: int[...] one past the last layer, ``<= L``.
        submesh: int[...] submesh index ``m``.
        config: int[...] config index ``k`` (all four broadcast together).

    Returns:
        f[...] seconds; ``inf`` for unusable slots. In float32 the prefix-sum
        difference loses about ``L * 6e-8`` relative on one-layer spans.
    """
    per_layer = model.per_layer
    prefix = jnp.concatenate(
        [jnp.zeros((1, *per_layer.shape[1:]), per_layer.dtype), per_layer.cumsum(0)]
    )
    starts, stops = jnp.asarray(starts), jnp.asarray(stops)
    value = (
        model.intercept[submesh, config]
        + prefix[stops, submesh, config]
        - prefix[starts, submesh, config]
    )
    return jnp.where(model.usable[submesh, config], value, jnp.inf)


def predict_table(model: LinearStageModel) -> NDArray[np.float64]:
    """The full predicted table, like ``compute_cost`` (inclusive indexing).

    Returns:
        f64[L, L, M, K] seconds; ``inf`` below the diagonal and on unusable slots.
    """
    per_layer = np.asarray(model.per_layer, dtype=np.float64)
    intercept = np.asarray(model.intercept, dtype=np.float64)
    num_layers = per_layer.shape[0]
    prefix = np.concatenate([np.zeros((1, *per_layer.shape[1:])), per_layer.cumsum(0)])
    table = intercept + prefix[None, 1:] - prefix[:-1, None]
    lower = np.tril(np.ones((num_layers, num_layers), dtype=bool), k=-1)
    table[lower] = np.inf
    table[:, :, ~np.asarray(model.usable)] = np.inf
    return table


def fit_linear_numpy(
    problem: Problem,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
    """The fit of :func:`fit_linear_model` (all entries) in NumPy, float64.

    The same normal equations, ridge, refinement and median fill; no JAX, so
    nothing is traced or compiled (a new process pays for neither: the
    engine's start-up uses this). It agrees with :func:`fit_linear_model` to
    rounding (LU instead of Cholesky on the same definite system).

    Returns:
        per_layer f64[L, M, K] seconds, intercept f64[M, K] seconds and
        usable bool[M, K] (unusable slots: zero parameters).
    """
    cost = problem.compute_cost
    num_layers, _, num_submeshes, num_configs = cost.shape
    slots = np.moveaxis(cost.reshape(num_layers, num_layers, -1), 2, 0)  # [S, L, L]
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    with np.errstate(invalid="ignore"):
        fitted = np.isfinite(slots) & (slots > 0) & upper
    inverse = np.where(fitted, 1.0 / np.where(fitted, slots, 1.0), 0.0)
    weight, target = inverse**2, inverse

    def spans_over(values: NDArray[np.float64]) -> NDArray[np.float64]:
        # C[s, p, q] = sum_{i <= p, j >= q} values[s, i, j]
        return np.cumsum(np.cumsum(values, axis=1)[:, :, ::-1], axis=2)[:, :, ::-1]

    cumulative = spans_over(weight)  # [S, L, L]
    coverage = np.diagonal(cumulative, axis1=1, axis2=2)  # [S, L]
    upper_part = np.triu(cumulative)
    size = num_layers + 1
    gram = np.zeros((slots.shape[0], size, size))
    gram[:, :-1, :-1] = upper_part + np.swapaxes(np.triu(cumulative, 1), 1, 2)
    gram[:, :-1, -1] = coverage
    gram[:, -1, :-1] = coverage
    gram[:, -1, -1] = weight.sum(axis=(1, 2))
    rhs = np.concatenate(
        [
            np.diagonal(spans_over(target), axis1=1, axis2=2),
            target.sum(axis=(1, 2))[:, None],
        ],
        axis=1,
    )[..., None]  # [S, L + 1, 1]
    trace = np.trace(gram, axis1=1, axis2=2)
    ridge = np.where(trace > 0, _RIDGE * trace / (num_layers + 1), 1.0)
    system = gram + ridge[:, None, None] * np.eye(size)
    solution = np.linalg.solve(system, rhs)
    for _ in range(_REFINEMENTS):
        solution = solution + np.linalg.solve(system, rhs - gram @ solution)
    solution = solution[..., 0]
    per_layer, intercept = solution[:, :-1], solution[:, -1]
    covered = coverage > 0
    filled = np.zeros(per_layer.shape[0])
    for slot in np.flatnonzero(covered.any(axis=1)):
        filled[slot] = np.median(per_layer[slot, covered[slot]])
    per_layer = np.where(covered, per_layer, filled[:, None])
    count = fitted.sum(axis=(1, 2))
    usable = count >= MIN_ENTRIES
    per_layer = np.where(usable[:, None], per_layer, 0.0)
    intercept = np.where(usable, intercept, 0.0)
    shape = (num_submeshes, num_configs)
    return (
        per_layer.T.reshape(num_layers, *shape),
        intercept.reshape(shape),
        usable.reshape(shape),
    )
