"""Model descriptions: parameter counts, FLOPs, Hugging Face configs, Megatron
command lines and the bundled presets."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.megatron.sailor_data import bundled_sailor_dir
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import (
    MAX_MODEL_FILE_BYTES,
    list_model_presets,
    load_model_spec,
    spec_from_dict,
    spec_from_hf_config,
)

# ---------------------------------------------------------------- Sailor sizes

# Sailor's llm_info.json counts the tied word embedding again in the last layer
# of its OPT models (a last pipeline stage's copy), not in GPT-Neo or LLaMA.
SAILOR_TIED_COPY = {
    "OPT-350": True,
    "OPT-30": True,
    "GPT-Neo-2.7": False,
    "LLAMA-3-8": False,
}


def _llm_info():
    with open(bundled_sailor_dir() / "llm_info.json") as handle:
        return json.load(handle)


@pytest.mark.parametrize("model", sorted(SAILOR_TIED_COPY))
def test_layer_params_match_sailor_llm_info_at_every_tp(model):
    spec = load_model_spec(model)
    info = _llm_info()[model]
    for tp, layers in info.items():
        expected = [layers[str(i)]["params_floats"] for i in range(len(layers))]
        got = list(spec.layer_params(int(tp), tied_copy=SAILOR_TIED_COPY[model]))
        assert len(got) == spec.num_profile_layers == len(expected)
        if model == "LLAMA-3-8":
            # llm_info gives its (tied) LM-head layer h = 4096 parameters; 0 here.
            assert expected[-1] - got[-1] == spec.hidden_size
            expected, got = expected[:-1], got[:-1]
        assert got == expected, f"{model} tp {tp}"


@pytest.mark.parametrize("model", sorted(SAILOR_TIED_COPY))
def test_sailor_presets_match_profile_sequence_length(model):
    spec = load_model_spec(model)
    layers = _llm_info()[model]["1"]
    # A block's output is seq x hidden floats at micro-batch 1.
    assert layers["1"]["act_output_floats"] == spec.seq_length * spec.hidden_size


# ----------------------------------------------------------- published totals


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("Llama-3-8B", 8.03e9),
        ("Llama-3-70B", 70.6e9),
        ("Llama-3.1-405B", 405.9e9),
        ("GPT-3-175B", 174.6e9),
        ("Mistral-7B", 7.24e9),
        ("Qwen2.5-7B", 7.62e9),
        ("Qwen2.5-72B", 72.7e9),
    ],
)
def test_preset_totals_match_published_counts(name, published):
    np.testing.assert_allclose(load_model_spec(name).num_params, published, rtol=5e-3)


def test_llama3_8b_counts_exactly():
    spec = load_model_spec("llama-3-8b")  # case-insensitive
    h, f, v = 4096, 14336, 128256
    block = 2 * h * h + 2 * h * 1024 + 3 * h * f + 2 * h
    assert spec.num_params == 2 * v * h + 32 * block + h == 8_030_261_248


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_sum_to_the_whole_plus_replicas(tp):
    spec = load_model_spec("Llama-3-70B")
    per_gpu = spec.block_params(tp)
    norms = 2 * spec.hidden_size
    assert (per_gpu - norms) * tp + norms == spec.block_params(1)


def test_gqa_with_more_tp_than_kv_heads_replicates_them():
    spec = load_model_spec("Llama-3-70B")  # 8 key/value heads of 128
    h, f = 8192, 28672
    qkv = h * (h // 16 + 2 * 128)  # one key/value head per GPU at TP 16
    assert spec.block_params(16) == qkv + h * h // 16 + 3 * h * f // 16 + 2 * h
    with pytest.raises(ValueError, match="num_query_groups"):
        TransformerSpec("m", 2, 96, 12, 4, 384, 100, 16, position="none").check_tp(6)


# --------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    ("layers", "hidden", "heads", "batch"),
    [(24, 2304, 24, 512), (40, 6144, 48, 1024), (105, 20480, 128, 2520)],
)
@pytest.mark.parametrize("recompute", [True, False])
def test_flops_reproduce_megatron_sc21_equation(
    layers, hidden, heads, batch, recompute
):
    s, v = 2048, 51200
    spec = TransformerSpec(
        "gpt", layers, hidden, heads, heads, 4 * hidden, v, s, max_position_embeddings=s
    )
    if recompute:
        expected = (
            96
            * batch
            * s
            * layers
            * hidden**2
            * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
        )
    else:
        expected = (
            72
            * batch
            * s
            * layers
            * hidden**2
            * (1 + s / (6 * hidden) + v / (12 * layers * hidden))
        )
    np.testing.assert_allclose(
        spec.hardware_flops_per_iteration(batch, None if recompute else 0),
        expected,
        rtol=1e-12,
    )
    # the model FLOPs (MFU's numerator) never count the recomputed forward
    np.testing.assert_allclose(
        spec.model_flops_per_iteration(batch),
        spec.hardware_flops_per_iteration(batch, 0),
        rtol=0,
    )


def test_flops_count_the_blocks_recomputed():
    # the block method reruns some blocks: their forward counts once more
    spec = load_model_spec("Llama-3-8B")
    none, full = (spec.hardware_flops_per_iteration(8, r) for r in (0, None))
    some = spec.hardware_flops_per_iteration(8, 8)
    np.testing.assert_allclose(some - none, (full - none) * 8 / 32, rtol=1e-12)
    assert spec.hardware_flops_per_iteration(8, 32) == full
    assert spec.model_flops_per_iteration(8) == none < some < full
    with pytest.raises(ValueError, match="recomputed_blocks must be an integer"):
        spec.hardware_flops_per_iteration(8, 33)


def test_flops_of_gqa_swiglu_count_every_gemm():
    spec = load_model_spec("Llama-3-8B")
    h, f, s, v, kv = 4096, 14336, 8192, 128256, 1024
    per_token = 32 * (2 * h * (h + 2 * kv) + 2 * h * h + 6 * h * f + 4 * s * h)
    np.testing.assert_allclose(
        spec.model_flops_per_iteration(8),
        8 * s * (3 * per_token + 3 * 2 * h * v),
        rtol=1e-12,
    )


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": 1002}, "divide hidden_size"),
        ({"num_query_groups": 3}, "divide num_attention_heads"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"gated_mlp": 1}, "gated_mlp must be true or false"),
        ({"norm": "batchnorm"}, "norm must be one of"),
        ({"max_position_embeddings": 1024}, "max_position_embeddings"),
        ({"name": ""}, "name"),
    ],
)
def test_spec_refuses_bad_fields(change, match):
    fields = dict(
        name="m",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=256,
        vocab_size=100,
        seq_length=2048,
        max_position_embeddings=2048,
    )
    fields.update(change)
    with pytest.raises(ValueError, match=match):
        TransformerSpec(**fields)


def test_layer_params_refuse_a_tp_that_does_not_split():
    with pytest.raises(ValueError, match="tp 5 must divide num_attention_heads"):
        load_model_spec("GPT-3-175B").layer_params(5)


# ------------------------------------------------------- Hugging Face configs

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
}
OPT_CONFIG = {
    "model_type": "opt",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_dim": 256,
    "vocab_size": 500,
    "max_position_embeddings": 128,
    "word_embed_proj_dim": 64,
}


def test_hf_llama_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    spec = spec_from_hf_config(path, name="tiny", seq_length=128)
    assert (spec.num_query_groups, spec.norm, spec.position) == (2, "rmsnorm", "rotary")
    assert spec.gated_mlp and not spec.tied_embeddings and not spec.linear_bias
    assert spec.seq_length == 128
    h, f, kv = 64, 160, 2 * 8
    assert (
        spec.num_params
        == 2 * 1000 * h + 2 * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h
    )


def test_hf_qwen2_has_qkv_bias_only():
    spec = spec_from_hf_config({**LLAMA_CONFIG, "model_type": "qwen2"})
    assert spec.qkv_bias and not spec.linear_bias
    plain = spec_from_hf_config(LLAMA_CONFIG)
    assert spec.num_params - plain.num_params == 2 * (64 + 2 * 16)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_embd": 64,
                "n_head": 4,
                "n_positions": 128,
                "vocab_size": 500,
            },
            dict(
                ffn_hidden_size=256,
                position="learned",
                max_position_embeddings=128,
                tied_embeddings=True,
                linear_bias=True,
            ),
        ),
        (
            OPT_CONFIG,
            dict(ffn_hidden_size=256, tied_embeddings=True),
        ),
        (
            {
                "model_type": "gpt_neo",
                "num_layers": 2,
                "hidden_size": 64,
                "num_heads": 4,
                "intermediate_size": None,
                "vocab_size": 500,
                "max_position_embeddings": 128,
            },
            dict(ffn_hidden_size=256, position="learned"),
        ),
        (
            {
                "model_type": "gpt_neox",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 256,
                "vocab_size": 500,
                "max_position_embeddings": 128,
            },
            dict(position="rotary", tied_embeddings=False, norm="layernorm"),
        ),
    ],
)
def test_hf_gpt_family_configs(config, expected):
    spec = spec_from_hf_config(config)
    for key, value in expected.items():
        assert getattr(spec, key) == value, key


def test_hf_gpt2_matches_published_124m():
    config = {
        "model_type": "gpt2",
        "n_layer": 12,
        "n_embd": 768,
        "n_head": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    assert spec_from_hf_config(config).num_params == 124_439_808


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**LLAMA_CONFIG, "num_local_experts": 8}, "mixture-of-experts"),
        (  # read as a mixture of experts (tests/test_model_config_moe.py)
            {**LLAMA_CONFIG, "model_type": "qwen2_moe", "num_experts": 60},
            "missing key 'num_experts_per_tok'",
        ),
        ({**LLAMA_CONFIG, "n_routed_experts": 64}, "mixture-of-experts"),
        ({**LLAMA_CONFIG, "moe_intermediate_size": 1408}, "mixture-of-experts"),
        (
            {k: v for k, v in LLAMA_CONFIG.items() if k != "intermediate_size"},
            "missing key 'intermediate_size'",
        ),
        ({**LLAMA_CONFIG, "hidden_size": "64"}, "hidden_size must be a positive"),
        ({**LLAMA_CONFIG, "model_type": "t5"}, "model_type 't5' is not supported"),
        (
            {**OPT_CONFIG, "word_embed_proj_dim": 32},
            "word_embed_proj_dim",
        ),
        ({**LLAMA_CONFIG, "num_key_value_heads": 3}, "num_query_groups"),
    ],
)
def test_hf_config_refusals(tmp_path, config, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ProblemError, match=match) as caught:
        spec_from_hf_config(path)
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"\xff\xfe\x00binary", "not UTF-8"),
        (b" " * (MAX_MODEL_FILE_BYTES + 1), "larger than"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_hostile_model_files_give_one_line_naming_the_file(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    for read in (spec_from_hf_config, load_model_spec):
        with pytest.raises(ProblemError, match=match) as caught:
            read(path)
        assert str(path) in str(caught.value)
        assert "\n" not in str(caught.value)


# ------------------------------------------------------------ presets, files


def test_presets_list_names_and_sources():
    presets = list_model_presets()
    for name in (
        "GPT-3-175B",
        "Llama-3-8B",
        "Llama-3-70B",
        "Llama-3.1-405B",
        "Qwen2.5-7B",
        "Qwen2.5-72B",
        "Mistral-7B",
        "OPT-350",
        "GPT-Neo-2.7",
        "LLAMA-3-8",
        "OPT-30",
    ):
        assert presets[name], name


def test_own_format_round_trip_and_refusals(tmp_path):
    spec = load_model_spec("Mistral-7B")
    data = {**dataclasses.asdict(spec), "source": "test"}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    assert load_model_spec(path) == spec
    assert load_model_spec(path, seq_length=4096).seq_length == 4096
    with pytest.raises(ProblemError, match="unknown key 'hiden_size'"):
        spec_from_dict({**data, "hiden_size": 1})
    with pytest.raises(ProblemError, match="missing key 'vocab_size'"):
        spec_from_dict({k: v for k, v in data.items() if k != "vocab_size"})
    with pytest.raises(ProblemError, match="unknown model 'nope'"):
        load_model_spec("nope")


# ------------------------------------------------------- Megatron arguments

# Megatron-LM SC'21 Table 1 (Narayanan et al., arXiv:2104.04473), launch flags
# of examples/academic_paper_scripts/sc21/run_table_1.sh: (layers, hidden,
# heads, tp, pp, layers per virtual stage, mbs, gbs) and the published params.
SC21 = [
    ("1.7B", 24, 2304, 24, 1, 1, None, 16, 512, 1.7),
    ("18B", 40, 6144, 48, 8, 1, None, 8, 1024, 18.4),
    ("76B", 60, 10240, 80, 8, 4, 5, 2, 1792, 76.1),
    ("145B", 80, 12288, 96, 8, 8, 5, 2, 2304, 145.6),
    ("530B", 105, 20480, 128, 8, 35, 1, 1, 2520, 529.6),
    ("1T", 128, 25600, 160, 8, 64, None, 1, 3072, 1008.0),
]


def _sc21_argv(layers, hidden, heads, tp, pp, per_virtual, mbs, gbs):
    argv = (
        f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
        f"--micro-batch-size {mbs} --global-batch-size {gbs} --num-layers {layers} "
        f"--hidden-size {hidden} --num-attention-heads {heads} --DDP-impl local "
        "--data-path /data/x --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
        "--log-interval 5 --seq-length 2048 --max-position-embeddings 2048 "
        "--train-iters 500 --lr 0.0001 --clip-grad 1.0 --fp16 --loss-scale 8192 "
        "--activations-checkpoint-method uniform"
    )
    if per_virtual:
        argv += f" --num-layers-per-virtual-pipeline-stage {per_virtual}"
    return argv


@pytest.mark.parametrize("row", SC21, ids=[row[0] for row in SC21])
def test_megatron_sc21_runs(row):
    _, layers, hidden, heads, tp, pp, per_virtual, mbs, gbs, billions = row
    run = spec_from_megatron_args(
        _sc21_argv(layers, hidden, heads, tp, pp, per_virtual, mbs, gbs)
    )
    assert (run.tp, run.pp, run.micro_batch, run.global_batch) == (tp, pp, mbs, gbs)
    assert run.virtual_chunks == (layers // pp // per_virtual if per_virtual else 1)
    assert run.recompute_full and run.recompute_num_layers == 1
    assert run.precision == "fp16" and not run.sequence_parallel
    assert run.spec.ffn_hidden_size == 4 * hidden
    assert "--DDP-impl local" in run.ignored and "--lr 0.0001" in run.ignored
    if tp == 8:
        assert run.padded_vocab_size == 51200
    # The paper's count, P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) with
    # V = 51,200, differs from ours only by the vocabulary's padding at TP 1.
    h, num_layers = hidden, layers
    paper = (
        12
        * num_layers
        * h**2
        * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * num_layers * h))
    )
    np.testing.assert_allclose(run.spec.num_params, paper, rtol=2e-3)
    # Published to one decimal (1.65e9 printed as 1.7); 76B's 76.04 as 76.1.
    assert abs(run.spec.num_params / 1e9 - billions) < 0.06
    s, v = 2048, run.padded_vocab_size
    eq3 = (
        96
        * gbs
        * s
        * layers
        * hidden**2
        * (1 + s / (6 * hidden) + v / (16 * layers * hidden))
    )
    np.testing.assert_allclose(
        run.spec.hardware_flops_per_iteration(
            gbs, None if run.recompute_full else 0, run.tp
        ),
        eq3,
        rtol=1e-12,
    )


def test_megatron_llama_style_flags_and_list_argv():
    argv = [
        "--num-layers=32",
        "--hidden-size=4096",
        "--num-attention-heads=32",
        "--group-query-attention",
        "--num-query-groups=8",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--seq-length",
        "8192",
        "--max-position-embeddings",
        "8192",
        "--vocab-size",
        "128256",
        "--make-vocab-size-divisible-by",
        "128",
        "--tensor-model-parallel-size",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "4",
        "--sequence-parallel",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1024",
        "--bf16",
        "--fp8-format",
        "hybrid",
        "--use-distributed-optimizer",
        "--recompute-granularity",
        "selective",
    ]
    run = spec_from_megatron_args(argv, name="llama")
    spec = run.spec
    assert spec.ffn_hidden_size == int((4 * 4096 * 2 / 3) / 64) * 64 == 10880
    assert (spec.num_query_groups, spec.norm, spec.position) == (8, "rmsnorm", "rotary")
    assert not spec.linear_bias and not spec.tied_embeddings and spec.gated_mlp
    assert run.padded_vocab_size == 128512 and run.virtual_chunks == 4
    assert run.precision == "fp8" and run.params_dtype == "bf16"
    assert run.use_distributed_optimizer and run.sequence_parallel
    assert run.recompute_granularity == "selective" and not run.recompute_full
    explicit = spec_from_megatron_args(argv + ["--ffn-hidden-size", "14336"])
    # 128,256 is a multiple of 128: at TP 1 this is Llama-3-8B exactly; at TP 4
    # Megatron pads the two vocabulary matrices to 128,512 rows.
    llama = load_model_spec("Llama-3-8B")
    assert explicit.spec.num_params == llama.num_params
    padding = (128512 - 128256) // 4 * 4096
    assert explicit.spec.layer_params(4)[0] == llama.layer_params(4)[0] + padding


BASE = (
    "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 "
    "--vocab-size 50257 "
)


def test_sequence_parallel_at_tp_1_is_turned_off_as_megatron_does():
    """Megatron-LM's validate_args turns --sequence-parallel off at TP 1
    (NVIDIA's Llama-3-8B example launches so); it is listed as ignored."""
    run = spec_from_megatron_args(BASE + "--sequence-parallel")
    assert not run.sequence_parallel and run.tp == 1
    assert any(item.startswith("--sequence-parallel") for item in run.ignored)
    on = spec_from_megatron_args(
        BASE + "--sequence-parallel --tensor-model-parallel-size 2"
    )
    assert on.sequence_parallel


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("--fp16 --bf16", "--fp16 and --bf16 are exclusive"),
        ("--tensor-model-parallel-size 3", "tp 3 must divide num_attention_heads"),
        ("--num-layers-per-virtual-pipeline-stage 2", "need --pipeline-model"),
        ("--pipeline-model-parallel-size 5", "not divisible by"),
        (
            "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 4",
            "pipeline stages x virtual stages",
        ),
        (
            "--pipeline-model-parallel-size 4 "
            "--num-layers-per-virtual-pipeline-stage 4",
            "not divisible by --num-layers-per-virtual",
        ),
        (
            "--recompute-granularity selective --recompute-method uniform",
            "only to --recompute-granularity full",
        ),
        (
            "--num-experts 8 --expert-model-parallel-size 3",
            "not a multiple of --expert-model-parallel-size",
        ),
        ("--hidden-size ${HS}", "--hidden-size must be an integer"),
        ("--normalization BatchNorm", "not supported"),
        ("--fp16=yes", "takes no value"),
        ("--global-batch-size 7", "not a multiple"),
        ("--group-query-attention --num-query-groups 3", "num_query_groups"),
        ("--micro-batch-size", "needs a value"),
    ],
)
def test_megatron_contradictions_are_refused(extra, match):
    with pytest.raises(ProblemError, match=match) as caught:
        spec_from_megatron_args(BASE + extra)
    assert "\n" not in str(caught.value)


def test_megatron_missing_model_flag_and_vocabulary():
    with pytest.raises(ProblemError, match="missing --hidden-size"):
        spec_from_megatron_args(
            "--num-layers 2 --num-attention-heads 2 "
            "--seq-length 8 --micro-batch-size 1 --vocab-size 9"
        )
    with pytest.raises(ProblemError, match="vocabulary size is unknown"):
        spec_from_megatron_args(BASE.replace("--vocab-size 50257 ", ""))
    run = spec_from_megatron_args(
        BASE.replace("--vocab-size 50257 ", ""), vocab_size=32000
    )
    assert run.spec.vocab_size == 32000 and run.global_batch is None
