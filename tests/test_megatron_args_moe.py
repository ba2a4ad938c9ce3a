"""Megatron-LM's mixture-of-experts, MLA, MTP and low-precision flags, read as
Megatron-LM core_v0.16.1 reads them (``megatron/training/arguments.py``,
``megatron/core/transformer/transformer_config.py``), and the one-line
refusal of a launch that ``predict``/``plan`` cannot price yet (FP4)."""

from __future__ import annotations

import json

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import MlaSpec, MoeSpec
from pipedejavu.costmodel.megatron.interleaving import chunk_layers
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.megatron_pattern import moe_layer_freq
from pipedejavu.planning.megatron_launch import (
    plan_from_megatron_run,
    predict_megatron_run,
)

#: A small dense model with Megatron's defaults (biases on, learned positions).
BASE = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 64 "
    "--vocab-size 32000 --bf16 "
)
#: The same without biases, with rotary positions (as MoE models are run).
MOE_BASE = BASE + "--disable-bias-linear --position-embedding-type rope "


def parse(flags: str):
    return spec_from_megatron_args(flags)


def test_moe_defaults_are_megatrons():
    run = parse(MOE_BASE + "--num-experts 8")
    # topk 2 (TransformerConfig), the experts as wide as --ffn-hidden-size (4h)
    assert run.spec.moe == MoeSpec(num_experts=8, topk=2, ffn_hidden_size=2048)
    assert run.spec.moe.layers is None  # --moe-layer-freq 1: every layer
    assert (run.ep, run.etp) == (1, None)  # ETP None: TP, as StageAxes says
    assert run.moe_options == MoeOptions()
    assert run.moe_options.dispatcher == "allgather"
    assert run.spec.mla is None and run.spec.mtp_layers == 0
    assert not run.spec.qk_layernorm
    assert run.fp8_recipe is None and run.fp4_recipe is None
    # the expert width follows the SwiGLU default of --ffn-hidden-size
    swiglu = parse(MOE_BASE + "--swiglu --num-experts 8")
    assert swiglu.spec.moe.ffn_hidden_size == int(4 * 512 * 2 / 3 / 64) * 64


def test_zero_experts_is_a_dense_model():
    run = parse(MOE_BASE + "--num-experts 0 --moe-router-topk 4 --moe-grouped-gemm")
    assert run.spec.moe is None and run.moe_options is None and run.spec.is_dense
    assert "--moe-router-topk 4 (no effect without --num-experts)" in run.ignored
    assert "--moe-grouped-gemm (no effect without --num-experts)" in run.ignored


