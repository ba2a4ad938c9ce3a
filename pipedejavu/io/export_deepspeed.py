"""DeepSpeed ``PipelineModule`` partitions and engine configs for a plan.

Checked against DeepSpeed 0.19.8 (``deepspeed/runtime/pipe/module.py``,
``runtime/pipe/topology.py``, ``runtime/pipe/schedule.py``,
``runtime/config.py``; no code copied):

* ``PipelineModule`` keeps the stage boundaries in ``parts``: stage ``s``
  builds ``layers[parts[s]:parts[s + 1]]`` of the layer list it was given.
  Its ``partition_method`` values (``parameters``, ``uniform``,
  ``type:...``) cannot express an arbitrary split, so the export gives
  ``parts`` to set in a ``_partition_layers`` override
  (``self.parts = parts``, then ``self._set_bounds(start=parts[stage],
  stop=parts[stage + 1])``).
* ``parts`` index one particular layer list, named in the file
  (``"layers"``), with the model's own block count ``L``
  (:func:`~pipedejavu.io.export_rules.num_blocks`):

  - ``deepspeed``: the abstract list ``[embedding, transformer.0 ...
    transformer.(L-1), head]``, one entry per profile layer (``final_norm``
    and ``head`` where the profile keeps them apart). A model written as
    exactly these entries gets the plan's stages.
  - ``megatron-deepspeed``: Megatron-DeepSpeed's ``GPTModelPipe``
    (``megatron/model/gpt_model.py`` at commit f4157bea, 2024-12-24, the
    same at 4efb479d, 2025-07-16; dense model, no MoE): ``[_to_float16,
    embedding, L transformer layers, final norm, head (the tied embedding
    unless untied), float16_to_fp32]``; the last entry exists only with
    ``--fp16``/``--bf16``, so ``parts`` is given for both. Our profile layer
    ``0`` is the cast and the embedding, the layers after the blocks the
    norm, the head and the cast back. (Commits before 53db2b14, July 2023,
    also had two transposes around the transformer layers; they are not
    covered.) ``parts`` go into ``GPTModelPipe._partition_layers`` itself
    (:data:`PARTS_HOW`): DeepSpeed's ``PipelineModule._is_checkpointable``
    knows ``GPTModelPipe`` by its class name and checkpoints its transformer
    layers only; in a subclass of another name it checkpoints every layer
    with parameters: the embedding (whose reentrant checkpoint, says
    DeepSpeed's comment there, leaves it without gradients), the final norm
    and an untied head, as Megatron-DeepSpeed's own code showed
    (``benchmarks/check_megatron_deepspeed.py``).

* The engine config's batch rule: ``train_batch_size =
  train_micro_batch_size_per_gpu x gradient_accumulation_steps x
  data-parallel size``, exactly.
* The topology ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes
  ``pipe, data, model``): the shared rank order of
  :mod:`pipedejavu.io.export_rules`. One TP degree for every stage.
* The schedule: the pipeline engine (``runtime/pipe/engine.py``) runs
  ``TrainSchedule``, 1F1B with whole backward passes (its
  ``DualPipeVSchedule`` also keeps the weight gradient inside
  ``BackwardPass``).

**Megatron-DeepSpeed's arguments** (:func:`megatron_deepspeed_flags`; read
in ``megatron/arguments.py``, ``initialize.py``,
``core/pipeline_parallel/deepspeed_zbh1_schedule.py`` and
``deepspeed_zbh1_engine.py``, ``core/tensor_parallel/layers.py`` and
``weight_grad_store.py``):

* ZB-H1: ``--enable-zbh1-pipeline`` replaces the engine's ``TrainSchedule``
  by ``ZeroBubbleH1Pipeline``, whose ``BackwardOnlyPass`` computes the input
  gradient and leaves the weight gradients of the linear layers (their
  ``WeightGradStore``, the LM head's among them: our ``W``) to a
  ``WeightPass`` that runs the oldest stored one. With
  ``--enable-zbh1-exact-semantics`` stage ``r`` of ``P`` runs ``P - r - 1``
  forwards, ``r`` forward/``B`` pairs, then forward, ``B``, ``W`` (the first
  stage its whole backward), then ``B``/``W`` pairs and the remaining ``W``:
  our ZB-H1 order (:func:`~pipedejavu.simulation.zero_bubble.
  zero_bubble_order`) for ``M = 1`` or ``M >= P - 1`` micro-batches
  (``tests/test_export_knobs.py`` re-states its steps); with ``1 < M < P -
  1`` its sections skip and each ``W`` follows its ``B`` at once, so such a
  plan is refused. Without exact semantics a stage runs whole backward passes in the
  steady state and sends each gradient after its ``W``: not the order priced.
  Its stash (``P - r`` micro-batches to ``B``, then ``r`` stored ``W``
  inputs) is below the one priced (``min(P, M)`` whole micro-batches to
  ``W``). It asserts no ``--sequence-parallel``.
* Full recomputation of every block: ``--checkpoint-activations
  --checkpoint-num-layers 1`` (``GPTModelPipe`` passes
  ``activation_checkpoint_interval`` 1 to ``PipelineModule``, which
  checkpoints each transformer layer alone, never the embedding, norm or
  head) with ``--deepspeed-activation-checkpointing`` (Megatron's RNG
  tracker in DeepSpeed's checkpoint). Recomputing the first ``N`` blocks
  (Megatron-LM's block method) has no counterpart (``GPTModelPipe`` turns a
  block method off) and selective recomputation was not checked: refused.
* The attention kernel: ``--use-flash-attn-v2`` for a plan priced with flash
  attention (its default is the unfused ``CoreAttention``); unfused without
  dropout: ``--attention-dropout 0``.

**Experts.** Both refuse a plan with experts (:data:`NO_EXPERTS`): DeepSpeed
0.19.8's ``deepspeed.moe.layer.MoE`` (what Megatron-DeepSpeed's
``--num-experts`` builds) gates with a capacity factor (1.0 by default,
``drop_tokens=True``), so it runs other expert layers than the dropless
Megatron-Core ones the plan was priced with.
"""

