"""``pipedejavu calibrate --profiles DIR [--runs RUN ...] --out CAL.json``:
the analytical model's constants fitted per GPU type to the cluster's own
per-layer profiles (:func:`~pipedejavu.costmodel.analytical.cluster_fit.
fit_cluster`), then refined on measured runs where given
(:func:`~pipedejavu.planning.run_fit.fit_runs`), for ``predict`` and
``plan`` to take with ``--calibration CAL.json``.

The report names, per GPU type, the constants fitted and their values, those
kept at the project's fitted values and why, and the error of the fit on
the profiles, in sample and leave-one-entry-out; with runs, each run's
measured and predicted seconds before the runs, after them and left out of
them, and the constants the runs moved. What the fit left out (models
without a bundled description, GPU types not on the sheet) is said too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipedejavu.cli.parsing import add_json_option
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import json_text
from pipedejavu.costmodel.analytical.calibration_file import (
    CALIBRATED_FIELDS,
    ClusterCalibration,
    load_calibration,
)
from pipedejavu.costmodel.analytical.cluster_fit import fit_cluster
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.measured_runs import load_runs
from pipedejavu.planning.run_fit import RunFit, fit_runs

__all__ = ["add_calibration_flag", "add_parser", "calibration_of", "run"]


def add_parser(commands: Any) -> None:
    """Register ``calibrate`` on the command line's sub-parsers."""
    calibrate = commands.add_parser(
        "calibrate",
        help="fit the predictor's constants per GPU type to the cluster's own "
        "per-layer profiles and measured runs",
        description="Fit, per GPU type, the tensor-core and memory efficiencies "
        "and the kernel overhead of the analytical model to the TP 1 per-layer "
        "profiles of other models on the cluster (Sailor's layout), the TP "
        "link's efficiency and latency to its TP > 1 profiles, refine them on "
        "measured runs (--runs), and write them for predict and plan "
        "--calibration.",
    )
    calibrate.add_argument(
        "--profiles",
        metavar="DIR",
        required=True,
        help="a folder laid out like Sailor's data (profiles/<MODEL>/<GPU>/"
        "profile.json, llm_info.json)",
    )
    calibrate.add_argument(
        "--models",
        metavar="M[,M...]",
        help="the profiled models to fit on (default: every one with a bundled "
        "description)",
    )
    calibrate.add_argument(
        "--gpus",
        metavar="T[,T...]",
        help="the GPU types to calibrate (default: every profiled one)",
    )
    calibrate.add_argument(
        "--runs",
        metavar="RUN",
        nargs="+",
        help="run files (pipedejavu-run/1: a plan that ran and its training log "
        "or measured seconds) or folders of them, to refine the constants on",
    )
    calibrate.add_argument(
        "--gpu-sheet", metavar="FILE", help="a JSON file extending the GPU sheet"
    )
    calibrate.add_argument(
        "--out", metavar="CAL.json", required=True, help="the calibration file"
    )
    add_json_option(calibrate)


def add_calibration_flag(parser: Any) -> None:
    """``--calibration CAL.json`` on ``parser`` (``predict``)."""
    parser.add_argument(
        "--calibration",
        metavar="CAL.json",
        help="price the analytical model with constants fitted to the cluster "
        "(pipedejavu calibrate); default: the project's",
    )


def calibration_of(args: argparse.Namespace) -> ClusterCalibration | None:
    """The calibration ``--calibration`` names, read (``None``: none given)."""
    path = getattr(args, "calibration", None)
    if path is None:
        return None
    return load_calibration(path, load_gpu_sheet(args.gpu_sheet))


