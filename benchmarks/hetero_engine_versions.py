"""The heterogeneous engine of several source trees, side by side in one run.

Each tree (a checkout of this repository, e.g. a ``git worktree`` of an older
commit) runs :func:`pipedejavu.search.hetero.engine.hetero_search` with its
default configuration on the same generated instances, in a fresh process
whose ``PYTHONPATH`` starts with that tree; the trees take turns, round after
round, so that a busy machine slows them alike. Per run: wall time (cold: the
process compiles), the engine's phase times, the plan's cost (the 1F1B
objective of the tree's own code), its certified gap, the load average.

Usage::

    git worktree add --detach /tmp/before <commit>
    python benchmarks/hetero_engine_versions.py --tree before=/tmp/before \\
        --tree after=. [--layers 256] [--rounds 2]
        [--out benchmarks/results/hetero_engine_versions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import stamp

#: Run in each tree's process: one engine run, its row as JSON on stdout.
_CHILD = """
import json, os, sys, time
import jax
from pipedejavu.costmodel.stage.hetero_generate import (
    hetero_problem, three_type_cluster,
)
from pipedejavu.search.hetero.engine import HeteroSearchConfig, hetero_search
layers = int(sys.argv[1])
problem = hetero_problem(
    layers, three_type_cluster((1, 1, 2)), num_microbatches=32, seed=0
)
started = time.perf_counter()
plan = hetero_search(problem, HeteroSearchConfig(), key=jax.random.key(0))
row = {"engine_s": time.perf_counter() - started, "cost": plan.cost,
       "certified_gap": plan.info["gap"], "num_stages": plan.num_stages,
       "load_average": os.getloadavg()}
for key in ("compile_time_s", "optimize_time_s", "polish_time_s", "bound_time_s"):
    row[key] = plan.info[key]
import pipedejavu
row["package"] = os.path.dirname(pipedejavu.__file__)
print(json.dumps(row))
"""


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--", "pipedejavu"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() + (" + uncommitted changes" if dirty.stdout else "")


def run_tree(tree: Path, layers: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(layers)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
    )
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(row.pop("package")).resolve() != (tree / "pipedejavu").resolve():
        raise RuntimeError(f"{tree}: the run imported another pipedejavu")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree",
        action="append",
        required=True,
        help="NAME=PATH of a source tree (repeat; the order of each round)",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[256])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/hetero_engine_versions.json"),
    )
    args = parser.parse_args()
    trees = {}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not name or not (Path(path) / "pipedejavu").is_dir():
            parser.error(f"--tree {item!r}: expected NAME=PATH of a source tree")
        trees[name] = Path(path)
    rows = []
    for layers in args.layers:
        for round_index in range(args.rounds):
            for name, tree in trees.items():
                row = {"tree": name, "layers": layers, "round": round_index}
                row.update(run_tree(tree, layers))
                rows.append(row)
                print(
                    f"L={layers} round {round_index} {name:<12} "
                    f"{row['engine_s']:7.1f} s  cost {row['cost']:.6f}  gap "
                    f"{row['certified_gap']:.2%}  bound {row['bound_time_s']:.1f} s"
                    f"  polish {row['polish_time_s']:.1f} s  load "
                    f"{row['load_average'][0]:.1f}",
                    flush=True,
                )
    result = {
        "benchmark": "hetero_engine_versions",
        "date": stamp.now(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
        },
        "instance": "three_type_cluster((1, 1, 2)), hetero_problem seed 0, B = 32",
        "trees": {name: _commit(tree) for name, tree in trees.items()},
        "rows": rows,
    }
    stamp.write_json(args.out, result, end="\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
