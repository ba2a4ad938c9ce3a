"""Predicted vs measured: every bundled training run of Sailor's validation set.

For each run (OPT-350M on GH200 nodes; OPT-350M on the heterogeneous RTX
cluster): measured iteration time and peak memory, our prediction with the
fitted constants, our leave-one-out prediction (constants refitted without the
run), and the anchor: Sailor's own closed form as its README describes it,
reimplemented here (``(M - 1) max_s(compute_s + send_s) + sum send + sum compute
+ max update + the slowest stage's all-reduce``; memory ``4.76e9 + 3e8 + 24 B x
parameters + in-flight activations``, raw profiles), next to the anchor's
published summary from the issue. Summaries per cluster: median, mean and max of
the absolute relative error. The suspect run (N3_D1) is listed, not counted.

Usage::

    python benchmarks/predict_real_runs.py [--no-loo] \
        [--out benchmarks/results/predict_real_runs.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import stamp

from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.fit import leave_one_out, load_measured_runs
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data

#: The issue's anchor: Sailor's simulator on these files (median / max |error|).
PUBLISHED_ANCHOR = {
    "gh200-opt350": {"time": (0.145, 0.457), "memory": (0.053, 0.088)},
    "gh200-opt350 (hand-edited profiles)": {"time": (0.060, 0.161)},
    "rtx-opt350": {"time": (0.073, 0.273)},
}
BUCKET = 500_000_000


def _ring_time(fit_coeffs, nbytes, workers):
    """Sailor's bucketed ring all-reduce estimate on a one-GPU link fit."""
    total, left = 0.0, nbytes
    while left > 0:
        bucket = min(left, BUCKET)
        part = bucket / workers
        x = math.log2(part) - math.log2(1e6)
        a, b, c = fit_coeffs
        total += 2 * (workers - 1) * (part / 1e9) / (a * x * x + b * x + c)
        left -= bucket
    return total


def _send(fit_coeffs, nbytes):
    x = math.log2(nbytes) - math.log2(1e6)
    a, b, c = fit_coeffs
    return (nbytes / 1e9) / (a * x * x + b * x + c)


def anchor(plan, data):
    """Sailor's closed form (as its README and planner describe it), raw profiles."""
    model = plan.model
    info = data.model_info(model)
    net = data.network
    mbs, count = plan.mbs, plan.num_microbatches
    compute, update, sends, allreduce, memory = [], [], [], [], []
    num = plan.num_stages
    for s, stage in enumerate(plan.stages):
        layers = slice(stage.start, stage.stop)
        worst, upd = 0.0, 0.0
        for r in stage.replicas:
            t = data.layer_times(model, r.gpu_type, mbs, r.tp)
            worst = max(worst, float((t.forward[layers] + t.backward[layers]).sum()))
            upd = max(upd, float(t.update[0]))
        compute.append(worst)
        update.append(upd)
        act = info.act_output[1][stage.stop - 1] * 4 * mbs
        grad = info.act_output[1][stage.start] * 4 * mbs
        act_t = grad_t = 0.0
        for j, r in enumerate(stage.replicas):
            if s < num - 1:
                o = plan.stages[s + 1].replicas[j]
                fit = net.inter(r.zone, r.gpu_type, o.zone, o.gpu_type, r.tp)
                act_t = max(act_t, _send(fit.coeffs, act))
            if s > 0:
                o = plan.stages[s - 1].replicas[j]
                fit = net.inter(r.zone, r.gpu_type, o.zone, o.gpu_type, r.tp)
                grad_t = max(grad_t, _send(fit.coeffs, grad))
        if 0 < s < num - 1:
            sends.append(act_t + grad_t)
        elif s == num - 1:
            sends.append(2 * grad_t)
        else:
            sends.append(act_t if num <= 3 else 2 * act_t)
        tp = min(r.tp for r in stage.replicas)
        size = info.params[1][layers].sum() * 4 / tp
        ring = 0.0
        for j in range(stage.dp - 1):
            a, b = stage.replicas[j], stage.replicas[j + 1]
            fit = net.inter(a.zone, a.gpu_type, b.zone, b.gpu_type, 1)
            ring = _ring_time(fit.coeffs, size, stage.dp)
        allreduce.append(ring)
        params = info.params[tp][layers].sum()
        act_mem = info.act_mem[tp][layers].sum() * 4 * mbs
        memory.append(4.76e9 + 300e6 + 24 * params + act_mem * (num - s))
    straggler = max(c + x for c, x in zip(compute, sends, strict=True))
    total = (
        (count - 1) * straggler
        + sum(sends)
        + sum(compute)
        + max(update)
        + max(allreduce)
    )
    return total, max(memory)


