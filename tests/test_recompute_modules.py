"""Selective recomputation by module (Megatron-Core's ``--recompute-modules``,
costmodel.analytical.recompute): what each module no longer keeps, by hand;
what it reruns, the priced forward of exactly its operations; the attention
core alone as selective recomputation was priced before; the options that
carry the modules (the launch flags: test_recompute_launch.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import decoder_spec

from pipedejavu.core.moe import MlaSpec, MoeSpec
from pipedejavu.core.training_options import RECOMPUTE_MODULES, TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import (
    activation_bytes,
    selective_forward_seconds,
)
from pipedejavu.costmodel.analytical.mla_ops import any_block_forward_ops
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers, alltoall_seconds
from pipedejavu.costmodel.analytical.moe_ops import (
    expert_activation_bytes,
    expert_block_forward_ops,
)
from pipedejavu.costmodel.analytical.moe_tokens import (
    ExpertPass,
    combine_bytes,
    dispatch_bytes,
)
from pipedejavu.costmodel.analytical.ops import PassOptions, attention_core_forward_ops
from pipedejavu.costmodel.analytical.roofline import pass_seconds
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.io.gpu_sheet import load_gpu_sheet

SHEET = load_gpu_sheet()
GPU = "H100-SXM"
E = 2  # bf16 bytes
#: A dense block with grouped-query attention and a gated MLP.
DENSE = decoder_spec(
    name="dense",
    num_layers=2,
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=1024,
    vocab_size=4096,
    seq_length=512,
)
#: Its expert form: 8 experts of 128, top 2, gated shared experts of 256.
MOE = dataclasses.replace(
    DENSE,
    name="moe",
    moe=MoeSpec(8, 2, 128, 256, shared_expert_gate=True),
)
#: Multi-latent attention with latent norms (q_lora 128, kv_lora 64, d 32 + 16,
#: v 32); its first block dense, its second an expert block; one MTP depth.
MLA = dataclasses.replace(
    MOE,
    name="mla",
    num_attention_heads=8,
    num_query_groups=8,
    mla=MlaSpec(128, 64, 32, 16, 32),
    qk_layernorm=True,
    moe=MoeSpec(8, 2, 128, 256, layers=(False, True)),
    mtp_layers=1,
)
B, T = 2, 2  # micro-batch, TP (with sequence parallelism)
OPTS = PassOptions(B, T, "bf16", sequence_parallel=True, tp_comm_overlap=True)
EXPERTS = ExpertPass(ep=2, etp=1, grouped_gemm=True)


def _dense_kept(spec: TransformerSpec, modules) -> float:
    return float(
        activation_bytes(
            spec, B, T, "bf16", recompute=modules, sequence_parallel=True,
            flash_attention=True, attention_dropout=False,
        )[1]
    )  # fmt: skip


@pytest.mark.parametrize("module", RECOMPUTE_MODULES)
def test_what_each_module_frees_of_a_dense_block_by_hand(module):
    """A dense block (TE spec: both norms fused into the next linear layer)."""
    tokens, h, f, heads = B * DENSE.seq_length, 256, 1024, 4 / T
    freed = {
        "core_attn": B * heads * DENSE.seq_length * 4.0,  # fp32 log-sum-exp
        # the MLP's input (its fused norm's output, on the GPU's tokens),
        # up projection (gate and up) and activation output
        "mlp": tokens * h / T * E + tokens * (2 * f / T + f / T) * E,
    }.get(module, 0.0)  # layernorm: no norm of its own; the others: absent
    none = _dense_kept(DENSE, "none")
    assert none - _dense_kept(DENSE, (module,)) == pytest.approx(freed, rel=1e-12)


@pytest.mark.parametrize("module", ["layernorm", "mla_up_proj"])
def test_what_mla_modules_free_by_hand(module):
    dense = dataclasses.replace(MLA, moe=None, mtp_layers=0)
    tokens, h, heads = B * MLA.seq_length, 256, 8 / T
    if module == "layernorm":  # the input norm is a module of its own
        freed = tokens * h / T * E
    else:  # Q, K (32 + 16 deep) and V (32) of each head, the latents' normed
        # copies; the rotary key (16, gathered) is kept by the checkpoint
        freed = tokens * heads * (2 * 48 + 32) * E
        freed += tokens / T * (128 + 64) * E - tokens * 16 * E
    none = _dense_kept(dense, "none")
    assert none - _dense_kept(dense, (module,)) == pytest.approx(freed, rel=1e-12)


def _expert_kept(modules) -> float:
    return expert_activation_bytes(MOE, OPTS, EXPERTS, modules)


@pytest.mark.parametrize(
    "module", ["moe_act", "layernorm", "shared_experts", "core_attn", "mlp"]
)
def test_what_each_module_frees_of_an_expert_block_by_hand(module):
    """An expert block of EP 2, expert TP 1, TP 2 with SP: the GPU holds
    ``T_gpu = b s / 2`` tokens and its 4 local experts take ``T_gpu k`` rows
    (balanced routing)."""
    h, fe, fs, s = 256, 128, 256, MOE.seq_length
    t_gpu = B * s / T
    rows = t_gpu * 2
    freed = {
        "moe_act": rows * fe * E,  # the activation's output
        "layernorm": t_gpu * h * E,  # the pre-MLP norm's output (MoE input)
        # the shared MLP's up and activation outputs (full sequence, split
        # over TP), the gate's output and the MLP output it scales
        "shared_experts": B * s * (2 * fs / T + fs / T) * E + t_gpu * (h + 1) * E,
        "core_attn": B * (4 / T) * s * 4.0,
        "mlp": 0.0,  # a dense layer's module
    }[module]
    freed_bytes = _expert_kept("none") - _expert_kept((module,))
    assert freed_bytes == pytest.approx(freed, rel=1e-12)


def test_moe_keeps_only_the_attention_half_by_hand():
    s, h, d, heads, groups = MOE.seq_length, 256, 64, 4 / T, 2 / T
    tokens = B * s
    # norm inputs, QKV input, MoE input, two masks (on the GPU's tokens);
    # Q, K, V, O; the log-sum-exp
    half = tokens * h * (4 * E + 2) / T + tokens * d * (2 * heads + 2 * groups) * E
    half += B * heads * s * 4.0
    assert _expert_kept(("moe",)) == pytest.approx(half, rel=1e-12)
    both = _expert_kept(("moe", "layernorm"))
    assert both == pytest.approx(half - tokens / T * h * E, rel=1e-12)


def _names(spec, opts, names, expert=False):
    ops = (
        expert_block_forward_ops(spec, opts, EXPERTS)
        if expert
        else any_block_forward_ops(spec, opts)
    )
    return [op for op in ops if op.name in names]


def _seconds(ops) -> float:
    return pass_seconds(ops, SHEET[GPU], SOURCE_CONSTANTS) if ops else 0.0


SOURCE_CONSTANTS = AnalyticalSource(DENSE, SHEET, TrainingOptions("bf16")).constants
#: What each module reruns of a dense block, named by hand.
DENSE_RERUNS = {
    "core_attn": ("flash_attention",),
    "mlp": (  # its norm is fused into its first linear layer
        "post_attention_norm",
        "all_gather.mlp_up",
        "mlp_up",
        "swiglu",
        "mlp_down",
        "reduce_scatter.mlp_down",
    ),
}


@pytest.mark.parametrize("module", RECOMPUTE_MODULES)
def test_a_dense_block_reruns_exactly_its_modules_ops(module):
    rerun = selective_forward_seconds(
        DENSE, SHEET[GPU], B, T, "bf16", recompute=(module,), sequence_parallel=True,
        tp_comm_overlap=True, constants=SOURCE_CONSTANTS,
    )  # fmt: skip
    names = DENSE_RERUNS.get(module, ())
    assert len(_names(DENSE, OPTS, names)) == len(names)
    assert rerun == _seconds(_names(DENSE, OPTS, names))


def test_mla_modules_rerun_exactly_their_ops():
    dense = dataclasses.replace(MLA, moe=None, mtp_layers=0)
    up = (
        "q_norm", "kv_norm", "all_gather.q_up", "q_up", "all_gather.kv_up",
        "kv_up", "mla_rope_q", "mla_rope_kv",
    )  # fmt: skip
    for modules, names in (
        (("layernorm",), ("input_norm",)),
        (("mla_up_proj",), up),
        (
            ("mla_up_proj", "layernorm", "core_attn"),
            (*up, "input_norm", "flash_attention"),
        ),
    ):
        rerun = selective_forward_seconds(
            dense, SHEET[GPU], B, T, "bf16", recompute=modules,
            sequence_parallel=True, tp_comm_overlap=True, constants=SOURCE_CONSTANTS,
        )  # fmt: skip
        ops = _names(dense, OPTS, names)
        assert len(ops) == len(names)
        assert rerun == pytest.approx(_seconds(ops), rel=1e-12)


def _source(spec, modules) -> AnalyticalSource:
    recompute = "none" if modules is None else "selective"
    kwargs = {} if modules is None else {"recompute_modules": modules}
    options = TrainingOptions(
        "bf16", recompute=recompute, sequence_parallel=True, tp_comm_overlap=True,
        **kwargs,
    )  # fmt: skip
    layers = ExpertLayers(EXPERTS) if spec.moe is not None else None
    return AnalyticalSource(spec, SHEET, options, experts=layers)


def _backward(spec, modules):
    return _source(spec, modules).layer_times(spec.name, GPU, B, T).backward


@pytest.mark.parametrize(
    "modules, names",
    [
        (("moe_act",), ("expert_activation",)),
        (("layernorm",), ("post_attention_norm",)),
        (("core_attn", "moe_act"), ("flash_attention", "expert_activation")),
    ],
)
def test_an_expert_block_reruns_exactly_its_modules_ops(modules, names):
    added = _backward(MOE, modules) - _backward(MOE, None)
    ops = _names(MOE, OPTS, names, expert=True)
    assert len(ops) == len(names)
    assert added[1:-1] == pytest.approx([_seconds(ops)] * 2, rel=1e-12)


def test_shared_experts_rerun_their_ops_and_moe_its_all_to_alls():
    forward = expert_block_forward_ops(MOE, OPTS, EXPERTS)
    shared = [op for op in forward if op.name.startswith("shared_expert.")]
    added = _backward(MOE, ("shared_experts",)) - _backward(MOE, None)
    assert added[1] == pytest.approx(_seconds(shared), rel=1e-12)
    # moe: from after the pre-MLP norm to before the residual add, with the
    # dispatch and combine all-to-alls and the pass overhead
    names = [op.name for op in forward]
    layer = forward[names.index("post_attention_norm") + 1 : -1]
    assert {op.name for op in shared} < {op.name for op in layer}
    source = _source(MOE, ("moe",))
    constants, entry = source.constants, SHEET[GPU]
    a2a = sum(
        alltoall_seconds(
            count(MOE, OPTS, EXPERTS), 2, 1, entry, constants.alltoall_efficiency
        )
        for count in (dispatch_bytes, combine_bytes)
    )
    added = source.layer_times(MOE.name, GPU, B, T).backward - _backward(MOE, None)
    rerun = pass_seconds(layer, entry, constants) + a2a
    assert added[1] == pytest.approx(rerun + constants.expert_block_overhead_s)


def test_the_attention_core_alone_prices_selective_recomputation_as_before():
    """``core_attn`` (Megatron-Core's default) adds each block's attention
    core forward, dense and expert blocks and the MTP depth alike (the rule
    before modules), and frees the core's softmax statistics only."""
    for spec in (DENSE, MOE, MLA):
        default = _backward(spec, ("core_attn",))
        assert list(_backward(spec, None)) != list(default)
        plain = TrainingOptions(
            "bf16", recompute="selective", sequence_parallel=True, tp_comm_overlap=True
        )
        layers = ExpertLayers(EXPERTS) if spec.moe is not None else None
        source = AnalyticalSource(spec, SHEET, plain, experts=layers)
        assert list(default) == list(source.layer_times(spec.name, GPU, B, T).backward)
        core = attention_core_forward_ops(_source(spec, None).padded(T), OPTS)
        added = default - _backward(spec, None)
        depths = 1 + spec.mtp_layers  # the head's layer holds the MTP depths'
        assert added[1:-1] == pytest.approx([_seconds(core)] * 2, rel=1e-12)
        assert added[-1] == pytest.approx((depths - 1) * _seconds(core), abs=1e-15)
        assert added[0] == 0.0
    none = _dense_kept(DENSE, "none")
    lse = B * (4 / T) * DENSE.seq_length * 4.0
    assert _dense_kept(DENSE, "selective") == none - lse


def test_the_mtp_depth_reruns_its_blocks_modules():
    """The MTP depth's block (the last block's kind: here an expert block)
    reruns what each block reruns."""
    for modules in (("moe_act", "layernorm"), ("moe",), ("mla_up_proj",)):
        added = _backward(MLA, modules) - _backward(MLA, None)
        assert added[-1] == pytest.approx(added[-2], rel=1e-9)
        assert added[-2] != added[1]  # the dense block reruns other ops


def test_options_carry_the_modules_and_read_old_files():
    options = TrainingOptions(
        recompute="selective", recompute_modules=["moe_act", "layernorm", "moe_act"]
    )
    assert options.recompute_modules == ("moe_act", "layernorm")
    assert options.selective_modules == ("moe_act", "layernorm")
    assert TrainingOptions.from_json(json.loads(json.dumps(options.to_json()))) == (
        options
    )
    old = TrainingOptions(recompute="selective").to_json()
    del old["recompute_modules"]  # a file written before the modules
    assert TrainingOptions.from_json(old).selective_modules == ("core_attn",)
    assert dataclasses.replace(options, recompute="full").selective_modules == ()
    for bad in ([], "core_attn", ["attention"], [3]):
        with pytest.raises(ValueError, match="recompute_modules must be"):
            TrainingOptions(recompute_modules=bad)
    with pytest.raises(ValueError, match="recompute must be"):
        activation_bytes(DENSE, 1, 1, "bf16", recompute=("attention",))
