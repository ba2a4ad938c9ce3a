"""What choosing the micro-batch size (and so the number of micro-batches) gains.

For every measured run in the bundled Sailor data (``measured/``), the setting
is the run's model, its GPUs (the types and counts it used) and its global
batch. Two plans, both exact under our planning model and re-scored by our
predictor: the best plan at the run's micro-batch size (``mbs_values=[mbs]``),
and the best plan over every profiled micro-batch size (what ``plan`` does).
The gain is ``T(best at the run's mbs) / T(best) - 1``; the measured run's own
plan is predicted too (its measured time beside it).

Usage::

    python benchmarks/mbs_choice.py [--out benchmarks/results/mbs_choice.json]
"""

from __future__ import annotations

import json
import statistics
import time

import stamp

from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.costmodel.megatron.fit import load_measured_runs
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.training import plan_training


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/mbs_choice.json")
    data = load_sailor_data()
    rows = []
    started = time.perf_counter()
    for run in load_measured_runs():
        if run.suspect:
            continue
        plan = run.plan
        pool = plan.gpus_by_type()
        ran = predict_plan(plan, data).iteration_time_s
        best = plan_training(plan.model, pool, plan.gbs)
        try:
            fixed = plan_training(plan.model, pool, plan.gbs, mbs_values=[plan.mbs])
            fixed_time = fixed.iteration_time_s
            fixed_plan = fixed.plan.describe()
        except InfeasibleProblemError:
            fixed_time, fixed_plan = None, None
        row = {
            "run": run.name,
            "gpus": pool,
            "gbs": plan.gbs,
            "run_mbs": plan.mbs,
            "run_plan": plan.describe(),
            "measured_s": run.time_s,
            "run_predicted_s": ran,
            "best_at_run_mbs_s": fixed_time,
            "best_at_run_mbs_plan": fixed_plan,
            "best_s": best.iteration_time_s,
            "best_mbs": best.plan.mbs,
            "best_microbatches": best.plan.num_microbatches,
            "best_plan": best.plan.describe(),
            "gain": None
            if fixed_time is None
            else fixed_time / best.iteration_time_s - 1,
        }
        rows.append(row)
        print(
            f"{run.name:42s} gbs {plan.gbs:5d} mbs {plan.mbs:3d} -> best mbs "
            f"{best.plan.mbs:3d} ({best.plan.num_microbatches} micro-batches): "
            f"{fixed_time if fixed_time is None else round(fixed_time, 4)} s -> "
            f"{best.iteration_time_s:.4f} s"
            + ("" if row["gain"] is None else f", gain {100 * row['gain']:.1f}%")
        )
    # Runs that differ only in their plan share a setting: count each once.
    settings = {
        (json.dumps(r["gpus"], sort_keys=True), r["gbs"], r["run_mbs"]): r for r in rows
    }
    gains = [r["gain"] for r in settings.values() if r["gain"] is not None]
    summary = {
        "runs": len(rows),
        "settings": len(settings),
        "mbs_changed": sum(r["best_mbs"] != r["run_mbs"] for r in rows),
        "settings_mbs_changed": sum(
            r["best_mbs"] != r["run_mbs"] for r in settings.values()
        ),
        "gain_median": statistics.median(gains),
        "gain_max": max(gains),
        "gain_mean": statistics.fmean(gains),
    }
    print(
        f"{summary['runs']} runs, {summary['settings']} distinct settings "
        f"(GPUs, gbs, run mbs); best mbs differs in {summary['mbs_changed']} "
        f"runs; over settings: "
        f"gain median {100 * summary['gain_median']:.1f}%, mean "
        f"{100 * summary['gain_mean']:.1f}%, max {100 * summary['gain_max']:.1f}%"
    )
    fields = {"summary": summary, "rows": rows}
    stamp.write_opened(out, "mbs_choice", started, fields)


if __name__ == "__main__":
    main()
