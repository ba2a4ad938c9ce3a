"""Parameters, memory and FLOPs of mixture-of-experts, multi-latent-attention
and multi-token-prediction models (core/moe_counts.py), checked against
checkpoints' parameter counts, Megatron-LM's own theoretical-memory formula
(tests/fixtures/megatron_moe_memory.json, made by make_megatron_moe_memory.py)
and the TFLOP/s NVIDIA published for thirteen MoE runs on H100."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import QWEN3_30B_A3B, decoder_spec

from pipedejavu.core.moe import MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.core.moe_counts import (
    block_param_parts,
    block_param_split,
    layer_param_split,
    moe_state_bytes,
    mtp_param_split,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.planning.published_runs import load_moe_published_runs

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_moe_memory.json"

DEEPSEEK_V3 = decoder_spec(
    name="DeepSeek-V3",
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    num_query_groups=128,
    ffn_hidden_size=18432,
    vocab_size=129280,
    seq_length=4096,
    moe=MoeSpec(256, 8, 2048, 2048, layers=moe_layer_pattern(61, first_dense=3)),
    mla=MlaSpec(1536, 512, 128, 64, 128),
    qk_layernorm=True,
)


# ------------------------------------------------------------ checkpoints
def test_total_and_active_parameters_equal_the_checkpoints():
    # Qwen3-30B-A3B's safetensors hold 30,532,122,624 elements; 3,353,032,704
    # pass a token (8 of 128 experts)
    assert QWEN3_30B_A3B.num_params == 30_532_122_624
    assert QWEN3_30B_A3B.active_params == 3_353_032_704
    # DeepSeek-V3's main model (no MTP module): 671,026,419,200 elements, of
    # which 58 x 256 are the routers' score-correction biases (a buffer in
    # Megatron-Core, not a parameter); 37,552,282,624 active
    assert DEEPSEEK_V3.num_params == 671_026_419_200 - 58 * 256
    assert DEEPSEEK_V3.active_params == 37_552_282_624


OLMOE_1B_7B = decoder_spec(
    name="OLMoE-1B-7B-0924",
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    num_query_groups=16,
    ffn_hidden_size=1024,
    vocab_size=50304,
    seq_length=4096,
    moe=MoeSpec(64, 8, 1024),
    qk_layernorm="projection",
)


def test_query_key_norms_over_the_projection_equal_olmoes_checkpoint():
    # allenai/OLMoE-1B-7B-0924's safetensors hold 6,919,161,856 elements
    # (the Hub's safetensors total; "6.92B"): its q_norm is h wide and its
    # k_norm g d wide, not one head's width; 1.28B pass a token (8 of 64)
    assert OLMOE_1B_7B.num_params == 6_919_161_856
    assert OLMOE_1B_7B.active_params == 6_919_161_856 - 16 * 56 * 3 * 2048 * 1024
    assert round(OLMOE_1B_7B.active_params / 1e9, 2) == 1.28
    parts = block_param_parts(OLMOE_1B_7B, 0)
    assert parts["attention_norms"] == 2048 + 16 * 128
    # per head (Megatron-Core's --qk-layernorm, Qwen3): one d-wide norm each
    per_head = dataclasses.replace(OLMOE_1B_7B, qk_layernorm=True)
    assert block_param_parts(per_head, 0)["attention_norms"] == 2 * 128
    # split with the heads they normalize: a quarter of each at tp 4, and the
    # key norm of the one key/value head a GPU holds when tp exceeds g
    assert block_param_parts(OLMOE_1B_7B, 0, tp=4)["attention_norms"] == 1024
    few_groups = dataclasses.replace(OLMOE_1B_7B, num_query_groups=2)
    assert block_param_parts(few_groups, 0, tp=4)["attention_norms"] == 512 + 128
    # weightless norms (Llama 4's L2 norm): none
    bare = dataclasses.replace(OLMOE_1B_7B, qk_layernorm=False)
    assert OLMOE_1B_7B.num_params - bare.num_params == 16 * 4096


def test_expert_blocks_without_shared_experts_have_no_shared_bias():
    # GPT-OSS: biases on every linear layer, no shared expert. Counted by hand
    # from openai/gpt-oss's model (gpt_oss/torch/model.py): per block the qkv
    # and output projections with biases, two norms, the router with its bias,
    # 128 experts of (2 x 2880 + 2880) x 2880 weights and 5760 + 2880 biases;
    # embedding, unembedding, final norm. Its 64 attention sinks a block are
    # not represented: 116,829,156,672 - 36 x 64 ("116.83B", its model card).
    h, heads, groups, d, experts = 2880, 64, 8, 64, 128
    attention = h * (heads + 2 * groups) * d + (heads + 2 * groups) * d
    attention += heads * d * h + h
    expert = 3 * h * h + 2 * h + h
    block = attention + 2 * h + experts * h + experts + experts * expert
    total = 36 * block + 2 * 201088 * h + h
    assert total == 116_829_156_672 - 36 * 64
    spec = decoder_spec(
        name="GPT-OSS-120B",
        num_layers=36,
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        ffn_hidden_size=h,
        vocab_size=201088,
        seq_length=4096,
        linear_bias=True,
        moe=MoeSpec(experts, 4, h),
    )
    assert spec.num_params == total
    assert block_param_parts(spec, 0)["mlp_bias"] == 0


def test_query_key_norm_scope_is_checked():
    with pytest.raises(ValueError, match="qk_layernorm must be true, false or"):
        dataclasses.replace(OLMOE_1B_7B, qk_layernorm="head")
    with pytest.raises(ValueError, match="needs grouped-query attention"):
        dataclasses.replace(DEEPSEEK_V3, qk_layernorm="projection")


def test_split_per_gpu_shards_experts_over_ep_and_etp():
    spec = DEEPSEEK_V3
    whole = block_param_parts(spec, 10)  # an expert block
    parts = block_param_parts(spec, 10, tp=4, ep=8, etp=2)
    assert parts["experts"] * 8 * 2 == whole["experts"]  # 32 experts, each / 2
    assert parts["router"] == whole["router"] == 256 * 7168  # replicated
    assert parts["attention_duplicated"] == whole["attention_duplicated"] > 0
    assert parts["attention"] * 4 == whole["attention"]
    assert parts["mlp"] * 4 == whole["mlp"] == 3 * 7168 * 2048  # shared expert
    # a dense block has no expert part; etp defaults to tp
    assert block_param_split(spec, 0, 4, 8)[1] == 0
    assert block_param_split(spec, 10, 4, 8) == block_param_split(spec, 10, 4, 8, 4)
    with pytest.raises(ValueError, match="ep 3 must divide num_experts"):
        block_param_split(spec, 10, 1, 3)
    with pytest.raises(ValueError, match="etp 3 must divide"):
        block_param_split(spec, 10, 1, 1, 3)


def test_mtp_lives_with_the_head_and_the_last_stage_holds_the_embedding():
    spec = dataclasses.replace(DEEPSEEK_V3, mtp_layers=1)
    plain = layer_param_split(DEEPSEEK_V3, 8, 64, 1)
    pairs = layer_param_split(spec, 8, 64, 1)
    assert pairs[:-1] == plain[:-1]
    mtp = mtp_param_split(spec, 8, 64, 1)
    assert pairs[-1] == (plain[-1][0] + mtp[0], mtp[1])
    # MTP depth = the last block + 3 norms + the 2h -> h projection over tp
    last = block_param_split(spec, 60, 8, 64, 1)
    assert mtp == (last[0] + 3 * 7168 + 2 * 7168 * 7168 // 8, last[1])
    # a last stage without layer 0 holds the whole embedding for MTP
    copy = layer_param_split(spec, 8, 64, 1, tied_copy=True)
    assert copy[-1][0] - pairs[-1][0] == spec.embedding_params(8)
    # DeepSeek-V3 with its MTP module: 671B + 11.5B (its embedding and head are
    # the model's)
    assert spec.num_params - DEEPSEEK_V3.num_params == sum(mtp_param_split(spec))


def test_dense_layer_params_are_the_split_dense_part():
    dense = dataclasses.replace(QWEN3_30B_A3B, moe=None, kv_channels=None)
    assert dense.is_dense
    pairs = dense.layer_param_split(4)
    assert dense.layer_params(4) == tuple(d for d, _ in pairs)
    assert all(e == 0 for _, e in pairs)
    assert dense.layer_params(4, tied_copy=True) == tuple(
        d for d, _ in dense.layer_param_split(4, tied_copy=True)
    )


# ---------------------------------------------------- Megatron's formula
def _spec_of(args: dict) -> TransformerSpec:
    layers = args["num_layers"]
    freq = args["moe_layer_freq"]
    pattern = (
        moe_layer_pattern(layers, freq=freq)
        if isinstance(freq, int)
        else tuple(bool(flag) for flag in freq)
    )
    mla = None
    if args["multi_latent_attention"]:
        mla = MlaSpec(
            args["q_lora_rank"] or 0,
            args["kv_lora_rank"],
            args["qk_head_dim"],
            args["qk_pos_emb_head_dim"],
            args["v_head_dim"],
        )
    shared = args["moe_shared_expert_intermediate_size"] or 0
    return TransformerSpec(
        name="random",
        num_layers=layers,
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"],
        ffn_hidden_size=args["ffn_hidden_size"],
        vocab_size=args["vocab_size"],
        vocab_divisible_by=args["make_vocab_size_divisible_by"],
        seq_length=4096,
        gated_mlp=args["swiglu"],
        norm="rmsnorm" if args["normalization"] == "RMSNorm" else "layernorm",
        position="rotary",
        tied_embeddings=not args["untie_embeddings_and_output_weights"],
        linear_bias=args["add_bias_linear"],
        moe=MoeSpec(
            args["num_experts"],
            args["moe_router_topk"],
            args["moe_ffn_hidden_size"],
            shared,
            layers=pattern,
            shared_expert_gate=args.get("moe_shared_expert_gate", False),
        ),
        mla=mla,
        mtp_layers=args["mtp_num_layers"] or 0,
        qk_layernorm=args["qk_layernorm"],
    )


def _as_megatron_counts(parts: dict, spec: TransformerSpec, tp: int) -> tuple:
    """One block's (dense, expert) as Megatron's formula counts it: the
    multi-latent down projections and latent norms divided over TP (and the
    latent norms there whether or not --qk-layernorm builds them); no
    per-head query/key norms, no linear biases but the router's."""
    dense = parts["attention"] + parts["norms"] + parts["mlp"]
    dense += parts["router"] + parts["shared_gate"]
    mla = spec.mla
    if mla is not None:
        norm = 2 if spec.norm == "layernorm" else 1
        dense += parts["attention_duplicated"] / tp
        dense += norm * (mla.q_lora_rank + mla.kv_lora_rank) / tp
    return dense, parts["experts"]


