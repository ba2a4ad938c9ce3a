"""Long pipelines: the extrapolated simulation equals the full one."""

import numpy as np
import pytest

from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.costmodel.megatron import long_pipelines
from pipedejavu.costmodel.megatron.long_pipelines import (
    PipelineSummary,
    every_pipeline,
    pipeline_summary,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.simulation.interleaved import simulate_interleaved
from pipedejavu.simulation.simulate import simulate


def _deepspeed(forward, backward, transfer, blocking):
    def run(m):
        r = simulate(
            forward,
            backward,
            m,
            schedule="deepspeed",
            transfer=transfer,
            gradient_transfer=transfer * 1.3,
            blocking=blocking,
        )
        return PipelineSummary(
            r.backward_end.max(axis=1), float(r.busy_time.sum()), r.peak_in_flight, None
        )

    return run


@pytest.mark.parametrize("seed", range(6))
def test_extrapolation_equals_the_full_simulation(seed):
    rng = np.random.default_rng(seed)
    stages = int(rng.integers(2, 6))
    forward = rng.uniform(0.5, 2.0, stages)
    backward = forward * rng.uniform(1.5, 3.0, stages)
    transfer = rng.uniform(0.0, 1.5, stages - 1)
    blocking = rng.random(stages - 1) < 0.5
    run = _deepspeed(forward, backward, transfer, blocking)
    count = int(rng.integers(400, 900))
    long = pipeline_summary(run, count, num_stages=stages)
    full = run(count)
    np.testing.assert_allclose(long.ends, full.ends, rtol=1e-9)
    np.testing.assert_allclose(long.busy_s, full.busy_s, rtol=1e-9)
    np.testing.assert_array_equal(long.peak_in_flight, full.peak_in_flight)


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_extrapolation_equals_the_full_simulation(seed):
    rng = np.random.default_rng(seed)
    ranks, chunks = 3, 2
    forward = rng.uniform(0.5, 2.0, (ranks, chunks))
    backward = 2 * forward
    transfer = rng.uniform(0.0, 0.5, ranks)
    memory = rng.uniform(1.0, 2.0, (ranks, chunks))

    def run(m):
        r = simulate_interleaved(
            forward, backward, m, transfer=transfer, memory_per_microbatch=memory
        )
        return PipelineSummary(
            r.backward_end.max(axis=(1, 2)),
            float(r.busy_time.sum()),
            r.peak_in_flight,
            r.peak_memory,
        )

    count = 3 * 200
    long = pipeline_summary(run, count, num_stages=ranks, step=ranks)
    full = run(count)
    np.testing.assert_allclose(long.ends, full.ends, rtol=1e-9)
    np.testing.assert_allclose(long.peak_memory, full.peak_memory, rtol=1e-12)


def test_predictor_on_a_long_pipeline(monkeypatch):
    """A prime global batch: one replica, mbs 1, 1,009 micro-batches."""
    data = load_sailor_data()
    stages = tuple(
        Stage3D(a, b, (Replica("GH-96", 1, node=s),))
        for s, (a, b) in enumerate([(0, 7), (7, 14), (14, 20), (20, 26)])
    )
    plan = Plan3D(stages, mbs=1, gbs=1009, model="OPT-350")
    fast = predict_plan(plan, data)
    monkeypatch.setattr(long_pipelines, "DIRECT_LIMIT", 10**9)
    slow = predict_plan(plan, data)
    np.testing.assert_allclose(fast.iteration_time_s, slow.iteration_time_s, rtol=1e-9)
    np.testing.assert_allclose(fast.bubble_fraction, slow.bubble_fraction, atol=1e-9)
    np.testing.assert_array_equal(fast.peak_in_flight, slow.peak_in_flight)


def test_every_pipeline_equals_each_pipeline_simulated():
    """Pipelines with equal inputs are simulated once; every pipeline's ends,
    the busy time summed in pipeline order and the peaks equal a loop that
    simulates each pipeline itself."""
    rng = np.random.default_rng(3)
    stages, kinds = 4, rng.uniform(0.5, 2.0, size=(2, 4, 3))
    which = rng.integers(0, 3, size=11)  # 11 pipelines of 3 kinds
    forward, backward = kinds[0][:, which], kinds[1][:, which]
    transfer = np.full((stages - 1, which.size), 0.1)
    transfer[:, 4] = 0.3  # one pipeline of kind which[4] on slower links
    calls = []

    def run(j):
        calls.append(j)
        result = simulate(forward[:, j], backward[:, j], 9, transfer=transfer[:, j])
        return PipelineSummary(
            result.backward_end.max(axis=1),
            float(result.busy_time.sum()),
            result.peak_in_flight,
            None,
        )

    ends, busy, peak = every_pipeline(run, forward, backward, transfer)
    distinct = {(int(k), float(transfer[0, j])) for j, k in enumerate(which)}
    assert len(calls) == len(distinct) < which.size
    each = [run(j) for j in range(which.size)]
    np.testing.assert_array_equal(ends, np.stack([e.ends for e in each], axis=1))
    expected = 0.0
    for e in each:
        expected += e.busy_s
    assert busy == expected
    np.testing.assert_array_equal(
        peak, np.max([e.peak_in_flight for e in each], axis=0)
    )
