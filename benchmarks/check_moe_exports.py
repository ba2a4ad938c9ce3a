"""Mixture-of-experts exports checked by Megatron-LM's own code (issue 44).

For MoE launches (hand-picked shapes, DeepSeek-V3-shaped small models with
multi-latent attention, shared experts, first dense blocks and multi-token
prediction, four presets and seeded random layouts), the plan Megatron-LM runs
for the launch (``plan_from_megatron_run``) is exported with
``export_plan(plan, "megatron", ...)`` and

* the whole ``pretrain_gpt.py`` command goes through Megatron-LM's
  ``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``
  (``benchmarks/check_exports.py``'s ``megatron_args``: placeholders given
  values, ``--no-rope-fusion`` for the CPU); the arguments must be the
  model's experts (``num_experts``, ``moe_router_topk``,
  ``moe_ffn_hidden_size``, the shared experts and their gate, the expert
  blocks of ``moe_layer_freq``), head width (``kv_channels``), query/key
  norms, the plan's ``expert_model_parallel_size`` /
  ``expert_tensor_parallel_size``, sequence parallelism, the alltoall
  dispatcher and grouped GEMM, and the dense shape
  (``check_exports.check_model_shape``); with multi-latent attention,
  Megatron-LM's ``MLATransformerConfig`` with the model's ranks and head
  widths, its latent norms and YaRN rotary embedding (what the cost model
  prices), and ``mtp_num_layers``;
* every rank runs ``parallel_state.initialize_model_parallel`` with those
  sizes on torch's fake process group and builds the plan's layers
  (``check_exports.check_megatron``), which asserts, as Megatron-Core does,
  that the dense and expert pipelines agree;
* Megatron-Core's ``RankGenerator``, built as ``initialize_model_parallel``
  builds its dense and expert generators for the exported sizes, gives the
  groups of ``plan.layout.groups``: dense ``tp``, ``dp``, ``pp``, and expert
  ``etp`` (its ``tp``), ``ep``, ``etp-ep`` (its ``tp-ep``), ``edp`` (its
  ``dp``), ``pp`` — the same lists in the same order;
* with MTP layers, every rank's ``get_mtp_num_layers_to_build`` (each model
  chunk) builds them on the last pipeline stage only, where the plan prices
  them with the LM head.

A split that only ``--pipeline-model-parallel-layout`` gives, with an MTP
layer (``Et*3|t*3|t|tmL``), goes through the same checks as the export
writes it (its read-back skipped), and the export's own answer (exported, or
refused by its read-back) is recorded.

A refusal is checked too: biased experts split over expert TP (the export
refuses them through our reader) must be refused by Megatron-LM's
``TransformerConfig``.

``validate_args`` asks the GPU's compute capability for ``--moe-grouped-gemm``
(grouped GEMM kernels need 8.0 or newer): the check answers 9.0 (H100), as
``check_exports`` answers the architecture for its TP warning.

Needs the launchers' environment of ``benchmarks/check_exports.py``; not run
by CI::

    PYTHONPATH=.:MEGATRON_LM_SOURCE python benchmarks/check_moe_exports.py

Writes benchmarks/results/check_moe_exports.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shlex
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_exports  # noqa: E402  (Megatron's argument parsing, silenced)
import torch  # noqa: E402

from pipedejavu.core.layout import experts_fit  # noqa: E402
from pipedejavu.costmodel.megatron.interleaving import chunk_layers  # noqa: E402
from pipedejavu.io import exports  # noqa: E402
from pipedejavu.io.export_rules import ExportRefused  # noqa: E402
from pipedejavu.io.exports import export_plan  # noqa: E402
from pipedejavu.io.megatron_args import spec_from_megatron_args  # noqa: E402
from pipedejavu.io.megatron_moe import MoeOptions  # noqa: E402
from pipedejavu.io.model_config import load_model_spec  # noqa: E402
from pipedejavu.planning.expert_search import moe_options_of  # noqa: E402
from pipedejavu.planning.megatron_launch import (  # noqa: E402
    options_of_run,
    plan_from_megatron_run,
)
from pipedejavu.planning.plan_model import plan_model  # noqa: E402

GPU = "H100-SXM"
TINY_MOE = ROOT / "tests" / "tiny_moe.json"
MOE = MoeOptions(dispatcher="alltoall", grouped_gemm=True)
BASE = (
    "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 64 "
    "--vocab-size 1024 --bf16 --disable-bias-linear --position-embedding-type rope "
    "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
)
#: (name, flags, GPUs, GPUs per node).
HAND = [
    ("ep inside tp", "--tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 2 --num-experts 8 "
     "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1", 16, 8),
    ("shared experts, gate, first block dense, kv-channels, qk norms",
     "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 16 "
     "--moe-router-topk 4 --moe-ffn-hidden-size 128 "
     "--moe-shared-expert-intermediate-size 256 --moe-shared-expert-gate "
     "--moe-layer-freq ([0]*1+[1]*7) --kv-channels 64 --qk-layernorm "
     "--group-query-attention --num-query-groups 2 "
     "--expert-model-parallel-size 8", 16, 8),
    ("every second block, expert TP = TP", "--tensor-model-parallel-size 2 "
     "--sequence-parallel --pipeline-model-parallel-size 2 --num-experts 4 "
     "--moe-layer-freq 2 --expert-model-parallel-size 2", 16, 8),
    ("interleaved pattern, top-1, replicas outermost",
     "--tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --num-experts 4 "
     "--moe-router-topk 1 --moe-router-pre-softmax --moe-layer-freq ([0]+[1])*4 "
     "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1", 8, 8),
    ("experts over the replicas", "--num-experts 8 "
     "--expert-model-parallel-size 8 --pipeline-model-parallel-size 2", 16, 8),
    ("EP across nodes", "--tensor-model-parallel-size 4 --sequence-parallel "
     "--num-experts 16 --expert-model-parallel-size 16 "
     "--expert-tensor-parallel-size 1", 32, 4),
]  # fmt: skip
#: DeepSeek-V3's shape, small: multi-latent attention with its latent norms,
#: shared experts, the first blocks dense, multi-token prediction.
LATENT = (
    "--multi-latent-attention --q-lora-rank 96 --kv-lora-rank 64 "
    "--qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm "
    "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 64 "
    "--moe-shared-expert-intermediate-size 64 --moe-layer-freq ([0]*2+[1]*6) "
)
#: Multi-latent attention and MTP launches: (name, flags, GPUs, per node).
LATENT_HAND = [
    ("MLA, MTP 1, uneven first/last stages", LATENT + "--mtp-num-layers 1 "
     "--tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
     "--decoder-last-pipeline-num-layers 1 --expert-model-parallel-size 4 "
     "--expert-tensor-parallel-size 1", 32, 8),
    ("MLA without a query latent, MTP 2, even stages",
     LATENT.replace("--q-lora-rank 96 ", "") + "--mtp-num-layers 2 "
     "--pipeline-model-parallel-size 2 --expert-model-parallel-size 8", 16, 8),
    ("MLA, MTP 1, last stage uneven, replicas outermost", LATENT
     + "--mtp-num-layers 1 --tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 3 --decoder-last-pipeline-num-layers 2 "
     "--use-tp-pp-dp-mapping --expert-model-parallel-size 2 "
     "--expert-tensor-parallel-size 1", 12, 4),
    ("MLA, MTP 1, one stage", LATENT + "--mtp-num-layers 1 "
     "--tensor-model-parallel-size 2 --sequence-parallel "
     "--expert-model-parallel-size 4 --expert-tensor-parallel-size 2", 16, 8),
    ("MLA, MTP 1, interleaved (2 chunks a stage)", LATENT + "--mtp-num-layers 1 "
     "--tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
     "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1", 8, 8),
    ("dense MLA with MTP (no experts)", LATENT.split("--num-experts")[0]
     + "--mtp-num-layers 1 --tensor-model-parallel-size 2 --sequence-parallel "
     "--pipeline-model-parallel-size 2", 8, 8),
]  # fmt: skip
#: DeepEP, the all-to-all overlap and interleaved splits with the embedding
#: and loss counted (14 blocks: 16 units, PP 4 x VP 2 of 2): (name, flags,
#: GPUs, per node).
KERNEL_HAND = [
    ("flex (DeepEP), all-to-all overlap, interleaved with embedding and loss "
     "counted", "--num-layers 14 --num-experts 8 --expert-model-parallel-size 4 "
     "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep "
     "--moe-grouped-gemm --overlap-moe-expert-parallel-comm "
     "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
     "--account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split", 32, 8),
    ("alltoall, overlap, one stage", "--num-experts 8 "
     "--expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall "
     "--moe-grouped-gemm --overlap-moe-expert-parallel-comm", 16, 8),
    ("interleaved, embedding counted", "--num-layers 15 --num-experts 8 "
     "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--moe-grouped-gemm --pipeline-model-parallel-size 4 "
     "--num-layers-per-virtual-pipeline-stage 2 "
     "--account-for-embedding-in-pipeline-split", 8, 8),
]  # fmt: skip
#: plan --model runs: (name, plan_model's keywords).
PLANNED = [
    ("plan --model, flex with the overlap",
     {"dispatchers": ("flex",), "dispatch_overlap": (True,)}),
    ("plan --model, every expert layout", {}),
]  # fmt: skip
#: Presets on small layouts: (name, TP, PP, EP, expert TP, GPUs).
PRESETS = [
    ("Mixtral-8x7B", 2, 2, 8, 1, 32),
    ("Qwen3-30B-A3B", 4, 2, 16, 1, 64),
    ("GPT-OSS-20B", 2, 2, 8, 1, 32),  # (biased experts: expert TP 1)
    ("DeepSeek-V3", 1, 2, 8, 1, 32),  # (61 blocks: 31 + 30)
]
#: A split that only --pipeline-model-parallel-layout gives (MTP added to
#: the model read: our reader refuses MTP layers in a layout).
LAYOUT_SPLIT = (
    LATENT + "--pipeline-model-parallel-size 4 "
    "--pipeline-model-parallel-layout Et*3|t*3|t|tL --expert-model-parallel-size 2"
)


def _own_layers(flags: str) -> str:
    """BASE and ``flags``, ``flags``' ``--num-layers`` in place of BASE's."""
    base = BASE.replace("--num-layers 8 ", "") if "--num-layers" in flags else BASE
    return base + flags


def split_evenly(blocks: int, pp: int) -> tuple[int, ...]:
    """Megatron's even split (``()``), or the first stages one block more."""
    if blocks % pp == 0:
        return ()
    return tuple(blocks // pp + (s < blocks % pp) for s in range(pp))


def preset_run(name: str, tp: int, pp: int, ep: int, etp: int):
    """A Megatron-LM run of a preset: its shape with the layout's flags."""
    spec = load_model_spec(name)
    run = spec_from_megatron_args(BASE + "--num-experts 8")
    return dataclasses.replace(
        run,
        spec=spec,
        tp=tp,
        pp=pp,
        sequence_parallel=tp > 1,
        padded_vocab_size=spec.padded_vocab_size(tp),
        # (an odd block count: the first stage one block more)
        stage_layers=split_evenly(spec.num_layers, pp),
        ep=ep,
        etp=None if etp == tp else etp,
        moe_options=MOE,
        global_batch=None,
    )


def random_launches(count: int, seed: int = 44):
    """Seeded layouts Megatron-Core takes: (name, flags, GPUs, per node)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        tp, pp, dp = rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), rng.choice((1, 2, 4))
        ep, etp = rng.choice((1, 2, 4, 8)), rng.choice((1, tp))
        if not experts_fit(tp, 1, dp, ep, etp) or tp * pp * dp > 64:
            continue
        mapping = pp > 1 and etp * ep == tp and rng.random() < 0.3
        flags = (
            f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
            f"--num-experts 8 --expert-model-parallel-size {ep} "
            f"--expert-tensor-parallel-size {etp} --moe-layer-freq "
            f"{rng.choice(('1', '2', '([0]+[1]*7)', '([1]*3+[0])*2'))} "
            + ("--sequence-parallel " if tp > 1 else "")
            + ("--use-tp-pp-dp-mapping" if mapping else "")
        )
        out.append((f"random {len(out)}", flags, tp * pp * dp, rng.choice((4, 8))))
    return out


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise check_exports.Mismatch(what)


def check_experts(args, config, spec, plan, moe_options=MOE) -> None:
    """Megatron-LM read the model's experts and the plan's expert sizes."""
    moe = spec.moe
    axes = plan.layout.stages[0]
    freq = args.moe_layer_freq
    blocks = (
        [i % freq == 0 for i in range(spec.num_layers)]
        if isinstance(freq, int)
        else [bool(x) for x in freq]
    )
    wanted = list(moe.layers) if moe.layers is not None else [True] * spec.num_layers
    fields = {
        "num_experts": (args.num_experts, moe.num_experts),
        "moe_router_topk": (args.moe_router_topk, moe.topk),
        "moe_ffn_hidden_size": (args.moe_ffn_hidden_size, moe.ffn_hidden_size),
        "shared": (
            args.moe_shared_expert_intermediate_size or 0,
            moe.shared_ffn_hidden_size,
        ),
        "gate": (bool(config.moe_shared_expert_gate), moe.shared_expert_gate),
        "moe_layer_freq": (blocks, wanted),
        "kv_channels": (config.kv_channels, spec.head_dim),
        "qk_layernorm": (bool(config.qk_layernorm), bool(spec.qk_layernorm)),
        "ep": (args.expert_model_parallel_size, axes.ep),
        "etp": (args.expert_tensor_parallel_size, axes.expert_tp),
        "sequence_parallel": (args.sequence_parallel, axes.tp > 1),
        "dispatcher": (args.moe_token_dispatcher_type, moe_options.dispatcher),
        "grouped_gemm": (args.moe_grouped_gemm, moe_options.grouped_gemm),
        "overlap": (
            bool(config.overlap_moe_expert_parallel_comm),
            moe_options.overlap_dispatch,
        ),
        "force balance": (args.moe_router_force_load_balancing, False),
    }
    if moe_options.dispatcher == "flex":
        fields["flex backend"] = (
            config.moe_flex_dispatcher_backend,
            moe_options.flex_backend or "deepep",
        )
    wrong = [k for k, (got, want) in fields.items() if got != want]
    expect(not wrong, f"experts read otherwise: {wrong}")


def check_latent(args, config, spec) -> None:
    """Megatron-LM read the model's multi-latent attention (the YaRN rotary
    embedding of its MLATransformerConfig, as priced) and MTP layers."""
    mla = spec.mla
    fields = {
        "multi_latent_attention": (bool(args.multi_latent_attention), mla is not None),
        "mtp_num_layers": (args.mtp_num_layers or 0, spec.mtp_layers),
    }
    if mla is not None:
        fields |= {
            "q_lora_rank": (config.q_lora_rank or 0, mla.q_lora_rank),
            "kv_lora_rank": (config.kv_lora_rank, mla.kv_lora_rank),
            "qk_head_dim": (config.qk_head_dim, mla.qk_head_dim),
            "qk_pos_emb_head_dim": (
                config.qk_pos_emb_head_dim,
                mla.qk_pos_emb_head_dim,
            ),  # fmt: skip
            "v_head_dim": (config.v_head_dim, mla.v_head_dim),
            "latent norms": (bool(config.qk_layernorm), bool(spec.qk_layernorm)),
            "rope_type": (config.rope_type, "yarn"),
        }
    wrong = [k for k, (got, want) in fields.items() if got != want]
    expect(not wrong, f"latent attention or MTP read otherwise: {wrong}")


def check_mtp_placement(args, config, plan, spec) -> None:
    """Megatron-Core builds the MTP layers on the last pipeline stage (its
    last model chunk), where the plan prices them with the LM head: every
    rank's ``get_mtp_num_layers_to_build``, chunk by chunk."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import (
        get_mtp_num_layers_to_build,
    )

    world, chunks = plan.num_gpus, args.virtual_pipeline_model_parallel_size or 1
    last = plan.num_stages - 1
    for rank in range(world):
        with check_exports.megatron_rank(args, rank, world):
            stage = ps.get_pipeline_model_parallel_rank()
            built = [
                get_mtp_num_layers_to_build(
                    config, vp_stage=None if chunks == 1 else chunk
                )
                for chunk in range(chunks)
            ]
        wanted = [0] * chunks
        wanted[-1] = spec.mtp_layers if stage == last else 0
        expect(built == wanted, f"rank {rank} (stage {stage}) builds MTP {built}")