def _most_loaded(spec: TransformerSpec, args: dict, blocks: list, mtp: tuple):
    """Megatron's "most loaded shard" built from per-block (dense, expert)
    counts: the first stage's embedding, 1/pp of the blocks and the final
    norm, every MTP depth, and the untied head when there is one stage."""
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    word = spec.padded_vocab_size(tp) // tp * spec.hidden_size
    norm = 2 * spec.hidden_size if spec.norm == "layernorm" else spec.hidden_size
    dense = word + (sum(d for d, _ in blocks) + norm) / pp
    dense += spec.mtp_layers * mtp[0]
    if not spec.tied_embeddings and pp == 1:
        dense += word
    expert = sum(e for _, e in blocks) / pp + spec.mtp_layers * mtp[1]
    return dense, expert


def _bytes(args: dict, dense: float, expert: float) -> float:
    """Megatron's byte rule: 18 bytes a parameter without the distributed
    optimizer; 6 + 12 / dp with it, dense parameters sharded over dp (CP is
    1 here), experts over edp = tp dp / (etp ep)."""
    edp = args["world_size"] // (
        args["expert_tensor_parallel_size"]
        * args["expert_model_parallel_size"]
        * args["pipeline_model_parallel_size"]
    )
    distributed = args["use_distributed_optimizer"]
    return moe_state_bytes(
        dense,
        expert,
        dense_shards=args["data_parallel_size"],
        expert_shards=edp,
        bytes_per_param=6 if distributed else 18,
        sharded_bytes_per_param=12 if distributed else 0,
    )


