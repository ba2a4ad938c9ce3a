"""Pollux's throughput model fitted to step times our predictor generates.

The comparison of :mod:`pipedejavu.planning.throughput_compare`. Pollux (AdaptDL) fits
seven parameters (:class:`PerfParams`) to observed step
times of *data-parallel* jobs and predicts the time of any (nodes, replicas,
atomic batch, accumulation steps). Here the "observations" are our predictor's
(:func:`pipedejavu.costmodel.megatron.predictor.predict_plan`, validated on the measured
runs) for Megatron-style plans on GH-96 GPUs, in AdaptDL's terms: with ``m``
micro-batches per iteration, ``accum_step_time`` = the compute of one
micro-batch (the predicted pipeline time / m) and ``optim_step_time`` = the
iteration time minus ``m - 1`` of them (the last micro-step, the gradient
all-reduce and the optimizer). Pollux's prediction of the iteration is
``predict_step_time(params, nodes, replicas, mbs, m - 1)``.

Each experiment fits :func:`~pipedejavu.costmodel.goodput.fit.fit_perf_params` on
one
part of the plans and reports the error against our predictor on the rest:

* ``dp-random``: data-parallel plans (1 stage, TP 1), random half / half;
* ``dp-extrapolate``: fitted on up to 8 GPUs, tested on 16 and 32;
* ``pipeline-S``: plans with S stages (TP 1, ``replicas`` = data-parallel
  degree, the GPUs' nodes as nodes), random half / half;
* ``pipeline-mixed``: 2- and 4-stage plans together (Pollux has no stage count).

Usage::

    python benchmarks/pollux_vs_predictor.py \
        [--out benchmarks/results/pollux_vs_predictor.json]
"""

from __future__ import annotations

import time

import numpy as np
import stamp

from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.throughput_compare import (
    heldout_errors,
    predictor_observations,
)

GPU = "GH-96"
MODELS = ("OPT-350", "GPT-Neo-2.7")


def evaluate(name, train, test):
    """Fit Pollux on ``train``; its error against our predictor on ``test``."""
    params, seen, held, fit_s = heldout_errors(train, test)
    out = {
        "experiment": name,
        "train": len(train),
        "test": len(test),
        "fit_s": fit_s,
        "perf_params": [float(p) for p in params],
        "train_median": float(np.median(seen)),
        "test_median": float(np.median(held)),
        "test_p90": float(np.quantile(held, 0.9)),
        "test_max": float(held.max()),
    }
    print(
        f"{name:28s} fit {len(train):3d}, test {len(test):3d}: held-out error "
        f"median {100 * out['test_median']:5.1f}%, p90 {100 * out['test_p90']:5.1f}%, "
        f"max {100 * out['test_max']:5.1f}% (train median "
        f"{100 * out['train_median']:.1f}%)"
    )
    return out


def _halves(rows, seed):
    order = np.random.default_rng(seed).permutation(len(rows))
    half = len(rows) // 2
    return [rows[i] for i in order[:half]], [rows[i] for i in order[half:]]


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/pollux_vs_predictor.json")
    data = load_sailor_data()
    started = time.perf_counter()
    results = []
    mbss, counts = (1, 2, 4, 8, 16), (1, 2, 4, 8)
    for model in MODELS:
        dp_rows = predictor_observations(
            model, GPU, 1, (1, 2, 4, 8, 16, 32), mbss, counts, data=data
        )
        train, test = _halves(dp_rows, 0)
        results.append(evaluate(f"{model} dp-random", train, test))
        small = [r for r in dp_rows if r["replicas"] <= 8]
        large = [r for r in dp_rows if r["replicas"] > 8]
        results.append(evaluate(f"{model} dp-extrapolate", small, large))
        mixed = []
        for stages in (2, 4):
            rows = predictor_observations(
                model, GPU, stages, (1, 2, 4, 8), mbss, (1, 4, 8, 16), data=data
            )
            mixed += rows
            train, test = _halves(rows, 0)
            results.append(evaluate(f"{model} pipeline-{stages}", train, test))
        train, test = _halves(mixed, 0)
        results.append(evaluate(f"{model} pipeline-mixed", train, test))
    fields = {"gpu": GPU, "results": results}
    stamp.write_opened(out, "pollux_vs_predictor", started, fields)


if __name__ == "__main__":
    main()
