"""Tests of costmodel.layers and costmodel.synthesize (synthetic instances)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    InfeasibleProblemError,
    Problem,
    evaluate,
)
from pipedejavu.costmodel.stage.layers import (
    LayerSpec,
    boundary_activation_bytes,
    gpt_layers,
    irregular_layers,
)
from pipedejavu.costmodel.stage.synthesis import (
    AlphaBetaComm,
    stage_cost_table,
    synthesize,
)
from pipedejavu.search.alpa.exact import exact_dp

SMALL_GPT = dict(hidden=64, seq_len=32, micro_batch=2, vocab=100)


class ZeroComm:
    """Free communication: isolates the compute term."""

    def predict_collective(self, collective, num_devices, num_bytes, crosses_hosts):
        return np.zeros_like(np.asarray(num_bytes, dtype=np.float64))


class ScalarComm:
    """AlphaBetaComm that refuses arrays (exercises the per-value fallback)."""

    def __init__(self):
        self.inner = AlphaBetaComm()
        self.calls = 0

    def predict_collective(self, collective, num_devices, num_bytes, crosses_hosts):
        if not isinstance(num_bytes, float):
            raise TypeError("scalars only")
        self.calls += 1
        return float(
            self.inner.predict_collective(
                collective, num_devices, num_bytes, crosses_hosts
            )
        )


# Layers ------------------------------------------------------------------------


def test_gpt_layer_formulas():
    b, s, h, v, p = 4, 512, 1024, 50000, 2
    layers = gpt_layers(6, h, s, b, v, p)
    assert [layer.name for layer in layers] == [
        "embedding",
        "block_0",
        "block_1",
        "block_2",
        "block_3",
        "lm_head",
    ]
    block = layers[1]
    np.testing.assert_allclose(
        block.forward_flops, 24 * b * s * h**2 + 4 * b * s**2 * h, rtol=1e-15
    )
    np.testing.assert_allclose(block.param_bytes, (12 * h**2 + 13 * h) * p)
    np.testing.assert_allclose(block.output_bytes, b * s * h * p)
    np.testing.assert_allclose(block.stash_bytes, 34 * b * s * h)  # Megatron's 34sbh
    assert (block.tp_allreduces, block.tp_allreduce_bytes) == (4, b * s * h * p)
    assert all(
        layer == dataclasses.replace(block, name=layer.name) for layer in layers[1:-1]
    )
    embedding, head = layers[0], layers[-1]
    assert embedding.param_bytes > block.param_bytes  # the vocabulary table
    np.testing.assert_allclose(head.forward_flops, 2 * b * s * h * v)
    assert head.forward_flops > block.forward_flops
    assert head.stash_bytes > block.stash_bytes  # fp32 logits
    with_scores = gpt_layers(6, h, s, b, v, p, num_heads=16)[1]
    np.testing.assert_allclose(
        with_scores.stash_bytes - block.stash_bytes, 5 * 16 * s**2 * b
    )


def test_irregular_layers_are_mixed_and_seeded():
    layers = irregular_layers(64, seed=7)
    assert len(layers) == 64
    assert layers == irregular_layers(64, seed=7)
    assert layers != irregular_layers(64, seed=8)
    kinds = {layer.name.split("_")[0] for layer in layers[1:-1]}
    assert kinds == {"dense", "moe", "conv", "light"}
    flops = np.array([layer.forward_flops for layer in layers[1:-1]])
    assert flops.max() / flops.min() > 100


def test_boundary_activation_bytes():
    layers = irregular_layers(10, seed=0)
    bytes_ = boundary_activation_bytes(layers)
    assert bytes_.shape == (9,) and bytes_.dtype == np.float64
    np.testing.assert_allclose(
        bytes_, [2 * layer.output_bytes for layer in layers[:-1]]
    )


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(forward_flops=-1.0), "forward_flops"),
        (dict(param_bytes=float("nan")), "param_bytes"),
        (dict(stash_bytes="1"), "stash_bytes"),
        (dict(tp_allreduces=1.5), "tp_allreduces"),
        (dict(name=3), "name"),
    ],
)
def test_layer_spec_validation(changes, match):
    fields = dict(
        name="x", forward_flops=1.0, param_bytes=1.0, output_bytes=1.0, stash_bytes=1.0
    )
    with pytest.raises(ValueError, match=match):
        LayerSpec(**{**fields, **changes})


def test_gpt_layers_validation():
    with pytest.raises(ValueError, match="num_layers .* >= 3"):
        gpt_layers(2, **SMALL_GPT)
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        gpt_layers(4, 0, 32, 2, 100)


# Communication -----------------------------------------------------------------


def test_alpha_beta_comm_formulas():
    comm = AlphaBetaComm()
    size = np.array([0.0, 1e6, 1e9])
    np.testing.assert_allclose(
        comm.predict_collective("all_reduce", 8, size, False),
        2 * 7 / 8 * size / 150e9 + 2 * 7 * 5e-6,
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        comm.predict_collective("all_gather", 4, size, True),
        3 / 4 * size / 12.5e9 + 3 * 20e-6,
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        comm.predict_collective("send_recv", 2, 1e6, True), 1e6 / 12.5e9 + 20e-6
    )
    np.testing.assert_array_equal(comm.predict_collective("all_reduce", 1, size, 0), 0)
    with pytest.raises(ValueError, match="collective must be one of"):
        comm.predict_collective("broadcast", 2, 1.0, False)
    with pytest.raises(ValueError, match="inter_host_bandwidth"):
        AlphaBetaComm(inter_host_bandwidth=0.0)


# Tables ------------------------------------------------------------------------


def test_one_entry_by_hand():
    """Blocks 1..2 on the (2, 2) submesh with tp = 2, dp = 2, from the formulas."""
    layers = gpt_layers(4, **SMALL_GPT)
    tokens, h = 64, 64
    flops = 24 * tokens * h**2 + 4 * tokens * 32 * h  # per block
    params = (12 * h**2 + 13 * h) * 2  # bytes per block
    stash = tokens * h * 34  # bytes per block
    static = 2 * params / 2 * 16 / 2  # 16 B/param, sharded by tp = 2
    per_mb = 2 * stash / 4  # over dp * tp = 4 devices
    memory = static + 5.5 * per_mb
    problem = synthesize(layers, (2, 2), num_microbatches=8, memory_per_device=memory)
    assert problem.submesh_shapes.tolist() == [[1, 1], [1, 2], [2, 2]]
    assert problem.num_configs == 2  # tp = 1, 2
    compute = 3 * 2 * flops / (4 * 312e12 * 0.5)
    # 4 all-reduces per block of tokens*h*2/dp bytes, tp group inside a host.
    tp_comm = 2 * 4 * (2 * 1 / 2 * (tokens * h * 2 / 2) / 150e9 + 2 * 5e-6)
    # Gradient all-reduce over dp = 2 across hosts of params/tp, amortized / B.
    grad = (2 * 1 / 2 * (2 * params / 2) / 12.5e9 + 2 * 20e-6) / 8
    expected = compute + tp_comm + grad + 1e-3
    np.testing.assert_allclose(problem.compute_cost[1, 2, 2, 1], expected, rtol=1e-12)
    assert problem.max_n_succ_stages[1, 2, 2, 1] == 4  # floor(5.5) - 1
    # (1, 1) has only tp = 1, like Alpa's padding of config slots.
    assert np.isinf(problem.compute_cost[:, :, 0, 1]).all()
    assert (problem.max_n_succ_stages[:, :, 0, 1] == -1).all()


@pytest.mark.parametrize(
    "layers, cluster",
    [
        (gpt_layers(10, 1024, 1024, 4, 51200), (1, 4)),
        (gpt_layers(18, 2048, 2048, 4, 51200), (2, 8)),
        (irregular_layers(12, seed=1), (2, 4)),
        (irregular_layers(24, seed=2), (4, 2)),
    ],
)
@pytest.mark.parametrize("memory", [16 * 2**30, np.inf])
def test_exact_dp_solves_synthesized(layers, cluster, memory):
    problem = synthesize(
        layers,
        cluster,
        num_microbatches=16,
        memory_per_device=memory,
        noise=0.03,
        seed=0,
    )
    assert isinstance(problem, Problem)
    assert problem.compute_cost.shape[:2] == (len(layers), len(layers))
    plan = exact_dp(problem)
    np.testing.assert_allclose(evaluate(problem, plan), plan.cost, rtol=1e-12)
    if np.isinf(memory):
        upper = np.isfinite(problem.compute_cost)
        assert (problem.max_n_succ_stages[upper] == UNLIMITED_SUCCEEDING_STAGES).all()


@pytest.mark.parametrize("kind", ["gpt", "irregular"])
def test_longer_spans_never_cheaper(kind):
    layers = (
        gpt_layers(24, 1024, 1024, 4, 51200)
        if kind == "gpt"
        else irregular_layers(24, seed=3)
    )
    cost = synthesize(layers, (2, 8), num_microbatches=16).compute_cost
    finite = np.isfinite(cost[0, 0])
    longer_end = cost[:, 1:][:, :, finite]  # [i, j + 1]
    shorter = cost[:, :-1][:, :, finite]
    upper = np.isfinite(longer_end) & np.isfinite(shorter)
    assert upper.sum() > 1000
    assert (longer_end[upper] >= shorter[upper]).all()
    earlier_start = cost[:-1][:, :, finite]  # [i - 1, j] vs [i, j]
    later = cost[1:][:, :, finite]
    upper = np.isfinite(earlier_start) & np.isfinite(later)
    assert (earlier_start[upper] >= later[upper]).all()


def test_more_devices_less_compute():
    layers = gpt_layers(16, 1024, 1024, 8, 51200)
    problem = synthesize(
        layers, (4, 8), num_microbatches=16, comm=ZeroComm(), stage_overhead=0.0
    )
    sizes = problem.submesh_sizes
    assert sizes.tolist() == [1, 2, 4, 8, 16, 32]
    data_parallel = problem.compute_cost[0, -1, :, 0]  # tp = 1 on every submesh
    assert (np.diff(data_parallel) < 0).all()
    np.testing.assert_allclose(data_parallel * sizes, data_parallel[0], rtol=1e-12)
    # With communication, the best config still speeds up within one host.
    real = synthesize(layers, (4, 8), num_microbatches=16).compute_cost
    best = np.min(real[0, -1], axis=-1)
    assert (np.diff(best[:4]) < 0).all()


def test_memory_limits():
    layers = gpt_layers(8, 1024, 1024, 4, 51200)
    tiny = synthesize(layers, (1, 4), num_microbatches=8, memory_per_device=1e6)
    assert (tiny.max_n_succ_stages == -1).all()
    with pytest.raises(InfeasibleProblemError):
        exact_dp(tiny)
    huge = synthesize(layers, (1, 4), num_microbatches=8, memory_per_device=1e30)
    finite = np.isfinite(huge.compute_cost)
    assert (huge.max_n_succ_stages[finite] == UNLIMITED_SUCCEEDING_STAGES).all()
    # Tighter memory: limits fall with longer spans and rise with more devices.
    mid = synthesize(layers, (1, 4), num_microbatches=8, memory_per_device=8 * 2**30)
    limits = mid.max_n_succ_stages[0, :, 0, 0]
    assert (np.diff(limits) <= 0).all() and limits[0] > limits[-1]
    assert (
        mid.max_n_succ_stages[1, 4, 2, :2] >= mid.max_n_succ_stages[1, 4, 1, :2]
    ).all()


def test_noise_is_seeded_and_bounded():
    layers = irregular_layers(16, seed=0)
    clean = synthesize(layers, (2, 4), num_microbatches=8)
    first = synthesize(layers, (2, 4), num_microbatches=8, noise=0.1, seed=5)
    again = synthesize(layers, (2, 4), num_microbatches=8, noise=0.1, seed=5)
    other = synthesize(layers, (2, 4), num_microbatches=8, noise=0.1, seed=6)
    np.testing.assert_array_equal(first.compute_cost, again.compute_cost)
    assert not np.array_equal(first.compute_cost, other.compute_cost)
    finite = np.isfinite(clean.compute_cost)
    np.testing.assert_array_equal(finite, np.isfinite(first.compute_cost))
    ratio = first.compute_cost[finite] / clean.compute_cost[finite]
    assert ratio.min() >= 0.9 and ratio.max() <= 1.1 and ratio.std() > 0.01
    np.testing.assert_array_equal(first.max_n_succ_stages, clean.max_n_succ_stages)


def test_scalar_comm_fallback_matches_vectorized():
    layers = irregular_layers(12, seed=4)
    vectorized = stage_cost_table(layers, (2, 4), num_microbatches=8)
    comm = ScalarComm()
    scalar = stage_cost_table(layers, (2, 4), num_microbatches=8, comm=comm)
    assert comm.calls > 0
    np.testing.assert_allclose(scalar.compute_cost, vectorized.compute_cost, rtol=1e-12)
    np.testing.assert_array_equal(
        scalar.max_n_succ_stages, vectorized.max_n_succ_stages
    )


def test_options():
    layers = gpt_layers(6, **SMALL_GPT)
    # dp must divide the micro-batch: (2, 4) has 8 devices, so tp = 1, 2 are out.
    tables = stage_cost_table(layers, (2, 4), num_microbatches=4, micro_batch_size=2)
    assert tables.submesh_shapes.tolist() == [[1, 1], [1, 2], [1, 4], [2, 4]]
    finite = np.isfinite(tables.compute_cost[0, 0])
    assert finite.tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, True],
        [False, False, True],
    ]
    # A device speed per submesh (e.g. a slower device type on the big one).
    zero = dict(comm=ZeroComm(), stage_overhead=0.0, configs=(1,))
    base = stage_cost_table(layers, (2, 4), num_microbatches=4, **zero)
    slow = stage_cost_table(
        layers, (2, 4), num_microbatches=4, device_flops=[312e12] * 3 + [156e12], **zero
    )
    np.testing.assert_allclose(
        slow.compute_cost[..., :3, :], base.compute_cost[..., :3, :]
    )
    np.testing.assert_allclose(
        slow.compute_cost[0, 5, 3], 2 * base.compute_cost[0, 5, 3]
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise=1.0), "noise"),
        (dict(efficiency=0.0), "efficiency"),
        (dict(configs=(0, 1)), "configs"),
        (dict(configs=()), "configs"),
        (dict(device_flops=[1e12, 2e12]), r"device_flops must .* shape \(3,\)"),
        (dict(memory_per_device=-1.0), "memory_per_device"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(cluster=(2, 0)), "cluster"),
    ],
)
def test_argument_errors(kwargs, match):
    arguments = {"cluster": (1, 4), "num_microbatches": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        synthesize(gpt_layers(4, **SMALL_GPT), **arguments)


def test_l512_on_128x8_builds():
    layers = gpt_layers(512, 4096, 2048, 8, 51200)
    started = time.process_time()
    problem = synthesize(layers, (128, 8), num_microbatches=64, noise=0.02, seed=0)
    elapsed = time.process_time() - started
    assert problem.compute_cost.shape == (512, 512, 11, 4)
    assert problem.submesh_shapes[-1].tolist() == [128, 8]
    assert np.isfinite(problem.compute_cost[0, 511]).sum() == 11 + 10 + 9 + 8
    assert elapsed < 30  # about 1-2 s on a 2-core machine
