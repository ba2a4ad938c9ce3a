"""Planning large pools (issue 47's scale part): seconds to plan (with the
proof) dense models on thousands of H100, this code against another
checkout side by side.

Each setting is planned in a fresh process by this checkout and, with
``--before DIR`` (a checkout of the code to compare, e.g. ``git worktree add
DIR <rev>``), by that one, alternating, ``--rounds`` times; the plans are
compared field by field (wall-clock fields and the per-knob outcomes aside:
how each knob choice was settled depends on the proofs' cutoffs).

    python benchmarks/large_pools.py [--before DIR] [--rounds N] [--out FILE]

Writes ``benchmarks/results/large_pools.json`` with date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import stamp

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = (
    ("Llama-3-70B", 1024, 1024),
    ("Llama-3-70B", 2048, 1024),
    ("Llama-3.1-405B", 2048, 1024),
    ("Llama-3.1-405B", 4096, 1024),
    ("Llama-3.1-405B", 16384, 1024),  # issue 47's target: <= 30 s
    ("Llama-3.1-405B", 131072, 16384),  # issue 47's target: <= 120 s
)
CHILD = """
import json, sys, time
from pipedejavu.planning.plan_model import plan_model

def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items()
                if k not in ("search_time_s", "time_s", "knobs")}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v

model, gpus, gbs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
started = time.perf_counter()
knobs = plan_model(model, {"H100-SXM": gpus}, gbs)
seconds = time.perf_counter() - started
import pipedejavu
json.dump({"seconds": seconds, "plan": strip(knobs.to_json()),
           "code": str(pipedejavu.__file__),
           "iteration_s": knobs.result.prediction.iteration_time_s,
           "proven": bool(knobs.result.proven)}, open(out, "w"))
"""


def _run(code: Path, model: str, gpus: int, gbs: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(code)}
        # run in the empty folder: `python -c` puts its working directory
        # first on sys.path, which would shadow PYTHONPATH from the checkout
        done = subprocess.run(
            [sys.executable, "-c", CHILD, model, str(gpus), str(gbs), str(out)],
            env=env,
            cwd=folder,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:  # (code before a limit was raised refuses)
            lines = done.stderr.strip().splitlines() or ["no message"]
            return {"refused": lines[-1], "code": str(code / "pipedejavu")}
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a checkout of the code to compare")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/large_pools.json")
    )
    args = parser.parse_args()
    codes = {"after": ROOT}
    if args.before:
        codes = {"before": Path(args.before).resolve(), "after": ROOT}
    rows = []
    for model, gpus, gbs in SETTINGS:
        seconds: dict[str, list[float]] = {name: [] for name in codes}
        plans, refused = {}, {}
        for _ in range(args.rounds):
            for name, code in codes.items():
                result = _run(code, model, gpus, gbs)
                if not Path(result["code"]).resolve().is_relative_to(code.resolve()):
                    raise SystemExit(f"{name} ran {result['code']}, not {code}")
                if "refused" in result:
                    if name == "after":
                        raise SystemExit(f"{model} on {gpus}: {result['refused']}")
                    refused[name] = result["refused"]
                    continue
                seconds[name].append(result["seconds"])
                plans[name] = result
        row = {
            "model": model,
            "gpus": gpus,
            "global_batch": gbs,
            "seconds": seconds,
            "iteration_s": plans["after"]["iteration_s"],
            "proven": plans["after"]["proven"],
        }
        if "before" in plans:
            row["identical"] = plans["before"]["plan"] == plans["after"]["plan"]
            row["iteration_s_before"] = plans["before"]["iteration_s"]
            row["ratio"] = min(seconds["after"]) / min(seconds["before"])
        elif "before" in refused:
            del seconds["before"]
            row["before_refused"] = refused["before"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "plan"}))
    out = {
        "settings": rows,
        "before": args.before and "a checkout given by --before",
        **stamp.stamp("unknown"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
