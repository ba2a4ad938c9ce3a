"""Tests of the flax GPT layer profiler and the Problem built from its timings.

Timings are never compared with fixed numbers: they are checked for sign and
finiteness, against each other (one-layer stages are the measurement itself),
and, for the accuracy of the stage model, with a bound (50%) five times wider
than anything measured for gpt-tiny on this shared 2-core CPU (benchmarks/
profiler_accuracy.py: <= 10% held out). Sizes, bytes and the Problem's entries
are checked against closed forms.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, Problem, evaluate
from pipedejavu.costmodel.profiling.gpt_model import (
    MODEL_NAMES,
    GPTConfig,
    gpt_config,
    gpt_modules,
    span_step,
)
from pipedejavu.costmodel.profiling.layer_problem import (
    DataParallelScaling,
    problem_from_layer_profile,
    profile_to_problem,
)
from pipedejavu.costmodel.profiling.profiler import LayerProfile, profile_model
from pipedejavu.costmodel.profiling.stage_overhead import (
    StageOverhead,
    fit_stage_overhead,
    predict_span_time,
)
from pipedejavu.search.alpa.exact import exact_dp

MICRO_SPANS = [(0, 4), (1, 3), (0, 2)]


@pytest.fixture(scope="module")
def micro_run() -> tuple[LayerProfile, list[tuple[int, int]]]:
    events: list[tuple[int, int]] = []
    profile = profile_model(
        "gpt-micro",
        repeats=5,
        warmup=1,
        spans=MICRO_SPANS,
        progress_fn=lambda done, total, what: events.append((done, total)),
    )
    return profile, events


@pytest.fixture
def micro(micro_run) -> LayerProfile:
    return micro_run[0]


def _synthetic(times, spans, span_times, stash=None) -> LayerProfile:
    """A profile with chosen times (no measurement) for the fit's closed forms."""
    num_layers = len(times)
    return LayerProfile(
        model_name="synthetic",
        config=gpt_config("gpt-micro"),
        layer_names=tuple(f"l{i}" for i in range(num_layers)),
        backend="none",
        device_kind="none",
        layer_times_s=np.asarray(times, float),
        layer_samples_s=np.asarray(times, float)[:, None],
        spans=tuple(spans),
        span_times_s=np.asarray(span_times, float),
        span_samples_s=np.asarray(span_times, float).reshape(-1, 1),
        activation_bytes=np.full(num_layers, 1000, np.int64),
        stash_bytes=np.full(num_layers, 4000, np.int64)
        if stash is None
        else np.asarray(stash, np.int64),
        param_bytes=np.arange(1, num_layers + 1, dtype=np.int64) * 100,
        repeats=1,
        warmup=0,
        burst=1,
        compile_s=0.0,
    )


def test_measurements_are_positive_finite_and_shaped(micro):
    assert micro.num_layers == 4
    assert micro.layer_names == ("embedding", "block0", "block1", "head")
    assert micro.backend == jax.default_backend()
    assert micro.layer_samples_s.shape == (4, 5)
    assert micro.span_samples_s.shape == (3, 5)
    assert micro.spans == tuple(MICRO_SPANS)
    for times in (micro.layer_samples_s, micro.span_samples_s):
        assert np.isfinite(times).all() and (times > 0).all()
    np.testing.assert_allclose(
        micro.layer_times_s, np.median(micro.layer_samples_s, axis=1), rtol=0
    )
    fastest = micro.with_statistic("min")
    assert (fastest.layer_times_s <= micro.layer_times_s).all()
    assert (fastest.span_times_s <= micro.span_times_s).all()
    with pytest.raises(ValueError, match="statistic must be median or min"):
        micro.with_statistic("mean")


def test_bytes_match_closed_forms(micro):
    c = micro.config
    b, s, h, v = c.batch_size, c.seq_len, c.hidden_size, c.vocab_size
    block = 12 * h * h + 13 * h  # qkv, out, 4h MLP (weights + biases), 2 LNs
    expected = [(v + s) * h, block, block, h * v + v + 2 * h]
    np.testing.assert_array_equal(micro.param_bytes, 4 * np.array(expected))
    np.testing.assert_array_equal(micro.activation_bytes, [4 * b * s * h] * 3 + [4])
    # every layer stashes at least its input, and blocks much more
    assert micro.stash_bytes[0] >= 4 * b * s  # the token ids
    assert (micro.stash_bytes[1:] >= 4 * b * s * h).all()
    assert micro.stash_bytes[1] == micro.stash_bytes[2]