from __future__ import annotations

from typing import Any

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    gpu_types_by_rank,
    head_layers,
    megatron_parallel_args,
    num_blocks,
    refuse_experts,
    transformer_layers,
    uniform_tp,
)

__all__ = [
    "DEEPSPEED_VERSION",
    "deepspeed_options",
    "MEGATRON_DEEPSPEED_VERSION",
    "NO_EXPERTS",
    "megatron_deepspeed_flags",
    "megatron_deepspeed_layers",
    "PARTS_HOW",
    "to_deepspeed",
    "to_megatron_deepspeed",
]

DEEPSPEED_VERSION = "DeepSpeed 0.19.8 PipelineModule"
MEGATRON_DEEPSPEED_VERSION = (
    "Megatron-DeepSpeed f4157bea (2024-12-24) GPTModelPipe on DeepSpeed 0.19.8"
)

_DEEPSPEED_MOE = (
    "DeepSpeed's experts (deepspeed.moe: top-k gating with a capacity factor, "
    "1.0 by default, the tokens past it dropped), not the dropless Megatron-Core "
    "expert layers the plan was priced with"
)
#: Why each target refuses a plan with experts.
NO_EXPERTS = {
    "DeepSpeed": "the DeepSpeed export partitions dense layers only; DeepSpeed "
    f"runs mixtures of experts as {_DEEPSPEED_MOE}",
    "Megatron-DeepSpeed": "Megatron-DeepSpeed's --num-experts runs " + _DEEPSPEED_MOE,
}

#: Where Megatron-DeepSpeed's ``parts`` go (module docstring).
PARTS_HOW = (
    "replace GPTModelPipe._partition_layers itself (self.parts = parts; "
    "stage = self._topo.get_coord(self.global_rank).pipe; "
    "self._set_bounds(start=parts[stage], stop=parts[stage + 1])), not in a "
    "subclass of another name: DeepSpeed's _is_checkpointable knows "
    "GPTModelPipe by its class name, and under another it checkpoints the "
    "embedding, the final norm and an untied head too (DeepSpeed's own "
    "comment there: the embedding's reentrant checkpoint leaves it without "
    "gradients)"
)


def _engine(plan: Plan3D, target: str, spec: TransformerSpec | None) -> dict[str, Any]:
    refuse_experts(plan, spec, NO_EXPERTS[target])
    tp = uniform_tp(plan, target)
    check_whole_batch(plan, target)
    out: dict[str, Any] = {
        "ds_config": {
            "train_batch_size": plan.gbs,
            "train_micro_batch_size_per_gpu": plan.mbs,
            "gradient_accumulation_steps": plan.num_microbatches,
        },
        "world_size": plan.num_gpus,
        "model_parallel_size": tp,
        "data_parallel_size": plan.dp,
    }
    if len(plan.gpus_by_type()) > 1:
        out["gpu_types_by_rank"] = gpu_types_by_rank(plan)
    return out