@pytest.mark.parametrize(
    ("flags", "read", "expected"),
    [
        ("--moe-router-topk 4", lambda r: r.spec.moe.topk, 4),
        ("--moe-ffn-hidden-size 768", lambda r: r.spec.moe.ffn_hidden_size, 768),
        (
            "--moe-shared-expert-intermediate-size 1024",
            lambda r: r.spec.moe.shared_ffn_hidden_size,
            1024,
        ),
        (
            "--moe-shared-expert-intermediate-size 1024 --moe-shared-expert-gate",
            lambda r: r.spec.moe.shared_expert_gate,
            True,
        ),
        ("--moe-layer-freq 2", lambda r: r.spec.moe.layers, (True, False) * 4),
        (
            "--moe-layer-freq ([0]*3+[1]*5)",
            lambda r: r.spec.moe.layers,
            (False,) * 3 + (True,) * 5,
        ),
        ("--expert-model-parallel-size 4", lambda r: r.ep, 4),
        (
            "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1",
            lambda r: (r.tp, r.etp),
            (2, 1),
        ),
        ("--tensor-model-parallel-size 2", lambda r: (r.tp, r.etp), (2, None)),
        (
            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
            lambda r: r.moe_options.dispatcher,
            "alltoall",
        ),
        (
            "--moe-token-dispatcher-type flex",
            lambda r: (r.moe_options.dispatcher, r.moe_options.flex_backend),
            ("flex", "deepep"),
        ),
        (
            "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep",
            lambda r: r.moe_options.flex_backend,
            "hybridep",
        ),
        ("--moe-grouped-gemm", lambda r: r.moe_options.grouped_gemm, True),
        (
            "--moe-router-force-load-balancing",
            lambda r: r.moe_options.force_load_balancing,
            True,
        ),
        (
            "--moe-expert-capacity-factor 1.25",
            lambda r: r.moe_options.capacity_factor,
            1.25,
        ),
        # TransformerConfig: a negative capacity factor means dropless
        ("--moe-expert-capacity-factor -1", lambda r: r.moe_options, MoeOptions()),
        (
            "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity",
            lambda r: r.moe_options.pad_to_capacity,
            True,
        ),
        (
            "--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap "
            "--moe-token-dispatcher-type alltoall",
            lambda r: r.moe_options.shared_expert_overlap,
            True,
        ),
        (
            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
            "--overlap-moe-expert-parallel-comm",
            lambda r: r.moe_options.overlap_dispatch,
            True,
        ),
        ("--qk-layernorm", lambda r: r.spec.qk_layernorm, True),
        ("--mtp-num-layers 1", lambda r: r.spec.mtp_layers, 1),
        ("--mtp-num-layers 0", lambda r: r.spec.mtp_layers, 0),
        # _add_mla_args' defaults: no q-lora-rank, kv-lora-rank 32, 128/64/128
        (
            "--multi-latent-attention",
            lambda r: r.spec.mla,
            MlaSpec(0, 32, 128, 64, 128),
        ),
        (
            "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
            "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128",
            lambda r: r.spec.mla,
            MlaSpec(1536, 512, 128, 64, 128),
        ),
        (
            "--fp8-format hybrid",
            lambda r: (r.precision, r.fp8_recipe),
            ("fp8", "delayed"),
        ),
        (
            "--fp8-format e4m3 --fp8-recipe mxfp8",
            lambda r: (r.precision, r.fp8_recipe),
            ("fp8", "mxfp8"),
        ),
        (
            "--fp8-format hybrid --fp8-recipe blockwise",
            lambda r: r.fp8_recipe,
            "blockwise",
        ),
        (
            "--fp4-format e2m1",
            lambda r: (r.precision, r.fp4_recipe),
            ("bf16", "nvfp4"),
        ),
    ],
)
def test_each_flag_is_read(flags, read, expected):
    run = parse(MOE_BASE + "--num-experts 8 " + flags)
    assert read(run) == expected


