"""Pollux/AdaptDL goodput port: reference answers, hand examples, jit/vmap/grad."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipedejavu.cli.goodput import FIT_COLUMNS
from pipedejavu.costmodel.goodput import model
from pipedejavu.costmodel.goodput.fit import (
    fit_perf_params,
    perf_objective,
)
from pipedejavu.costmodel.goodput.function import (
    GoodputFunction,
    GoodputInputError,
)
from pipedejavu.costmodel.goodput.model import (
    GradParams,
    PerfParams,
)

_FIXTURES = Path(__file__).parent / "fixtures" / "reference"


def _load(name: str) -> dict:
    return json.loads(gzip.decompress((_FIXTURES / f"{name}.json.gz").read_bytes()))


_GOODPUT = _load("goodput_cases")["cases"]


def _function(case: dict) -> GoodputFunction:
    grad = case["grad_params"]
    return GoodputFunction(
        PerfParams(**case["perf_params"]),
        (grad["sqr"], grad["var"]),
        case["init_batch_size"],
    )


def _range(value):
    return tuple(value["__tuple__"]) if isinstance(value, dict) else value


_PREDICT_KEYS = ("predict_accum_time", "predict_network_time", "predict_log_optim_time")


@jax.jit
def _predict(params, num_nodes, num_replicas, atomic_bsz):
    accum = model.predict_accum_time(params, atomic_bsz)
    network = model.predict_network_time(params, num_nodes, num_replicas)
    return accum, network, model.predict_log_optim_time(params, accum, network)


def test_evaluate_throughput_efficiency_match_adaptdl():
    assert len(_GOODPUT) == 240
    worst, below_init = 0.0, 0
    for case in _GOODPUT:
        fn = _function(case)
        e = case["evaluate"]
        args = [
            np.array(e[k])
            for k in ("num_nodes", "num_replicas", "atomic_bsz", "accum_steps")
        ]
        got = {
            "goodput": fn.evaluate(*args),
            "call_goodput": fn(*args),
            "throughput": fn.throughput(*args),
            "efficiency": fn.efficiency(np.array(e["batch_size"])),
        }
        with jax.enable_x64(True):
            predicted = _predict(fn.perf_params, *args[:3])
        got.update(zip(_PREDICT_KEYS, predicted, strict=True))
        for key, value in got.items():
            np.testing.assert_allclose(value, e[key], rtol=1e-12, err_msg=key)
            worst = max(worst, float(np.max(np.abs(np.asarray(value) / e[key] - 1))))
        scalar = case["evaluate_scalar"]
        call = [
            scalar[k]
            for k in ("num_nodes", "num_replicas", "atomic_bsz", "accum_steps")
        ]
        value = fn.evaluate(*call)
        assert isinstance(value, np.float64)  # a numpy scalar, as AdaptDL's
        np.testing.assert_allclose(value, scalar["goodput"], rtol=1e-12)
        np.testing.assert_allclose(
            fn.throughput(*call), scalar["throughput"], rtol=1e-12
        )
        only = case["efficiency_only"]
        np.testing.assert_allclose(
            fn.efficiency(np.array(only["batch_size"])), only["efficiency"], rtol=1e-12
        )
        if "evaluate_below_init" in case:
            below = case["evaluate_below_init"]
            assert below["error"]["type"] == "AssertionError"
            with pytest.raises(GoodputInputError, match="init_batch_size"):
                fn.evaluate(*below["args"])
            below_init += 1
    assert worst < 1e-12
    assert below_init == sum("evaluate_below_init" in c for c in _GOODPUT) > 20


def test_optimize_matches_adaptdl():
    calls = errors = 0
    for case in _GOODPUT:
        fn = _function(case)
        for call in case["optimize"]:
            args = call["args"]
            run = (
                args["num_nodes"],
                args["num_replicas"],
                args["max_batch_size"],
                _range(args["atomic_bsz_range"]),
                args["accumulation"],
            )
            if "error" in call:
                # AdaptDL's bare asserts become GoodputInputError, still an
                # AssertionError; its ValueError stays a ValueError.
                expected = {"AssertionError": AssertionError, "ValueError": ValueError}
                with pytest.raises(expected[call["error"]["type"]]) as info:
                    fn.optimize(*run)
                assert isinstance(info.value, ValueError)
                errors += 1
                continue
            goodput, atomic_bsz, accum_steps = fn.optimize(*run)
            expected = call["result"]
            assert np.array_equal(atomic_bsz, expected["atomic_bsz"]), (
                case["id"],
                args,
            )
            assert np.array_equal(accum_steps, expected["accum_steps"]), (
                case["id"],
                args,
            )
            np.testing.assert_allclose(goodput, expected["goodput"], rtol=1e-12, atol=0)
            if np.isscalar(args["num_nodes"]) or np.isscalar(args["num_replicas"]):
                assert type(goodput) is float and type(atomic_bsz) is int
                assert type(accum_steps) is int
            else:
                assert np.shape(goodput) == np.shape(expected["goodput"])
            calls += 1
    assert calls > 1500 and errors > 75


def test_candidates_match_adaptdl_sampling():
    """The 50 (atomic_bsz, accum_steps) per replica count, all reference rows."""
    sample = jax.jit(
        jax.vmap(model.candidate_configs, in_axes=(None, 0, None, None, None, None)),
        static_argnums=5,
    )
    rows = 0
    for case in _GOODPUT:
        init = case["init_batch_size"]
        for call in case["optimize"]:
            if "candidates" not in call:
                continue
            args = call["args"]
            max_batch = args["max_batch_size"] or init
            low, high = _range(args["atomic_bsz_range"]) or (None, None)
            shape = np.broadcast(
                np.asarray(args["num_nodes"]), np.asarray(args["num_replicas"])
            ).shape
            replicas = np.broadcast_to(args["num_replicas"], shape).ravel()
            padded = np.ones(8)  # one shape: one compilation per accumulation flag
            padded[: len(replicas)] = replicas
            with jax.enable_x64(True):
                atomic, accum = sample(
                    float(init),
                    padded,
                    float(max_batch),
                    float(low or 1),
                    float(high or max_batch),
                    args["accumulation"],
                )
            expected = call["candidates"]
            atomic, accum = atomic[: len(replicas)], accum[: len(replicas)]
            np.testing.assert_array_equal(
                atomic, np.reshape(expected["atomic_bsz"], atomic.shape)
            )
            np.testing.assert_array_equal(
                accum, np.reshape(expected["accum_steps"], accum.shape)
            )
            rows += len(replicas)
    assert rows > 5000


def test_hand_computed_goodput():
    # alpha_c 1 s + 0.1 s/sample; one replica: network 1e-8 + 1e-8 * 1e-8;
    # gamma 1: optim = accum + network.
    fn = GoodputFunction((1.0, 0.1, 0.5, 0.01, 0.2, 0.02, 1.0), (1.0, 1.0), 10)
    accum = 1.0 + 0.1 * 10
    np.testing.assert_allclose(
        fn.throughput(1, 1, 10, 0), 10 / (accum + 1e-8 + 1e-16), rtol=1e-15
    )
    # Two steps of accumulation: 3 x 10 samples in 2 x accum + optim.
    np.testing.assert_allclose(
        fn.throughput(1, 1, 10, 2), 30 / (3 * accum + 1e-8 + 1e-16), rtol=1e-15
    )
    # 4 replicas on 1 node: intra-node 0.2 + 0.02 * (4 - 2); batch 40.
    np.testing.assert_allclose(
        fn.throughput(1, 4, 10, 0), 40 / (accum + 0.2 + 0.04), rtol=1e-15
    )
    # 2 nodes, 2 replicas: inter-node 0.5 + 0.01 * 1e-8.
    np.testing.assert_allclose(
        fn.throughput(2, 2, 10, 0), 20 / (accum + 0.5 + 1e-10), rtol=1e-15
    )
    # Efficiency at batch 20 (scale 2): (1 + 1) / (1 / 2 + 1) / 2 = 2 / 3.
    np.testing.assert_allclose(fn.efficiency(20), 2 / 3, rtol=1e-15)
    np.testing.assert_allclose(fn.efficiency(10), 1.0, rtol=1e-15)
    np.testing.assert_allclose(
        fn.evaluate(1, 2, 10, 0), fn.throughput(1, 2, 10, 0) * 2 / 3, rtol=1e-15
    )
    # No gradient signal (sqr = var = 0): gain 1, efficiency = init / batch.
    flat = GoodputFunction(fn.perf_params, GradParams(0.0, 0.0), 10)
    np.testing.assert_allclose(flat.efficiency(40), 0.25, rtol=1e-15)


def test_hand_computed_optimize():
    fn = GoodputFunction((1.0, 0.1, 0.5, 0.01, 0.2, 0.02, 1.0), (1.0, 1.0), 10)
    # max batch = init: every candidate is the batch 10 split over 4 replicas,
    # atomic ceil(2.5) = 3.
    goodput, atomic, accum = fn.optimize(1, 4)
    assert (atomic, accum) == (3, 0)
    np.testing.assert_allclose(goodput, fn.evaluate(1, 4, 3, 0), rtol=1e-14)
    # An empty atomic range (min 30 > max 20): every candidate scores 0 and the
    # first one (batch 4 x 30 = 120, sampled down to 100) is returned.
    goodput, atomic, accum = fn.optimize(1, 4, 100, (30, 20))
    assert goodput == 0.0 and atomic == 30 and accum == 0
    # Accumulation with one replica: at least one extra step for every candidate
    # past the initial batch (its gradient statistics need two micro-batches).
    with jax.enable_x64(True):
        sample = jax.jit(model.candidate_configs, static_argnums=5)
        sampled = sample(10.0, 1.0, 1000.0, 1.0, 1000.0, True)
        atomic, accum = (np.asarray(a) for a in sampled)
    batch = np.geomspace(10, 1000)
    np.testing.assert_array_equal(accum >= 1, batch > 10 + 1e-8)
    np.testing.assert_array_equal(atomic, np.ceil(batch / (accum + 1) - 1e-8))
    # Shapes: 2-D inputs keep their shape; a scalar meets one element only.
    goodput, atomic, accum = fn.optimize(np.ones((2, 3), int), np.full((2, 3), 4), 200)
    assert goodput.shape == atomic.shape == accum.shape == (2, 3)
    assert isinstance(fn.optimize(1, [4], 200)[1], int)
    with pytest.raises(ValueError, match="scalar"):
        fn.optimize(1, [2, 4], 200)


def test_bad_input_raises_value_errors_naming_the_argument():
    fn = GoodputFunction((1.0, 0.1, 0.5, 0.01, 0.2, 0.02, 1.0), (1.0, 1.0), 10)
    for args, name in [
        ((0, 1), "num_nodes"),
        ((3, 2), "num_replicas"),
        ((1, 2, 5), "max_batch_size"),
    ]:
        with pytest.raises(GoodputInputError, match=name) as info:
            fn.optimize(*args)
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, AssertionError)  # AdaptDL's `except` still works
    with pytest.raises(ValueError, match="perf_params"):
        GoodputFunction((1.0, 2.0), (1.0, 1.0), 10)
    with pytest.raises(ValueError, match="grad_params"):
        GoodputFunction(fn.perf_params, (1.0,), 10)
    with pytest.raises(ValueError, match="init_batch_size"):
        GoodputFunction(fn.perf_params, (1.0, 1.0), 0)
    with pytest.raises(ValueError, match="optim_step_time has 2 values"):
        fit_perf_params([1, 1, 1], [1, 2, 4], [8, 8, 8], [1, 1, 1], [1, 1])
    with pytest.raises(ValueError, match="accum_step_time must be positive"):
        fit_perf_params([1], [1], [8], [0.0], [1.0])


def test_jit_and_vmap_agree_with_a_loop():
    case = _GOODPUT[3]
    fn = _function(case)
    e = case["evaluate"]
    configs = np.array(
        [e[k] for k in ("num_nodes", "num_replicas", "atomic_bsz", "accum_steps")]
    ).T
    with jax.enable_x64(True):
        one = jax.jit(
            lambda n, r, a, s: model.goodput(
                fn.perf_params, fn.grad_params, fn.init_batch_size, n, r, a, s
            )
        )
        batched = jax.vmap(one)(*configs.T)
        looped = [float(one(*row)) for row in configs]
        # GoodputFunction's methods are traceable too.
        traced = jax.jit(jax.vmap(fn.evaluate))(*(jnp.asarray(c) for c in configs.T))
    np.testing.assert_allclose(batched, looped, rtol=1e-15)
    np.testing.assert_allclose(traced, e["goodput"], rtol=1e-12)
    # optimize: one vectorized call equals a loop of scalar calls.
    nodes = np.array([1, 1, 2, 4, 1])
    replicas = np.array([1, 3, 2, 8, 8])
    vector = fn.optimize(nodes, replicas, 8 * case["init_batch_size"], None, True)
    for i in range(len(nodes)):
        scalar = fn.optimize(
            int(nodes[i]), int(replicas[i]), 8 * case["init_batch_size"], None, True
        )
        assert scalar[1:] == (vector[1][i], vector[2][i])
        np.testing.assert_allclose(scalar[0], vector[0][i], rtol=1e-15)


def _central_difference(f, x, h):
    grad = np.zeros_like(x)
    for i in range(x.size):
        step = np.zeros_like(x)
        step[i] = h * max(abs(x[i]), 1e-3)
        grad[i] = (f(x + step) - f(x - step)) / (2 * step[i])
    return grad


def test_grad_of_the_objectives_matches_finite_differences():
    fits = _load("goodput_fit_cases")["cases"]
    case = next(c for c in fits if c["coverage"] == "full")
    data = [np.asarray(case["inputs"][k], dtype=float) for k in FIT_COLUMNS]
    x = np.array(list(case["true_params"].values())) * 1.3 + 1e-4
    with jax.enable_x64(True):
        objective = jax.jit(lambda p: perf_objective(p, *data))
        exact = np.asarray(jax.grad(objective)(jnp.asarray(x)))
        numeric = _central_difference(lambda p: float(objective(p)), x, 1e-6)
        np.testing.assert_allclose(exact, numeric, rtol=1e-5, atol=1e-9)
        # Goodput against perf params, gradient statistics and the batch size.
        fn = _function(_GOODPUT[0])

        @jax.jit
        def goodput(p, atomic_bsz):
            return model.goodput(
                PerfParams(*p[:7]), GradParams(*p[7:]), 1000.0, 2, 8, atomic_bsz, 1
            )

        point = np.array([*fn.perf_params, *fn.grad_params])
        for atomic_bsz in (150.0, 700.0):
            exact = np.asarray(jax.grad(goodput)(jnp.asarray(point), atomic_bsz))
            numeric = _central_difference(
                lambda p, m=atomic_bsz: float(goodput(p, m)), point, 1e-4
            )
            np.testing.assert_allclose(exact, numeric, rtol=1e-5, atol=1e-6)
            d_batch = jax.grad(goodput, argnums=1)(jnp.asarray(point), atomic_bsz)
            h = 1e-4
            fd = (goodput(point, atomic_bsz + h) - goodput(point, atomic_bsz - h)) / (
                2 * h
            )
            np.testing.assert_allclose(d_batch, fd, rtol=1e-6)


def test_goodput_from_step_time_equals_pollux_with_its_own_step_time():
    fn = _function(_GOODPUT[5])
    nodes, replicas, atomic, accum = 2, 8, 37, 3
    with jax.enable_x64(True):

        @jax.jit
        def from_step_time(perf, grad):
            step = model.predict_step_time(perf, nodes, replicas, atomic, accum)
            batch = replicas * atomic * (accum + 1)
            return model.goodput_from_step_time(grad, fn.init_batch_size, batch, step)

        value = from_step_time(fn.perf_params, fn.grad_params)
    np.testing.assert_allclose(
        value, fn.evaluate(nodes, replicas, atomic, accum), rtol=1e-14
    )


_FIT = _load("goodput_fit_cases")["cases"]


def test_fit_is_as_good_as_adaptdl_and_predicts_alike():
    compared = 0
    for case in _FIT:
        data = [np.asarray(case["inputs"][k], dtype=float) for k in FIT_COLUMNS]
        fitted = fit_perf_params(*case["inputs"].values())
        assert isinstance(fitted, PerfParams)
        with jax.enable_x64(True):
            ours = float(perf_objective(np.array(fitted), *data))
            theirs = case["fitted_stats"]["objective"]
            assert ours <= 1.01 * theirs + 1e-12, (case["id"], ours, theirs)
            best = case["best_known"]["objective"]
            if not (
                case["reference_within_1pct_of_best_known"]
                and abs(ours / best - 1) <= 0.01
            ):
                continue
            predicted = _predict(fitted, data[0], data[1], data[2])
            accum, optim = np.asarray(predicted[0]), np.exp(np.asarray(predicted[2]))
        stats = case["fitted_stats"]
        rel = np.abs(
            np.concatenate(
                [
                    accum / np.asarray(stats["pred_accum_time"]),
                    optim / np.asarray(stats["pred_optim_time"]),
                ]
            )
            - 1
        )
        assert np.median(rel) <= 0.005 and np.quantile(rel, 0.9) <= 0.02, case["id"]
        assert rel.max() <= 0.10, case["id"]
        compared += 1
    assert compared >= 15


def test_fit_recovers_noise_free_parameters():
    truth = PerfParams(0.05, 0.002, 0.3, 0.01, 0.05, 0.002, 2.0)
    rng = np.random.default_rng(0)
    nodes = rng.integers(1, 5, 60)
    replicas = nodes * rng.integers(1, 5, 60)
    atomic = rng.integers(8, 256, 60)
    with jax.enable_x64(True):
        accum = np.asarray(model.predict_accum_time(truth, atomic))
        network = model.predict_network_time(truth, nodes, replicas)
        optim = np.exp(np.asarray(model.predict_log_optim_time(truth, accum, network)))
        fitted = fit_perf_params(nodes, replicas, atomic, accum, optim)
        fit_accum = np.asarray(model.predict_accum_time(fitted, atomic))
        fit_network = model.predict_network_time(fitted, nodes, replicas)
        fit_log_optim = model.predict_log_optim_time(fitted, fit_accum, fit_network)
    # Noise-free times are predicted closely; the compute model is identified.
    np.testing.assert_allclose(fit_accum, accum, rtol=1e-6)
    np.testing.assert_allclose(np.exp(fit_log_optim), optim, rtol=0.01)
    np.testing.assert_allclose(fitted.alpha_c, truth.alpha_c, rtol=1e-4)
    np.testing.assert_allclose(fitted.beta_c, truth.beta_c, rtol=1e-4)
    np.testing.assert_allclose(fitted.alpha_n, truth.alpha_n, rtol=0.02)
