"""Nothing slower and nothing different: benchmarks of two checkouts side by side.

Runs each benchmark script of two checkouts of the package (``--before``, a
folder with the older checkout, and ``--after``, by default the repository this
script is in) as subprocesses, each with ``PYTHONPATH=<its checkout>``, from its
checkout's root, writing its JSON to a temporary file; interleaved (before,
after, before, after, ...) for ``--rounds`` rounds, so that both see the same
load. Then compares:

* plans and costs, field by field: every field of each saved row except the
  timings (and the date, machine, load lines) must be identical, across trees
  and across rounds; any difference is listed with its path;
* wall times: per row (median over rounds of each tree's in-process timings),
  the sum of those, and the subprocess wall time (imports included), each with
  the ratio after / before.

Benchmarks: ``dp_scaling.py --suite kinds`` (the exact DP on the kinds of its
worst cases, both exact methods), ``plan_vs_sailor.py`` (the Megatron
planner on Sailor's settings) and ``moe_planning.py --no-published`` (the
mixtures of experts' planning settings; chosen with ``--benchmarks``).

Usage::

    python benchmarks/layout_before_after.py --before ../old [--after .]
        [--rounds 2] [--order before-first|alternate]
        [--benchmarks dp_kinds plan_vs_sailor] [--seeds 4]
        [--out benchmarks/results/layout_before_after.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Per benchmark: the script, its extra arguments (``{seeds}`` filled in), the
#: fields that are timings or run metadata (left out of the identity check;
#: matched by key name at any depth), and how to name and time a row.
BENCHMARKS = {
    "dp_kinds": {
        "script": "benchmarks/dp_scaling.py",
        "args": ["--suite", "kinds", "--seeds", "{seeds}"],
        "volatile": {
            "header",
            "labels_s",
            "caps_s",
            "caps_over_labels",
            "labels_samples_s",
            "caps_samples_s",
            "load",
        },
        "rows": lambda saved: saved["rows"],
        "row_name": lambda row: f"{row['kind']} seed {row['seed']}",
        "row_times": lambda row: {
            "labels_s": row.get("labels_s"),
            "caps_s": row.get("caps_s"),
        },
    },
    "plan_vs_sailor": {
        "script": "benchmarks/plan_vs_sailor.py",
        "args": [],
        "volatile": {
            "date",
            "machine",
            "loadavg",
            "search_time_cold_s",
            "search_time_warm_s",
            "search_time_s",
        },
        "rows": lambda saved: saved["settings"],
        "row_name": lambda row: (
            f"{row['model']} "
            + "+".join(f"{n} {t}" for t, n in row["gpus"].items())
            + f" gbs {row['gbs']}"
        ),
        "row_times": lambda row: {
            "cold_s": row["ours"]["search_time_cold_s"],
            "warm_s": row["ours"]["search_time_warm_s"],
            "mixed_s": row.get("mixed_types", {}).get("search_time_s"),
        },
    },
    "moe_planning": {
        "script": "benchmarks/moe_planning.py",
        "args": ["--no-published"],
        "volatile": {"date", "machine", "seconds"},
        "rows": lambda saved: saved["settings"],
        "row_name": lambda row: row["id"],
        "row_times": lambda row: {"seconds": row["seconds"]},
    },
}


def strip(value, volatile: set[str]):
    """``value`` without the keys in ``volatile`` (at any depth)."""
    if isinstance(value, dict):
        return {k: strip(v, volatile) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [strip(v, volatile) for v in value]
    return value


def differences(a, b, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ (exact equality, floats too)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'after' if key in b else 'before'}")
            else:
                out.extend(differences(a[key], b[key], f"{path}/{key}"))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        out = []
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            out.extend(differences(x, y, f"{path}[{index}]"))
        return out
    if type(a) is not type(b) or a != b:
        return [f"{path}: {a!r} vs {b!r}"]
    return []


def git(tree: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()


def tree_info(tree: Path) -> dict:
    """The checkout's commit, whether it has local changes (besides results),
    and where ``import pipedejavu`` resolves with its PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    where = subprocess.run(
        [sys.executable, "-c", "import pipedejavu; print(pipedejavu.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"PYTHONPATH={tree} imports pipedejavu from {where}")
    changed = [
        line
        for line in git(tree, "status", "--porcelain").splitlines()
        if "benchmarks/results/" not in line
    ]
    return {
        "path_name": tree.resolve().name,
        "commit": git(tree, "rev-parse", "HEAD"),
        "commit_date": git(tree, "log", "-1", "--format=%cI"),
        "subject": git(tree, "log", "-1", "--format=%s")[:120],
        "local_changes": changed,
        "imports_from": str(Path(where).resolve().relative_to(tree.resolve())),
    }


def run_once(tree: Path, spec: dict, seeds: int) -> dict:
    """One subprocess run of one benchmark of one checkout."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        args = [a.format(seeds=seeds) for a in spec["args"]]
        command = [sys.executable, str(tree / spec["script"]), *args, "--out", str(out)]
        env = dict(os.environ, PYTHONPATH=str(tree))
        load = os.getloadavg()[0]
        started = time.perf_counter()
        done = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            tail = done.stderr[-3000:]
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{tail}")
        saved = json.loads(out.read_text())
    return {"wall_s": wall, "load_before": load, "saved": saved}


def ratio(after, before):
    return after / before if before else None


def compare(name: str, spec: dict, runs: dict[str, list[dict]]) -> dict:
    """Identity of plans/costs and times side by side for one benchmark."""
    volatile = spec["volatile"]
    reference = strip(runs["before"][0]["saved"], volatile)
    diffs = {}
    for side in ("before", "after"):
        for index, run in enumerate(runs[side]):
            if side == "before" and index == 0:
                continue
            found = differences(reference, strip(run["saved"], volatile))
            if found:
                diffs[f"{side} round {index + 1} vs before round 1"] = found
    rows_before = [spec["rows"](run["saved"]) for run in runs["before"]]
    rows_after = [spec["rows"](run["saved"]) for run in runs["after"]]
    per_row = []
    totals = {"before": {}, "after": {}}
    for index, row in enumerate(rows_before[0]):
        entry = {"row": spec["row_name"](row)}
        for key in spec["row_times"](row):
            before = [spec["row_times"](rows[index])[key] for rows in rows_before]
            after = [spec["row_times"](rows[index])[key] for rows in rows_after]
            if any(v is None for v in before + after):
                continue
            b, a = statistics.median(before), statistics.median(after)
            entry[key] = {"before": b, "after": a, "ratio": ratio(a, b)}
            totals["before"][key] = totals["before"].get(key, 0.0) + b
            totals["after"][key] = totals["after"].get(key, 0.0) + a
        per_row.append(entry)
    walls = {side: [run["wall_s"] for run in runs[side]] for side in runs}
    summed = {
        key: {
            "before": totals["before"][key],
            "after": totals["after"][key],
            "ratio": ratio(totals["after"][key], totals["before"][key]),
        }
        for key in totals["before"]
    }
    wall = {
        "before_runs_s": walls["before"],
        "after_runs_s": walls["after"],
        "before_median_s": statistics.median(walls["before"]),
        "after_median_s": statistics.median(walls["after"]),
    }
    wall["ratio"] = ratio(wall["after_median_s"], wall["before_median_s"])
    return {
        "identical": not diffs,
        "differences": diffs,
        "rows_compared": len(rows_before[0]),
        "row_time_sums": summed,
        "subprocess_wall": wall,
        "per_row": per_row,
        "load_before_each_run": {
            side: [run["load_before"] for run in runs[side]] for side in runs
        },
        "volatile_fields": sorted(volatile),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", type=Path, required=True, help="folder with the older checkout"
    )
    parser.add_argument(
        "--after",
        type=Path,
        default=REPO,
        help="folder with the newer checkout (default: this script's repository)",
    )
    parser.add_argument(
        "--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS)
    )
    parser.add_argument("--rounds", type=int, default=2, help="before/after pairs")
    parser.add_argument(
        "--order",
        default="before-first",
        choices=["before-first", "alternate"],
        help="before-first: before, after in every round; alternate: after, before "
        "in every second round (cancels a bias of running second)",
    )
    parser.add_argument("--seeds", type=int, default=4, help="dp_scaling kinds seeds")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks/results/layout_before_after.json",
    )
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    info = {side: tree_info(tree) for side, tree in trees.items()}
    for side in trees:
        print(f"# {side}: {info[side]['commit'][:10]} {info[side]['subject'][:70]}")
    load_start = list(os.getloadavg())
    started = datetime.now(timezone.utc)
    print(f"# {started:%Y-%m-%d %H:%M} UTC, load average {load_start}")
    runs = {name: {"before": [], "after": []} for name in args.benchmarks}
    for round_ in range(args.rounds):
        for name in args.benchmarks:
            sides = ("before", "after")
            if args.order == "alternate" and round_ % 2 == 1:
                sides = ("after", "before")
            for side in sides:
                run = run_once(trees[side], BENCHMARKS[name], args.seeds)
                runs[name][side].append(run)
                print(
                    f"round {round_ + 1} {name:15s} {side:6s} {run['wall_s']:7.1f} s "
                    f"(load {run['load_before']:.2f} before)",
                    flush=True,
                )
    comparison = {name: compare(name, BENCHMARKS[name], runs[name]) for name in runs}
    result = {
        "benchmark": "layout_before_after",
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
        "rounds": args.rounds,
        "order": (
            "per round, per benchmark: before then after"
            if args.order == "before-first"
            else "per benchmark: before, after in odd rounds, after, before in even"
        ),
        "arguments": {
            name: [a.format(seeds=args.seeds) for a in BENCHMARKS[name]["args"]]
            for name in args.benchmarks
        },
        "before": info["before"],
        "after": info["after"],
        "comparison": comparison,
    }
    for name, found in comparison.items():
        print(
            f"\n{name}: plans/costs identical over {found['rows_compared']} rows "
            f"and {args.rounds} rounds: {found['identical']}"
        )
        for label, diffs in found["differences"].items():
            print(f"  {label}: {len(diffs)} differences, e.g. {diffs[:3]}")
        for entry in found["per_row"]:
            times = "  ".join(
                f"{key} {v['before']:.3f}->{v['after']:.3f} ({v['ratio']:.2f})"
                for key, v in entry.items()
                if key != "row"
            )
            print(f"  {entry['row']:45s} {times}")
        for key, v in found["row_time_sums"].items():
            print(
                f"  sum {key}: {v['before']:.2f} s -> {v['after']:.2f} s, "
                f"after/before {v['ratio']:.3f}"
            )
        wall = found["subprocess_wall"]
        print(
            f"  subprocess wall (median): {wall['before_median_s']:.1f} s -> "
            f"{wall['after_median_s']:.1f} s, after/before {wall['ratio']:.3f}"
        )
    print(f"# load average at the end {result['loadavg_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