def _compare(config: dict) -> dict:
    args, megatron = config["args"], config["megatron"]
    spec = _spec_of(args)
    tp = args["tensor_model_parallel_size"]
    ep, etp = args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]
    assert spec.padded_vocab_size(tp) == args["padded_vocab_size"]
    parts = [block_param_parts(spec, b, tp, ep, etp) for b in range(spec.num_layers)]
    ours = _most_loaded(
        spec,
        args,
        [block_param_split(spec, b, tp, ep, etp) for b in range(spec.num_layers)],
        mtp_param_split(spec, tp, ep, etp) if spec.mtp_layers else (0, 0),
    )
    last = _as_megatron_counts(parts[-1], spec, tp)
    as_megatron = _most_loaded(
        spec, args, [_as_megatron_counts(p, spec, tp) for p in parts], last
    )
    return {
        "fold": np.sign(ep * etp - tp),
        "omitted_by_megatron": bool(spec.mtp_layers)
        or (spec.mla is not None and tp > 1),
        "ours": ours,
        "as_megatron": as_megatron,
        "megatron": (megatron["dense_params"], megatron["expert_params"]),
        "bytes": _bytes(args, *ours),
        "megatron_bytes": megatron["bytes"],
        "rule_on_megatron_params": _bytes(
            args, megatron["dense_params"], megatron["expert_params"]
        ),
        "old_bytes": megatron["bytes_core_v0_16_1"],
    }


