"""Calibration to the user's cluster: the analytical model's constants fitted
per GPU type to per-layer profiles of other models measured on it.

A datasheet says what a GPU could do; a profile says what it did. Given a
folder of profiles in Sailor's layout (``profiles/<MODEL>/<GPU>/
profile.json``, what ``pipedejavu profile`` writes too), :func:`fit_cluster`
fits, for each GPU type, the constants the profiles can determine, in two
steps: on the TP 1 entries, the tensor-core efficiency of the forward and of
the backward GEMMs, the memory efficiency of the element-wise kernels and the
launch overhead per kernel (:data:`~pipedejavu.costmodel.analytical.
calibration_file.COMPUTE_FIELDS`); then, those held, on the TP > 1 entries
(whose times hold the TP all-reduces over the node's link), the share of the
link's bandwidth a TP collective reaches and its latency (:data:`~pipedejavu.
costmodel.analytical.calibration_file.LINK_FIELDS`; the link is the
profiles' measured intra-node fit where they hold one, the sheet's
otherwise). Every other constant keeps the project's fitted value
(:data:`~pipedejavu.costmodel.analytical.roofline.FITTED_ANALYTICAL`), and
the result says which and why.

The fit prices each profiled layer with the predictor's own code: an
:class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource` of the
profiled model, trained as the profiles measured it
(:data:`PROFILED_TRAINING`), whose layer times are compared with the
profile's; least squares on the logarithm of their ratio, each constant
within its bounds. A constant the samples do not move (its column of the
Jacobian vanishes against the others, or it is a combination of them) is not
fitted and is named with the reason. The leave-one-out error leaves out one
(model, micro-batch size) entry at a time (every TP of it), fits both steps
on the rest and prices it.

What a calibration is and its file:
:mod:`~pipedejavu.costmodel.analytical.calibration_file`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.calibrate import QK_LAYER_SCALING
from pipedejavu.costmodel.analytical.calibration_file import (
    CALIBRATED_FIELDS,
    COMPUTE_FIELDS,
    LINK_FIELDS,
    LOG_FIELDS,
    ClusterCalibration,
    GpuCalibration,
)
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
    "PROFILED_TRAINING",
    "ProfileSample",
    "fit_cluster",
    "profile_samples",
]

#: How Sailor's profiles trained (Megatron-DeepSpeed: fp32, unfused
#: attention, no recomputation).
PROFILED_TRAINING = TrainingOptions("fp32", flash_attention=False)
#: A column of the Jacobian this much below the largest moves no sample.
_UNMOVED = 1e-3


@dataclasses.dataclass(frozen=True)
class ProfileSample:
    """One profiled pass: ``layer`` (``block``: the median over the model's
    blocks; ``head``) and ``direction`` of ``model`` at micro-batch ``mbs``
    and TP ``tp`` on ``gpu`` (the sheet's name), ``measured`` seconds."""

    model: str
    gpu: str
    mbs: int
    layer: str
    direction: str
    measured: float
    tp: int = 1


def profile_samples(
    data: SailorData,
    sheet: GpuSheet,
    models: Sequence[str] | None = None,
    gpus: Collection[str] | None = None,
) -> tuple[list[ProfileSample], list[str]]:
    """``(samples, notes)``: every block and head pass, at every TP, of the
    profiles of ``models`` (``None``: every model the profiles hold) whose
    shape is known (a bundled preset) on a GPU type of the sheet (of
    ``gpus``, the sheet's names, where given); the notes say what was left
    out and why."""
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
            for (mbs, tp), times in sorted(data.profile(model, folder).items()):
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
                            ProfileSample(
                                model, gpu, mbs, layer, direction, seconds, tp
                            )
                        )
    return samples, notes


