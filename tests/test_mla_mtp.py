"""Multi-latent attention and multi-token prediction priced by the analytical
cost model (``costmodel/analytical/mla_ops.py``, ``mtp_ops.py``), checked
against Megatron-LM's FLOP count (``moe_counts``, an exact oracle for the
GEMMs), hand counts of the collectives and activations, and end to end:
``predict --megatron-args`` of a DeepSeek-V3 launch and ``plan --model`` of a
small MLA/MTP model, both refused before."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from helpers import DEEPSEEK_V3_MODEL_ARGS, DEEPSEEK_V3_RUN_ARGS, one_knob_choice

from pipedejavu.cli.main import main
from pipedejavu.core.moe import MlaSpec, MoeSpec
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.layers import activation_bytes
from pipedejavu.costmodel.analytical.mla_ops import (
    any_block_backward_ops,
    any_block_forward_ops,
    mla_attention_backward_ops,
    mla_attention_forward_ops,
)
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.moe_ops import expert_block_forward_ops
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.costmodel.analytical.mtp_ops import (
    mtp_own_backward_ops,
    mtp_own_forward_ops,
    mtp_rerun_ops,
)
from pipedejavu.costmodel.analytical.ops import Collective, Gemm, PassOptions
from pipedejavu.costmodel.analytical.roofline import pass_seconds
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.megatron_launch import predict_megatron_run

DEEPSEEK = load_model_spec("DeepSeek-V3")
#: DeepSeek-V3's shapes, small: 2 dense blocks then 2 expert blocks, one MTP
#: depth; the vocabulary is padded (its 129,280 rows do not split 8 ways).
SMALL = dataclasses.replace(
    DEEPSEEK,
    name="small-mla",
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=8,
    ffn_hidden_size=1024,
    vocab_size=4096,
    seq_length=512,
    moe=MoeSpec(16, 2, 256, 256, layers=(False, False, True, True)),
    mla=MlaSpec(128, 64, 32, 16, 32),
)


def _gemm_flops(ops, skip=()) -> float:
    return sum(
        op.flops
        for op in ops
        if isinstance(op, Gemm) and not op.name.startswith(tuple(skip))
    )


def _all_gpus(ops, tp: int, sp: bool, skip=()) -> float:
    """GEMM FLOPs of a pass on the tp GPUs, each counted once: without
    sequence parallelism every GPU runs the duplicated down projections on
    all the tokens (the same products tp times)."""
    down = _gemm_flops([op for op in ops if op.name in ("q_down", "kv_down")])
    return (_gemm_flops(ops, skip) - down) * tp + down * (tp if sp else 1)


def _count_per_token(spec) -> float:
    """Megatron-LM's forward FLOPs per token (model FLOPs / 3 tokens)."""
    return spec.model_flops_per_iteration(1) / (3 * spec.seq_length)


def _one_block(spec, expert: bool):
    moe = dataclasses.replace(spec.moe, layers=None) if expert else None
    return dataclasses.replace(spec, num_layers=1, moe=moe, mtp_layers=0)


def _head_per_token(spec) -> float:
    return 2 * spec.hidden_size * spec.padded_vocab_size()


