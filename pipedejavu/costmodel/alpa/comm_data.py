"""Collective timings from Alpa's ``prof_database.pkl``, one series per curve.

Alpa times each collective (all-gather, all-reduce, reduce-scatter, all-to-all) on
every replica-group pattern of every mesh, for ``f16`` and ``f32``, at ``size = 0``
and ``size = 2^i`` *elements* up to 4 GiB (``alpa/mesh_profiling.py``). The payload
in bytes is ``size * itemsize``: the whole gathered / reduced array per device (an
all-to-all's per-device buffer holds ``size / group_size`` elements). Each
``(cluster, mesh, collective, group shape, dtype)`` (a :class:`CommKey`, its
replica groups described by a :class:`GroupShape`) gives one :class:`CommSeries`,
the points that :mod:`pipedejavu.costmodel.alpa.comm_fit` fits one curve to.

Which points are fitted: ``inf``/``nan`` times (failed profiling batches) are
skipped and counted; so are *no-op* points, where Alpa ran no collective at all
(size 0, or a per-device shard of zero elements: all-gather and reduce-scatter
below ``group_size`` elements, all-to-all below ``group_size^2``), and the
*artifacts* that Alpa's ``make_monotonic`` derived from them (it lowers each time
to ``size / best bandwidth so far``; a time clamped to the rate of a no-op point
measures nothing). Times clamped to a real measurement are kept and counted as
``clamped``. :mod:`pipedejavu.costmodel.alpa.comm_plots` reports on the fits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.costmodel.alpa.comm_fit import DEFAULT_FIT, CommFitConfig
from pipedejavu.costmodel.alpa.profiles import read_prof_database
from pipedejavu.io.alpa_records import MeshProfilingResult

__all__ = [
    "ARTIFACT",
    "COLLECTIVES",
    "INVALID",
    "NO_OP",
    "USED",
    "CommKey",
    "CommSeries",
    "GroupShape",
    "comm_series",
    "dtype_itemsize",
    "group_shape_of",
    "stack_series",
]

#: Collective names, in Alpa's field order (``<name>_cost_dict``).
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
#: Point kinds in :attr:`CommSeries.kind`.
USED, INVALID, NO_OP, ARTIFACT = 0, 1, 2, 3
_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s8": 1, "s32": 4, "u8": 1}
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
