"""Plan regret of planning on predicted stage costs, and its report.

:func:`plan_regret` draws a fraction of the profiled entries
(:func:`pipedejavu.costmodel.stage.predict.predict_stage_costs`), solves the planner's
view of the problem (:func:`pipedejavu.costmodel.stage.predict.planning_problem`)
exactly with
:func:`pipedejavu.search.alpa.exact.exact_dp`, re-evaluates that plan on the true table
and
compares it with the true optimum: ``regret = cost_on_true / optimum - 1``. A
plan that uses a stage the true table has as ``inf``, or breaks a true memory
limit, is a *failure*: counted, never folded into the regret. A true problem
without a plan (e.g. every profiled stage over Alpa's memory limit) is reported
as such, with the prediction errors still measured.

Refinement (``refine=True``): profile the plan's predicted stages, put their
measured values in, and re-plan, until the plan uses measured stages only. It
costs a few profiles per round (reported) and the final plan cannot fail.

:func:`predictor_report` runs fractions x seeds on one instance (a problem, an
Alpa stage-profile file or its records) and returns a JSON-able dict;
:func:`format_predictor_report` renders it as text.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import (
    InfeasibleProblemError,
    Plan,
    PlanError,
    Problem,
    evaluate,
)
from pipedejavu.costmodel.alpa.profiles import (
    problem_from_stage_profile,
    read_stage_profile,
)
from pipedejavu.costmodel.stage.memory_model import MemoryStatsTable, memory_stats_table
from pipedejavu.costmodel.stage.predict import (
    SUPPORTS,
    PredictionResult,
    SubsetConfig,
    planning_problem,
    predict_stage_costs,
)
from pipedejavu.search.alpa.exact import exact_dp

__all__ = [
    "RegretResult",
    "format_predictor_report",
    "load_instance",
    "plan_regret",
    "predictor_report",
    "true_optimum",
]


@dataclasses.dataclass(frozen=True)
class RegretResult:
    """One draw's plan on predicted costs, scored on the true table.

    Attributes:
        prediction: the draw's :class:`PredictionResult` (scalars in JSON).
        support: ``"profiled"`` or ``"all"``.
        status: ``"ok"``; ``"true-infeasible"`` (the true problem has no plan,
            so no regret); ``"no-plan"`` (the planning problem has none);
            ``"failed-profiled"`` (the plan uses a stage that is ``inf`` in the
            true table) or ``"failed-memory"`` (it breaks a true memory limit).
        optimum: the true optimum (s per iteration), ``None`` if infeasible.
        plan_cost: the plan's objective on the true table, ``None`` unless ok.
        regret: ``plan_cost / optimum - 1``, ``None`` unless ok.
        detail: why, for statuses other than ok.
        stages: the plan's ``(start, stop, submesh, config)`` (half-open).
        num_refined: entries measured by refinement beyond the draw (0 without).
        refine_rounds: plans solved by refinement (0 without).
    """

    prediction: PredictionResult
    support: str
    status: str
    optimum: float | None
    plan_cost: float | None
    regret: float | None
    detail: str
    stages: tuple[tuple[int, int, int, int], ...]
    num_refined: int = 0
    refine_rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary (the prediction's scalars inlined)."""
        out = self.prediction.to_json()
        for field in dataclasses.fields(self):
            if field.name != "prediction":
                out[field.name] = getattr(self, field.name)
        out["stages"] = [list(stage) for stage in self.stages]
        return out


def true_optimum(problem: Problem) -> tuple[float | None, str]:
    """``(optimum, "")`` from :func:`exact_dp`, or ``(None, why)`` if infeasible."""
    try:
        return exact_dp(problem).cost, ""
    except InfeasibleProblemError as error:
        return None, str(error)


