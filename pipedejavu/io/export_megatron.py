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
  ``t*n`` repeats; ``m`` a multi-token-prediction layer). The layout holds
  ``|``, so the command line is quoted for a POSIX shell (:func:`shlex.join`).
  Megatron-LM builds the final norm with the LM head on the last stage: a
  plan that puts them on different stages is refused.
* Multi-token prediction: ``--mtp-num-layers``. Megatron-LM builds the MTP
  layers on the last pipeline stage, the plan prices them there (with the
  LM head); a layout must then name them, after every transformer layer
  (``validate_layer_layout``, ``multi_token_prediction.py``): the last stage
  is written ``t*n`` ``m`` ``L`` (:func:`pipeline_layout`). Megatron-LM's
  MTP loss scaling is left at its default, as the model description holds
  none.
* Multi-latent attention: ``--multi-latent-attention``, ``--q-lora-rank``
  (only for queries projected through a latent), ``--kv-lora-rank``,
  ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``, the latent
  norms as ``--qk-layernorm``, and the model's ``--normalization`` and
  ``--position-embedding-type rope``. ``--rope-type`` is not written:
  Megatron-LM's ``MLATransformerConfig`` then runs YaRN, whose fused kernel
  the cost model prices (its other rotary type needs ``--no-rope-fusion``);
  the model's rotary base and scaling are not in its description, and a
  comment asks for them (:func:`latent_note`).
* One TP degree for every stage (:func:`~pipedejavu.io.export_rules.uniform_tp`).
* Megatron-LM's interleaved schedule with ``V`` chunks per rank:
  ``--num-layers-per-virtual-pipeline-stage`` (transformer layers per chunk);
  Megatron needs an even split (no first/last-stage counts) whose layers per
  rank divide by it (``validate_args``), and PP > 1 with its default
  ``--overlap-p2p-communication`` (:func:`interleaving_flags`).