def _priced(
    samples: Sequence[ProfileSample],
    sheet: GpuSheet,
    constants: AnalyticalConstants,
    links: NetworkTables | None,
) -> np.ndarray:
    """The predictor's seconds of each sample under ``constants``, TP
    collectives over ``links`` (``None``: the sheet's)."""
    out = np.empty(len(samples))
    groups: dict[tuple[str, str, int, int], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.model, s.gpu, s.mbs, s.tp), []).append(i)
    no_cache = PriceCache(maxsize=0)
    for (model, gpu, mbs, tp), indices in groups.items():
        spec = load_model_spec(model)
        source = AnalyticalSource(
            spec,
            sheet,
            PROFILED_TRAINING,
            constants=constants,
            mbs_values=(mbs,),
            query_key_layer_scaling=model in QK_LAYER_SCALING,
            prices=no_cache,
            measured_links=links,
        )
        times = source.layer_times(spec.name, gpu, mbs, tp)
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
            if f in LOG_FIELDS
            else getattr(constants, f)
            for f in fields
        ]
    )


def _constants(
    x: np.ndarray, fields: Sequence[str], base: AnalyticalConstants
) -> AnalyticalConstants:
    values = {}
    for f, v in zip(fields, x, strict=True):
        lo, hi = CALIBRATED_FIELDS[f]  # (exp(log(hi)) may pass hi)
        values[f] = min(
            max(float(math.exp(v)) if f in LOG_FIELDS else float(v), lo), hi
        )
    return dataclasses.replace(base, **values)


def _fit(
    samples: Sequence[ProfileSample],
    sheet: GpuSheet,
    fields: Sequence[str],
    base: AnalyticalConstants,
    links: NetworkTables | None,
) -> tuple[AnalyticalConstants, np.ndarray]:
    """Least squares of ``log(predicted / measured)`` over ``fields``:
    ``(constants, the Jacobian's column norms at the solution)``."""
    from scipy.optimize import least_squares  # (0.3-0.5 s: a fit only)

    measured = np.log([s.measured for s in samples])
    bounds = np.array(
        [
            (math.log(lo), math.log(hi)) if f in LOG_FIELDS else (lo, hi)
            for f, (lo, hi) in ((f, CALIBRATED_FIELDS[f]) for f in fields)
        ]
    ).T
    start = np.clip(_vector(base, fields), bounds[0], bounds[1])

    def residuals(x: np.ndarray) -> np.ndarray:
        constants = _constants(x, fields, base)
        return np.log(_priced(samples, sheet, constants, links)) - measured

    found = least_squares(residuals, start, bounds=bounds, x_scale="jac")
    return _constants(found.x, fields, base), np.linalg.norm(found.jac, axis=0)


def _fit_step(
    gpu: str,
    samples: list[ProfileSample],
    sheet: GpuSheet,
    fields: Sequence[str],
    base: AnalyticalConstants,
    links: NetworkTables | None,
) -> tuple[AnalyticalConstants, list[str], dict[str, str]]:
    """``fields`` fitted to ``samples`` from ``base``, the unmoved ones
    dropped and refitted without: ``(constants, fields fitted, kept with
    reasons)``."""
    fields, kept = list(fields), {}
    while True:
        if len(samples) < len(fields):
            raise ProblemError(
                f"{gpu}: {len(samples)} profiled passes cannot determine "
                f"{len(fields)} constants ({', '.join(fields)}): profile more "
                "micro-batch sizes or models"
            )
        fitted, norms = _fit(samples, sheet, fields, base, links)
        unmoved = [
            f for f, n in zip(fields, norms, strict=True) if n < _UNMOVED * norms.max()
        ]
        if not unmoved:
            return fitted, fields, kept
        for f in unmoved:
            kept[f] = "no profiled pass depends on it (left at the fitted default)"
        fields = [f for f in fields if f not in unmoved]
        if not fields:
            raise ProblemError(f"{gpu}: the profiles determine none of the constants")


