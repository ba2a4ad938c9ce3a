"""Megatron-LM arguments for a plan.

Checked against Megatron Core 0.16.1 (``megatron/training/arguments.py``:
``parse_args`` + ``validate_args``; ``megatron/core/parallel_state.py``:
``RankGenerator``; the micro-batch calculator; no code copied):

* ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--micro-batch-size``, ``--global-batch-size`` and ``--num-layers``
  (the model's transformer blocks,
  :func:`~pipedejavu.io.export_rules.num_blocks`: a profile with the final
  norm and the LM head as two layers has ``L + 3``). Data parallelism is the
  world size over ``TP x PP``: launch ``TP x PP x DP`` processes; the global
  batch must be a multiple of ``micro-batch x DP``.
* Layers per stage: an even split needs nothing more; uneven first/last stages
  with equal middle stages use ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers`` (what they leave divides evenly over
  the other stages); any other split uses ``--pipeline-model-parallel-layout``
  (``E`` embedding, ``t`` transformer layer, ``L`` loss, stages split by ``|``,
  ``t*n`` repeats). The layout holds ``|``, so the command line is quoted for
  a POSIX shell (:func:`shlex.join`). Megatron-LM builds the final norm with
  the LM head on the last stage: a plan that puts them on different stages is
  refused.
* One TP degree for every stage (:func:`~pipedejavu.io.export_rules.uniform_tp`).
* Megatron-LM's interleaved schedule with ``V`` chunks per rank:
  ``--num-layers-per-virtual-pipeline-stage`` (transformer layers per chunk);
  Megatron needs an even split (no first/last-stage counts) whose layers per
  rank divide by it (``validate_args``), and PP > 1 with its default
  ``--overlap-p2p-communication`` (:func:`interleaving_flags`).
* No zero-bubble schedule (:data:`NO_ZERO_BUBBLE`; read in megatron-core
  0.16.1): ``get_forward_backward_func`` (``pipeline_parallel/schedules.py``)
  picks no pipelining, 1F1B or interleaved 1F1B, each with whole backward
  passes. ``--delay-wgrad-compute`` defers weight gradients only inside one
  1F1B step of the MoE expert-parallel overlap (``TransformerConfig`` requires
  ``overlap_moe_expert_parallel_comm`` with it), not into the pipeline's
  bubble, so a ZB-H1 plan is refused.
"""

from __future__ import annotations

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    head_layers,
    megatron_parallel_args,
    transformer_layers,
    uniform_tp,
)

__all__ = [
    "MEGATRON_VERSION",
    "NO_ZERO_BUBBLE",
    "interleaving_flags",
    "pipeline_layout",
    "to_megatron",
]

MEGATRON_VERSION = "Megatron-LM (Megatron Core 0.16.1)"
#: Why a ZB-H1 plan is refused (module docstring).
NO_ZERO_BUBBLE = (
    "Megatron-LM has no zero-bubble schedule (megatron-core 0.16.1 runs 1F1B or "
    "interleaved 1F1B; --delay-wgrad-compute defers weight gradients only "
    "within its MoE expert-parallel overlap)"
)


def pipeline_layout(counts: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` of transformer layers per stage."""
    parts = []
    for index, count in enumerate(counts):
        text = "E" if index == 0 else ""
        text += f"t*{count}" if count > 1 else ("t" if count == 1 else "")
        text += "L" if index == len(counts) - 1 else ""
        parts.append(text)
    return "|".join(parts)


def to_megatron(plan: Plan3D, spec: TransformerSpec | None = None) -> list[str]:
    """Megatron-LM's parallel, batch and layer-split arguments (module
    docstring); one string per token. ``spec``: the model, whose block count
    the arguments must build (``None``: one embedding and one head layer
    around the blocks).

    Raises:
        ExportRefused: per-stage TP, a batch that is not whole micro-batches,
            or the final norm and the LM head on different stages.
        ProblemError: a plan of another number of layers than ``spec``.
    """
    tp = uniform_tp(plan, "Megatron-LM")
    check_whole_batch(plan, "Megatron-LM")
    counts = transformer_layers(plan, spec)
    if head_layers(plan, spec) == 2 and plan.stages[-1].start == plan.num_layers - 1:
        raise ExportRefused(
            "Megatron-LM builds the final norm with the LM head on the last "
            "stage; the plan puts them on different stages"
        )
    num_layers, stages = sum(counts), len(counts)
    args = megatron_parallel_args(tp, stages, plan, num_layers)
    if stages == 1 or len(set(counts)) == 1:
        return args  # Megatron's even split
    middle = counts[1:-1]
    if min(counts) > 0 and len(set(middle)) <= 1:
        # Megatron divides what first/last leave evenly over the other stages.
        even = middle[0] if middle else None
        if counts[0] != even:
            args += ["--decoder-first-pipeline-num-layers", str(counts[0])]
        if middle and counts[-1] != even:
            args += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
        return args
    return args + ["--pipeline-model-parallel-layout", pipeline_layout(counts)]


def interleaving_flags(
    plan: Plan3D, chunks: int, spec: TransformerSpec | None = None
) -> list[str]:
    """``--num-layers-per-virtual-pipeline-stage`` for ``chunks`` model chunks
    per rank (none for 1).

    Raises:
        ExportRefused: one stage, unequal stages, or layers per stage that do
            not split into ``chunks`` equal chunks.
    """
    if chunks == 1:
        return []
    counts = transformer_layers(plan, spec)
    if len(counts) < 2 or len(set(counts)) != 1 or counts[0] % chunks:
        raise ExportRefused(
            f"Megatron-LM's interleaved schedule needs at least 2 stages of "
            f"equally many transformer layers that split into {chunks} chunks; "
            f"the plan has {counts}"
        )
    return ["--num-layers-per-virtual-pipeline-stage", str(counts[0] // chunks)]
