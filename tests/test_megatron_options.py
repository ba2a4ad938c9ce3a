"""The training-option rules against hand-computed numbers: Megatron-LM's bytes
per parameter, Korthikanti et al.'s activation formulas on their GPT-3 175B
example, recomputation, interleaving's in-flight memory."""

from __future__ import annotations

import numpy as np
import pytest

from pipedejavu.core.training_options import TRAINING_PRECISIONS
from pipedejavu.costmodel.megatron.constants import BYTES_PER_PARAM
from pipedejavu.costmodel.megatron.options import (
    activation_element_bytes,
    bytes_per_param,
    grad_reduce_bytes_per_param,
    optimizer_update_fraction,
    param_gather_bytes_per_param,
    param_gather_share,
    param_state_bytes,
    recompute_time,
)

# GPT-3 175B as in Korthikanti et al. (MLSys'23): s, h, a, t; b = 1.
S, H, A, T = 2048, 12288, 96, 8
SBH = S * 1 * H  # 25_165_824


# Parameters ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "plain", "replicated", "shardable"),
    [
        # Megatron-LM docs/user-guide/features/dist_optimizer.md: 16 / 8 + 8/d,
        # 18 / 6 + 12/d (bf16 weights, fp32 gradients), 20 / 4 + 16/d (fp16).
        ("fp32", 16, 8, 8),
        ("bf16", 18, 6, 12),
        ("fp16", 20, 4, 16),
        ("fp8", 18, 6, 12),
    ],
)
def test_bytes_per_param_are_megatrons(precision, plain, replicated, shardable):
    assert param_state_bytes(precision) == (replicated, shardable)
    assert bytes_per_param(precision) == plain
    assert bytes_per_param(precision, distributed_optimizer=True) == plain
    np.testing.assert_allclose(
        bytes_per_param(precision, distributed_optimizer=True, data_parallel=8),
        replicated + shardable / 8,
    )
    np.testing.assert_allclose(
        bytes_per_param(
            precision, distributed_optimizer=True, data_parallel=np.array([1, 2, 4])
        ),
        [plain, replicated + shardable / 2, replicated + shardable / 4],
    )


def test_fp32_is_the_predictors_constant():
    # The fp32 predictor's model state (rules.model_state_bytes) stays 16 B.
    assert bytes_per_param("fp32") == BYTES_PER_PARAM == 16


def test_hand_numbers_of_the_distributed_optimizer():
    # bf16 on 64 data-parallel ranks: 6 + 12 / 64 = 6.1875 bytes.
    assert bytes_per_param("bf16", distributed_optimizer=True, data_parallel=64) == (
        6.1875
    )
    assert optimizer_update_fraction(True, 64) == 1 / 64
    assert optimizer_update_fraction(False, 64) == 1.0


@pytest.mark.parametrize(
    ("precision", "grad", "gather"),
    [("fp32", 4, 4), ("bf16", 4, 2), ("fp16", 2, 2), ("fp8", 4, 2)],
)
def test_data_parallel_traffic_per_param(precision, grad, gather):
    assert grad_reduce_bytes_per_param(precision) == grad
    assert param_gather_bytes_per_param(precision, True) == gather
    assert param_gather_bytes_per_param(precision, False) == 0


# Activations: the paper's GPT-3 example ----------------------------------------


def test_recompute_time():
    assert recompute_time("none", 3.0, 0.5) == 0.0
    assert recompute_time("selective", 3.0, 0.5) == 0.5
    assert recompute_time("full", 3.0, 0.5) == 3.0
    np.testing.assert_allclose(
        recompute_time("full", np.array([1.0, 2.0]), np.array([0.1, 0.2])), [1.0, 2.0]
    )


# Interleaving ------------------------------------------------------------------


# Arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: bytes_per_param("fp64"), "precision must be one of"),
        (lambda: param_state_bytes("tf32"), "precision must be one of"),
        (lambda: activation_element_bytes("int8"), "precision must be one of"),
        (
            lambda: bytes_per_param(
                "bf16", distributed_optimizer=True, data_parallel=0
            ),
            "data_parallel must be >= 1",
        ),
        (lambda: recompute_time("some", 1.0, 1.0), "recompute must be one of"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_precision_has_rules():
    for precision in TRAINING_PRECISIONS:
        assert bytes_per_param(precision) >= 16
        assert activation_element_bytes(precision) in (2, 4)


# Activations: the predictor's per-operation count (costmodel.analytical.layers)
# against Korthikanti et al.'s closed form (MLSys'23, Table 2), the oracle.


def _korthikanti_per_sbh(recompute, sequence_parallel, tp, a, s, h):
    """Bytes per ``s b h`` of one GPT layer in 16-bit with dropout, no flash."""
    scores = 5 * a * s / (h * tp)
    base = 34 / tp if sequence_parallel else 10 + 24 / tp
    if recompute == "full":
        return 2 / tp if sequence_parallel else 2
    if recompute == "selective":
        return base
    return base + scores


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize(
    ("layers", "h", "a", "tp", "mbs"),
    [(96, 12288, 96, 8, 1), (105, 20480, 128, 8, 1), (24, 2048, 16, 2, 4)],
)
def test_activations_follow_korthikanti(
    recompute, sequence_parallel, layers, h, a, tp, mbs
):
    from pipedejavu.core.transformer import TransformerSpec
    from pipedejavu.costmodel.analytical.layers import activation_bytes

    s = 2048
    spec = TransformerSpec(
        "gpt", layers, h, a, a, 4 * h, 51200, s, max_position_embeddings=s
    )
    block = activation_bytes(
        spec,
        mbs,
        tp,
        "fp16",
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        flash_attention=False,
        attention_dropout=True,
    )[1]
    expected = _korthikanti_per_sbh(recompute, sequence_parallel, tp, a, s, h)
    np.testing.assert_allclose(block / (s * mbs * h), expected, rtol=1e-12)


def _a100_plan(stages, model, gbs):
    """A plan of ``(start, stop, tp)`` stages on A100-80 nodes, DP 2."""
    from pipedejavu.costmodel.megatron.tables import plan_from_stages

    return plan_from_stages(
        stages,
        gpu_type="A100-80",
        dp=2,
        mbs=1,
        gbs=gbs,
        model=model,
        gpus_per_node=8,
        zone="z",
    )


def _block_sources(n_values, **options):
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.planning.any_model import choose_cost_source

    def source(**extra):
        return choose_cost_source(
            "Llama-3-8B",
            {"A100-80": 16},
            options=TrainingOptions("bf16", **options, **extra),
            seq_length=4096,
        )

    return (
        source(),
        source(recompute="full"),
        {n: source(recompute="full", recompute_num_layers=n) for n in n_values},
    )


def test_block_recomputation_reruns_the_first_blocks_of_a_stage():
    """Megatron's block method on one stage of all 32 blocks: time and memory
    move from no recomputation to full by n / 32 (each block reruns the same
    forward and keeps the same activations), and at n >= 32 it is full."""
    from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
    from pipedejavu.costmodel.megatron.predictor import predict_plan

    none, full, block = _block_sources((1, 5, 32, 40))
    layers = none.data.model_info(none.model).num_layers
    plan = _a100_plan([(0, layers, 8)], none.model, 16)

    def predicted(choice):
        found = predict_plan(plan, choice.data, constants=C)
        return found.iteration_time_s, float(found.stage_memory_bytes[0])

    t0, m0 = predicted(none)
    t1, m1 = predicted(full)
    assert t1 > t0 and m1 < m0
    for n, choice in block.items():
        t, m = predicted(choice)
        share = min(n, 32) / 32
        assert t - t0 == pytest.approx(share * (t1 - t0), rel=1e-9)
        assert m - m0 == pytest.approx(share * (m1 - m0), rel=1e-9)


@pytest.mark.parametrize(("chunks", "zero_bubble"), [(1, False), (2, False), (1, True)])
def test_block_recomputation_applies_per_stage_and_chunk(chunks, zero_bubble):
    """Four stages of 8 blocks (the first and last also hold the embedding and
    the head): n >= the blocks of a model chunk is full recomputation, n = 1
    lies strictly between, on every stage, in 1F1B, interleaved and ZB-H1."""
    from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
    from pipedejavu.costmodel.megatron.predictor import predict_plan

    per_chunk = 8 // chunks
    none, full, block = _block_sources(
        (1, per_chunk, 32), zero_bubble=zero_bubble, sequence_parallel=True
    )
    layers = none.data.model_info(none.model).num_layers
    stages = [(0, 9, 2), (9, 17, 2), (17, 25, 2), (25, layers, 2)]
    plan = _a100_plan(stages, none.model, 64)

    def predicted(choice):
        found = predict_plan(plan, choice.data, constants=C, virtual_stages=chunks)
        return found.iteration_time_s, found.stage_memory_bytes

    t0, m0 = predicted(none)
    t1, m1 = predicted(full)
    for n in (per_chunk, 32):
        t, m = predicted(block[n])
        assert t == pytest.approx(t1, rel=1e-12)
        assert np.allclose(m, m1, rtol=1e-12)
    t, m = predicted(block[1])
    assert t0 < t < t1
    assert (m1 < m).all() and (m < m0).all()


def test_bf16_gradients_are_two_bytes_where_fp32_takes_four():
    for precision in ("bf16", "fp8"):
        plain = param_state_bytes(precision)
        halved = param_state_bytes(precision, bf16_grads=True)
        assert plain.replicated - halved.replicated == 2
        assert plain.shardable == halved.shardable
        assert grad_reduce_bytes_per_param(precision, bf16_grads=True) == 2
        assert param_gather_share(precision) == 0.5
        assert param_gather_share(precision, bf16_grads=True) == 1.0
    for precision in ("fp32", "fp16"):
        with pytest.raises(ValueError, match="bf16 gradients"):
            param_state_bytes(precision, bf16_grads=True)