@pytest.mark.parametrize("q_lora", [1536, 0])
@pytest.mark.parametrize("tp, sp", [(1, False), (4, True), (8, False)])
def test_mla_block_gemms_equal_megatrons_count(q_lora, tp, sp):
    """A dense MLA block's forward GEMMs on the tp GPUs are Megatron's count
    less the latent norms it counts (one FLOP an element, twice); the
    backward's GEMMs (bar the fused attention's recomputation) twice them."""
    spec = _one_block(dataclasses.replace(DEEPSEEK, seq_length=1024), expert=False)
    mla = dataclasses.replace(spec.mla, q_lora_rank=q_lora)
    spec = dataclasses.replace(spec, mla=mla)
    opts = PassOptions(2, tp, sequence_parallel=sp)
    tokens = 2 * spec.seq_length
    norms = 2 * (mla.q_lora_rank + mla.kv_lora_rank)  # q_lora may be 0
    count = (_count_per_token(spec) - _head_per_token(spec) - norms) * tokens
    forward = any_block_forward_ops(spec, opts)
    assert _all_gpus(forward, tp, sp) == pytest.approx(count, rel=1e-12)
    backward = any_block_backward_ops(spec, opts)
    core = _gemm_flops(forward) - _gemm_flops(forward, skip=("flash",))
    assert _gemm_flops(backward, skip=("flash",)) == pytest.approx(
        2 * (_gemm_flops(forward) - core), rel=1e-12
    )
    names = {op.name for op in forward}
    assert ("q_up" in names) == bool(q_lora) and ("q_proj" in names) != bool(q_lora)


@pytest.mark.parametrize("tp, ep, etp", [(1, 8, 1), (2, 4, 1), (2, 2, 2)])
def test_mla_expert_block_gemms_equal_megatrons_count(tp, ep, etp):
    """An MLA expert block (DeepSeek-V3's, 2 of its 256 experts a token):
    forward GEMMs but the router's, times tp, equal Megatron's count less
    the latent norms."""
    spec = _one_block(dataclasses.replace(DEEPSEEK, seq_length=1024), expert=True)
    opts = PassOptions(1, tp, sequence_parallel=tp > 1)
    tokens = spec.seq_length
    norms = 2 * (spec.mla.q_lora_rank + spec.mla.kv_lora_rank)
    count = (_count_per_token(spec) - _head_per_token(spec) - norms) * tokens
    ops = expert_block_forward_ops(spec, opts, ExpertPass(ep=ep, etp=etp))
    assert _all_gpus(ops, tp, tp > 1, ("router",)) == pytest.approx(count, rel=1e-12)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (4, False)])
def test_mtp_depth_gemms_equal_megatrons_count(tp, sp):
    """One MTP depth: its eh_proj and LM head GEMMs plus a block's, times tp,
    equal what Megatron adds for the depth, less the three norms it counts
    (2 x 3h) and the block's latent norms."""
    base = dataclasses.replace(SMALL, moe=None, mtp_layers=0)
    with_mtp = dataclasses.replace(base, mtp_layers=2)
    opts = PassOptions(1, tp, sequence_parallel=sp)
    h, tokens = base.hidden_size, base.seq_length
    norms = 6 * h + 2 * (base.mla.q_lora_rank + base.mla.kv_lora_rank)
    added = (_count_per_token(with_mtp) - _count_per_token(base)) / 2
    ours = _all_gpus(mtp_own_forward_ops(base, opts), tp, sp)
    ours += _all_gpus(any_block_forward_ops(base, opts), tp, sp)
    assert ours == pytest.approx((added - norms) * tokens, rel=1e-12)
    backward = _gemm_flops(mtp_own_backward_ops(base, opts))
    assert backward == pytest.approx(
        2 * _gemm_flops(mtp_own_forward_ops(base, opts)), rel=1e-12
    )


