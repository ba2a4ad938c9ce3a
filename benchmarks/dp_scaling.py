"""How the exact DP scales, side by side with Alpa's own cap scan.

For generated GPT-like instances (``pipedejavu.generate.random_problem``) with
L in {16, 32, 64, 128} layers on D in {8, 16, 32, 64} devices (1x8 .. 8x8,
power_of_two submeshes, 2 configs, B = 32), with memory unlimited and tight, it
prints per instance: the distinct stage costs (Alpa's candidate caps), the exact
DP's wall time and caps evaluated, and the Alpa-compatible scan's wall time,
caps evaluated / skipped by the 1e-6 gap / never reached (early stop), the time
ratio Alpa / exact and the cost ratio Alpa / exact.

The Alpa-compatible scan reproduces Alpa's answers and does Alpa's work
(Theta(L * E * D) per cap for E admissible entries, vectorized); it gets
``--alpa-budget`` seconds per instance and reports how far it got when cut off.

Usage::

    python benchmarks/dp_scaling.py [--layers 16 32 64 128] [--devices 8 16 32 64]
        [--alpa-budget 60] [--out benchmarks/results/dp_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pipedejavu.baselines.alpa_dp import ScanTimeout, alpa_training_dp
from pipedejavu.baselines.exact_dp import exact_dp
from pipedejavu.generate import random_problem

CLUSTERS = {8: (1, 8), 16: (2, 8), 32: (4, 8), 64: (8, 8)}


def run_instance(num_layers: int, num_devices: int, memory: str, budget: float):
    problem = random_problem(
        num_layers,
        CLUSTERS[num_devices],
        num_microbatches=32,
        memory_tightness=2.0 if memory == "tight" else None,
        seed=num_layers * 1000 + num_devices,
    )
    started = time.perf_counter()
    exact = exact_dp(problem)
    exact_time = time.perf_counter() - started
    row = {
        "L": num_layers,
        "D": num_devices,
        "memory": memory,
        "M": problem.num_submeshes,
        "K": problem.num_configs,
        "candidates": exact.info["num_candidates"],
        "exact_time_s": exact_time,
        "exact_evaluated": exact.info["num_evaluated"],
        "exact_cost": exact.cost,
        "exact_stages": exact.num_stages,
    }
    started = time.perf_counter()
    try:
        alpa = alpa_training_dp(problem, time_limit_s=budget)
    except ScanTimeout as stop:
        row.update(
            alpa_time_s=None,
            alpa_budget_s=budget,
            alpa_evaluated=stop.num_evaluated,
            alpa_passed=stop.position,
        )
        return row
    alpa_time = time.perf_counter() - started
    row.update(
        alpa_time_s=alpa_time,
        alpa_evaluated=alpa.info["num_evaluated"],
        alpa_skipped_gap=alpa.info["num_skipped_gap"],
        alpa_not_reached=alpa.info["num_not_reached"],
        alpa_cost_ratio=alpa.cost / exact.cost,
        time_ratio=alpa_time / exact_time,
    )
    return row


HEADER = (
    f"{'L':>4} {'D':>4} {'memory':>6} {'caps':>7} {'exact s':>9} {'eval':>5} "
    f"{'alpa s':>9} {'eval':>6} {'gap':>6} {'stopped':>7} {'alpa/ex':>8} {'cost':>8}"
)


def format_row(row: dict) -> str:
    head = (
        f"{row['L']:>4} {row['D']:>4} {row['memory']:>6} {row['candidates']:>7} "
        f"{row['exact_time_s']:>9.3f} {row['exact_evaluated']:>5}"
    )
    if row["alpa_time_s"] is None:  # cut off: the ratio is a lower bound
        budget = row["alpa_budget_s"]
        ratio = budget / row["exact_time_s"]
        return (
            f"{head} {'>' + format(budget, '.0f'):>9} {row['alpa_evaluated']:>6} "
            f"{'':>6} {'':>7} {'>' + format(ratio, '.0f'):>8} {'?':>8}"
            f"  (cut off after {row['alpa_passed']} of {row['candidates']} caps)"
        )
    return (
        f"{head} {row['alpa_time_s']:>9.3f} {row['alpa_evaluated']:>6} "
        f"{row['alpa_skipped_gap']:>6} {row['alpa_not_reached']:>7} "
        f"{row['time_ratio']:>8.1f} {row['alpa_cost_ratio']:>8.5f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument(
        "--devices",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64],
        choices=sorted(CLUSTERS),
    )
    parser.add_argument(
        "--memory", nargs="+", default=["none", "tight"], choices=["none", "tight"]
    )
    parser.add_argument(
        "--alpa-budget",
        type=float,
        default=60.0,
        help="seconds for Alpa's scan per instance (default 60)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/dp_scaling.json")
    )
    parser.add_argument(
        "--show", type=Path, metavar="JSON", help="only print the table of a saved run"
    )
    args = parser.parse_args()
    if args.show:
        saved = json.loads(args.show.read_text())
        print(saved["header"])
        print(HEADER)
        for row in saved["rows"]:
            print(format_row(row))
        return
    header = (
        f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )
    print(header)
    print(HEADER)
    rows = []
    for num_layers in args.layers:
        for num_devices in args.devices:
            for memory in args.memory:
                row = run_instance(num_layers, num_devices, memory, args.alpa_budget)
                rows.append(row)
                print(format_row(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