@pytest.fixture(scope="module")
def comparisons() -> list[dict]:
    data = json.loads(FIXTURE.read_text())
    assert data["megatron"]["ref"] == "core_v0.19.0" and len(data["configs"]) == 200
    return [_compare(config) for config in data["configs"]]


def test_parts_megatron_counts_equal_megatrons_on_200_configs(comparisons):
    """Where Megatron's formula counts a part, it counts what we count: the
    dense and expert parameters of its most loaded shard, rebuilt from our
    per-block parts with its simplifications, equal its own to 1e-9."""
    for c in comparisons:
        np.testing.assert_allclose(c["as_megatron"], c["megatron"], rtol=1e-9)
    # and its byte rule is moe_state_bytes with its constants
    for c in comparisons:
        np.testing.assert_allclose(
            c["rule_on_megatron_params"], c["megatron_bytes"], rtol=1e-9
        )


def test_weights_gradients_optimizer_within_1pct_of_megatron(comparisons):
    """Our exact per-GPU bytes against Megatron-LM core_v0.19.0's formula,
    shard for shard. Its formula leaves out, by design, the query/key norms
    and the linear biases (within 0.5% here), and two larger parts: the MTP
    depths' ``2h -> h`` projection and norms, and the duplicated multi-latent
    down projections, which it divides over TP. Where neither is there, the
    bytes agree within 1%; where they are, we count more, never less."""
    error = np.array([c["bytes"] / c["megatron_bytes"] - 1 for c in comparisons])
    plain = np.array([not c["omitted_by_megatron"] for c in comparisons])
    assert plain.sum() >= 60
    assert np.abs(error[plain]).max() < 0.01, np.abs(error[plain]).max()
    assert error.min() > -1e-4 and error[~plain].max() > 0.01


def test_older_megatron_formula_splits_experts_over_tp(comparisons):
    """Megatron-LM core_v0.16.1's formula (what the launchers' release ships)
    splits every expert over TP and shards their optimizer state over DP: it
    agrees with the expert-aware one (within its router and gate, 0.5%) only
    where etp x ep = tp, over-reports where the experts are spread wider and
    under-reports where narrower."""
    old = np.array([c["old_bytes"] / c["megatron_bytes"] - 1 for c in comparisons])
    fold = np.array([c["fold"] for c in comparisons])
    assert (fold == 0).sum() and (fold > 0).sum() and (fold < 0).sum()
    assert np.abs(old[fold == 0]).max() < 0.005
    assert old[fold > 0].min() > 0.02 and np.median(old[fold > 0]) > 0.5
    assert old[fold < 0].max() < -0.03 and np.median(old[fold < 0]) < -0.3


# -------------------------------------------------------------- FLOPs
def _rounding(run) -> float:
    """Relative rounding of the published numbers behind a FLOPs-per-token
    figure: TFLOP/s to the unit, tokens/s to the unit or the step time to
    0.1 s."""
    bound = 0.5 / run.tflops_per_gpu
    if run.tokens_per_s_per_gpu is not None:
        return bound + 0.5 / run.tokens_per_s_per_gpu
    return bound + 0.05 / run.iteration_time_s


def _errors(**conventions) -> dict[str, float]:
    out = {}
    for run in load_moe_published_runs():
        published = run.published_flops_per_token
        if published is None:
            continue
        count_gate = conventions.get("count_gate", run.count_gate)
        flops = run.spec.model_flops_per_iteration(
            run.global_batch,
            run.tp,
            causal=conventions.get("causal"),
            count_gate=count_gate,
        )
        out[run.run_id] = (
            flops / (run.global_batch * run.spec.seq_length) / published - 1
        )
    return out


