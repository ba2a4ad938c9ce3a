"""Calibration to the user's cluster: the analytical model's constants fitted
per GPU type to per-layer profiles of other models measured on it.

A datasheet says what a GPU could do; a profile says what it did. Given a
folder of profiles in Sailor's layout (``profiles/<MODEL>/<GPU>/
profile.json``, what ``pipedejavu profile`` writes too), :func:`fit_cluster`
fits, for each GPU type, the constants the profiles can determine: the
tensor-core efficiency of the forward and of the backward GEMMs, the memory
efficiency of the element-wise kernels and the launch overhead per kernel
(:data:`CALIBRATED_FIELDS`). Every other constant keeps the project's fitted
value (:data:`~pipedejavu.costmodel.analytical.roofline.FITTED_ANALYTICAL`),
and the result says which and why.

The fit prices each profiled layer with the predictor's own code: an
:class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource` of the
profiled model, trained as the profiles measured it
(:data:`PROFILED_TRAINING`), whose layer times are compared with the
profile's; least squares on the logarithm of their ratio, each constant
within its bounds. Only TP 1 entries enter: at TP > 1 a layer's time holds
the TP all-reduce over the cluster's links, which this fit does not
calibrate. A constant the samples do not move (its column of the Jacobian
vanishes against the others, or it is a combination of them) is not fitted
and is named with the reason. The leave-one-out error leaves out one
(model, micro-batch size) entry at a time, fits on the rest and prices it.

A calibration is saved as JSON (:meth:`ClusterCalibration.to_json`) and read
back with :func:`load_calibration`, which checks every key and value (a file
is untrusted: one line naming it for anything wrong).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pipedejavu.core.files import read_json
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.calibrate import FIT_FIELDS, QK_LAYER_SCALING
from pipedejavu.costmodel.analytical.price_cache import PriceCache
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    AnalyticalConstants,
)
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.sailor_data import NetworkTables, SailorData
from pipedejavu.io.gpu_sheet import GpuSheet
from pipedejavu.io.model_config import load_model_spec

__all__ = [
    "CALIBRATED_FIELDS",
    "CALIBRATION_FORMAT",
    "PROFILED_TRAINING",
    "ClusterCalibration",
    "GpuCalibration",
    "ProfileSample",
    "fit_cluster",
    "load_calibration",
    "profile_samples",
]

#: The constants a GPU type's profiles calibrate, with their bounds.
CALIBRATED_FIELDS: dict[str, tuple[float, float]] = {
    name: FIT_FIELDS[name]
    for name in (
        "tensor_efficiency",
        "backward_tensor_efficiency",
        "memory_efficiency",
        "kernel_overhead_s",
    )
}
_LOG_FIELDS = frozenset({"kernel_overhead_s"})
#: The file's format tag.
CALIBRATION_FORMAT = "pipedejavu-calibration/1"
_MAX_BYTES = 1 << 20
_MAX_GPUS = 64
#: How Sailor's profiles trained (Megatron-DeepSpeed: fp32, unfused
#: attention, no recomputation).
PROFILED_TRAINING = TrainingOptions("fp32", flash_attention=False)
#: A column of the Jacobian this much below the largest moves no sample.
_UNMOVED = 1e-3


@dataclasses.dataclass(frozen=True)
class ProfileSample:
    """One profiled pass: ``layer`` (``block``: the median over the model's
    blocks; ``head``) and ``direction`` of ``model`` at micro-batch ``mbs``
    and TP 1 on ``gpu`` (the sheet's name), ``measured`` seconds."""

    model: str
    gpu: str
    mbs: int
    layer: str
    direction: str
    measured: float


def profile_samples(
    data: SailorData,
    sheet: GpuSheet,
    models: Sequence[str] | None = None,
    gpus: Collection[str] | None = None,
) -> tuple[list[ProfileSample], list[str]]:
    """``(samples, notes)``: every TP 1 block and head pass of the profiles
    of ``models`` (``None``: every model the profiles hold) whose shape is
    known (a bundled preset) on a GPU type of the sheet (of ``gpus``, the
    sheet's names, where given); the notes say what was left out and why."""
    samples, notes = [], []
    names = data.models() if models is None else list(models)
    for model in names:
        if model not in data.models():
            raise ProblemError(
                f"no profiles of {model} (the profiles hold: "
                f"{', '.join(data.models()) or 'none'})"
            )
        try:
            spec = load_model_spec(model)
        except ProblemError:
            notes.append(f"{model}: no bundled description of its shape, left out")
            continue
        for folder in data.gpu_types(model):
            try:
                gpu = sheet.resolve(folder)
            except KeyError:
                notes.append(f"{model} on {folder}: not on the GPU sheet, left out")
                continue
            if gpus is not None and gpu not in gpus:
                continue
            wide = 0
            for (mbs, tp), times in sorted(data.profile(model, folder).items()):
                if tp != 1:
                    wide += 1
                    continue
                blocks = slice(1, spec.num_layers + 1)
                passes = (
                    ("block", "forward", float(np.median(times.forward[blocks]))),
                    ("block", "backward", float(np.median(times.backward[blocks]))),
                    ("head", "forward", float(times.forward[-1])),
                    ("head", "backward", float(times.backward[-1])),
                )
                for layer, direction, seconds in passes:
                    if seconds > 0 and math.isfinite(seconds):
                        samples.append(
                            ProfileSample(model, gpu, mbs, layer, direction, seconds)
                        )
            if wide:
                notes.append(
                    f"{model} on {folder}: {wide} TP > 1 entries left out (their "
                    "times hold the TP all-reduce over the cluster's links, which "
                    "this fit does not calibrate)"
                )
    return samples, notes


def _priced(
    samples: Sequence[ProfileSample],
    sheet: GpuSheet,
    constants: AnalyticalConstants,
) -> np.ndarray:
    """The predictor's seconds of each sample under ``constants``."""
    out = np.empty(len(samples))
    groups: dict[tuple[str, str, int], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.model, s.gpu, s.mbs), []).append(i)
    no_cache = PriceCache(maxsize=0)
    for (model, gpu, mbs), indices in groups.items():
        spec = load_model_spec(model)
        source = AnalyticalSource(
            spec,
            sheet,
            PROFILED_TRAINING,
            constants=constants,
            mbs_values=(mbs,),
            query_key_layer_scaling=model in QK_LAYER_SCALING,
            prices=no_cache,
        )
        times = source.layer_times(spec.name, gpu, mbs, 1)
        blocks = slice(1, spec.num_layers + 1)
        row = {
            ("block", "forward"): float(np.median(times.forward[blocks])),
            ("block", "backward"): float(np.median(times.backward[blocks])),
            ("head", "forward"): float(times.forward[-1]),
            ("head", "backward"): float(times.backward[-1]),
        }
        for i in indices:
            out[i] = row[samples[i].layer, samples[i].direction]
    return out


