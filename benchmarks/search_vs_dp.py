"""The differentiable engine against the exact DP and Alpa's algorithm, side by side.

Per instance it prints: the exact optimum and the exact DP's time, the engine's
cost, cost ratio, cold time (compilation included) and warm time, the time
ratio engine / exact DP, the engine's certified gap to its lower bound, and —
where asked — Alpa's cap scan (our faithful reproduction) with a time budget.
Results also go to JSON and CSV for the notebooks.

Suites:
  quality   the real profiles + generated instances: L in {16, 32, 64, 128},
            clusters 1x4 .. 8x8, B in {8, 32, 128}, 10% entries missing, memory
            unlimited or tight;
  alpa      L = 64 on 16 and 32 devices: engine vs Alpa's scan (10x target);
  scale     L = 512 on 128x8 devices: engine only, gap to the lower bound;
  coarse    L = 256 on 32x8 and L = 512 on 128x8: the exact DP on layers merged
            in groups (what a DP can finish in the engine's time) vs the engine,
            both evaluated on the fine table.
  startup   whole ``pipedejavu solve FILE --method diff`` processes at L = 32
            and 64 on 16 and 32 devices: cold (an empty compilation cache),
            warm cache (a new process after the first), and the in-process
            warm search (a second ``search`` call in one process), beside the
            exact DP's whole process, with the machine's load average.

Usage::

    python benchmarks/search_vs_dp.py [--suite quality alpa scale coarse startup]
        [--alpa-budget 120] [--out benchmarks/results/search_vs_dp]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import stamp

from pipedejavu import Problem, make_plan
from pipedejavu.baselines.alpa_dp import ScanTimeout, alpa_training_dp
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.planning.inputs import bundled_examples
from pipedejavu.search.alpa.exact import exact_dp
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.engine.driver import search

CLUSTERS = [(1, 4), (2, 8), (4, 8), (8, 8)]


def _engine(problem: Problem, config: SearchConfig) -> tuple[dict, float]:
    cold = search(problem, config, key=jax.random.key(0))
    started = time.perf_counter()
    warm = search(problem, config, key=jax.random.key(0))
    warm_time = time.perf_counter() - started
    row = {
        "engine_cost": cold.plan.cost,
        "engine_stages": cold.plan.num_stages,
        "engine_cold_s": cold.run_time_s,
        "engine_compile_s": cold.compile_time_s,
        "engine_warm_s": warm_time,
        "lower_bound": cold.lower_bound,
        "gap_to_bound": cold.plan.info["gap"],
        "fraction_best": cold.fraction_best,
    }
    return row, warm.plan.cost


def quality_instances():
    for example in bundled_examples():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problem = example.load()
        yield example.name, problem
    for layers in (16, 32, 64, 128):
        for hosts, per_host in CLUSTERS:
            for b in (8, 32, 128):
                tight = (layers + hosts + b) % 2 == 0
                name = (
                    f"gen-L{layers}-{hosts}x{per_host}-B{b}{'-tight' if tight else ''}"
                )
                yield (
                    name,
                    random_problem(
                        layers,
                        (hosts, per_host),
                        num_microbatches=b,
                        missing=0.1,
                        memory_tightness=2.0 if tight else None,
                        seed=layers + 10 * hosts + b,
                    ),
                )


def run_quality(config: SearchConfig) -> list[dict]:
    rows = []
    for name, problem in quality_instances():
        row = {
            "suite": "quality",
            "instance": name,
            "L": problem.num_layers,
            "D": problem.num_devices,
            "B": problem.num_microbatches,
        }
        started = time.perf_counter()
        try:
            exact = exact_dp(problem)
        except Exception as error:  # an infeasible real profile
            row["note"] = f"infeasible: {error}"
            rows.append(row)
            print(format_row(row), flush=True)
            continue
        row["exact_cost"] = exact.cost
        row["exact_s"] = time.perf_counter() - started
        engine, _ = _engine(problem, config)
        row.update(engine)
        row["cost_ratio"] = row["engine_cost"] / row["exact_cost"]
        row["time_ratio_warm"] = row["engine_warm_s"] / row["exact_s"]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def run_alpa(config: SearchConfig, budget: float) -> list[dict]:
    rows = []
    for hosts in (2, 4):
        problem = random_problem(64, (hosts, 8), num_microbatches=32, seed=hosts)
        row = {
            "suite": "alpa",
            "instance": f"gen-L64-{hosts}x8-B32",
            "L": 64,
            "D": hosts * 8,
            "B": 32,
        }
        started = time.perf_counter()
        exact = exact_dp(problem)
        row.update(exact_cost=exact.cost, exact_s=time.perf_counter() - started)
        engine, _ = _engine(problem, config)
        row.update(engine)
        row["cost_ratio"] = row["engine_cost"] / row["exact_cost"]
        started = time.perf_counter()
        try:
            alpa_training_dp(problem, time_limit_s=budget)
            row["alpa_s"] = time.perf_counter() - started
            row["alpa_finished"] = True
        except ScanTimeout:
            row["alpa_s"] = time.perf_counter() - started
            row["alpa_finished"] = False
        row["alpa_over_engine_cold"] = row["alpa_s"] / row["engine_cold_s"]
        row["alpa_over_engine_warm"] = row["alpa_s"] / row["engine_warm_s"]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def coarsen(problem: Problem, group: int) -> tuple[Problem, np.ndarray]:
    """Layers merged in groups of ``group`` (the last group may be shorter)."""
    edges = np.r_[np.arange(0, problem.num_layers, group), problem.num_layers]
    starts, stops = edges[:-1], edges[1:]
    table = problem.compute_cost[starts[:, None], stops[None, :] - 1]
    memory = problem.max_n_succ_stages[starts[:, None], stops[None, :] - 1]
    coarse = Problem(
        table,
        memory,
        problem.submesh_shapes,
        problem.cluster_shape,
        problem.num_microbatches,
    )
    return coarse, edges


def run_scale_and_coarse(config: SearchConfig, suites: set[str]) -> list[dict]:
    rows = []
    cases = [(512, (128, 8))] if "scale" in suites else []
    if "coarse" in suites:
        cases = [(256, (32, 8)), *cases] if cases else [(256, (32, 8)), (512, (128, 8))]
    for layers, cluster in cases:
        problem = random_problem(
            layers,
            cluster,
            num_microbatches=32,
            seed=layers,
            submesh_space="power_of_two",
        )
        row = {
            "suite": "scale",
            "instance": f"gen-L{layers}-{cluster[0]}x8-B32",
            "L": layers,
            "D": problem.num_devices,
            "B": 32,
        }
        budget = dataclasses.replace(config, time_budget_s=100.0)
        result = search(problem, budget, key=jax.random.key(0))
        row.update(
            engine_cost=result.plan.cost,
            engine_cold_s=result.run_time_s,
            engine_compile_s=result.compile_time_s,
            lower_bound=result.lower_bound,
            gap_to_bound=result.plan.info["gap"],
            engine_stages=result.plan.num_stages,
        )
        started = time.perf_counter()
        exact = exact_dp(problem)  # the crossover question: can the DP finish?
        row.update(exact_cost=exact.cost, exact_s=time.perf_counter() - started)
        row["cost_ratio"] = result.plan.cost / exact.cost
        if "coarse" in suites:
            # The finest grouping whose DP finishes within the engine's time:
            # start coarse, refine while the DP stays within that budget.
            for group in (32, 16, 8, 4, 2):
                coarse, edges = coarsen(problem, group)
                started = time.perf_counter()
                plan = exact_dp(coarse)
                elapsed = time.perf_counter() - started
                if elapsed > result.run_time_s and "coarse_group" in row:
                    break
                fine = make_plan(
                    problem,
                    [
                        (
                            int(edges[s.start]),
                            int(edges[s.stop]),
                            s.submesh_index,
                            s.config_index,
                        )
                        for s in plan.stages
                    ],
                    method="dp-coarse",
                )
                row.update(
                    coarse_group=group,
                    coarse_dp_s=elapsed,
                    coarse_dp_cost=fine.cost,
                    engine_speedup_vs_coarse=fine.cost / result.plan.cost - 1,
                )
                if elapsed > result.run_time_s:
                    break
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


STARTUP = [
    ("gpt-L32-2x8-B64-14pct", 32, (2, 8), 64, 0.86),
    ("gpt-L32-4x8-B128", 32, (4, 8), 128, 0.0),
    ("gpt-L64-2x8-B32", 64, (2, 8), 32, 0.0),
    ("gpt-L64-4x8-B32", 64, (4, 8), 32, 0.0),
]

#: Warm-cache processes per instance (the median is reported).
WARM_PROCESSES = 3

_IN_PROCESS = """
import json, sys, time, jax
from pipedejavu.planning.inputs import load_problem
from pipedejavu.search.engine.driver import search
problem = load_problem(sys.argv[1])
search(problem, key=jax.random.key(0))
started = time.perf_counter()
result = search(problem, key=jax.random.key(0))
print(json.dumps({"warm_s": time.perf_counter() - started,
                  "cost": result.plan.cost}))
