"""A torchtitan job-config fragment (TOML) for a plan and its training options.

Checked against torchtitan v0.2.2 (commit 73a0e697: ``torchtitan/config/
job_config.py``, ``distributed/parallel_dims.py``,
``distributed/pipeline_parallel.py``, ``distributed/activation_checkpoint.py``,
``distributed/utils.py``, ``models/llama3/infra/parallelize.py``,
``models/attention.py``, ``train.py``) and the PyTorch it ran on (torch
2.14.1, and 2.13.0 since 2026-12-06; ``torch/distributed/pipelining/
schedules.py`` and ``_utils.py``); no code copied.
``benchmarks/check_exports.py`` runs the real code on these files, and
``benchmarks/check_torchtitan_fsdp.py`` on sharded ones (v0.2.2 and v0.2.1,
whose job config has every key the fragment writes).

**Layout and batch.**

* ``ParallelDims``: ``dp_replicate x dp_shard x cp x tp x pp`` is the world
  size; the mesh is ``pp, dp_replicate, fsdp, tp`` with ``fsdp = dp_shard x
  cp`` (TP fastest, then CP, then the replicas: the rank order of
  :mod:`pipedejavu.io.export_rules`, and the layout's: replica ``j`` is
  replicate group ``j // dp_shard``, shard ``j mod dp_shard``).
* Sharded data parallelism (``zero_stage = 3`` over shard groups of more than
  one GPU, :attr:`~pipedejavu.core.layout.ParallelLayout.shard_group`) is
  FSDP2: ``data_parallel_shard_degree`` the layout's ``shard_replicas``,
  ``data_parallel_replicate_degree`` its ``dp_replicate`` (HSDP above 1);
  ``apply_fsdp`` shards the embedding, each block and the norm with the head
  over ``dp_replicate x fsdp``. ``fsdp_reshard_after_forward``: ``"always"``
  for ``reshard_after_forward`` (``"default"`` keeps the norm and head
  gathered, and every unit under PP), ``"never"`` otherwise. Context
  parallelism (``context_parallel_degree``) is always sharded: ``fsdp_enabled``
  is ``dp_shard > 1 or cp > 1``.
* Without it, ``parallelize_llama`` runs DDP (``data_parallel_shard_degree =
  1``), and only as the one parallelism (``RuntimeError: DDP has not
  supported > 1D parallelism``): a plan with ``dp > 1`` beside TP or stages,
  or with ``cp > 1``, is refused unless it is ``zero_stage`` 3; so are ZeRO 1
  and 2 over replicas (only FSDP shards optimizer state, with everything
  else) and ZeRO-3 over single-GPU shard groups beside other replicas. One
  replica without CP has no shard group: any ZeRO stage exports unsharded.
* FSDP with pipeline stages is refused: PyTorch's ``PipelineStage``
  (``backward_maybe_with_nosync``) turns FSDP's gradient sync and resharding
  off for every micro-batch's backward but the last, so a stage's whole
  gathered weights and unsharded gradients stay on each GPU until one
  reduce-scatter per step; the plan prices ZeRO-3 sharded between
  micro-batches, reduce-scattered after each.
* ``seq_len`` must be a multiple of ``tp x 2 cp`` (``parallelize_llama``
  asserts it: sequence parallelism's split, and CP's head-tail load
  balancing of causal attention): refused otherwise. CP runs SDPA's fused
  kernels (ring attention, ``context_parallel_rotate_method`` left at
  ``"allgather"``): a plan priced without flash attention is refused.
* The batch (``train.py``): gradient accumulation is ``global_batch_size /
  (local_batch_size x dp)``. With one stage a rank runs ``local_batch_size``
  samples in one forward/backward (``pipeline_parallel_microbatch_size`` is
  not used), so ``local_batch_size`` is the micro-batch and the global batch
  gives the accumulation (CP ranks share their replica's samples). With
  several stages (then ``dp = 1``) the pipeline
  schedule splits ``local_batch_size`` into micro-batches of
  ``pipeline_parallel_microbatch_size``: ``local_batch_size`` is the global
  batch, one accumulation step.
* ``module_fqns_per_model_part`` (``pipeline_module_split``) with the llama3
  decoder's names ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``
  (:func:`module_fqns`; the model's own block count,
  :func:`~pipedejavu.io.export_rules.num_blocks`, and ``norm`` and ``output``
  on different parts where the profile keeps them apart); uneven splits are
  kept.
* ``[training] seq_len``: the length the plan was priced at (torchtitan's
  default is 2,048); a comment where it is not known.

**Schedule** (``pipeline_parallel_schedule``; ``pipeline_llm`` checks the
parts per rank only when ``pipeline_parallel_layers_per_stage`` is set, which
the fragment leaves unset):

* 1F1B: ``"1F1B"``, one part per stage. PyTorch's ``Schedule1F1B`` raises
  ``ValueError`` for fewer micro-batches than stages, so such a plan is refused
  (``GPipe`` would run it, but holds every micro-batch's activations on every
  stage: not the memory the plan was checked against).
* Megatron-LM's interleaved 1F1B with ``V`` chunks per rank:
  ``"Interleaved1F1B"`` with ``P V`` parts. ``pipeline_module_split`` gives
  rank ``r`` the parts ``r, r + P, ...`` (its ``"loop"`` style, and
  ``generate_stage_to_rank_mapping`` puts stage ``k`` on rank ``k mod P``),
  so part ``k = c P + r`` is chunk ``c`` of rank ``r``, as in Megatron-LM:
  the transformer layers split into ``P V`` equal chunks in order, the
  embedding in part 0 and the norm and head in the last. PyTorch's
  ``ScheduleInterleaved1F1B`` takes micro-batches in rounds of ``M / max(1,
  M // P)``; with ``M`` a multiple of ``P`` (Megatron-LM's rule) a round is
  ``P`` micro-batches and each rank's order is
  :func:`~pipedejavu.simulation.interleaved.interleaved_order`. Refused: one
  stage, unequal stages, stages that do not split into ``V`` chunks, ``M``
  not a multiple of ``P``.
* ZB-H1 (``zero_bubble``): ``"InterleavedZeroBubble"`` with one part per
  rank. ``build_pipeline_schedule`` hands this multi-stage class the list of
  the rank's one stage; PyTorch's ``ScheduleInterleavedZeroBubble`` then runs
  ZB-1p on one stage per rank: ``min(P - 1 - r, M)`` forwards, then per step a
  forward, an input-gradient ``B`` and, from the rank's ``r``-th ``B`` on, the
  oldest pending weight-gradient ``W``; then the remaining ``B``/``W``. It
  raises ``ValueError`` unless ``M`` is a multiple of ``max(1, M // P)``, so
  such a plan is refused. With one stage torchtitan runs no schedule: each
  micro-batch's forward and whole backward, the ZB-H1 order of one rank.
* Interleaved zero bubble (``zero_bubble`` with ``V > 1``):
  ``"InterleavedZeroBubble"`` with ``V`` parts per rank, Megatron-LM's chunks
  (as ``Interleaved1F1B``); with ``M`` a multiple of ``P`` its order is
  :func:`~pipedejavu.simulation.zero_bubble.zero_bubble_order` with ``V``
  chunks. Refused as ``Interleaved1F1B`` is.
* ZB-V (``v_shape``): ``"ZBVZeroBubble"`` with the same ``2 P`` parts in
  model order; torchtitan's ``pipeline_module_split`` places them in a V for
  this schedule (rank ``r`` gets parts ``r`` and ``2 P - 1 - r``: our
  chunks 0 and 1) and PyTorch's ``ScheduleZBVZeroBubble`` runs
  :func:`~pipedejavu.simulation.zero_bubble.zbv_order` for any ``M``.
  Refused: one stage, unequal stages, stages that do not split into two
  chunks.

**Recomputation** (``[activation_checkpoint] mode``, always written:
torchtitan's default is ``"selective"`` with ``selective_ac_option = "2"``,
every second block):

* none: ``"none"``. full: ``"full"``; ``apply_ac`` wraps every transformer
  block (not the embedding, norm or head), as Megatron-LM's full
  recomputation does. With ``recompute_num_layers = k`` Megatron-LM's
  ``block`` method recomputes the first ``k`` layers of each chunk: the same
  as ``"full"`` when no chunk has more than ``k`` layers, refused otherwise
  (torchtitan's layer-level selective mode checkpoints every ``n``-th block
  of a rank, counted over its parts, not the first ``k`` of each).
* selective with torchtitan's own policy (``recompute_modules =
  ("torchtitan_op",)``): ``"selective"`` with ``selective_ac_option =
  "op"`` (``apply_ac`` wraps every block with a policy that saves every
  other ``aten.mm`` output, attention's and a few others). With fp8 it is
  refused: float8 linears run ``aten._scaled_mm``, which the policy's save
  list does not hold, so every product is recomputed. Megatron-LM's
  selective modules (by default the attention core alone) are refused: the
  op-level mode is another policy, the layer-level mode whole blocks.

**Precision** (``[training] dtype`` and ``mixed_precision_param``, always
written; ``dtype`` stays ``"float32"``: ``"bfloat16"`` drops the fp32 master
weights). With FSDP: fp32 is ``mixed_precision_param = "float32"``; bf16 is
``"bfloat16"`` with ``mixed_precision_reduce = "float32"`` (fp32 sharded
weights, bf16 gathered ones, fp32 reduce-scatters: what the plan prices);
fp8 adds torchao's float8 linears (``[model] converters =
["quantize.linear.float8"]``, ``[quantize.linear.float8] recipe_name =
"tensorwise"``; every ``nn.Linear`` with dimensions that are multiples of 16,
the head too, as the analytical model prices it; torchao and SM 8.9 needed).
``grad_reduce_in_bf16`` is refused (``mixed_precision_reduce`` is float32
only). Without FSDP only fp32 (``"float32"`` for both: the default
``"bfloat16"`` turns on ``torch.autocast`` under DDP or on one GPU,
``maybe_enable_amp``): bf16 and fp8 are refused there (autocast over fp32
weights, and no mixed precision at all with TP or PP). fp16 is refused
(``mixed_precision_param`` is bfloat16 or float32).

**Sequence parallelism.** ``apply_tp`` always shards the norms along the
sequence (``SequenceParallel`` on ``attention_norm``, ``ffn_norm`` and
``norm``): a plan with TP > 1 is exported only with ``sequence_parallel``.
At TP 1 there is nothing to shard (Megatron-LM turns it off too).

**Overlap.** Megatron-LM's ``overlap_grad_reduce`` and
``overlap_param_gather`` are refused under DDP (PyTorch's buckets overlap
otherwise), and ``tp_comm_overlap`` (async TP, torchtitan's with
``torch.compile`` only). FSDP2 always overlaps its gathers and
reduce-scatters with the passes, as the plan prices ZeRO-3 with or without
``overlap_grad_reduce``: accepted there. **Compile**: no training option
names ``torch.compile``, so the fragment leaves torchtitan's default (off).

**Attention.** The kernel and attention dropout belong to the model's code,
not to the job config (llama3's attention is SDPA with cuDNN and flash
kernels first, ``ScaledDotProductAttentionWrapper``, without dropout), so the
fragment carries neither, as the other targets' files do not (but CP, above).

**Experts** (:data:`NO_EXPERTS`): a plan with experts is refused. The export
writes llama3, a dense model. torchtitan's MoE models (``qwen3``,
``deepseek_v3``, ``llama4``, ``gpt_oss``) take ``expert_parallel_degree``
and ``expert_tensor_parallel_degree`` (1 or TP: ``ParallelDims._validate``),
but their EP is folded out of ``dp_shard x cp x tp`` (the ``efsdp`` mesh),
not out of replicated data parallelism as Megatron-Core folds it, and
``deepseek_v3``'s and ``llama4``'s ``parallelize`` wrap the model in FSDP
whenever EP > 1: the sharded state the plans here do not price.
"""