def test_flags_read_only_with_another_are_listed_as_ignored():
    run = parse(
        MOE_BASE + "--num-experts 8 --kv-lora-rank 64 --moe-shared-expert-gate "
        "--fp4-recipe nvfp4 --moe-router-load-balancing-type seq_aux_loss"
    )
    assert run.spec.mla is None and not run.spec.moe.shared_expert_gate
    assert run.ignored == (
        "--fp4-recipe nvfp4 (no effect without --fp4-format)",
        "--moe-router-load-balancing-type seq_aux_loss (no effect on the prediction)",
        "--moe-shared-expert-gate (no effect without "
        "--moe-shared-expert-intermediate-size)",
        "--kv-lora-rank 64 (no effect without --multi-latent-attention)",
    )


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        # validate_args: "num_experts must be non None to use expert model
        # parallelism", "Number of experts should be a multiple of expert
        # model parallel_size."
        ("--expert-model-parallel-size 2", "needs --num-experts"),
        ("--num-experts 6 --expert-model-parallel-size 4", "not a multiple"),
        # TransformerConfig: "moe_ffn_hidden_size must be None when num_experts
        # is not set."
        ("--moe-ffn-hidden-size 128", "--moe-ffn-hidden-size needs --num-experts"),
        # TransformerConfig: "num_moe_experts must be non-negative."
        ("--num-experts -2", ">= 0"),
        # TransformerConfig: "moe_shared_expert_overlap only works with alltoall
        # token dispatcher."
        (
            "--num-experts 8 --moe-shared-expert-intermediate-size 512 "
            "--moe-shared-expert-overlap",
            "only with --moe-token-dispatcher-type alltoall",
        ),
        # TransformerConfig: "moe_expert_capacity_factor must be set to use
        # moe_pad_expert_input_to_capacity"
        (
            "--num-experts 8 --moe-pad-expert-input-to-capacity",
            "needs --moe-expert-capacity-factor",
        ),
        # TransformerConfig: capacity only with aux_loss/seq/global/none
        (
            "--num-experts 8 --moe-expert-capacity-factor 1 "
            "--moe-router-load-balancing-type sinkhorn",
            "works only with the aux_loss",
        ),
        # TransformerConfig: "Please use --moe-router-pre-softmax when topk is 1."
        ("--num-experts 8 --moe-router-topk 1", "needs --moe-router-pre-softmax"),
        # TransformerConfig: flex with the deepep backend cannot pad
        (
            "--num-experts 8 --moe-token-dispatcher-type flex "
            "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity",
            "deepep backend does not support",
        ),
        # TransformerConfig: "DeepEP backend is only supported with flex token
        # dispatcher."
        ("--num-experts 8 --moe-enable-deepep", "needs --moe-token-dispatcher-type"),
        # TEGroupedLinear: divide(moe_ffn_hidden_size, expert TP)
        (
            "--num-experts 8 --disable-bias-linear --moe-ffn-hidden-size 100 "
            "--expert-tensor-parallel-size 8",
            "must divide the experts' width 100",
        ),
        # the shared experts' MLP is split over TP (divide)
        (
            "--num-experts 8 --disable-bias-linear --tensor-model-parallel-size 8 "
            "--moe-shared-expert-intermediate-size 100",
            "must divide --moe-shared-expert-intermediate-size 100",
        ),
        ("--num-experts 4 --moe-router-topk 8", "more than --num-experts 4"),
        # get_gpt_decoder_layer_specs: the pattern's length is --num-layers
        ("--num-experts 8 --moe-layer-freq [1]*4", "names 4 layers"),
        ("--num-experts 8 --moe-layer-freq [0]*8", "makes no layer an expert"),
        # TransformerConfig's --overlap-moe-expert-parallel-comm checks
        (
            "--num-experts 8 --overlap-moe-expert-parallel-comm",
            "needs --expert-model-parallel-size > 1",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 2 "
            "--overlap-moe-expert-parallel-comm",
            "alltoall or flex",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-"
            "type alltoall --overlap-moe-expert-parallel-comm "
            "--pipeline-model-parallel-size 2",
            "virtual pipeline stages",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-"
            "type alltoall --overlap-moe-expert-parallel-comm "
            "--recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1",
            "no full recomputation",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-"
            "type alltoall --overlap-moe-expert-parallel-comm --mtp-num-layers 2",
            "at most one MTP layer",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-"
            "type alltoall --overlap-moe-expert-parallel-comm "
            "--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap",
            "no --moe-shared-expert-overlap",
        ),
        # validate_args: "Group query attention is mutually exclusive with multi
        # latent attention."
        (
            "--multi-latent-attention --group-query-attention --num-query-groups 2",
            "exclusive",
        ),
        # validate_args: MTP needs rope or no position embedding
        (
            "--mtp-num-layers 1 --position-embedding-type learned_absolute",
            "rope or none, not learned_absolute",
        ),
        # validate_args: "--fp4-format and --fp8-format cannot be used
        # simultaneously."
        ("--fp4-format e2m1 --fp8-format hybrid", "are exclusive"),
        # a recipe needing a quantizer factory is not priced
        ("--fp8-format hybrid --fp8-recipe custom", "not supported"),
        ("--moe-token-dispatcher-type alltoall_seq", "not supported"),
        ("--moe-expert-capacity-factor nan", "finite number"),
        ("--moe-router-load-balancing-type", "needs a value"),
    ],
)
def test_contradictions_are_refused_where_megatron_refuses_them(flags, match):
    with pytest.raises(ProblemError, match=match) as caught:
        parse(MOE_BASE + flags)
    assert "\n" not in str(caught.value)


def test_experts_with_biases_need_expert_tp_1():
    # TransformerConfig: "Bias in Moe is only supported when ETP==1" (Megatron
    # adds linear biases unless --disable-bias-linear)
    with pytest.raises(ProblemError, match="--expert-tensor-parallel-size 1, not 2"):
        parse(BASE + "--num-experts 8 --tensor-model-parallel-size 2")
    run = parse(
        BASE + "--num-experts 8 --tensor-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1"
    )
    assert (run.tp, run.etp, run.spec.linear_bias) == (2, 1, True)


def test_overlap_checks_pass_when_megatron_passes():
    run = parse(
        MOE_BASE + "--num-experts 8 --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--mtp-num-layers 1"
    )
    assert run.moe_options.overlap_dispatch and run.virtual_chunks == 2


