"""The linear stage-latency model: exact recovery, noise, prediction, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipedejavu.costmodel.stage.linear as linear
from pipedejavu import Problem
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.costmodel.stage.linear import (
    fit_linear_model,
    fit_linear_numpy,
    predict_spans,
    predict_table,
)


def _linear_problem(
    rng: np.random.Generator,
    num_layers: int,
    *,
    num_submeshes: int = 3,
    num_configs: int = 2,
    missing: float = 0.0,
    noise: float = 0.0,
) -> tuple[Problem, np.ndarray, np.ndarray]:
    """A problem whose table is exactly the linear model (times noise).

    Returns the problem, the true intercept f64[M, K] and per_layer f64[L, M, K].
    """
    shape = (num_submeshes, num_configs)
    intercept = rng.uniform(0.1, 1.0, shape)
    per_layer = rng.uniform(0.5, 2.0, (num_layers, *shape))
    prefix = np.concatenate([np.zeros((1, *shape)), per_layer.cumsum(0)])
    table = intercept + prefix[None, 1:] - prefix[:-1, None]  # [L, L, M, K]
    table *= 1.0 + noise * rng.uniform(-1.0, 1.0, table.shape)
    table[rng.random(table.shape) < missing] = np.inf
    shapes = np.array([[1, 2**m] for m in range(num_submeshes)])
    problem = Problem(table, None, shapes, (1, 2 ** (num_submeshes - 1)), 4)
    return problem, intercept, per_layer


@pytest.mark.parametrize("missing", [0.0, 0.3])
@pytest.mark.parametrize("num_layers", [12, 24])
def test_recovers_an_exactly_linear_table(num_layers, missing):
    rng = np.random.default_rng(num_layers)
    problem, intercept, per_layer = _linear_problem(rng, num_layers, missing=missing)
    model = fit_linear_model(problem)
    assert model.usable.all()
    np.testing.assert_allclose(model.intercept, intercept, rtol=1e-6)
    np.testing.assert_allclose(model.per_layer, per_layer, rtol=1e-6)
    assert float(model.relative_rms.max()) < 1e-12  # float64 fit, refined
    finite = np.isfinite(problem.compute_cost)
    table = predict_table(model)
    np.testing.assert_allclose(table[finite], problem.compute_cost[finite], rtol=1e-6)


@pytest.mark.parametrize("noise", [0.01, 0.05, 0.2])
def test_noise_degrades_gracefully(noise):
    problem, _, _ = _linear_problem(np.random.default_rng(3), 24, missing=0.2)
    clean = problem.compute_cost
    noisy = _linear_problem(np.random.default_rng(3), 24, missing=0.2, noise=noise)[0]
    model = fit_linear_model(noisy)
    # Uniform +-noise has standard deviation noise / sqrt(3); the fit absorbs a
    # little of it (25 parameters for about 240 entries per slot).
    spread = noise / np.sqrt(3.0)
    rms = np.asarray(model.relative_rms)
    assert (rms > 0.8 * spread).all() and (rms < 1.05 * spread).all(), rms
    # The noise averages out: predictions sit about sqrt(25 / 240) ~ 0.3 spread
    # from the clean table.
    finite = np.isfinite(clean)
    error = (predict_table(model)[finite] - clean[finite]) / clean[finite]
    assert np.sqrt(np.mean(error**2)) < 0.5 * spread


def test_predict_spans_agrees_with_table_under_jit_and_vmap():
    rng = np.random.default_rng(5)
    problem, _, _ = _linear_problem(rng, 24, missing=0.3, noise=0.05)
    model = fit_linear_model(problem)
    table = predict_table(model)
    starts = rng.integers(0, 24, 500)
    stops = starts + 1 + rng.integers(0, 24 - starts)
    submesh, config = rng.integers(0, 3, 500), rng.integers(0, 2, 500)
    expected = table[starts, stops - 1, submesh, config]
    eager = predict_spans(model, starts, stops, submesh, config)
    jitted = jax.jit(predict_spans)(model, starts, stops, submesh, config)
    mapped = jax.vmap(predict_spans, in_axes=(None, 0, 0, 0, 0))(
        model, starts, stops, submesh, config
    )
    for values in (eager, jitted, mapped):
        np.testing.assert_allclose(values, expected, rtol=1e-5)


def test_predict_spans_is_differentiable_in_the_model():
    rng = np.random.default_rng(6)
    problem, _, _ = _linear_problem(rng, 12)
    model = fit_linear_model(problem)

    def total(intercept, per_layer):  # layers 2..5 and 0..8 on slot (1, 0)
        fitted = model._replace(intercept=intercept, per_layer=per_layer)
        starts, stops = jnp.array([2, 0]), jnp.array([6, 9])
        return predict_spans(fitted, starts, stops, 1, 0).sum()

    d_intercept, d_per_layer = jax.grad(total, (0, 1))(model.intercept, model.per_layer)
    expected = np.zeros(model.per_layer.shape)
    expected[2:6, 1, 0] += 1.0
    expected[0:9, 1, 0] += 1.0
    np.testing.assert_allclose(d_per_layer, expected)
    expected = np.zeros(model.intercept.shape)
    expected[1, 0] = 2.0
    np.testing.assert_allclose(d_intercept, expected)


def test_unusable_slots_and_uncovered_layers():
    rng = np.random.default_rng(8)
    problem, _, per_layer = _linear_problem(rng, 12)
    table = problem.compute_cost.copy()
    table[:, :, 0, 1] = np.inf  # no entry at all
    table[:, :, 1, 0] = np.inf
    table[2, 4, 1, 0] = 3.0  # a single entry: still not enough
    # Slot (2, 0): no finite entry covers layer 7.
    covers = np.zeros((12, 12), dtype=bool)
    covers[:8, 7:] = True
    table[covers, 2, 0] = np.inf
    problem = problem.replace(compute_cost=table)
    model = fit_linear_model(problem)
    usable = np.ones((3, 2), dtype=bool)
    usable[0, 1] = usable[1, 0] = False
    np.testing.assert_array_equal(model.usable, usable)
    for slot in [(0, 1), (1, 0)]:
        assert float(model.intercept[slot]) == 0.0
        assert not np.asarray(model.per_layer[(slice(None), *slot)]).any()
        assert float(model.relative_rms[slot]) == 0.0
        assert np.isinf(predict_spans(model, 0, 3, *slot))
    predicted = predict_table(model)
    assert np.isinf(predicted[:, :, 0, 1]).all()
    assert np.isinf(predicted[:, :, 1, 0]).all()
    upper = np.triu(np.ones((12, 12), dtype=bool))
    assert np.isfinite(predicted[upper][:, 2, 0]).all()
    assert np.isinf(predicted[~upper]).all()
    fill = np.median(np.delete(np.asarray(model.per_layer[:, 2, 0]), 7))
    np.testing.assert_allclose(model.per_layer[7, 2, 0], fill, rtol=1e-6)
    # Layers the slot does cover are still recovered exactly.
    np.testing.assert_allclose(
        np.delete(np.asarray(model.per_layer[:, 2, 0]), 7),
        np.delete(per_layer[:, 2, 0], 7),
        rtol=1e-6,
    )


@pytest.mark.parametrize("missing", [0.0, 0.3])
@pytest.mark.parametrize(("num_layers", "cluster"), [(16, (1, 8)), (64, (4, 8))])
def test_generated_instances_fit_to_their_noise_level(num_layers, cluster, missing):
    # random_problem's stage cost is linear in the layers (intercept 0) times
    # uniform +-noise, so the relative RMS is about noise / sqrt(3).
    exact = random_problem(num_layers, cluster, noise=0.0, missing=missing, seed=1)
    assert float(fit_linear_model(exact).relative_rms.max()) < 1e-12
    noisy = random_problem(num_layers, cluster, noise=0.02, missing=missing, seed=1)
    rms = np.asarray(fit_linear_model(noisy).relative_rms)
    spread = 0.02 / np.sqrt(3.0)
    assert (rms > 0.8 * spread).all() and (rms < 1.05 * spread).all(), rms


def test_subsampling_is_deterministic_and_keyed():
    rng = np.random.default_rng(9)
    exact, intercept, per_layer = _linear_problem(rng, 24)
    model = fit_linear_model(exact, max_entries_per_slot=120)
    np.testing.assert_allclose(model.per_layer, per_layer, rtol=1e-6)
    np.testing.assert_allclose(model.intercept, intercept, rtol=1e-6)
    noisy, _, _ = _linear_problem(rng, 24, noise=0.1)
    first = fit_linear_model(noisy, max_entries_per_slot=120)
    again = fit_linear_model(noisy, max_entries_per_slot=120)
    other = fit_linear_model(noisy, max_entries_per_slot=120, key=jax.random.key(1))
    full = fit_linear_model(noisy)
    np.testing.assert_array_equal(first.per_layer, again.per_layer)
    assert not np.allclose(first.per_layer, other.per_layer, rtol=1e-3)
    assert not np.allclose(first.per_layer, full.per_layer, rtol=1e-3)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_rejects_bad_entry_limits(bad):
    problem, _, _ = _linear_problem(np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match="max_entries_per_slot"):
        fit_linear_model(problem, max_entries_per_slot=bad)


def test_same_shapes_do_not_retrace():
    rng = np.random.default_rng(10)
    first, _, _ = _linear_problem(rng, 13, num_submeshes=2, num_configs=3)
    second, _, _ = _linear_problem(rng, 13, num_submeshes=2, num_configs=3)
    before = linear._fit_traces
    fit_linear_model(first)
    traced = linear._fit_traces
    assert traced - before <= 1
    fit_linear_model(second)
    fit_linear_model(first, key=jax.random.key(4))
    assert linear._fit_traces == traced


def test_dtype_follows_the_x64_setting():
    problem, _, _ = _linear_problem(np.random.default_rng(11), 12)
    assert fit_linear_model(problem).per_layer.dtype == jnp.float32
    with jax.enable_x64(True):
        model = fit_linear_model(problem)
        assert model.per_layer.dtype == jnp.float64
        assert model.intercept.dtype == jnp.float64


@pytest.mark.parametrize("missing", [0.0, 0.5, 0.97])
def test_numpy_fit_agrees_with_the_jax_fit(missing):
    """The engine's NumPy fit (no tracing at start-up) against the JAX fit, on
    noisy tables with unprofiled entries and slots too sparse to fit."""
    rng = np.random.default_rng(11)
    problem, _, _ = _linear_problem(rng, 20, missing=missing, noise=0.1)
    model = fit_linear_model(problem)
    per_layer, intercept, usable = fit_linear_numpy(problem)
    np.testing.assert_array_equal(usable, np.asarray(model.usable))
    # fit_linear_model returns float32 here (x64 off): agree to its rounding
    # on the entries the data determine (a nearly empty slot's parameters are
    # set by the ridge, so there the predictions of fitted entries are compared).
    prefix = np.concatenate([np.zeros((1, *intercept.shape)), per_layer.cumsum(0)])
    table = intercept + prefix[None, 1:] - prefix[:-1, None]
    fitted = np.isfinite(problem.compute_cost) & usable
    np.testing.assert_allclose(table[fitted], predict_table(model)[fitted], rtol=1e-5)
    if missing <= 0.5:
        np.testing.assert_allclose(per_layer, model.per_layer, rtol=2e-6, atol=1e-9)
        np.testing.assert_allclose(intercept, model.intercept, rtol=2e-6, atol=1e-9)