def test_progress(micro_run):
    events = micro_run[1]
    total = 4 + len(MICRO_SPANS) + 5
    assert [done for done, _ in events] == list(range(1, total + 1))
    assert {count for _, count in events} == {total}


def test_timed_step_computes_the_real_gradients():
    config = gpt_config("gpt-micro")
    layers = gpt_modules(config)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (4, 32), dtype=np.int32))
    targets = jnp.roll(tokens, -1, axis=1)
    hidden = jnp.zeros((4, 32, config.hidden_size))
    params = tuple(
        jax.jit(layer.init)(jax.random.key(i), x, *extra)
        for i, (layer, x, extra) in enumerate(
            zip(
                layers,
                [tokens, hidden, hidden, hidden],
                [()] * 3 + [(targets,)],
                strict=True,
            )
        )
    )

    def loss(all_params):
        x = tokens
        for layer, layer_params in zip(layers[:-1], all_params[:-1], strict=True):
            x = layer.apply(layer_params, x)
        return layers[-1].apply(all_params[-1], x, targets)

    expected = jax.jit(jax.grad(loss))(params)
    step = span_step(config, 0, 4)
    value, (gradients,) = step(params, tokens, targets, jnp.ones((), jnp.float32))
    np.testing.assert_allclose(value, jax.jit(loss)(params), rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(gradients), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # identical blocks share one compiled function
    assert span_step(config, 1, 2) is span_step(config, 2, 3)


def test_problem_on_one_device_is_valid_and_exact_dp_solves_it(micro):
    problem = problem_from_layer_profile(micro, num_microbatches=4)
    assert problem.compute_cost.shape == (4, 4, 1, 1)
    assert problem.cluster_shape == (1, 1)
    cost = problem.compute_cost[..., 0, 0]
    # one-layer stages are the measurement itself
    np.testing.assert_allclose(np.diag(cost), micro.layer_times_s, rtol=1e-12)
    upper = cost[np.triu_indices(4)]
    assert np.isfinite(upper).all() and (upper > 0).all()
    plan = exact_dp(problem)
    # one device: one stage holding every layer, B times its latency
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 4)]
    np.testing.assert_allclose(plan.cost, 4 * cost[0, 3], rtol=1e-12)
    np.testing.assert_allclose(evaluate(problem, plan), plan.cost, rtol=1e-12)


def test_multi_device_scaling_closed_form(micro):
    with pytest.raises(ValueError, match="pass scaling=DataParallelScaling"):
        problem_from_layer_profile(micro, (1, 2), num_microbatches=4)
    ideal = DataParallelScaling(
        parallel_fraction=1.0, allreduce_latency_s=0.0, intra_host_bandwidth=math.inf
    )
    no_spill = StageOverhead(1e-5, 0.1)
    problem = problem_from_layer_profile(
        micro, (1, 2), num_microbatches=4, scaling=ideal, overhead=no_spill
    )
    np.testing.assert_array_equal(problem.submesh_shapes, [[1, 1], [1, 2]])
    cost = problem.compute_cost[..., 0]
    np.testing.assert_allclose(cost[..., 1], cost[..., 0] / 2, rtol=1e-12)
    # the spill test uses the working set per device: a micro-batch split over
    # two devices halves it, so the whole model spills on one device only
    whole = float(micro.stash_bytes.sum())
    spill = StageOverhead(spill_fraction=0.5, spill_bytes=0.75 * whole)
    problem = problem_from_layer_profile(
        micro, (1, 2), num_microbatches=4, scaling=ideal, overhead=spill
    )
    total = micro.layer_times_s.sum()
    np.testing.assert_allclose(
        problem.compute_cost[0, 3, :, 0], [1.5 * total, total / 2], rtol=1e-12
    )

    scaling = DataParallelScaling(0.9, 1e-5, 1e9, 1e8)
    problem = problem_from_layer_profile(
        micro, (2, 2), num_microbatches=8, scaling=scaling, overhead=no_spill
    )
    shapes = problem.submesh_shapes.tolist()
    assert shapes == [[1, 1], [1, 2], [2, 2]]
    one = problem.compute_cost[1, 2, 0, 0]
    params = float(micro.param_bytes[1:3].sum())
    for index, (hosts, devices) in enumerate(shapes[1:], start=1):
        d = hosts * devices
        bandwidth = 1e9 if hosts == 1 else 1e8
        allreduce = 2 * (d - 1) * 1e-5 + 2 * (d - 1) / d * params / bandwidth
        expected = one * (0.1 + 0.9 / d) + allreduce / 8
        np.testing.assert_allclose(
            problem.compute_cost[1, 2, index, 0], expected, rtol=1e-12
        )
    plan = exact_dp(problem)
    assert sum(s.num_devices for s in plan.stages) == 4
    np.testing.assert_allclose(evaluate(problem, plan), plan.cost, rtol=1e-12)
    with pytest.raises(ValueError, match="parallel_fraction must be in"):
        DataParallelScaling(parallel_fraction=1.5)
    with pytest.raises(ValueError, match="inter_host_bandwidth must be > 0"):
        DataParallelScaling(inter_host_bandwidth=0.0)


