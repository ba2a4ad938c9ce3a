"""Statistics over seeds: means with 95% confidence intervals, time to a target
validation loss, paired differences between strategies, mean curves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipedejavu.init_search.strategies import StrategyResult
from pipedejavu.init_search.train import METRICS, VALIDATION_LOSS

__all__ = ["mean_ci", "mean_curves", "summarize", "time_to_target"]

_FINAL = [name for name in METRICS if name != "train_loss"]
#: Reported quantities that are positive: their intervals are on log scale.
_POSITIVE = {"gradient_evaluations", "sequential_steps", "wall_time_s"}


def mean_ci(
    values: Sequence[float], level: float = 0.95, *, positive: bool = False
) -> dict[str, Any]:
    """Mean and Student-t confidence interval of the mean.

    Args:
        values: the samples (``None`` entries are skipped).
        level: the confidence level.
        positive: the quantity is positive (a time, a count): the interval is
            Student-t's on the logarithms, mapped back (it never starts below
            zero; it is around the geometric mean, so not symmetric), when
            every value is > 0.

    Returns:
        ``{"mean", "ci95": [low, high], "n"}``; the interval is ``None`` for
        fewer than two values, the mean ``None`` for none.
    """
    from scipy import stats

    array = np.asarray([v for v in values if v is not None], dtype=np.float64)
    count = int(array.size)
    if count == 0:
        return {"mean": None, "ci95": None, "n": 0}
    mean = float(array.mean())
    if count < 2:
        return {"mean": mean, "ci95": None, "n": count}
    quantile = float(stats.t.ppf(0.5 + level / 2, count - 1))
    if positive and bool(np.all(array > 0)):
        logs = np.log(array)
        half = quantile * float(logs.std(ddof=1) / math.sqrt(count))
        centre = float(logs.mean())
        interval = [math.exp(centre - half), math.exp(centre + half)]
        return {"mean": mean, "ci95": interval, "n": count}
    half = quantile * float(array.std(ddof=1) / math.sqrt(count))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": count}


def time_to_target(
    result: StrategyResult, target: float, *, sequential: bool = False
) -> int | None:
    """Gradient evaluations (or, with ``sequential``, sequential steps: the
    wall-clock view when the N workers run side by side) until the pick's
    validation loss first reaches ``target`` (<=); None if it never does."""
    hits = np.flatnonzero(result.curve[:, VALIDATION_LOSS] <= target)
    axis = result.sequential if sequential else result.compute
    return int(axis[hits[0]]) if hits.size else None


def summarize(
    runs: Sequence[dict[str, StrategyResult]], targets: Sequence[float] = ()
) -> dict[str, Any]:
    """Per strategy, the mean over runs (seeds) of every reported number, their
    95% intervals, time to each target and paired differences.

    Args:
        runs: one :func:`~.strategies.run_strategies` answer per seed.
        targets: validation-loss levels for time to target.

    Returns:
        ``{"strategies": {name: {...}}, "paired_differences": {...}}``; each
        strategy's ``final_*`` and ``gradient_evaluations`` are means over the
        runs, ``ci95`` their intervals, ``per_seed`` the values, and
        ``time_to_target[str(target)]`` (gradient evaluations) and
        ``sequential_steps_to_target[...]`` the mean over the runs that reached
        it, with ``reached`` counting them.
    """
    names = list(runs[0])
    out: dict[str, Any] = {"strategies": {}, "paired_differences": {}}
    for name in names:
        rows = [run[name].to_json() for run in runs]
        keys = [
            "gradient_evaluations",
            "sequential_steps",
            *[f"final_{m}" for m in _FINAL],
            "best_validation_loss",
            "wall_time_s",
        ]
        entry: dict[str, Any] = {}
        intervals, per_seed = {}, {}
        for key in keys:
            values = [row[key] for row in rows]
            stats = mean_ci(values, positive=key in _POSITIVE)
            entry[key] = stats["mean"]
            intervals[key] = stats["ci95"]
            per_seed[key] = values
        entry["budget"] = rows[0]["budget"]
        entry["ci95"] = intervals
        entry["per_seed"] = per_seed
        for field, sequential in (
            ("time_to_target", False),
            ("sequential_steps_to_target", True),
        ):
            entry[field] = {}
            for target in targets:
                hits = [
                    time_to_target(run[name], target, sequential=sequential)
                    for run in runs
                ]
                stats = mean_ci(hits, positive=True)
                entry[field][repr(float(target))] = {
                    "mean": stats["mean"],
                    "ci95": stats["ci95"],
                    "reached": stats["n"],
                    "runs": len(runs),
                    "per_seed": hits,
                }
        out["strategies"][name] = entry
    for other in [n for n in names if n != "refine"]:
        if "refine" not in names:
            break
        label = f"refine - {other}"
        diffs: dict[str, Any] = {}
        for metric in [f"final_{m}" for m in _FINAL] + ["best_validation_loss"]:
            values = [
                run["refine"].to_json()[metric] - run[other].to_json()[metric]
                for run in runs
            ]
            diffs[metric] = mean_ci(values)
        for target in targets:
            pairs = [
                (
                    time_to_target(run["refine"], target),
                    time_to_target(run[other], target),
                )
                for run in runs
            ]
            values = [a - b for a, b in pairs if a is not None and b is not None]
            diffs[f"time_to_target {float(target)!r}"] = mean_ci(values)
        out["paired_differences"][label] = diffs
    return out


def mean_curves(
    runs: Sequence[dict[str, StrategyResult]], metric: str = "validation_loss"
) -> dict[str, dict[str, np.ndarray]]:
    """Per strategy: compute i64[P], mean f64[P] and 95% band f64[2, P] of the
    pick's ``metric`` over runs (curves cut to the shortest run)."""
    column = METRICS.index(metric)
    out = {}
    for name in runs[0]:
        length = min(len(run[name].compute) for run in runs)
        values = np.stack([run[name].curve[:length, column] for run in runs])
        mean = values.mean(axis=0)
        if len(runs) > 1:
            from scipy import stats

            half = (
                stats.t.ppf(0.975, len(runs) - 1)
                * values.std(axis=0, ddof=1)
                / math.sqrt(len(runs))
            )
        else:
            half = np.zeros_like(mean)
        out[name] = {
            "compute": runs[0][name].compute[:length],
            "mean": mean,
            "band": np.stack([mean - half, mean + half]),
        }
    return out