def _vector(constants: AnalyticalConstants, fields: Sequence[str]) -> np.ndarray:
    return np.array(
        [
            math.log(getattr(constants, f))
            if f in _LOG_FIELDS
            else getattr(constants, f)
            for f in fields
        ]
    )


def _constants(
    x: np.ndarray, fields: Sequence[str], base: AnalyticalConstants
) -> AnalyticalConstants:
    values = {
        f: float(math.exp(v)) if f in _LOG_FIELDS else float(v)
        for f, v in zip(fields, x, strict=True)
    }
    return dataclasses.replace(base, **values)


def _fit(
    samples: Sequence[ProfileSample],
    sheet: GpuSheet,
    fields: Sequence[str],
    base: AnalyticalConstants,
) -> tuple[AnalyticalConstants, np.ndarray]:
    """Least squares of ``log(predicted / measured)`` over ``fields``:
    ``(constants, the Jacobian's column norms at the solution)``."""
    from scipy.optimize import least_squares  # (0.3-0.5 s: a fit only)

    measured = np.log([s.measured for s in samples])
    bounds = np.array(
        [
            (math.log(lo), math.log(hi)) if f in _LOG_FIELDS else (lo, hi)
            for f, (lo, hi) in ((f, CALIBRATED_FIELDS[f]) for f in fields)
        ]
    ).T
    start = np.clip(_vector(base, fields), bounds[0], bounds[1])

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(_priced(samples, sheet, _constants(x, fields, base))) - measured

    found = least_squares(residuals, start, bounds=bounds, x_scale="jac")
    return _constants(found.x, fields, base), np.linalg.norm(found.jac, axis=0)


@dataclasses.dataclass(frozen=True)
class GpuCalibration:
    """One GPU type's calibration.

    Attributes:
        gpu: the GPU sheet's name.
        constants: the fitted constants (of :data:`CALIBRATED_FIELDS`).
        kept: the calibrated fields not fitted, each with the reason.
        models: the profiled models it was fitted on.
        samples: profiled passes fitted.
        fit_error: ``{"median", "max"}`` absolute relative error of the
            fitted samples.
        leave_one_out: the same, each (model, mbs) entry priced by a fit on
            the others (``None``: one entry only).
    """

    gpu: str
    constants: Mapping[str, float]
    kept: Mapping[str, str]
    models: tuple[str, ...]
    samples: int
    fit_error: Mapping[str, float]
    leave_one_out: Mapping[str, float] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "constants": dict(self.constants),
            "kept": dict(self.kept),
            "models": list(self.models),
            "samples": self.samples,
            "fit_error": dict(self.fit_error),
            "leave_one_out": (
                None if self.leave_one_out is None else dict(self.leave_one_out)
            ),
        }