def test_model_flops_reproduce_the_published_tflops():
    """Model TFLOP/s per GPU of the 12 runs with a measured throughput: our
    FLOPs per token over the FLOPs per token the published TFLOP/s and
    tokens/s (or step time) imply. Each within the rounding of its published
    numbers plus 0.1% (the two figures may average different iterations):
    the rounding alone reaches 0.47% on the ModelZoo rows."""
    runs = load_moe_published_runs()
    assert len(runs) == 13
    # the 13th states TFLOP/s only (its time is derived from them): not a check
    assert [run.published_flops_per_token is None for run in runs].count(True) == 1
    errors = _errors()
    assert len(errors) == 12
    by_id = {run.run_id: run for run in runs}
    for run_id, error in errors.items():
        assert abs(error) <= _rounding(by_id[run_id]) + 1e-3, (run_id, error)
    values = np.abs(list(errors.values()))
    assert np.median(values) < 0.002 and values.max() < 0.0055


@pytest.mark.parametrize(
    "conventions, smallest",
    [
        (dict(causal=False), 0.10),  # the full attention square: 10-21% more
        (dict(count_gate=True), None),  # GPT-OSS's gate counted: 26% more
    ],
)
def test_the_check_sees_a_convention_change(conventions, smallest):
    errors = _errors(**conventions)
    if smallest is not None:
        assert min(errors.values()) > smallest
    else:
        gpt_oss = [e for run_id, e in errors.items() if "GPTOSS" in run_id]
        assert len(gpt_oss) == 1 and gpt_oss[0] > 0.2


def test_moe_flops_formula_by_hand():
    """Qwen3-30B-A3B per token, as Megatron-Bridge's formula reads:
    6 (h (3 f_e k) L + L (h (q + 2 g d) + q s / 2 * 2 + q h) + h V)."""
    h, layers, s, q, kv, vocab = 2048, 48, 4096, 32 * 128, 2 * 4 * 128, 151936
    per_token = 6 * (
        h * 3 * 768 * 8 * layers + layers * (h * (q + kv) + q * s + q * h) + h * vocab
    )
    assert QWEN3_30B_A3B.model_flops_per_iteration(3) == 3 * s * per_token
    # recomputation adds forwards of the named blocks; dense and expert blocks
    # differ in cost, so a bare count of some is refused
    spec = dataclasses.replace(
        QWEN3_30B_A3B, moe=MoeSpec(128, 8, 768, layers=moe_layer_pattern(48, freq=2))
    )
    everything = spec.hardware_flops_per_iteration(1, None)
    flags = (True,) * 48
    assert spec.hardware_flops_per_iteration(1, flags) == everything
    some = spec.hardware_flops_per_iteration(1, (True,) + (False,) * 47)
    assert spec.model_flops_per_iteration(1) < some < everything
    with pytest.raises(ValueError, match="name the recomputed blocks"):
        spec.hardware_flops_per_iteration(1, 3)
    with pytest.raises(ValueError, match="48 true/false flags"):
        spec.hardware_flops_per_iteration(1, (True,))


def test_moe_record_refused_with_one_line(tmp_path):
    data = json.loads(
        (
            Path(__file__).parents[1] / "pipedejavu/data/published/moe_h100.json"
        ).read_text()
    )
    data["runs"][0]["model"]["num_experts"] = "many"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProblemError, match="run 0: model.num_experts must be"):
        load_moe_published_runs(str(path))


def test_mla_mtp_flops_as_megatron_writes_them():
    """DeepSeek-V3 with one MTP depth, per token, term by term as
    Megatron-LM's num_floating_point_operations (core_v0.16.1) writes them."""
    spec = dataclasses.replace(DEEPSEEK_V3, mtp_layers=1, vocab_divisible_by=128)
    h, s, a, vocab = 7168, 4096, 128, spec.padded_vocab_size(1)
    q_lora, kv_lora, qk, rope, v = 1536, 512, 128, 64, 128
    dense_layers, moe_layers = 3, 58 + 1  # the MTP depth is an expert block
    mlp = h * (18432 * 3 * dense_layers + (2048 * 8 * 3 + 2048 * 3) * moe_layers)
    attention = (
        q_lora * (h + a * (qk + rope) + 1)
        + kv_lora * (h + a * (qk + v) + 1)
        + h * rope
        + a * v * h
        + s * a * (qk + rope) / 2
        + s * a * v / 2
    ) * 62
    per_token = 6 * (mlp + attention + (3 * h + 2 * h * h) + h * vocab * 2)
    np.testing.assert_allclose(
        spec.model_flops_per_iteration(2) / (2 * s), per_token, rtol=1e-12
    )