def _refined_plan(
    problem: Problem, planning: Problem, measured: NDArray[np.bool_]
) -> tuple[Plan, int, int]:
    """Re-plan until the plan uses measured entries only.

    Each round "profiles" the plan's unmeasured stages (true cost, ``inf`` if
    the true table has none, and Alpa's limit) and solves again; the measured
    set grows every round, so this ends. Returns the plan, the entries measured
    and the rounds. Raises :class:`InfeasibleProblemError` like :func:`exact_dp`.
    """
    cost = np.array(planning.compute_cost)
    limit = np.array(planning.max_n_succ_stages)
    measured = measured.copy()
    added = rounds = 0
    while True:
        rounds += 1
        plan = exact_dp(planning)
        keys = [
            (s.start, s.stop - 1, s.submesh_index, s.config_index) for s in plan.stages
        ]
        new = [key for key in keys if not measured[key]]
        if not new:
            return plan, added, rounds
        for key in new:
            measured[key] = True
            cost[key] = problem.compute_cost[key]
            limit[key] = problem.max_n_succ_stages[key]
        added += len(new)
        planning = planning.replace(compute_cost=cost, max_n_succ_stages=limit)


def plan_regret(
    problem: Problem,
    fraction: float,
    *,
    seed: int,
    memory_stats: MemoryStatsTable | None = None,
    support: str = "profiled",
    refine: bool = False,
    config: SubsetConfig | None = None,
    optimum: tuple[float | None, str] | None = None,
) -> RegretResult:
    """Plan on a fraction's predictions and score the plan on the true table.

    Args:
        problem: the true instance.
        fraction, seed, memory_stats, config: as in
            :func:`predict_stage_costs`.
        support: which entries the planner may use (``"profiled"``/``"all"``).
        refine: profile the plan's unmeasured stages and re-plan until the plan
            uses measured stages only (a few extra profiles per round; the plan
            can then no longer fail on the true table).
        optimum: a cached :func:`true_optimum` of ``problem`` (saves a DP).

    Returns:
        The :class:`RegretResult`; infeasibility and failures are statuses, not
        exceptions.

    Raises:
        ValueError: bad arguments.
    """
    if support not in SUPPORTS:
        raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")
    if not isinstance(refine, bool):
        raise ValueError(f"refine must be a bool, got {refine!r}")
    prediction = predict_stage_costs(
        problem,
        fraction,
        seed=seed,
        memory_stats=memory_stats,
        config=config,
    )
    best, why = true_optimum(problem) if optimum is None else optimum
    result: dict[str, Any] = dict(prediction=prediction, support=support, optimum=best)
    planning = planning_problem(problem, prediction, support=support)
    try:
        if refine:
            plan, refined, rounds = _refined_plan(problem, planning, prediction.sampled)
            result.update(num_refined=refined, refine_rounds=rounds)
        else:
            plan = exact_dp(planning)
    except InfeasibleProblemError as error:
        status = "true-infeasible" if best is None else "no-plan"
        return RegretResult(
            **result,
            status=status,
            plan_cost=None,
            regret=None,
            detail=why if best is None else str(error),
            stages=(),
        )
    stages = tuple(
        (s.start, s.stop, s.submesh_index, s.config_index) for s in plan.stages
    )
    try:
        cost = evaluate(problem, plan)
    except PlanError as error:
        status = f"failed-{error.rule}"
        return RegretResult(
            **result,
            status=status,
            plan_cost=None,
            regret=None,
            detail=str(error),
            stages=stages,
        )
    if best is None:  # a feasible plan on the true table: exact_dp is wrong
        raise RuntimeError("exact_dp found no plan on a problem that has one")
    return RegretResult(
        **result,
        status="ok",
        plan_cost=cost,
        regret=cost / best - 1,
        detail="",
        stages=stages,
    )


