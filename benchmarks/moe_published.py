"""The thirteen published MoE runs on H100 (``moe_h100.json``), predicted.

For each run: the published tokens/s per GPU, the prediction with the MoE
constants fitted on all thirteen (what ``predict --megatron-args`` uses), and
the leave-one-out error (the constants fitted on the other twelve). The MoE
constants (``pipedejavu.planning.moe_published.MOE_FIELDS``) are the only
numbers fitted on these runs; everything else is fitted before, on dense
profiles and dense published runs.

    python benchmarks/moe_published.py [--out benchmarks/results/moe_published.json]

About 5 minutes on a 2-core machine (fourteen fits of three constants).
"""

from __future__ import annotations

import time

import numpy as np
import stamp

from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.moe_published import (
    MOE_FIELDS,
    fit_moe_constants,
    moe_launches,
    moe_leave_one_out,
    predicted_tokens,
)


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/moe_published.json")
    start = time.perf_counter()
    sheet = load_gpu_sheet()
    launches = moe_launches()
    fitted = fit_moe_constants(launches, sheet)
    published = np.array([tokens for *_, tokens in launches])
    predicted = predicted_tokens(launches, fitted, sheet)
    loo, fits = moe_leave_one_out(sheet=sheet)
    elapsed = time.perf_counter() - start
    runs = []
    print(f"{'run':58s} {'published':>9s} {'predicted':>9s} {'fit':>7s} {'LOO':>7s}")
    for k, (run, *_) in enumerate(launches):
        fit_error = predicted[k] / published[k] - 1.0
        print(
            f"{run.run_id[:58]:58s} {published[k]:9.0f} {predicted[k]:9.0f} "
            f"{fit_error:+7.1%} {loo[k]:+7.1%}"
        )
        runs.append(
            {
                "id": run.run_id,
                "published_tokens_per_s_per_gpu": float(published[k]),
                "predicted_tokens_per_s_per_gpu": float(predicted[k]),
                "error": float(fit_error),
                "leave_one_out_error": float(loo[k]),
                "leave_one_out_constants": {
                    name: getattr(fits[k], name) for name in MOE_FIELDS
                },
            }
        )
    fit_errors = predicted / published - 1.0
    result = {
        "constants": {name: getattr(fitted, name) for name in MOE_FIELDS},
        "runs": runs,
        "fitted_on_all": stamp.abs_summary(fit_errors),
        "leave_one_out": stamp.abs_summary(loo),
        **stamp.stamp(),
        "seconds": elapsed,
    }
    summary = result["leave_one_out"]
    print(f"constants fitted on all: {result['constants']}")
    print(
        f"|error| fitted on all: median {result['fitted_on_all']['median']:.1%}, "
        f"max {result['fitted_on_all']['max']:.1%}; leave-one-out: median "
        f"{summary['median']:.1%}, max {summary['max']:.1%}"
    )
    stamp.save(out, result, note=f" ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
