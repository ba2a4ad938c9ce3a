"""Collective-communication latency: alpha-beta fits to Alpa's ``prof_database.pkl``.

Alpa times each collective (all-gather, all-reduce, reduce-scatter, all-to-all) on
every replica-group pattern of every mesh, for ``f16`` and ``f32``, at ``size = 0``
and ``size = 2^i`` *elements* up to 4 GiB (``alpa/mesh_profiling.py``). The payload
in bytes is ``size * itemsize``: the whole gathered / reduced array per device (an
all-to-all's per-device buffer holds ``size / group_size`` elements). One curve per
``(cluster, mesh, collective, group shape, dtype)`` is fit with (:class:`AlphaBeta`)

    t(b) = max(floor, line(b))      [seconds; b bytes]

where ``line`` is the alpha-beta line ``alpha + beta * b`` or, where the data
demand it, two lines joined continuously (an intermediate one, then a
large-message one). Breakpoints are chosen by least squares on the *relative*
error ``(t_hat - t) / t``, because the times span six orders of magnitude: every
pair of cut points splits the sorted points into floor / intermediate / large
parts, each part is fit by weighted least squares, and the split whose whole model
has the lowest BIC wins (so the floor and the second line appear only when they
pay for their parameters; exact alpha-beta data give one line).

Which points are fitted: ``inf``/``nan`` times (failed profiling batches) are
skipped and counted; so are *no-op* points, where Alpa ran no collective at all
(size 0, or a per-device shard of zero elements: all-gather and reduce-scatter
below ``group_size`` elements, all-to-all below ``group_size^2``), and the
*artifacts* that Alpa's ``make_monotonic`` derived from them (it lowers each time
to ``size / best bandwidth so far``; a time clamped to the rate of a no-op point
measures nothing). Times clamped to a real measurement are kept and counted as
``clamped``. :mod:`costmodel.comm_plots` reports on the fits.

Downstream of the fit everything is plain JAX: :class:`CommModel` is a pytree,
:meth:`CommModel.predict` is jitted and differentiable in ``num_bytes``, and
:meth:`CommModel.predict_collective` covers group sizes the database lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from numpy.typing import NDArray

from .alpa_profiles import read_prof_database
from .alpa_types import MeshProfilingResult

__all__ = [
    "COLLECTIVES",
    "AlphaBeta",
    "CommFitConfig",
    "CommKey",
    "CommModel",
    "CommSeries",
    "DEFAULT_FIT",
    "Fallback",
    "GroupShape",
    "alpha_beta_time",
    "bandwidth_factor",
    "comm_series",
    "fit_alpha_beta",
    "fit_comm_model",
    "group_shape_of",
    "held_out_errors",
    "stack_series",
]

#: Collective names, in Alpa's field order (``<name>_cost_dict``).
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
#: Point kinds in :attr:`CommSeries.kind`.
USED, INVALID, NO_OP, ARTIFACT = 0, 1, 2, 3
_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s8": 1, "s32": 4, "u8": 1}
_RELATIVE_SSE_FLOOR = 1e-24  # an exact fit's relative SSE per point, for BIC
_CLAMP_RTOL = 1e-9


class GroupShape(NamedTuple):
    """What a replica-group pattern looks like, independent of device ids.

    Attributes:
        num_groups: groups running the collective at the same time.
        group_size: devices per group.
        crosses_hosts: a group spans more than one host (device ``i`` sits on
            host ``i // devices_per_host``).
        stride: device-id step inside a group (1: consecutive devices; 0 for
            one-device groups).
    """

    num_groups: int
    group_size: int
    crosses_hosts: bool
    stride: int


class CommKey(NamedTuple):
    """One fitted curve: ``mesh`` is ``(num_hosts, devices_per_host)``."""

    collective: str
    cluster: str
    mesh: tuple[int, int]
    group: GroupShape
    dtype: str


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


@dataclasses.dataclass(frozen=True)
class CommSeries:
    """The profiled points of one curve, sorted by size.

    Attributes:
        key: which curve.
        num_bytes: f64[N] payload bytes (``size * itemsize``).
        seconds: f64[N] Alpa's time per call (may hold ``inf``/``nan``).
        kind: i8[N] :data:`USED`, :data:`INVALID`, :data:`NO_OP` or
            :data:`ARTIFACT` (the latter two are fitted if ``drop_no_op`` is off).
        clamped: bool[N] the time was lowered by Alpa's ``make_monotonic`` to an
            earlier point's bandwidth.
        used: bool[N] the points the fit sees.
    """

    key: CommKey
    num_bytes: NDArray[np.float64]
    seconds: NDArray[np.float64]
    kind: NDArray[np.int8]
    clamped: NDArray[np.bool_]
    used: NDArray[np.bool_]


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of an XLA dtype string such as ``"f16"``."""
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    try:
        return np.dtype(dtype).itemsize
    except TypeError as error:
        raise ValueError(
            f"unknown dtype {dtype!r} in the profiling database"
        ) from error


def group_shape_of(
    replica_groups: Sequence[Sequence[int]], devices_per_host: int
) -> GroupShape:
    """Describe ``replica_groups`` (tuple of tuples of device ids) by its shape."""
    groups = [tuple(int(d) for d in group) for group in replica_groups]
    if not groups or not groups[0] or len({len(g) for g in groups}) != 1:
        raise ValueError(
            "replica_groups must be non-empty groups of one size, got "
            f"{replica_groups!r}"
        )
    first = groups[0]
    crosses = any(
        len({device // devices_per_host for device in group}) > 1 for group in groups
    )
    return GroupShape(
        num_groups=len(groups),
        group_size=len(first),
        crosses_hosts=crosses,
        stride=first[1] - first[0] if len(first) > 1 else 0,
    )


def _is_no_op(collective: str, size: float, group_size: int) -> bool:
    """Whether Alpa's profiler ran no collective at this size (empty shard)."""
    if collective == "all_to_all":
        return size < group_size**2
    if collective in ("all_gather", "reduce_scatter"):
        return size < group_size
    return size <= 0


def _classify(collective: str, sizes: NDArray, times: NDArray, group_size: int):
    """Kinds and clamped flags of one curve's points (sizes ascending)."""
    kind = np.full(sizes.shape, USED, dtype=np.int8)
    clamped = np.zeros(sizes.shape, dtype=bool)
    best, anchor = 0.0, -1  # make_monotonic's running max bandwidth, and its point
    for i, (size, time) in enumerate(zip(sizes, times, strict=True)):
        if not (np.isfinite(time) and time > 0):
            kind[i] = INVALID
        elif _is_no_op(collective, size, group_size):
            kind[i] = NO_OP
        bandwidth = size / time if np.isfinite(time) and time > 0 else 0.0
        if size > 0 and best > 0 and abs(bandwidth - best) <= _CLAMP_RTOL * best:
            clamped[i] = True
            if kind[i] == USED and kind[anchor] == NO_OP:
                kind[i] = ARTIFACT
        elif bandwidth > best:
            best, anchor = bandwidth, i
    return kind, clamped


def _database(prof_db: Any) -> Mapping[tuple[str, tuple[int, int]], Any]:
    if isinstance(prof_db, (str, os.PathLike)):
        return read_prof_database(prof_db)
    if not isinstance(prof_db, Mapping):
        raise ValueError(
            "prof_db must be a path or the dict from read_prof_database, got "
            f"{type(prof_db).__name__}"
        )
    return prof_db


def comm_series(
    prof_db: Any, *, config: CommFitConfig = DEFAULT_FIT
) -> list[CommSeries]:
    """All collective curves of a profiling database.

    Args:
        prof_db: a path to ``prof_database.pkl`` or the dict returned by
            :func:`~costmodel.read_prof_database`.
        config: which points count as used (``drop_no_op``).

    Returns:
        One :class:`CommSeries` per ``(cluster, mesh, collective, replica
        groups, dtype)``, in database order.
    """
    series = []
    for (cluster, mesh), result in _database(prof_db).items():
        if not isinstance(result, MeshProfilingResult):
            raise ValueError(
                f"prof_db[{(cluster, mesh)!r}] must be a MeshProfilingResult, got "
                f"{type(result).__name__}"
            )
        for collective in COLLECTIVES:
            for (groups, dtype), points in getattr(
                result, f"{collective}_cost_dict"
            ).items():
                group = group_shape_of(groups, mesh[1])
                data = np.array(points, dtype=np.float64).reshape(-1, 2)
                data = data[np.argsort(data[:, 0], kind="stable")]
                kind, clamped = _classify(
                    collective, data[:, 0], data[:, 1], group.group_size
                )
                fitted = (USED,) if config.drop_no_op else (USED, NO_OP, ARTIFACT)
                series.append(
                    CommSeries(
                        key=CommKey(collective, cluster, tuple(mesh), group, dtype),
                        num_bytes=data[:, 0] * dtype_itemsize(dtype),
                        seconds=data[:, 1],
                        kind=kind,
                        clamped=clamped,
                        used=np.isin(kind, fitted),
                    )
                )
    return series


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
        num_folds: k >= 2.
        config: fit settings.

    Returns:
        f64[F, N] held-out relative errors; ``nan`` off the mask (and where a
        training fold had too few points).
    """
    if isinstance(num_folds, bool) or not isinstance(num_folds, int) or num_folds < 2:
        raise ValueError(f"num_folds must be an integer >= 2, got {num_folds!r}")
    num_bytes, seconds, mask = _checked(num_bytes, seconds, mask, ndim=2)
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


def bandwidth_factor(collective: str, group_size: int) -> float:
    """Bytes each device sends per payload byte (Alpa's ring accounting).

    ``2 (g-1)/g`` for all-reduce, ``(g-1)/g`` for all-gather and reduce-scatter,
    ``(g-1)/g^2`` for all-to-all (its per-device buffer is ``1/g`` of the payload).
    """
    g = group_size
    factors = {
        "all_reduce": 2 * (g - 1) / g,
        "all_gather": (g - 1) / g,
        "reduce_scatter": (g - 1) / g,
        "all_to_all": (g - 1) / g**2,
    }
    return factors[collective]


@jax.jit
def _predict_row(params: AlphaBeta, index, num_bytes) -> jax.Array:
    return alpha_beta_time(AlphaBeta(*(p[index] for p in params)), num_bytes)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["keys"]
)
@dataclasses.dataclass(frozen=True)
class CommModel:
    """Fitted collective latencies: one :class:`AlphaBeta` row per curve.

    A pytree (``params`` are leaves, ``keys`` static), so a model can be passed
    through ``jax.jit``; :meth:`predict` is differentiable in ``num_bytes`` (and
    in ``params``).

    :meth:`fallback` reads only ``keys``, so :meth:`predict_collective` works
    under ``jax.jit`` with the model as an argument too.

    Attributes:
        keys: the F fitted curves.
        params: :class:`AlphaBeta` of f[F] arrays (JAX's default float dtype).
    """

    keys: tuple[CommKey, ...]
    params: AlphaBeta

    @classmethod
    def fit(cls, prof_db: Any, *, config: CommFitConfig = DEFAULT_FIT) -> CommModel:
        """Fit every curve of ``prof_db``; see :func:`fit_comm_model`."""
        return fit_comm_model(prof_db, config=config)

    def find(
        self,
        collective: str,
        mesh: Sequence[int] | None = None,
        group_shape: Sequence[Any] | None = None,
        dtype: str | None = None,
        *,
        cluster: str | None = None,
    ) -> list[int]:
        """Indices of the curves matching every given field.

        ``group_shape`` may be a :class:`GroupShape` or a prefix of its fields,
        e.g. ``(num_groups, group_size)``.
        """
        _check_collective(collective)
        shape = None if group_shape is None else tuple(group_shape)
        found = []
        for index, key in enumerate(self.keys):
            if key.collective != collective or (
                dtype is not None and key.dtype != dtype
            ):
                continue
            if mesh is not None and key.mesh != tuple(mesh):
                continue
            if cluster is not None and key.cluster != cluster:
                continue
            if shape is not None and tuple(key.group)[: len(shape)] != shape:
                continue
            found.append(index)
        return found

    def predict(
        self,
        collective: str,
        mesh: Sequence[int],
        group_shape: Sequence[Any],
        dtype: str,
        num_bytes: ArrayLike,
        *,
        cluster: str | None = None,
    ) -> jax.Array:
        """Seconds for ``num_bytes`` on one fitted curve (jitted, differentiable).

        Args:
            collective: one of :data:`COLLECTIVES`.
            mesh: ``(num_hosts, devices_per_host)``.
            group_shape: :class:`GroupShape` or a prefix of its fields that
                matches exactly one curve.
            dtype: e.g. ``"f16"``.
            num_bytes: f[...] payload bytes (``elements * itemsize``).
            cluster: Alpa's cluster key, if the database has several.

        Returns:
            f[...] seconds.

        Raises:
            ValueError: no curve or several curves match.
        """
        found = self.find(collective, mesh, group_shape, dtype, cluster=cluster)
        if len(found) != 1:
            options = sorted({tuple(self.keys[i].group) for i in found}) or sorted(
                {
                    (k.mesh, tuple(k.group))
                    for k in self.keys
                    if k.collective == collective
                }
            )
            raise ValueError(
                f"({collective!r}, mesh={mesh!r}, group_shape={group_shape!r}, "
                f"dtype={dtype!r}) must match exactly one fitted curve, got "
                f"{len(found)}; fitted (mesh and) group shapes: {options}"
            )
        return _predict_row(self.params, found[0], num_bytes)

    def fallback(
        self,
        collective: str,
        num_devices: int,
        *,
        crosses_hosts: bool | None = None,
        dtype: str = "f16",
        mesh: Sequence[int] | None = None,
    ) -> Fallback:
        """Which curves :meth:`predict_collective` mixes, and how.

        Rule. Start from the curves of ``collective`` (without the
        one-device curves, which time a local copy, when ``num_devices >= 2``
        and others exist); keep those on ``mesh``, then those with
        ``crosses_hosts``, then those of ``dtype``, each filter applied only if
        something passes it. Then:

        1. a curve of group size ``num_devices``: use it;
        2. else fitted sizes below and above: interpolate the predicted times
           geometrically in log(group size) between the nearest size below and
           the nearest above;
        3. else the nearest size ``g``, with the payload scaled by
           ``bandwidth_factor(num_devices) / bandwidth_factor(g)``.

        Among curves of one size, prefer the fewest concurrent groups, then the
        smaller mesh, then the smaller stride.

        Returns:
            a :class:`Fallback`.

        Raises:
            ValueError: bad arguments, or no curve of ``collective``.
        """
        _check_collective(collective)
        if isinstance(num_devices, bool) or not isinstance(num_devices, int):
            raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
        if num_devices < 1:
            raise ValueError(f"num_devices must be an int >= 1, got {num_devices}")
        pool = self.find(collective)
        if not pool:
            raise ValueError(f"no fitted curve for {collective!r}")
        filters = []
        if num_devices >= 2:
            filters.append(lambda k: k.group.group_size > 1)
        if mesh is not None:
            filters.append(lambda k: k.mesh == tuple(mesh))
        if crosses_hosts is not None:
            filters.append(lambda k: k.group.crosses_hosts == crosses_hosts)
        filters.append(lambda k: k.dtype == dtype)
        for keep in filters:
            pool = [i for i in pool if keep(self.keys[i])] or pool
        keys = self.keys

        def best(group_size: int) -> int:
            return min(
                (i for i in pool if keys[i].group.group_size == group_size),
                key=lambda i: (
                    keys[i].group.num_groups,
                    keys[i].mesh,
                    keys[i].group.stride,
                ),
            )

        sizes = {keys[i].group.group_size for i in pool}
        below = [g for g in sizes if g <= num_devices]
        above = [g for g in sizes if g >= num_devices]
        if below and above:
            low, high = max(below), min(above)
            weight = (
                math.log(num_devices / low) / math.log(high / low)
                if high > low
                else 0.0
            )
            return Fallback((best(low), best(high)), (1.0 - weight, weight), (1.0, 1.0))
        nearest = min(sizes, key=lambda g: (abs(math.log(g / num_devices)), -g))
        index, scale = best(nearest), 1.0
        if min(nearest, num_devices) >= 2:
            scale = bandwidth_factor(collective, num_devices) / bandwidth_factor(
                collective, nearest
            )
        return Fallback((index, index), (1.0, 0.0), (scale, scale))

    def predict_collective(
        self,
        collective: str,
        num_devices: int,
        num_bytes: ArrayLike,
        *,
        crosses_hosts: bool | None = None,
        dtype: str = "f16",
        mesh: Sequence[int] | None = None,
    ) -> jax.Array:
        """Seconds for a collective over ``num_devices``, from the nearest curves.

        For group shapes the database may lack; the rule is :meth:`fallback`'s.
        Jitted and differentiable in ``num_bytes``.

        Args:
            collective: one of :data:`COLLECTIVES`.
            num_devices: devices in the group.
            num_bytes: f[...] payload bytes.
            crosses_hosts: whether the group spans hosts (None: either).
            dtype: preferred curve dtype.
            mesh: preferred mesh ``(num_hosts, devices_per_host)``.

        Returns:
            f[...] seconds.
        """
        choice = self.fallback(
            collective, num_devices, crosses_hosts=crosses_hosts, dtype=dtype, mesh=mesh
        )
        return _predict_mix(self.params, *choice, num_bytes)


class Fallback(NamedTuple):
    """Two curves mixed geometrically: ``prod_i t_i(b * scales[i]) ** weights[i]``.

    ``indices`` into :attr:`CommModel.keys`; ``weights`` sum to 1.
    """

    indices: tuple[int, int]
    weights: tuple[float, float]
    scales: tuple[float, float]


@jax.jit
def _predict_mix(params: AlphaBeta, indices, weights, scales, num_bytes) -> jax.Array:
    num_bytes = jnp.asarray(num_bytes)
    log_time = 0.0
    for index, weight, scale in zip(indices, weights, scales, strict=True):
        row = AlphaBeta(*(p[index] for p in params))
        time = jnp.maximum(alpha_beta_time(row, num_bytes * scale), 1e-30)
        log_time = log_time + weight * jnp.log(time)
    return jnp.exp(log_time)


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def stack_series(
    series: Sequence[CommSeries],
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
    """Pad curves to one length: bytes f64[F, N], seconds f64[F, N], used bool[F, N]."""
    length = max((len(s.seconds) for s in series), default=1)
    num_bytes = np.zeros((len(series), length))
    seconds = np.ones((len(series), length))
    used = np.zeros((len(series), length), dtype=bool)
    for row, curve in enumerate(series):
        n = len(curve.seconds)
        num_bytes[row, :n] = curve.num_bytes
        seconds[row, :n] = np.where(curve.used, curve.seconds, 1.0)
        used[row, :n] = curve.used
    return num_bytes, seconds, used


def fit_comm_model(prof_db: Any, *, config: CommFitConfig = DEFAULT_FIT) -> CommModel:
    """Fit one :class:`AlphaBeta` curve per collective, mesh, group and dtype.

    Args:
        prof_db: a path to ``prof_database.pkl`` or the dict from
            :func:`~costmodel.read_prof_database`.
        config: fit settings.

    Returns:
        The :class:`CommModel` (parameters in JAX's default float dtype). Curves
        with no fit (fewer than 2 usable points, e.g. a failed profiling batch)
        are left out; :func:`~costmodel.comm_plots.comm_report` still lists them.

    Example:
        >>> model = fit_comm_model("prof_database.pkl")
        >>> model.predict("all_reduce", (1, 4), (1, 4), "f16", 2.0**20)
    """
    series = comm_series(prof_db, config=config)
    params, _ = fit_alpha_beta(*stack_series(series), config=config)
    fitted = np.isfinite(np.stack(params)).all(axis=0)
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    return CommModel(
        keys=tuple(s.key for s, ok in zip(series, fitted, strict=True) if ok),
        params=AlphaBeta(*(jnp.asarray(p[fitted], dtype=dtype) for p in params)),
    )
