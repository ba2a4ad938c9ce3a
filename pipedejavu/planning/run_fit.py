"""A calibration refined on measured runs: the constants a few iterations the
user timed can move, moved as far as they say.

The profiles fix each GPU type's constants layer by layer
(:func:`~pipedejavu.costmodel.analytical.cluster_fit.fit_cluster`); a whole
iteration holds what no layer profile does (the pipeline's bubbles and
sends, the gradient reductions, the optimizer, the framework between
kernels). :func:`fit_runs` refines, per GPU type the runs use, the constants
of :data:`RUN_FIELDS` by maximum a posteriori least squares, every run priced
by :func:`~pipedejavu.planning.measured_runs.price_run` (the predictor
itself):

* each run adds ``log(predicted / measured) / RUN_SIGMA``,
* each constant adds ``(log value - log profiled value) / PRIOR_SIGMA``:
  the profiles' value is the prior, so one run moves the constants it
  depends on a little and many runs that agree move them far; the constants
  stay within their bounds (:data:`~pipedejavu.costmodel.analytical.
  calibration_file.CALIBRATED_FIELDS`).

A constant no run depends on (its column of the runs' Jacobian vanishes
against the others') keeps its profiled value and is named. The
leave-one-run-out error fits on all runs but one and prices that one. The
two sigmas are fixed (:data:`RUN_SIGMA`, :data:`PRIOR_SIGMA`), not tuned on
the runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.calibration_file import (
    CALIBRATED_FIELDS,
    ClusterCalibration,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.measured_runs import MeasuredRun, price_run

__all__ = ["PRIOR_SIGMA", "RUN_FIELDS", "RUN_SIGMA", "RunFit", "fit_runs", "record"]

#: The constants runs refine, per GPU type.
RUN_FIELDS = (
    "tensor_efficiency",
    "backward_tensor_efficiency",
    "memory_efficiency",
    "link_efficiency",
    "collective_latency_s",
)
#: The log error a run is expected within (measurement and model).
RUN_SIGMA = 0.05
#: How far (log) a constant may stray from its profiled value, one sigma.
PRIOR_SIGMA = 0.3
_UNMOVED = 1e-3


@dataclasses.dataclass(frozen=True)
class RunFit:
    """What :func:`fit_runs` found.

    Attributes:
        calibration: the calibration with the refined constants (and its
            ``runs`` record, :meth:`record`).
        runs: the run names, in order.
        measured: seconds per iteration of each run.
        before: each run priced with the calibration given.
        after: each run priced with the refined one.
        left_out: each run priced by a fit on the others (``None``: one run).
        fields: the refined constants, per GPU type.
        kept: the constants no run depends on, per GPU type, with the reason.
    """

    calibration: ClusterCalibration
    runs: tuple[str, ...]
    measured: np.ndarray
    before: np.ndarray
    after: np.ndarray
    left_out: np.ndarray | None
    fields: Mapping[str, tuple[str, ...]]
    kept: Mapping[str, Mapping[str, str]]

    def errors(self, which: str) -> np.ndarray:
        """Relative errors of ``before``, ``after`` or ``left_out``."""
        return getattr(self, which) / self.measured - 1


def _summary(errors: np.ndarray) -> dict[str, float]:
    values = np.abs(errors)
    return {"median": float(np.median(values)), "max": float(values.max())}


def record(fit: RunFit) -> dict[str, Any]:
    """The calibration file's ``runs`` record of ``fit``."""
    return {
        "files": [os.path.basename(name) for name in fit.runs],
        "fields": {gpu: list(f) for gpu, f in fit.fields.items()},
        "kept": {gpu: dict(k) for gpu, k in fit.kept.items()},
        "error_before": _summary(fit.errors("before")),
        "fit_error": _summary(fit.errors("after")),
        "leave_one_out": (
            None if fit.left_out is None else _summary(fit.errors("left_out"))
        ),
        "run_sigma": RUN_SIGMA,
        "prior_sigma": PRIOR_SIGMA,
    }


def _with(
    calibration: ClusterCalibration, values: Mapping[tuple[str, str], float]
) -> ClusterCalibration:
    gpus = dict(calibration.gpus)
    for (gpu, field), value in values.items():
        constants = dict(gpus[gpu].constants)
        constants[field] = value
        gpus[gpu] = dataclasses.replace(gpus[gpu], constants=constants)
    return dataclasses.replace(calibration, gpus=gpus)


