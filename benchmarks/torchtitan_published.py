"""torchtitan's seven published Llama 3.1 8B runs on 8 H100 (96 GB, 500 W),
predicted from their job files (``torchtitan_llama3_8b_h100.json``).

For each run: the published tokens/s per GPU and peak memory, the prediction
with the two torchtitan constants fitted on all seven (what ``predict
--torchtitan-config`` uses: ``pipedejavu.costmodel.analytical.
torchtitan_constants``), the leave-one-out error (the constants fitted on the
other six), and the prediction before any torchtitan constant (the
Megatron-LM ones, ``HALF_PRECISION_ANALYTICAL``). Nothing else is fitted on
these runs; memory has no fitted constant here.

    python benchmarks/torchtitan_published.py [--out FILE]

(default ``benchmarks/results/torchtitan_published.json``).

A few seconds on a 2-core machine.
"""

from __future__ import annotations

import time

import stamp

from pipedejavu.costmodel.analytical.roofline import HALF_PRECISION_ANALYTICAL
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.torchtitan_published import (
    FIELDS,
    fit_torchtitan_constants,
    leave_one_out,
    load_torchtitan_runs,
    predict_runs,
)


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/torchtitan_published.json")
    start = time.perf_counter()
    sheet = load_gpu_sheet()
    runs = load_torchtitan_runs()
    fitted = fit_torchtitan_constants(runs, sheet)
    predicted = predict_runs(runs, fitted, sheet)
    before = predict_runs(runs, HALF_PRECISION_ANALYTICAL, sheet)
    loo, fits = leave_one_out(runs, sheet)
    elapsed = time.perf_counter() - start
    rows, time_fit, memory, untuned = [], [], [], []
    print(
        f"{'run':44s} {'published':>9s} {'fitted':>8s} {'LOO':>7s} {'before':>7s} "
        f"{'GiB':>5s} {'pred':>5s}"
    )
    for run, (tokens, gib), (raw, _), error, constants in zip(
        runs, predicted, before, loo, fits, strict=True
    ):
        fit_error = tokens / run.tokens_per_s_per_gpu - 1
        memory_error = gib / run.peak_memory_gib - 1
        raw_error = raw / run.tokens_per_s_per_gpu - 1
        time_fit.append(fit_error)
        memory.append(memory_error)
        untuned.append(raw_error)
        print(
            f"{run.run_id[24:68]:44s} {run.tokens_per_s_per_gpu:9.0f} {tokens:8.0f} "
            f"{error:+7.1%} {raw_error:+7.1%} {run.peak_memory_gib:5.1f} {gib:5.1f}"
        )
        rows.append(
            {
                "id": run.run_id,
                "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
                "predicted_tokens_per_s_per_gpu": tokens,
                "error": fit_error,
                "leave_one_out_error": error,
                "leave_one_out_constants": {
                    name: getattr(constants, name) for name in FIELDS
                },
                "error_before_torchtitan_constants": raw_error,
                "published_peak_memory_gib": run.peak_memory_gib,
                "predicted_peak_memory_gib": gib,
                "memory_error": memory_error,
            }
        )
    result = {
        "constants": {name: getattr(fitted, name) for name in FIELDS},
        "runs": rows,
        "fitted_on_all": stamp.abs_summary(time_fit),
        "leave_one_out": stamp.abs_summary(loo),
        "before_torchtitan_constants": stamp.abs_summary(untuned),
        "memory": stamp.abs_summary(memory),
        "seconds": elapsed,
        **stamp.stamp(),
    }
    print(
        f"leave-one-out |error|: median {result['leave_one_out']['median']:.1%}, "
        f"max {result['leave_one_out']['max']:.1%}; memory median "
        f"{result['memory']['median']:.1%}; {elapsed:.1f} s"
    )
    stamp.write_json(out, result, end="\n")


if __name__ == "__main__":
    main()
