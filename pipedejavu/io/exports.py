"""Export a :class:`~pipedejavu.core.plan3d.Plan3D` to what people launch.

Each target has its own module, which states the version it was checked
against and the rules it honours (read from that version's source; no code
copied); every exported file names that version:

========================  =====================================================
``megatron``              :mod:`pipedejavu.io.export_megatron_command` (a whole
                          Megatron Core 0.16.1 ``pretrain_gpt.py`` command,
                          one shell-quoted line)
``deepspeed``             :mod:`pipedejavu.io.export_deepspeed` (DeepSpeed
                          0.19.8 ``PipelineModule`` ``parts`` of the abstract
                          list ``[embedding, blocks, head]``)
``megatron-deepspeed``    :mod:`pipedejavu.io.export_deepspeed` (the same on
                          Megatron-DeepSpeed's ``GPTModelPipe`` layer list)
``torchtitan``            :mod:`pipedejavu.io.export_torchtitan` (v0.2.2 TOML)
``alpa``                  :mod:`pipedejavu.io.export_alpa` (b8078a9
                          ``ManualStageOption`` and micro-batches)
``sailor``                :func:`pipedejavu.io.sailor_plan.plan_to_sailor`
========================  =====================================================

An export either builds exactly the plan's stages, the ranks of each stage's
replicas (TP fastest, then data, then pipeline: :mod:`pipedejavu.io.export_rules`),
the model's transformer blocks (checked against the model's own count:
:func:`~pipedejavu.io.export_rules.check_model_layers`) and its batch, and
states the sequence length the plan was priced at, or is refused with
:class:`~pipedejavu.io.export_rules.ExportRefused`, one line saying why and
which targets can launch the plan instead (:func:`launchers`, which the
plan reports use too). A plan on
several GPU types names the type of each block of global ranks (a comment in
the Megatron arguments and the torchtitan TOML, ``gpu_types_by_rank`` in the
DeepSpeed JSON); order the hosts so that those ranks land on them.

**Training options** (:class:`~pipedejavu.core.training_options.TrainingOptions`:
precision, recomputation, distributed optimizer, sequence parallelism, the
pipeline schedule, attention kernel) a plan was priced with travel with it:

* Megatron-LM gets its flags (:func:`option_flags`: ``--bf16``, fp8 as
  ``--fp8-format hybrid --fp8-recipe tensorwise`` (the current scaling priced),
  ``--recompute-granularity`` with its ``--recompute-modules``,
  ``--use-distributed-optimizer``,
  ``--sequence-parallel``, ``--overlap-grad-reduce``,
  ``--overlap-param-gather``, ``--grad-reduce-in-bf16``, ``--tp-comm-overlap``
  (not at TP 1, where Megatron-LM refuses it), ``--attention-backend
  unfused``) and
  ``--num-layers-per-virtual-pipeline-stage`` for the interleaved schedule.
* The DeepSpeed configs get their ``bf16``/``fp16`` sections and ZeRO stage 1
  for the distributed optimizer. DeepSpeed's abstract layer list refuses
  recomputation and sequence parallelism (the pipeline engine sets
  recomputation in code, ``activation_checkpoint_interval``, and has no
  sequence parallelism) and any schedule but 1F1B (its engine runs
  ``TrainSchedule``). Megatron-DeepSpeed also runs ZB-H1 and full
  recomputation of every block (:func:`megatron_deepspeed_flags`); it refuses
  sequence parallelism: under DeepSpeed's engine nothing all-reduces the
  norms' gradients over the TP group (Megatron's ``allreduce_layernorm_grads``
  runs only without ``--deepspeed``, and DeepSpeed 0.19.8 reduces over data
  parallelism only), so each TP rank would train its own copy of them.
* torchtitan carries the schedule (1F1B, interleaved, ZB-H1, interleaved
  zero bubble), full
  recomputation, fp32 precision and sequence parallelism, and refuses what its
  file cannot express exactly (:mod:`pipedejavu.io.export_torchtitan`).
* The other targets, whose files carry no such settings, refuse any options
  but plain fp32 1F1B training.

**Experts.** A plan with experts goes to Megatron-LM only
(:mod:`pipedejavu.io.export_megatron`: the experts' flags, one EP and expert
TP, the ``moe`` options it was priced with); the other targets refuse it
(:func:`~pipedejavu.io.export_rules.refuse_experts`, each with its reason).

**Zero bubble.** A ZB-H1 plan (``zero_bubble``, one chunk per rank or more)
is refused by Megatron-LM
(megatron-core 0.16.1's ``get_forward_backward_func`` runs no pipelining,
1F1B or interleaved 1F1B; its ``--delay-wgrad-compute`` defers weight
gradients only inside the MoE expert-parallel overlap of one 1F1B step, which
``TransformerConfig`` requires) and by DeepSpeed's abstract list (0.19.8's
pipeline engine runs ``TrainSchedule`` with whole backward passes; its
``DualPipeVSchedule`` keeps the weight gradient inside ``BackwardPass`` too);
torchtitan runs it as ``InterleavedZeroBubble`` and Megatron-DeepSpeed as
``--enable-zbh1-pipeline --enable-zbh1-exact-semantics``
(:mod:`pipedejavu.io.export_deepspeed`). :data:`LAUNCHED_SCHEDULES` says which
target runs which schedule (:func:`schedule_targets` for the help texts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pipedejavu.core.files import json_text
from pipedejavu.core.placement import RANK_ORDERS, check_nodes, plan_rank_order
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE_GRANULARITIES,
    TRAINING_PRECISIONS,
    TrainingOptions,
    params_dtype,
)
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_alpa import to_alpa
from pipedejavu.io.export_deepspeed import (
    deepspeed_options,
    to_deepspeed,
    to_megatron_deepspeed,
)
from pipedejavu.io.export_megatron import (
    DEFAULT_MOE_OPTIONS,
    NO_ZERO_BUBBLE,
    check_experts,
    check_read_back,
    expert_note,
    latent_note,
    moe_run_flags,
    to_megatron,
)
from pipedejavu.io.export_megatron_command import megatron_command
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_model_layers,
    check_sharding,
    transformer_layers,
)
from pipedejavu.io.export_torchtitan import to_torchtitan
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.sailor_plan import plan_to_sailor

__all__ = [
    "EXPORTS",
    "LAUNCHED_RANK_ORDERS",
    "LAUNCHED_RECOMPUTE_LAYERS",
    "LAUNCHED_SCHEDULES",
    "LAUNCHED_TRAINING",
    "DATA_PARALLEL_ALONE",
    "SAILOR_VERSION",
    "export_plan",
    "launchers",
    "precision_refusal",
    "SWITCH_FLAGS",
    "option_flags",
    "schedule_targets",
    "schedule_targets_text",
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
    "megatron-deepspeed": ("1f1b", "zb-h1"),
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
LAUNCHED_TRAINING["megatron-deepspeed"] = {
    **LAUNCHED_TRAINING["deepspeed"],
    "recompute": ("none", "full"),
}
#: The recomputed blocks of each stage (:class:`~pipedejavu.planning.
#: knob_space.KnobSpace`'s ``recompute_layers``: ``None`` every one, ``N`` the
#: first ``N``) each target launches with full recomputation; ``None`` here:
#: every count (Megatron-LM's block method; torchtitan's where it covers
#: every chunk). Megatron-DeepSpeed recomputes every block or none.
LAUNCHED_RECOMPUTE_LAYERS: dict[str, tuple[None, ...] | None] = {
    target: (None,) if target == "megatron-deepspeed" else None for target in EXPORTS
}
#: Why a target runs no plan of a precision, where more than its flags is
#: missing.
_PRECISION_WHY = {
    ("torchtitan", "bf16"): "torchtitan trains bf16 only with FSDP, which "
    "shards parameters, gradients and optimizer state: the sharded single-stage "
    "space holds such plans of a dense model (--sharded on with knob flags), the "
    "pipeline search none",
    ("torchtitan", "fp8"): "torchtitan trains fp8 only with FSDP, which shards "
    "parameters, gradients and optimizer state: the sharded single-stage space "
    "holds such plans of a dense model (--sharded on with knob flags), the "
    "pipeline search none",
}
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


def schedule_targets() -> dict[str, list[str]]:
    """``{schedule: the targets that launch it}`` (:data:`LAUNCHED_SCHEDULES`),
    for the help texts and the reports."""
    out: dict[str, list[str]] = {}
    for target in EXPORTS:
        for schedule in LAUNCHED_SCHEDULES[target]:
            out.setdefault(schedule, []).append(target)
    return out


def schedule_targets_text() -> str:
    """Which target runs which schedule, for the help texts: ``1f1b by
    megatron, ...; interleaved by megatron, torchtitan; ...``."""
    return "; ".join(
        f"{schedule} by {', '.join(targets)}"
        for schedule, targets in schedule_targets().items()
    )


def precision_refusal(target: str, precision: str) -> str | None:
    """Why ``target`` launches no plan trained in ``precision``, with the
    targets that do (``None``: it launches some)."""
    launched = LAUNCHED_TRAINING[target]["precision"]
    if precision in launched:
        return None
    why = _PRECISION_WHY.get(
        (target, precision),
        f"{target} launches {', '.join(launched)} training as planned, not {precision}",
    )
    others = [t for t in EXPORTS if precision in LAUNCHED_TRAINING[t]["precision"]]
    return f"--export {target}: {why}; --export {', '.join(others)} run {precision}"


def option_flags(options: TrainingOptions) -> list[str]:
    """Megatron-LM's flags for ``options`` (module docstring)."""
    dtype = params_dtype(options.precision)
    flags = [] if dtype == "fp32" else [f"--{dtype}"]
    if options.precision == "fp8":
        flags += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    if options.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
        if options.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
            flags += ["--recompute-modules", *options.recompute_modules]
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
        if not options.attention_dropout:  # (Megatron-LM's default is 0.1)
            flags += ["--attention-dropout", "0"]
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


