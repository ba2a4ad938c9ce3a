"""How the exact DP scales, side by side with our cap scan and Alpa's own scan.

``--suite grid`` (default): generated GPT-like instances
(``pipedejavu.costmodel.stage.generate.random_problem``) with L in {16, 32, 64, 128}
layers on
D in {8, 16, 32, 64} devices (1x8 .. 8x8, power_of_two submeshes, 2 configs,
B = 32), with memory unlimited and tight. Per instance: the distinct stage
costs (Alpa's candidate caps), the exact DP's wall time (the default label
method) and the cap scan's (``method="caps"``, the previous default) with its
caps evaluated, and the Alpa-compatible scan's wall time, caps evaluated /
skipped by the 1e-6 gap / never reached (early stop), the time ratio Alpa /
exact and the cost ratio Alpa / exact. The Alpa-compatible scan reproduces
Alpa's answers and does Alpa's work (Theta(L * E * D) per cap for E admissible
entries, vectorized); it gets ``--alpa-budget`` seconds per instance and
reports how far it got when cut off.

``--suite kinds``: the instance kinds of the exact DP's worst cases, several
seeds each, the two exact methods side by side (same process, alternating),
with the plan's stage count and the share of finite entries that never fit:
GPT-like L = 32 on 2x8 (14% of entries profiled) and 4x8; L = 96 with 6
submeshes x 3 configs; L = 128 with 7 x 2, memory free; and memory-tight
instances from :func:`memory_tight_problem` (L = 128 with 7 x 2 and 7 x 3,
L = 96 with 5 x 3), whose optimum needs about 8-16 stages.

Usage::

    python benchmarks/dp_scaling.py [--suite grid kinds] [--layers 16 32 64 128]
        [--devices 8 16 32 64] [--alpa-budget 60] [--seeds 4]
        [--out benchmarks/results/dp_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import stamp

from pipedejavu.baselines.alpa_dp import ScanTimeout, alpa_training_dp
from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, Problem
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.alpa.exact import exact_dp

CLUSTERS = {8: (1, 8), 16: (2, 8), 32: (4, 8), 64: (8, 8)}


def memory_tight_problem(
    num_layers: int,
    cluster_shape: tuple[int, int],
    *,
    num_microbatches: int = 64,
    num_configs: int = 2,
    submesh_space: str = "power_of_two",
    never_fit: float = 0.71,
    activation_ratio: float = 0.06,
    seed: int = 0,
) -> Problem:
    """A GPT-like instance whose memory limits bind hard and whose optimum
    needs many stages (about 8-16 at L = 128 on 64 devices).

    Costs are :func:`pipedejavu.costmodel.stage.generate.random_problem`'s. Memory per
    device of
    a stage of layers ``i..j`` on ``n`` devices with config ``k``: parameters
    ``P(i..j) / n^(1 - k / K)`` (config 0 shards them over all ``n`` devices,
    higher configs over fewer, as data parallelism replicates them) plus
    ``A(i..j) / n`` activations per micro-batch in flight (1F1B keeps ``s + 1``
    in flight when ``s`` stages follow). Layer parameters ~1 (embedding 3),
    activations ``activation_ratio`` of that, both +-20%. The device capacity
    is the ``1 - never_fit`` quantile of the one-micro-batch need, so
    ``never_fit`` of the entries never fit (``max_n_succ_stages = -1``); the
    others get ``floor((capacity - params) / activations) - 1``. Parameters
    dominate, so long stages must spread over many devices: the plan needs
    many stages, and each stage's limit on its followers binds.
    """
    base = random_problem(
        num_layers,
        cluster_shape,
        num_microbatches=num_microbatches,
        num_configs=num_configs,
        submesh_space=submesh_space,
        seed=seed,
    )
    rng = np.random.default_rng(seed + 1)
    params = np.where(np.arange(num_layers) == 0, 3.0, 1.0)
    params = params * rng.uniform(0.8, 1.2, num_layers)
    activations = activation_ratio * rng.uniform(0.8, 1.2, num_layers)
    param_prefix = np.concatenate([[0.0], np.cumsum(params)])
    act_prefix = np.concatenate([[0.0], np.cumsum(activations)])
    starts, ends = np.triu_indices(num_layers)
    sizes = base.submesh_sizes.astype(np.float64)
    shards = sizes[:, None] ** (1.0 - np.arange(num_configs) / num_configs)[None, :]
    stage_params = (param_prefix[ends + 1] - param_prefix[starts])[:, None, None]
    stage_params = stage_params / shards[None]  # [P, M, K]
    stage_acts = (act_prefix[ends + 1] - act_prefix[starts])[:, None, None]
    stage_acts = stage_acts / sizes[None, :, None]
    need = stage_params + stage_acts
    capacity = np.quantile(need, 1.0 - never_fit)
    limit = np.floor((capacity - stage_params) / stage_acts) - 1
    limit = np.where(need > capacity, -1, limit)
    limit = np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
    memory = np.full(base.compute_cost.shape, -1, dtype=np.int64)
    memory[starts, ends] = limit
    return base.replace(max_n_succ_stages=memory)


#: (name, builder(seed) -> Problem) of the kinds suite.
KINDS = [
    (
        "gpt L32 2x8 B64 14% profiled",
        lambda seed: random_problem(
            32, (2, 8), num_microbatches=64, missing=0.86, seed=100 + seed
        ),
    ),
    (
        "gpt L32 4x8 B128",
        lambda seed: random_problem(32, (4, 8), num_microbatches=128, seed=200 + seed),
    ),
    (
        "L96 6x3 B32 memory free",
        lambda seed: random_problem(
            96, (4, 8), num_microbatches=32, num_configs=3, seed=300 + seed
        ),
    ),
    (
        "L128 7x2 B128 memory free",
        lambda seed: random_problem(128, (8, 8), num_microbatches=128, seed=400 + seed),
    ),
    (
        "L128 7x3 B64 memory binds",
        lambda seed: memory_tight_problem(
            128, (8, 8), num_configs=3, never_fit=0.6, seed=500 + seed
        ),
    ),
    (
        "L128 7x2 B64 memory binds hard",
        lambda seed: memory_tight_problem(128, (8, 8), seed=seed),
    ),
    (
        "L96 5x3 B128 memory binds",
        lambda seed: memory_tight_problem(
            96,
            (8, 4),
            num_microbatches=128,
            num_configs=3,
            submesh_space="small_power_of_two",
            never_fit=0.6,
            seed=700 + seed,
        ),
    ),
]


#: The issue's "best exact method we know" per kind (seconds, in-process, its
#: own instances of the kind on a 2-core machine of this kind): a reference,
#: not a run of this benchmark.
ISSUE_BEST_S = {
    "L96 6x3 B32 memory free": 0.11,
    "L128 7x2 B128 memory free": 0.066,
    "L128 7x3 B64 memory binds": 0.28,
    "L128 7x2 B64 memory binds hard": 0.32,
    "L96 5x3 B128 memory binds": 0.032,
}


def run_kind(name: str, problem: Problem, seed: int, repeats: int = 3) -> dict:
    """Both exact methods on one instance, side by side, alternating; median
    of ``repeats`` runs each (a cap scan over 1 s is timed once)."""
    finite = np.isfinite(problem.compute_cost)
    row = {
        "kind": name,
        "seed": seed,
        "L": problem.num_layers,
        "D": problem.num_devices,
        "M": problem.num_submeshes,
        "K": problem.num_configs,
        "B": problem.num_microbatches,
        "never_fit": float((problem.max_n_succ_stages[finite] < 0).mean()),
    }
    samples: dict[str, list[float]] = {"labels": [], "caps": []}
    plans = {}
    for attempt in range(repeats):
        for method in ("labels", "caps"):
            if method == "caps" and attempt > 0 and samples["caps"][0] > 1.0:
                continue  # a slow cap scan is timed once
            started = time.perf_counter()
            try:
                plans[method] = exact_dp(problem, method=method)
            except Exception as error:  # an infeasible draw: say so, keep going
                row["note"] = f"{type(error).__name__}: {error}"
                return row
            samples[method].append(time.perf_counter() - started)
    times = {method: float(np.median(values)) for method, values in samples.items()}
    labels, caps = plans["labels"], plans["caps"]
    row.update(
        labels_s=times["labels"],
        caps_s=times["caps"],
        caps_over_labels=times["caps"] / times["labels"],
        labels_samples_s=samples["labels"],
        caps_samples_s=samples["caps"],
        stages=labels.num_stages,
        cost=labels.cost,
        same_plan=labels.stages == caps.stages and labels.cost == caps.cost,
        passes=labels.info["num_evaluated"],
        labels=labels.info["num_labels"],
        caps_evaluated=caps.info["num_evaluated"],
        memory_binds=bool(
            exact_dp(problem.replace(max_n_succ_stages=None)).cost < labels.cost
        ),
    )
    return row


KIND_HEADER = (
    f"{'kind':<32} {'seed':>4} {'never fit':>9} {'stages':>6} {'labels s':>9} "
    f"{'caps s':>8} {'caps/lab':>8} {'passes':>6} {'labels':>7} {'binds':>5} "
    f"{'same':>5}"
)


def format_kind(row: dict) -> str:
    head = f"{row['kind']:<32} {row['seed']:>4} {row['never_fit']:>9.0%}"
    if "note" in row:
        return f"{head}  {row['note']}"
    return (
        f"{head} {row['stages']:>6} {row['labels_s']:>9.3f} {row['caps_s']:>8.3f} "
        f"{row['caps_over_labels']:>8.1f} {row['passes']:>6} {row['labels']:>7} "
        f"{str(row['memory_binds']):>5} {str(row['same_plan']):>5}"
    )


SUMMARY_HEADER = (
    f"{'kind (median over seeds)':<32} {'labels s':>9} {'max':>7} {'caps s':>8} "
    f"{'issue best s':>12} {'labels/best':>11}"
)


def summarize_kinds(rows: list[dict]) -> list[str]:
    """Per kind: the median and worst label-DP time over seeds, the cap scan's
    median, and the ratio of the label median to the issue's best method."""
    lines = []
    for name, _ in KINDS:
        done = [row for row in rows if row["kind"] == name and "labels_s" in row]
        if not done:
            continue
        labels = float(np.median([row["labels_s"] for row in done]))
        worst = max(row["labels_s"] for row in done)
        caps = float(np.median([row["caps_s"] for row in done]))
        best = ISSUE_BEST_S.get(name)
        ratio = f"{labels / best:>11.2f}" if best else f"{'':>11}"
        reference = f"{best:>12.3f}" if best else f"{'':>12}"
        lines.append(
            f"{name:<32} {labels:>9.3f} {worst:>7.3f} {caps:>8.3f} {reference} {ratio}"
        )
    return lines


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
    started = time.perf_counter()
    caps = exact_dp(problem, method="caps")
    caps_time = time.perf_counter() - started
    row = {
        "L": num_layers,
        "D": num_devices,
        "memory": memory,
        "M": problem.num_submeshes,
        "K": problem.num_configs,
        "candidates": exact.info["num_candidates"],
        "exact_time_s": exact_time,
        "caps_time_s": caps_time,
        "caps_evaluated": caps.info["num_evaluated"],
        "same_plan": exact.stages == caps.stages,
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
    f"{'L':>4} {'D':>4} {'memory':>6} {'caps':>7} {'exact s':>9} {'capscan s':>9} "
    f"{'eval':>5} "
    f"{'alpa s':>9} {'eval':>6} {'gap':>6} {'stopped':>7} {'alpa/ex':>8} {'cost':>8}"
)


