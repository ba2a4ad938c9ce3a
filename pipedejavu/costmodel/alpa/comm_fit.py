"""Alpha-beta curves fit by least squares on the relative error.

A curve (:class:`AlphaBeta`) is

    t(b) = max(floor, line(b))      [seconds; b bytes]

where ``line`` is the alpha-beta line ``alpha + beta * b`` or, where the data
demand it, two lines joined continuously (an intermediate one, then a
large-message one). Breakpoints are chosen by least squares on the *relative*
error ``(t_hat - t) / t``, because the times span six orders of magnitude: every
pair of cut points splits the sorted points into floor / intermediate / large
parts, each part is fit by weighted least squares, and the split whose whole model
has the lowest BIC wins (so the floor and the second line appear only when they
pay for their parameters; exact alpha-beta data give one line).

:func:`fit_alpha_beta` fits a batch of curves in float64 under one jit;
:func:`held_out_errors` cross-validates it; :class:`CommFitConfig` holds the
settings. :func:`alpha_beta_time` is pure JAX and differentiable.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_FIT",
    "AlphaBeta",
    "CommFitConfig",
    "alpha_beta_time",
    "fit_alpha_beta",
    "held_out_errors",
]

_RELATIVE_SSE_FLOOR = 1e-24  # an exact fit's relative SSE per point, for BIC


@dataclasses.dataclass(frozen=True)
class CommFitConfig:
    """Static fit settings.

    Attributes:
        allow_floor: allow the latency floor.
        max_lines: 1 fits one line above the floor; 2 also tries a separate
            large-message line.
        min_floor_points: fewest points a floor may rest on (>= 1).
        min_line_points: fewest points the large-message line may rest on (>= 2).
        drop_no_op: skip no-op points and their ``make_monotonic`` artifacts.
    """

    allow_floor: bool = True
    max_lines: int = 2
    min_floor_points: int = 2
    min_line_points: int = 3
    drop_no_op: bool = True

    def __post_init__(self) -> None:
        for name, least in (("min_floor_points", 1), ("min_line_points", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.max_lines not in (1, 2):
            raise ValueError(f"max_lines must be 1 or 2, got {self.max_lines!r}")


#: The default fit settings.
DEFAULT_FIT = CommFitConfig()


class AlphaBeta(NamedTuple):
    """Fitted parameters (a pytree; arrays broadcast together).

    ``t(b) = max(floor, line(b))`` seconds for ``b`` bytes, where ``line`` joins
    the intermediate line ``alpha_mid + beta_mid * b`` and the large-message line
    ``alpha + beta * b`` continuously: their ``min`` if the large-message line is
    flatter (bandwidth still rising with size), else their ``max``. With a single
    line ``alpha_mid == alpha`` and ``beta_mid == beta``.

    Attributes:
        floor: seconds, the small-message latency floor (0: none).
        alpha: seconds, intercept of the large-message line (may be below
            ``floor``, even negative: it is an extrapolation to 0 bytes).
        beta: seconds per byte of the large-message line (1 / bandwidth).
        alpha_mid: seconds, intercept of the intermediate line.
        beta_mid: seconds per byte of the intermediate line.
    """

    floor: jax.Array
    alpha: jax.Array
    beta: jax.Array
    alpha_mid: jax.Array
    beta_mid: jax.Array


def alpha_beta_time(params: AlphaBeta, num_bytes: ArrayLike) -> jax.Array:
    """Seconds for ``num_bytes`` (see :class:`AlphaBeta`); pure JAX, differentiable."""
    large = params.alpha + params.beta * num_bytes
    mid = params.alpha_mid + params.beta_mid * num_bytes
    line = jnp.where(
        params.beta < params.beta_mid, jnp.minimum(mid, large), jnp.maximum(mid, large)
    )
    return jnp.maximum(params.floor, line)


def _segment_lines(sums: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted least-squares lines from ``[..., 5]`` sums of ``w^2 (1, x, x^2)``
    and ``w (1, x)``; returns intercept, slope and whether it is determined."""
    s0, s1, s2, r0, r1 = (sums[..., i] for i in range(5))
    det = s0 * s2 - s1**2
    ok = det > 1e-12 * jnp.maximum(s0 * s2, 1e-300)
    safe = jnp.where(ok, det, 1.0)
    return (s2 * r0 - s1 * r1) / safe, (s0 * r1 - s1 * r0) / safe, ok


