"""torchtitan's published Llama 3.1 runs (the visible development set),
predicted from their job files, and the constants fitted on them.

Each record of ``torchtitan_llama3_8b_h100.json`` (bundled in
``pipedejavu/data/published``) is written back as the job file it ran
(:func:`job_text`: the 2024-12 schema of the commit the runs name; the
degrees, batch, sequence, recomputation, compile and float8 as the record
gives them) and read by the project's own reader
(:func:`~pipedejavu.io.torchtitan_job.parse_torchtitan_job`), then predicted
as any job is (:func:`~pipedejavu.planning.torchtitan_launch.
predict_torchtitan_job`) on the sheet's ``H100-96GB-500W``.

**The fit** (:func:`fit_torchtitan_constants`) of the two constants of
:mod:`~pipedejavu.costmodel.analytical.torchtitan_constants`: a run's
seconds per token are, to first order, ``t0 + (1/a - 1) A + (g0/g - 1) G``
for attention efficiency ``a`` and tensor efficiency ``g`` (``A``: its
attention kernels' seconds, ``G``: its GEMMs' at ``g0``, each read off the
predictor as what halving that efficiency adds), a linear least-squares
problem in ``1/a`` and ``1/g`` over the runs' relative errors, solved in
closed form and clipped to efficiencies of at most 1. The errors reported
are the predictor's own with the fitted constants, not the linear model's;
:func:`leave_one_out` fits on six runs and predicts the seventh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json
from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.costmodel.analytical.roofline import (
    HALF_PRECISION_ANALYTICAL,
    AnalyticalConstants,
)
from pipedejavu.costmodel.analytical.torchtitan_constants import (
    TORCHTITAN_LOSS_LOGIT_BYTES,
)
from pipedejavu.io.torchtitan_job import TorchtitanJob, parse_torchtitan_job
from pipedejavu.planning.published_runs import (
    MAX_PUBLISHED_FILE_BYTES,
    bundled_published_file,
)
from pipedejavu.planning.torchtitan_launch import predict_torchtitan_job

__all__ = [
    "TORCHTITAN_GPU",
    "TorchtitanRun",
    "bundled_torchtitan_published_path",
    "fit_torchtitan_constants",
    "job_text",
    "leave_one_out",
    "load_torchtitan_runs",
    "predict_runs",
]

#: The sheet's name of the runs' GPU (H100 SXM, 96 GB HBM2e, 500 W).
TORCHTITAN_GPU = "H100-96GB-500W"
#: What the fit starts from: the 16-bit constants with torchtitan's loss.
TORCHTITAN_BASE = dataclasses.replace(
    HALF_PRECISION_ANALYTICAL, loss_logit_bytes=TORCHTITAN_LOSS_LOGIT_BYTES
)
#: The fitted fields, in :func:`fit_torchtitan_constants`' order.
FIELDS = ("attention_efficiency", "tensor_efficiency")


@dataclasses.dataclass(frozen=True)
class TorchtitanRun:
    """A published run: its id, job, GPUs and measurements (tokens/s per
    GPU, peak memory in GiB as torchtitan reports it)."""

    run_id: str
    job: TorchtitanJob
    num_gpus: int
    tokens_per_s_per_gpu: float
    peak_memory_gib: float


def bundled_torchtitan_published_path() -> Path:
    """The vendored copy of the seven runs."""
    return bundled_published_file("torchtitan_llama3_8b_h100.json")


def job_text(record: Mapping[str, Any]) -> str:
    """The job file (torchtitan's 2024-12 schema) of a published record.

    Raises:
        ProblemError: a record without the fields read (one line).
    """
    try:
        par, batch = record["parallelism"], record["batch"]
        model = record["model"]
        recompute = "full" if par["recompute"] == "full" else "selective"
        float8 = "Float8" in record["precision"]
        lines = [
            "[model]",
            'name = "llama3"',
            'flavor = "8B"',
            "[training]",
            f"batch_size = {int(batch['micro_batch_size'])}",
            f"seq_len = {int(model['seq_length'])}",
            "data_parallel_replicate_degree = 1",
            f"data_parallel_shard_degree = {int(par['dp'])}",
            f"tensor_parallel_degree = {int(par['tp'])}",
            f"compile = {'true' if par['torch_compile'] else 'false'}",
            "[experimental]",
            f"context_parallel_degree = {int(par['cp'])}",
            f"pipeline_parallel_degree = {int(par['pp'])}",
            "[activation_checkpoint]",
            f'mode = "{recompute}"',
        ]
    except (KeyError, TypeError, ValueError) as bad:
        raise ProblemError(f"a published torchtitan record lacks {bad}") from None
    if recompute == "selective":
        lines.append('selective_ac_option = "op"')
    if float8:
        lines += ["[float8]", "enable_float8_linear = true"]
    return "\n".join(lines) + "\n"


def load_torchtitan_runs(path: str | None = None) -> list[TorchtitanRun]:
    """The runs of the file (default: the bundled one).

    Raises:
        ProblemError: an unreadable file or record (one line naming it).
    """
    file = bundled_torchtitan_published_path() if path is None else Path(path)
    data = read_json(file, MAX_PUBLISHED_FILE_BYTES, "published runs file")
    runs = []
    for record in data.get("runs", []) if isinstance(data, dict) else []:
        text = job_text(record)
        job = parse_torchtitan_job(text, f"{file.name}: {record.get('id')}")
        measured = record["measured"]
        runs.append(
            TorchtitanRun(
                str(record["id"]),
                job,
                int(record["hardware"]["num_gpus"]),
                float(measured["tokens_per_s_per_gpu"]),
                float(measured["peak_memory_gib"]),
            )
        )
    if not runs:
        raise ProblemError(f"{file}: no runs")
    return runs


def _with(base: AnalyticalConstants, values: Sequence[float]) -> AnalyticalConstants:
    return dataclasses.replace(base, **dict(zip(FIELDS, values, strict=True)))


def predict_runs(
    runs: Sequence[TorchtitanRun],
    constants: AnalyticalConstants,
    sheet: Mapping[str, GpuSheetEntry],
) -> list[tuple[float, float]]:
    """``(tokens/s per GPU, peak memory GiB)`` of each run with ``constants``."""
    out = []
    for run in runs:
        predicted = predict_torchtitan_job(
            run.job, TORCHTITAN_GPU, run.num_gpus, sheet, constants=constants
        )
        memory = predicted.launch.prediction.peak_memory_bytes / 2**30
        out.append((predicted.tokens_per_s_per_gpu, memory))
    return out


def fit_torchtitan_constants(
    runs: Sequence[TorchtitanRun],
    sheet: Mapping[str, GpuSheetEntry],
    base: AnalyticalConstants = TORCHTITAN_BASE,
) -> AnalyticalConstants:
    """``base`` with :data:`FIELDS` fitted to the runs' tokens/s per GPU
    (module docstring), rounded to 4 digits.

    Raises:
        ProblemError: fewer than two runs (two constants).
    """
    if len(runs) < 2:
        raise ProblemError("fitting two constants needs at least two runs")

    def seconds(constants: AnalyticalConstants) -> np.ndarray:
        return np.array([1.0 / t for t, _ in predict_runs(runs, constants, sheet)])

    a0, g0 = (getattr(base, name) for name in FIELDS)
    t0 = seconds(base)
    attention = seconds(_with(base, [a0 / 2, g0])) - t0  # A: the kernels' own
    gemms = seconds(_with(base, [a0, g0 / 2])) - t0  # G: the GEMMs' own
    measured = np.array([1.0 / run.tokens_per_s_per_gpu for run in runs])
    # t0 - A - G + x A + y G = measured, x = a0 / a, y = g0 / g, relatively
    matrix = np.stack([attention / measured, gemms / measured], axis=1)
    target = 1.0 - (t0 - attention - gemms) / measured
    (x, y), *_ = np.linalg.lstsq(matrix, target, rcond=None)
    fitted = [min(a0 / max(x, 1e-6), 1.0), min(g0 / max(y, 1e-6), 1.0)]
    return _with(base, [round(float(v), 4) for v in fitted])


def leave_one_out(
    runs: Sequence[TorchtitanRun], sheet: Mapping[str, GpuSheetEntry]
) -> tuple[list[float], list[AnalyticalConstants]]:
    """Each run's tokens/s error (predicted over published, less 1) with the
    constants fitted on the others, and those fits."""
    errors, fits = [], []
    for k, run in enumerate(runs):
        constants = fit_torchtitan_constants(
            [r for j, r in enumerate(runs) if j != k], sheet
        )
        ((tokens, _),) = predict_runs([run], constants, sheet)
        errors.append(tokens / run.tokens_per_s_per_gpu - 1.0)
        fits.append(constants)
    return errors, fits
