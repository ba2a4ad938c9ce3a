"""Predicting Alpa's memory limit ``max_n_succ_stages`` for unprofiled stages.

Alpa derives a stage's memory limit from four numbers of its profile
(:func:`pipedejavu.costmodel.stage_memory_stats`, all bytes per device)::

    max_n_succ_stages = floor((available - peak - initial) / intermediate) - 1

clipped to ``[-1, UNLIMITED_SUCCEEDING_STAGES]``: ``initial`` is the parameters and
optimizer state, ``peak`` the liveness peak of the forward + backward walk and
``intermediate`` the activations one in-flight micro-batch stashes.

The model here predicts those components, not the limit itself: for every
(submesh ``m``, config ``k``) slot it fits an additive per-layer model

    value(i..j, m, k) ~= intercept[m, k] + sum_{l=i..j} per_layer[l, m, k]

to ``peak``, ``initial`` and ``intermediate`` of the profiled stages by ordinary
least squares (the minimum-norm solution when the entries do not determine it;
a layer no fitted entry covers takes the median coefficient of the covered
ones), takes ``available`` as the median of the slot's records, and applies
Alpa's formula to the predictions. ``initial`` and ``intermediate`` are sums over
layers, so additive in truth; ``peak`` is not (it contains a maximum over the
layers' temporaries), and its error is the model's main one.

Arrays use Alpa's inclusive indexing ``[i, j, m, k]`` (layers ``i..j``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, Problem
from pipedejavu.costmodel.alpa.memory import stage_memory_stats
from pipedejavu.io.alpa_records import StageProfileResult

__all__ = [
    "MemoryModel",
    "MemoryStatsTable",
    "alpa_max_n_succ_stages",
    "fit_memory_model",
    "memory_stats_table",
    "predict_memory_stats",
    "synthetic_memory_stats",
]

COMPONENTS = ("peak", "initial", "intermediate")


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryStatsTable:
    """Alpa's per-stage memory statistics as tables; ``nan`` = no profile.

    Attributes:
        available: f64[L, L, M, K] bytes per device available when profiled.
        peak: f64[L, L, M, K] bytes, liveness peak of the stage's modules.
        initial: f64[L, L, M, K] bytes of parameters and optimizer state.
        intermediate: f64[L, L, M, K] bytes stashed per in-flight micro-batch.
    """

    available: NDArray[np.float64]
    peak: NDArray[np.float64]
    initial: NDArray[np.float64]
    intermediate: NDArray[np.float64]

    def __post_init__(self) -> None:
        shape = np.shape(self.available)
        if len(shape) != 4 or shape[0] != shape[1]:
            raise ValueError(
                f"available must have shape (L, L, M, K), got {tuple(shape)}"
            )
        for name in ("available", *COMPONENTS):
            value = np.asarray(getattr(self, name), dtype=np.float64)
            if value.shape != shape:
                raise ValueError(
                    f"{name} must have the shape of available {tuple(shape)}, got "
                    f"{tuple(value.shape)}"
                )
            value = value.copy()
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def profiled(self) -> NDArray[np.bool_]:
        """bool[L, L, M, K] entries with all four statistics."""
        return np.all(
            [np.isfinite(getattr(self, name)) for name in ("available", *COMPONENTS)],
            axis=0,
        )

    def max_n_succ_stages(self) -> NDArray[np.int64]:
        """Alpa's limit for every entry (``-1`` where not profiled)."""
        return alpa_max_n_succ_stages(
            self.available, self.peak, self.initial, self.intermediate
        )


def alpa_max_n_succ_stages(
    available: NDArray[np.float64],
    peak: NDArray[np.float64],
    initial: NDArray[np.float64],
    intermediate: NDArray[np.float64],
) -> NDArray[np.int64]:
    """Alpa's memory limit, elementwise (as in :func:`stage_memory_stats`).

    Args:
        available, peak, initial, intermediate: f64[...] bytes per device
            (broadcast together); ``nan`` marks an unknown entry.

    Returns:
        i64[...] ``floor((available - peak - initial) / max(intermediate, 1e-8)) -
        1`` clipped to ``[-1, UNLIMITED_SUCCEEDING_STAGES]``; ``-1`` where any
        input is ``nan``.
    """
    free = np.asarray(available, np.float64) - peak - initial
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        limit = np.floor_divide(free, np.maximum(intermediate, 1e-8)) - 1
    limit = np.where(np.isnan(limit), -1.0, limit)
    return np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)


