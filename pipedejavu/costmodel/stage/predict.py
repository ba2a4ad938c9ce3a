"""Predicting unprofiled stage costs and memory limits from a fraction of a
profile (pipeDejavu's "predictive model saving pre-profiling time").

For a problem whose finite entries are the stages Alpa profiled:

1. **Profile a fraction.** :func:`profile_subset` draws, in every (submesh ``m``,
   config ``k``) slot, ``ceil(fraction * n)`` of the slot's ``n`` profiled entries
   (at least ``min(n, min_per_slot)``), each with probability proportional to
   ``1 / stage length`` (or uniformly; :class:`SubsetConfig`), then, while the
   drawn spans leave the slot's additive model less determined than all its
   profiled spans do (a layer no drawn span covers, two layers always drawn
   together, the intercept not separable), adds the shortest profiled entry that
   removes such a freedom (random tie-break). The effective fraction is
   reported; it exceeds the requested one on small profiles.
2. **Predict.** :func:`predict_stage_costs` fits the additive linear model of
   :mod:`pipedejavu.costmodel.stage.linear` to the drawn entries and predicts every
   entry, and fits the memory model of :mod:`pipedejavu.costmodel.stage.memory_model`
   to their memory statistics to predict Alpa's ``max_n_succ_stages``. Held-out
   error: MAPE over the profiled entries that were not drawn; memory
   disagreement: how often ``predicted limit >= 0`` differs from Alpa's on them.
3. **The planner's view.** :func:`planning_problem`: measured values on the
   drawn entries, predictions elsewhere. Which entries exist (``support``)?
   ``"profiled"`` (default): only the stages the true table has finite, i.e.
   the candidate stages Alpa's profiler ran successfully; what is saved is their
   measurement, not their existence. ``"all"``: every stage of every fitted
   slot, those Alpa never enumerated or failed to profile included, filtered by
   the *predicted* memory limit only. With no memory statistics (a bare
   :class:`~pipedejavu.core.problem.Problem`) the problem's own ``max_n_succ_stages``
   stands in for the memory model.

Plan regret on the true table: :mod:`pipedejavu.planning.predict_regret`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import Problem
from pipedejavu.costmodel.stage.linear import fit_linear_model, predict_table
from pipedejavu.costmodel.stage.memory_model import (
    MemoryStatsTable,
    fit_memory_model,
    predict_memory_stats,
)

__all__ = [
    "PredictionResult",
    "SubsetConfig",
    "planning_problem",
    "predict_stage_costs",
    "profile_subset",
]

SUPPORTS = ("profiled", "all")
DESIGNS = ("short", "uniform")


def _check_fraction(fraction: Any) -> float:
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, numbers.Real)
        or not 0 < fraction <= 1
    ):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


@dataclasses.dataclass(frozen=True)
class SubsetConfig:
    """How :func:`profile_subset` chooses the entries to profile.

    Attributes:
        design: ``"short"`` (default) draws each entry with probability
            proportional to ``1 / (number of layers)``: short stages pin the
            per-layer coefficients best and are the cheapest to profile;
            ``"uniform"`` draws every entry alike.
        min_per_slot: each slot keeps at least ``min(n, min_per_slot)`` entries
            (2, the least :func:`pipedejavu.costmodel.stage.linear.fit_linear_model`
            fits a slot on).
        complete_rank: add entries until the draw determines each slot's
            additive model as well as all its entries do; ``False`` keeps the
            plain draw (the fit is then the minimum-norm one).

    Raises:
        ValueError: an unknown design, a non-positive ``min_per_slot`` or a
            non-bool ``complete_rank``.
    """

    design: str = "short"
    min_per_slot: int = 2
    complete_rank: bool = True

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"design must be one of {DESIGNS}, got {self.design!r}")
        value = self.min_per_slot
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or value < 1
        ):
            raise ValueError(f"min_per_slot must be a positive integer, got {value!r}")
        if not isinstance(self.complete_rank, bool):
            raise ValueError(
                f"complete_rank must be a bool, got {self.complete_rank!r}"
            )


def profile_subset(
    profiled: NDArray[np.bool_],
    fraction: float,
    *,
    seed: int,
    config: SubsetConfig | None = None,
) -> NDArray[np.bool_]:
    """Choose the entries to "profile": a per-slot random draw, completed so the
    drawn spans determine the additive model (see the module docstring).

    Args:
        profiled: bool[L, L, M, K] the entries that can be drawn (finite costs).
        fraction: share of each slot's entries to draw, in ``(0, 1]``.
        seed: seed of ``numpy.random.default_rng`` (same seed, same subset).
        config: the :class:`SubsetConfig`; default ``SubsetConfig()``.

    Returns:
        bool[L, L, M, K] the drawn entries, a subset of ``profiled``.

    Raises:
        ValueError: bad ``fraction``, ``seed``, ``config`` or shape.
    """
    fraction = _check_fraction(fraction)
    rng = np.random.default_rng(_check_seed(seed))
    if config is None:
        config = SubsetConfig()
    if not isinstance(config, SubsetConfig):
        raise ValueError(f"config must be a SubsetConfig, got {config!r}")
    profiled = np.asarray(profiled, dtype=bool)
    if profiled.ndim != 4 or profiled.shape[0] != profiled.shape[1]:
        raise ValueError(
            f"profiled must have shape (L, L, M, K), got {tuple(profiled.shape)}"
        )
    num_layers = profiled.shape[0]
    chosen = np.zeros_like(profiled)
    for m in range(profiled.shape[2]):
        for k in range(profiled.shape[3]):
            starts, ends = np.nonzero(profiled[:, :, m, k])
            count = starts.size
            if count == 0:
                continue
            take = min(
                count, max(config.min_per_slot, math.ceil(fraction * count - 1e-9))
            )
            weight = 1.0 / (ends - starts + 1)
            if config.design == "uniform":
                weight = np.ones(count)
            picked = np.zeros(count, dtype=bool)
            drawn = rng.choice(count, size=take, replace=False, p=weight / weight.sum())
            picked[drawn] = True
            if config.complete_rank:
                _complete_rank(picked, starts, ends, num_layers, rng)
            chosen[starts[picked], ends[picked], m, k] = True
    return chosen


def _complete_rank(
    picked: NDArray[np.bool_],
    starts: NDArray[np.int64],
    ends: NDArray[np.int64],
    num_layers: int,
    rng: np.random.Generator,
) -> None:
    """Add entries to ``picked`` (in place) until the drawn spans determine the
    additive model as well as all of the slot's spans do.

    The design row of span ``i..j`` is its layer indicator plus an intercept 1.
    While some candidate row is not in the span of the drawn rows, the shortest
    such candidate (random tie-break) is added; this covers every layer,
    separates layers that the drawn spans only hold together, and separates the
    intercept from the layers.
    """
    layers = np.arange(num_layers)
    design = np.concatenate(
        [
            (starts[:, None] <= layers) & (layers <= ends[:, None]),
            np.ones((len(starts), 1)),
        ],
        axis=1,
    ).astype(np.float64)
    basis = np.linalg.svd(design[picked], full_matrices=False)
    keep = basis[1] > 1e-9 * basis[1].max()
    orthonormal = basis[2][keep]  # [r, L + 1] rows spanning the drawn rows
    lengths = ends - starts
    while True:
        residual = design - (design @ orthonormal.T) @ orthonormal
        norms = np.linalg.norm(residual, axis=1)
        options = np.nonzero(norms > 1e-6)[0]
        if options.size == 0:
            return
        shortest = options[lengths[options] == lengths[options].min()]
        added = rng.choice(shortest)
        picked[added] = True
        orthonormal = np.vstack([orthonormal, residual[added] / norms[added]])


@dataclasses.dataclass(frozen=True, eq=False)
class PredictionResult:
    """The predicted tables of one draw, and their held-out errors.

    Attributes:
        fraction: requested share of profiled entries.
        seed: the draw's seed.
        sampled: bool[L, L, M, K] the drawn ("profiled") entries.
        predicted_cost: f64[L, L, M, K] seconds, the linear model everywhere
            (``inf`` below the diagonal and on slots it could not fit).
        predicted_max_n_succ: i64[L, L, M, K] Alpa's limit from the predicted
            memory statistics, or ``None`` without memory statistics.
        num_profiled: finite entries of the true table.
        num_sampled: drawn entries.
        num_held_out: profiled entries not drawn with a finite prediction.
        held_out_mape: mean ``|predicted / true - 1|`` over them (``nan`` if none).
        held_out_max_ape: the largest such error (``nan`` if none).
        fit_max_relative_error: largest ``|predicted / measured - 1|`` on the drawn
            entries (the fit's residual).
        num_memory_held_out: held-out entries with memory statistics.
        memory_disagreement: share of them where ``predicted limit >= 0``
            differs from Alpa's (``nan`` if none or no memory model).
        memory_limit_match: share whose limit, capped at ``min(L, D) - 1``,
            equals Alpa's exactly (``nan`` likewise).
    """

    fraction: float
    seed: int
    sampled: NDArray[np.bool_]
    predicted_cost: NDArray[np.float64]
    predicted_max_n_succ: NDArray[np.int64] | None
    num_profiled: int
    num_sampled: int
    num_held_out: int
    held_out_mape: float
    held_out_max_ape: float
    fit_max_relative_error: float
    num_memory_held_out: int
    memory_disagreement: float
    memory_limit_match: float

    @property
    def effective_fraction(self) -> float:
        """Drawn share of the profiled entries (>= ``fraction`` on small slots)."""
        return self.num_sampled / max(self.num_profiled, 1)

    def to_json(self) -> dict[str, Any]:
        """The scalar fields, JSON-able (``nan`` -> ``None``)."""
        out: dict[str, Any] = {"effective_fraction": self.effective_fraction}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (int, float)):
                out[field.name] = _json_number(value)
        return out


def _json_number(value: float | int | None) -> float | int | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value


def _check_inputs(problem: Problem, memory_stats: MemoryStatsTable | None) -> None:
    if not isinstance(problem, Problem):
        raise ValueError(f"problem must be a Problem, got {type(problem).__name__}")
    if memory_stats is not None:
        if not isinstance(memory_stats, MemoryStatsTable):
            raise ValueError(
                "memory_stats must be a MemoryStatsTable or None, got "
                f"{type(memory_stats).__name__}"
            )
        if memory_stats.available.shape != problem.compute_cost.shape:
            raise ValueError(
                "memory_stats must have the table shape "
                f"{problem.compute_cost.shape}, got {memory_stats.available.shape}"
            )


def predict_stage_costs(
    problem: Problem,
    fraction: float,
    *,
    seed: int,
    memory_stats: MemoryStatsTable | None = None,
    config: SubsetConfig | None = None,
) -> PredictionResult:
    """Fit the cost (and memory) model to a drawn fraction and predict every entry.

    Args:
        problem: the true instance; its finite entries are "what Alpa profiled".
        fraction: share of them to draw, in ``(0, 1]`` (see :func:`profile_subset`).
        seed: seed of the draw.
        memory_stats: the profiled memory statistics (e.g.
            :func:`pipedejavu.costmodel.stage.memory_model.memory_stats_table`);
            ``None``: no
            memory model.
        config: how the entries are drawn (:class:`SubsetConfig`; default
            ``SubsetConfig()``).

    Returns:
        The :class:`PredictionResult`.

    Raises:
        ValueError: bad arguments.
    """
    _check_inputs(problem, memory_stats)
    cost = problem.compute_cost
    profiled = np.isfinite(cost)
    sampled = profile_subset(profiled, fraction, seed=seed, config=config)
    with jax.enable_x64(True):
        model = fit_linear_model(
            problem.replace(compute_cost=np.where(sampled, cost, np.inf))
        )
    predicted = predict_table(model)
    with np.errstate(divide="ignore", invalid="ignore"):
        error = np.abs(predicted / cost - 1)
    positive = profiled & (cost > 0) & np.isfinite(predicted)
    held_out = positive & ~sampled
    fit_errors = error[positive & sampled]
    held_errors = error[held_out]

    predicted_limit = None
    num_memory = 0
    disagreement = match = math.nan
    if memory_stats is not None:
        memory_model = fit_memory_model(memory_stats, sampled)
        predicted_limit = predict_memory_stats(memory_model).max_n_succ_stages()
        memory_held_out = profiled & ~sampled & memory_stats.profiled
        num_memory = int(memory_held_out.sum())
        if num_memory:
            true_limit = problem.max_n_succ_stages[memory_held_out]
            guess = predicted_limit[memory_held_out]
            disagreement = float(np.mean((guess >= 0) != (true_limit >= 0)))
            cap = min(problem.num_layers, problem.num_devices) - 1
            match = float(
                np.mean(np.minimum(guess, cap) == np.minimum(true_limit, cap))
            )
    return PredictionResult(
        fraction=float(fraction),
        seed=int(seed),
        sampled=sampled,
        predicted_cost=predicted,
        predicted_max_n_succ=predicted_limit,
        num_profiled=int(profiled.sum()),
        num_sampled=int(sampled.sum()),
        num_held_out=int(held_out.sum()),
        held_out_mape=float(held_errors.mean()) if held_errors.size else math.nan,
        held_out_max_ape=float(held_errors.max()) if held_errors.size else math.nan,
        fit_max_relative_error=float(fit_errors.max()) if fit_errors.size else 0.0,
        num_memory_held_out=num_memory,
        memory_disagreement=disagreement,
        memory_limit_match=match,
    )


def planning_problem(
    problem: Problem, prediction: PredictionResult, *, support: str = "profiled"
) -> Problem:
    """The instance a planner sees after profiling only ``prediction.sampled``.

    Drawn entries keep their measured cost and Alpa's limit; the others get the
    predicted cost (clipped at 0 s) and the predicted limit (the problem's own
    limit when there is no memory model). ``support`` says which entries exist
    (see the module docstring).

    Raises:
        ValueError: unknown ``support``.
    """
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")
    sampled = prediction.sampled
    cost = problem.compute_cost
    exists = np.isfinite(cost) if support == "profiled" else np.ones_like(sampled)
    guess = np.where(exists, np.maximum(prediction.predicted_cost, 0.0), np.inf)
    plan_cost = np.where(sampled, cost, guess)
    limit = problem.max_n_succ_stages
    if prediction.predicted_max_n_succ is not None:
        limit = np.where(sampled, limit, prediction.predicted_max_n_succ)
    return problem.replace(compute_cost=plan_cost, max_n_succ_stages=limit)