def _models(text: str | None, flag: str) -> list[str] | None:
    """The names of a comma-separated ``flag`` (``None``: not given)."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names) or len(names) > 64 or len(set(names)) != len(names):
        raise ProblemError(
            f"{flag} must be 1 to 64 distinct names separated by commas, got "
            f"{text[:80]!r}"
        )
    return names


def _at_bound(field: str, value: float) -> str:
    """`` (at its upper bound)`` where the fit stopped at a bound: the
    profiles asked for more than the constant may give."""
    lo, hi = CALIBRATED_FIELDS[field]
    if value >= hi * (1 - 1e-6):
        return " (at its upper bound)"
    return " (at its lower bound)" if value <= lo * (1 + 1e-6) else ""


def _report_runs(fit: RunFit) -> None:
    print(f"runs ({len(fit.runs)}): seconds per iteration, measured and predicted")
    print("  run                              measured   before    after  left out")
    left = fit.left_out if fit.left_out is not None else [None] * len(fit.runs)
    for i, name in enumerate(fit.runs):
        row = f"  {os.path.basename(name)[:32]:32s} {fit.measured[i]:8.3f}"
        row += f" {fit.before[i]:8.3f} {fit.after[i]:8.3f}"
        row += "" if left[i] is None else f" {left[i]:9.3f}"
        print(row)
    record = fit.calibration.runs or {}
    for key, words in (
        ("error_before", "before the runs"),
        ("fit_error", "fitted on them"),
        ("leave_one_out", "leave-one-run-out"),
    ):
        if record.get(key) is not None:
            error = record[key]
            print(f"  error {words}: median {error['median']:.1%}, max "
                  f"{error['max']:.1%}")  # fmt: skip
    for gpu, fields in fit.fields.items():
        values = fit.calibration.gpus[gpu].constants
        moved = ", ".join(
            f"{f} {values[f]:.4g}" + _at_bound(f, values[f]) for f in fields
        )
        print(f"  {gpu}: refined {moved or 'nothing'}")
        for field, why in fit.kept.get(gpu, {}).items():
            print(f"    kept {field}: {why}")


def run(args: argparse.Namespace) -> int:
    if not Path(args.profiles).is_dir():
        raise ProblemError(f"--profiles {args.profiles}: not a folder")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ProblemError(f"--out {args.out}: not a file in an existing folder")
    sheet = load_gpu_sheet(args.gpu_sheet)
    runs = load_runs(args.runs) if args.runs else None  # (bad files: before fits)
    data = load_sailor_data(args.profiles)
    print(f"calibrating on {os.fspath(args.profiles)} ...", file=sys.stderr)
    found = fit_cluster(
        data, sheet, models=_models(args.models, "--models"),
        gpus=_models(args.gpus, "--gpus"),
    )  # fmt: skip
    fit = None
    if runs:
        print(f"refining on {len(runs)} measured runs ...", file=sys.stderr)
        fit = fit_runs(
            found, runs, gpu_sheet=args.gpu_sheet,
            progress=lambda text: print(text, file=sys.stderr),
        )  # fmt: skip
        found = fit.calibration
    text = json_text(found.to_json(), indent=1)
    out.write_text(text + "\n")
    if args.json:
        print(text)
        return 0
    for gpu, gpu_fit in found.gpus.items():
        values = ", ".join(
            f"{k} {v:.4g}" + _at_bound(k, v) for k, v in gpu_fit.constants.items()
        )
        print(f"{gpu} ({gpu_fit.samples} passes of {', '.join(gpu_fit.models)}): "
              f"{values}")  # fmt: skip
        for field, why in gpu_fit.kept.items():
            print(f"  kept {field}: {why}")
        fitted = gpu_fit.fit_error
        error = f"  error on the profiles: fit median {fitted['median']:.1%}, max "
        error += f"{fitted['max']:.1%}"
        if gpu_fit.leave_one_out is not None:
            loo = gpu_fit.leave_one_out
            error += f"; leave-one-out median {loo['median']:.1%}, max {loo['max']:.1%}"
        print(error)
    if fit is not None:
        _report_runs(fit)
    for note in found.notes:
        print(f"note: {note}")
    print(f"wrote {out}")
    return 0