def check_chunks(args, config, plan, spec) -> None:
    """Interleaved: ``check_exports.check_megatron`` builds one chunk a rank;
    here each rank's chunk ``c`` builds the blocks the plan prices it with
    (``chunk_layers``: virtual stage ``c PP + r``, equal shares, or one block
    fewer in the first/last where the embedding/loss is counted), and the
    micro-batches are the plan's."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        get_transformer_layer_offset,
    )

    chunks, pp = args.virtual_pipeline_model_parallel_size, plan.num_stages
    # the plan's model chunks (the predictor's: chunk_layers), in blocks
    spans = chunk_layers(plan, chunks)
    expect(args.data_parallel_size == plan.dp, "data parallel size")
    count = check_exports.megatron_microbatches(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    expect(count == plan.num_microbatches, "micro-batches")
    for rank in range(pp):
        for chunk in range(chunks):
            start, stop = spans[rank][chunk]
            first, last = max(start, 1), min(stop, spec.num_layers + 1)
            got = (
                get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank),
                get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank),
            )
            want = (last - first, first - 1)
            expect(got == want, f"rank {rank} chunk {chunk} builds {got}, not {want}")


def check_groups(args, plan) -> int:
    """Megatron-Core's generators' groups against the plan's layout; the
    number of group kinds compared."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    world = plan.num_gpus
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, 1
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp,
                          order=order)  # fmt: skip
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                           order=order)  # fmt: skip
    pairs = [
        (dense, "tp", "tp"), (dense, "dp", "dp"), (dense, "pp", "pp"),
        (expert, "tp", "etp"), (expert, "ep", "ep"), (expert, "tp-ep", "etp-ep"),
        (expert, "dp", "edp"), (expert, "pp", "pp"),
    ]  # fmt: skip
    for generator, theirs, ours in pairs:
        got = generator.get_ranks(theirs)
        expect(got == plan.layout.groups(ours), f"{ours} groups differ")
    return len(pairs)


