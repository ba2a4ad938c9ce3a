"""Export a :class:`~pipedejavu.core.plan3d.Plan3D` to what people launch.

Each target has its own module, which states the version it was checked
against and the rules it honours (read from that version's source; no code
copied); every exported file names that version:

========================  =====================================================
``megatron``              :mod:`pipedejavu.io.export_megatron` (Megatron Core
                          0.20 arguments, one shell-quoted line)
``deepspeed``             :mod:`pipedejavu.io.export_deepspeed` (DeepSpeed
                          0.16.5 ``PipelineModule`` ``parts`` of the abstract
                          list ``[embedding, blocks, head]``)
``megatron-deepspeed``    :mod:`pipedejavu.io.export_deepspeed` (the same on
                          Megatron-DeepSpeed's ``GPTModelPipe`` layer list)
``torchtitan``            :mod:`pipedejavu.io.export_torchtitan` (v0.2.2 TOML)
``alpa``                  :mod:`pipedejavu.io.export_alpa` (b8078a9
                          ``ManualStageOption`` and micro-batches)
``sailor``                :func:`pipedejavu.io.sailor_plan.plan_to_sailor`
========================  =====================================================

An export either builds exactly the plan's stages, the ranks of each stage's
replicas (TP fastest, then data, then pipeline: :mod:`pipedejavu.io.export_rules`)
and its batch, or is refused with :class:`~pipedejavu.io.export_rules.ExportRefused`,
one line saying why and which targets can launch the plan instead. A plan on
several GPU types names the type of each block of global ranks (a comment in
the Megatron arguments and the torchtitan TOML, ``gpu_types_by_rank`` in the
DeepSpeed JSON); order the hosts so that those ranks land on them.

**Training options** (:class:`~pipedejavu.core.training_options.TrainingOptions`:
precision, recomputation, distributed optimizer, sequence parallelism, the
pipeline schedule, attention kernel) a plan was priced with travel with it:

* Megatron-LM gets its flags (:func:`option_flags`: ``--bf16``,
  ``--recompute-granularity``, ``--use-distributed-optimizer``,
  ``--sequence-parallel``, ``--overlap-grad-reduce``,
  ``--overlap-param-gather``, ``--grad-reduce-in-bf16``, ``--tp-comm-overlap``
  (not at TP 1, where Megatron-LM refuses it), ``--attention-backend
  unfused``) and
  ``--num-layers-per-virtual-pipeline-stage`` for the interleaved schedule.
* The DeepSpeed configs get their ``bf16``/``fp16`` sections and ZeRO stage 1
  for the distributed optimizer; recomputation and sequence parallelism are
  refused (the pipeline engine sets recomputation in code,
  ``activation_checkpoint_interval``, and has no sequence parallelism), and so
  is any schedule but 1F1B (its engine runs ``TrainSchedule``).
* torchtitan carries the schedule (1F1B, interleaved, ZB-H1, interleaved
  zero bubble), full
  recomputation, fp32 precision and sequence parallelism, and refuses what its
  file cannot express exactly (:mod:`pipedejavu.io.export_torchtitan`).
* The other targets, whose files carry no such settings, refuse any options
  but plain fp32 1F1B training.

**Zero bubble.** A ZB-H1 plan (``zero_bubble``, one chunk per rank or more)
is refused by Megatron-LM
(megatron-core 0.16.1's ``get_forward_backward_func`` runs no pipelining,
1F1B or interleaved 1F1B; its ``--delay-wgrad-compute`` defers weight
gradients only inside the MoE expert-parallel overlap of one 1F1B step, which
``TransformerConfig`` requires) and by DeepSpeed (0.19.8's pipeline engine runs
``TrainSchedule`` with whole backward passes; its ``DualPipeVSchedule`` keeps
the weight gradient inside ``BackwardPass`` too); torchtitan runs it as
``InterleavedZeroBubble``.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping

from pipedejavu.core.files import json_text
from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D, check_nodes, rank_order_of
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import (
    RECOMPUTE_GRANULARITIES,
    TRAINING_PRECISIONS,
    TrainingOptions,
)
from pipedejavu.io.export_alpa import to_alpa
from pipedejavu.io.export_deepspeed import to_deepspeed, to_megatron_deepspeed
from pipedejavu.io.export_megatron import (
    NO_ZERO_BUBBLE,
    interleaving_flags,
    megatron_text,
)
from pipedejavu.io.export_rules import ExportRefused, transformer_layers
from pipedejavu.io.export_torchtitan import to_torchtitan
from pipedejavu.io.sailor_plan import plan_to_sailor

__all__ = [
    "EXPORTS",
    "LAUNCHED_RANK_ORDERS",
    "LAUNCHED_SCHEDULES",
    "LAUNCHED_TRAINING",
    "DATA_PARALLEL_ALONE",
    "SAILOR_VERSION",
    "export_plan",
    "SWITCH_FLAGS",
    "option_flags",
    "uniform_recompute",
]

EXPORTS = (
    "megatron",
    "deepspeed",
    "megatron-deepspeed",
    "torchtitan",
    "alpa",
    "sailor",
)
#: The pipeline schedules each target launches (the knob space's names:
#: ``1f1b``, ``interleaved``, ``zb-h1``, ``interleaved-zb``, ``zbv``); the
#: others it refuses.
LAUNCHED_SCHEDULES = {
    "megatron": ("1f1b", "interleaved"),
    "deepspeed": ("1f1b",),
    "megatron-deepspeed": ("1f1b",),
    "torchtitan": ("1f1b", "interleaved", "zb-h1", "interleaved-zb", "zbv"),
    "alpa": ("1f1b",),
    "sailor": ("1f1b",),
}
#: The rank orders each target launches (:data:`~pipedejavu.core.plan3d.
#: RANK_ORDERS`); the others it refuses. Megatron-LM takes
#: ``--use-tp-pp-dp-mapping``; torchtitan's mesh and DeepSpeed's topology put
#: the pipeline outermost (the default order).
LAUNCHED_RANK_ORDERS = {
    target: RANK_ORDERS if target == "megatron" else RANK_ORDERS[:1]
    for target in EXPORTS
}
_BOTH = (True, False)
_PLAIN = {
    "precision": ("fp32",),
    "recompute": ("none",),
    "sequence_parallel": (False,),
    "distributed_optimizer": (False,),
    "overlap_grad_reduce": (False,),
    "overlap_param_gather": (False,),
    "grad_reduce_in_bf16": (False,),
    "tp_comm_overlap": (False,),
}
#: The training options each target launches as planned (the values of
#: :class:`~pipedejavu.core.training_options.TrainingOptions`' fields); the
#: export refuses the others, each with its reason (DeepSpeed: no
#: recomputation or sequence parallelism in its config, no FP8; torchtitan:
#: fp32 only without FSDP, no selective recomputation of the attention core,
#: sequence parallelism always on with TP, optimizer state sharded only with
#: FSDP: :mod:`pipedejavu.io.export_torchtitan`; Alpa and Sailor: plain fp32
#: training). ``sequence_parallel`` ``(True,)`` means "with TP > 1": at TP 1
#: it changes nothing.
LAUNCHED_TRAINING = {
    "megatron": {
        "precision": TRAINING_PRECISIONS,
        "recompute": RECOMPUTE_GRANULARITIES,
        "sequence_parallel": _BOTH,
        "distributed_optimizer": _BOTH,
        "overlap_grad_reduce": _BOTH,
        "overlap_param_gather": _BOTH,
        "grad_reduce_in_bf16": _BOTH,
        "tp_comm_overlap": _BOTH,
    },
    "deepspeed": {
        "precision": ("fp32", "fp16", "bf16"),
        "recompute": ("none",),
        "sequence_parallel": (False,),
        "distributed_optimizer": _BOTH,
        "overlap_grad_reduce": (False,),
        "overlap_param_gather": (False,),
        "grad_reduce_in_bf16": (False,),
        "tp_comm_overlap": (False,),
    },
    "torchtitan": {
        "precision": ("fp32",),
        "recompute": ("none", "full"),
        "sequence_parallel": (True,),
        "distributed_optimizer": (False,),
        "overlap_grad_reduce": (False,),
        "overlap_param_gather": (False,),
        "grad_reduce_in_bf16": (False,),
        "tp_comm_overlap": (False,),
    },
    "alpa": _PLAIN,
    "sailor": _PLAIN,
}
LAUNCHED_TRAINING["megatron-deepspeed"] = LAUNCHED_TRAINING["deepspeed"]
#: The targets that run data parallelism as planned (unsharded replicas) only
#: without TP or PP beside it: torchtitan, whose DDP refuses more than one
#: dimension of parallelism (beside TP or PP it runs FSDP/HSDP, which shards
#: what the plan priced unsharded).
DATA_PARALLEL_ALONE = frozenset({"torchtitan"})
#: Sailor's plan reader the ``plan_config`` export was checked against.
SAILOR_VERSION = "Sailor cf2c8e3 (2025-08-14) plan_config"


#: The training options that are Megatron-LM switches, with their flags (in
#: the order :func:`option_flags` writes them); every one is off in the plain
#: training each target runs by default.
SWITCH_FLAGS = {
    "distributed_optimizer": "--use-distributed-optimizer",
    "sequence_parallel": "--sequence-parallel",
    "overlap_grad_reduce": "--overlap-grad-reduce",
    "overlap_param_gather": "--overlap-param-gather",
    "grad_reduce_in_bf16": "--grad-reduce-in-bf16",
    "tp_comm_overlap": "--tp-comm-overlap",
}


def option_flags(options: TrainingOptions) -> list[str]:
    """Megatron-LM's flags for ``options`` (module docstring)."""
    flags = []
    if options.precision in ("bf16", "fp8"):
        flags.append("--bf16")
    elif options.precision == "fp16":
        flags.append("--fp16")
    if options.precision == "fp8":
        flags += ["--fp8-format", "hybrid"]
    if options.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif options.recompute == "full":
        layers = options.recompute_num_layers
        flags += ["--recompute-granularity", "full", "--recompute-method"]
        flags += (
            ["uniform", "--recompute-num-layers", "1"]
            if layers is None
            else [
                "block",
                "--recompute-num-layers",
                str(layers),
            ]
        )
    flags += [flag for name, flag in SWITCH_FLAGS.items() if getattr(options, name)]
    if not options.flash_attention:
        flags += ["--attention-backend", "unfused"]
    return flags