def load_instance(
    source: Problem | str | os.PathLike[str] | Mapping[Any, Any],
    *,
    cluster_shape: tuple[int, int] | None = None,
    num_microbatches: int | None = None,
    submesh_space: str = "small_power_of_two",
) -> tuple[Problem, MemoryStatsTable | None]:
    """The true problem and, for Alpa stage profiles, its memory statistics.

    Args:
        source: a :class:`~pipedejavu.core.problem.Problem` (no memory statistics), a
            problem file (``.npz``), an Alpa stage profile (``.npy``) or its
            records as :func:`pipedejavu.costmodel.read_stage_profile` returns them.
        cluster_shape, num_microbatches, submesh_space: the run's settings,
            needed for stage profiles (see
            :func:`pipedejavu.costmodel.problem_from_stage_profile`).

    Returns:
        ``(problem, memory_stats or None)``.

    Raises:
        ValueError: a stage profile without ``cluster_shape`` or
            ``num_microbatches``, or the readers' errors.
    """
    if isinstance(source, Problem):
        return source, None
    if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".npz"):
        return Problem.from_npz(source), None
    if cluster_shape is None or num_microbatches is None:
        raise ValueError(
            "an Alpa stage profile needs cluster_shape=(hosts, devices_per_host) "
            "and num_microbatches, which the file does not store"
        )
    records = source if isinstance(source, Mapping) else read_stage_profile(source)
    problem = problem_from_stage_profile(
        records,
        cluster_shape=cluster_shape,
        num_microbatches=num_microbatches,
        submesh_space=submesh_space,
    )
    return problem, memory_stats_table(records, problem.compute_cost.shape)


def _median(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(finite)) if finite else None