def to_deepspeed(plan: Plan3D, spec: TransformerSpec | None = None) -> dict[str, Any]:
    """DeepSpeed's partition of the abstract layer list and the engine config
    (module docstring); ``spec``: the model (``None``: one embedding and one
    head layer around the blocks).

    Raises:
        ExportRefused: per-stage TP, a batch that is not whole micro-batches,
            or experts (:data:`NO_EXPERTS`).
        ProblemError: a plan of another number of layers than ``spec``.
    """
    engine = _engine(plan, "DeepSpeed", spec)
    blocks = num_blocks(plan, spec)
    head = ["final_norm", "head"] if head_layers(plan, spec) == 2 else ["head"]
    layers = ["embedding"] + [f"transformer.{i}" for i in range(blocks)] + head
    return {
        "target": DEEPSPEED_VERSION,
        "pipeline_module": {
            "num_stages": plan.num_stages,
            "parts_index": "the 'layers' list: embedding, transformer layers, head "
            "(one entry per profile layer); for Megatron-DeepSpeed's GPTModelPipe "
            "use --export megatron-deepspeed",
            "layers": layers,
            "parts": [s.start for s in plan.stages] + [plan.num_layers],
        },
        **engine,
    }


def megatron_deepspeed_layers(num_layers: int, *, half: bool = True) -> list[str]:
    """``GPTModelPipe``'s layer list for ``num_layers`` transformer layers
    (module docstring); ``half``: with ``--fp16`` or ``--bf16``."""
    return (
        ["_to_float16", "embedding"]
        + [f"transformer.{i}" for i in range(num_layers)]
        + ["final_norm", "head"]
        + (["float16_to_fp32"] if half else [])
    )


def _gpt_model_pipe_index(layer: int) -> int:
    """First ``GPTModelPipe`` entry of profile layer ``layer`` (``0``: the cast
    and the embedding; then a transformer layer, the norm, the head)."""
    return 0 if layer == 0 else layer + 1


def megatron_deepspeed_flags(
    plan: Plan3D, options: TrainingOptions, spec: TransformerSpec | None = None
) -> list[str]:
    """Megatron-DeepSpeed's flags for the plan's schedule, recomputation and
    attention kernel (module docstring).

    Raises:
        ExportRefused: what it does not run as planned: sequence parallelism
            at TP > 1, an interleaved or V schedule, ZB-H1 with ``1 < M < P -
            1`` micro-batches, selective recomputation, or
            recomputation of some blocks of a stage only.
    """
    target = "Megatron-DeepSpeed"
    flags = []
    if options.sequence_parallel and uniform_tp(plan, target) > 1:
        raise ExportRefused(
            f"{target}'s DeepSpeed engine does not all-reduce the norms' "
            "gradients over the TP group under --sequence-parallel (Megatron's "
            "allreduce_layernorm_grads runs only without --deepspeed), so each "
            "TP rank would train its own copy of them"
        )
    if options.virtual_stages != 1:
        raise ExportRefused(f"{target}: no interleaved pipeline schedule")
    if options.zero_bubble:
        stages, count = plan.num_stages, plan.num_microbatches
        if 1 < count < stages - 1:
            raise ExportRefused(
                f"{target}'s ZeroBubbleH1Pipeline runs the ZB-H1 order only for "
                f"one or at least P - 1 = {stages - 1} micro-batches (with 2 to "
                f"P - 2, each weight pass follows its input gradient at once); "
                f"the plan runs {count}"
            )
        flags += ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]
    if options.recompute == "selective":
        raise ExportRefused(
            f"{target}: selective recomputation is not among what the export "
            "checked (full recomputation of every block is)"
        )
    if options.recompute == "full":
        limit = options.recompute_num_layers
        most = max(transformer_layers(plan, spec))
        if limit is not None and limit < most:
            raise ExportRefused(
                f"{target} recomputes every transformer layer or none "
                f"(GPTModelPipe's activation_checkpoint_interval), not the first "
                f"{limit} of each stage (a stage holds up to {most})"
            )
        flags += ["--checkpoint-activations", "--checkpoint-num-layers", "1"]
        flags.append("--deepspeed-activation-checkpointing")
    if options.flash_attention:
        flags.append("--use-flash-attn-v2")
    elif not options.attention_dropout:
        flags += ["--attention-dropout", "0"]
    return flags