def test_mla_collectives_by_hand():
    """Down projections duplicated (on a GPU's tokens), the latents and the
    rotary key gathered with SP; without SP the up projections' input
    gradients all-reduced, the rotary key's left alone (Megatron-Core)."""
    spec = SMALL
    mla, h, t = spec.mla, spec.hidden_size, 4
    tokens, act = 2 * spec.seq_length, 2.0
    sp = PassOptions(2, t, sequence_parallel=True)
    forward = mla_attention_forward_ops(spec, sp)
    gemm = {op.name: op for op in forward if isinstance(op, Gemm)}
    assert gemm["q_down"].m == gemm["kv_down"].m == tokens / t  # its tokens
    assert (gemm["q_down"].n, gemm["kv_down"].n) == (128, 64 + 16)  # whole
    assert gemm["q_up"].n == 8 / t * (32 + 16) and gemm["kv_up"].n == 8 / t * 64
    coll = {op.name: op.message_bytes for op in forward if isinstance(op, Collective)}
    assert coll == {
        "all_gather.q_up": tokens * mla.q_lora_rank * act,
        "all_gather.kv_up": tokens * mla.kv_lora_rank * act,
        "all_gather.k_pos_emb": tokens * mla.qk_pos_emb_head_dim * act,
        "reduce_scatter.out_proj": tokens * h * act,
    }
    backward = mla_attention_backward_ops(spec, sp)
    names = sorted(op.name for op in backward if isinstance(op, Collective))
    assert names == [
        "all_gather.out_proj",
        "reduce_scatter.k_pos_emb",
        "reduce_scatter.kv_up",
        "reduce_scatter.q_up",
    ]
    plain = PassOptions(2, t)
    forward = mla_attention_forward_ops(spec, plain)
    assert [op.name for op in forward if isinstance(op, Collective)] == [
        "all_reduce.out_proj"
    ]
    assert next(op for op in forward if op.name == "q_down").m == tokens
    backward = mla_attention_backward_ops(spec, plain)
    assert sorted(op.name for op in backward if isinstance(op, Collective)) == [
        "all_reduce.kv_up",
        "all_reduce.q_up",
    ]


