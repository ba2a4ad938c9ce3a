"""Start-up of the ``pipedejavu`` command: whole processes, imports included.

Times, as new processes (the median of ``--repeats``, commands interleaved
round by round so they see the same load):

* ``pipedejavu --help`` (target <= 0.3 s);
* ``pipedejavu solve EXAMPLE`` with the exact DP on bundled examples: the
  generated ``generated-gpt-32layers-2x8`` (target <= 0.6 s) and the real Alpa
  profile ``gpt1.3b-6layers-B128``, whose restricted unpickler's checks take
  part of its time;
* for comparison: an empty Python (``python -c pass``), ``import numpy``,
  ``import scipy.optimize`` and ``import jax``;

and the exact DP itself in this process (load and solve, no imports). With
``--before CHECKOUT`` (a folder holding an older checkout of the repository)
the same commands of that checkout run in the same rounds (``PYTHONPATH`` set
to it), so both trees see the same load. Each process gets a fresh folder in
``$PIPEDEJAVU_CACHE_DIR`` (the user's cache stays untouched).

Python's compiled bytecode is kept, as an installed package has it: the
processes write and read it in a temporary ``PYTHONPYCACHEPREFIX`` (the
checkouts stay clean), after one untimed round, even where
``PYTHONDONTWRITEBYTECODE`` is set. ``--no-bytecode`` times them compiling
every module of ours from source instead, as they run where that variable is
set (a development checkout on a shared machine).

Usage::

    python benchmarks/startup.py [--repeats 7] [--before ../old] [--no-bytecode]
        [--out benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import stamp

REPO = Path(__file__).resolve().parents[1]

#: Runs the command line as the installed ``pipedejavu`` script does.
CLI = "import sys; from pipedejavu.cli import main; sys.exit(main())"

#: name: (arguments of ``python``, target seconds or None, runs in --before).
COMMANDS = {
    "python": (["-c", "pass"], None, False),
    "help": (["-c", CLI, "--help"], 0.3, True),
    "solve_generated": (["-c", CLI, "solve", "generated-gpt-32layers-2x8"], 0.6, True),
    "solve_alpa_profile": (["-c", CLI, "solve", "gpt1.3b-6layers-B128"], None, True),
    "import_numpy": (["-c", "import numpy"], None, False),
    "import_scipy_optimize": (["-c", "import scipy.optimize"], None, False),
    "import_jax": (["-c", "import jax"], None, False),
}


def _process(
    argv: list[str], root: Path, cache: Path, bytecode: Path | None
) -> tuple[float, float]:
    """Wall and CPU time (user + system) of one whole process run in ``root``
    with ``root`` first on the module path (bytecode kept in ``bytecode``)."""
    env = dict(os.environ, PYTHONPATH=str(root), PIPEDEJAVU_CACHE_DIR=str(cache))
    if bytecode is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, *argv], cwd=root, env=env, check=True, capture_output=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _commit(root: Path) -> str:
    """The checkout's commit (a short hash; ``+`` when it has changes)."""
    run = lambda *a: subprocess.run(  # noqa: E731
        ["git", "-C", str(root), *a], capture_output=True, text=True
    ).stdout.strip()
    return run("rev-parse", "--short", "HEAD") + (
        "+" if run("status", "-s", "-uno") else ""
    )


def _in_process(example: str, repeats: int) -> dict[str, float]:
    """The exact DP of ``solve EXAMPLE`` in this process: loading the example
    and solving it (median seconds; the modules are loaded already)."""
    from pipedejavu.planning.inputs import load_problem
    from pipedejavu.planning.solve import solve

    loads, solves = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profile's incomplete records
        for _ in range(repeats + 1):
            started = time.perf_counter()
            problem = load_problem(example)
            loaded = time.perf_counter()
            solve(problem)
            loads.append(loaded - started)
            solves.append(time.perf_counter() - loaded)
    return {  # the first call out: it loads the modules
        "load_s": statistics.median(loads[1:]),
        "dp_s": statistics.median(solves[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", type=Path, help="an older checkout to compare")
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="compile our modules from source in every process",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "startup.json"
    )
    args = parser.parse_args()
    trees = {"after": REPO}
    if args.before is not None:
        trees["before"] = args.before.resolve()
    header = (
        f"{stamp.header(python=True)}, load average {os.getloadavg()[0]:.1f} at start"
    )
    print(header, flush=True)
    folder = Path(tempfile.mkdtemp(prefix="pdj-startup-"))
    bytecode = None if args.no_bytecode else folder / "bytecode"
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    loads = []
    for round_ in range(-1 if bytecode else 0, args.repeats):  # -1: untimed
        loads.append(os.getloadavg()[0])
        for tree, root in trees.items():
            for name, (argv, _, compared) in COMMANDS.items():
                if tree == "before" and not compared:
                    continue
                cache = folder / f"cache-{tree}-{name}-{round_}"
                times = _process(argv, root, cache, bytecode)
                if round_ >= 0:
                    samples.setdefault((tree, name), []).append(times)
    rows = []
    for (tree, name), runs in samples.items():
        argv, target, _ = COMMANDS[name]
        wall = statistics.median(w for w, _ in runs)
        row = {
            "tree": tree,
            "command": name,
            "argv": argv if argv[:2] != ["-c", CLI] else ["pipedejavu", *argv[2:]],
            "wall_s": wall,
            "cpu_s": statistics.median(c for _, c in runs),
            "samples_s": [w for w, _ in runs],
        }
        if target is not None:
            row["target_s"] = target
            row["met"] = wall <= target
        rows.append(row)
        print(
            f"{tree:<7} {name:<22} median {wall:6.3f} s (cpu "
            f"{row['cpu_s']:.3f} s)"
            + (
                f"  target {target} s: {'met' if row['met'] else 'MISSED'}"
                if target
                else ""
            ),
            flush=True,
        )
    in_process = {
        example: _in_process(example, args.repeats)
        for example in ("generated-gpt-32layers-2x8", "gpt1.3b-6layers-B128")
    }
    for example, times in in_process.items():
        print(
            f"in this process: {example}: load {times['load_s']:.3f} s, exact DP "
            f"{times['dp_s']:.4f} s",
            flush=True,
        )
    result = {
        "header": header,
        "repeats": args.repeats,
        "bytecode": "compiled every time" if args.no_bytecode else "kept",
        "commits": {tree: _commit(root) for tree, root in trees.items()},
        "load_average": loads + [os.getloadavg()[0]],
        "rows": rows,
        "in_process": in_process,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