def format_row(row: dict) -> str:
    caps = row.get("caps_time_s", math.nan)  # saved runs before the label DP
    evaluated = row.get("caps_evaluated", row.get("exact_evaluated"))
    head = (
        f"{row['L']:>4} {row['D']:>4} {row['memory']:>6} {row['candidates']:>7} "
        f"{row['exact_time_s']:>9.3f} {caps:>9.3f} {evaluated:>5}"
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


def _show(saved: dict) -> None:
    print(saved["header"])
    grid = [row for row in saved["rows"] if "kind" not in row]
    kinds = [row for row in saved["rows"] if "kind" in row]
    if grid:
        print(HEADER)
        for row in grid:
            print(format_row(row))
    if kinds:
        print(KIND_HEADER)
        for row in kinds:
            print(format_kind(row))
        print(SUMMARY_HEADER)
        for line in summarize_kinds(kinds):
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite", nargs="+", default=["grid"], choices=["grid", "kinds"]
    )
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
        "--seeds", type=int, default=4, help="instances per kind (default 4)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per method (default 3)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/dp_scaling.json")
    )
    parser.add_argument(
        "--show", type=Path, metavar="JSON", help="only print the table of a saved run"
    )
    args = parser.parse_args()
    if args.show:
        _show(json.loads(args.show.read_text()))
        return
    header = (
        f"{stamp.header(python=True)}, "
        f"numpy {np.__version__}, load average {os.getloadavg()[0]:.1f} at start"
    )
    print(header)
    rows = []
    if "grid" in args.suite:
        print(HEADER)
        for num_layers in args.layers:
            for num_devices in args.devices:
                for memory in args.memory:
                    row = run_instance(
                        num_layers, num_devices, memory, args.alpa_budget
                    )
                    rows.append(row)
                    print(format_row(row), flush=True)
    if "kinds" in args.suite:
        exact_dp(KINDS[0][1](0))  # warm-up: first-call costs out of the timings
        print(KIND_HEADER)
        for name, build in KINDS:
            for seed in range(args.seeds):
                row = run_kind(name, build(seed), seed, args.repeats)
                row["load"] = os.getloadavg()[0]
                rows.append(row)
                print(format_kind(row), flush=True)
    if "kinds" in args.suite:
        print(SUMMARY_HEADER)
        for line in summarize_kinds([row for row in rows if "kind" in row]):
            print(line)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