from __future__ import annotations

import json

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.training_options import TORCHTITAN_OP, TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    num_blocks,
    refuse_experts,
    transformer_layers,
    type_comment,
    uniform_tp,
)

__all__ = [
    "NO_EXPERTS",
    "TORCHTITAN_VERSION",
    "module_fqns",
    "part_layers",
    "schedule_name",
    "to_torchtitan",
]

TORCHTITAN_VERSION = "torchtitan v0.2.2"
#: Why a plan with experts is refused (module docstring).
NO_EXPERTS = (
    f"{TORCHTITAN_VERSION}: the export writes its dense llama3 model; its MoE "
    "models fold expert parallelism out of FSDP and TP only (ParallelDims: "
    "efsdp = dp_shard x cp x tp / (etp x ep)), never out of unsharded "
    "replicas, and always wrap experts in FSDP, so the plan's expert layout "
    "is not launched as planned"
)


def _refuse(reason: str) -> ExportRefused:
    """A refusal whose reason reads after the version's name."""
    return ExportRefused(f"{TORCHTITAN_VERSION}{reason}")


def schedule_name(options: TrainingOptions) -> str:
    """torchtitan's ``pipeline_parallel_schedule`` for ``options``."""
    if options.v_shape:
        return "ZBVZeroBubble"
    if options.zero_bubble:
        return "InterleavedZeroBubble"
    return "Interleaved1F1B" if options.virtual_stages > 1 else "1F1B"