def _fit_one(
    num_bytes: jax.Array, seconds: jax.Array, mask: jax.Array, *, config: CommFitConfig
) -> tuple[AlphaBeta, jax.Array]:
    """Fit one curve: f64[N] each, sorted by bytes. Returns params and regimes.

    Candidate ``(c1, c2)`` (indices into the sorted points) puts points
    ``< c1`` on the floor, ``c1 <= n < c2`` on the intermediate line and
    ``>= c2`` on the large-message line; each part is a weighted least-squares
    fit, and the candidate whose *whole* model has the lowest BIC of the
    relative errors wins.
    """
    size = num_bytes.shape[0]
    scale = jnp.max(jnp.where(mask, num_bytes, 0.0))
    scale = jnp.where(scale > 0, scale, 1.0)
    x = num_bytes / scale  # conditioning: x in [0, 1]
    t = jnp.where(mask, seconds, 1.0)
    w = jnp.where(mask, 1.0 / t, 0.0)  # relative error: residual * w
    quantities = jnp.stack([w**2, w**2 * x, w**2 * x**2, w, w * x], axis=1)  # [N, 5]
    cut = jnp.arange(size + 1)
    index = jnp.arange(size)
    # Direct segment sums (not prefix differences, which cancel catastrophically
    # when w spans 1e-1..1e5).
    middle = (cut[:, None, None] <= index) & (index < cut[None, :, None])
    tail = index >= cut[:, None]
    alpha_mid, beta_mid, ok_mid = _segment_lines(
        jnp.einsum("abn,nq->abq", middle.astype(x.dtype), quantities)
    )
    alpha_tail, beta_tail, ok_tail = _segment_lines(tail.astype(x.dtype) @ quantities)
    head = jnp.concatenate([jnp.zeros((1, 5), x.dtype), jnp.cumsum(quantities, 0)])
    count_head = jnp.concatenate([jnp.zeros(1, int), jnp.cumsum(mask)])
    count = count_head[-1]
    count_tail = count - count_head
    count_mid = count_head[None, :] - count_head[:, None]
    has_floor = count_head > 0
    floor = jnp.where(has_floor, head[:, 3] / jnp.where(has_floor, head[:, 0], 1.0), 0)
    has_tail = count_tail > 0

    alpha = jnp.where(has_tail[None, :], alpha_tail[None, :], alpha_mid)
    beta = jnp.where(has_tail[None, :], beta_tail[None, :], beta_mid)
    params = AlphaBeta(floor[:, None], alpha, beta, alpha_mid, beta_mid)
    predicted = alpha_beta_time(
        AlphaBeta(*(jnp.broadcast_to(p, alpha.shape)[..., None] for p in params)), x
    )
    sse = jnp.sum(jnp.where(mask, (predicted - t) * w, 0.0) ** 2, axis=-1)
    valid = (count_mid >= 2) & ok_mid & (beta_mid >= 0)
    floor_ok = (count_head >= config.min_floor_points) & config.allow_floor
    valid &= (~has_floor | floor_ok)[:, None]
    tail_ok = (count_tail >= config.min_line_points) & ok_tail & (beta_tail >= 0)
    valid &= (~has_tail | (tail_ok & (config.max_lines > 1)))[None, :]
    num_params = 2 + 2 * has_floor[:, None] + 3 * has_tail[None, :]
    n = jnp.maximum(count, 1)
    bic = n * jnp.log(sse / n + _RELATIVE_SSE_FLOOR) + num_params * jnp.log(n)
    bic = jnp.where(valid, bic, jnp.inf).ravel()
    best = jnp.argmin(bic)
    ok = jnp.isfinite(bic[best])
    fitted = AlphaBeta(
        *(
            jnp.where(ok, jnp.broadcast_to(p, alpha.shape).ravel()[best], jnp.nan)
            for p in params
        )
    )
    slope = 1.0 / scale  # back from x to bytes
    fitted = fitted._replace(beta=fitted.beta * slope, beta_mid=fitted.beta_mid * slope)
    regimes = jnp.where(ok, 1 + has_floor[best // (size + 1)], 0)
    regimes = regimes + jnp.where(ok, has_tail[best % (size + 1)], 0)
    return fitted, regimes


_BATCH = 8  # curves fit side by side (lax.map batch); batches are padded to it


@functools.partial(jax.jit, static_argnames=("config",))
def _fit_batch(num_bytes, seconds, mask, *, config):
    fit = functools.partial(_fit_one, config=config)
    return jax.lax.map(
        lambda args: fit(*args), (num_bytes, seconds, mask), batch_size=_BATCH
    )


def _padded(*arrays: np.ndarray) -> list[np.ndarray]:
    """Pad [F, N] arrays to F a multiple of :data:`_BATCH` (one compile per N)."""
    extra = -arrays[0].shape[0] % _BATCH
    return [np.pad(a, ((0, extra), (0, 0)), constant_values=a.flat[0]) for a in arrays]


def _sorted_rows(num_bytes, seconds, mask):
    order = np.argsort(np.where(mask, num_bytes, np.inf), axis=-1, kind="stable")
    take = functools.partial(np.take_along_axis, indices=order, axis=-1)
    return take(num_bytes), take(seconds), take(mask), order


def _checked(num_bytes, seconds, mask, ndim=None):
    num_bytes = np.asarray(num_bytes, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    mask = np.ones(seconds.shape, bool) if mask is None else np.asarray(mask, bool)
    if (
        not (num_bytes.shape == seconds.shape == mask.shape)
        or seconds.ndim < 1
        or (ndim is not None and seconds.ndim != ndim)
    ):
        want = "(..., N)" if ndim is None else "(F, N)"
        raise ValueError(
            f"num_bytes, seconds and mask must have one shape {want}, got "
            f"{num_bytes.shape}, {seconds.shape} and {mask.shape}"
        )
    mask = mask & np.isfinite(seconds) & (seconds > 0) & np.isfinite(num_bytes)
    mask &= num_bytes >= 0
    return num_bytes, np.where(mask, seconds, 1.0), mask


def fit_alpha_beta(
    num_bytes: ArrayLike,
    seconds: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    config: CommFitConfig = DEFAULT_FIT,
) -> tuple[AlphaBeta, NDArray[np.int64]]:
    """Fit :class:`AlphaBeta` curves by relative least squares, float64 under jit.

    Args:
        num_bytes: f[..., N] payload bytes (any order).
        seconds: f[..., N] measured times; non-finite or non-positive ones are
            ignored.
        mask: bool[..., N] points to fit (default: all valid ones).
        config: fit settings.

    Returns:
        ``(params, regimes)``: :class:`AlphaBeta` of f64[...] numpy arrays
        (``nan`` where no model could be fit, e.g. fewer than 2 points), and
        i64[...] the number of regimes used: 1 (a line), 2 (floor + line or two
        lines), 3 (floor + two lines); 0 if no fit.

    Raises:
        ValueError: mismatched shapes.
    """
    num_bytes, seconds, mask = _checked(num_bytes, seconds, mask)
    num_bytes, seconds, mask, _ = _sorted_rows(num_bytes, seconds, mask)
    batch, size = seconds.shape[:-1], seconds.shape[-1]
    flat = [a.reshape(-1, size) for a in (num_bytes, seconds, mask)]
    count = flat[0].shape[0]
    flat[2] = np.concatenate([flat[2], np.zeros((-count % _BATCH, size), bool)])
    with jax.enable_x64(True):
        params, regimes = _fit_batch(*_padded(*flat[:2]), flat[2], config=config)
        params = AlphaBeta(
            *(np.asarray(p, np.float64)[:count].reshape(batch) for p in params)
        )
    return params, np.asarray(regimes, np.int64)[:count].reshape(batch)


@functools.partial(jax.jit, static_argnames=("num_folds", "config"))
def _held_out_batch(num_bytes, seconds, mask, fold, *, num_folds, config):
    def one_fold(index):
        train = mask & (fold != index)
        params, _ = _fit_batch(num_bytes, seconds, train, config=config)
        row = AlphaBeta(*(p[:, None] for p in params))
        error = jnp.abs(alpha_beta_time(row, num_bytes) - seconds) / seconds
        return jnp.where(mask & (fold == index), error, 0.0)

    return jax.lax.map(one_fold, jnp.arange(num_folds)).sum(0)


def held_out_errors(
    num_bytes: ArrayLike,
    seconds: ArrayLike,
    mask: ArrayLike,
    *,
    num_folds: int = 5,
    config: CommFitConfig = DEFAULT_FIT,
) -> NDArray[np.float64]:
    """k-fold held-out relative errors ``|t_hat - t| / t`` of :func:`fit_alpha_beta`.

    Folds interleave by size: the i-th used point (ascending bytes) of a curve
    belongs to fold ``i % num_folds``, so each fold samples every regime and every
    point is predicted once by a fit that never saw it.

    Args:
        num_bytes: f[F, N] bytes; seconds: f[F, N]; mask: bool[F, N] used points.
        num_folds: k >= 2; capped at the most used points of any curve (a
            larger k assigns the same folds: leave-one-out).
        config: fit settings.

    Returns:
        f64[F, N] held-out relative errors; ``nan`` off the mask (and where a
        training fold had too few points).
    """
    if isinstance(num_folds, bool) or not isinstance(num_folds, int) or num_folds < 2:
        raise ValueError(f"num_folds must be an integer >= 2, got {num_folds!r}")
    num_bytes, seconds, mask = _checked(num_bytes, seconds, mask, ndim=2)
    # Folds past a curve's number of used points are empty: with k at least the
    # most points of any curve, every k assigns the same folds (leave-one-out).
    num_folds = max(2, min(num_folds, int(mask.sum(axis=1).max(initial=0))))
    num_bytes, seconds, mask, order = _sorted_rows(num_bytes, seconds, mask)
    fold = np.where(mask, (np.cumsum(mask, axis=1) - 1) % num_folds, -1)
    count = mask.shape[0]
    padded = _padded(num_bytes, seconds, mask & False, fold)
    padded[2][:count] = mask
    with jax.enable_x64(True):
        errors = _held_out_batch(*padded, num_folds=num_folds, config=config)
        errors = np.asarray(errors, dtype=np.float64)[:count]
        errors = np.where(mask, errors, np.nan)
    unsorted = np.empty_like(errors)
    np.put_along_axis(unsorted, order, errors, axis=1)
    return unsorted