def _order(plan: Plan3D, gpus_per_node: Mapping[str, int] | None) -> str:
    """The plan's rank order (its layout's, checked against its nodes)."""
    gpu = plan.stages[0].replicas[0].gpu_type
    per_node = None if gpus_per_node is None else gpus_per_node.get(gpu)
    try:
        return plan_rank_order(plan, per_node)
    except ProblemError as error:
        raise ExportRefused(str(error)) from None


def uniform_recompute(
    plan: Plan3D,
    options: TrainingOptions | None,
    target: str,
    spec: TransformerSpec | None = None,
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
    blocks = transformer_layers(plan, spec)
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
    spec: TransformerSpec | None = None,
    megatron_args: str | None = None,
    moe: MoeOptions | None = None,
) -> str:
    options = uniform_recompute(plan, options, target, spec)
    check_sharding(plan, target, options)
    order = _order(plan, gpus_per_node)
    if order not in LAUNCHED_RANK_ORDERS.get(target, ()):
        raise ExportRefused(
            f"{target}: the plan places each pipeline's stages on consecutive "
            f"ranks ({order}); the target lays out {RANK_ORDERS[0]} only"
        )
    if target == "megatron":
        if options is not None and options.zero_bubble:
            raise ExportRefused(NO_ZERO_BUBBLE)
        own = megatron_args is not None
        sp = options is not None and options.sequence_parallel
        check_experts(plan, spec, sequence_parallel=sp, own_command=own)
        chunks = 1 if options is None else options.virtual_stages
        args = to_megatron(plan, spec, chunks)
        args += ["--use-tp-pp-dp-mapping"] if order == RANK_ORDERS[1] else []
        moe = None if own else moe or DEFAULT_MOE_OPTIONS
        args += [] if moe is None else moe_run_flags(spec, moe)
        if options is not None:
            if options.tp_comm_overlap and plan.stages[0].replicas[0].tp == 1:
                # Megatron-LM turns sequence parallelism off at TP 1 and then
                # asserts on --tp-comm-overlap; without TP it overlaps nothing
                options = dataclasses.replace(options, tp_comm_overlap=False)
            args += option_flags(options)
        text = megatron_command(
            plan,
            args,
            spec=spec,
            seq_length=seq_length,
            user_args=megatron_args,
            notes=expert_note(plan, spec, moe) + latent_note(None if own else spec),
        )
        check_read_back(plan, text, spec)
        return text
    if target in ("deepspeed", "megatron-deepspeed"):
        deepspeed = target == "deepspeed"
        data = (
            to_deepspeed(plan, spec) if deepspeed else to_megatron_deepspeed(plan, spec)
        )
        flags = deepspeed_options(data, plan, options, target, spec)
        data["seq_length"] = seq_length
        if not deepspeed:
            # Megatron's own arguments, before --deepspeed: the model's dtype
            # (and so GPTModelPipe's layer list, "layers" not "layers_fp32"),
            # the length, the schedule, recomputation and attention
            if options is not None and options.precision in ("bf16", "fp16"):
                flags.insert(0, f"--{options.precision}")
            if seq_length is not None:
                flags += ["--seq-length", str(seq_length)]
            data["arguments"][-3:-3] = flags
        return json_text(data, indent=1) + "\n"
    if target == "torchtitan":
        return to_torchtitan(plan, options, seq_length, spec)
    if not _plain(options):
        raise ExportRefused(
            f"{target}: its file carries no precision, recomputation, sharding or "
            "schedule settings, and the plan was priced with some"
        )
    if target == "alpa":
        gpu = plan.stages[0].replicas[0].gpu_type
        per_host = (gpus_per_node or {}).get(gpu)
        data = to_alpa(plan, gpus_per_host=per_host, spec=spec)
    elif target == "sailor":
        data = {"target": SAILOR_VERSION}
        data.update(plan_to_sailor(plan, gpus_per_node=gpus_per_node, spec=spec))
    else:
        raise ProblemError(
            f"export must be one of {', '.join(EXPORTS)}, got {target!r}"
        )
    data["seq_length"] = seq_length  # the model's length, for the user
    return json_text(data, indent=1 if target == "alpa" else 2) + "\n"


