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
    boundary_message_bytes,
    bytes_per_param,
    grad_reduce_bytes_per_param,
    interleaved_in_flight,
    interleaving_memory_factor,
    layer_activation_bytes,
    layer_input_bytes,
    optimizer_update_fraction,
    param_gather_bytes_per_param,
    param_state_bytes,
    recompute_time,
    recompute_working_bytes,
    recomputed_layers,
    stash_per_microbatch_bytes,
)
from pipedejavu.simulation.interleaved import simulate_interleaved

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


def test_the_papers_5as_over_h():
    # "5as/h = 80 for GPT-3" and 64 for MT-NLG (a = 128, h = 20480).
    for a, h, expected in ((96, 12288, 80), (128, 20480, 64)):
        full = layer_activation_bytes(S, 1, h, a, 1)
        none = layer_activation_bytes(S, 1, h, a, 1, attention_scores=False)
        np.testing.assert_allclose((full - none) / (S * h), expected)


@pytest.mark.parametrize(
    ("kwargs", "per_sbh"),
    [
        # s b h (10 + 24/t + 5as/(ht)) = 10 + 3 + 10
        ({}, 23.0),
        # sequence parallel: 34/t + 5as/(ht) = 4.25 + 10
        ({"sequence_parallel": True}, 14.25),
        # selective (no scores): 10 + 24/t, and 34/t with sequence parallelism
        ({"attention_scores": False}, 13.0),
        ({"attention_scores": False, "sequence_parallel": True}, 4.25),
    ],
)
def test_gpt3_layer_at_tp8(kwargs, per_sbh):
    np.testing.assert_allclose(
        layer_activation_bytes(S, 1, H, A, T, **kwargs), per_sbh * SBH, rtol=1e-12
    )


def test_gpt3_layer_by_bytes():
    # 23 x 25_165_824 = 578_813_952 bytes (552 MiB) per layer and micro-batch.
    assert layer_activation_bytes(S, 1, H, A, T) == 578_813_952
    # Without tensor parallelism: 34 + 80 = 114 s b h.
    assert layer_activation_bytes(S, 1, H, A) == 114 * SBH == 2_868_903_936


def test_fp32_elements():
    # e = 4: (4e + 2) + 12e = 66 s b h and (2e + 1) a s / h = 9 x 16 = 144.
    np.testing.assert_allclose(
        layer_activation_bytes(S, 1, H, A, element_bytes=4), (66 + 144) * SBH
    )
    assert activation_element_bytes("fp32") == 4
    assert [activation_element_bytes(p) for p in ("fp16", "bf16", "fp8")] == [2] * 3


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_papers_formulas(tp, micro_batch_size, sequence_parallel):
    s, b, h, a = 1024, micro_batch_size, 4096, 32
    scores = 5 * a * s / (h * tp)
    linear = 34 / tp if sequence_parallel else 10 + 24 / tp
    np.testing.assert_allclose(
        layer_activation_bytes(s, b, h, a, tp, sequence_parallel=sequence_parallel),
        s * b * h * (linear + scores),
        rtol=1e-12,
    )


def test_full_recomputation_stashes_the_input():
    assert layer_input_bytes(S, 1, H) == 2 * SBH == 50_331_648
    assert layer_input_bytes(S, 1, H, T, sequence_parallel=True) == 6_291_456
    assert boundary_message_bytes(S, 1, H, T) == 2 * SBH
    assert boundary_message_bytes(S, 1, H, T, sequence_parallel=True) == SBH / 4
    assert boundary_message_bytes(S, 1, H, element_bytes=4) == 4 * SBH


