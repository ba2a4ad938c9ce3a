"""The MoE and MLA shape vocabulary (core/moe.py) and TransformerSpec's checks."""

import dataclasses

import pytest

from pipedejavu.core.moe import MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.core.transformer import TransformerSpec

DENSE = TransformerSpec(
    name="t",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    ffn_hidden_size=256,
    vocab_size=1000,
    seq_length=128,
    position="rotary",
)


def test_layer_pattern_as_megatron_reads_freq_and_first_dense():
    assert moe_layer_pattern(4) == (True,) * 4
    # Megatron-LM --moe-layer-freq 2: blocks 0, 2, ... are expert blocks
    assert moe_layer_pattern(5, freq=2) == (True, False, True, False, True)
    # DeepSeek-V3: first_k_dense_replace = 3 of 61 blocks
    pattern = moe_layer_pattern(61, first_dense=3)
    assert pattern[:3] == (False,) * 3 and all(pattern[3:]) and len(pattern) == 61
    assert moe_layer_pattern(6, freq=2, first_dense=1) == (
        False,
        False,
        True,
        False,
        True,
        False,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(freq=0), "frequency"),
        (dict(freq=True), "frequency"),
        (dict(first_dense=-1), "first dense"),
        (dict(first_dense=5), "first dense"),
    ],
)
def test_layer_pattern_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moe_layer_pattern(4, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=0, topk=1, ffn_hidden_size=8), "num_experts"),
        (dict(num_experts=8, topk=9, ffn_hidden_size=8), "topk"),
        (dict(num_experts=8, topk=2, ffn_hidden_size=2**23), "ffn_hidden_size"),
        (
            dict(num_experts=8, topk=2, ffn_hidden_size=8, shared_ffn_hidden_size=-1),
            "shared_ffn",
        ),
        (
            dict(num_experts=8, topk=2, ffn_hidden_size=8, layers=(False, False)),
            "no expert block",
        ),
        (dict(num_experts=8, topk=2, ffn_hidden_size=8, layers=[True]), "tuple"),
        (
            dict(num_experts=8, topk=2, ffn_hidden_size=8, shared_expert_gate=1),
            "shared_expert_gate",
        ),
    ],
)
def test_moe_spec_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeSpec(**kwargs)


def test_mla_spec_bounds():
    MlaSpec(0, 512, 128, 64, 128)  # V2-Lite: queries not compressed
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MlaSpec(1536, 0, 128, 64, 128)
    with pytest.raises(ValueError, match="v_head_dim"):
        MlaSpec(1536, 512, 128, 64, 2**17)


def test_transformer_spec_checks_moe_fields():
    moe = MoeSpec(8, 2, 128, layers=moe_layer_pattern(4, freq=2))
    spec = dataclasses.replace(DENSE, moe=moe)
    assert not spec.is_dense and DENSE.is_dense
    assert [spec.moe.is_expert_block(i) for i in range(4)] == [True, False, True, False]
    assert spec.moe.num_expert_blocks(4) == 2
    with pytest.raises(ValueError, match="names 5 blocks"):
        dataclasses.replace(DENSE, moe=MoeSpec(8, 2, 128, layers=(True,) * 5))
    with pytest.raises(ValueError, match="must be a MoeSpec"):
        dataclasses.replace(DENSE, moe={"num_experts": 8})
    with pytest.raises(ValueError, match="mtp_layers"):
        dataclasses.replace(DENSE, mtp_layers=65)
    with pytest.raises(ValueError, match="qk_layernorm"):
        dataclasses.replace(DENSE, qk_layernorm="yes")


@pytest.mark.parametrize(
    "extra",
    [
        dict(moe=MoeSpec(8, 2, 128)),
        dict(mla=MlaSpec(0, 32, 16, 8, 16)),
        dict(mtp_layers=1),
    ],
)
def test_dense_block_counts_refuse_other_blocks(extra):
    """block_params / layer_params count blocks all alike and dense; experts,
    latent attention and prediction depths are counted by layer_param_split
    (and the FLOPs)."""
    spec = dataclasses.replace(DENSE, **extra)
    with pytest.raises(ValueError, match="counted by layer_param_split"):
        spec.block_params(1)
    with pytest.raises(ValueError, match="counted by layer_param_split"):
        spec.layer_params(1)
    pairs = spec.layer_param_split(1)
    assert len(pairs) == spec.num_profile_layers
    assert spec.num_params == sum(d + e for d, e in pairs) > DENSE.num_params / 2
    assert spec.model_flops_per_iteration(8) > 0


def test_dense_block_counts_take_any_head_width():
    """4 heads of 32 on a width of 64: the query columns and the attention
    output's rows are a d = 128, not h."""
    spec = dataclasses.replace(DENSE, kv_channels=32)
    h, f, qkv = 64, 256, 3 * 4 * 32
    norms = 2 * 2 * h  # two layernorms, weight and bias
    biases = qkv + f + 2 * h
    assert spec.block_params(1) == h * qkv + 4 * 32 * h + 2 * h * f + norms + biases
    assert spec.layer_params(1)[1] == spec.block_params(1)
    assert spec.layer_params(1) == tuple(d for d, _ in spec.layer_param_split(1))