def _check(
    plan: Plan3D,
    target: str,
    gpus_per_node: Mapping[str, int] | None,
    spec: TransformerSpec | None,
) -> None:
    if target not in EXPORTS:
        raise ProblemError(
            f"export must be one of {', '.join(EXPORTS)}, got {target!r}"
        )
    if gpus_per_node is not None:
        check_nodes(plan, lambda gpu: gpus_per_node[gpu])
    check_model_layers(plan, spec)


def launchers(
    plan: Plan3D,
    *,
    gpus_per_node: Mapping[str, int] | None = None,
    options: TrainingOptions | None = None,
    spec: TransformerSpec | None = None,
    moe: MoeOptions | None = None,
) -> dict[str, str | None]:
    """Which targets launch ``plan`` as planned: ``{target: None}`` for those
    that do, ``{target: why not}`` for the others, in :data:`EXPORTS`' order
    (arguments as :func:`export_plan`'s; the one definition the refusals and
    the plan reports use).

    Raises:
        ProblemError: nodes that hold too many GPUs, or a plan of another
            number of layers than ``spec``.
    """
    _check(plan, EXPORTS[0], gpus_per_node, spec)
    out: dict[str, str | None] = {}
    for target in EXPORTS:
        try:
            _build(plan, target, gpus_per_node, options, None, spec, moe=moe)
        except ProblemError as refusal:  # (or e.g. Alpa's hosts not given)
            out[target] = str(refusal).removeprefix(f"{target}: ")
        else:
            out[target] = None
    return out


