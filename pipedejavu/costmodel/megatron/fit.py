"""The predictor's free constants, fitted on measured training runs, and their
leave-one-out error.

The measured runs (``measured/<cluster>/plan_config_*.json`` of a Sailor-style
folder; a copy ships in ``pipedejavu/data/sailor``) are the *validation set*: this
module is the only place that reads their measured fields (``real``: seconds per
iteration; ``max_mem``: device bytes), and only to fit or score. The predictor
never reads them.

Three constants are fitted, each a physical quantity
(:class:`~pipedejavu.costmodel.megatron.predictor.PredictorConstants`):

* ``op_overhead_s``: one number for every GPU type, by least squares on the
  relative error of the iteration time over every trusted run (both clusters);
* ``reserve_bytes["GH-96"]`` and ``activation_overhead``: by least squares on the
  relative error of the peak memory over the GH200 runs only. The RTX cluster's
  memory readings are too small to be fp32 Adam's (the data's README), so they
  are reported, not fitted; GPU types without a trusted reading get the GH-96
  reserve (``default_reserve_bytes``).

``tests/test_megatron_fit.py`` reproduces :data:`FITTED_CONSTANTS` from the data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS, PredictorConstants
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import (
    SailorData,
    bundled_sailor_dir,
    load_sailor_data,
)
from pipedejavu.io.sailor_plan import plan_from_sailor

__all__ = [
    "FITTED_CONSTANTS",
    "MEASURED_MODELS",
    "MeasuredRun",
    "fit_constants",
    "leave_one_out",
    "load_measured_runs",
]

#: Model profile name of each measured cluster folder.
MEASURED_MODELS = {"gh200-opt350": "OPT-350", "rtx-opt350": "OPT-350"}
#: Runs left out of every fit and statistic, with the reason (the data's README).
SUSPECT_RUNS = {
    "rtx-opt350/plan_config_N3_D1.json": "its time, memory and all-reduce readings "
    "are bit-identical to N6_D2's, and it reports a 5.5 s all-reduce with one "
    "replica",
}
#: Clusters whose memory readings are trusted for fitting.
MEMORY_FIT_CLUSTERS = ("gh200-opt350",)
MEMORY_FIT_GPU = "GH-96"


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """A plan that was run, with what was measured.

    Attributes:
        name: ``"<cluster>/<file>"``.
        cluster: the folder, e.g. ``"gh200-opt350"``.
        plan: the plan (its ``model`` set).
        time_s: measured seconds per iteration.
        memory_bytes: measured peak device memory (max over GPUs).
        suspect: why the run is left out, or ``""``.
    """

    name: str
    cluster: str
    plan: Plan3D
    time_s: float
    memory_bytes: float
    suspect: str = ""

    @property
    def memory_trusted(self) -> bool:
        return self.cluster in MEMORY_FIT_CLUSTERS


def load_measured_runs(
    directory: str | os.PathLike | None = None,
) -> list[MeasuredRun]:
    """Every ``measured/<cluster>/plan_config_*.json`` under ``directory``
    (``None``: the bundled copy), sorted by name.

    Raises:
        ProblemError: a file is not a plan with numeric ``real`` and ``max_mem``.
    """
    root = bundled_sailor_dir() if directory is None else Path(directory)
    runs = []
    for path in sorted((root / "measured").glob("*/plan_config_*.json")):
        cluster = path.parent.name
        name = f"{cluster}/{path.name}"
        if cluster not in MEASURED_MODELS:
            raise ProblemError(f"{path}: unknown cluster folder {cluster!r}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ProblemError(f"cannot read {path}: {error}") from None
        plan = plan_from_sailor(data, model=MEASURED_MODELS[cluster], source=str(path))
        values = [data.get("real"), data.get("max_mem")]
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            for v in values
        ):
            raise ProblemError(f"{path}: needs positive 'real' and 'max_mem'")
        runs.append(
            MeasuredRun(
                name=name,
                cluster=cluster,
                plan=plan,
                time_s=float(values[0]),
                memory_bytes=float(values[1]),
                suspect=SUSPECT_RUNS.get(name, ""),
            )
        )
    return runs


def _time_errors(
    runs: Sequence[MeasuredRun], data: SailorData, constants: PredictorConstants
) -> np.ndarray:
    return np.array(
        [
            predict_plan(run.plan, data, constants=constants).iteration_time_s
            / run.time_s
            - 1.0
            for run in runs
        ]
    )


def _fit_op_overhead(runs: Sequence[MeasuredRun], data: SailorData) -> float:
    from scipy.optimize import minimize_scalar

    base = PredictorConstants()

    def loss(value: float) -> float:
        constants = dataclasses.replace(base, op_overhead_s=value)
        return float(np.sum(_time_errors(runs, data, constants) ** 2))

    result = minimize_scalar(
        loss, bounds=(0.0, 0.05), method="bounded", options={"xatol": 1e-7}
    )
    return float(result.x)


def _memory_parts(run: MeasuredRun, data: SailorData):
    """Per GPU: model state + reserve-free stash, as arrays for the fit."""
    prediction = predict_plan(run.plan, data, constants=PredictorConstants())
    stash = np.broadcast_to(
        prediction.activation_bytes[:, None], prediction.model_state_bytes.shape
    )
    return prediction.model_state_bytes.ravel(), np.asarray(stash).ravel()


def _fit_memory(runs: Sequence[MeasuredRun], data: SailorData) -> tuple[float, float]:
    from scipy.optimize import minimize

    parts = [(_memory_parts(run, data), run.memory_bytes) for run in runs]

    def loss(x: np.ndarray) -> float:
        reserve, overhead = x[0] * 1e9, x[1]
        return float(
            sum(
                (np.max(state + (1.0 + overhead) * stash) + reserve - measured) ** 2
                / measured**2
                for (state, stash), measured in parts
            )
        )

    result = minimize(
        loss,
        np.array([4.0, 0.0]),
        method="Nelder-Mead",
        options={"xatol": 1e-7, "fatol": 1e-12, "maxiter": 2000},
    )
    reserve, overhead = float(result.x[0] * 1e9), float(result.x[1])
    return max(reserve, 0.0), max(overhead, 0.0)


def fit_constants(
    runs: Sequence[MeasuredRun] | None = None, data: SailorData | None = None
) -> PredictorConstants:
    """Fit the three constants (module docstring) on the trusted runs.

    Args:
        runs: measured runs (``None``: the bundled ones); suspect runs are
            skipped.
        data: profiles (``None``: the bundled copy).
    """
    data = load_sailor_data() if data is None else data
    runs = load_measured_runs() if runs is None else list(runs)
    trusted = [run for run in runs if not run.suspect]
    if not trusted:
        raise ProblemError("no trusted measured runs to fit on")
    overhead = _fit_op_overhead(trusted, data)
    memory_runs = [run for run in trusted if run.memory_trusted]
    if memory_runs:
        reserve, activation = _fit_memory(memory_runs, data)
    else:
        reserve, activation = 0.0, 0.0
    return PredictorConstants(
        op_overhead_s=overhead,
        reserve_bytes=((MEMORY_FIT_GPU, reserve),),
        default_reserve_bytes=reserve,
        activation_overhead=activation,
    )


@dataclasses.dataclass(frozen=True)
class LeaveOneOut:
    """Predictions of each run by constants fitted without it.

    Attributes:
        names: the runs.
        time_s, memory_bytes: f64[N] predictions (memory: ``nan`` unless the
            run's memory is trusted; a run's memory is predicted by constants
            fitted on the other trusted runs).
    """

    names: tuple[str, ...]
    time_s: np.ndarray
    memory_bytes: np.ndarray


def leave_one_out(
    runs: Sequence[MeasuredRun] | None = None, data: SailorData | None = None
) -> LeaveOneOut:
    """Refit without each trusted run in turn and predict it (slow: about a
    second per run)."""
    data = load_sailor_data() if data is None else data
    runs = [
        r for r in (load_measured_runs() if runs is None else runs) if not r.suspect
    ]
    times = np.full(len(runs), math.nan)
    memory = np.full(len(runs), math.nan)
    for index, run in enumerate(runs):
        rest = runs[:index] + runs[index + 1 :]
        overhead = _fit_op_overhead(rest, data)
        constants = dataclasses.replace(FITTED_CONSTANTS, op_overhead_s=overhead)
        if run.memory_trusted:
            reserve, activation = _fit_memory(
                [r for r in rest if r.memory_trusted], data
            )
            constants = dataclasses.replace(
                constants,
                reserve_bytes=((MEMORY_FIT_GPU, reserve),),
                default_reserve_bytes=reserve,
                activation_overhead=activation,
            )
        prediction = predict_plan(run.plan, data, constants=constants)
        times[index] = prediction.iteration_time_s
        if run.memory_trusted:
            memory[index] = prediction.peak_memory_bytes
    return LeaveOneOut(tuple(r.name for r in runs), times, memory)
