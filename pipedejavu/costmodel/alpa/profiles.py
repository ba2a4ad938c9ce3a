"""Readers for Alpa's profiling outputs, and Alpa's stage tables built from them.

* ``prof_database.pkl`` -> :func:`read_prof_database`.
* ``profile-results-*.npy`` -> :func:`read_stage_profile` ->
  :func:`stage_profile_tables` (``compute_cost``, ``max_n_succ_stages``) ->
  :func:`problem_from_stage_profile` (a :class:`~pipedejavu.core.problem.Problem`).

The tables follow Alpa's ``interpret_profile_result_training_2d`` and its
liveness-based memory estimate (:mod:`pipedejavu.costmodel.alpa.memory`), with one
deliberate difference: Alpa crashes on a record whose module was never profiled,
we count it as unprofiled (``inf`` cost, ``-1`` stages) and warn once.

Keys use Alpa's inclusive layer indexing: ``(start, end, submesh, config)`` is the
stage holding layers ``start..end``, both included. Units: seconds and bytes.
The indices size the tables (``L * L * M * K`` entries), so they are bounded
(:data:`MAX_STAGE_TABLE_ENTRIES`) before anything is allocated.
"""

from __future__ import annotations

import importlib.resources
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.npzfile import MAX_NPZ_BYTES
from pipedejavu.core.problem import Problem, ProblemError, get_submesh_choices
from pipedejavu.costmodel.alpa.memory import checked_modules, is_int, stage_memory_stats
from pipedejavu.io.alpa_pickle import PathLike, load_alpa_npy, load_alpa_pickle
from pipedejavu.io.alpa_records import MeshProfilingResult, StageProfileResult

__all__ = [
    "BUNDLED",
    "MAX_STAGE_TABLE_ENTRIES",
    "prof_database_path",
    "problem_from_stage_profile",
    "read_prof_database",
    "read_stage_profile",
    "stage_profile_tables",
]

StageKey = tuple[int, int, int, int]
MeshKey = tuple[str, tuple[int, int]]

#: Most entries ``L * L * M * K`` of the stage tables built from a profile
#: (2**23: 64 MiB per table). Both tables (f64 and i64) then take half the
#: reading limit of a problem file (:data:`~pipedejavu.core.npzfile.MAX_NPZ_BYTES`),
#: so what ``pipedejavu convert`` writes reads back. Alpa compiles and runs every
#: stage it profiles, so real profiles are tiny (the bundled ones: L <= 12, 3
#: submeshes, 4 configs, 1,728 entries); a key past this is corrupt or hostile.
MAX_STAGE_TABLE_ENTRIES = MAX_NPZ_BYTES // 32


#: The name that stands for the ``prof_database.pkl`` shipped in
#: ``pipedejavu/data/`` (see its ``ATTRIBUTION.md``) wherever a path is taken.
BUNDLED = "bundled"


def prof_database_path(path: PathLike) -> PathLike:
    """``path``, or the bundled database's path for :data:`BUNDLED` (when no
    file of that name exists)."""
    if os.fspath(path) == BUNDLED and not os.path.exists(path):
        return Path(
            str(importlib.resources.files("pipedejavu").joinpath("data", _BUNDLED_PKL))
        )
    return path


_BUNDLED_PKL = "prof_database.pkl"


def read_prof_database(path: PathLike) -> dict[MeshKey, MeshProfilingResult]:
    """Read Alpa's mesh-profiling database (``prof_database.pkl``).

    Args:
        path: the pickle file, loaded with the restricted unpickler; or
            ``"bundled"`` for the one shipped with the package.

    Returns:
        ``{(cluster_key, (num_hosts, devices_per_host)): MeshProfilingResult}``,
        e.g. ``("default", (1, 4))``.

    Raises:
        UnsafePickleError: the file names a non-allowed global.
        ProblemError: unreadable, empty, or not a dict of that shape.
    """
    path = prof_database_path(path)
    data = load_alpa_pickle(path)
    if not isinstance(data, dict):
        raise ProblemError(
            f"{path} holds a {type(data).__name__}, not Alpa's profiling database "
            "(a dict of MeshProfilingResult)"
        )
    if not data:
        raise ProblemError(f"{path} is an empty profiling database (no mesh entries)")
    database: dict[MeshKey, MeshProfilingResult] = {}
    for key, value in data.items():
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and isinstance(key[0], str)
            and isinstance(key[1], tuple)
            and len(key[1]) == 2
            and all(is_int(x) and x >= 1 for x in key[1])
        ):
            raise ProblemError(
                f"{path}: database key must be (cluster_key, (num_hosts, "
                f"devices_per_host)), got {key!r}"
            )
        if not isinstance(value, MeshProfilingResult):
            raise ProblemError(
                f"{path}: entry {key!r} is a {type(value).__name__}, not a "
                "MeshProfilingResult"
            )
        memory = value.available_memory_per_device
        if memory is not None and not (is_int(memory) and memory > 0):
            raise ProblemError(
                f"{path}: entry {key!r} has available_memory_per_device {memory!r}, "
                "expected a positive number of bytes"
            )
        database[(key[0], (int(key[1][0]), int(key[1][1])))] = value
    return database


