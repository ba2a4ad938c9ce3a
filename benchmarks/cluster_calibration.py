"""Calibration to the cluster (issue 46): what fitting the analytical model's
constants per GPU type to OPT-350's profiles, then to measured runs, changes.

1. ``fit_cluster`` on the bundled OPT-350 profiles alone (TP 1 entries for
   the compute constants, TP > 1 entries for the TP link's, every GPU type):
   the constants per type, the fit's and its leave-one-entry-out error on
   the profiles, and the seconds it took.
2. Every bundled measured run (OPT-350 on GH200 nodes, on the RTX cluster),
   priced by the analytical model alone (the model given as its bundled
   description, trained as Sailor ran it: fp32, unfused attention) with the
   project's constants and the GPU sheet's links, and with the calibration
   (its constants and the profiles' measured links): time error against the
   measured ``real``. The runs are not fitted on (the profiles are).
3. A check on another model: GPT-Neo-2.7's block profiles on GH-96 (every
   TP; not fitted on), priced with and without the calibration.
4. The runs (``fit_runs``): per cluster, the profile calibration refined on
   every run of the cluster (the suspect one left out), with each run's
   leave-one-run-out error; and the error against the number of runs used:
   for 1, 2, 3 and 5 runs, ``SUBSETS`` random subsets (seeded) of that many
   runs, each fitted on and the cluster's other runs predicted.

    python benchmarks/cluster_calibration.py [--out FILE]

Writes ``benchmarks/results/cluster_calibration.json`` with date and machine.
"""

from __future__ import annotations

import time

import numpy as np
import stamp

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
from pipedejavu.planning.measured_runs import load_runs, price_run
from pipedejavu.planning.run_fit import fit_runs

MODEL_FILE = stamp.ROOT / "pipedejavu/data/models/sailor-opt-350.json"
RUNS = stamp.ROOT / "pipedejavu/data/runs"
SUBSETS = 8
COUNTS = (1, 2, 3, 5)


def _neo_errors(neo, spec, sheet, calibration, links) -> dict[str, float]:
    """GPT-Neo-2.7's GH-96 block passes priced with ``calibration``."""
    errors = []
    for s in neo:
        source = AnalyticalSource(
            spec,
            sheet,
            PROFILED_TRAINING,
            mbs_values=(s.mbs,),
            calibrated=None
            if calibration is None
            else calibration.fields_for(["GH-96"]),
            measured_links=links,
        )
        times = source.layer_times(spec.name, "GH-96", s.mbs, s.tp)
        row = getattr(times, s.direction)[1 : spec.num_layers + 1]
        errors.append(float(np.median(row)) / s.measured - 1)
    return stamp.abs_summary(errors)


def _runs_part(calibration, runs) -> tuple[dict, object]:
    """Refined on all runs (leave-one-run-out), and on subsets of them."""
    started = time.perf_counter()
    fit = fit_runs(calibration, runs)
    seconds = time.perf_counter() - started
    out = {
        "runs": [r.name.rsplit("/", 1)[-1] for r in runs],
        "profiles_only": stamp.abs_summary(fit.errors("before")),
        "fitted": stamp.abs_summary(fit.errors("after")),
        "leave_one_run_out": stamp.abs_summary(fit.errors("left_out")),
        "per_run": [
            {"run": r.name.rsplit("/", 1)[-1], "measured_s": m, "profiles_only_s": b,
             "fitted_s": a, "left_out_s": o}
            for r, m, b, a, o in zip(runs, fit.measured, fit.before, fit.after,
                                     fit.left_out, strict=True)
        ],
        "fields": {g: list(f) for g, f in fit.fields.items()},
        "fit_seconds": seconds,
    }  # fmt: skip
    print(f"{len(runs)} runs: profiles only {out['profiles_only']}, fitted "
          f"{out['fitted']}, leave one run out {out['leave_one_run_out']} "
          f"({seconds:.0f} s)")  # fmt: skip
    rng = np.random.default_rng(46)
    by_count = {}
    for count in COUNTS:
        errors = []
        for _ in range(SUBSETS):
            chosen = set(rng.choice(len(runs), size=count, replace=False).tolist())
            used = [runs[i] for i in sorted(chosen)]
            rest = [r for i, r in enumerate(runs) if i not in chosen]
            refined = fit_runs(calibration, used, leave_one_out=False).calibration
            errors += [
                price_run(r, refined).iteration_time_s / r.seconds - 1 for r in rest
            ]
        by_count[str(count)] = stamp.abs_summary(errors)
        print(f"  on {count} runs, the others predicted: {by_count[str(count)]}")
    out["by_runs_used"] = by_count
    return out, fit.calibration


def main() -> None:
    out_path = stamp.out_option(
        __doc__, str(stamp.RESULTS / "cluster_calibration.json")
    )
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
            key: stamp.abs_summary([r[f"{key}_error"] for r in mine])
            for key in ("default", "calibrated")
        }
        print(cluster, clusters[cluster])

    neo = [
        s
        for s in profile_samples(data, sheet, ["GPT-Neo-2.7"])[0]
        if s.gpu == "GH-96" and s.layer == "block"
    ]
    links = calibration.links
    spec = load_model_spec("GPT-Neo-2.7")
    other = {
        "default": _neo_errors(neo, spec, sheet, None, None),
        "calibrated": _neo_errors(neo, spec, sheet, calibration, links),
    }
    by_runs, refined = {}, {}
    for cluster in ("rtx-opt350", "gh200-opt350"):
        runs = load_runs([RUNS / cluster])
        by_runs[cluster], refined[cluster] = _runs_part(calibration, runs)
    other["calibrated_and_runs"] = _neo_errors(
        neo, spec, sheet, refined["gh200-opt350"], links
    )
    print("GPT-Neo-2.7 blocks on GH-96 (not fitted on):", other)
    out = {
        "fit_on": "OPT-350 profiles, TP 1 entries, every GPU type",
        "fit_seconds": fit_s,
        "calibration": calibration.to_json(),
        "runs": rows,
        "clusters": clusters,
        "gpt_neo_blocks_gh96": other,
        "runs_fit": by_runs,
        **stamp.stamp("unknown"),
    }
    stamp.save(out_path, out, end="\n")


if __name__ == "__main__":
    main()
