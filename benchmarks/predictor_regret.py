"""Plan regret of planning on stage costs predicted from a fraction of a profile.

For each instance, fraction (10, 25, 50, 100 % of the profiled entries) and seed,
:func:`pipedejavu.planning.predict_regret.plan_regret` draws the "profiled"
entries, fits the additive per-layer cost model and the memory model to them, solves the
planner's view exactly, and scores that plan on the true table:
``regret = cost_on_true / optimum - 1``. The table shows per row the effective
fraction drawn, the held-out entries, their MAPE (median over seeds), the
regret (median / max over the seeds whose plan is valid), the failed plans
(a stage the true table lacks, or a broken true memory limit), the memory
feasibility disagreement on held-out entries (median), and with refinement the
extra entries profiled (median).

Instances:

* The three real Alpa GPT-1.3B profiles (1x4 cluster, L = 6/12): 17, 11 and 6
  complete records over 12 (m, k) slots, so the draw that determines each
  slot's model profiles everything; the "plain" rows draw without completing
  the rank (minimum-norm fit) to measure extrapolation at all. The first
  profile has no feasible plan under Alpa's memory rule: no regret exists.
* Generated GPT-like instances (``random_problem``: irregularity 0.3, noise
  2 %, L = 32..64, 2x8 / 4x8 clusters, B = 32) with GPT-like memory statistics
  (``synthetic_memory_stats``, tightness 2.5: memory raises every optimum by
  3-13 % over unlimited memory), one with 30 % of the
  entries never profiled, planned with ``support="profiled"`` and ``"all"``.
  Draws favour short stages (``SubsetConfig.design="short"``); the "uniform"
  rows draw every stage alike, for comparison.

Usage::

    python benchmarks/predictor_regret.py [--seeds 5] [--quick]
        [--out benchmarks/results/predictor_regret.json]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
import stamp

from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.costmodel.stage.memory_model import synthetic_memory_stats
from pipedejavu.costmodel.stage.predict import SubsetConfig
from pipedejavu.planning.inputs import bundled_examples
from pipedejavu.planning.predict_regret import predictor_report

FRACTIONS = (0.1, 0.25, 0.5, 1.0)


def generated(num_layers, cluster, *, missing=0.0, noise=0.02, seed=0):
    problem = random_problem(
        num_layers,
        cluster,
        irregularity=0.3,
        noise=noise,
        missing=missing,
        num_microbatches=32,
        seed=seed,
    )
    stats, problem = synthetic_memory_stats(problem, tightness=2.5, seed=seed)
    return problem, stats


def cases(quick: bool):
    """``(name, source, options)`` for :func:`predictor_report`."""
    for example in bundled_examples():
        settings = dict(
            cluster_shape=example.cluster_shape,
            num_microbatches=example.num_microbatches,
        )
        yield example.name, example.path, settings
        plain = SubsetConfig(complete_rank=False)
        yield f"{example.name} plain", example.path, dict(settings, config=plain)
    specs = [("gen-L32-2x8", 32, (2, 8), 0.0, 0.02)]
    if not quick:
        specs += [
            ("gen-L32-2x8-noise0.5%", 32, (2, 8), 0.0, 0.005),
            ("gen-L64-4x8", 64, (4, 8), 0.0, 0.02),
            ("gen-L48-2x8-missing30%", 48, (2, 8), 0.3, 0.02),
        ]
    for name, num_layers, cluster, missing, noise in specs:
        problem, stats = generated(
            num_layers, cluster, missing=missing, noise=noise, seed=num_layers
        )
        uniform = SubsetConfig(design="uniform")
        yield f"{name} uniform", problem, dict(memory_stats=stats, config=uniform)
        supports = ("profiled", "all") if missing else ("profiled",)
        for support in supports:
            for refine in (False, True):
                label = name + ("" if support == "profiled" else " all")
                label += " refine" if refine else ""
                options = dict(memory_stats=stats, support=support, refine=refine)
                yield label, problem, options


HEADER = (
    f"{'instance':<34} {'frac%':>5} {'eff%':>6} {'held':>5} {'MAPE%':>7} "
    f"{'regret% med/max':>15} {'fail':>4} {'memdis%':>7} {'+prof':>5}"
)


def _pct(value, digits=2):
    return "-" if value is None else f"{100 * value:.{digits}f}"


def format_rows(name: str, report: dict) -> list[str]:
    lines = []
    for row in report["rows"]:
        held = row["num_held_out"]
        regret = f"{_pct(row['regret_median'])}/{_pct(row['regret_max'])}"
        if report["optimum"] is None:
            regret = "infeasible"
        extra = row["num_refined"] if report["refine"] else None
        lines.append(
            f"{name:<34} {_pct(row['fraction'], 0):>5} "
            f"{_pct(row['effective_fraction'], 1):>6} "
            f"{'-' if held is None else f'{held:.0f}':>5} "
            f"{_pct(row['held_out_mape']):>7} {regret:>15} {row['num_failed']:>4} "
            f"{_pct(row['memory_disagreement']):>7} "
            f"{'-' if extra is None else f'{extra:.0f}':>5}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per fraction")
    parser.add_argument(
        "--quick", action="store_true", help="real profiles and one generated"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/predictor_regret.json")
    )
    args = parser.parse_args()
    header = (
        f"{stamp.header(python=True)}, "
        f"numpy {np.__version__}; fractions {list(FRACTIONS)}, {args.seeds} seeds"
    )
    print(header)
    print(HEADER)
    reports = []
    for name, source, options in cases(args.quick):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # incomplete Alpa records
            report = predictor_report(
                source,
                fractions=FRACTIONS,
                seeds=tuple(range(args.seeds)),
                name=name,
                **options,
            )
        report["time_s"] = time.perf_counter() - started
        reports.append(report)
        for line in format_rows(name, report):
            print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"header": header, "reports": reports}))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