def _checked_records(records: Any, source: str) -> dict[StageKey, StageProfileResult]:
    """Validate ``{(start, end, submesh, config): StageProfileResult}``."""
    if not isinstance(records, Mapping):
        raise ProblemError(
            f"{source} must be a dict of stage-profile records, got "
            f"{type(records).__name__}"
        )
    checked: dict[StageKey, StageProfileResult] = {}
    for key, value in records.items():
        if not (isinstance(key, tuple) and len(key) == 4 and all(map(is_int, key))):
            raise ProblemError(
                f"{source}: a stage-profile key must be (start, end, submesh, "
                f"config) integers, got {key!r}"
            )
        start, end, submesh, config = (int(x) for x in key)
        if min(start, submesh, config) < 0 or start > end:
            raise ProblemError(
                f"{source}: stage-profile key {key!r} needs 0 <= start <= end "
                "(inclusive) and non-negative submesh and config indices"
            )
        if not isinstance(value, StageProfileResult):
            raise ProblemError(
                f"{source}: record {key!r} is a {type(value).__name__}, not a "
                "StageProfileResult"
            )
        checked[(start, end, submesh, config)] = value
    _check_table_size(_needed_sizes(checked), source, "its keys' largest indices")
    return checked


def _needed_sizes(records: Mapping[StageKey, Any]) -> tuple[int, int, int]:
    """``(L, M, K)``: the largest layer, submesh and config index + 1."""
    return tuple(  # type: ignore[return-value]
        max((key[axis] for key in records), default=-1) + 1 for axis in (1, 2, 3)
    )


def _check_table_size(sizes: Sequence[int], source: str, cause: str) -> None:
    """Refuse tables of more than :data:`MAX_STAGE_TABLE_ENTRIES` entries."""
    num_layers, num_submeshes, num_configs = sizes
    entries = num_layers * num_layers * num_submeshes * num_configs
    if entries > MAX_STAGE_TABLE_ENTRIES:
        raise ProblemError(
            f"{source}: {cause} make stage tables of L x L x M x K = {num_layers} "
            f"x {num_layers} x {num_submeshes} x {num_configs} = {entries} "
            f"entries, over the limit of {MAX_STAGE_TABLE_ENTRIES} (real Alpa "
            "profiles fill a few thousand)"
        )


def _table_sizes(
    records: Mapping[StageKey, Any],
    num_layers: int | None,
    num_submeshes: int | None,
    num_configs: int | None,
    source: str,
) -> tuple[int, int, int]:
    """``(L, M, K)`` of the tables: the sizes given (checked against the keys)
    or the keys' largest indices + 1, bounded by :data:`MAX_STAGE_TABLE_ENTRIES`."""
    needed = _needed_sizes(records)
    sizes = (
        _table_size("num_layers", num_layers, needed[0]),
        _table_size("num_submeshes", num_submeshes, needed[1]),
        _table_size("num_configs", num_configs, needed[2]),
    )
    _check_table_size(sizes, source, "the sizes and the keys' largest indices")
    return sizes


def read_stage_profile(path: PathLike) -> dict[StageKey, StageProfileResult]:
    """Read an Alpa stage-profile file (``profile-results-*.npy``).

    Args:
        path: the ``.npy`` file (a pickled dict in a 0-d object array).

    Returns:
        ``{(start, end_inclusive, submesh_index, config_index):
        StageProfileResult}`` with plain ``int`` keys.

    Raises:
        UnsafePickleError: the payload names a non-allowed global.
        ProblemError: unreadable, not an object ``.npy``, or bad keys/values.
    """
    data = load_alpa_npy(path).item()
    return _checked_records(data, str(path))


def _table_size(name: str, given: int | None, needed: int) -> int:
    if given is None:
        return needed
    if not is_int(given) or given < needed:
        raise ProblemError(
            f"{name} must be an integer >= {needed} (max index in the profile + 1), "
            f"got {given!r}"
        )
    return int(given)