def test_mla_activation_bytes_by_hand():
    """What an MLA block keeps (bf16, tp 2 with SP, flash attention): the
    dense block's norm inputs, input and masks, the queries, keys, values and
    output, each latent's norm input and normed output, the MLP's tensors and
    the softmax statistics."""
    spec = dataclasses.replace(SMALL, moe=None, mtp_layers=0)
    b, s, h, t, e = 2, spec.seq_length, spec.hidden_size, 2, 2
    tokens, heads = b * s, 8 / t
    kept = activation_bytes(
        spec, b, t, "bf16", sequence_parallel=True, flash_attention=True
    )[1]
    by_hand = tokens * h * (4 * e + 2) / t  # norm inputs, input, masks
    by_hand += tokens * heads * (2 * (32 + 16) + 2 * 32) * e  # Q, K, V, out
    by_hand += tokens / t * 2 * (128 + 64) * e  # latents: norm in and out
    by_hand += tokens * (2 * 1024 / t + 1024 / t) * e  # MLP up, activation
    by_hand += b * heads * s * 4.0  # log-sum-exp
    assert kept == pytest.approx(by_hand, rel=1e-12)
    selective = activation_bytes(
        spec, b, t, "bf16", recompute="selective", sequence_parallel=True,
        flash_attention=True,
    )[1]  # fmt: skip
    assert selective == pytest.approx(by_hand - b * heads * s * 4.0, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_mtp_priced_in_the_last_layer(recompute):
    """The MTP depths sit in the last layer: its forward grows by each
    depth's own operations plus an expert block's time (the last block's
    kind), its backward by theirs (and the rerun under full recomputation);
    its activations by the embedding's, the norms' and projection's inputs,
    the block's and the head's."""
    sheet = load_gpu_sheet()
    options = TrainingOptions("bf16", sequence_parallel=True, recompute=recompute)
    layers = ExpertLayers(ExpertPass(ep=4, grouped_gemm=True))
    depths, tp, gpu = 2, 2, "H100-SXM"
    with_mtp = dataclasses.replace(SMALL, mtp_layers=depths)
    without = dataclasses.replace(SMALL, mtp_layers=0)
    times, infos = {}, {}
    for spec in (with_mtp, without):
        source = AnalyticalSource(spec, sheet, options, experts=layers)
        times[spec.mtp_layers] = source.layer_times(spec.name, gpu, 1, tp)
        infos[spec.mtp_layers] = source.model_info(spec.name)
    mine, base = times[depths], times[0]
    last = SMALL.num_layers  # the last (expert) block's profile layer
    opts = PassOptions(1, tp, sequence_parallel=True)
    constants, spec = source.constants, source.padded(tp)
    own_f = pass_seconds(mtp_own_forward_ops(spec, opts), sheet[gpu], constants)
    own_b = pass_seconds(mtp_own_backward_ops(spec, opts), sheet[gpu], constants)
    block_f, block_b = base.forward[last], base.backward[last]  # recompute in
    if recompute == "full":  # the block's rerun is in its row, as the core's
        own_b += pass_seconds(mtp_rerun_ops(spec, opts), sheet[gpu], constants)
    assert mine.forward[-1] - base.forward[-1] == pytest.approx(
        depths * (own_f + block_f), rel=1e-9
    )
    assert mine.backward[-1] - base.backward[-1] == pytest.approx(
        depths * (own_b + block_b), rel=1e-9
    )
    assert list(mine.forward[:-1]) == list(base.forward[:-1])
    kept, plain = infos[depths].act_mem[tp], infos[0].act_mem[tp]
    local = SMALL.seq_length * SMALL.hidden_size / tp  # elements
    if recompute == "full":
        expected = plain[0] + local + plain[-1]
    else:
        expected = plain[0] + 4 * local + plain[last] + plain[-1]
    assert kept[-1] - plain[-1] == pytest.approx(depths * expected, rel=1e-9)
    assert list(kept[:-1]) == list(plain[:-1])


#: DeepSeek-V3 as Megatron-LM launches it (the model zoo's and
#: Megatron-Bridge's flags), bf16, 61 layers over 16 stages.
DEEPSEEK_ARGS = (
    DEEPSEEK_V3_MODEL_ARGS
    + "--mtp-num-layers 1 "
    + DEEPSEEK_V3_RUN_ARGS
    + "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 "
    "--expert-model-parallel-size 64 --decoder-first-pipeline-num-layers 3 "
    "--decoder-last-pipeline-num-layers 2"
)


def test_deepseek_v3_launch_is_predicted(capsys):
    """The launch of DeepSeek-V3 (MLA, MTP, 256 experts) at TP 1, PP 16, EP
    64 on 1,024 H100s is priced: a finite time, the preset's shape, the model
    FLOPs Megatron counts, and a fit in memory under full recomputation."""
    run = spec_from_megatron_args(DEEPSEEK_ARGS)
    assert run.spec.mla == DEEPSEEK.mla and run.spec.mtp_layers == 1
    assert run.spec.num_params == DEEPSEEK.num_params
    predicted = predict_megatron_run(run, "H100-SXM", 1024, load_gpu_sheet())
    seconds = predicted.prediction.iteration_time_s
    assert math.isfinite(seconds) and seconds > 0
    assert predicted.model_flops_per_iteration == pytest.approx(
        DEEPSEEK.model_flops_per_iteration(8192), rel=1e-12
    )
    assert predicted.prediction.fits_memory
    assert 0.05 < predicted.mfu < 0.8
    flags = ["predict", "--megatron-args", DEEPSEEK_ARGS, "--gpus", "H100-SXM:1024"]
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["experts"]["ep"] == 64
    assert data["iteration_time_s"] == pytest.approx(seconds, rel=1e-12)


def test_plan_model_plans_mla_and_mtp(tmp_path):
    """plan --model of a small MLA/MTP mixture of experts (refused before)."""
    from pipedejavu.planning import plan_model as module

    path = tmp_path / "small-mla.json"
    own = {**dataclasses.asdict(SMALL), "source": "a test model"}
    own["moe"]["layers"] = list(own["moe"]["layers"])
    path.write_text(json.dumps(own))
    space = one_knob_choice()
    found = module.plan_model(str(path), {"H100": 4}, 8, space=space)
    assert found.choice.spec.mla == SMALL.mla and found.choice.spec.mtp_layers == 1
    assert math.isfinite(found.result.prediction.iteration_time_s)