def check_case(name, run, gpus, per_node) -> dict:
    plan = plan_from_megatron_run(run, GPU, gpus, per_node)
    options = options_of_run(run)
    moe = run.moe_options if run.moe_options is not None else MOE
    moe = MOE if moe.dispatcher == "allgather" else moe  # (our reader's default)
    text = export_plan(
        plan, "megatron", spec=run.spec, options=options, moe=moe,
        gpus_per_node={GPU: per_node},
    )  # fmt: skip
    return check_text(name, plan, text, run.spec, options, moe)


def check_planned() -> list[dict]:
    """Plans ``plan --model`` finds for a small MoE with DeepEP and the
    all-to-all overlap, exported as the command line exports them (the
    plan's expert kernels), through the same checks."""
    out = []
    for name, kwargs in PLANNED:
        found = plan_model(str(TINY_MOE), {"H100": 32}, 64, **kwargs)
        plan, options = found.result.plan, found.result.options
        moe = moe_options_of(found.choice.data.experts)
        spec = found.choice.spec
        per_node = {GPU: 8}
        text = export_plan(
            plan, "megatron", spec=spec, options=options, moe=moe,
            gpus_per_node=per_node,
        )  # fmt: skip
        out.append(check_text(name, plan, text, spec, options, moe))
    return out