def test_layout_checks_the_world_as_megatron_core_does():
    run = parse(
        MOE_BASE + "--num-experts 16 --tensor-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1 --expert-model-parallel-size 8 "
        "--pipeline-model-parallel-size 2"
    )
    sizes = run.layout(64).sizes(0)
    assert sizes == {"tp": 2, "cp": 1, "dp": 16, "etp": 1, "ep": 8, "edp": 4, "pp": 2}
    # initialize_model_parallel: world % (ETP x EP x PP) must be 0
    with pytest.raises(ProblemError, match="not whole groups of etp 1 x ep 8"):
        run.layout(4 * 2 * 3)
    with pytest.raises(ProblemError, match="not whole groups of TP x CP x PP"):
        run.layout(7)
    # replicas outermost with several stages: ETP x EP must be TP x CP
    mapped = MOE_BASE + "--use-tp-pp-dp-mapping --pipeline-model-parallel-size 2 "
    with pytest.raises(ProblemError, match="EP 4, ETP 1 and 2 pipeline stages"):
        parse(mapped + "--num-experts 8 --expert-model-parallel-size 4")
    ok = parse(
        mapped + "--num-experts 8 --expert-model-parallel-size 2 "
        "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1"
    )
    assert ok.layout(8).edp(0) == ok.layout(8).dp == 2


@pytest.mark.parametrize(
    ("text", "num_layers"),
    [
        # moe_freq_type's documented examples
        ("([1]*3+[0]*1)*3", 12),
        ("([0]+[1]*23)", 24),
        ("([1]*3+[0]*2)*2", 10),
        ("([0]*3+[1]*58)", 61),  # DeepSeek-V3's first three dense layers
        ("[1,0,1,0]", 4),
        ("[1,1,]", 2),
        ("2*[0,1]+[1]*(1+1)", 6),
    ],
)
def test_layer_freq_lists_equal_megatrons_eval(text, num_layers):
    # Megatron-LM's moe_freq_type evaluates the string with Python: the reference
    expected = tuple(entry == 1 for entry in eval(text))  # noqa: S307
    assert moe_layer_freq(text, num_layers) == expected


@pytest.mark.parametrize(("freq", "num_layers"), [(1, 5), (2, 7), (3, 9), (12, 5)])
def test_layer_freq_integer_is_every_nth_layer(freq, num_layers):
    # get_gpt_decoder_layer_specs: layer i is an expert layer when i % N == 0
    expected = tuple(i % freq == 0 for i in range(num_layers))
    assert moe_layer_freq(str(freq), num_layers) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[1, 0]", "' ' is not allowed"),  # Megatron's _eval_pattern refuses it
        ("[1]**2", "'\\*\\*' is not read"),
        ("[1,0][0]", "subscripts"),
        ("([1],[0])", "a tuple"),
        ("[[1],[0]]", "a list inside the list"),
        ("[1]+1", "adds a list and an integer"),
        ("[1]*[2]", "multiplies two lists"),
        ("[01,1]", "not a Python integer"),
        ("[1,2]", "each entry must be 0"),
        ("[1]*100000000", "too large"),
        ("[1]*60000*2", "more than 65,536"),
        ("(" * 100 + "[1,1]" + ")" * 100, "deeper than"),
        ("[1,1", "ends too early"),
        ("0", "positive"),
        ("two", "expected a positive integer"),
    ],
)
def test_layer_freq_refusals_are_one_line(text, match):
    with pytest.raises(ProblemError, match=match) as caught:
        moe_layer_freq(text, 2)
    assert "\n" not in str(caught.value)


