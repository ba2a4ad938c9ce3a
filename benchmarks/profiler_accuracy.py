"""How well the layer profiler predicts a stage run as one jitted function.

For each model it times, in one interleaved session (:func:`profile_model`),
every layer and every contiguous span of at least two layers as one jitted
forward + backward, each sample the second of two back-to-back calls (a stage's
steady state). The stage-overhead model (:func:`fit_stage_overhead`) is fit
on the ``"auto"`` calibration spans only (whole model, both halves, layers 1..2);
every other span is held out. Per span it prints the predicted stage latency
(sum of layer times with the fitted boundary and working-set terms), the
measured latency, the error, and the error of the plain sum of layer times.
The target of the issue: |error| <= 15% on held-out spans.

Everything is measured on whatever backend JAX sees; the load average of the
machine is recorded before and after, because on a shared CPU it moves the
numbers more than anything else.

Usage::

    python benchmarks/profiler_accuracy.py [--models gpt-tiny gpt-small]
        [--repeats 20] [--warmup 2] [--burst 2] [--single-thread]
        [--out benchmarks/results/profiler_accuracy.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
import stamp

from pipedejavu.costmodel.profiling.gpt_model import MODEL_NAMES, gpt_config
from pipedejavu.costmodel.profiling.profiler import LayerProfile, profile_model
from pipedejavu.costmodel.profiling.stage_overhead import (
    fit_stage_overhead,
    predict_span_time,
)

TARGET = 0.15


def evaluate(profile: LayerProfile, statistic: str) -> dict:
    """Held-out and in-sample errors of one profile under one statistic."""
    profile = profile.with_statistic(statistic)
    num_layers = profile.num_layers
    half = (num_layers + 1) // 2
    auto = {(0, num_layers), (0, half), (num_layers // 2, num_layers), (1, 3)}
    calibration = [span for span in profile.spans if span in auto]
    overhead = fit_stage_overhead(profile, calibration)
    rows = []
    for span, measured in zip(profile.spans, profile.span_times_s, strict=True):
        predicted = predict_span_time(profile, *span, overhead)
        plain = float(profile.layer_times_s[span[0] : span[1]].sum())
        rows.append(
            {
                "span": [span[0], span[1] - 1],
                "layers": span[1] - span[0],
                "held_out": span not in auto,
                "predicted_s": predicted,
                "measured_s": float(measured),
                "error": predicted / float(measured) - 1,
                "sum_error": plain / float(measured) - 1,
            }
        )
    held = [abs(row["error"]) for row in rows if row["held_out"]]
    plain = [abs(row["sum_error"]) for row in rows if row["held_out"]]
    return {
        "statistic": statistic,
        "overhead": dataclasses.asdict(overhead),
        "rows": rows,
        "held_out_max_abs_error": max(held, default=float("nan")),
        "held_out_mean_abs_error": float(np.mean(held)) if held else float("nan"),
        "held_out_within_target": int(sum(e <= TARGET for e in held)),
        "held_out_count": len(held),
        "sum_only_max_abs_error": max(plain, default=float("nan")),
        "sum_only_mean_abs_error": float(np.mean(plain)) if plain else float("nan"),
    }


def run_model(name: str, repeats: int, warmup: int, burst: int) -> dict:
    num_layers = gpt_config(name).num_layers
    spans = [
        (start, stop)
        for start in range(num_layers)
        for stop in range(start + 2, num_layers + 1)
    ]

    def progress(done: int, total: int, what: str) -> None:
        print(f"  [{name}] {done}/{total} {what}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    started = time.perf_counter()
    profile = profile_model(
        name,
        repeats=repeats,
        warmup=warmup,
        burst=burst,
        spans=spans,
        progress_fn=progress,
    )
    wall = time.perf_counter() - started
    load_after = os.getloadavg()
    spread = profile.layer_samples_s
    result = {
        "model": name,
        "config": dataclasses.asdict(profile.config),
        "layer_names": list(profile.layer_names),
        "layer_times_s": profile.layer_times_s.tolist(),
        "layer_iqr_over_median": (
            (np.percentile(spread, 75, axis=1) - np.percentile(spread, 25, axis=1))
            / profile.layer_times_s
        ).tolist(),
        "param_bytes": profile.param_bytes.tolist(),
        "activation_bytes": profile.activation_bytes.tolist(),
        "stash_bytes": profile.stash_bytes.tolist(),
        "compile_s": profile.compile_s,
        "wall_s": wall,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "by_statistic": [evaluate(profile, s) for s in ("median", "min")],
    }
    return result


def print_model(result: dict) -> None:
    print(
        f"\n{result['model']}: L = {len(result['layer_names'])}, layer times (ms) "
        + " ".join(f"{t * 1e3:.2f}" for t in result["layer_times_s"])
        + f"; profiled in {result['wall_s']:.1f} s (compile {result['compile_s']:.1f}"
        f" s), load {result['load_average_before'][0]:.1f} -> "
        f"{result['load_average_after'][0]:.1f}"
    )
    for evaluation in result["by_statistic"]:
        fit = evaluation["overhead"]
        print(
            f"  statistic {evaluation['statistic']}: per_boundary "
            f"{fit['per_boundary_s'] * 1e3:.3f} ms, boundary_fraction "
            f"{fit['boundary_fraction']:.3f}, spill_fraction "
            f"{fit['spill_fraction']:.3f} above {fit['spill_bytes'] / 2**20:.1f} MiB "
            f"(fit on {fit['num_spans']} spans)"
        )
        if evaluation["statistic"] == "median":
            print(
                f"  {'span':>7} {'held':>4} {'predicted ms':>12} {'measured ms':>11}"
                f" {'error %':>8} {'sum-only %':>10}"
            )
            for row in evaluation["rows"]:
                print(
                    f"  {row['span'][0]:>3}..{row['span'][1]:<3}"
                    f" {'yes' if row['held_out'] else 'fit':>4}"
                    f" {row['predicted_s'] * 1e3:>12.3f}"
                    f" {row['measured_s'] * 1e3:>11.3f}"
                    f" {row['error'] * 100:>8.1f} {row['sum_error'] * 100:>10.1f}"
                )
        print(
            f"  held out: max |error| {evaluation['held_out_max_abs_error']:.1%}, mean "
            f"{evaluation['held_out_mean_abs_error']:.1%}, "
            f"{evaluation['held_out_within_target']}/{evaluation['held_out_count']} "
            f"within {TARGET:.0%}; sum of layers alone: max "
            f"{evaluation['sum_only_max_abs_error']:.1%}, mean "
            f"{evaluation['sum_only_mean_abs_error']:.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["gpt-tiny", "gpt-small"], choices=MODEL_NAMES
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--burst", type=int, default=2)
    parser.add_argument(
        "--single-thread",
        action="store_true",
        help="run XLA:CPU on one thread (steadier on a loaded machine)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/profiler_accuracy.json")
    )
    args = parser.parse_args()
    if args.single_thread:  # read when the backend starts, i.e. below
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    header = {
        "date": stamp.minute(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "burst": args.burst,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "target": TARGET,
    }
    print(
        f"# {header['date']}, {header['machine']}, {header['cpus']} CPUs, backend "
        f"{header['backend']} ({header['device_kind']}), repeats {args.repeats}"
    )
    results = []
    for name in args.models:
        results.append(run_model(name, args.repeats, args.warmup, args.burst))
        print_model(results[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"header": header, "models": results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
