"""Planning time of mixtures of experts (issue 44's planning targets).

``plan_model`` (what ``pipedejavu plan --model M --gpus H100:N
--global-batch B --seq-len 4096 --precision bf16`` runs) on the settings
below: the best plan, its predicted time and tokens/s per GPU, whether it is
proven optimal under the predictor (else the certified lower bound), and the
wall-clock seconds, one setting at a time in this process (the pricing memo
starts empty for each model; the first setting pays for importing JAX).

Then each run of the visible published set (``moe_h100.json``) beside the
best plan for the same model, GPUs, global batch, precision, options and
expert layout (``plan --megatron-args``'s
:func:`~pipedejavu.planning.launch_compare.compare_megatron_run`): the
launch as predicted, the plan's time, the speed-up, whether it is proven,
and the search's seconds.

    python benchmarks/moe_planning.py [--only ID] [--no-published] [--out FILE]

Writes ``benchmarks/results/moe_planning.json`` with date and machine. The
issue's targets: Qwen3-235B-A22B on 256 H100 proven in 10 s or less and
predicted no slower than each published configuration, DeepSeek-V3 on 1,024
H100 in 60 s or less.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import stamp

from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.launch_compare import compare_megatron_run
from pipedejavu.planning.moe_published import GPU, moe_launches
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
    layers = found.choice.data.experts
    return {
        **setting,
        "seconds": seconds,
        "plan": {
            "pp": len(plan.stages),
            "tp": plan.stages[0].replicas[0].tp,
            "dp": len(plan.stages[0].replicas),
            "ep": plan.layout.stages[0].ep,
            "mbs": plan.mbs,
            "dispatcher": layers.experts.dispatcher,
            "a2a_overlap": layers.overlap_dispatch,
            "options": result.options.to_json(),
        },
        "iteration_time_s": time_s,
        "tokens_per_s_per_gpu": setting["gbs"] * 4096 / (time_s * setting["gpus"]),
        "proven": result.proven,
        "lower_bound_s": result.predicted_lower_bound_s,
        "notes": list(found.choice.notes),
    }


def published() -> list[dict]:
    """Each published launch beside the best plan of its settings."""
    sheet = load_gpu_sheet()
    rows = []
    for run_, launch, tokens in moe_launches():
        started = time.perf_counter()
        comparison = compare_megatron_run(launch, GPU, run_.num_gpus, sheet)
        best = comparison.best
        given_s = comparison.given.prediction.iteration_time_s
        per_gpu = launch.global_batch * launch.spec.seq_length / run_.num_gpus
        rows.append(
            {
                "id": run_.run_id,
                "gpus": run_.num_gpus,
                "published_tokens_per_s_per_gpu": tokens,
                "given_tokens_per_s_per_gpu": per_gpu / given_s,
                "planned_tokens_per_s_per_gpu": per_gpu / best.iteration_time_s,
                "speedup": comparison.speedup,
                "proven": best.proven,
                "seconds": time.perf_counter() - started,
                "given": {
                    "pp": launch.pp,
                    "vp": launch.virtual_chunks,
                    "tp": launch.tp,
                    "ep": launch.ep,
                    "mbs": launch.micro_batch,
                },
                "planned": {
                    "pp": best.plan.num_stages,
                    "vp": best.options.virtual_stages,
                    "tp": best.plan.stages[0].replicas[0].tp,
                    "ep": best.plan.layout.stages[0].ep,
                    "mbs": best.plan.mbs,
                    "recompute": best.options.recompute,
                },
            }
        )
        row = rows[-1]
        print(
            f"{row['id']}: x{row['speedup']:.3f} "
            f"({'proven' if row['proven'] else 'not proven'}, {row['seconds']:.1f} s)",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one setting's id")
    parser.add_argument(
        "--no-published", action="store_true", help="skip the published launches"
    )
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
        **stamp.stamp("host"),
        "settings": rows,
    }
    if not args.no_published:
        out["published"] = published()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