def _summary(errors: Iterable[float]) -> dict[str, float]:
    values = np.abs(np.fromiter(errors, dtype=float))
    return {"median": float(np.median(values)), "max": float(values.max())}


def _fit_gpu(
    gpu: str,
    samples: list[ProfileSample],
    sheet: GpuSheet,
    base: AnalyticalConstants,
) -> GpuCalibration:
    fields = list(CALIBRATED_FIELDS)
    kept: dict[str, str] = {}
    while True:
        if len(samples) < len(fields):
            raise ProblemError(
                f"{gpu}: {len(samples)} profiled passes cannot determine "
                f"{len(fields)} constants ({', '.join(fields)}): profile more "
                "micro-batch sizes or models"
            )
        fitted, norms = _fit(samples, sheet, fields, base)
        unmoved = [
            f for f, n in zip(fields, norms, strict=True) if n < _UNMOVED * norms.max()
        ]
        if not unmoved:
            break
        for f in unmoved:
            kept[f] = "no profiled pass depends on it (left at the fitted default)"
        fields = [f for f in fields if f not in unmoved]
        if not fields:
            raise ProblemError(f"{gpu}: the profiles determine none of the constants")
    predicted = _priced(samples, sheet, fitted)
    errors = predicted / np.array([s.measured for s in samples]) - 1
    entries = sorted({(s.model, s.mbs) for s in samples})
    loo = None
    if len(entries) > 1:
        out = []
        for entry in entries:
            rest = [s for s in samples if (s.model, s.mbs) != entry]
            left = [s for s in samples if (s.model, s.mbs) == entry]
            if len(rest) < len(fields):
                continue
            other, _ = _fit(rest, sheet, fields, base)
            priced = _priced(left, sheet, other)
            out += list(priced / np.array([s.measured for s in left]) - 1)
        loo = _summary(out) if out else None
    return GpuCalibration(
        gpu=gpu,
        constants={f: float(getattr(fitted, f)) for f in fields},
        kept=kept,
        models=tuple(sorted({s.model for s in samples})),
        samples=len(samples),
        fit_error=_summary(errors),
        leave_one_out=loo,
    )


@dataclasses.dataclass(frozen=True)
class ClusterCalibration:
    """Calibrated constants per GPU type (:class:`GpuCalibration`), what the
    fit left out (``notes``), and the cluster's measured links (``links``:
    the profiles' network fits,
    :meth:`~pipedejavu.costmodel.megatron.sailor_data.NetworkTables.tables`;
    ``None``: the GPU sheet's links)."""

    gpus: Mapping[str, GpuCalibration]
    notes: tuple[str, ...] = ()
    links: NetworkTables | None = None

    def fields_for(self, gpus: Iterable[str]) -> dict[str, dict[str, float]]:
        """The calibrated constants of each GPU type of ``gpus`` (the
        sheet's names), for
        :class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource`'s
        ``calibrated``.

        Raises:
            ProblemError: a type the calibration does not hold.
        """
        types = sorted(set(gpus))
        missing = [g for g in types if g not in self.gpus]
        if missing:
            raise ProblemError(
                f"the calibration holds {', '.join(sorted(self.gpus))}, not "
                f"{', '.join(missing)}: calibrate on profiles of that GPU type"
            )
        return {g: dict(self.gpus[g].constants) for g in types}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "gpus": {name: g.to_json() for name, g in sorted(self.gpus.items())},
            "notes": list(self.notes),
            "links": None if self.links is None else self.links.tables(),
        }


def fit_cluster(
    data: SailorData,
    sheet: GpuSheet,
    *,
    models: Sequence[str] | None = None,
    gpus: Sequence[str] | None = None,
    base: AnalyticalConstants = FITTED_ANALYTICAL,
) -> ClusterCalibration:
    """Each GPU type's constants fitted to the TP 1 profiles of ``models``
    (``None``: all) in ``data`` (module docstring), of the GPU types ``gpus``
    (names or aliases of the sheet; ``None``: every profiled one).

    Raises:
        ProblemError: no usable profile, or too few passes for a GPU type.
    """
    wanted = None
    if gpus is not None:
        wanted = set()
        for name in gpus:
            try:
                wanted.add(sheet.resolve(name))
            except KeyError:
                what = f"GPU type {name!r:.40}"
                raise ProblemError(f"{what} is not on the GPU sheet") from None
    samples, notes = profile_samples(data, sheet, models, wanted)
    if not samples:
        raise ProblemError(
            "no usable profile: a calibration needs TP 1 profiles of a model "
            "with a bundled description on a GPU type of the sheet"
            + (f" ({'; '.join(notes)})" if notes else "")
        )
    by_gpu: dict[str, list[ProfileSample]] = {}
    for s in samples:
        by_gpu.setdefault(s.gpu, []).append(s)
    gpus = {
        gpu: _fit_gpu(gpu, rows, sheet, base) for gpu, rows in sorted(by_gpu.items())
    }
    tables = data.network.tables()
    measured = tables["het"] or tables["homo"]["inter"] or tables["intra"]
    return ClusterCalibration(gpus, tuple(notes), data.network if measured else None)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite")
    return float(value)


