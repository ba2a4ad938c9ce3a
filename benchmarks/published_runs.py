"""Predicted vs published and measured runs, with no profile of the model.

Three checks of the analytical cost model (issue: predict any model on any GPU):

1. **Megatron-LM SC'21 Table 1** (GPT 1.7B-1T on 32-3,072 A100-80, fp16,
   full recomputation, interleaved on four): TFLOP/s per GPU predicted from
   the launch flags alone. The two 16-bit constants are fitted on these ten
   runs, so the error to quote is leave-one-out (refit without the run,
   predict it); the in-sample error of the frozen constants is listed beside
   it, and the anchor "one constant MFU for all ten runs" (its leave-one-out).
2. **Sailor's measured OPT-350M runs** (GH200 and the RTX cluster), predicted
   with no OPT-350M profile: the analytical constants refitted on the other
   models' profiles only, the predictor's free constants (per-instruction
   overhead, memory reserve, activation overhead) refitted without each run
   (leave-one-out), the measured link fits of those clusters (a network, not
   a profile of the model).
3. The same runs with their profiles, for reference (today's predictor).

Usage::

    python benchmarks/published_runs.py [--out benchmarks/results/published_runs.json]
"""

from __future__ import annotations

import time

import numpy as np
import stamp

from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.calibrate import (
    QK_LAYER_SCALING,
    calibration_set,
    fit_constants,
)
from pipedejavu.costmodel.analytical.roofline import HALF_PRECISION_ANALYTICAL
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.fit import leave_one_out, load_measured_runs
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.published_runs import (
    leave_one_out as published_leave_one_out,
)
from pipedejavu.planning.published_runs import (
    load_published_runs,
    predict_published,
)


def _summary(errors) -> dict[str, float]:
    errors = np.abs(np.asarray(errors, dtype=float))
    errors = errors[np.isfinite(errors)]
    return {**stamp.abs_summary(errors), "count": int(errors.size)}


def published(sheet) -> dict:
    runs = load_published_runs()
    measured = np.array([run.tflops_per_gpu for run in runs])
    # Each run's first prediction in this process, timed alone (a source is
    # built per run, so nothing of the run is cached before it).
    frozen, seconds = np.zeros(len(runs)), np.zeros(len(runs))
    for k, run in enumerate(runs):
        started = time.perf_counter()
        frozen[k] = predict_published([run], HALF_PRECISION_ANALYTICAL, sheet)[0]
        seconds[k] = time.perf_counter() - started
    per_prediction = float(seconds.mean())
    loo = published_leave_one_out(runs, sheet=sheet)
    # Anchor: one MFU for all runs, fitted without the run (mean of the others).
    mfu = measured / 312.0
    anchor = np.array([np.delete(mfu, k).mean() / mfu[k] - 1 for k in range(len(runs))])
    rows = []
    for k, run in enumerate(runs):
        rows.append(
            {
                "id": run.run_id,
                "gpus": run.num_gpus,
                "tp": run.run.tp,
                "pp": run.run.pp,
                "virtual_stages": run.run.virtual_chunks,
                "published_tflops_per_gpu": run.tflops_per_gpu,
                "predicted_tflops_per_gpu": float(frozen[k]),
                "in_sample_error": float(frozen[k] / measured[k] - 1),
                "leave_one_out_error": float(loo[k]),
                "constant_mfu_leave_one_out_error": float(anchor[k]),
                "prediction_ms": float(1e3 * seconds[k]),
            }
        )
    return {
        "runs": rows,
        "leave_one_out": _summary(loo),
        "in_sample": _summary(frozen / measured - 1),
        "constant_mfu_leave_one_out": _summary(anchor),
        "seconds_per_prediction": per_prediction,
        "slowest_prediction_ms": float(1e3 * seconds.max()),
    }


def opt350_without_profile(sheet) -> dict:
    data = load_sailor_data()
    samples = calibration_set(data)
    constants = fit_constants(samples.select(samples.model != "OPT-350"))
    spec = load_model_spec("OPT-350")
    # Sailor's OPT-350 runs: fp32, unfused attention, Megatron's layer scaling.
    source = AnalyticalSource(
        spec,
        sheet,
        TrainingOptions(flash_attention=False),
        constants=constants,
        measured_links=data.network,
        query_key_layer_scaling="OPT-350" in QK_LAYER_SCALING,
    )
    runs = [r for r in load_measured_runs() if not r.suspect]
    analytical = leave_one_out(runs, source)
    profiled = leave_one_out(runs, data)
    out = {}
    for cluster in sorted({r.cluster for r in runs}):
        pick = np.array([r.cluster == cluster for r in runs])
        time_s = np.array([r.time_s for r in runs])[pick]
        memory = np.array(
            [r.memory_bytes if r.memory_trusted else np.nan for r in runs]
        )[pick]
        entry = {}
        for name, result in (("no_profile", analytical), ("profiles", profiled)):
            entry[name] = {
                "time": _summary(result.time_s[pick] / time_s - 1),
                "memory": (
                    _summary(result.memory_bytes[pick] / memory - 1)
                    if np.isfinite(memory).any()
                    else None
                ),
            }
        out[cluster] = entry
    return out


def _pct(summary) -> str:
    if summary is None:
        return "-"
    return f"{100 * summary['median']:5.1f}% / {100 * summary['max']:5.1f}%"


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/published_runs.json")
    started = time.perf_counter()
    sheet = load_gpu_sheet()
    result = {"sc21": published(sheet), "opt350": opt350_without_profile(sheet)}
    elapsed = time.perf_counter() - started
    sc21 = result["sc21"]
    print("Megatron-LM SC'21 Table 1, TFLOP/s per GPU (A100-80, fp16)")
    for row in sc21["runs"]:
        print(
            f"  {row['id']:20s} {row['gpus']:5d} GPUs  published "
            f"{row['published_tflops_per_gpu']:5.0f}  predicted "
            f"{row['predicted_tflops_per_gpu']:6.1f}  in-sample "
            f"{100 * row['in_sample_error']:+5.1f}%  leave-one-out "
            f"{100 * row['leave_one_out_error']:+5.1f}%  {row['prediction_ms']:5.0f} ms"
        )
    print(f"  leave-one-out median / max: {_pct(sc21['leave_one_out'])}")
    print(f"  constant MFU (leave-one-out): {_pct(sc21['constant_mfu_leave_one_out'])}")
    print("Sailor's OPT-350M runs, time and memory |error| median / max")
    for cluster, entry in result["opt350"].items():
        for name, summary in entry.items():
            print(
                f"  {cluster:14s} {name:10s} time {_pct(summary['time'])}"
                f"   memory {_pct(summary['memory'])}"
            )
    result.update(
        {
            **stamp.stamp(),
            "seconds": elapsed,
        }
    )
    stamp.save(out, result, note=f" ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