# Stash and working memory per option --------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "per_sbh"),
    [
        # 12 GPT-3 layers on a rank (96 layers, P = 8), t = 8, sequence parallel.
        ({"flash_attention": False}, 12 * 14.25),
        ({"flash_attention": True}, 12 * 4.25),  # flash: no s x s terms
        ({"recompute": "selective", "flash_attention": False}, 12 * 4.25),
        ({"recompute": "full"}, 12 * 0.25),
        # block method: the first 4 layers stash their inputs, 8 keep everything.
        (
            {"recompute": "full", "recompute_num_layers": 4, "flash_attention": False},
            4 * 0.25 + 8 * 14.25,
        ),
        ({"recompute": "full", "recompute_num_layers": 40}, 12 * 0.25),
    ],
)
def test_stash_per_microbatch(kwargs, per_sbh):
    got = stash_per_microbatch_bytes(
        12, S, 1, H, A, T, sequence_parallel=True, **kwargs
    )
    np.testing.assert_allclose(got, per_sbh * SBH, rtol=1e-12)


@pytest.mark.parametrize(
    ("recompute", "flash", "per_sbh"),
    [
        ("none", False, 0.0),
        ("selective", False, 10.0),  # one layer's scores, 5as/(ht)
        ("selective", True, 0.0),
        ("full", False, 14.25),  # one layer's activations
        ("full", True, 4.25),
    ],
)
def test_recompute_working_bytes(recompute, flash, per_sbh):
    got = recompute_working_bytes(
        S,
        1,
        H,
        A,
        T,
        recompute=recompute,
        sequence_parallel=True,
        flash_attention=flash,
    )
    np.testing.assert_allclose(got, per_sbh * SBH, rtol=1e-12)


def test_stash_on_arrays_of_spans():
    layers = np.array([1, 4, 12])
    got = stash_per_microbatch_bytes(
        layers, S, 1, H, A, T, recompute="full", recompute_num_layers=2
    )
    # min(L, 2) inputs (2 s b h) and the rest at 13 s b h (flash: no scores).
    np.testing.assert_allclose(
        got, (np.minimum(layers, 2) * 2 + (layers - np.minimum(layers, 2)) * 13) * SBH
    )


# Recomputation time ------------------------------------------------------------


def test_recomputed_layers_block_method():
    assert recomputed_layers(12, "full") == 12
    assert recomputed_layers(12, "full", 4) == 4
    assert recomputed_layers(12, "full", 40) == 12
    assert recomputed_layers(12, "selective") == 0
    assert recomputed_layers(12, "none") == 0


def test_recompute_time():
    assert recompute_time("none", 3.0, 0.5) == 0.0
    assert recompute_time("selective", 3.0, 0.5) == 0.5
    assert recompute_time("full", 3.0, 0.5) == 3.0
    np.testing.assert_allclose(
        recompute_time("full", np.array([1.0, 2.0]), np.array([0.1, 0.2])), [1.0, 2.0]
    )


# Interleaving ------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("num_chunks", [1, 2, 3])
def test_interleaved_in_flight_is_the_simulators(num_ranks, num_chunks):
    count = 3 * num_ranks
    shape = (num_ranks, num_chunks)
    result = simulate_interleaved(np.ones(shape), np.full(shape, 2.0), count)
    expected = [
        interleaved_in_flight(r, num_ranks, num_chunks, count) for r in range(num_ranks)
    ]
    np.testing.assert_array_equal(result.peak_in_flight, expected)


@pytest.mark.parametrize(("num_ranks", "num_chunks"), [(2, 2), (4, 2), (8, 3)])
def test_interleaving_memory_factor(num_ranks, num_chunks):
    # Rank 0 holds V P + P - 1 chunks of 1 / V of its layers: P (1 + (P-1)/(PV)).
    peak = interleaved_in_flight(0, num_ranks, num_chunks, 4 * num_ranks)
    assert peak == num_chunks * num_ranks + num_ranks - 1
    np.testing.assert_allclose(
        peak / num_chunks, num_ranks * interleaving_memory_factor(num_ranks, num_chunks)
    )
    assert interleaving_memory_factor(4, 2) == 1 + 3 / 8


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
        (lambda: recomputed_layers(4, "partial"), "recompute must be one of"),
        (
            lambda: stash_per_microbatch_bytes(4, S, 1, H, A, recompute="all"),
            "recompute must be one of",
        ),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_precision_has_rules():
    for precision in TRAINING_PRECISIONS:
        assert bytes_per_param(precision) >= 16
        assert activation_element_bytes(precision) in (2, 4)