def _maximum(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(max(finite)) if finite else None


def _checked_list(values: Any, name: str) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a non-empty sequence, got {values!r}")
    if not values:
        raise ValueError(f"{name} must be a non-empty sequence, got {values!r}")
    return list(values)


def predictor_report(
    source: Problem | str | os.PathLike[str] | Mapping[Any, Any],
    *,
    fractions: Sequence[float] = (0.1, 0.25, 0.5, 1.0),
    seeds: Sequence[int] = (0, 1, 2),
    support: str = "profiled",
    refine: bool = False,
    memory_stats: MemoryStatsTable | None = None,
    cluster_shape: tuple[int, int] | None = None,
    num_microbatches: int | None = None,
    submesh_space: str = "small_power_of_two",
    config: SubsetConfig | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Prediction error and plan regret over fractions x seeds, JSON-able.

    Args:
        source: see :func:`load_instance`.
        fractions: shares of the profiled entries to draw, each in ``(0, 1]``.
        seeds: seeds of the draws (one run per fraction and seed).
        support, refine, config: see :func:`plan_regret`.
        memory_stats: memory statistics for a ``Problem`` source (e.g.
            :func:`pipedejavu.costmodel.stage.memory_model.synthetic_memory_stats`);
            stage
            profiles bring their own.
        cluster_shape, num_microbatches, submesh_space: for stage profiles.
        name: the instance's name in the report; default the path or
            ``"problem"``.

    Returns:
        ``{"instance", sizes, "memory_model": "fitted" | "table", "support",
        "refine", "optimum" (None if infeasible), "infeasible_reason", "rows":
        [one per fraction: medians/maxima over seeds], "runs": [one per
        (fraction, seed): :meth:`RegretResult.to_json`]}``; ``None`` stands for
        "not measurable" (no held-out entries, no feasible plan).

    Raises:
        ValueError: bad arguments.
    """
    fractions = _checked_list(fractions, "fractions")
    seeds = _checked_list(seeds, "seeds")
    problem, profile_memory = load_instance(
        source,
        cluster_shape=cluster_shape,
        num_microbatches=num_microbatches,
        submesh_space=submesh_space,
    )
    memory = profile_memory if profile_memory is not None else memory_stats
    optimum = true_optimum(problem)
    runs = [
        plan_regret(
            problem,
            fraction,
            seed=seed,
            memory_stats=memory,
            support=support,
            refine=refine,
            config=config,
            optimum=optimum,
        ).to_json()
        for fraction in fractions
        for seed in seeds
    ]
    rows = []
    for fraction in fractions:
        group = [run for run in runs if run["fraction"] == float(fraction)]
        statuses: dict[str, int] = {}
        for run in group:
            statuses[run["status"]] = statuses.get(run["status"], 0) + 1
        failed = sum(n for s, n in statuses.items() if s.startswith("failed"))
        rows.append(
            {
                "fraction": float(fraction),
                "num_seeds": len(group),
                "effective_fraction": _median([r["effective_fraction"] for r in group]),
                "num_held_out": _median([r["num_held_out"] for r in group]),
                "held_out_mape": _median([r["held_out_mape"] for r in group]),
                "held_out_mape_max": _maximum([r["held_out_mape"] for r in group]),
                "regret_median": _median([r["regret"] for r in group]),
                "regret_max": _maximum([r["regret"] for r in group]),
                "num_ok": statuses.get("ok", 0),
                "num_failed": failed,
                "statuses": statuses,
                "memory_disagreement": _median(
                    [r["memory_disagreement"] for r in group]
                ),
                "memory_limit_match": _median([r["memory_limit_match"] for r in group]),
                "num_refined": _median([r["num_refined"] for r in group]),
            }
        )
    if name is None:
        name = "problem" if isinstance(source, (Problem, Mapping)) else str(source)
    return {
        "instance": name,
        "num_layers": problem.num_layers,
        "num_submeshes": problem.num_submeshes,
        "num_configs": problem.num_configs,
        "cluster_shape": list(problem.cluster_shape),
        "num_microbatches": problem.num_microbatches,
        "num_profiled_entries": int(np.isfinite(problem.compute_cost).sum()),
        "memory_model": "table" if memory is None else "fitted",
        "support": support,
        "refine": refine,
        "subset": dataclasses.asdict(config or SubsetConfig()),
        "optimum": optimum[0],
        "infeasible_reason": optimum[1],
        "rows": rows,
        "runs": runs,
    }


def _percent(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def format_predictor_report(report: Mapping[str, Any]) -> str:
    """The report of :func:`predictor_report` as a text table (percentages)."""
    lines = [
        f"{report['instance']}: L={report['num_layers']} M={report['num_submeshes']} "
        f"K={report['num_configs']} cluster={report['cluster_shape'][0]}x"
        f"{report['cluster_shape'][1]} B={report['num_microbatches']}, "
        f"{report['num_profiled_entries']} profiled entries; memory model "
        f"{report['memory_model']}, support {report['support']}"
        + (", refined" if report["refine"] else "")
        + f", {report['subset']['design']} draw"
        + ("" if report["subset"]["complete_rank"] else " without rank completion"),
    ]
    if report["optimum"] is None:
        lines.append(
            f"true problem infeasible ({report['infeasible_reason']}): no regret"
        )
    else:
        lines.append(f"true optimum {report['optimum']:.6g} s per iteration")
    header = (
        f"{'fraction':>8} {'eff%':>6} {'held':>5} {'MAPE%':>7} {'maxMAPE%':>8} "
        f"{'regret%med':>10} {'regret%max':>10} {'fail':>4} {'memdis%':>7}"
    )
    lines.append(header)
    for row in report["rows"]:
        held = row["num_held_out"]
        lines.append(
            f"{_percent(row['fraction'], 0):>8} "
            f"{_percent(row['effective_fraction'], 1):>6} "
            f"{'-' if held is None else f'{held:.0f}':>5} "
            f"{_percent(row['held_out_mape']):>7} "
            f"{_percent(row['held_out_mape_max']):>8} "
            f"{_percent(row['regret_median']):>10} "
            f"{_percent(row['regret_max']):>10} "
            f"{row['num_failed']:>4} "
            f"{_percent(row['memory_disagreement']):>7}"
        )
    return "\n".join(lines)