def part_layers(
    plan: Plan3D, chunks: int = 1, spec: TransformerSpec | None = None
) -> list[range]:
    """Profile layers of each model part: the plan's stages (``chunks = 1``),
    or Megatron-LM's ``P chunks`` equal virtual stages in order (module
    docstring), part ``k = c P + r`` being chunk ``c`` of rank ``r`` (under
    ZB-V torchtitan gives rank ``r`` parts ``r`` and ``2 P - 1 - r``).

    Raises:
        ExportRefused: ``chunks > 1`` with one stage, unequal stages, or
            stages that do not split into ``chunks`` equal chunks.
    """
    if chunks == 1:
        return [range(s.start, s.stop) for s in plan.stages]
    counts = transformer_layers(plan, spec)
    if len(counts) < 2 or len(set(counts)) != 1 or counts[0] % chunks:
        raise _refuse(
            f"'s Interleaved1F1B runs Megatron-LM's chunks "
            f"only for at least 2 stages of equally many transformer layers that "
            f"split into {chunks} chunks; the plan has {counts}"
        )
    size, num_parts = counts[0] // chunks, len(counts) * chunks
    out = []
    for k in range(num_parts):
        start = 0 if k == 0 else 1 + k * size
        stop = plan.num_layers if k == num_parts - 1 else 1 + (k + 1) * size
        out.append(range(start, stop))
    return out