def check_text(name, plan, text, spec, options, moe_options=MOE) -> dict:
    """An export's command through Megatron-LM's code (module docstring)."""
    args, config = check_exports.megatron_args(
        shlex.split(text.splitlines()[-1]), plan.num_gpus
    )
    if spec.moe is not None:
        check_experts(args, config, spec, plan, moe_options)
    check_latent(args, config, spec)
    if args.virtual_pipeline_model_parallel_size:
        check_chunks(args, config, plan, spec)
    else:
        check_exports.check_megatron(plan, text, spec=spec, options=options)
    if spec.mtp_layers:
        check_mtp_placement(args, config, plan, spec)
    kinds = check_groups(args, plan)
    return {"case": name, "layout": plan.describe(), "group_kinds": kinds}


def check_layout_mtp() -> str:
    """A split only --pipeline-model-parallel-layout gives, with an MTP
    layer: the command the export writes (``Et*3|t*3|t|tmL``) through
    Megatron-LM's code, and what the export's read-back says of it."""
    read = spec_from_megatron_args(BASE + LAYOUT_SPLIT)
    spec = dataclasses.replace(read.spec, mtp_layers=1)
    run = dataclasses.replace(read, spec=spec, moe_options=MOE)
    plan = plan_from_megatron_run(run, GPU, 8, 8)
    options = options_of_run(run)
    try:
        export_plan(plan, "megatron", spec=spec, options=options, moe=MOE)
        said = "exported"
    except ExportRefused as error:
        said = f"the export refuses it: {error}"
    # the command the export writes, its read-back skipped
    with mock.patch.object(exports, "check_read_back", lambda *_: None):
        text = export_plan(plan, "megatron", spec=spec, options=options, moe=MOE)
    expect("Et*3|t*3|t|tmL" in text, "the layout written")
    check_text("layout with MTP", plan, text, spec, options)
    return f"Megatron-LM runs the written command as planned; {said}"


