"""Calibration to the cluster (issue 46's first part): what fitting the
analytical model's constants per GPU type to OPT-350's profiles changes.

1. ``fit_cluster`` on the bundled OPT-350 profiles alone (TP 1 entries, every
   GPU type): the constants per type, the fit's and its leave-one-entry-out
   error on the profiles, and the seconds it took.
2. Every bundled measured run (OPT-350 on GH200 nodes, on the RTX cluster),
   priced by the analytical model alone (the model given as its bundled
   description, trained as Sailor ran it: fp32, unfused attention) with the
   project's constants and the GPU sheet's links, and with the calibration
   (its constants and the profiles' measured links): time error against the
   measured ``real``. The runs are not fitted on (the profiles are).
3. A check on another model: GPT-Neo-2.7's TP 1 block profiles on GH-96
   (not fitted on), priced with and without the calibration.

    python benchmarks/cluster_calibration.py [--out FILE]

Writes ``benchmarks/results/cluster_calibration.json`` with date and machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pipedejavu.costmodel.analytical.cluster_fit import (
    PROFILED_TRAINING,
    fit_cluster,
    profile_samples,
)
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.fit import load_measured_runs
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.any_model import choose_cost_source, predict_any_plan

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILE = ROOT / "pipedejavu/data/models/sailor-opt-350.json"


def _summary(errors) -> dict[str, float]:
    values = np.abs(np.asarray(errors, dtype=float))
    return {"median": float(np.median(values)), "max": float(values.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/cluster_calibration.json")
    )
    args = parser.parse_args()
    data, sheet = load_sailor_data(), load_gpu_sheet()
    started = time.perf_counter()
    calibration = fit_cluster(data, sheet, models=["OPT-350"])
    fit_s = time.perf_counter() - started
    print(f"fit on OPT-350's profiles: {fit_s:.1f} s")
    for gpu, fit in calibration.gpus.items():
        print(f"  {gpu}: {dict(fit.constants)} loo {fit.leave_one_out}")

    rows = []
    for run in load_measured_runs():
        times = {}
        for name, cal in (("default", None), ("calibrated", calibration)):
            choice = choose_cost_source(
                str(MODEL_FILE),
                run.plan.gpus_by_type(),
                options=PROFILED_TRAINING,
                calibration=cal,
            )
            plan = run.plan.replace(model=choice.model)
            _, prediction = predict_any_plan(plan, choice)
            times[name] = prediction.iteration_time_s
        row = {
            "run": run.name,
            "cluster": run.cluster,
            "suspect": run.suspect,
            "measured_s": run.time_s,
            "default_s": times["default"],
            "calibrated_s": times["calibrated"],
            "default_error": times["default"] / run.time_s - 1,
            "calibrated_error": times["calibrated"] / run.time_s - 1,
        }
        rows.append(row)
        print(
            f"{run.name:40s} {run.time_s:8.3f} s: default "
            f"{100 * row['default_error']:+6.1f}%, calibrated "
            f"{100 * row['calibrated_error']:+6.1f}%"
        )
    clusters = {}
    for cluster in sorted({r["cluster"] for r in rows}):
        mine = [r for r in rows if r["cluster"] == cluster and not r["suspect"]]
        clusters[cluster] = {
            key: _summary([r[f"{key}_error"] for r in mine])
            for key in ("default", "calibrated")
        }
        print(cluster, clusters[cluster])

    neo = [
        s
        for s in profile_samples(data, sheet, ["GPT-Neo-2.7"])[0]
        if s.gpu == "GH-96" and s.layer == "block"
    ]
    spec = load_model_spec("GPT-Neo-2.7")
    other = {}
    for name, fields in (("default", None), ("calibrated", calibration)):
        errors = []
        for s in neo:
            source = AnalyticalSource(
                spec,
                sheet,
                PROFILED_TRAINING,
                mbs_values=(s.mbs,),
                calibrated=None if fields is None else fields.fields_for(["GH-96"]),
            )
            times = source.layer_times(spec.name, "GH-96", s.mbs, 1)
            row = getattr(times, s.direction)[1 : spec.num_layers + 1]
            errors.append(float(np.median(row)) / s.measured - 1)
        other[name] = _summary(errors)
    print("GPT-Neo-2.7 blocks on GH-96 (not fitted on):", other)
    out = {
        "fit_on": "OPT-350 profiles, TP 1 entries, every GPU type",
        "fit_seconds": fit_s,
        "calibration": calibration.to_json(),
        "runs": rows,
        "clusters": clusters,
        "gpt_neo_blocks_gh96": other,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node() or 'unknown'} ({platform.machine()}, "
        f"{__import__('os').cpu_count()} cores)",
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