def module_fqns(
    plan: Plan3D, chunks: int = 1, spec: TransformerSpec | None = None
) -> list[list[str]]:
    """torchtitan's module names of each model part (:func:`part_layers`)."""
    blocks = num_blocks(plan, spec)
    # the layers after the blocks: the norm and the head, together or apart
    after = [["norm", "output"]] if plan.num_layers == blocks + 2 else [["norm"]]
    after += [["output"]] * (plan.num_layers - blocks - 1 - len(after))
    out = []
    for layers in part_layers(plan, chunks, spec):
        names = []
        for layer in layers:
            if layer == 0:
                names.append("tok_embeddings")
            elif layer > blocks:
                names += after[layer - blocks - 1]
            else:
                names.append(f"layers.{layer - 1}")
        out.append(names)
    return out


def _sharded(plan: Plan3D, tp: int, options: TrainingOptions) -> bool:
    """Whether torchtitan runs the plan with FSDP (module docstring), after
    refusing the data parallelism it cannot run as planned."""
    layout, stage, pp = plan.layout, options.zero_stage, plan.num_stages
    priced = f"the plan prices zero_stage {stage} over {plan.dp} replica(s)"
    if stage == 3:
        priced += f" in shard groups of {layout.shard_group} GPU(s)"
    if stage == 3 and layout.shard_group > 1:
        if pp > 1:
            raise _refuse(
                "'s pipeline stages run FSDP without gradient sync or resharding "
                "between micro-batches (PyTorch's PipelineStage turns both off but "
                "for the last backward): each GPU holds its stage's gathered weights "
                "and unsharded gradients until one reduce-scatter per step; "
                f"{priced} and {pp} stages, resharded and reduce-scattered after "
                "each micro-batch"
            )
        return True
    if layout.cp > 1:
        raise _refuse(
            " always shards the model state over context-parallel GPUs (FSDP over "
            "data_parallel_shard_degree x context_parallel_degree): it runs CP "
            f"plans with zero_stage 3; {priced} and cp {layout.cp}"
        )
    if plan.dp > 1 and (tp > 1 or pp > 1):
        raise _refuse(
            " runs data parallelism beside TP or PP only as FSDP/HSDP (sharded; "
            "its DDP refuses > 1D parallelism), which plans with zero_stage 3 over "
            f"shard groups of more than one GPU price; {priced} with tp {tp} and "
            f"{pp} stage(s)"
        )
    if stage and plan.dp > 1:
        raise _refuse(
            " shards optimizer state only with FSDP, which shards parameters and "
            "gradients too (zero_stage 3 over shard groups of more than one GPU); "
            + priced
        )
    return False


