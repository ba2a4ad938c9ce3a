"""How well the analytical cost model predicts the bundled per-layer profiles.

The roofline's constants (:mod:`pipedejavu.costmodel.analytical.roofline`) are
fitted on the block entries (forward and backward) of the Sailor profiles;
then, for each model (each GPU type), refitted without it and its entries
predicted: the error is ``|predicted / measured - 1|`` of forward + backward
per block at every profiled (mbs, tp), summarized per GPU type (per model)
as median and max. Head (forward + backward) and embedding (forward) layers
are predicted with the same held-out constants (they are never fitted).
Also: the precision hypotheses on A100 (TF32 vs plain fp32) and the
activation bytes against Sailor's measured ``act_mem`` (informative).

Usage::

    python benchmarks/analytical_accuracy.py [--out FILE.json]
"""

from __future__ import annotations

import time

import numpy as np
import stamp

from pipedejavu.costmodel.analytical.calibrate import (
    PROFILED_MODELS,
    calibration_set,
    cross_validate,
    precision_hypotheses,
)
from pipedejavu.costmodel.analytical.layers import activation_bytes
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data


def activation_ratios() -> dict[str, dict[str, float]]:
    """Our fp32 block activation bytes (no recomputation, attention dropout,
    no flash attention) over Sailor's measured ``act_mem`` at mbs 1."""
    data = load_sailor_data()
    out = {}
    for model, spec in PROFILED_MODELS.items():
        info = data.model_info(model)
        out[model] = {}
        for tp in info.tp_values:
            ours = activation_bytes(spec, 1, tp, "fp32")[1]
            out[model][f"tp{tp}"] = float(ours / (info.act_mem[tp][1] * 4.0))
    return out


def _row(summary: dict) -> str:
    return f"{100 * summary['median']:5.1f}% / {100 * summary['max']:5.1f}%"


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/analytical_accuracy.json")
    started = time.perf_counter()
    samples = calibration_set()
    result = cross_validate(samples)
    result["precision_hypotheses"] = precision_hypotheses()
    result["activation_ratio_vs_sailor"] = activation_ratios()
    elapsed = time.perf_counter() - started
    print("leave-one-model-out (fit without the model; blocks fwd+bwd, median / max)")
    for model, entry in result["leave_one_model_out"].items():
        for gpu, summary in entry["blocks"].items():
            head = entry["head"].get(gpu)
            emb = entry["embedding_forward"].get(gpu)
            print(
                f"  {model:12s} {gpu:10s} blocks {_row(summary)}"
                f"   head {_row(head) if head else '   (no head)   '}"
                f"   embedding {_row(emb) if emb else '-'}"
            )
    print("leave-one-GPU-type-out (fit without the GPU type)")
    for gpu, entry in result["leave_one_gpu_out"].items():
        for model, summary in entry["blocks"].items():
            print(f"  {gpu:10s} {model:12s} blocks {_row(summary)}")
        all_blocks = [s["median"] for s in entry["blocks"].values()]
        print(f"  {gpu:10s} {'(median)':12s} {100 * np.median(all_blocks):5.1f}%")
    print("precision hypotheses (in-sample, blocks, median / max)")
    for hypothesis, table in result["precision_hypotheses"].items():
        print(
            f"  {hypothesis}: " + ", ".join(f"{k} {_row(v)}" for k, v in table.items())
        )
    print("activation bytes / Sailor act_mem (fp32, mbs 1)")
    for model, ratios in result["activation_ratio_vs_sailor"].items():
        print(f"  {model}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    result.update(
        {
            **stamp.stamp(),
            "seconds": elapsed,
            "split": (
                "constants fitted on block forward/backward entries of the training "
                "profiles; held out: every entry of one model (leave_one_model_out) "
                "or of one GPU type (leave_one_gpu_out); errors on forward+backward "
                "per block, head forward+backward (GPT-Neo-2.7's head profile has no "
                "LM head and is left out), embedding forward"
            ),
        }
    )
    stamp.save(out, result, note=f" ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