"""


def _process(args: list[str], cache: Path) -> tuple[float, float]:
    """Wall time and CPU time (user + system) of one whole process, start-up
    included. On a shared machine the CPU time is the steadier of the two."""
    env = dict(os.environ, PIPEDEJAVU_CACHE_DIR=str(cache))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(args, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def run_startup() -> list[dict]:
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="pdj-startup-"))
    cli = [sys.executable, "-m", "pipedejavu.cli.main", "solve"]
    for name, layers, cluster, batches, missing in STARTUP:
        problem = random_problem(
            layers, cluster, num_microbatches=batches, missing=missing, seed=layers
        )
        path = folder / f"{name}.npz"
        problem.to_npz(path)
        cache = folder / f"cache-{name}"  # empty: the first run is cold
        row = {
            "suite": "startup",
            "instance": name,
            "L": layers,
            "D": problem.num_devices,
            "B": batches,
            "load_before": os.getloadavg()[0],
        }
        row["dp_process_s"], row["dp_process_cpu_s"] = _process(
            [*cli, str(path)], cache
        )
        row["engine_cold_process_s"], row["engine_cold_process_cpu_s"] = _process(
            [*cli, str(path), "--method", "diff"], cache
        )
        warm = [
            _process([*cli, str(path), "--method", "diff"], cache)
            for _ in range(WARM_PROCESSES)
        ]  # median of several: the machine is shared
        row["engine_warm_cache_process_s"] = float(np.median([w for w, _ in warm]))
        row["engine_warm_cache_process_cpu_s"] = float(np.median([c for _, c in warm]))
        row["engine_warm_cache_process_samples_s"] = [w for w, _ in warm]
        out = subprocess.run(
            [sys.executable, "-c", _IN_PROCESS, str(path)],
            env=dict(os.environ, PIPEDEJAVU_CACHE_DIR=str(cache)),
            check=True,
            capture_output=True,
            text=True,
        )
        row["engine_warm_in_process_s"] = json.loads(out.stdout.splitlines()[-1])[
            "warm_s"
        ]
        row["python_jax_import_s"], _ = _process(
            [sys.executable, "-c", "import jax, pipedejavu.search.engine.driver"], cache
        )
        row["load_after"] = os.getloadavg()[0]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    parts = [f"{row['instance']:<32}"]
    for key, fmt in (
        ("exact_cost", ".4f"),
        ("exact_s", ".3f"),
        ("engine_cost", ".4f"),
        ("cost_ratio", ".5f"),
        ("engine_cold_s", ".2f"),
        ("engine_warm_s", ".2f"),
        ("time_ratio_warm", ".1f"),
        ("gap_to_bound", ".3%"),
        ("alpa_s", ".1f"),
        ("alpa_over_engine_warm", ".0f"),
        ("coarse_group", "d"),
        ("coarse_dp_s", ".1f"),
        ("engine_speedup_vs_coarse", ".2%"),
        ("dp_process_s", ".2f"),
        ("engine_cold_process_s", ".2f"),
        ("engine_warm_cache_process_s", ".2f"),
        ("engine_warm_cache_process_cpu_s", ".2f"),
        ("engine_warm_in_process_s", ".2f"),
        ("python_jax_import_s", ".2f"),
        ("load_before", ".1f"),
        ("load_after", ".1f"),
    ):
        if key in row:
            parts.append(f"{key}={format(row[key], fmt)}")
    if "note" in row:
        parts.append(row["note"])
    return "  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite", nargs="+", default=["quality", "alpa", "scale", "coarse"]
    )
    parser.add_argument("--alpa-budget", type=float, default=120.0)
    parser.add_argument("--restarts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/search_vs_dp")
    )
    args = parser.parse_args()
    config = SearchConfig(num_restarts=args.restarts, num_steps=args.steps)
    header = (
        f"{stamp.header()}, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {config}"
    )
    print(header, flush=True)
    rows: list[dict] = []
    suites = set(args.suite)
    if "quality" in suites:
        rows += run_quality(config)
        ratios = [r["cost_ratio"] for r in rows if "cost_ratio" in r]
        print(
            f"# quality: {len(ratios)} instances, cost/optimum max "
            f"{max(ratios):.5f}, median {float(np.median(ratios)):.5f}",
            flush=True,
        )
    if "alpa" in suites:
        rows += run_alpa(config, args.alpa_budget)
    if suites & {"scale", "coarse"}:
        rows += run_scale_and_coarse(config, suites)
    if "startup" in suites:
        rows += run_startup()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"header": header, "rows": rows}, indent=1, default=float)
    )
    keys = sorted({key for row in rows for key in row})
    with args.out.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {args.out}.json and .csv")


if __name__ == "__main__":
    main()