def _check_training(tp: int, options: TrainingOptions, fsdp: bool) -> None:
    """Precision, sequence parallelism and overlap (module docstring)."""
    if options.precision == "fp16":
        raise _refuse(
            " has no fp16 training (mixed_precision_param is bfloat16 or float32)"
        )
    if options.precision == "bf16" and not fsdp:
        raise _refuse(
            " without FSDP runs bf16 only as torch.autocast over fp32 weights under "
            "DDP or on one GPU (and not at all with TP or PP), not the bf16 "
            "training the plan was priced with (FSDP's, for plans with zero_stage 3)"
        )
    if options.precision == "fp8" and not fsdp:
        raise _refuse(
            " runs fp8 only as torchao's float8 linears over FSDP's bf16 mixed "
            "precision (plans with zero_stage 3), not over the fp32 weights it "
            "trains without FSDP"
        )
    if options.grad_reduce_in_bf16:
        raise _refuse(
            " reduces FSDP's gradients in float32 only (mixed_precision_reduce), "
            "not in bf16 as the plan was priced"
        )
    if tp > 1 and not options.sequence_parallel:
        raise _refuse(
            f" always shards the norms along the sequence with TP (apply_tp), but "
            f"the plan was priced with tp {tp} without sequence parallelism"
        )
    if not fsdp and (options.overlap_grad_reduce or options.overlap_param_gather):
        raise _refuse(
            " overlaps gradients as PyTorch's DDP buckets them, not as the "
            "Megatron-LM overlap the plan was priced with"
        )
    if options.tp_comm_overlap:
        raise _refuse(
            " overlaps tensor-parallel communication (async TP) with its own "
            "kernels, not Transformer Engine's overlap the plan was priced with"
        )