def _plain(options: TrainingOptions | None) -> bool:
    """fp32 1F1B training without recomputation, sharding or sequence
    parallelism (the attention kernel aside): what every target runs by
    default."""
    if options is None:
        return True
    return (
        options.precision == "fp32"
        and options.recompute == "none"
        and options.virtual_stages == 1
        and not options.zero_bubble
        and not any(getattr(options, name) for name in SWITCH_FLAGS)
    )


def _deepspeed_options(data: dict, options: TrainingOptions | None, target: str):
    if options is None:
        return data
    if options.recompute != "none" or options.sequence_parallel:
        raise ExportRefused(
            f"{target}: the plan recomputes activations or uses sequence "
            "parallelism, which the DeepSpeed config cannot express"
        )
    if options.virtual_stages != 1:
        raise ExportRefused(f"{target}: no interleaved pipeline schedule")
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
    if options.zero_bubble:
        raise ExportRefused(
            f"{target}: no zero-bubble schedule (the pipeline engine runs 1F1B, "
            "TrainSchedule, with whole backward passes)"
        )
    config = data["ds_config"]
    if options.precision == "fp8":
        raise ExportRefused(f"{target}: no FP8 training in the DeepSpeed config")
    if options.precision in ("bf16", "fp16"):
        config[options.precision] = {"enabled": True}
    if options.distributed_optimizer:
        config["zero_optimization"] = {"stage": 1}
    return data