def stage_profile_tables(
    profile_results: Mapping[StageKey, StageProfileResult],
    *,
    num_layers: int | None = None,
    num_submeshes: int | None = None,
    num_configs: int | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Alpa's DP tables from stage-profile records.

    Matches Alpa's ``interpret_profile_result_training_2d``, except that records
    with an unprofiled module count as unprofiled instead of crashing.

    Args:
        profile_results: ``{(start, end_inclusive, submesh, config):
            StageProfileResult}``.
        num_layers: L; default max layer index + 1.
        num_submeshes: M; default max submesh index + 1.
        num_configs: K; default max config index + 1.

    Returns:
        ``(compute_cost, max_n_succ_stages)``: f64[L, L, M, K] seconds per
        micro-batch, the sum of the module costs (forward + backward), ``inf``
        where no complete record exists; and i64[L, L, M, K] from
        :func:`stage_memory_stats` of the single record, ``-1`` where none.

    Raises:
        ProblemError: bad keys, an explicit size below what the keys need,
            tables of more than :data:`MAX_STAGE_TABLE_ENTRIES` entries, or an
            inconsistent record.

    Warns:
        UserWarning: once, counting records with an unprofiled module; they are
            treated as unprofiled.
    """
    records = _checked_records(profile_results, "profile_results")
    if not records and None in (num_layers, num_submeshes, num_configs):
        raise ProblemError(
            "profile_results is empty; pass num_layers, num_submeshes and "
            "num_configs to get all-unprofiled tables"
        )
    sizes = _table_sizes(
        records, num_layers, num_submeshes, num_configs, "profile_results"
    )
    shape = (sizes[0], *sizes)
    compute_cost = np.full(shape, np.inf, dtype=np.float64)
    max_n_succ_stages = np.full(shape, -1, dtype=np.int64)
    incomplete = 0
    for key, record in records.items():
        if not record.fully_profiled:
            incomplete += 1
            continue
        where = f"stage-profile record {key}"
        modules = checked_modules(record, where)
        compute_cost[key] = sum(module.compute_cost for module in modules)
        stats = stage_memory_stats([record], where=where)
        max_n_succ_stages[key] = stats.max_n_succ_stages
    if incomplete:
        warnings.warn(
            f"{incomplete} of {len(records)} stage-profile records are incomplete "
            "(a module was not profiled); they count as unprofiled (inf)",
            UserWarning,
            stacklevel=2,
        )
    return compute_cost, max_n_succ_stages


def problem_from_stage_profile(
    path_or_results: PathLike | Mapping[StageKey, StageProfileResult],
    *,
    cluster_shape: tuple[int, int],
    num_microbatches: int,
    submesh_space: str = "small_power_of_two",
    manual_submeshes: Sequence[tuple[int, int]] | None = None,
    num_layers: int | None = None,
    num_configs: int | None = None,
) -> Problem:
    """A :class:`~pipedejavu.core.problem.Problem` from an Alpa stage profile.

    Args:
        path_or_results: a ``profile-results-*.npy`` file, or records as
            returned by :func:`read_stage_profile`.
        cluster_shape: ``(num_hosts, devices_per_host)`` of the profiled cluster.
        num_microbatches: B, micro-batches per iteration (not stored in the file).
        submesh_space: Alpa's ``submesh_physical_shape_space`` of the run.
        manual_submeshes: the shapes, for ``submesh_space="manual"``.
        num_layers: L; default max layer index in the profile + 1.
        num_configs: K; default max config index in the profile + 1.

    Returns:
        The problem: ``submesh_shapes`` from ``get_submesh_choices`` (M of them),
        tables from :func:`stage_profile_tables`.

    Raises:
        ProblemError: the profile uses a submesh index outside the choices,
            tables of more than :data:`MAX_STAGE_TABLE_ENTRIES` entries, or any
            error of the readers.
    """
    if isinstance(path_or_results, Mapping):
        records = _checked_records(path_or_results, "path_or_results")
        source = "the stage profile"
    else:
        records = read_stage_profile(path_or_results)
        source = str(path_or_results)
    if not (
        isinstance(cluster_shape, Sequence)
        and len(cluster_shape) == 2
        and all(is_int(x) for x in cluster_shape)
    ):
        raise ProblemError(
            "cluster_shape must be (num_hosts, devices_per_host), got "
            f"{cluster_shape!r}"
        )
    num_hosts, devices_per_host = (int(x) for x in cluster_shape)
    choices = get_submesh_choices(
        num_hosts, devices_per_host, submesh_space, manual_submeshes
    )
    used = max((key[2] for key in records), default=-1)
    if used >= len(choices):
        raise ProblemError(
            f"{source} uses submesh index {used}, but the {submesh_space!r} submesh "
            f"space of a {num_hosts}x{devices_per_host} cluster has only "
            f"{len(choices)} choices {list(choices)}"
        )
    # Checked here too, so that the message names the file.
    _table_sizes(records, num_layers, len(choices), num_configs, source)
    compute_cost, max_n_succ_stages = stage_profile_tables(
        records,
        num_layers=num_layers,
        num_submeshes=len(choices),
        num_configs=num_configs,
    )
    return Problem(
        compute_cost=compute_cost,
        max_n_succ_stages=max_n_succ_stages,
        submesh_shapes=np.asarray(choices, dtype=np.int64),
        cluster_shape=(num_hosts, devices_per_host),
        num_microbatches=num_microbatches,
    )
