"""Hardware-aware planning: the engine vs Alpa's way vs the exact oracle.

Per instance, measured side by side in one run: Alpa's way
(:func:`pipedejavu.baselines.hetero.alpa_homogeneous`: Alpa's exact DP on the
mean-speed homogeneous view, placed blind to types, priced on the true
cluster), the differentiable engine
(:func:`pipedejavu.search.hetero.engine.hetero_search`: cost, cold time with
compilation, warm time, certified gap to its lower bound), the exact search
over every valid plan as ``solve(..., "dp")`` runs it
(:func:`pipedejavu.search.hetero.exact.hetero_exact`, with a time limit, then
:func:`~pipedejavu.search.hetero.polish.local_search` on the objective when it
cannot prove its plan optimal: ``exact_then_polish``) and, for comparison, the
oracle as it was before issue 17, over canonical placements only
(``hetero_canonical.py``, same limit): its plan and its time.

Since issue 23 the objective is 1F1B's (``hetero_rules.hetero_objective``);
the exact search is exact for the all-in-flight ``hetero_bound`` only, a lower
bound on it, so "oracle" is the ``dp`` method's plan with its certified status
(``oracle_proven``: ``optimal`` or ``bounded``, ``oracle_lower_bound``,
``oracle_gap``), not an optimum unless proven. The canonical oracle is still
exact for ``hetero_bound`` over canonical placements; its plan is priced on the
objective. Ratios: ``better = 1 - engine / alpa``, ``engine / oracle - 1``
(issue 17 target <= 1%; negative when the engine beats the dp plan),
``alpa / oracle`` (Alpa's way over the dp plan; ``alpa / oracle lower bound``
bounds what any plan can gain), ``oracle time / canonical oracle time`` (the
exact search alone, before the polish; issue 17 target <= 2).

Instances (:mod:`pipedejavu.costmodel.stage.hetero_generate`, GPT-3 6.7B-like, B = 32):
  two_type    2 A100 (speed 1) + 2 V100 (speed 0.5) hosts x 8 devices, slow
              inter-host links (25 Gb/s, 10 Gb/s between types); L = 32, 64,
              128, seeds 0 and 1;
  three_type  1 H100 + 1 A100 + 2 V100 hosts x 8 (L = 128, 256) and
              2 + 2 + 4 hosts x 8 (L = 128); the engine must return in under a
              minute with a certified gap.
  large       4 H100 + 4 A100 + 8 V100 hosts x 8 (128 devices), L = 128 and
              256: the engine with ``time_budget_s=50`` (cold run only), the
              oracle with ``--oracle-limit`` (reported as '> limit' when cut
              off); results in ``benchmarks/results/hetero_vs_alpa_large.json``.
  placement   (``--suite placement``) 200 random small instances (1-3 types,
              speed ties, 1-4 hosts of 2-4 devices, links free, slow inside
              or between hosts, L <= 6): how often and by how much the true
              optimum beats the canonical one, and both oracles' times;
              results in ``benchmarks/results/hetero_placement.json``. Both
              oracles are exact for ``hetero_bound`` (the objective before
              issue 23), so the optima compared (``oracle``, ``canonical``)
              are of that; ``oracle_cost`` and ``canonical_cost`` are their
              plans' 1F1B objective, ``oracle_proven`` the exact search's
              status on it.

Usage::

    python benchmarks/hetero_vs_alpa.py [--suite two_type three_type]
        [--oracle-limit 300] [--out benchmarks/results/hetero_vs_alpa.json]
    python benchmarks/hetero_vs_alpa.py --suite large --oracle-limit 120
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
import stamp
from hetero_canonical import CanonicalTimeoutError, canonical_exact  # noqa: I001

from pipedejavu.baselines.hetero import alpa_homogeneous
from pipedejavu.core.cluster import Cluster, DeviceType, Link
from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.hetero_rules import evaluate_hetero, hetero_bound
from pipedejavu.core.problem import InfeasibleProblemError, get_submesh_choices
from pipedejavu.costmodel.stage.hetero_generate import (
    hetero_problem,
    three_type_cluster,
    two_type_cluster,
)
from pipedejavu.search.hetero.assign import split
from pipedejavu.search.hetero.engine import HeteroSearchConfig, hetero_search
from pipedejavu.search.hetero.exact import HeteroTimeoutError, hetero_exact
from pipedejavu.search.hetero.polish import local_search

NUM_MICROBATCHES = 32
#: The large suite's engine budget (s): optimization + polish + bound.
LARGE_BUDGET_S = 50.0


def _random_small(rng: np.random.Generator) -> HeteroProblem:
    """A small instance that stresses placement (see the module docstring)."""
    num_types = int(rng.integers(1, 4))
    speeds = rng.choice([0.5, 0.7, 1.0, 1.0], num_types)
    types = [DeviceType(f"t{i}", float(v)) for i, v in enumerate(speeds)]
    dph = int(rng.choice([2, 2, 3, 4]))
    num_hosts = int(rng.integers(1, 5 if dph == 2 else 4))
    hosts = rng.integers(0, num_types, num_hosts).tolist()

    def link() -> Link:
        if rng.random() < 0.25:
            return Link()
        return Link(float(rng.uniform(0, 0.3)), float(rng.choice([0.5, 2.0, 20.0])))

    cluster = Cluster.from_types(
        types,
        hosts,
        dph,
        intra_host={t.name: link() for t in types},
        inter_host={"default": link()},
    )
    if dph == 3:
        shapes = [(1, 1), (1, 2), (1, 3)] + [(h, 3) for h in range(2, num_hosts + 1)]
    else:
        shapes = list(get_submesh_choices(num_hosts, dph, "all"))
    shapes = np.array(shapes)
    num_layers = int(rng.integers(2, 7))
    shape = (num_layers, num_layers, len(shapes), 2, num_types)
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1
    cost = (
        rng.uniform(0.5, 2.0, shape)
        * np.clip(spans, 1, None)[:, :, None, None, None]
        / (shapes[:, 0] * shapes[:, 1])[None, None, :, None, None] ** 0.8
        / np.asarray(cluster.speeds)
    )
    cost[rng.random(shape) < 0.15] = np.inf
    limits = np.where(
        rng.random(shape) < 0.3, rng.integers(-1, num_layers, shape), 2**20
    )
    return HeteroProblem(
        cost,
        limits,
        shapes,
        cluster,
        int(rng.integers(1, 9)),
        boundary_bytes=rng.uniform(0, 4, num_layers - 1),
    )


def placement_suite(count: int) -> dict:
    """True vs canonical optimum on ``count`` random small instances."""
    rows = []
    for seed in range(count):
        problem = _random_small(np.random.default_rng([17, seed]))
        row = {"seed": seed, "num_layers": problem.num_layers}
        for name, solve in (("oracle", hetero_exact), ("canonical", canonical_exact)):
            started = time.perf_counter()
            try:
                plan = solve(problem)
                elapsed = time.perf_counter() - started
                row[f"{name}_cost"] = plan.cost
                if name == "oracle":
                    # the certified bound is the optimum of hetero_bound
                    row[name] = plan.info["lower_bound"]
                    row["oracle_proven"] = plan.info["proven"]
                    row["searched"] = plan.info["num_searched"] > 0
                else:
                    row[name] = hetero_bound(
                        [stage.latency for stage in plan.stages],
                        plan.transfers,
                        problem.num_microbatches,
                    )
            except InfeasibleProblemError:
                elapsed = time.perf_counter() - started
                row[name] = row[f"{name}_cost"] = math.inf
            row[f"{name}_s"] = elapsed
        rows.append(row)
    feasible = [r for r in rows if math.isfinite(r["oracle"])]
    cheaper = [r for r in feasible if r["oracle"] < r["canonical"] * (1 - 1e-9)]
    ratios = [
        r["oracle"] / r["canonical"] for r in cheaper if math.isfinite(r["canonical"])
    ]
    summary = {
        "instances": count,
        "feasible": len(feasible),
        "cheaper_than_canonical": len(cheaper),
        "canonical_infeasible_only": sum(
            1 for r in cheaper if not math.isfinite(r["canonical"])
        ),
        "ratio_median": float(np.median(ratios)) if ratios else None,
        "ratio_min": float(np.min(ratios)) if ratios else None,
        "oracle_s_total": sum(r["oracle_s"] for r in rows),
        "canonical_s_total": sum(r["canonical_s"] for r in rows),
        "searched_by_astar": sum(1 for r in rows if r.get("searched")),
        "oracle_proven_optimal": sum(
            1 for r in rows if r.get("oracle_proven") == "optimal"
        ),
        "oracle_cheaper_than_canonical_on_objective": sum(
            1 for r in feasible if r["oracle_cost"] < r["canonical_cost"] * (1 - 1e-9)
        ),
        "canonical_cheaper_on_objective": sum(
            1 for r in feasible if r["canonical_cost"] < r["oracle_cost"] * (1 - 1e-9)
        ),
    }
    return {"summary": summary, "rows": rows}


def instances(suites: list[str]):
    """``(suite, name, problem)`` triples."""
    if "two_type" in suites:
        cluster = two_type_cluster(2, 2, 8, inter_host_gbps=25, cross_type_gbps=10)
        for layers in (32, 64, 128):
            for seed in (0, 1):
                problem = hetero_problem(
                    layers, cluster, num_microbatches=NUM_MICROBATCHES, seed=seed
                )
                yield "two_type", f"2A100+2V100 L={layers} s={seed}", problem
    if "three_type" in suites:
        for hosts, layers in (((1, 1, 2), 128), ((1, 1, 2), 256), ((2, 2, 4), 128)):
            cluster = three_type_cluster(hosts)
            problem = hetero_problem(
                layers, cluster, num_microbatches=NUM_MICROBATCHES, seed=0
            )
            name = f"{hosts[0]}H100+{hosts[1]}A100+{hosts[2]}V100 L={layers}"
            yield "three_type", name, problem
    if "large" in suites:
        cluster = three_type_cluster((4, 4, 8))
        for layers in (128, 256):
            problem = hetero_problem(
                layers, cluster, num_microbatches=NUM_MICROBATCHES, seed=0
            )
            yield "large", f"4H100+4A100+8V100 L={layers}", problem


def measure(
    suite: str,
    name: str,
    problem: HeteroProblem,
    config: HeteroSearchConfig,
    oracle_limit: float,
    *,
    time_budget_s: float | None = None,
    warm_run: bool = True,
) -> dict:
    row: dict = {
        "suite": suite,
        "instance": name,
        "cluster": problem.cluster.describe(),
        "num_layers": problem.num_layers,
        "num_devices": problem.num_devices,
        "num_microbatches": problem.num_microbatches,
    }
    started = time.perf_counter()
    alpa = alpa_homogeneous(problem)
    row["alpa_s"] = time.perf_counter() - started
    row["alpa_cost"] = alpa.cost
    row["alpa_stages"] = alpa.num_stages
    row["alpa_mixed_stages"] = alpa.info.get("mixed_stages")

    started = time.perf_counter()
    search = dict(key=jax.random.key(0), time_budget_s=time_budget_s)
    plan = hetero_search(problem, config, **search)
    row["engine_cold_s"] = time.perf_counter() - started
    row["engine_budget_s"] = time_budget_s
    assert plan.cost == evaluate_hetero(problem, plan)
    row["engine_warm_s"] = row["engine_warm_cost"] = None
    if warm_run:
        started = time.perf_counter()
        warm = hetero_search(problem, config, **search)
        row["engine_warm_s"] = time.perf_counter() - started
        row["engine_warm_cost"] = warm.cost
    row["engine_cost"] = plan.cost
    row["engine_stages"] = plan.num_stages
    row["engine_types"] = [s.device_type for s in plan.stages]
    row["lower_bound"] = plan.info["lower_bound"]
    row["certified_gap"] = plan.info["gap"]
    for key in (
        "compile_time_s",
        "optimize_time_s",
        "polish_time_s",
        "bound_time_s",
        "fraction_best",
    ):
        row[key] = plan.info[key]
    row["engine_first_best_s"] = plan.info["trace"][-1][0]
    row["better_than_alpa"] = 1.0 - plan.cost / alpa.cost

    started = time.perf_counter()
    try:
        oracle = hetero_exact(problem, time_limit_s=oracle_limit)
        row["oracle_finished"] = True
    except HeteroTimeoutError as error:
        oracle = error.best_plan
        row["oracle_finished"] = False
        row["oracle_lower_bound"] = error.lower_bound
    row["oracle_search_s"] = time.perf_counter() - started
    row["oracle_exact_cost"] = None if oracle is None else oracle.cost
    if row["oracle_finished"]:
        # exact_then_polish (solve(..., "dp")): local moves on the objective
        # when the exact search cannot prove its plan optimal, within the limit
        row["oracle_lower_bound"] = oracle.info["lower_bound"]
        if oracle.info["proven"] != "optimal":
            stages, placement = split(oracle.stages)
            cost, _, _ = local_search(
                problem,
                stages,
                placement,
                oracle.cost,
                deadline=started + oracle_limit,
            )
            oracle_cost = min(cost, oracle.cost)
        else:
            oracle_cost = oracle.cost
        bound = row["oracle_lower_bound"]
        row["oracle_proven"] = "optimal" if oracle_cost <= bound else "bounded"
        row["oracle_gap"] = oracle_cost / bound - 1 if bound > 0 else 0.0
    else:
        oracle_cost = row["oracle_exact_cost"]
    row["oracle_cost"] = oracle_cost
    row["oracle_s"] = time.perf_counter() - started
    row["oracle_time"] = (
        f"{row['oracle_s']:.1f} s"
        if row["oracle_finished"]
        else f"> {oracle_limit:g} s"
    )
    if row["oracle_finished"]:
        row["engine_vs_oracle"] = plan.cost / row["oracle_cost"] - 1.0
        row["oracle_gap_to_bound"] = row["oracle_cost"] / row["lower_bound"] - 1.0
        row["alpa_vs_oracle"] = alpa.cost / row["oracle_cost"]
        row["alpa_vs_oracle_bound"] = alpa.cost / row["oracle_lower_bound"]
        row["oracle_info"] = {k: v for k, v in oracle.info.items() if k != "t_max"}
    started = time.perf_counter()
    try:
        canonical = canonical_exact(problem, time_limit_s=oracle_limit)
        row["canonical_cost"] = canonical.cost
        row["canonical_finished"] = True
    except CanonicalTimeoutError as error:
        best = error.best_plan
        row["canonical_cost"] = None if best is None else best.cost
        row["canonical_finished"] = False
    row["canonical_s"] = time.perf_counter() - started
    if row["oracle_finished"] and row["canonical_finished"]:
        row["oracle_time_ratio"] = row["oracle_search_s"] / row["canonical_s"]
        row["oracle_vs_canonical"] = row["oracle_cost"] / row["canonical_cost"]
    row["load_average"] = os.getloadavg()
    return row


HEADER = (
    f"{'instance':<30} {'alpa':>9} {'engine':>9} {'oracle':>9} {'canon':>9} "
    f"{'better':>7} {'vs orc':>7} {'dp gap':>6} {'gap':>6} {'alpa s':>7} {'cold s':>7} "
    f"{'warm s':>7} {'orc s':>7} {'can s':>7} {'ratio':>6} {'load':>5}"
)


def format_row(row: dict) -> str:
    oracle = row["oracle_cost"]
    versus = row.get("engine_vs_oracle")
    dp_gap = row.get("oracle_gap")
    warm = row["engine_warm_s"]
    timed = (
        f"{row['oracle_s']:7.1f}"
        if row["oracle_finished"]
        else (f"{'> ' + format(row['oracle_s'], '.0f'):>7}")
    )
    canonical = row["canonical_cost"]
    ratio = row.get("oracle_time_ratio")
    return (
        f"{row['instance']:<30} {row['alpa_cost']:9.4f} {row['engine_cost']:9.4f} "
        f"{'-' if oracle is None else f'{oracle:.4f}':>9} "
        f"{'-' if canonical is None else f'{canonical:.4f}':>9} "
        f"{row['better_than_alpa']:7.1%} "
        f"{'-' if versus is None else f'{versus:+.2%}':>7} "
        f"{'-' if dp_gap is None else f'{dp_gap:.2%}':>6} "
        f"{row['certified_gap']:6.2%} {row['alpa_s']:7.2f} "
        f"{row['engine_cold_s']:7.1f} {'-' if warm is None else f'{warm:.1f}':>7} "
        f"{timed} {row['canonical_s']:7.1f} "
        f"{'-' if ratio is None else f'{ratio:.2f}':>6} {row['load_average'][0]:5.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        nargs="+",
        default=["two_type", "three_type"],
        choices=["two_type", "three_type", "large", "placement"],
    )
    parser.add_argument("--count", type=int, default=200, help="placement suite")
    parser.add_argument("--oracle-limit", type=float, default=300.0)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/hetero_vs_alpa.json "
        "(hetero_vs_alpa_large.json for --suite large alone)",
    )
    args = parser.parse_args()
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
    }
    if args.suite == ["placement"]:
        out = args.out or Path("benchmarks/results/hetero_placement.json")
        result = placement_suite(args.count)
        machine["load_average_at_end"] = os.getloadavg()
        result = {
            "benchmark": "hetero_placement",
            "date": stamp.now(),
            "machine": machine,
            **result,
        }
        print(json.dumps(result["summary"], indent=1))
        stamp.write_json(out, result, end="\n")
        print(f"wrote {out}")
        return
    if args.out is None:
        stem = "hetero_vs_alpa_large" if args.suite == ["large"] else "hetero_vs_alpa"
        args.out = Path(f"benchmarks/results/{stem}.json")
    config = HeteroSearchConfig()
    print(
        "costs: seconds per iteration (1F1B objective); oracle: solve(dp), the "
        "exact search over every valid plan (exact for hetero_bound) polished "
        "on the objective; dp gap = oracle/its certified bound - 1; canon: the "
        "canonical-placement oracle before issue 17; better = 1 - engine/alpa; "
        "vs orc = engine/oracle - 1; gap = engine/lower bound - 1 (certified); "
        "cold includes compilation; '> t' = cut off at the time limit t; ratio "
        "= oracle time / canonical oracle time; load = 1-minute load average"
    )
    print(HEADER)
    rows = []
    for suite, name, problem in instances(args.suite):
        large = suite == "large"
        row = measure(
            suite,
            name,
            problem,
            config,
            args.oracle_limit,
            time_budget_s=LARGE_BUDGET_S if large else None,
            warm_run=not large,
        )
        rows.append(row)
        print(format_row(row), flush=True)
    result = {
        "benchmark": "hetero_vs_alpa",
        "date": stamp.now(),
        "machine": {**machine, "load_average_at_end": os.getloadavg()},
        "engine_config": {
            key: value for key, value in vars(config).items() if not key.startswith("_")
        },
        "oracle_limit_s": args.oracle_limit,
        "rows": rows,
    }
    stamp.write_json(args.out, result, end="\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