def _check_length(
    plan: Plan3D, tp: int, options: TrainingOptions, seq_length: int | None
) -> int:
    """``tp x 2 cp``, which ``seq_len`` must be a multiple of; CP's attention
    (module docstring)."""
    cp = plan.layout.cp
    divisor = tp * 2 * cp
    if seq_length is not None and seq_length % divisor:
        raise _refuse(
            f"'s parallelize_llama needs seq_len to be a multiple of tp x 2 cp = "
            f"{divisor} (sequence parallelism and CP's load balancing); the plan "
            f"trains {seq_length} tokens per sample"
        )
    if cp > 1 and not options.flash_attention:
        raise _refuse(
            "'s context parallelism runs SDPA's fused kernels only (ring "
            "attention over flash, efficient or cuDNN attention), not the "
            "attention without flash attention the plan was priced with"
        )
    return divisor


def _checkpoint_mode(
    plan: Plan3D, options: TrainingOptions, spec: TransformerSpec | None
) -> str:
    """``[activation_checkpoint]``'s lines (module docstring)."""
    if options.recompute == "none":
        return 'mode = "none"'
    if options.selective_modules == (TORCHTITAN_OP,):
        if options.precision == "fp8":
            raise _refuse(
                "'s per-op recomputation saves aten.mm outputs; its float8 "
                "linears run aten._scaled_mm, which the policy recomputes, not "
                "the every-other product the plan was priced with"
            )
        return 'mode = "selective"\nselective_ac_option = "op"'
    if options.recompute == "selective":
        raise _refuse(
            " has no selective recomputation of Megatron-Core's modules "
            f"({', '.join(options.selective_modules)}): its op-level mode is its "
            f"own policy (recompute_modules ['{TORCHTITAN_OP}']), its "
            "layer-level mode whole blocks"
        )
    limit = options.recompute_num_layers
    if limit is not None:
        # Equal chunks when interleaved (checked before).
        most = max(transformer_layers(plan, spec)) // options.virtual_stages
        if limit < most:
            raise _refuse(
                f" recomputes every block or every n-th block of a rank, not the "
                f"first {limit} of each chunk (a chunk holds up to {most})"
            )
    return 'mode = "full"'