def deepspeed_options(
    data: dict,
    plan: Plan3D,
    options: TrainingOptions | None,
    target: str,
    spec: TransformerSpec | None,
) -> list[str]:
    """The engine config's precision and ZeRO sections in ``data`` (ZeRO
    stage 1 for the distributed optimizer); returns the Megatron-DeepSpeed
    flags of the schedule, recomputation and attention (none for
    ``deepspeed``, none for ``options`` ``None``: the targets' defaults).

    Raises:
        ExportRefused: what ``target`` does not run as planned (module
            docstring; :func:`megatron_deepspeed_flags`).
    """
    if options is None:
        return []
    if options.overlap_grad_reduce or options.overlap_param_gather:
        raise ExportRefused(
            f"{target}: the pipeline engine reduces the gradients after the "
            "pipeline, not beside the backward pass the plan was priced with"
        )
    if options.grad_reduce_in_bf16:
        raise ExportRefused(
            f"{target}: the plan was priced with Megatron-LM's bf16 gradient "
            "buffers (--grad-reduce-in-bf16), which the DeepSpeed config does "
            "not set"
        )
    if options.precision == "fp8":
        raise ExportRefused(f"{target}: no FP8 training in the DeepSpeed config")
    flags = []
    if target == "megatron-deepspeed":
        flags = megatron_deepspeed_flags(plan, options, spec)
    elif options.recompute != "none" or options.sequence_parallel:
        raise ExportRefused(
            f"{target}: the plan recomputes activations or uses sequence "
            "parallelism, which the DeepSpeed config cannot express"
        )
    elif options.virtual_stages != 1:
        raise ExportRefused(f"{target}: no interleaved pipeline schedule")
    elif options.zero_bubble:
        raise ExportRefused(
            f"{target}: no zero-bubble schedule (the pipeline engine runs 1F1B, "
            "TrainSchedule, with whole backward passes)"
        )
    config = data["ds_config"]
    if options.precision in ("bf16", "fp16"):
        config[options.precision] = {"enabled": True}
    if options.distributed_optimizer:
        config["zero_optimization"] = {"stage": 1}
    return flags


def to_megatron_deepspeed(
    plan: Plan3D, spec: TransformerSpec | None = None
) -> dict[str, Any]:
    """Megatron-DeepSpeed's arguments, ``GPTModelPipe`` partition and engine
    config (module docstring); the arguments are the plan's, to add to the
    user's launch (the model's shape, data and tokenizer are theirs).

    Raises:
        ExportRefused: per-stage TP, a batch that is not whole micro-batches,
            or experts (:data:`NO_EXPERTS`).
        ProblemError: a plan of another number of layers than ``spec``.
    """
    engine = _engine(plan, "Megatron-DeepSpeed", spec)
    num_layers = num_blocks(plan, spec)
    starts = [_gpt_model_pipe_index(s.start) for s in plan.stages]
    half = megatron_deepspeed_layers(num_layers, half=True)
    full = megatron_deepspeed_layers(num_layers, half=False)
    # Megatron-DeepSpeed takes the plain Megatron arguments; its pipeline split
    # comes from GPTModelPipe's partition, not from Megatron's layer options.
    args = megatron_parallel_args(
        engine["model_parallel_size"], plan.num_stages, plan, num_layers
    )
    return {
        "target": MEGATRON_DEEPSPEED_VERSION,
        "arguments_note": "the plan's arguments: add them to your pretrain_gpt.py "
        "launch, whose model shape, data and tokenizer flags are yours",
        "arguments": args + ["--deepspeed", "--deepspeed_config", "ds_config.json"],
        "pipeline_module": {
            "num_stages": plan.num_stages,
            "parts_index": "GPTModelPipe's specs (dense model, no MoE): the "
            "'layers' list with --fp16/--bf16, 'layers_fp32' without",
            "parts_how": PARTS_HOW,
            "layers": half,
            "parts": starts + [len(half)],
            "layers_fp32": full,
            "parts_fp32": starts + [len(full)],
        },
        **engine,
    }
