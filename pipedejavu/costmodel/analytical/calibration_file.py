"""What a calibration to the user's cluster is, and its file.

A :class:`ClusterCalibration` holds, per GPU type, the analytical model's
constants fitted to what the user measured on the cluster
(:class:`GpuCalibration`: the compute constants from TP 1 profiles, the TP
link's from TP > 1 profiles, :data:`CALIBRATED_FIELDS`), the cluster's
measured links, and notes on what the fit left out. Fitted by
:func:`~pipedejavu.costmodel.analytical.cluster_fit.fit_cluster` (profiles);
saved as JSON (:meth:`ClusterCalibration.to_json`) and read back with
:func:`load_calibration`, which checks every key and value (a file is
untrusted: one line naming it for anything wrong).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from pipedejavu.core.files import read_json
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.calibrate import FIT_FIELDS
from pipedejavu.costmodel.analytical.roofline import MAX_LINK_EFFICIENCY
from pipedejavu.costmodel.megatron.sailor_data import NetworkTables
from pipedejavu.io.gpu_sheet import GpuSheet

__all__ = [
    "CALIBRATED_FIELDS",
    "CALIBRATION_FORMAT",
    "COMPUTE_FIELDS",
    "LINK_FIELDS",
    "ClusterCalibration",
    "GpuCalibration",
    "load_calibration",
]

#: The compute constants a GPU type's TP 1 profiles calibrate, with bounds.
COMPUTE_FIELDS: dict[str, tuple[float, float]] = {
    name: FIT_FIELDS[name]
    for name in (
        "tensor_efficiency",
        "backward_tensor_efficiency",
        "memory_efficiency",
        "kernel_overhead_s",
    )
}
#: The TP link's constants its TP > 1 profiles calibrate, with bounds: the
#: share of the link's bandwidth (measured or the sheet's) a TP collective
#: reaches (above 1 where the collective beats the pairs the link was
#: measured with) and the seconds each collective costs beyond its bytes.
LINK_FIELDS: dict[str, tuple[float, float]] = {
    "link_efficiency": (0.02, MAX_LINK_EFFICIENCY),
    "collective_latency_s": FIT_FIELDS["collective_latency_s"],
}
#: Every calibrated constant, with its bounds.
CALIBRATED_FIELDS: dict[str, tuple[float, float]] = {**COMPUTE_FIELDS, **LINK_FIELDS}
#: The constants fitted on the logarithm of their value.
LOG_FIELDS = frozenset({"kernel_overhead_s", "collective_latency_s"})
#: The file's format tag.
CALIBRATION_FORMAT = "pipedejavu-calibration/1"
_MAX_BYTES = 1 << 20
_MAX_GPUS = 64


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
            "fit_error": dict(self.fit_error) or None,
            "leave_one_out": (
                None if self.leave_one_out is None else dict(self.leave_one_out)
            ),
        }


@dataclasses.dataclass(frozen=True)
class ClusterCalibration:
    """Calibrated constants per GPU type (:class:`GpuCalibration`), what the
    fit left out (``notes``), and the cluster's measured links (``links``:
    the profiles' network fits,
    :meth:`~pipedejavu.costmodel.megatron.sailor_data.NetworkTables.tables`;
    ``None``: the GPU sheet's links), and what measured runs refined
    (``runs``: :func:`~pipedejavu.planning.run_fit.record`; ``None``: no
    run)."""

    gpus: Mapping[str, GpuCalibration]
    notes: tuple[str, ...] = ()
    links: NetworkTables | None = None
    runs: Mapping[str, Any] | None = None

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
            "runs": None if self.runs is None else dict(self.runs),
        }


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


def _runs_of(value: Any) -> dict[str, Any] | None:
    """The ``runs`` record checked: what the runs refined, as written."""
    if value is None:
        return None
    keys = {"files", "fields", "kept", "error_before", "fit_error"}
    keys |= {"leave_one_out", "run_sigma", "prior_sigma"}
    if not isinstance(value, Mapping) or set(value) != keys:
        raise ValueError(f"runs must be an object with keys {sorted(keys)}")
    files = value["files"]
    if (
        not isinstance(files, list)
        or len(files) > 1000
        or not all(isinstance(f, str) and len(f) <= 400 for f in files)
    ):
        raise ValueError("runs.files must be a list of file names")
    for key in ("fields", "kept"):
        body = value[key]
        if (
            not isinstance(body, Mapping)
            or len(body) > _MAX_GPUS
            or not all(
                isinstance(v, list | Mapping) and len(v) <= len(CALIBRATED_FIELDS)
                for v in body.values()
            )
        ):
            raise ValueError(f"runs.{key} must map GPU types to constants")
    for key in ("error_before", "fit_error", "leave_one_out"):
        _summary_of(value[key], f"runs.{key}")
    for key in ("run_sigma", "prior_sigma"):
        _number(value[key], f"runs.{key}")
    return dict(value)


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
        keys = {"format", "gpus", "notes", "links", "runs"}
        unknown = sorted(str(k)[:40] for k in set(data) - keys)
        if unknown:
            raise ValueError(f"unknown keys {unknown[:5]}")
        gpus = data.get("gpus")
        if not isinstance(gpus, Mapping) or not gpus or len(gpus) > _MAX_GPUS:
            raise ValueError(f"gpus must be an object of 1 to {_MAX_GPUS} GPU types")
        out = {}
        for gpu, body in gpus.items():
            resolved = sheet.resolve_listed(gpu)
            out[resolved] = _gpu_of(resolved, body)
        notes = data.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise ValueError("notes must be a list of strings")
        runs = _runs_of(data.get("runs"))
    except ValueError as error:
        raise ProblemError(f"{name}: {error}") from None
    links = data.get("links")
    if links is not None:
        links = NetworkTables.from_tables(links, name)
    return ClusterCalibration(out, tuple(n[:400] for n in notes[:100]), links, runs)
