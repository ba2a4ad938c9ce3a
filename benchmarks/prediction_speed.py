"""One prediction of the largest published configuration (issue 47's target:
<= 50 ms): Llama-3.1-405B as Meta trained it (TP 8, PP 16 with 7 layers on
the first and last stage, sequence parallelism, the distributed optimizer,
micro-batch 1, 8,192 tokens, bf16) on 16,384 H100 (global batch 2,048) and
on 131,072 (global batch 16,384), as ``pipedejavu predict --megatron-args
... --gpus H100-SXM:N --json`` answers it, in this process: the Megatron
flags read, the plan built, priced and predicted, the JSON written. The
first call (caches empty) and the median of the next ``--repeats``.

    python benchmarks/prediction_speed.py [--repeats N] [--out FILE]

Writes ``benchmarks/results/prediction_speed.json`` with date and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from pathlib import Path

import stamp

from pipedejavu.cli.main import main as cli

ROOT = Path(__file__).resolve().parent.parent
FLAGS = (
    "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
    "--num-attention-heads 128 --group-query-attention --num-query-groups 8 "
    "--seq-length 8192 --max-position-embeddings 8192 --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --disable-bias-linear --vocab-size 128256 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
    "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7 "
    "--sequence-parallel --use-distributed-optimizer --micro-batch-size 1 "
    "--bf16 --global-batch-size "
)
SETTINGS = ((16384, 2048), (131072, 16384))


def predict(gpus: int, batch: int) -> tuple[float, dict]:
    """Seconds of one ``predict --json`` in this process, and its answer."""
    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = cli(["predict", "--megatron-args", FLAGS + str(batch),
                    "--gpus", f"H100-SXM:{gpus}", "--json"])  # fmt: skip
    seconds = time.perf_counter() - started
    if code not in (0, None):
        raise SystemExit(f"predict exited {code}")
    return seconds, json.loads(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/prediction_speed.json")
    )
    args = parser.parse_args()
    rows = []
    for gpus, batch in SETTINGS:
        first, answer = predict(gpus, batch)
        again = [predict(gpus, batch)[0] for _ in range(args.repeats)]
        prediction = answer.get("prediction", answer)
        rows.append(
            {
                "gpus": gpus,
                "global_batch": batch,
                "first_s": first,
                "median_s": statistics.median(again),
                "repeats": args.repeats,
                "iteration_s": prediction.get("iteration_time_s"),
            }
        )
        print(f"{gpus:,} H100: first {first * 1e3:.0f} ms, then median "
              f"{rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    out = {
        "model": "Llama-3.1-405B (TP 8, PP 16, SP, distributed optimizer)",
        "settings": rows,
        "target_s": 0.05,
        **stamp.stamp("unknown"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
