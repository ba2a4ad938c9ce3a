"""Elastic mode: the best plan per GPU count vs DeepSpeed's one global batch.

OPT-350M and GPT-Neo-2.7B on GH200 ("GH-96", 4 GPUs per node), GPU counts
16, 32, ..., 128. Per count: the best plan over global batches that are
multiples of ``STEP`` up to ``MAX_BATCH`` (throughput mode; and, on multiples
of ``GOODPUT_STEP``, goodput mode at
Kaplan et al. 2020's critical batch for loss 3.0, see ``goodput_modes.py``).
DeepSpeed v0.2's rule (micro-batch sizes = the profiled ones, max batch, GPU
range, 4 GPUs per node, model-parallel sizes 1, 2, 4) gives the common batch;
every count is planned at it. The price is the throughput (goodput) lost by
running one batch at every count. Plots need matplotlib.

Usage::

    python benchmarks/elastic_modes.py [--out benchmarks/results/elastic_modes.json]
"""

from __future__ import annotations

import os
import sys
import time

import stamp

from pipedejavu.core.problem import ProblemError
from pipedejavu.planning.batch import grad_params_from_noise_scale
from pipedejavu.planning.elastic import plan_elastic
from pipedejavu.planning.elastic_report import format_elastic, plot_elastic

MODELS = ("OPT-350", "GPT-Neo-2.7")
COUNTS = list(range(16, 129, 16))
MAX_BATCH, STEP, INIT_BATCH = 4096, 256, 32
GOODPUT_STEP = 32  # goodput mode: optima are small batches, so a finer grid
NOISE_SCALE = 2e8 / 3.0 ** (1 / 0.21) / 2048  # Kaplan et al. 2020 at L = 3.0


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/elastic_modes.json")
    started = time.perf_counter()
    results = []
    folder = os.path.dirname(out)
    os.makedirs(folder, exist_ok=True)
    for model in MODELS:
        for mode in ("throughput", "goodput"):
            grad = (
                grad_params_from_noise_scale(NOISE_SCALE, INIT_BATCH)
                if mode == "goodput"
                else None
            )
            t0 = time.perf_counter()
            result = plan_elastic(
                model,
                "GH-96",
                COUNTS,
                MAX_BATCH,
                grad_params=grad,
                init_batch=INIT_BATCH if grad is not None else STEP,
                batch_multiple=STEP if grad is None else GOODPUT_STEP,
                progress_fn=lambda line: print(line, file=sys.stderr),
            )
            wall = time.perf_counter() - t0
            print(f"== {model}, {mode} mode ({wall:.0f} s)")
            print(format_elastic(result))
            entry = result.to_json()
            entry.update(mode=mode, wall_s=wall)
            if grad is not None:
                entry["noise_scale_samples"] = NOISE_SCALE
            try:
                path = os.path.join(folder, f"elastic_{model}_{mode}.png")
                plot_elastic(result, path)
                entry["plot"] = os.path.basename(path)
            except ProblemError as error:
                print(f"no plot: {error}", file=sys.stderr)
            results.append(entry)
    fields = {
        "counts": COUNTS,
        "max_batch": MAX_BATCH,
        "batch_multiple": {"throughput": STEP, "goodput": GOODPUT_STEP},
        "results": results,
    }
    stamp.write_opened(out, "elastic_modes", started, fields)


if __name__ == "__main__":
    main()