def _summary_of(value: Any, where: str) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"median", "max"}:
        raise ValueError(f"{where} must be an object with median and max")
    return {k: _number(v, f"{where}.{k}") for k, v in value.items()}


def _gpu_of(name: str, body: Any) -> GpuCalibration:
    where = f"gpus.{name[:40]}"
    if not isinstance(body, Mapping):
        raise ValueError(f"{where} must be an object")
    known = {"constants", "kept", "models", "samples", "fit_error", "leave_one_out"}
    unknown = sorted(str(k)[:40] for k in set(body) - known)[:5]
    if unknown or "constants" not in body:
        raise ValueError(
            f"{where}: expected keys {sorted(known)}, got {sorted(body)[:8]}"
        )
    constants = body["constants"]
    if not isinstance(constants, Mapping) or not constants:
        raise ValueError(f"{where}.constants must be a non-empty object")
    values = {}
    for field, value in constants.items():
        if field not in CALIBRATED_FIELDS:
            raise ValueError(
                f"{where}.constants: {str(field)[:40]!r} is not a calibrated "
                f"constant ({', '.join(CALIBRATED_FIELDS)})"
            )
        lo, hi = CALIBRATED_FIELDS[field]
        number = _number(value, f"{where}.constants.{field}")
        if not lo <= number <= hi:
            raise ValueError(f"{where}.constants.{field} must be in [{lo}, {hi}]")
        values[field] = number
    kept = body.get("kept", {})
    if not isinstance(kept, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) <= 400
        for k, v in kept.items()
    ):
        raise ValueError(f"{where}.kept must map constant names to reasons")
    models = body.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ValueError(f"{where}.models must be a list of model names")
    samples = body.get("samples", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"{where}.samples must be a whole number >= 0")
    return GpuCalibration(
        gpu=name,
        constants=values,
        kept=dict(kept),
        models=tuple(models),
        samples=samples,
        fit_error=_summary_of(body.get("fit_error"), f"{where}.fit_error") or {},
        leave_one_out=_summary_of(body.get("leave_one_out"), f"{where}.leave_one_out"),
    )


def load_calibration(path: str | os.PathLike, sheet: GpuSheet) -> ClusterCalibration:
    """The calibration saved in ``path`` (:meth:`ClusterCalibration.to_json`),
    its GPU types named as ``sheet`` names them.

    Raises:
        ProblemError: one line naming the file: not JSON, too large, another
            format, an unknown key, a value out of its bounds, a GPU type not
            on the sheet.
    """
    name = os.fspath(path)
    data = read_json(path, _MAX_BYTES, "calibration file")
    try:
        if not isinstance(data, Mapping) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(
                f'not a calibration file (no "format": "{CALIBRATION_FORMAT}")'
            )
        keys = {"format", "gpus", "notes", "links"}
        unknown = sorted(str(k)[:40] for k in set(data) - keys)
        if unknown:
            raise ValueError(f"unknown keys {unknown[:5]}")
        gpus = data.get("gpus")
        if not isinstance(gpus, Mapping) or not gpus or len(gpus) > _MAX_GPUS:
            raise ValueError(f"gpus must be an object of 1 to {_MAX_GPUS} GPU types")
        out = {}
        for gpu, body in gpus.items():
            try:
                resolved = sheet.resolve(str(gpu))
            except KeyError:
                raise ValueError(
                    f"GPU type {str(gpu)[:40]!r} is not on the GPU sheet"
                ) from None
            out[resolved] = _gpu_of(resolved, body)
        notes = data.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise ValueError("notes must be a list of strings")
    except ValueError as error:
        raise ProblemError(f"{name}: {error}") from None
    links = data.get("links")
    if links is not None:
        links = NetworkTables.from_tables(links, name)
    return ClusterCalibration(out, tuple(n[:400] for n in notes[:100]), links)