def test_memory_budget_closed_form():
    profile = _synthetic([1e-3, 2e-3, 2e-3], [], [])
    problem = problem_from_layer_profile(
        profile,
        (1, 2),
        num_microbatches=4,
        scaling=DataParallelScaling(),
        memory_budget_bytes=50_000,
        weight_memory_factor=4.0,
    )
    memory = problem.max_n_succ_stages[..., 0]
    # layers 0..1 on one device: (50000 - 4 * 300) // 8000 - 1 = 5
    assert memory[0, 1, 0] == 5
    # on two devices the stash halves: (50000 - 1200) // 4000 - 1 = 11
    assert memory[0, 1, 1] == 11
    # all three layers: (50000 - 4 * 600) // 12000 - 1 = 2
    assert memory[0, 2, 0] == 2
    tight = problem_from_layer_profile(
        profile, num_microbatches=1, memory_budget_bytes=1000
    )
    assert (tight.max_n_succ_stages[np.triu_indices(3)] == -1).all()
    roomy = problem_from_layer_profile(
        profile, num_microbatches=1, memory_budget_bytes=1e30
    )
    assert (roomy.max_n_succ_stages == UNLIMITED_SUCCEEDING_STAGES).all()
    with pytest.raises(ValueError, match="memory_budget_bytes must be > 0"):
        problem_from_layer_profile(profile, num_microbatches=1, memory_budget_bytes=0)


@pytest.mark.parametrize("per_boundary, fraction", [(0.0, 0.0), (1e-4, 0.05)])
def test_overhead_fit_recovers_known_coefficients(per_boundary, fraction):
    times = np.array([0.5e-3, 2e-3, 2.5e-3, 1.5e-3, 1e-3])
    spans = [(0, 5), (0, 2), (1, 4), (2, 5), (3, 5)]
    truth = StageOverhead(per_boundary, fraction, len(spans))
    measured = [
        predict_span_time(_synthetic(times, [], []), a, b, truth) for a, b in spans
    ]
    profile = _synthetic(times, spans, measured)
    fitted = fit_stage_overhead(profile)
    np.testing.assert_allclose(
        [fitted.per_boundary_s, fitted.boundary_fraction],
        [per_boundary, fraction],
        atol=1e-9,
    )
    assert fitted.num_spans == 5
    # a single layer is its measurement; the plain sum minus the savings
    assert predict_span_time(profile, 2, 3) == times[2]
    boundary_means = (times[0] + times[1]) / 2 + (times[1] + times[2]) / 2
    expected = times[:3].sum() - 2 * per_boundary - fraction * boundary_means
    np.testing.assert_allclose(predict_span_time(profile, 0, 3), expected, rtol=1e-6)


def test_overhead_fit_finds_the_working_set_capacity():
    times = np.array([0.5e-3, 2e-3, 2e-3, 2e-3, 2e-3, 1e-3])
    stash = [100, 1000, 1000, 1000, 1000, 200]
    spans = [(0, 6), (0, 3), (1, 4), (3, 6), (1, 3), (2, 6)]
    truth = StageOverhead(1e-5, 0.05, 0.3, 2500.0)
    plain = _synthetic(times, [], [], stash)
    measured = [predict_span_time(plain, a, b, truth) for a, b in spans]
    # three blocks (3000 bytes) spill, two (2000) and their neighbours do not
    assert measured[2] > 1.2 * times[1:4].sum()
    fitted = fit_stage_overhead(_synthetic(times, spans, measured, stash))
    np.testing.assert_allclose(
        [fitted.per_boundary_s, fitted.boundary_fraction, fitted.spill_fraction],
        [1e-5, 0.05, 0.3],
        atol=1e-8,
    )
    assert 2200 < fitted.spill_bytes < 3000