# --- The published MoE runs of ../shared/data/published/moe_h100.json,
# written by hand as Megatron-LM flags from their model and parallelism fields.
QWEN3_30B = (
    "--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
    "--num-attention-heads 32 --group-query-attention --num-query-groups 4 "
    "--kv-channels 128 --num-experts 128 --moe-router-topk 8 "
    "--moe-ffn-hidden-size 768 --qk-layernorm --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --seq-length 4096 --vocab-size 151936 "
    "--micro-batch-size 1 --global-batch-size 1024 --bf16 "
    "--use-distributed-optimizer --moe-router-force-load-balancing "
    "--moe-grouped-gemm "
)
QWEN3_235B = (
    "--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 "
    "--num-attention-heads 64 --group-query-attention --num-query-groups 4 "
    "--kv-channels 128 --num-experts 128 --moe-router-topk 8 "
    "--moe-ffn-hidden-size 1536 --qk-layernorm --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --seq-length 4096 --vocab-size 151936 "
    "--global-batch-size 2048 --bf16 --use-distributed-optimizer "
    "--sequence-parallel --expert-tensor-parallel-size 1 "
)
# GPT-OSS-120B: heads 64 x 64 wide on h = 2880, biases on (ETP 1), a gated MLP;
# its YaRN rotary embedding is written as rope (the shapes are the same).
GPT_OSS_120B = (
    "--num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 "
    "--num-attention-heads 64 --group-query-attention --num-query-groups 8 "
    "--kv-channels 64 --num-experts 128 --moe-router-topk 4 "
    "--moe-ffn-hidden-size 2880 --swiglu --normalization RMSNorm "
    "--untie-embeddings-and-output-weights --position-embedding-type rope "
    "--seq-length 4096 --vocab-size 201088 --micro-batch-size 1 "
    "--global-batch-size 1280 --bf16 --use-distributed-optimizer "
    "--recompute-granularity selective "
)
PUBLISHED = [
    # (id, flags, GPUs, (tp, pp, V, ep, etp), (dp, edp))
    (
        "mbridge_26.06_Qwen3_30B_a3B_H100_FP8_16gpu_gbs1024",
        QWEN3_30B + "--fp8-format hybrid --fp8-recipe tensorwise "
        "--expert-model-parallel-size 16 --expert-tensor-parallel-size 1 "
        "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep",
        16,
        (1, 1, 1, 16, 1),
        (16, 1),
    ),
    (
        "mbridge_26.02_Qwen3_30B_a3B_H100_FP8_16gpu_gbs1024",
        QWEN3_30B + "--fp8-format hybrid --fp8-recipe tensorwise "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 12 "
        "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
        "--moe-token-dispatcher-type flex --overlap-moe-expert-parallel-comm",
        16,
        (1, 2, 12, 8, 1),
        (8, 1),
    ),
    (
        "mbridge_26.04.01_GPTOSS120B_H100_BF16_64gpu_gbs1280",
        GPT_OSS_120B + "--pipeline-model-parallel-size 4 "
        "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
        "--moe-token-dispatcher-type alltoall",
        64,
        (1, 4, 1, 8, 1),
        (16, 2),
    ),
    (
        "modelzoo_qwen3_235b_h100_intra_node_ep8_fsdp",
        QWEN3_235B + "--tensor-model-parallel-size 2 --expert-model-parallel-size 8 "
        "--micro-batch-size 4 --moe-token-dispatcher-type flex",
        256,
        (2, 1, 1, 8, 1),
        (128, 32),
    ),
]


@pytest.mark.parametrize(
    ("flags", "num_gpus", "sizes", "data_parallel"),
    [case[1:] for case in PUBLISHED],
    ids=[case[0] for case in PUBLISHED],
)
def test_published_moe_runs_give_their_fields(flags, num_gpus, sizes, data_parallel):
    run = parse(flags)
    spec, moe = run.spec, run.spec.moe
    layers = {"Qwen3": (48, 94), "GPT": (36,)}
    assert spec.num_layers in (*layers["Qwen3"], *layers["GPT"])
    assert moe.num_experts == 128 and moe.layers is None
    assert spec.head_dim in (128, 64) and spec.kv_channels == spec.head_dim
    expected = {48: (8, 768), 94: (8, 1536), 36: (4, 2880)}[spec.num_layers]
    assert (moe.topk, moe.ffn_hidden_size) == expected
    assert spec.qk_layernorm == (spec.num_layers != 36)
    etp = run.etp or run.tp
    assert (run.tp, run.pp, run.virtual_chunks, run.ep, etp) == sizes
    layout = run.layout(num_gpus)
    assert (layout.dp, layout.edp(0)) == data_parallel
    assert layout.num_gpus == num_gpus