def _order(plan: Plan3D, gpus_per_node: Mapping[str, int] | None) -> str | None:
    """The plan's rank order (``None``: not one Megatron-LM lays out)."""
    gpu = plan.stages[0].replicas[0].gpu_type
    per_node = None if gpus_per_node is None else gpus_per_node.get(gpu)
    return rank_order_of(plan, per_node)


def uniform_recompute(
    plan: Plan3D, options: TrainingOptions | None, target: str
) -> TrainingOptions | None:
    """``options`` with per-stage recomputation counts as the one rule every
    launcher takes, or the reason none can: all stages rerun nothing (no
    recomputation), every block (full), or ``min(N, its blocks)`` for one
    ``N`` (Megatron-LM's block method).

    Raises:
        ExportRefused: counts no single ``N`` gives.
    """
    if options is None or not options.per_stage_recompute:
        return options
    counts = options.recompute_stage_layers
    if counts is None or len(counts) != plan.num_stages:
        raise ExportRefused(
            f"{target}: the options choose per-stage recomputation counts but do "
            "not give the plan's (recompute_stage_layers)"
        )
    blocks = transformer_layers(plan)
    rerun = [b if n is None else min(n, b) for n, b in zip(counts, blocks, strict=True)]
    plain = dataclasses.replace(
        options, recompute_choices=None, recompute_stage_layers=None
    )
    if not any(rerun):
        return dataclasses.replace(plain, recompute="none")
    if rerun == blocks:
        return plain
    most = max(rerun)
    if all(n == min(most, b) for n, b in zip(rerun, blocks, strict=True)):
        return dataclasses.replace(plain, recompute_num_layers=most)
    raise ExportRefused(
        f"{target}: the plan's stages rerun {rerun} of their {blocks} transformer "
        "blocks, and the launchers take one count for every stage "
        "(Megatron-LM's --recompute-num-layers)"
    )