def _summary(errors):
    values = np.abs(np.asarray(errors, dtype=float))
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    return {
        "median": float(np.median(values)),
        "mean": float(values.mean()),
        "max": float(values.max()),
        "n": int(len(values)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-loo", action="store_true", help="skip leave-one-out")
    parser.add_argument("--out", default="benchmarks/results/predict_real_runs.json")
    args = parser.parse_args()
    data = load_sailor_data()
    runs = load_measured_runs()
    started = time.perf_counter()
    loo = None if args.no_loo else leave_one_out(runs, data)
    loo_time = time.perf_counter() - started
    loo_index = {} if loo is None else {n: i for i, n in enumerate(loo.names)}
    rows = []
    header = (
        f"{'run':40s} {'meas s':>8s} {'pred s':>8s} {'err':>7s} {'LOO':>7s} "
        f"{'anchor':>7s} | {'meas GB':>7s} {'pred GB':>7s} {'err':>7s} {'LOO':>7s} "
        f"{'anchor':>7s}"
    )
    print(header)
    for run in runs:
        prediction = predict_plan(run.plan, data, constants=FITTED_CONSTANTS)
        anchor_time, anchor_memory = anchor(run.plan, data)
        i = loo_index.get(run.name)
        loo_t = math.nan if i is None else float(loo.time_s[i])
        loo_m = math.nan if i is None else float(loo.memory_bytes[i])
        row = {
            "run": run.name,
            "cluster": run.cluster,
            "plan": run.plan.describe(),
            "suspect": run.suspect,
            "measured_time_s": run.time_s,
            "predicted_time_s": prediction.iteration_time_s,
            "time_error": prediction.iteration_time_s / run.time_s - 1,
            "loo_time_error": loo_t / run.time_s - 1,
            "anchor_time_s": anchor_time,
            "anchor_time_error": anchor_time / run.time_s - 1,
            "measured_memory_bytes": run.memory_bytes,
            "predicted_memory_bytes": prediction.peak_memory_bytes,
            "memory_error": prediction.peak_memory_bytes / run.memory_bytes - 1,
            "loo_memory_error": loo_m / run.memory_bytes - 1,
            "anchor_memory_error": anchor_memory / run.memory_bytes - 1,
            "memory_trusted": run.memory_trusted,
        }
        rows.append(row)
        flag = "  (suspect, not counted)" if run.suspect else ""
        print(
            f"{run.name:40s} {run.time_s:8.3f} {prediction.iteration_time_s:8.3f} "
            f"{100 * row['time_error']:+6.1f}% {100 * row['loo_time_error']:+6.1f}% "
            f"{100 * row['anchor_time_error']:+6.1f}% | "
            f"{run.memory_bytes / 1e9:7.2f} {prediction.peak_memory_bytes / 1e9:7.2f} "
            f"{100 * row['memory_error']:+6.1f}% "
            f"{100 * row['loo_memory_error']:+6.1f}% "
            f"{100 * row['anchor_memory_error']:+6.1f}%{flag}"
        )
    summary = {}
    print("\nabsolute relative error, median / mean / max (suspect run left out)")
    for cluster in ("gh200-opt350", "rtx-opt350"):
        mine = [r for r in rows if r["cluster"] == cluster and not r["suspect"]]
        entry = {
            key: _summary([r[key] for r in mine])
            for key in (
                "time_error",
                "loo_time_error",
                "anchor_time_error",
                "memory_error",
                "loo_memory_error",
                "anchor_memory_error",
            )
        }
        entry["signed_time_error_median"] = float(
            np.median([r["time_error"] for r in mine])
        )
        summary[cluster] = entry
        for key, value in entry.items():
            if isinstance(value, dict):
                print(
                    f"  {cluster:14s} {key:20s} {100 * value['median']:5.1f}% "
                    f"{100 * value['mean']:5.1f}% {100 * value['max']:5.1f}%"
                )
    print("  published anchor (issue):", json.dumps(PUBLISHED_ANCHOR))
    result = {
        **stamp.opening_cpu("predict_real_runs"),
        "constants": FITTED_CONSTANTS.to_json(),
        "leave_one_out_seconds": loo_time,
        "published_anchor": PUBLISHED_ANCHOR,
        "summary": summary,
        "runs": rows,
    }
    stamp.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