def _fit_both(
    gpu: str,
    samples: list[ProfileSample],
    sheet: GpuSheet,
    base: AnalyticalConstants,
    links: NetworkTables | None,
    fields: tuple[Sequence[str], Sequence[str]] | None = None,
) -> tuple[AnalyticalConstants, list[str], dict[str, str]]:
    """The compute step on the TP 1 samples, then the link step on the TP > 1
    samples (module docstring); ``fields``: the fields of each step, as a
    first fit found them (``None``: find them)."""
    narrow = [s for s in samples if s.tp == 1]
    wide = [s for s in samples if s.tp > 1]
    kept: dict[str, str] = {}
    if not narrow:
        raise ProblemError(
            f"{gpu}: no TP 1 profile (the compute constants are fitted on "
            "TP 1 entries, the TP link's on TP > 1 entries)"
        )
    if fields is None:
        fitted, compute, kept = _fit_step(
            gpu, narrow, sheet, COMPUTE_FIELDS, base, links
        )
    else:
        compute = list(fields[0])
        fitted, _ = _fit(narrow, sheet, compute, base, links)
    link: list[str] = []
    if fields is not None:
        link = list(fields[1])
        if link:
            fitted, _ = _fit(wide, sheet, link, fitted, links)
    elif len(wide) >= len(LINK_FIELDS):
        fitted, link, more = _fit_step(gpu, wide, sheet, LINK_FIELDS, fitted, links)
        kept.update(more)
    else:
        for f in LINK_FIELDS:
            kept[f] = "no TP > 1 profile to fit it on (left at the fitted default)"
    return fitted, compute + link, kept


def _summary(errors: Iterable[float]) -> dict[str, float]:
    values = np.abs(np.fromiter(errors, dtype=float))
    return {"median": float(np.median(values)), "max": float(values.max())}


def _fit_gpu(
    gpu: str,
    samples: list[ProfileSample],
    sheet: GpuSheet,
    base: AnalyticalConstants,
    links: NetworkTables | None,
) -> GpuCalibration:
    fitted, fields, kept = _fit_both(gpu, samples, sheet, base, links)
    steps = (
        [f for f in fields if f in COMPUTE_FIELDS],
        [f for f in fields if f in LINK_FIELDS],
    )
    predicted = _priced(samples, sheet, fitted, links)
    errors = predicted / np.array([s.measured for s in samples]) - 1
    entries = sorted({(s.model, s.mbs) for s in samples})
    loo = None
    if len(entries) > 1:
        out = []
        for entry in entries:
            rest = [s for s in samples if (s.model, s.mbs) != entry]
            left = [s for s in samples if (s.model, s.mbs) == entry]
            narrow = sum(s.tp == 1 for s in rest)
            wide = len(rest) - narrow
            if narrow < len(steps[0]) or wide < len(steps[1]):
                continue
            other, _, _ = _fit_both(gpu, rest, sheet, base, links, steps)
            priced = _priced(left, sheet, other, links)
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


def fit_cluster(
    data: SailorData,
    sheet: GpuSheet,
    *,
    models: Sequence[str] | None = None,
    gpus: Sequence[str] | None = None,
    base: AnalyticalConstants = FITTED_ANALYTICAL,
) -> ClusterCalibration:
    """Each GPU type's constants fitted to the profiles of ``models``
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
            "no usable profile: a calibration needs profiles of a model "
            "with a bundled description on a GPU type of the sheet"
            + (f" ({'; '.join(notes)})" if notes else "")
        )
    by_gpu: dict[str, list[ProfileSample]] = {}
    for s in samples:
        by_gpu.setdefault(s.gpu, []).append(s)
    tables = data.network.tables()
    measured = tables["het"] or tables["homo"]["inter"] or tables["intra"]
    links = data.network if measured else None
    gpus = {
        gpu: _fit_gpu(gpu, rows, sheet, base, links)
        for gpu, rows in sorted(by_gpu.items())
    }
    return ClusterCalibration(gpus, tuple(notes), links)