def export_plan(
    plan: Plan3D,
    target: str,
    *,
    gpus_per_node: Mapping[str, int] | None = None,
    options: TrainingOptions | None = None,
    seq_length: int | None = None,
    spec: TransformerSpec | None = None,
    megatron_args: str | None = None,
    moe: MoeOptions | None = None,
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
        seq_length: the tokens per sample the plan was priced at (default:
            ``spec``'s), stated in every export: where the target takes it
            (Megatron-LM's and Megatron-DeepSpeed's ``--seq-length``,
            torchtitan's ``[training] seq_len``) and as ``seq_length`` in the
            JSON of the others; ``None`` with no ``spec``: said to be unknown.
        spec: the model, whose transformer blocks the export builds (checked
            against the plan's layers) and whose shape the Megatron-LM command
            carries (``None``: the plan's layers are one embedding, the
            blocks and one head layer, and the shape is not known).
        megatron_args: the user's own Megatron-LM command (``plan
            --megatron-args``): the Megatron-LM export is that command with the
            plan's flags in place of its own.
        moe: how the plan's experts were priced (dispatcher, grouped GEMM,
            forced balance, capacity, overlaps), written to Megatron-LM
            (``None``: :data:`~pipedejavu.io.export_megatron.
            DEFAULT_MOE_OPTIONS`; with ``megatron_args``, the command's own).

    Raises:
        ExportRefused: the target cannot launch the plan as planned; one line
            with the reason and the targets that can.
        ProblemError: an unknown target, nodes that hold too many GPUs, or a
            plan of another number of layers than ``spec``.
    """
    _check(plan, target, gpus_per_node, spec)
    if seq_length is None and spec is not None:
        seq_length = spec.seq_length
    try:
        return _build(
            plan, target, gpus_per_node, options, seq_length, spec, megatron_args, moe
        )
    except ExportRefused as refusal:
        able = [
            other
            for other, why in launchers(
                plan, gpus_per_node=gpus_per_node, options=options, spec=spec, moe=moe
            ).items()
            if why is None and other != target
        ]
        instead = (
            f"--export {', '.join(able)} can launch it"
            if able
            else "no export target can launch it"
        )
        raise ExportRefused(
            f"cannot export this plan to {target}: {refusal}; {instead}"
        ) from None