* Mixtures of experts (:func:`check_experts`, :func:`shape_flags`,
  :func:`moe_run_flags`): the model's ``--num-experts``, ``--moe-router-topk``,
  ``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size`` (with
  ``--moe-shared-expert-gate``) and ``--moe-layer-freq`` (an integer ``N``
  when block ``i`` is an expert block exactly when ``i % N == 0``, else
  Megatron's list expression, :func:`moe_layer_freq_text`); one
  ``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size`` for
  every stage (:func:`~pipedejavu.io.export_rules.uniform_experts`); the
  dispatcher, grouped GEMM and overlaps the plan was priced with
  (:class:`~pipedejavu.io.megatron_moe.MoeOptions`, by default
  :data:`DEFAULT_MOE_OPTIONS`). Megatron-Core's ``MoELayer.forward`` raises
  in training at TP > 1 without ``--sequence-parallel``: a plan priced
  without it is refused. ``--moe-router-topk 1`` takes
  ``--moe-router-pre-softmax`` (``TransformerConfig`` refuses a softmax over
  one score without it).
* Every export with experts, multi-latent attention or multi-token
  prediction is read back by
  :func:`~pipedejavu.io.megatron_args.spec_from_megatron_args` (the one
  statement here of what Megatron-LM refuses) and must give the plan's
  layout and layers per stage and the model's experts, heads, norms, latent
  attention and MTP layers (:func:`check_read_back`).
* Heads not ``h / a`` wide: ``--kv-channels``; per-head query/key norms:
  ``--qk-layernorm``. Refused: norms over a whole projection (OLMoE; no
  Megatron-LM flag).
* No zero-bubble schedule (:data:`NO_ZERO_BUBBLE`; read in megatron-core
  0.16.1): ``get_forward_backward_func`` (``pipeline_parallel/schedules.py``)
  picks no pipelining, 1F1B or interleaved 1F1B, each with whole backward
  passes. ``--delay-wgrad-compute`` defers weight gradients only inside one
  1F1B step of the MoE expert-parallel overlap (``TransformerConfig`` requires
  ``overlap_moe_expert_parallel_comm`` with it), not into the pipeline's
  bubble, so a ZB-H1 plan is refused.
"""

from __future__ import annotations

import dataclasses
import shlex

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import PIPELINE_SPLITS, chunks_hold_blocks, split_blocks
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    has_experts,
    head_layers,
    megatron_parallel_args,
    transformer_layers,
    uniform_experts,
    uniform_tp,
)
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.megatron_pattern import MAX_PATTERN_CHARS

__all__ = [
    "DEFAULT_MOE_OPTIONS",
    "MEGATRON_VERSION",
    "NO_ZERO_BUBBLE",
    "check_read_back",
    "check_experts",
    "expert_note",
    "interleaving_flags",
    "latent_note",
    "moe_layer_freq_text",
    "moe_run_flags",
    "pipeline_layout",
    "shape_flags",
    "to_megatron",
]

MEGATRON_VERSION = "Megatron-LM (Megatron Core 0.16.1)"
#: Why a ZB-H1 plan is refused (module docstring).
NO_ZERO_BUBBLE = (
    "Megatron-LM has no zero-bubble schedule (megatron-core 0.16.1 runs 1F1B or "
    "interleaved 1F1B; --delay-wgrad-compute defers weight gradients only "
    "within its MoE expert-parallel overlap)"
)
#: How the experts' tokens move and compute when the plan's own settings are
#: not given: the alltoall dispatcher with grouped GEMMs (the published
#: Megatron-LM recipes'); routing priced balanced, not forced.
DEFAULT_MOE_OPTIONS = MoeOptions(dispatcher="alltoall", grouped_gemm=True)


def _repeat(letter: str, count: int) -> str:
    return f"{letter}*{count}" if count > 1 else letter * count


def pipeline_layout(counts: list[int], mtp: int = 0) -> str:
    """``--pipeline-model-parallel-layout`` of transformer layers per stage,
    with ``mtp`` multi-token-prediction layers (``m``) after the last
    stage's transformer layers, before the loss: Megatron-LM's layout must
    hold ``--mtp-num-layers`` of them, after every transformer layer."""
    parts = []
    for index, count in enumerate(counts):
        last = index == len(counts) - 1
        text = "E" if index == 0 else ""
        text += _repeat("t", count)
        text += _repeat("m", mtp) + "L" if last else ""
        parts.append(text)
    return "|".join(parts)


def to_megatron(
    plan: Plan3D, spec: TransformerSpec | None = None, chunks: int = 1
) -> list[str]:
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
    if has_experts(plan, spec):
        ep, etp = uniform_experts(plan, "Megatron-LM")
        args += ["--expert-model-parallel-size", str(ep)]
        args += ["--expert-tensor-parallel-size", str(etp)]
    if chunks > 1:  # the interleaved split: equal stages, or as counted
        return args + interleaving_flags(plan, chunks, spec)
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
    mtp = 0 if spec is None else spec.mtp_layers
    return args + ["--pipeline-model-parallel-layout", pipeline_layout(counts, mtp)]


def interleaving_flags(
    plan: Plan3D, chunks: int, spec: TransformerSpec | None = None
) -> list[str]:
    """``--num-layers-per-virtual-pipeline-stage`` for ``chunks`` model chunks
    per rank (none for 1), with ``--account-for-embedding-in-pipeline-split``
    and/or ``--account-for-loss-in-pipeline-split`` where the first (last)
    stage holds one block fewer, as Megatron-LM then splits
    (``get_num_layers_to_build``; at least 2 units per chunk, so every chunk
    holds a block).

    Raises:
        ExportRefused: one stage, or layers per stage that do not split into
            ``chunks`` equal chunks per stage, the embedding and the loss
            counted or not.
    """
    if chunks == 1:
        return []
    counts = transformer_layers(plan, spec)
    ranks = len(counts)
    blocks = sum(counts)
    for embedding, loss in PIPELINE_SPLITS:
        even = split_blocks(blocks, ranks, embedding, loss)
        if counts != even or not chunks_hold_blocks(
            blocks, ranks, chunks, embedding, loss
        ):
            continue
        per_chunk = (blocks + embedding + loss) // (ranks * chunks)
        counted = ["--account-for-embedding-in-pipeline-split"] * embedding
        counted += ["--account-for-loss-in-pipeline-split"] * loss
        return ["--num-layers-per-virtual-pipeline-stage", str(per_chunk), *counted]
    raise ExportRefused(
        f"Megatron-LM's interleaved schedule needs at least 2 stages of "
        f"equally many transformer layers that split into {chunks} chunks "
        f"(the embedding and/or the loss counted as a layer, "
        f"--account-for-embedding/loss-in-pipeline-split); the plan has {counts}"
    )


def _runs(pattern: tuple[bool, ...]) -> str:
    """``[0]*3+[1]*58``: the pattern as runs of one value."""
    parts: list[str] = []
    start = 0
    for index in range(1, len(pattern) + 1):
        if index == len(pattern) or pattern[index] != pattern[start]:
            count = index - start
            value = f"[{int(pattern[start])}]"
            parts.append(value if count == 1 else f"{value}*{count}")
            start = index
    return "+".join(parts)


def moe_layer_freq_text(pattern: tuple[bool, ...] | None) -> str:
    """Megatron-LM's ``--moe-layer-freq`` for the expert blocks ``pattern``
    (``None``: every block): ``N`` when block ``i`` is an expert block exactly
    when ``i % N == 0``; else the list expression of the shortest repeated
    unit, ``([0]+[1])*24``, or of the runs, ``([0]*3+[1]*58)``.

    Raises:
        ExportRefused: a list expression longer than Megatron's flag is read
            here (:data:`~pipedejavu.io.megatron_pattern.MAX_PATTERN_CHARS`).
    """
    if pattern is None or all(pattern):
        return "1"
    blocks = len(pattern)
    firsts = [i for i, flag in enumerate(pattern) if flag]
    freq = firsts[1] if len(firsts) > 1 else blocks
    if all(flag == (i % freq == 0) for i, flag in enumerate(pattern)):
        return str(freq)
    text = f"({_runs(pattern)})"
    for period in range(1, blocks // 2 + 1):
        if blocks % period == 0 and pattern == pattern[:period] * (blocks // period):
            text = f"({_runs(pattern[:period])})*{blocks // period}"
            break
    if len(text) > MAX_PATTERN_CHARS:
        raise ExportRefused(
            f"Megatron-LM: the expert-block pattern needs {len(text):,} characters "
            f"of --moe-layer-freq, more than the {MAX_PATTERN_CHARS:,} read here"
        )
    return text


def _check_shape(spec: TransformerSpec) -> None:
    if spec.qk_layernorm == "projection":
        raise ExportRefused(
            f"Megatron-LM's --qk-layernorm normalizes each head's queries and "
            f"keys; {spec.name}'s norms over the whole query and key projections "
            "(OLMoE's) have no Megatron-LM flag"
        )


def _latent_flags(spec: TransformerSpec) -> list[str]:
    """Multi-latent attention's flags (``--q-lora-rank`` only for queries
    projected through a latent) and ``--mtp-num-layers``."""
    flags = []
    mla = spec.mla
    if mla is not None:
        flags.append("--multi-latent-attention")
        flags += ["--q-lora-rank", str(mla.q_lora_rank)] if mla.q_lora_rank else []
        flags += ["--kv-lora-rank", str(mla.kv_lora_rank)]
        flags += ["--qk-head-dim", str(mla.qk_head_dim)]
        flags += ["--qk-pos-emb-head-dim", str(mla.qk_pos_emb_head_dim)]
        flags += ["--v-head-dim", str(mla.v_head_dim)]
    return flags + (
        ["--mtp-num-layers", str(spec.mtp_layers)] if spec.mtp_layers else []
    )


def shape_flags(spec: TransformerSpec) -> list[str]:
    """The model's head width, query/key norms, multi-latent attention,
    multi-token prediction and experts (module docstring), beside
    :func:`~pipedejavu.io.export_megatron_command.model_flags`' dense shape.

    Raises:
        ExportRefused: a shape Megatron-LM has no flag for.
    """
    _check_shape(spec)
    flags = [] if spec.kv_channels is None else ["--kv-channels", str(spec.kv_channels)]
    flags += ["--qk-layernorm"] if spec.qk_layernorm else []
    flags += _latent_flags(spec)
    moe = spec.moe
    if moe is None:
        return flags
    flags += [
        "--num-experts",
        str(moe.num_experts),
        "--moe-router-topk",
        str(moe.topk),
        "--moe-ffn-hidden-size",
        str(moe.ffn_hidden_size),
    ]
    if moe.shared_ffn_hidden_size:
        flags += ["--moe-shared-expert-intermediate-size"]
        flags += [str(moe.shared_ffn_hidden_size)]
        flags += ["--moe-shared-expert-gate"] if moe.shared_expert_gate else []
    flags += ["--moe-layer-freq", moe_layer_freq_text(moe.layers)]
    # (TransformerConfig: softmax over one score has no gradient)
    return flags + (["--moe-router-pre-softmax"] if moe.topk == 1 else [])


def moe_run_flags(spec: TransformerSpec | None, options: MoeOptions) -> list[str]:
    """The experts' dispatcher, GEMMs, routing and overlaps of ``options``
    (none for a dense ``spec``)."""
    if spec is None or spec.moe is None:
        return []
    flags = ["--moe-token-dispatcher-type", options.dispatcher]
    if options.flex_backend is not None:
        flags += ["--moe-flex-dispatcher-backend", options.flex_backend]
    if options.capacity_factor is not None:
        flags += ["--moe-expert-capacity-factor", repr(options.capacity_factor)]
    switches = {
        "--moe-grouped-gemm": options.grouped_gemm,
        "--moe-router-force-load-balancing": options.force_load_balancing,
        "--moe-pad-expert-input-to-capacity": options.pad_to_capacity,
        "--moe-shared-expert-overlap": options.shared_expert_overlap,
        "--overlap-moe-expert-parallel-comm": options.overlap_dispatch,
    }
    return flags + [flag for flag, on in switches.items() if on]


def check_experts(
    plan: Plan3D,
    spec: TransformerSpec | None,
    *,
    sequence_parallel: bool,
    own_command: bool,
) -> None:
    """Check that Megatron-LM runs the plan's experts as planned (the flags
    are :func:`to_megatron`'s and :func:`shape_flags`'): one expert layout,
    a model that has experts, sequence parallelism at TP > 1.

    Raises:
        ExportRefused: as the module docstring says; a plan with experts and
            no model description (``spec`` ``None``, not ``own_command``:
            the export would not know the experts' flags).
    """
    if spec is not None:
        _check_shape(spec)
    if not has_experts(plan, spec):
        return
    uniform_experts(plan, "Megatron-LM")
    if spec is None and not own_command:
        raise ExportRefused(
            "the plan lays out experts, and without the model's description the "
            "export cannot write its --num-experts and expert shape"
        )
    tp = uniform_tp(plan, "Megatron-LM")
    if tp > 1 and not sequence_parallel:
        raise ExportRefused(
            f"Megatron-Core's MoE layers train at TP {tp} only with "
            "--sequence-parallel (MoELayer.forward raises), and the plan was "
            "priced without it"
        )


def expert_note(
    plan: Plan3D, spec: TransformerSpec | None, options: MoeOptions | None
) -> list[str]:
    """The comment lines that say how the experts were laid out and priced
    (none for a dense plan; ``options`` ``None``: the user's command's)."""
    if not has_experts(plan, spec):
        return []
    layout = plan.layout
    ep, etp = uniform_experts(plan, "Megatron-LM")
    edp = sorted({layout.edp(s) for s in range(layout.pp)})
    lines = [
        f"# experts: EP {ep} x expert TP {etp} x expert DP "
        f"{'/'.join(map(str, edp))} on each stage's GPUs; routing priced "
        "balanced (each expert its share of the tokens): real routing imbalance "
        "is not priced"
    ]
    if options is not None:
        kernels = "grouped GEMM" if options.grouped_gemm else "one GEMM per expert"
        forced = (
            "; --moe-router-force-load-balancing routes evenly, as priced"
            if options.force_load_balancing
            else ""
        )
        dispatcher = f"{options.dispatcher} dispatcher"
        if options.dispatcher == "flex":  # (the backend is a package of its own)
            backend = options.flex_backend or "deepep"
            dispatcher += f" ({backend} backend: the launch needs it installed)"
        overlap = (
            ", the all-to-alls overlapped with another micro-batch's compute"
            if options.overlap_dispatch
            else ""
        )
        lines.append(f"# {dispatcher}, {kernels}{overlap}{forced}")
    return lines


def latent_note(spec: TransformerSpec | None) -> list[str]:
    """The comment lines that say what the export leaves at Megatron-LM's
    defaults for multi-latent attention and multi-token prediction (none
    without them)."""
    lines = []
    if spec is not None and spec.mla is not None:
        lines.append(
            "# multi-latent attention with Megatron-LM's rotary embedding for "
            "it, YaRN with its fused kernel (as priced); the model's rotary base "
            "and scaling are not known here: add its --rotary-base, "
            "--rotary-scaling-factor, --mscale and --mscale-all-dim"
        )
    if spec is not None and spec.mtp_layers:
        lines.append(
            f"# {spec.mtp_layers} multi-token-prediction layer(s) on the last "
            "pipeline stage, where Megatron-LM builds them and the plan prices "
            "them; --mtp-loss-scaling-factor left at Megatron-LM's 0.1"
        )
    return lines


def _shape_of(spec: TransformerSpec) -> tuple:
    """What the shape flags say of ``spec``: its experts (every block named
    as ``None``), head width, query/key norms, multi-latent attention and
    multi-token-prediction layers."""
    moe = spec.moe
    if moe is not None and moe.layers is not None and all(moe.layers):
        moe = dataclasses.replace(moe, layers=None)
    return moe, spec.head_dim, spec.qk_layernorm, spec.mla, spec.mtp_layers


def _reads_back(plan: Plan3D, spec: TransformerSpec | None) -> bool:
    """Whether the export is read back: experts, multi-latent attention or
    multi-token prediction."""
    latent = spec is not None and (spec.mla is not None or spec.mtp_layers > 0)
    return latent or has_experts(plan, spec)


def _same_layout(a, b) -> bool:
    """Two layouts alike, an expert TP of ``None`` read as the stage's TP."""

    def norm(layout):
        stages = tuple((s.tp, s.ep, s.expert_tp) for s in layout.stages)
        return stages, layout.dp, layout.cp, layout.order if layout.pp > 1 else ""

    return norm(a) == norm(b)


def check_read_back(plan: Plan3D, text: str, spec: TransformerSpec | None) -> None:
    """A plan with experts, multi-latent attention or multi-token
    prediction: its export (the command on the last line of ``text``) read
    back by :func:`~pipedejavu.io.megatron_args.spec_from_megatron_args`
    must give the plan's layout and layers per stage, and ``spec``'s
    experts, head width, query/key norms, latent attention and MTP layers.

    Raises:
        ExportRefused: the reader refuses the command (what Megatron-LM
            refuses, as the reader states it), or reads another layout,
            split or model.
    """
    if not _reads_back(plan, spec):
        return
    try:
        run = spec_from_megatron_args(shlex.split(text.splitlines()[-1]))
        layout = run.layout(plan.num_gpus)
    except ProblemError as error:
        raise ExportRefused(
            f"the export's command, read back by pipedejavu's Megatron-LM "
            f"reader, is refused: {error}"
        ) from None
    if spec is not None and _shape_of(run.spec) != _shape_of(spec):
        raise ExportRefused(
            f"Megatron-LM would build another model than {spec.name} from the "
            "command (experts, heads, norms, latent attention or MTP layers)"
        )
    if not _same_layout(layout, plan.layout):
        raise ExportRefused(
            "Megatron-LM would lay out the command's GPUs otherwise than the plan"
        )
    counts = transformer_layers(plan, spec)
    read = list(run.stage_layers) or [run.spec.num_layers // run.pp] * run.pp
    if read != counts:
        raise ExportRefused(
            f"Megatron-LM would split the command's transformer layers {read} "
            f"over the stages, the plan {counts}"
        )
