"""An expert block's operations, tokens, dispatch bytes and activations
(costmodel.analytical.moe_ops, moe_tokens)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import QWEN3_30B_A3B

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.moe import MlaSpec, MoeSpec
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import activation_bytes
from pipedejavu.costmodel.analytical.moe_ops import (
    expert_activation_bytes,
    expert_block_backward_ops,
    expert_block_forward_ops,
    overlapped_shared_ops,
)
from pipedejavu.costmodel.analytical.moe_tokens import (
    INDEX_BYTES,
    ROUTING_MAP_BYTES,
    ExpertPass,
    combine_bytes,
    dispatch_bytes,
    expert_tokens,
)
from pipedejavu.costmodel.analytical.ops import (
    GRAD_ACCUMULATE_BYTES,
    Gemm,
    PassOptions,
    block_backward_ops,
    block_forward_ops,
)
from pipedejavu.costmodel.analytical.roofline import pass_seconds

GPU = GpuSheetEntry("X", 8e10, 3e12, (("fp32", 6e13), ("bf16", 1e15)), 8, 4e11, 5e10)

#: Qwen3-30B-A3B's shapes, four blocks, a shorter sequence; heads not h / a
#: wide (kv_channels), shared experts with a gate added.
QWEN = dataclasses.replace(
    QWEN3_30B_A3B,
    name="qwen-moe",
    num_layers=4,
    seq_length=1024,
    moe=MoeSpec(
        num_experts=128,
        topk=8,
        ffn_hidden_size=768,
        shared_ffn_hidden_size=1024,
        shared_expert_gate=True,
    ),
)

NOT_COUNTED = ("router", "shared_expert.gate")  # Megatron's count leaves them out


def _gemm_flops(ops, skip=()) -> float:
    """GEMM FLOPs of ``ops`` but those of the products named in ``skip``
    (and their gradients)."""
    return sum(
        op.flops
        for op in ops
        if isinstance(op, Gemm)
        and op.name.rsplit(".", 1)[0] not in skip
        and op.name not in skip
    )


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "grouped"),
    [(1, 1, None, True), (2, 8, None, True), (2, 16, 1, False), (4, 4, 2, True)],
)
def test_flops_equal_the_blocks_share_of_megatrons_count(tp, ep, etp, grouped):
    spec, mbs = QWEN, 2
    opts = PassOptions(mbs, tp, sequence_parallel=tp > 1)
    experts = ExpertPass(ep=ep, etp=etp, grouped_gemm=grouped)
    forward = expert_block_forward_ops(spec, opts, experts)
    backward = expert_block_backward_ops(spec, opts, experts)
    tokens = mbs * spec.seq_length
    # Megatron's count (causal, every block an expert block): one block's
    # forward per token, the LM head taken out.
    per_iteration = spec.model_flops_per_iteration(mbs)
    head = 2 * spec.hidden_size * spec.padded_vocab_size(1)
    block = (per_iteration / (3 * tokens) - head) / spec.num_layers
    assert _gemm_flops(forward, NOT_COUNTED) * tp == pytest.approx(
        block * tokens, rel=1e-12
    )
    # The backward: two GEMMs per product, but fused attention recomputes
    # the scores (2.5x its forward, not 2x).
    core = _gemm_flops(forward) - _gemm_flops(forward, ("flash_attention",))
    others = _gemm_flops(forward, (*NOT_COUNTED, "flash_attention"))
    assert _gemm_flops(backward, (*NOT_COUNTED, "flash_attention")) == pytest.approx(
        2 * others, rel=1e-12
    )
    flash = _gemm_flops(backward) - _gemm_flops(backward, ("flash_attention",))
    assert flash == pytest.approx(2.5 * core, rel=1e-12)
    # The router runs on the tokens the GPU holds: T x E x h.
    router = next(op for op in forward if op.name == "router")
    assert router.flops == 2 * tokens / tp * 128 * 2048


def _one_expert(width: int) -> TransformerSpec:
    return dataclasses.replace(
        QWEN, moe=MoeSpec(num_experts=1, topk=1, ffn_hidden_size=width)
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_one_expert_prices_its_mlp_as_the_dense_block(tp):
    spec = _one_expert(1536)
    dense = dataclasses.replace(spec, moe=None, ffn_hidden_size=1536)
    opts = PassOptions(2, tp, sequence_parallel=tp > 1)
    experts = ExpertPass(grouped_gemm=True)
    ours = {op.name: op for op in expert_block_forward_ops(spec, opts, experts)}
    theirs = {op.name: op for op in block_forward_ops(dense, opts)}
    for moe_name, dense_name in (("expert_fc1", "mlp_up"), ("expert_fc2", "mlp_down")):
        assert ours[moe_name] == theirs[dense_name]._replace(name=moe_name)
    # The activation moves the dense one's bytes and reads the probabilities.
    tokens = 2 * spec.seq_length
    probs = tokens * 2.0
    assert ours["expert_activation"].bytes == theirs["swiglu"].bytes + probs
    # The backward's gradient GEMMs too.
    ours = {op.name: op for op in expert_block_backward_ops(spec, opts, experts)}
    theirs = {op.name: op for op in block_backward_ops(dense, opts)}
    for moe_name, dense_name in (("expert_fc1", "mlp_up"), ("expert_fc2", "mlp_down")):
        for grad in (".dgrad", ".wgrad"):
            assert ours[moe_name + grad] == theirs[dense_name + grad]._replace(
                name=moe_name + grad
            )
    # Same attention half, op for op.
    names = [op.name for op in block_forward_ops(dense, opts)]
    cut = names.index("post_attention_norm") + 1
    assert (
        expert_block_forward_ops(spec, opts, experts)[:cut]
        == block_forward_ops(dense, opts)[:cut]
    )


def test_block_backward_ops_takes_heads_not_h_over_a_wide():
    # Before: the accumulation counted block_params, which refuses such heads.
    dense = dataclasses.replace(QWEN, moe=None)
    ops = block_backward_ops(dense, PassOptions(1, 2, sequence_parallel=True))
    accumulate = next(op for op in ops if op.name == "grad_accumulate")
    assert accumulate.bytes == GRAD_ACCUMULATE_BYTES * sum(
        dense.layer_param_split(2)[1]
    )


def test_gradient_accumulation_counts_the_local_experts():
    opts = PassOptions(1, 2, sequence_parallel=True)
    experts = ExpertPass(ep=8, etp=1)
    ops = expert_block_backward_ops(QWEN, opts, experts)
    accumulate = next(op for op in ops if op.name == "grad_accumulate")
    dense, expert = QWEN.layer_param_split(2, 8, 1)[1]
    assert accumulate.bytes == GRAD_ACCUMULATE_BYTES * (dense + expert)


SMALL = TransformerSpec(
    name="small",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=16,
    gated_mlp=True,
    position="rotary",
    moe=MoeSpec(num_experts=4, topk=2, ffn_hidden_size=32),
)


def test_dispatch_bytes_by_hand():
    opts = PassOptions(1, 1)  # 16 tokens of 64 bf16 activations (128 bytes)
    # alltoall: 32 routed copies, each 128 bytes and a 2-byte probability,
    # half of them to the other GPU.
    assert dispatch_bytes(SMALL, opts, ExpertPass(ep=2)) == 32 * 130 / 2
    assert combine_bytes(SMALL, opts, ExpertPass(ep=2)) == 32 * 128 / 2
    # fp32 router: 4-byte probabilities.
    assert dispatch_bytes(SMALL, opts, ExpertPass(ep=2, router_fp32=True)) == (
        32 * 132 / 2
    )
    # allgather: the other GPU's 16 tokens, with 4 probabilities and 4 flags.
    gather = ExpertPass(ep=2, dispatcher="allgather")
    assert dispatch_bytes(SMALL, opts, gather) == 16 * (128 + 4 * 3)
    assert combine_bytes(SMALL, opts, gather) == 16 * 128
    # flex: a token goes to the other GPU unless both its experts are here:
    # 1 - (2/4)(1/3) = 5/6 of them, once each.
    flex = ExpertPass(ep=2, dispatcher="flex")
    assert dispatch_bytes(SMALL, opts, flex) == pytest.approx(16 * 128 * 5 / 6)
    # capacity 1.0 pads each expert to ceil(32 / 4) = 8 copies: the same 32.
    padded = ExpertPass(ep=2, capacity_factor=1.0, pad_to_capacity=True)
    assert dispatch_bytes(SMALL, opts, padded) == 32 * 130 / 2
    half = ExpertPass(ep=2, capacity_factor=0.5)  # 4 a expert kept
    assert dispatch_bytes(SMALL, opts, half) == 16 * 130 / 2
    assert dispatch_bytes(SMALL, opts, ExpertPass(ep=1)) == 0.0


def test_expert_tokens_by_hand():
    opts = PassOptions(2, 2, sequence_parallel=True)  # 16 tokens a GPU
    # 16 x 2 / 4 = 8 copies per expert from each of the ep x etp senders.
    assert expert_tokens(SMALL, opts, ExpertPass(ep=2, etp=1)) == 16
    assert expert_tokens(SMALL, opts, ExpertPass(ep=2, etp=2)) == 32
    assert expert_tokens(SMALL, opts, ExpertPass(ep=4, etp=1, imbalance=1.5)) == 48
    assert expert_tokens(SMALL, opts, ExpertPass(ep=2, etp=1, capacity_factor=0.5)) == 8
    padded = ExpertPass(ep=2, etp=1, capacity_factor=2.0, pad_to_capacity=True)
    assert expert_tokens(SMALL, opts, padded) == 32
    capped = ExpertPass(ep=2, etp=1, imbalance=3.0, capacity_factor=2.0)
    assert expert_tokens(SMALL, opts, capped) == 32


def _seconds(spec, opts, experts) -> float:
    return pass_seconds(
        expert_block_forward_ops(spec, opts, experts), GPU
    ) + pass_seconds(expert_block_backward_ops(spec, opts, experts), GPU)


def test_effects_are_monotone():
    opts = PassOptions(2, 2, sequence_parallel=True)
    base = ExpertPass(ep=8, grouped_gemm=True)
    times = [
        _seconds(QWEN, opts, dataclasses.replace(base, imbalance=x))
        for x in (1.0, 1.5, 3.0)
    ]
    assert times[0] < times[1] < times[2]
    # One kernel per expert is slower than one grouped GEMM.
    assert (
        _seconds(QWEN, opts, dataclasses.replace(base, grouped_gemm=False)) > (times[0])
    )
    # Dropping tokens at capacity < 1 is cheaper, padding to 2 dearer.
    cheaper = dataclasses.replace(base, capacity_factor=0.5)
    dearer = dataclasses.replace(base, capacity_factor=2.0, pad_to_capacity=True)
    assert _seconds(QWEN, opts, cheaper) < times[0] < _seconds(QWEN, opts, dearer)
    # More EP GPUs: a larger share of the tokens leaves each GPU; fewer local
    # experts (fewer parameters to accumulate).
    sent = [dispatch_bytes(QWEN, opts, ExpertPass(ep=ep)) for ep in (1, 2, 8, 32)]
    assert sent == sorted(sent) and sent[0] == 0 < sent[1]
    seconds = [_seconds(QWEN, opts, ExpertPass(ep=ep)) for ep in (1, 4, 16)]
    assert seconds[0] > seconds[1] > seconds[2]
    # Expert TP: the all-gather and reduce-scatter appear with etp > 1 only.
    names = {op.name for op in expert_block_forward_ops(QWEN, opts, ExpertPass(ep=8))}
    assert {"all_gather.experts", "reduce_scatter.experts"} <= names
    names = {
        op.name for op in expert_block_forward_ops(QWEN, opts, ExpertPass(ep=8, etp=1))
    }
    assert not any(name.endswith(".experts") for name in names)
    # More memory with imbalance, less with recomputation.
    memory = [
        expert_activation_bytes(QWEN, opts, dataclasses.replace(base, imbalance=x))
        for x in (1.0, 2.0)
    ]
    assert memory[0] < memory[1]
    kept = [
        expert_activation_bytes(QWEN, opts, base, r)
        for r in ("full", "selective", "none")
    ]
    assert kept == sorted(kept) and kept[0] < kept[1]


def test_activation_bytes_of_one_expert_are_the_dense_blocks_plus_routing():
    spec = _one_expert(1536)
    dense = dataclasses.replace(spec, moe=None, ffn_hidden_size=1536)
    for tp, recompute in ((1, "none"), (2, "selective"), (4, "none"), (2, "full")):
        opts = PassOptions(2, tp, sequence_parallel=tp > 1)
        ours = expert_activation_bytes(spec, opts, ExpertPass(), recompute)
        theirs = activation_bytes(
            dense,
            2,
            tp,
            "bf16",
            recompute=recompute,
            sequence_parallel=tp > 1,
            flash_attention=True,
            attention_dropout=False,
        )[1]
        # The GPU holds T tokens; its expert takes the etp = tp GPUs' T each
        # (rows): their copy of h activations (a tensor of its own, beside
        # the MoE input) and probability, the row map of the T it sent, the
        # router's probabilities and routing map (E = 1).
        tokens, rows = 2 * spec.seq_length / tp, 2 * spec.seq_length
        routing = rows * (2 * spec.hidden_size + 2.0) + tokens * INDEX_BYTES
        routing += tokens * (2.0 + ROUTING_MAP_BYTES)
        extra = 0.0 if recompute == "full" else routing
        assert ours == pytest.approx(theirs + extra, rel=1e-12)


def test_shared_experts_overlap_names_their_ops():
    opts = PassOptions(1, 2, sequence_parallel=True)
    overlapped = ExpertPass(ep=8, shared_expert_overlap=True)
    ops = expert_block_forward_ops(QWEN, opts, overlapped)
    beside = overlapped_shared_ops(ops, overlapped)
    assert {op.name for op in beside} >= {
        "shared_expert.mlp_up",
        "shared_expert.mlp_down",
        "shared_expert.gate",
    }
    assert overlapped_shared_ops(ops, ExpertPass(ep=8)) == []
    # The shared MLP is the dense MLP of its width, split over TP.
    up = next(op for op in ops if op.name == "shared_expert.mlp_up")
    assert up.flops == 2 * 1024 * 2 * 1024 / 2 * 2048


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ep": 0}, "ep must be an integer >= 1"),
        ({"etp": 1.5}, "etp must be an integer >= 1"),
        ({"imbalance": 0.9}, "imbalance must be a number in"),
        ({"imbalance": math.nan}, "imbalance must be a number in"),
        ({"imbalance": True}, "imbalance must be a number in"),
        ({"capacity_factor": 0.0}, "capacity_factor must be None or a number"),
        ({"pad_to_capacity": True}, "pad_to_capacity needs a capacity_factor"),
        ({"dispatcher": "nccl"}, "dispatcher must be one of"),
        ({"grouped_gemm": 1}, "grouped_gemm must be true or false"),
        (
            {"shared_expert_overlap": True, "dispatcher": "allgather"},
            "shared_expert_overlap needs the alltoall dispatcher",
        ),
    ],
)
def test_bad_expert_pass_refused(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        ExpertPass(**fields)
    assert "\n" not in str(info.value)


def test_bad_settings_refused():
    sp = PassOptions(1, 2, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence parallelism"):
        expert_block_forward_ops(QWEN, PassOptions(1, 2), ExpertPass())
    with pytest.raises(ValueError, match="ep 3 must divide num_experts"):
        expert_block_forward_ops(QWEN, sp, ExpertPass(ep=3))
    with pytest.raises(ValueError, match="etp 5 must divide"):
        dispatch_bytes(QWEN, sp, ExpertPass(etp=5))
    with pytest.raises(ValueError, match="no experts"):
        expert_activation_bytes(dataclasses.replace(QWEN, moe=None), sp, ExpertPass())
    with pytest.raises(ValueError, match="flex dispatcher needs"):
        dispatch_bytes(SMALL, PassOptions(1, 1), ExpertPass(dispatcher="flex"))
    mla = dataclasses.replace(
        QWEN, kv_channels=None, mla=MlaSpec(512, 512, 128, 64, 128)
    )
    for price in (expert_block_forward_ops, expert_block_backward_ops):
        ops = price(mla, sp, ExpertPass())  # priced: tests/test_mla_mtp.py
        assert any(op.name.startswith("kv_up") for op in ops)
    assert dispatch_bytes(mla, sp, ExpertPass(ep=2)) > 0  # no attention in it
    with pytest.raises(ValueError, match="recompute must be"):
        expert_activation_bytes(QWEN, sp, ExpertPass(), "some")
