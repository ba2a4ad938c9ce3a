"""Per-stage recomputation against one count for every stage (issue 25).

For each setting of ``benchmarks/plan_knobs.py`` but the smallest, the best
plan under the predictor with full recomputation, 1F1B, no sequence
parallelism and the optimizer unsharded (Megatron-LM's defaults beside the
recomputation), in two spaces, each proven optimal over its own:

* ``uniform``: the first 1, 2 or 4 blocks of every stage, or every block
  (Megatron-LM's ``--recompute-method block|uniform``);
* ``per stage``: those spaces and each stage's own count, the least of 0, 1,
  2, 4 and every block that fits it
  (:mod:`pipedejavu.costmodel.megatron.stage_recompute`).

    python benchmarks/stage_recompute.py [--out FILE]

Writes ``benchmarks/results/stage_recompute.json`` (date, machine, the plans,
their counts and times, search seconds).
"""

from __future__ import annotations

import time

import stamp

from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.knobs import plan_with_knobs

SETTINGS = [
    ("gpt3-175b", "GPT-3-175B", {"A100-80": 1024}, 1536, 2048),
    ("llama3-70b", "Llama-3-70B", {"H100-SXM": 256}, 1024, 8192),
]


def space(per_stage: bool) -> KnobSpace:
    return KnobSpace(
        recompute=("full",),
        sequence_parallel=(False,),
        distributed_optimizer=(False,),
        schedules=("1f1b",),
        rank_orders=("tp-dp-pp",),
        recompute_layers=(1, 2, 4, None),
        recompute_per_stage=per_stage,
    )


def run(model: str, gpus: dict, gbs: int, seq: int) -> dict:
    out = {"model": model, "gpus": gpus, "gbs": gbs, "seq": seq}
    for name, per_stage in (("uniform", False), ("per stage", True)):
        started = time.perf_counter()
        knobs = plan_with_knobs(
            model, gpus, gbs, seq_length=seq, precision="bf16", space=space(per_stage)
        )
        result = knobs.result
        options = result.options
        out[name] = {
            "iteration_time_s": result.prediction.iteration_time_s,
            "plan": result.plan.describe(),
            "recompute_num_layers": options.recompute_num_layers,
            "recompute_stage_layers": (
                None
                if options.recompute_stage_layers is None
                else list(options.recompute_stage_layers)
            ),
            "proven": bool(result.proven),
            "lower_bound_s": result.predicted_lower_bound_s,
            "search_s": time.perf_counter() - started,
        }
        print(model, name, out[name], flush=True)
    out["speedup"] = (
        out["uniform"]["iteration_time_s"] / out["per stage"]["iteration_time_s"]
    )
    return out


def main(argv=None) -> int:
    out = stamp.out_option(__doc__, str(stamp.RESULTS / "stage_recompute.json"), argv)
    started = time.perf_counter()
    results = {
        **stamp.stamp("vm"),
        "settings": {
            key: run(model, gpus, gbs, seq) for key, model, gpus, gbs, seq in SETTINGS
        },
    }
    results["seconds"] = time.perf_counter() - started
    stamp.save(out, results, end="\n", note=f" ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
