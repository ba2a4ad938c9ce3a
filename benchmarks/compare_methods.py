"""Every planner on generated GPT-like instances of growing size, side by side.

For each instance: ``pipedejavu.compare`` (warm-up run, then timed repeats) of
the exact DP, the differentiable engine, greedy, uniform, random search and
simulated annealing. Prints one table per instance and a summary of
cost / optimum and search time / DP time; writes the rows as JSON and CSV and
the ratio plot to ``benchmarks/results/`` (the README's table and figure).

    python benchmarks/compare_methods.py            # L = 16, 32, 64, 128
    python benchmarks/compare_methods.py --quick    # L = 16, 32 (a minute)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
from pathlib import Path

from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.planning import plots
from pipedejavu.planning.compare import compare

RESULTS = Path(__file__).parent / "results"
METHODS = ["dp", "diff", "greedy", "uniform", "random", "anneal"]
#: (layers, cluster): the cluster grows with the model, as in practice.
INSTANCES = [(16, (1, 8)), (32, (2, 8)), (64, (4, 8)), (128, (8, 8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 16 and 32 only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=2, help="instances per size")
    args = parser.parse_args()
    instances = INSTANCES[:2] if args.quick else INSTANCES
    rows = []
    for num_layers, cluster in instances:
        for seed in range(args.seeds):
            problem = random_problem(
                num_layers,
                cluster,
                num_microbatches=32,
                seed=seed,
                irregularity=0.5,
                missing=0.1,
            )
            result = compare(
                problem,
                METHODS,
                repeats=args.repeats,
                warmup=1,
                options={"anneal": {"num_steps": 20_000}},
            )
            print(
                f"\n== L={num_layers}, cluster {cluster[0]}x{cluster[1]}, seed {seed}"
            )
            print(result.format_table(), flush=True)
            dp_time = result.result("dp").time_stats()["mean"]
            for row in result.rows():
                rows.append(
                    {
                        "num_layers": num_layers,
                        "cluster": f"{cluster[0]}x{cluster[1]}",
                        "seed": seed,
                        **row,
                        "time_ratio": row["time_mean_s"] / dp_time,
                    }
                )
    print("\nsummary (mean over instances of each size): cost / optimum, time / DP")
    sizes = sorted({r["num_layers"] for r in rows})
    header = f"{'method':<8}" + "".join(f"  L={n:<4} cost    time" for n in sizes)
    print(header)
    for method in METHODS:
        line = f"{method:<8}"
        for n in sizes:
            mine = [r for r in rows if r["method"] == method and r["num_layers"] == n]
            cost = sum(r["cost_ratio"] for r in mine) / len(mine)
            time = sum(r["time_ratio"] for r in mine) / len(mine)
            line += f"  {cost:9.4f} {time:9.2f}x"
        print(line)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": "python benchmarks/compare_methods.py"
        + (" --quick" if args.quick else ""),
    }
    (RESULTS / "compare_methods.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    with open(RESULTS / "compare_methods.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    path = plots.plot_ratios(rows, RESULTS / "compare_methods.png")
    print(f"wrote {path} and compare_methods.json/.csv")


if __name__ == "__main__":
    main()