def test_published_fp8_run_reads_its_recipe():
    run = parse(PUBLISHED[0][1])
    assert (run.precision, run.fp8_recipe, run.params_dtype) == (
        "fp8",
        "tensorwise",
        "bf16",
    )
    assert run.moe_options == MoeOptions(
        dispatcher="flex",
        flex_backend="hybridep",
        grouped_gemm=True,
        force_load_balancing=True,
    )


def test_published_interleaved_split_with_embedding_and_loss():
    # Qwen3-235B at PP 8 x VP 4 counts the embedding and the loss as layers
    # (94 + 2 = 96, 3 a virtual stage): the first and last stages hold one
    # block fewer, and their first (last) chunk the embedding (loss) instead
    flags = (
        QWEN3_235B + "--micro-batch-size 1 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 4 "
        "--account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split --expert-model-parallel-size 32 "
        "--sequence-parallel"
    )
    run = parse(flags)
    assert run.virtual_chunks == 4
    assert run.stage_layers == (11, 12, 12, 12, 12, 12, 12, 11)
    plan = plan_from_megatron_run(run, "H100-SXM", 256, 8)
    chunks = chunk_layers(plan, 4)
    # every virtual stage 3 profile layers: the embedding and 2 blocks first
    assert chunks[0][0] == (0, 3) and chunks[1][0] == (3, 6)
    assert chunks[7][3] == (93, 96) and plan.num_layers == 96
    assert all(b - a == 3 for row in chunks for a, b in row)


def test_moe_launch_is_predicted_and_says_how_experts_are_priced(capsys):
    flags = PUBLISHED[0][1]
    assert main(["predict", "--megatron-args", flags, "--gpus", "H100-SXM:16"]) == 0
    out = capsys.readouterr().out
    assert "ep 16" in out.splitlines()[0]  # the plan line names the layout
    assert (
        "experts: EP 16 x expert TP 1, expert DP 1; flex dispatcher; routing "
        "priced balanced" in out
    )
    assert (
        main(["predict", "--megatron-args", flags, "--gpus", "H100-SXM:16", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["experts"]["routing"] == "balanced" and data["experts"]["edp"] == 1
    # Megatron Core's check of the world size comes first
    assert main(["predict", "--megatron-args", flags, "--gpus", "H100-SXM:24"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not whole groups of etp 1 x ep 16" in err[0], err


def test_fp4_launches_are_refused_in_one_line():
    sheet = load_gpu_sheet()
    mla = parse(MOE_BASE + "--multi-latent-attention --mtp-num-layers 1")
    # priced since MLA and MTP are (tests/test_mla_mtp.py)
    assert predict_megatron_run(mla, "H100-SXM", 8, sheet).prediction.fits_memory
    dense_fp4 = parse(MOE_BASE + "--fp4-format e2m1")
    without = [name for name, entry in sheet.items() if "fp4" not in entry.precisions]
    with pytest.raises(ProblemError, match="needs a GPU with FP4"):
        predict_megatron_run(dense_fp4, without[0], 8, sheet)
    with_fp4 = [name for name, entry in sheet.items() if "fp4" in entry.precisions]
    for gpu in with_fp4[:1]:  # (Blackwell, where the sheet records FP4)
        with pytest.raises(ProblemError, match="FP4 training .* not available yet"):
            predict_megatron_run(dense_fp4, gpu, 8, sheet)
    dense = parse(MOE_BASE)
    assert predict_megatron_run(dense, "H100-SXM", 8, sheet).prediction.fits_memory


def test_kv_channels_are_read_and_priced_as_wider_heads():
    # validate_args: --kv-channels defaults to h / a, which needs a to divide h
    assert parse(BASE + "--kv-channels 64").spec.kv_channels is None
    wide = parse(BASE + "--kv-channels 128")
    assert (wide.spec.kv_channels, wide.spec.head_dim) == (128, 128)
    with pytest.raises(ProblemError, match="give --kv-channels"):
        parse(BASE.replace("--num-attention-heads 8", "--num-attention-heads 7"))
    sheet = load_gpu_sheet()
    narrow = predict_megatron_run(parse(BASE), "H100-SXM", 8, sheet)
    wider = predict_megatron_run(wide, "H100-SXM", 8, sheet)
    # heads of 128 on a width of 512: QKV, attention and its output twice as wide
    assert wider.prediction.iteration_time_s > narrow.prediction.iteration_time_s
    assert wider.model_flops_per_iteration > narrow.model_flops_per_iteration
