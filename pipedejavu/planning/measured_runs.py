"""Measured runs: a plan the user ran, and the seconds per iteration it took.

A run file (JSON, format ``pipedejavu-run/1``) ties what ran to what was
measured; paths in it are relative to the file::

    {"format": "pipedejavu-run/1",
     "plan": "plan.json",            # a plan file (ours, or Sailor's plan_config)
     "model": "OPT-350",             # a preset, a model of the profiles or a
                                     # config.json (where the plan names none)
     "log": "train.log",             # Megatron-LM, Megatron-DeepSpeed or
                                     # torchtitan (pipedejavu.io.run_logs)
     "skip_intervals": 1,            # logged intervals of warm-up (default 1)
     "training": {"precision": "fp32", "flash_attention": false},
     "seq_length": 2048}

Instead of ``log``: ``"seconds_per_iteration": S``, measured otherwise; or
neither, for a Sailor ``plan_config`` carrying its measured ``real``. The
``training`` object (the options the run used, as plan files write them;
default: the plan's) and ``seq_length`` describe the run exactly.

:func:`load_runs` reads run files (or every ``*.json`` of a folder);
:func:`price_run` prices a run as ``pipedejavu predict PLAN.json --model M
--calibration CAL.json`` would, through the same calls. From a log:
Megatron's seconds per iteration, or torchtitan's tokens per second per GPU
turned into seconds of the plan's global batch (``gbs * seq_length /
(tps * GPUs)``); the median over the steady intervals.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipedejavu.core.files import read_json
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.calibration_file import ClusterCalibration
from pipedejavu.costmodel.megatron.predictor import Prediction
from pipedejavu.io.export_megatron import DEFAULT_MOE_OPTIONS
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.run_logs import read_training_log
from pipedejavu.io.sailor_plan import load_plan3d, load_plan_training
from pipedejavu.planning.any_model import (
    CostChoice,
    choose_cost_source,
    predict_any_plan,
)
from pipedejavu.planning.expert_search import layers_of

__all__ = [
    "RUN_FORMAT",
    "MeasuredRun",
    "load_run",
    "load_runs",
    "plan_choice",
    "price_run",
]

#: The run file's format tag.
RUN_FORMAT = "pipedejavu-run/1"
_KEYS = {
    "format",
    "plan",
    "model",
    "log",
    "seconds_per_iteration",
    "skip_intervals",
    "training",
    "seq_length",
}
_MAX_BYTES = 1 << 16
_MAX_RUNS = 1000


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """A run measured on the cluster.

    Attributes:
        name: the run file (or the Sailor plan) it was read from.
        plan: what ran.
        model: the model, as :func:`~pipedejavu.planning.any_model.
            choose_cost_source` takes it.
        options: the training options it used (``None``: the model's
            defaults).
        seq_length: tokens per sample (``None``: the model's).
        experts: how its experts ran (the plan file's; ``None``: a dense
            model's plan, or Megatron-LM's defaults).
        seconds: measured seconds per iteration.
        memory_bytes: the peak memory the log reports (``None``: none).
        how: where ``seconds`` came from, in words.
    """

    name: str
    plan: Plan3D
    model: str
    options: TrainingOptions | None
    seq_length: int | None
    seconds: float
    memory_bytes: float | None
    how: str
    experts: MoeOptions | None = None


def _resolve(base: Path, value: Any, key: str) -> Path:
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise ValueError(f"{key} must be a path")
    path = Path(value)
    return path if path.is_absolute() else base / path


def _model_arg(base: Path, value: Any) -> str:
    """A model name as given, or a model file beside the run file."""
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise ValueError("model must be a preset name or a model file")
    local = base / value
    return os.fspath(local) if value.endswith(".json") and local.is_file() else value


def _positive_int(value: Any, key: str, low: int, high: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= high
    ):
        raise ValueError(f"{key} must be an integer in [{low}, {high}]")
    return value


def _log_seconds(
    log_path: Path, skip: int, plan: Plan3D, seq_length: int | None
) -> tuple[float, float | None, str]:
    log = read_training_log(log_path)
    steady = log.steady(skip)
    if log.launcher == "torchtitan":
        if seq_length is None:
            raise ProblemError(
                f"{log_path}: a torchtitan log gives tokens per second: the run "
                "file must give seq_length to turn them into seconds"
            )
        tps = float(np.median([i.tokens_per_gpu_s for i in steady]))
        seconds = plan.gbs * seq_length / (tps * plan.num_gpus)
    else:
        seconds = float(np.median([i.seconds for i in steady]))
    how = f"{log.launcher} log, median of {len(steady)} logged intervals"
    return seconds, log.peak_memory_bytes(), how


def load_run(path: str | os.PathLike) -> MeasuredRun:
    """The run a run file describes (module docstring).

    Raises:
        ProblemError: one line naming the file (or the plan or log it names):
            not a run file, an unknown key, a missing plan or model, two
            measurements or none, a bad log.
    """
    name = os.fspath(path)
    base = Path(path).parent
    data = read_json(path, _MAX_BYTES, "run file")
    try:
        if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
            raise ValueError(f'not a run file (no "format": "{RUN_FORMAT}")')
        unknown = sorted(str(k)[:40] for k in set(data) - _KEYS)
        if unknown:
            raise ValueError(f"unknown keys {unknown[:5]} (known: {sorted(_KEYS)})")
        if "plan" not in data:
            raise ValueError("no plan: name the plan file that ran")
        plan_path = _resolve(base, data["plan"], "plan")
        given = [k for k in ("log", "seconds_per_iteration") if k in data]
        if len(given) > 1:
            raise ValueError("give log or seconds_per_iteration, not both")
        skip = _positive_int(data.get("skip_intervals", 1), "skip_intervals", 0, 10**6)
        seq_length = data.get("seq_length")
        if seq_length is not None:
            seq_length = _positive_int(seq_length, "seq_length", 1, 2**24)
        options = data.get("training")
        if options is not None:
            options = TrainingOptions.from_json(options)
    except (TypeError, ValueError) as error:
        raise ProblemError(f"{name}: {error}") from None
    try:  # what is wrong with the plan or the log, named with the run file
        return _measured(name, base, data, plan_path, skip, seq_length, options)
    except ProblemError as error:
        if str(error).startswith(name):
            raise
        raise ProblemError(f"{name}: {error}") from None


def _measured(
    name: str,
    base: Path,
    data: dict[str, Any],
    plan_path: Path,
    skip: int,
    seq_length: int | None,
    options: TrainingOptions | None,
) -> MeasuredRun:
    """The run of a checked run file ``data`` (:func:`load_run`)."""
    raw = read_json(plan_path, 1 << 24, "plan file")
    sailor = isinstance(raw, dict) and "pipeline_list" in raw
    model = data.get("model")
    if model is None and sailor:
        raise ProblemError(f"{name}: a Sailor plan names no model: give model")
    try:
        model = None if model is None else _model_arg(base, model)
    except ValueError as error:
        raise ProblemError(f"{name}: {error}") from None
    plan, _ = load_plan3d(plan_path, model=model if sailor else None)
    model = model if model is not None else plan.model
    if model is None:
        raise ProblemError(f"{name}: {plan_path} names no model: give model")
    training = load_plan_training(plan_path)
    options = options if options is not None else training.options
    seq_length = seq_length if seq_length is not None else training.seq_length
    memory = None
    if "log" in data:
        log_path = _resolve(base, data["log"], "log")
        seconds, memory, how = _log_seconds(log_path, skip, plan, seq_length)
    elif "seconds_per_iteration" in data:
        seconds = data["seconds_per_iteration"]
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ProblemError(f"{name}: seconds_per_iteration must be a number")
        how = "seconds given in the run file"
    elif sailor and isinstance(raw.get("real"), int | float):
        seconds, how = raw["real"], "the Sailor plan's measured real"
    else:
        raise ProblemError(
            f"{name}: no measurement: give log (a training log) or "
            "seconds_per_iteration"
        )
    if not (
        isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0
    ):
        raise ProblemError(f"{name}: the measured seconds must be > 0, got {seconds}")
    return MeasuredRun(
        name, plan, model, options, seq_length, float(seconds), memory, how,
        training.experts,
    )  # fmt: skip


def load_runs(paths: Sequence[str | os.PathLike]) -> list[MeasuredRun]:
    """The runs of run files and folders (a folder: its ``*.json`` files,
    sorted), in order.

    Raises:
        ProblemError: a path that is neither, an empty folder, more than
            1,000 runs, or a bad run file (:func:`load_run`).
    """
    files: list[Path] = []
    for path in paths:
        where = Path(path)
        if where.is_dir():
            found = sorted(where.glob("*.json"))
            if not found:
                raise ProblemError(f"{os.fspath(path)}: no run file (*.json)")
            files += found
        elif where.is_file():
            files.append(where)
        else:
            raise ProblemError(f"{os.fspath(path)}: no such run file or folder")
        if len(files) > _MAX_RUNS:
            raise ProblemError(f"more than {_MAX_RUNS} runs")
    return [load_run(f) for f in files]


def plan_choice(
    model: str,
    plan: Plan3D,
    *,
    options: TrainingOptions | None = None,
    experts: MoeOptions | None = None,
    precision: Any = None,
    recompute: Any = None,
    seq_length: int | None = None,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    memory_headroom: Any = None,
    calibration: ClusterCalibration | None = None,
) -> CostChoice:
    """The cost source that prices a plan file's ``plan`` of ``model``, as
    ``predict PLAN.json`` and :func:`price_run` both take it: its GPUs, its
    experts laid out as the plan lays them (``experts``: how they ran), its
    context parallelism, the other arguments as for
    :func:`~pipedejavu.planning.any_model.choose_cost_source`."""
    axes = plan.layout.stages[0]
    return choose_cost_source(
        model,
        plan.gpus_by_type(),
        options=options,
        precision=precision,
        recompute=recompute,
        seq_length=seq_length,
        gpu_sheet=gpu_sheet,
        profiles=profiles,
        memory_headroom=memory_headroom,
        experts=layers_of(experts or DEFAULT_MOE_OPTIONS, axes.ep, axes.etp),
        context_parallel=plan.layout.cp,
        calibration=calibration,
    )


def price_run(
    run: MeasuredRun,
    calibration: ClusterCalibration | None,
    *,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
) -> Prediction:
    """``run``'s plan priced as ``predict PLAN.json --model M --calibration
    CAL.json`` prices it (the same cost source, options and plan).

    Raises:
        ProblemError: the plan does not fit the model or the GPUs (one line
            naming the run).
    """
    try:
        choice = plan_choice(
            run.model,
            run.plan,
            options=run.options,
            experts=run.experts,
            seq_length=run.seq_length,
            gpu_sheet=gpu_sheet,
            profiles=profiles,
            calibration=calibration,
        )
        if not choice.analytical:
            raise ProblemError(
                "priced from its own profiles, which a calibration does not "
                "change: give runs of models priced analytically"
            )
        _, prediction = predict_any_plan(run.plan.replace(model=choice.model), choice)
    except ProblemError as error:
        raise ProblemError(f"{run.name}: {error}") from None
    return prediction