def _schedule(plan: Plan3D, options: TrainingOptions) -> str:
    """The schedule's name, after PyTorch's rules on the micro-batch count."""
    name = schedule_name(options)
    stages, count = plan.num_stages, plan.num_microbatches
    if name == "1F1B" and count < stages:
        raise _refuse(
            f"'s 1F1B schedule (PyTorch's Schedule1F1B) needs at least as many "
            f"micro-batches as stages; the plan runs {count} over {stages} stages"
        )
    interleaved = options.virtual_stages > 1 and not options.v_shape
    if (name == "Interleaved1F1B" or interleaved) and count % stages:
        raise _refuse(
            f"'s {name} runs Megatron-LM's order only for a number of "
            f"micro-batches that is a multiple of the {stages} stages (PyTorch's "
            f"rounds of M / max(1, M // P)); the plan runs {count}"
        )
    rounds = max(1, count // stages)
    if name == "InterleavedZeroBubble" and count % rounds:
        raise _refuse(
            f"'s InterleavedZeroBubble (PyTorch's ScheduleInterleavedZeroBubble) "
            f"needs the micro-batches to be a multiple of max(1, M // P) = "
            f"{rounds}; the plan runs {count} over {stages} stages"
        )
    return name


def _parallelism(plan: Plan3D, tp: int, fsdp: bool, reshard: bool) -> str:
    """The ``[parallelism]`` degrees (module docstring)."""
    layout = plan.layout
    if fsdp:
        policy = "always" if reshard else "never"
        dp = (
            f"data_parallel_replicate_degree = {layout.dp_replicate}\n"
            f"data_parallel_shard_degree = {layout.shard_replicas}\n"
            f'fsdp_reshard_after_forward = "{policy}"\n'
        )
    else:
        dp = (
            f"data_parallel_replicate_degree = {plan.dp}\n"
            "data_parallel_shard_degree = 1\n"
        )
    cp = f"context_parallel_degree = {layout.cp}\n" if layout.cp > 1 else ""
    return (
        f"\n[parallelism]\n{dp}tensor_parallel_degree = {tp}\n{cp}"
        f"pipeline_parallel_degree = {plan.num_stages}\n"
    )


def _precision(options: TrainingOptions, fsdp: bool) -> tuple[str, str]:
    """The ``[training]`` precision lines and the fp8 sections."""
    half = options.precision in ("bf16", "fp8")
    text = 'dtype = "float32"\n'
    text += f'mixed_precision_param = "{"bfloat16" if half else "float32"}"\n'
    if fsdp:
        text += 'mixed_precision_reduce = "float32"\n'
    fp8 = ""
    if options.precision == "fp8":
        fp8 = (
            '\n[model]\nconverters = ["quantize.linear.float8"]\n'
            '\n[quantize.linear.float8]\nrecipe_name = "tensorwise"\n'
        )
    return text, fp8


def to_torchtitan(
    plan: Plan3D,
    options: TrainingOptions | None = None,
    seq_length: int | None = None,
    spec: TransformerSpec | None = None,
) -> str:
    """The TOML fragment: ``[training]`` batch sizes, sequence length and
    precision, ``[parallelism]``, the float8 converter for fp8 and
    ``[activation_checkpoint]``.

    Args:
        plan: the plan (its layout's ``cp`` and ``dp_shard`` too).
        options: the training it was priced with (``None``: plain fp32;
            ``zero_stage`` 3: FSDP2 or HSDP).
        seq_length: its tokens per sample (``seq_len``; ``None``: not known,
            a comment says so: torchtitan's default is 2048).
        spec: the model (``None``: one embedding and one head layer around the
            blocks).

    Raises:
        ExportRefused: per-stage TP; data or context parallelism torchtitan
            does not run as priced (unsharded beside TP, PP or CP; sharded
            beside PP); a batch that is not whole micro-batches; a length,
            schedule, recomputation, precision or overlap torchtitan cannot
            run as planned (module docstring).
    """
    refuse_experts(plan, spec, NO_EXPERTS)
    options = TrainingOptions() if options is None else options
    tp = uniform_tp(plan, TORCHTITAN_VERSION)
    check_whole_batch(plan, TORCHTITAN_VERSION)
    pp = plan.num_stages
    fsdp = _sharded(plan, tp, options)
    _check_training(tp, options, fsdp)
    divisor = _check_length(plan, tp, options, seq_length)
    chunks = options.virtual_stages
    if chunks > 1:
        part_layers(plan, chunks, spec)  # refuses what cannot interleave
    mode = _checkpoint_mode(plan, options, spec)
    name = _schedule(plan, options) if pp > 1 else None
    if pp == 1:
        local_batch = plan.mbs  # one forward/backward per accumulation step
    else:
        local_batch = plan.gbs  # dp == 1: the schedule splits it into mbs
    precision, fp8 = _precision(options, fsdp)
    text = (
        f"# {TORCHTITAN_VERSION} job config fragment (pipedejavu plan)\n"
        + type_comment(plan)
        + "[training]\n"
        f"local_batch_size = {local_batch}\n"
        f"global_batch_size = {plan.gbs}\n"
        + (
            "# seq_len: the length the plan was priced at is not known (set "
            "the model's, a multiple of tp x 2 cp = "
            f"{divisor}; torchtitan's default is 2048)\n"
            if seq_length is None
            else f"seq_len = {seq_length}\n"
        )
        + precision
        + _parallelism(plan, tp, fsdp, options.reshard_after_forward)
    )
    if name is not None:
        parts = module_fqns(plan, chunks, spec)
        fqns = ",\n    ".join(json.dumps(part) for part in parts)
        text += (
            f'pipeline_parallel_schedule = "{name}"\n'
            f"pipeline_parallel_microbatch_size = {plan.mbs}\n"
            f"module_fqns_per_model_part = [\n    {fqns},\n]\n"
        )
    return text + fp8 + f"\n[activation_checkpoint]\n{mode}\n"
