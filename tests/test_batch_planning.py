"""Goodput mode (pipedejavu.planning.batch): bound and prune equals enumeration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.planning.batch import (
    candidate_batches,
    efficiency,
    grad_params_from_noise_scale,
    maximize_over_batches,
    plan_goodput,
    throughput_upper_bound,
)
from pipedejavu.planning.training import plan_training

POOL = {"GH-96": 4}
BATCHES = [4, 8, 16, 24, 32, 48, 64]


@pytest.fixture(scope="module")
def planned():
    """Plain enumeration: every candidate batch planned once."""
    out = {}
    for batch in BATCHES:
        try:
            out[batch] = plan_training("OPT-350", POOL, batch)
        except InfeasibleProblemError:
            out[batch] = None
    return out


def _enumerate(planned, noise_scale, init):
    gains = efficiency(grad_params_from_noise_scale(noise_scale, init), init, BATCHES)
    best, best_value = None, -math.inf
    for batch, gain in zip(BATCHES, gains, strict=True):
        plan = planned[batch]
        if plan is None:
            continue
        value = batch / plan.iteration_time_s * gain
        if value > best_value:  # strict: ties to the smaller batch
            best, best_value = batch, value
    return best, best_value


@pytest.mark.parametrize("noise_scale", [1.0, 30.0, 300.0, 1e5])
def test_goodput_mode_equals_enumeration(planned, noise_scale):
    grad = grad_params_from_noise_scale(noise_scale, 4)
    result = plan_goodput("OPT-350", POOL, grad, 4, 64, batches=BATCHES)
    best, value = _enumerate(planned, noise_scale, 4)
    assert result.global_batch == best
    assert result.goodput == pytest.approx(value, rel=1e-12)
    assert result.training.plan.gbs == best
    assert result.throughput * result.efficiency == pytest.approx(result.goodput)
    assert len(result.records) == len(BATCHES)
    assert result.planned + result.pruned == len(BATCHES)


def test_small_noise_scale_prunes(planned):
    # With a tiny noise scale efficiency falls like 1/B: big batches are pruned.
    grad = grad_params_from_noise_scale(1.0, 4)
    result = plan_goodput("OPT-350", POOL, grad, 4, 64, batches=BATCHES)
    assert result.pruned >= 1
    assert result.to_json()["goodput"]["pruned"] == result.pruned


def test_bound_holds_on_every_planned_batch(planned):
    bounds = throughput_upper_bound("OPT-350", POOL, BATCHES)
    for batch, bound in zip(BATCHES, bounds, strict=True):
        plan = planned[batch]
        if plan is not None:
            assert batch / plan.iteration_time_s <= bound * (1 + 1e-9)
            assert bound < math.inf


def test_maximize_over_batches_matches_enumeration_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        batches = sorted(rng.choice(100, size=n, replace=False) + 1)
        values = rng.integers(0, 5, size=n).astype(float)  # many ties
        feasible = rng.random(n) > 0.2
        bounds = values + rng.integers(0, 3, size=n)
        table = dict(zip(batches, zip(values, feasible, strict=True), strict=True))

        def evaluate(batch, table=table):
            value, ok = table[batch]
            return (value, batch) if ok else None

        best, payload, records = maximize_over_batches(batches, bounds, evaluate)
        expected, expected_value = None, -math.inf
        for batch, value, ok in zip(batches, values, feasible, strict=True):
            if ok and value > expected_value:
                expected, expected_value = batch, value
        assert best == expected and payload == expected
        assert len(records) == n


def test_invalid_bound_is_detected():
    with pytest.raises(RuntimeError, match="bound is invalid"):
        maximize_over_batches([1, 2], [1.0, 1.0], lambda b: (2.0, b))


def test_bad_arguments():
    with pytest.raises(ProblemError, match="init_batch"):
        candidate_batches(0, 8)
    with pytest.raises(ProblemError, match="no multiple of 16"):
        candidate_batches(3, 15, 16)
    assert candidate_batches(3, 20, 4) == [4, 8, 12, 16, 20]
    with pytest.raises(ProblemError, match="grad_params"):
        plan_goodput("OPT-350", POOL, (0.0, 0.0), 4, 8)
    with pytest.raises(ProblemError, match="must lie in"):
        plan_goodput("OPT-350", POOL, (1.0, 1.0), 4, 8, batches=[2, 4])


def test_noise_scale_matches_mccandlish_efficiency():
    grad = grad_params_from_noise_scale(100.0, 8)
    gains = efficiency(grad, 8, [8, 100, 1000])
    expected = [(100 + 8) / (100 + b) for b in (8, 100, 1000)]
    np.testing.assert_allclose(gains, expected, rtol=1e-12)