class _Problem:
    """The runs priced as a function of the log constants ``keys``."""

    def __init__(
        self,
        calibration: ClusterCalibration,
        runs: Sequence[MeasuredRun],
        keys: Sequence[tuple[str, str]],
        prior: np.ndarray,
        pricing: Mapping[str, Any],
    ) -> None:
        self.calibration, self.runs, self.keys = calibration, runs, list(keys)
        self.prior, self.pricing = prior, pricing
        self.measured = np.log([r.seconds for r in runs])

    def calibrated(self, x: np.ndarray) -> ClusterCalibration:
        values = {}
        for (gpu, field), v in zip(self.keys, x, strict=True):
            lo, hi = CALIBRATED_FIELDS[field]  # (exp(log(hi)) may pass hi)
            values[gpu, field] = min(max(float(math.exp(v)), lo), hi)
        return _with(self.calibration, values)

    def priced(self, x: np.ndarray, runs: Sequence[MeasuredRun]) -> np.ndarray:
        calibration = self.calibrated(x)
        return np.array(
            [price_run(r, calibration, **self.pricing).iteration_time_s for r in runs]
        )

    def residuals(self, x: np.ndarray) -> np.ndarray:
        runs = (np.log(self.priced(x, self.runs)) - self.measured) / RUN_SIGMA
        return np.concatenate([runs, (x - self.prior) / PRIOR_SIGMA])

    def solve(self) -> tuple[np.ndarray, np.ndarray]:
        """``(log constants, the runs' Jacobian column norms)``."""
        from scipy.optimize import least_squares  # (a fit only)

        bounds = np.log([CALIBRATED_FIELDS[f] for _, f in self.keys]).T
        start = np.clip(self.prior, bounds[0] + 1e-9, bounds[1] - 1e-9)
        found = least_squares(
            self.residuals, start, bounds=bounds, x_scale=1.0, diff_step=1e-3
        )
        runs = found.jac[: len(self.runs)]
        return found.x, np.linalg.norm(runs, axis=0)


def _solved(
    problem: _Problem, keys: list[tuple[str, str]]
) -> tuple[np.ndarray, np.ndarray]:
    return problem.solve() if keys else (np.zeros(0), np.zeros(0))


def fit_runs(
    calibration: ClusterCalibration,
    runs: Sequence[MeasuredRun],
    *,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    fields: Sequence[str] = RUN_FIELDS,
    leave_one_out: bool = True,
    progress: Callable[[str], None] | None = None,
) -> RunFit:
    """``calibration`` refined on ``runs`` (module docstring); ``progress``
    is told of each fit as it starts.

    Raises:
        ProblemError: no run, a run on a GPU type the calibration lacks, a
            run that cannot be priced (one line naming it), a field that is
            not calibrated.
    """
    if not runs:
        raise ProblemError("no measured run to calibrate on")
    unknown = [f for f in fields if f not in CALIBRATED_FIELDS]
    if unknown:
        raise ProblemError(f"not calibrated constants: {', '.join(unknown)}")
    pricing = {"gpu_sheet": gpu_sheet, "profiles": profiles}
    sheet = load_gpu_sheet(gpu_sheet)
    names = set()
    for run in runs:
        for gpu in run.plan.gpus_by_type():
            try:
                names.add(sheet.resolve(gpu))
            except KeyError:
                raise ProblemError(
                    f"{run.name}: GPU type {gpu!r:.40} is not on the GPU sheet"
                ) from None
    base = calibration.fields_for(names)  # (a type it lacks: one line)
    kept: dict[str, dict[str, str]] = {}
    keys = []
    for gpu in sorted(names):
        for field in fields:
            if field in base[gpu]:
                keys.append((gpu, field))
            else:
                why = "not in the calibration (its profiles did not fit it)"
                kept.setdefault(gpu, {})[field] = why
    prior = np.log([base[gpu][f] for gpu, f in keys])
    measured = np.array([r.seconds for r in runs])
    say = progress or (lambda text: None)
    say(f"fitting {len(keys)} constants to {len(runs)} runs")
    unchanged = _Problem(calibration, runs, [], prior[:0], pricing)
    before = unchanged.priced(prior[:0], runs)
    problem = _Problem(calibration, runs, keys, prior, pricing)
    x, norms = _solved(problem, keys)
    moved = norms >= _UNMOVED * max(float(norms.max(initial=0.0)), 1e-300)
    for (gpu, field), m in zip(keys, moved, strict=True):
        if not m:
            why = "no run depends on it (left at its profiled value)"
            kept.setdefault(gpu, {})[field] = why
    if not moved.all():
        keys = [k for k, m in zip(keys, moved, strict=True) if m]
        prior = prior[moved]
        problem = _Problem(calibration, runs, keys, prior, pricing)
        x, _ = _solved(problem, keys)
    after = problem.priced(x, runs)
    left_out = None
    if leave_one_out and len(runs) > 1:
        out = []
        for i, run in enumerate(runs):
            say(f"leaving out run {i + 1} of {len(runs)}")
            rest = [r for j, r in enumerate(runs) if j != i]
            other = _Problem(calibration, rest, keys, prior, pricing)
            y, _ = _solved(other, keys)
            out.append(other.priced(y, [run])[0])
        left_out = np.array(out)
    fit = RunFit(
        calibration=problem.calibrated(x),
        runs=tuple(r.name for r in runs),
        measured=measured,
        before=before,
        after=after,
        left_out=left_out,
        fields={g: tuple(f for k, f in keys if k == g) for g in sorted(names)},
        kept=kept,
    )
    refined = dataclasses.replace(fit.calibration, runs=record(fit))
    return dataclasses.replace(fit, calibration=refined)
