"""Planning time with context parallelism and sharded data parallelism
(issue 45's planning targets).

``plan_model`` (what ``pipedejavu plan --model M --gpus H100:N
--global-batch B --seq-len S`` runs: the proven pipeline search joined by
the sharded single-stage space, FSDP2/HSDP x TP x CP) on the settings below,
and the same with ``--export torchtitan`` (the sharded space alone, with
torchtitan's recomputations): the best plan, its predicted time and
tokens/s per GPU, whether it is proven optimal under the predictor, which
space it came from, and the wall-clock seconds.

    python benchmarks/sharded_planning.py [--out FILE]

Writes ``benchmarks/results/sharded_planning.json`` with date and machine.
The issue's targets: Llama-3.1-8B at 131,072 tokens on 64 H100 proven in
10 s or less, Llama-3.1-405B at 8,192 tokens on 2,048 H100 in 60 s or less
(here the 8B model is the bundled Llama-3-8B preset: the same shape).
"""

from __future__ import annotations

import argparse
import time

import stamp

from pipedejavu.planning.plan_model import plan_model

SETTINGS = [
    {"id": "llama3-8b-128k-64", "model": "Llama-3-8B", "gpus": 64, "gbs": 16,
     "seq": 131072},
    {"id": "llama3.1-405b-8k-2048", "model": "Llama-3.1-405B", "gpus": 2048,
     "gbs": 1024, "seq": 8192},
]  # fmt: skip


def run(setting: dict, export: str | None) -> dict:
    started = time.perf_counter()
    found = plan_model(
        setting["model"],
        {"H100": setting["gpus"]},
        setting["gbs"],
        seq_length=setting["seq"],
        export=export,
    )
    seconds = time.perf_counter() - started
    result = found.result
    tokens = setting["gbs"] * setting["seq"]
    return {
        "id": setting["id"] + ("" if export is None else f"-{export}"),
        "model": setting["model"],
        "gpus": setting["gpus"],
        "global_batch": setting["gbs"],
        "seq_length": setting["seq"],
        "export": export,
        "plan": result.plan.describe(),
        "options": result.options.to_json(),
        "space": "sharded" if result.method == "enumeration" else "pipelines",
        "iteration_time_s": result.iteration_time_s,
        "tokens_per_s_per_gpu": tokens / result.iteration_time_s / setting["gpus"],
        "proven": result.proven,
        "search_seconds": seconds,
        "notes": list(found.choice.notes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/sharded_planning.json")
    args = parser.parse_args()
    rows = []
    for setting in SETTINGS:
        for export in (None, "torchtitan"):
            row = run(setting, export)
            rows.append(row)
            print(
                f"{row['id']:36s} {row['plan']:58s} {row['iteration_time_s']:8.3f} s "
                f"{row['tokens_per_s_per_gpu']:7.0f} tok/s/GPU "
                f"{'proven' if row['proven'] else 'NOT proven'} ({row['space']}) "
                f"in {row['search_seconds']:.1f} s"
            )
    result = {
        "runs": rows,
        **stamp.stamp(),
    }
    stamp.write_json(args.out, result, end="\n")


if __name__ == "__main__":
    main()
