"""The knobs that decide speed at scale, searched with the plan (issue 25).

For each setting, the best plan under the predictor over nested spaces, each
proven optimal over its own space:

* ``today``: the space before the knobs (1F1B, no recomputation, no sequence
  parallelism, the optimizer unsharded);
* ``+recompute``: recomputation none, selective or full;
* ``+SP, dist-opt``: sequence parallelism and the distributed optimizer too;
* ``+interleaved``: Megatron-LM's interleaved schedule too;
* ``all``: the zero-bubble schedules (ZB-H1, its interleaved form and ZB-V)
  and the ``tp-pp-dp`` rank order too (the spaces before keep Megatron-LM's
  default order);
* ``all + blocks 1/2/4``: full recomputation of only the first 1, 2 or 4
  blocks of each stage too (Megatron-LM's block method; an option, not the
  default space).

And for the published runs of ``pipedejavu/data/published`` named here, the
published configuration as predicted beside the best plan for the same model,
GPUs, global batch and precision (``plan --megatron-args``), in today's space
with the launch's recomputation and with every knob.

    python benchmarks/plan_knobs.py [--only ID] [--out FILE]

Writes ``benchmarks/results/plan_knobs.json`` (date, machine, per setting the
plans, times, knobs and search seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import stamp

from pipedejavu.core.plan3d import rank_order_of
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.knobs import plan_with_knobs
from pipedejavu.planning.launch_compare import compare_megatron_run
from pipedejavu.planning.megatron_launch import options_of_run
from pipedejavu.planning.published_runs import load_published_runs

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = [
    {
        "id": "gpt3-175b",
        "model": "GPT-3-175B",
        "gpus": {"A100-80": 1024},
        "gbs": 1536,
        "seq": 2048,
    },
    {
        "id": "llama3-70b",
        "model": "Llama-3-70B",
        "gpus": {"H100-SXM": 256},
        "gbs": 1024,
        "seq": 8192,
    },
    {
        "id": "llama3-8b",
        "model": "Llama-3-8B",
        "gpus": {"GH-96": 32},
        "gbs": 512,
        "seq": 8192,
    },
]
PUBLISHED = ["sc21_table1_1T"]

DEFAULT_ORDER = ("tp-dp-pp",)
SPACES = {
    "today": KnobSpace(("none",), (False,), (False,), ("1f1b",), DEFAULT_ORDER),
    "+recompute": KnobSpace(
        schedules=("1f1b",),
        sequence_parallel=(False,),
        distributed_optimizer=(False,),
        rank_orders=DEFAULT_ORDER,
    ),  # fmt: skip
    "+SP, dist-opt": KnobSpace(schedules=("1f1b",), rank_orders=DEFAULT_ORDER),
    "+interleaved": KnobSpace(
        schedules=("1f1b", "interleaved"), rank_orders=DEFAULT_ORDER
    ),
    "all": KnobSpace(),
    # full recomputation of 1, 2 or 4 blocks of a stage beside every block
    "all + blocks 1/2/4": KnobSpace(recompute_layers=(1, 2, 4, None)),
}


def summary(result, seconds: float) -> dict:
    options = result.options
    return {
        "iteration_time_s": result.prediction.iteration_time_s,
        "plan": result.plan.describe(),
        "schedule": KnobSpace.fixed(options).schedules[0],
        "rank_order": rank_order_of(result.plan),
        "chunks": options.virtual_stages,
        "recompute": options.recompute,
        "recompute_num_layers": options.recompute_num_layers,
        "sequence_parallel": options.sequence_parallel,
        "distributed_optimizer": options.distributed_optimizer,
        "peak_memory_gb": result.prediction.peak_memory_bytes / 1e9,
        "proven": bool(result.proven),
        "lower_bound_s": result.predicted_lower_bound_s,
        "search_s": seconds,
    }


def run_setting(setting: dict) -> dict:
    out = {k: setting[k] for k in ("model", "gpus", "gbs", "seq")}
    out["spaces"] = {}
    for name, space in SPACES.items():
        started = time.perf_counter()
        knobs = plan_with_knobs(
            setting["model"],
            setting["gpus"],
            setting["gbs"],
            seq_length=setting["seq"],
            precision="bf16",
            space=space,
        )
        out["spaces"][name] = summary(knobs.result, time.perf_counter() - started)
        print(setting["id"], name, out["spaces"][name], flush=True)
    return out


def run_published(run_id: str) -> dict:
    run = next(r for r in load_published_runs() if r.run_id == run_id)
    sheet = load_gpu_sheet()
    out = {"gpus": {run.gpu_type: run.num_gpus}, "args": run.args, "spaces": {}}
    # today's space with the launch's own recomputation (the published runs
    # recompute every layer: without it no plan of the largest fits)
    launch = dataclasses.replace(options_of_run(run.run), virtual_stages=1)
    spaces = {"today": KnobSpace.fixed(launch), "all": SPACES["all"]}
    for name, space in spaces.items():
        started = time.perf_counter()
        comparison = compare_megatron_run(
            run.run, run.gpu_type, run.num_gpus, sheet, space=space
        )
        out["spaces"][name] = summary(comparison.best, time.perf_counter() - started)
        out["published_predicted_s"] = comparison.given.prediction.iteration_time_s
        out["published_plan"] = comparison.given.plan.describe()
        print(run_id, name, out["spaces"][name], flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the setting with this id only")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/plan_knobs.json")
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    results: dict = {"settings": {}, "published": {}}
    if args.only and out.exists():  # one setting rerun: keep the others
        results = json.loads(out.read_text())
    results |= {
        **stamp.stamp("vm"),
        "spaces": {name: space.describe() for name, space in SPACES.items()},
    }
    for setting in SETTINGS:
        if args.only in (None, setting["id"]):
            results["settings"][setting["id"]] = run_setting(setting)
    for run_id in PUBLISHED:
        if args.only in (None, run_id):
            results["published"][run_id] = run_published(run_id)
    results["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
