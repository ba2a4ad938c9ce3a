"""Planning time of mixtures of experts (issue 44's planning targets).

``plan_model`` (what ``pipedejavu plan --model M --gpus H100:N
--global-batch B --seq-len 4096 --precision bf16`` runs) on the settings
below: the best plan, its predicted time and tokens/s per GPU, whether it is
proven optimal under the predictor (else the certified lower bound), and the
wall-clock seconds, one setting at a time in this process (the pricing memo
starts empty for each model; the first setting pays for importing JAX).

    python benchmarks/moe_planning.py [--only ID] [--out FILE]

Writes ``benchmarks/results/moe_planning.json`` with date and machine. The
issue's targets: Qwen3-235B-A22B on 256 H100 proven in 10 s or less,
DeepSeek-V3 on 1,024 H100 in 60 s or less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from pipedejavu.planning.plan_model import plan_model

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = [
    {"id": "qwen3-30b-a3b-16", "model": "Qwen3-30B-A3B", "gpus": 16, "gbs": 1024},
    {"id": "qwen3-235b-a22b-256", "model": "Qwen3-235B-A22B", "gpus": 256, "gbs": 2048},
    {"id": "deepseek-v3-1024", "model": "DeepSeek-V3", "gpus": 1024, "gbs": 8192},
]


def run(setting: dict) -> dict:
    started = time.perf_counter()
    found = plan_model(
        setting["model"],
        {"H100": setting["gpus"]},
        setting["gbs"],
        seq_length=4096,
        precision="bf16",
    )
    seconds = time.perf_counter() - started
    result = found.result
    plan = result.plan
    time_s = result.prediction.iteration_time_s
    return {
        **setting,
        "seconds": seconds,
        "plan": {
            "pp": len(plan.stages),
            "tp": plan.stages[0].replicas[0].tp,
            "dp": len(plan.stages[0].replicas),
            "ep": plan.layout.stages[0].ep,
            "mbs": plan.mbs,
            "options": result.options.to_json(),
        },
        "iteration_time_s": time_s,
        "tokens_per_s_per_gpu": setting["gbs"] * 4096 / (time_s * setting["gpus"]),
        "proven": result.proven,
        "lower_bound_s": result.predicted_lower_bound_s,
        "notes": list(found.choice.notes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one setting's id")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/moe_planning.json")
    )
    args = parser.parse_args()
    chosen = [s for s in SETTINGS if args.only in (None, s["id"])]
    if not chosen:
        parser.error(f"--only: one of {', '.join(s['id'] for s in SETTINGS)}")
    rows = []
    for setting in chosen:
        row = run(setting)
        rows.append(row)
        print(
            f"{row['id']}: {row['seconds']:.1f} s, {row['iteration_time_s']:.4f} s "
            f"predicted ({row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU), "
            + (
                "proven"
                if row["proven"]
                else f"lower bound {row['lower_bound_s']:.4f} s"
            ),
            flush=True,
        )
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node() or 'host'} ({platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "settings": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