def memory_stats_table(
    profile_results: Mapping[tuple[int, int, int, int], StageProfileResult],
    shape: tuple[int, int, int, int],
) -> MemoryStatsTable:
    """The memory statistics of every complete record of an Alpa stage profile.

    Args:
        profile_results: ``{(start, end_inclusive, submesh, config):
            StageProfileResult}`` as
            :func:`pipedejavu.costmodel.read_stage_profile` returns.
        shape: ``(L, L, M, K)`` of the tables, e.g. ``problem.compute_cost.shape``.

    Returns:
        The :class:`MemoryStatsTable`; incomplete records stay ``nan``.

    Raises:
        ValueError: a key outside ``shape``.
        ProblemError: an inconsistent record (from :func:`stage_memory_stats`).
    """
    tables = {name: np.full(shape, np.nan) for name in ("available", *COMPONENTS)}
    for key, record in profile_results.items():
        if any(not 0 <= index < size for index, size in zip(key, shape, strict=True)):
            raise ValueError(
                f"profile_results key {key} is outside the table shape {shape}"
            )
        if not record.fully_profiled:
            continue
        stats = stage_memory_stats([record], where=f"stage-profile record {key}")
        tables["available"][key] = stats.available_memory
        tables["peak"][key] = stats.peak_memory
        tables["initial"][key] = stats.initial_size
        tables["intermediate"][key] = stats.intermediate_size
    return MemoryStatsTable(**tables)


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryModel:
    """Additive per-layer models of the memory components, one per slot.

    Attributes:
        intercept: ``{component: f64[M, K] bytes}`` for peak/initial/intermediate.
        per_layer: ``{component: f64[L, M, K] bytes}``.
        available: f64[M, K] bytes per device (median of the slot's records).
        usable: bool[M, K] slots with at least one fitted record; the others
            predict ``nan`` (a limit of ``-1``).
    """

    intercept: dict[str, NDArray[np.float64]]
    per_layer: dict[str, NDArray[np.float64]]
    available: NDArray[np.float64]
    usable: NDArray[np.bool_]


def _span_design(starts: NDArray[np.int64], ends: NDArray[np.int64], num_layers: int):
    """f64[N, L + 1]: layer-membership columns, then the intercept column."""
    layers = np.arange(num_layers)
    inside = (layers >= starts[:, None]) & (layers <= ends[:, None])
    return np.concatenate([inside, np.ones((len(starts), 1))], axis=1).astype(float)


def fit_memory_model(
    stats: MemoryStatsTable, fitted: NDArray[np.bool_] | None = None
) -> MemoryModel:
    """Fit the additive memory components to the chosen profiled entries.

    Args:
        stats: the profiled statistics.
        fitted: bool[L, L, M, K] the entries to fit on (intersected with
            ``stats.profiled``); default all profiled entries.

    Returns:
        The fitted :class:`MemoryModel`.

    Raises:
        ValueError: ``fitted`` has the wrong shape.
    """
    shape = stats.available.shape
    profiled = stats.profiled
    if fitted is not None:
        fitted = np.asarray(fitted, dtype=bool)
        if fitted.shape != shape:
            raise ValueError(
                f"fitted must have shape {tuple(shape)}, got {tuple(fitted.shape)}"
            )
        profiled = profiled & fitted
    num_layers, _, num_submeshes, num_configs = shape
    intercept = {name: np.zeros(shape[2:]) for name in COMPONENTS}
    per_layer = {name: np.zeros((num_layers, *shape[2:])) for name in COMPONENTS}
    available = np.full(shape[2:], np.nan)
    usable = np.zeros(shape[2:], dtype=bool)
    for m in range(num_submeshes):
        for k in range(num_configs):
            starts, ends = np.nonzero(profiled[:, :, m, k])
            if starts.size == 0:
                continue
            usable[m, k] = True
            available[m, k] = np.median(stats.available[starts, ends, m, k])
            design = _span_design(starts, ends, num_layers)
            covered = design[:, :-1].any(axis=0)
            for name in COMPONENTS:
                target = getattr(stats, name)[starts, ends, m, k]
                solution = np.linalg.lstsq(design, target, rcond=None)[0]
                layer_part = solution[:-1]
                layer_part[~covered] = np.median(layer_part[covered])
                per_layer[name][:, m, k] = layer_part
                intercept[name][m, k] = solution[-1]
    return MemoryModel(intercept, per_layer, available, usable)