def test_overhead_fit_bounds_and_arguments():
    times = np.array([1e-3, 1e-3, 1e-3])
    slow = _synthetic(times, [(0, 3)], [30e-3])  # ten times the sum
    fitted = fit_stage_overhead(slow)
    assert fitted.per_boundary_s == pytest.approx(-0.5e-3)
    assert fitted.boundary_fraction == pytest.approx(-0.5)
    fast = _synthetic(times, [(0, 3)], [1e-6])
    assert predict_span_time(fast, 0, 3) > 0
    assert fit_stage_overhead(_synthetic(times, [], [])) == StageOverhead()
    with pytest.raises(ValueError, match="must be among the profiled spans"):
        fit_stage_overhead(slow, [(0, 2)])
    with pytest.raises(ValueError, match="span must satisfy"):
        predict_span_time(slow, 2, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repeats": 0}, "repeats must be an integer >= 1, got 0"),
        ({"repeats": 1.5}, "repeats must be an integer >= 1"),
        ({"warmup": -1}, "warmup must be an integer >= 0, got -1"),
        ({"burst": 0}, "burst must be an integer >= 1, got 0"),
        ({"spans": "all"}, "spans must be 'auto'"),
        ({"spans": [(0, 1)]}, r"span \(0, 1\) must satisfy"),
        ({"spans": [(2, 9)]}, r"span \(2, 9\) must satisfy"),
        ({"spans": [3]}, "spans must hold"),
        ({"batch": 0}, "batch_size must be an integer >= 1, got 0"),
    ],
)
def test_profile_model_validates_before_compiling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        profile_model("gpt-micro", **kwargs)


def test_configs():
    assert {"gpt-tiny", "gpt-small"} <= set(MODEL_NAMES)
    tiny = gpt_config("gpt-tiny")
    assert 2 <= tiny.num_blocks <= 4 and 64 <= tiny.hidden_size <= 128
    assert (tiny.seq_len, tiny.vocab_size) == (64, 512)
    with pytest.raises(ValueError, match="model must be one of gpt-micro"):
        gpt_config("gpt-huge")
    with pytest.raises(ValueError, match="hidden_size must be a multiple of"):
        dataclasses.replace(tiny, num_heads=3)


def test_profile_to_problem_writes_a_problem_file(tmp_path):
    path = tmp_path / "problem.npz"
    problem, profile = profile_to_problem(
        "gpt-micro", path, num_microbatches=3, repeats=2, warmup=1
    )
    loaded = Problem.from_npz(path)
    np.testing.assert_array_equal(loaded.compute_cost, problem.compute_cost)
    assert loaded.num_microbatches == 3
    with np.load(path) as archive:
        assert archive["layer_names"].tolist() == list(profile.layer_names)
        assert str(archive["backend"]) == jax.default_backend()
        np.testing.assert_array_equal(archive["param_bytes"], profile.param_bytes)
    assert exact_dp(loaded).cost == pytest.approx(3 * problem.compute_cost[0, 3, 0, 0])


@pytest.mark.slow
def test_gpt_tiny_stage_prediction_within_a_loose_bound():
    spans = [(0, 6), (1, 4), (3, 5)]
    profile = profile_model("gpt-tiny", repeats=7, warmup=1, spans=spans)
    overhead = fit_stage_overhead(profile, [(0, 6)])  # the others are held out
    for span, measured in zip(spans, profile.span_times_s, strict=True):
        predicted = predict_span_time(profile, *span, overhead)
        plain = profile.layer_times_s[span[0] : span[1]].sum()
        assert abs(predicted / measured - 1) < 0.5, (span, predicted, measured)
        assert abs(plain / measured - 1) < 0.5, (span, plain, measured)
    assert isinstance(GPTConfig(**dataclasses.asdict(profile.config)), GPTConfig)
