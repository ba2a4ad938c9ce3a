"""Collective-communication latency: alpha-beta fits to Alpa's ``prof_database.pkl``.

:func:`fit_comm_model` reads every collective curve of a profiling database
(:mod:`pipedejavu.costmodel.alpa.comm_data`: which points count, :func:`comm_series`)
and fits each with ``t(b) = max(floor, line(b))`` seconds for ``b`` bytes,
``line`` one alpha-beta line or two joined continuously
(:mod:`pipedejavu.costmodel.alpa.comm_fit`: :class:`AlphaBeta`,
:func:`fit_alpha_beta`). The public names of both modules are re-exported here.

Downstream of the fit everything is plain JAX: :class:`CommModel` is a pytree,
:meth:`CommModel.predict` is jitted and differentiable in ``num_bytes``, and
:meth:`CommModel.predict_collective` covers group sizes the database lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from pipedejavu.costmodel.alpa.comm_data import (
    COLLECTIVES,
    CommKey,
    CommSeries,
    GroupShape,
    comm_series,
    group_shape_of,
    stack_series,
)
from pipedejavu.costmodel.alpa.comm_fit import (
    DEFAULT_FIT,
    AlphaBeta,
    CommFitConfig,
    alpha_beta_time,
    fit_alpha_beta,
    held_out_errors,
)

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


def fit_comm_model(prof_db: Any, *, config: CommFitConfig = DEFAULT_FIT) -> CommModel:
    """Fit one :class:`AlphaBeta` curve per collective, mesh, group and dtype.

    Args:
        prof_db: a path to ``prof_database.pkl``, ``"bundled"`` for the one
            shipped with the package, or the dict from
            :func:`~costmodel.read_prof_database`.
        config: fit settings.

    Returns:
        The :class:`CommModel` (parameters in JAX's default float dtype). Curves
        with no fit (fewer than 2 usable points, e.g. a failed profiling batch)
        are left out; :func:`~costmodel.comm_plots.comm_report` still lists them.

    Example:
        >>> model = fit_comm_model("bundled")  # or a path to prof_database.pkl
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