def check_bias_refusal() -> str:
    """Biased experts at expert TP 2: we refuse; Megatron-LM must too."""
    flags = (
        "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 "
        "--expert-model-parallel-size 2"
    )
    run = spec_from_megatron_args(BASE + flags)  # expert TP = TP = 2
    biased = dataclasses.replace(run.spec, linear_bias=True)
    plan = plan_from_megatron_run(dataclasses.replace(run, spec=biased), GPU, 8, 8)
    try:
        export_plan(plan, "megatron", spec=biased, options=options_of_run(run))
        return "exported"
    except ExportRefused:
        pass
    words = shlex.split(BASE.replace("--disable-bias-linear ", "") + flags)
    words += ["--data-path", "d", "--tokenizer-type", "NullTokenizer"]
    try:
        check_exports.megatron_args(words, 8)
    except (AssertionError, ValueError) as error:
        return f"refused by both: {str(error)[:80]}"
    return "Megatron-LM accepts it"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random", type=int, default=40)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/check_moe_exports.json")
    )
    ns = parser.parse_args(argv)
    # validate_args asks the GPU's compute capability for --moe-grouped-gemm
    torch.cuda.get_device_capability = lambda *_: (9, 0)
    started = time.perf_counter()
    cases = [
        (name, spec_from_megatron_args(BASE + flags), gpus, per_node)
        for name, flags, gpus, per_node in HAND
        + LATENT_HAND
        + random_launches(ns.random)
    ]
    cases += [  # (their own block counts in place of BASE's)
        (name, spec_from_megatron_args(_own_layers(flags)), gpus, per_node)
        for name, flags, gpus, per_node in KERNEL_HAND
    ]
    cases += [
        (name, preset_run(name, tp, pp, ep, etp), gpus, 8)
        for name, tp, pp, ep, etp, gpus in PRESETS
    ]
    checked, failures = [], []
    try:
        planned = check_planned()
    except (check_exports.Mismatch, check_exports.RealRejects, ExportRefused,
            AssertionError, ValueError, RuntimeError) as error:  # fmt: skip
        planned = []
        failures.append(
            {"case": "plan --model", "why": f"{type(error).__name__}: {error}"}
        )
    checked += planned
    for name, run, gpus, per_node in cases:
        try:
            checked.append(check_case(name, run, gpus, per_node))
        except (check_exports.Mismatch, check_exports.RealRejects, ExportRefused,
                AssertionError, ValueError, RuntimeError) as error:  # fmt: skip
            failures.append({"case": name, "why": f"{type(error).__name__}: {error}"})
    try:
        layout_mtp = check_layout_mtp()
    except (check_exports.Mismatch, check_exports.RealRejects, AssertionError,
            ValueError, RuntimeError) as error:  # fmt: skip
        layout_mtp = f"{type(error).__name__}: {error}"
        failures.append({"case": "layout with MTP", "why": layout_mtp})
    refusal = check_bias_refusal()
    if not refusal.startswith("refused by both"):
        failures.append({"case": "biased experts at expert TP 2", "why": refusal})
    fields = {
        "exports_checked": len(cases) + len(PLANNED),
        "as_planned": len(checked),
        "group_kinds_compared": sum(c["group_kinds"] for c in checked),
        "latent_attention_or_mtp_exports": sum(
            run.spec.mla is not None or run.spec.mtp_layers > 0
            for _, run, _, _ in cases
        ),
        "biased_experts_at_expert_tp_2": refusal,
        "layout_with_mtp": layout_mtp,
        "cases": checked,
    }
    shown = ("exports_checked", "as_planned", "group_kinds_compared",
             "latent_attention_or_mtp_exports", "biased_experts_at_expert_tp_2",
             "layout_with_mtp")  # fmt: skip
    return check_exports.write_check(ns.out, started, fields, failures, shown)


if __name__ == "__main__":
    raise SystemExit(main())