def _build(
    plan: Plan3D,
    target: str,
    gpus_per_node: Mapping[str, int] | None,
    options: TrainingOptions | None = None,
    seq_length: int | None = None,
) -> str:
    options = uniform_recompute(plan, options, target)
    order = _order(plan, gpus_per_node)
    if order is not None and order not in LAUNCHED_RANK_ORDERS.get(target, ()):
        raise ExportRefused(
            f"{target}: the plan places each pipeline's stages on consecutive "
            f"ranks ({order}); the target lays out {RANK_ORDERS[0]} only"
        )
    if target == "megatron":
        if options is not None and options.zero_bubble:
            raise ExportRefused(NO_ZERO_BUBBLE)
        text = megatron_text(plan)
        extra = ["--use-tp-pp-dp-mapping"] if order == RANK_ORDERS[1] else []
        if options is not None:
            if options.tp_comm_overlap and plan.stages[0].replicas[0].tp == 1:
                # Megatron-LM turns sequence parallelism off at TP 1 and then
                # asserts on --tp-comm-overlap; without TP it overlaps nothing
                options = dataclasses.replace(options, tp_comm_overlap=False)
            extra += interleaving_flags(plan, options.virtual_stages)
            extra += option_flags(options)
        if seq_length is not None:
            extra += ["--seq-length", str(seq_length)]
        if extra:
            text = text.rstrip("\n") + " " + shlex.join(extra) + "\n"
        return text
    if target == "deepspeed":
        data = _deepspeed_options(to_deepspeed(plan), options, target)
        return json_text(data, indent=1) + "\n"
    if target == "megatron-deepspeed":
        data = _deepspeed_options(to_megatron_deepspeed(plan), options, target)
        # Megatron's own arguments, before --deepspeed: the model's dtype (and
        # so GPTModelPipe's layer list, "layers" not "layers_fp32") and length
        extra = []
        if options is not None and options.precision in ("bf16", "fp16"):
            extra.append(f"--{options.precision}")
        if seq_length is not None:
            extra += ["--seq-length", str(seq_length)]
        data["arguments"][-3:-3] = extra
        return json_text(data, indent=1) + "\n"
    if target == "torchtitan":
        return to_torchtitan(plan, options, seq_length)
    if not _plain(options):
        raise ExportRefused(
            f"{target}: its file carries no precision, recomputation, sharding or "
            "schedule settings, and the plan was priced with some"
        )
    if target == "alpa":
        gpu = plan.stages[0].replicas[0].gpu_type
        per_host = (gpus_per_node or {}).get(gpu)
        return json_text(to_alpa(plan, gpus_per_host=per_host), indent=1) + "\n"
    if target == "sailor":
        data = {"target": SAILOR_VERSION}
        data.update(plan_to_sailor(plan, gpus_per_node=gpus_per_node))
        return json_text(data, indent=2) + "\n"
    raise ProblemError(f"export must be one of {', '.join(EXPORTS)}, got {target!r}")


def export_plan(
    plan: Plan3D,
    target: str,
    *,
    gpus_per_node: Mapping[str, int] | None = None,
    options: TrainingOptions | None = None,
    seq_length: int | None = None,
) -> str:
    """The export for ``target`` (:data:`EXPORTS`) as text.

    Args:
        plan: the plan.
        target: one of :data:`EXPORTS`.
        gpus_per_node: GPUs per node of each type; with it, no node of the plan
            may hold more GPUs than that
            (:func:`~pipedejavu.core.plan3d.check_nodes`). Alpa needs it (its
            mesh is whole hosts), and Sailor for a plan that places replicas on
            nodes.
        options: the training the plan was priced with (``None``: plain fp32,
            the targets' defaults); see the module docstring.
        seq_length: the tokens per sample the plan was priced with, written
            where the target takes it (Megatron-LM's and Megatron-DeepSpeed's
            ``--seq-length``, torchtitan's ``[training] seq_len``; DeepSpeed's
            config, Alpa's and Sailor's files have none); ``None``: not written.

    Raises:
        ExportRefused: the target cannot launch the plan as planned; one line
            with the reason and the targets that can.
        ProblemError: an unknown target, or nodes that hold too many GPUs.
    """
    if target not in EXPORTS:
        raise ProblemError(
            f"export must be one of {', '.join(EXPORTS)}, got {target!r}"
        )
    if gpus_per_node is not None:
        check_nodes(plan, lambda gpu: gpus_per_node[gpu])
    try:
        return _build(plan, target, gpus_per_node, options, seq_length)
    except ExportRefused as refusal:
        able = []
        for other in EXPORTS:
            if other == target:
                continue
            try:
                _build(plan, other, gpus_per_node, options, seq_length)
            except ProblemError:
                continue
            able.append(other)
        instead = (
            f"--export {', '.join(able)} can launch it"
            if able
            else "no export target can launch it"
        )
        raise ExportRefused(
            f"cannot export this plan to {target}: {refusal}; {instead}"
        ) from None
