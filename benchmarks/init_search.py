"""Does parallel random initialization help? One budget, spent four ways.

On the bundled digits (1,079 train / 359 validation / 359 test images), for
each model and seed, :func:`pipedejavu.init_search.run_strategies` spends the
same budget of gradient evaluations (N = 8 workers x E = 100 epochs x 16
mini-batches of 64) on

* ``single``: one He-initialized network trained for all 800 epochs;
* ``best_of_n``: 8 networks, 100 epochs each, the best validation loss picked;
* ``refine``: 3 rounds of 8 candidates warmed up 20 epochs and scored by
  validation loss, the 2 best kept, new candidates resampled around the
  survivors' initial weights at scale 0.5 then 0.25; the 2 survivors train on
  for 160 more epochs each, the better one picked;
* ``refine_random`` (ablation): ``refine`` with survivors drawn at random, to
  separate what the scores are worth from what the schedule does.

Same Adam (learning rate 1e-3, constant), mini-batches and data for all; the
settings are the defaults fixed before any benchmark seed ran (nothing was
tuned on these seeds). Reported per strategy, mean and 95% Student-t interval
over the seeds: final validation loss and accuracy, final test accuracy (the
test split decides nothing), the best validation loss on the way, and the
gradient evaluations until the pick's validation loss first reaches each
target (mean over the seeds that reach it; ``reached`` counts them), and the
sequential steps until then (the wall-clock view when the 8 workers train side
by side: ``single`` uses one worker, the others all 8 at first). The
targets were chosen from two exploration seeds (1000, 1001), not from the
seeds reported. Paired differences ``refine - other`` per seed come with their
own intervals: an interval that contains 0 means no difference shown.

Usage::

    python benchmarks/init_search.py [--seeds 10] [--models mlp mlp-deep]
        [--quick] [--plot DIR] [--out FILE.json]

Without ``--out`` the report goes to a new dated file,
``benchmarks/results/init_search-YYYYMMDD-HHMMSS.json`` (never an existing
one); the tracked ``benchmarks/results/init_search.json`` (which the docs'
tables read) is overwritten only when named: ``--out
benchmarks/results/init_search.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import jax

from pipedejavu.init_search import (
    InitSearchConfig,
    TrainConfig,
    load_digits,
    model_config,
    run_strategies,
)
from pipedejavu.init_search.summary import summarize

STRATEGIES = ("single", "best_of_n", "refine", "refine_random")
#: Validation-loss targets per model, read off exploration seeds 1000 and 1001.
TARGETS = {"mlp": (0.15, 0.12, 0.10), "mlp-deep": (0.25, 0.20, 0.17)}


def _cell(stats: dict, digits: int = 4) -> str:
    if stats["mean"] is None:
        return "-"
    if stats["ci95"] is None:
        return f"{stats['mean']:.{digits}f}"
    half = (stats["ci95"][1] - stats["ci95"][0]) / 2
    return f"{stats['mean']:.{digits}f} +- {half:.{digits}f}"


def _print_model(model: str, summary: dict, targets: tuple[float, ...]) -> None:
    print(f"\n== {model}: mean +- 95% half-interval over the seeds ==")
    keys = (
        "final_validation_loss",
        "final_validation_accuracy",
        "final_test_accuracy",
        "best_validation_loss",
    )
    print(
        f"{'strategy':<14} {'val loss':>17} {'val acc':>17} {'test acc':>17} "
        f"{'best val loss':>17}"
    )
    for name, entry in summary["strategies"].items():
        cells = [_cell({"mean": entry[k], "ci95": entry["ci95"][k]}) for k in keys]
        print(f"{name:<14} " + " ".join(f"{c:>17}" for c in cells))
    print("to reach a validation loss: gradient evaluations | sequential steps")
    print(f"{'strategy':<14}" + "".join(f" {'<= ' + str(t):>36}" for t in targets))
    for name, entry in summary["strategies"].items():
        row = f"{name:<14}"
        for target in targets:
            evals = entry["time_to_target"][repr(float(target))]
            steps = entry["sequential_steps_to_target"][repr(float(target))]
            text = (
                f"{_cell(evals, 0)} | {_cell(steps, 0)} "
                f"({evals['reached']}/{evals['runs']})"
            )
            row += f" {text:>36}"
        print(row)
    print("paired differences (refine - other), mean +- 95% half-interval:")
    for label, diffs in summary["paired_differences"].items():
        parts = [
            f"{metric.replace('final_', '')} {_cell(stats)}"
            for metric, stats in diffs.items()
            if metric in ("final_validation_loss", "final_test_accuracy")
        ]
        print(f"  {label:<26} " + "; ".join(parts))


def default_out(now: datetime, folder: Path | None = None) -> Path:
    """A new dated report file, ``init_search-YYYYMMDD-HHMMSS[-k].json``."""
    folder = Path(__file__).parent / "results" if folder is None else folder
    stem = f"init_search-{now:%Y%m%d-%H%M%S}"
    path, k = folder / f"{stem}.json", 1
    while path.exists():
        path, k = folder / f"{stem}-{k}.json", k + 1
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=list(TARGETS))
    parser.add_argument(
        "--quick", action="store_true", help="3 seeds, 40 epochs (a smoke run)"
    )
    parser.add_argument("--plot", help="write the curves' figures here")
    parser.add_argument(
        "--out",
        help="the report's file (default: a new dated file in "
        "benchmarks/results; name benchmarks/results/init_search.json to "
        "replace the tracked one)",
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = str(default_out(datetime.now(timezone.utc)))
    seeds = list(range(3 if args.quick else args.seeds))
    config = (
        InitSearchConfig(epochs=40, demo_epochs=8) if args.quick else InitSearchConfig()
    )
    dataset = load_digits()
    load_before = os.getloadavg()
    started = time.perf_counter()
    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "jax_backend": jax.default_backend(),
            "jax_devices": jax.device_count(),
            "jax": jax.__version__,
            "python": platform.python_version(),
        },
        "load_average_before": load_before,
        "config": {**vars(config), "learning_rate": 1e-3, "batch_size": 64},
        "seeds": seeds,
        "models": {},
    }
    for model in args.models:
        train_config = TrainConfig(model=model_config(model))
        targets = TARGETS.get(model, (0.15,))
        runs = []
        for seed in seeds:
            tick = time.perf_counter()
            runs.append(
                run_strategies(
                    dataset,
                    train_config,
                    config,
                    key=jax.random.key(seed),
                    strategies=STRATEGIES,
                )
            )
            print(
                f"{model} seed {seed}: {time.perf_counter() - tick:.1f} s",
                flush=True,
            )
        summary = summarize(runs, targets)
        summary["targets"] = list(targets)
        summary["hidden"] = list(train_config.model.hidden)
        report["models"][model] = summary
        _print_model(model, summary, targets)
        if args.plot:
            from pipedejavu.init_search.plots import plot_candidates, plot_compute

            directory = Path(args.plot)
            directory.mkdir(parents=True, exist_ok=True)
            plot_compute(runs, directory / f"init_search_{model}_compute.png")
            plot_candidates(
                {k: runs[0][k] for k in ("best_of_n", "refine")},
                directory / f"init_search_{model}_candidates.png",
            )
    report["wall_time_s"] = time.perf_counter() - started
    report["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"\nwrote {args.out} ({report['wall_time_s']:.0f} s, load average "
        f"{load_before[0]:.1f} -> {report['load_average_after'][0]:.1f})"
    )


if __name__ == "__main__":
    main()
