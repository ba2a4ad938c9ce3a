"""Interleaved plans exported to Megatron-LM, checked by Megatron-LM's own code.

For every interleaved plan of a grid (pipeline stages, chunks per stage,
transformer layers, TP, DP), the exported arguments go through Megatron-LM's
``parse_args`` and ``validate_args`` (as in ``benchmarks/check_exports.py``);
then, for every pipeline rank and model chunk, Megatron Core's
``get_num_layers_to_build`` and ``get_transformer_layer_offset`` say which
transformer layers that chunk builds, compared with the chunks our predictor
prices (:func:`pipedejavu.costmodel.megatron.interleaving.chunk_layers`).

Needs the launchers' environment of ``benchmarks/check_exports.py`` (torch,
megatron-core with the Megatron-LM source of the same version on
``PYTHONPATH``); not run by CI.

    PYTHONPATH=.:MEGATRON_LM_SOURCE python benchmarks/check_interleaved_export.py
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_exports  # noqa: E402  (Megatron's argument parsing, silenced)

from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D  # noqa: E402
from pipedejavu.core.training_options import TrainingOptions  # noqa: E402
from pipedejavu.costmodel.megatron.interleaving import chunk_layers  # noqa: E402
from pipedejavu.io.export_rules import ExportRefused  # noqa: E402
from pipedejavu.io.exports import export_plan  # noqa: E402


def plans():
    """``(plan, chunks)`` over a grid of interleaved shapes."""
    for blocks in (8, 12, 24, 48):
        for pp in (2, 3, 4, 6, 8):
            if blocks % pp:
                continue
            per = blocks // pp
            for chunks in range(2, per + 1):
                if per % chunks:
                    continue
                for tp, dp in ((1, 1), (2, 2), (4, 1)):
                    bounds = [0] + [1 + per * r for r in range(1, pp)] + [blocks + 2]
                    stages = tuple(
                        Stage3D(a, b, tuple(Replica("H100-SXM", tp) for _ in range(dp)))
                        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                    )
                    yield Plan3D(stages, mbs=1, gbs=pp * dp * 2), chunks


def check(plan: Plan3D, chunks: int) -> str:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        get_transformer_layer_offset,
    )

    text = export_plan(plan, "megatron", options=TrainingOptions(virtual_stages=chunks))
    args, config = check_exports.megatron_args(
        shlex.split(text.splitlines()[-1]), plan.num_gpus
    )
    if args.virtual_pipeline_model_parallel_size != chunks:
        return f"virtual size {args.virtual_pipeline_model_parallel_size}"
    ours = chunk_layers(plan, chunks)
    for rank in range(plan.num_stages):
        for chunk in range(chunks):
            count = get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank)
            offset = get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank)
            start, stop = ours[rank][chunk]
            # profile layers: 0 embedding, 1..L blocks, L + 1 head
            blocks = [x for x in range(start, stop) if 1 <= x <= plan.num_layers - 2]
            if blocks != [offset + i + 1 for i in range(count)]:
                return f"rank {rank} chunk {chunk}: Megatron builds {offset}+{count}"
    return "as planned"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/check_interleaved_export.json")
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    outcomes: dict[str, int] = {}
    failures = []
    for plan, chunks in plans():
        try:
            outcome = check(plan, chunks)
        except ExportRefused as error:
            outcome = f"refused: {error}"
        except (AssertionError, ValueError, SystemExit) as error:
            outcome = f"Megatron rejects: {error}"
        key = outcome if outcome == "as planned" else "differs or rejected"
        outcomes[key] = outcomes.get(key, 0) + 1
        if outcome != "as planned":
            failures.append({"plan": plan.describe(), "chunks": chunks, "why": outcome})
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node() or 'vm'} ({platform.machine()})",
        "versions": {
            name: metadata.version(name) for name in ("torch", "megatron-core")
        },
        "outcomes": outcomes,
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("outcomes", "versions")}))
    for failure in failures[:10]:
        print(failure)
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