def predict_memory_stats(model: MemoryModel) -> MemoryStatsTable:
    """The predicted statistics of every stage (``nan`` on unusable slots and
    below the diagonal); apply :meth:`MemoryStatsTable.max_n_succ_stages`."""
    num_layers = model.per_layer["peak"].shape[0]
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    valid = upper[:, :, None, None] & model.usable[None, None]
    tables = {}
    for name in COMPONENTS:
        prefix = np.concatenate(
            [np.zeros((1, *model.usable.shape)), np.cumsum(model.per_layer[name], 0)]
        )
        table = model.intercept[name] + prefix[None, 1:] - prefix[:-1, None]
        tables[name] = np.where(valid, table, np.nan)
    available = np.broadcast_to(model.available, valid.shape)
    return MemoryStatsTable(available=np.where(valid, available, np.nan), **tables)


def synthetic_memory_stats(
    problem: Problem,
    *,
    tightness: float = 1.5,
    irregularity: float = 0.2,
    seed: int = 0,
) -> tuple[MemoryStatsTable, Problem]:
    """GPT-like memory statistics for a generated problem, and the problem with
    Alpa's limits from them (for tests and benchmarks of the memory model).

    Per layer ``l``: parameters ``p_l`` (the first layer, the embedding, weighs
    3, the last 1.5, blocks ``1 +- irregularity``) and activations ``a_l``
    (``0.25 +- irregularity / 4``), in units of 1e8 bytes. On a submesh of ``n``
    devices, config ``k`` divides parameters by ``n ** e_k`` and activations by
    ``n ** g_k`` (``e_k, g_k`` drawn in ``[0.5, 1]``). Then ``initial = 4 *
    sum p`` (weights, gradients, two Adam moments), ``intermediate = sum a``,
    ``peak = sum p + 2 * max a`` (not additive), and ``available = tightness *
    4 * sum_all p / D``.

    Args:
        problem: the instance; only its shapes are used, and entries with an
            ``inf`` cost stay unprofiled (``nan``).
        tightness: usable memory relative to the whole model's optimizer state
            spread over all ``D`` devices; around 1-2 makes memory bind.
        irregularity: spread of the per-layer sizes.
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        ``(stats, problem with max_n_succ_stages from stats)``.

    Raises:
        ValueError: ``tightness`` is not positive.
    """
    if not tightness > 0:
        raise ValueError(f"tightness must be > 0, got {tightness!r}")
    rng = np.random.default_rng(seed)
    num_layers, num_configs = problem.num_layers, problem.num_configs
    unit = 1e8
    params = 1.0 + irregularity * rng.uniform(-1, 1, num_layers)
    params[0] = 3.0
    if num_layers > 1:
        params[-1] = 1.5
    acts = 0.25 + irregularity / 4 * rng.uniform(-1, 1, num_layers)
    param_exponent = rng.uniform(0.5, 1.0, num_configs)
    act_exponent = rng.uniform(0.5, 1.0, num_configs)
    sizes = problem.submesh_sizes.astype(float)
    param_share = sizes[:, None] ** -param_exponent[None]  # [M, K]
    act_share = sizes[:, None] ** -act_exponent[None]
    starts, ends = np.triu_indices(num_layers)
    param_prefix = np.concatenate([[0.0], np.cumsum(params)])
    act_prefix = np.concatenate([[0.0], np.cumsum(acts)])
    span_params = (param_prefix[ends + 1] - param_prefix[starts])[:, None, None]
    span_acts = (act_prefix[ends + 1] - act_prefix[starts])[:, None, None]
    span_max_act = np.array(
        [acts[i : j + 1].max() for i, j in zip(starts, ends, strict=True)]
    )
    shape = problem.compute_cost.shape
    tables = {name: np.full(shape, np.nan) for name in ("available", *COMPONENTS)}
    tables["initial"][starts, ends] = 4 * unit * span_params * param_share
    tables["intermediate"][starts, ends] = unit * span_acts * act_share
    tables["peak"][starts, ends] = unit * (
        span_params * param_share + 2 * span_max_act[:, None, None] * act_share
    )
    tables["available"][starts, ends] = (
        tightness * 4 * unit * params.sum() / problem.num_devices
    )
    unprofiled = ~np.isfinite(problem.compute_cost)
    for table in tables.values():
        table[unprofiled] = np.nan
    stats = MemoryStatsTable(**tables)
    return stats, problem.replace(max_n_succ_stages=stats.max_n_succ_stages())
