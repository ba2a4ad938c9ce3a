"""Interleaved plans exported to Megatron-LM, checked by Megatron-LM's own code.

For every interleaved plan of a grid (pipeline stages, chunks per stage,
transformer layers, TP, DP), placed in each of Megatron-LM's rank orders and
with full recomputation of every block or (``--recompute-method block``) of
the first block of each chunk, the exported arguments go through
Megatron-LM's ``parse_args`` and ``validate_args`` (as in
``benchmarks/check_exports.py``): ``--use-tp-pp-dp-mapping`` must be set
exactly for ``tp-pp-dp`` plans and the recomputation must be ours. Then, for
every pipeline rank and model chunk, Megatron Core's
``get_num_layers_to_build`` and ``get_transformer_layer_offset`` say which
transformer layers that chunk builds, compared with the chunks our predictor
prices (:func:`pipedejavu.costmodel.megatron.interleaving.chunk_layers`). (The
rank groups of each order: ``benchmarks/check_rank_order_export.py``.)

Needs the launchers' environment of ``benchmarks/check_exports.py`` (torch,
megatron-core with the Megatron-LM source of the same version on
``PYTHONPATH``); not run by CI.

    PYTHONPATH=.:MEGATRON_LM_SOURCE python benchmarks/check_interleaved_export.py
"""

from __future__ import annotations

import shlex

import check_exports  # Megatron's argument parsing, silenced

from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    RANK_ORDERS,
    Plan3D,
    rank_order_of,
)
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.interleaving import chunk_layers
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.exports import export_plan

GPU, GPUS_PER_NODE = "H100-SXM", 8


def plans():
    """``(plan, options)`` over a grid of interleaved shapes, rank orders and
    recomputation."""
    for blocks in (8, 12, 24, 48):
        for pp in (2, 3, 4, 6, 8):
            if blocks % pp:
                continue
            per = blocks // pp
            for chunks in range(2, per + 1):
                if per % chunks:
                    continue
                for tp, dp in ((1, 1), (2, 2), (4, 1), (2, 4)):
                    bounds = [0] + [1 + per * r for r in range(1, pp)] + [blocks + 2]
                    stages = [
                        (a, b, tp) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                    ]
                    for order in RANK_ORDERS:
                        plan = plan_from_stages(
                            stages,
                            gpu_type=GPU,
                            dp=dp,
                            mbs=1,
                            gbs=pp * dp * 2,
                            model="check",
                            gpus_per_node=GPUS_PER_NODE,
                            zone=DEFAULT_ZONE,
                            rank_order=order,
                        )
                        for layers in (None, 1):
                            options = TrainingOptions(
                                virtual_stages=chunks,
                                recompute="full",
                                recompute_num_layers=layers,
                            )
                            yield plan, options


def check(plan: Plan3D, options: TrainingOptions) -> str:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        get_transformer_layer_offset,
    )

    chunks = options.virtual_stages
    text = export_plan(
        plan, "megatron", gpus_per_node={GPU: GPUS_PER_NODE}, options=options
    )
    args, config = check_exports.megatron_args(
        shlex.split(text.splitlines()[-1]), plan.num_gpus
    )
    if args.virtual_pipeline_model_parallel_size != chunks:
        return f"virtual size {args.virtual_pipeline_model_parallel_size}"
    order = rank_order_of(plan, GPUS_PER_NODE)
    if args.use_tp_pp_dp_mapping != (order == RANK_ORDERS[1]):
        return f"--use-tp-pp-dp-mapping {args.use_tp_pp_dp_mapping} for {order}"
    block = options.recompute_num_layers
    method, layers = ("uniform", 1) if block is None else ("block", block)
    if (args.recompute_granularity, args.recompute_method) != ("full", method):
        return f"recompute {args.recompute_granularity} {args.recompute_method}"
    if args.recompute_num_layers != layers:
        return f"--recompute-num-layers {args.recompute_num_layers}"
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
    return check_exports.check_cases(
        argv,
        __doc__,
        "check_interleaved_export",
        plans(),
        check,
        lambda plan, options: {"plan": plan.describe(), "options": options.to_json()},
    )


if __name__ == "__main__":
    raise SystemExit(main())
