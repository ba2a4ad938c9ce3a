"""The differentiable engine: valid plans, optimality on tiny cases, gradients,
jit/vmap/loop agreement, no retracing, determinism, multi-device restarts."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    fake_devices_env,
    python_last_line,
    relaxed_start,
    solved_alike,
    tiny_problem,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from pipedejavu import InfeasibleProblemError, ProblemError, evaluate
from pipedejavu.baselines import brute_force, exact_dp
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine import driver as engine
from pipedejavu.search.engine import restarts
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.engine.driver import differentiable, search
from pipedejavu.search.engine.relax import (
    RelaxedParams,
    RelaxedProblem,
    relaxed_loss,
    soft_assignment,
)

SMALL = SearchConfig(num_restarts=8, num_steps=40, num_chunks=2, num_polished=2)


def _tiny(seed: int):
    # Fixed L keeps the number of compiled shapes (and the test time) small.
    return tiny_problem(np.random.default_rng(seed), max_layers=6)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(seed=st.integers(0, 10_000))
def test_engine_plans_are_valid_and_never_beat_the_optimum(seed):
    problem = _tiny(seed)
    solved = solved_alike(
        brute_force,
        lambda p: differentiable(p, SMALL, key=jax.random.key(seed)),
        problem,
    )
    if solved is None:
        return
    optimum, plan = solved[0].cost, solved[1]
    assert plan.cost == evaluate(problem, plan)
    assert plan.cost >= optimum * (1 - 1e-12)
    assert plan.info["lower_bound"] <= optimum * (1 + 1e-12)


def test_engine_reaches_the_optimum_on_most_tiny_instances():
    reached = total = 0
    for seed in range(40):
        problem = _tiny(100 + seed)
        try:
            optimum = brute_force(problem).cost
        except InfeasibleProblemError:
            continue
        total += 1
        plan = differentiable(problem, SMALL, key=jax.random.key(seed))
        reached += plan.cost <= optimum * (1 + 1e-9)
    assert total >= 25
    assert reached / total >= 0.9


@pytest.mark.parametrize(("layers", "cluster"), [(24, (2, 4)), (32, (2, 8))])
@pytest.mark.parametrize("tightness", [None, 2.0])
def test_engine_matches_the_dp_on_generated_instances(layers, cluster, tightness):
    problem = random_problem(
        layers, cluster, num_microbatches=16, memory_tightness=tightness, seed=11
    )
    plan = differentiable(problem, SMALL, key=jax.random.key(0))
    optimum = exact_dp(problem).cost
    assert plan.cost <= optimum * 1.01
    assert plan.info["lower_bound"] <= optimum
    assert 0 <= plan.info["gap"]


def _relaxed_instance(num_layers=7, num_slots=3, num_stages=4, seed=0):
    rng = np.random.default_rng(seed)
    data = RelaxedProblem(
        per_layer=jnp.asarray(rng.uniform(0.1, 1.0, (num_layers, num_slots))),
        intercept=jnp.asarray(rng.uniform(0.0, 0.2, num_slots)),
        slot_devices=jnp.asarray([1.0, 2.0, 4.0][:num_slots]),
        num_devices=jnp.asarray(4.0),
        num_microbatches=jnp.asarray(8.0),
    )
    params, mask, temps = relaxed_start(rng, RelaxedParams, num_stages, num_slots)
    return params, data, mask, temps


def test_gradients_match_finite_differences():
    with jax.enable_x64(True):
        params, data, mask, temps = _relaxed_instance()
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
        check_grads(
            lambda p: relaxed_loss(p, data, mask, temps),
            (params,),
            order=1,
            modes=["rev"],
            atol=1e-5,
            rtol=1e-5,
        )
        grads = jax.grad(relaxed_loss)(params, data, mask, temps)
        assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_soft_assignment_is_a_partition_of_layers():
    ends = jnp.asarray([2.0, 2.0, 5.0, 8.0])  # an empty second stage
    membership = soft_assignment(ends, 8, jnp.asarray(0.01))
    np.testing.assert_allclose(membership.sum(axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(membership.sum(axis=0), [2, 0, 3, 3], atol=1e-6)


def test_jit_vmap_and_loop_agree():
    params, data, mask, temps = _relaxed_instance()
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, 0.5 * x, -x]), params)
    masks = jnp.stack([mask, mask, jnp.ones_like(mask)])
    vmapped = jax.jit(jax.vmap(relaxed_loss, in_axes=(0, None, 0, None)))(
        batch, data, masks, temps
    )
    looped = []
    for restart in range(3):
        one = RelaxedParams(*(x[restart] for x in batch))
        looped.append(relaxed_loss(one, data, masks[restart], temps))
    np.testing.assert_allclose(vmapped, looped, rtol=1e-6)


def test_the_jitted_step_traces_once():
    problem = random_problem(12, (1, 4), num_microbatches=8, seed=1)
    config = SearchConfig(
        num_restarts=4, num_steps=30, num_chunks=3, num_polished=1, learning_rate=0.07
    )
    before = restarts.TRACE_COUNT[0]
    first = search(problem, config, key=jax.random.key(0))
    assert restarts.TRACE_COUNT[0] == before + 1  # three chunks, one trace
    assert first.compile_time_s > 0
    second = search(problem, config, key=jax.random.key(1))
    assert restarts.TRACE_COUNT[0] == before + 1
    assert second.compile_time_s == 0.0
    assert len(first.loss_curve) == 30


def test_same_key_same_plan():
    problem = random_problem(20, (2, 4), num_microbatches=8, seed=4)
    a = differentiable(problem, SMALL, key=jax.random.key(7))
    b = differentiable(problem, SMALL, key=jax.random.key(7))
    assert [s.to_json() for s in a.stages] == [s.to_json() for s in b.stages]
    assert a.cost == b.cost


def test_search_result_reports_what_it_did():
    problem = random_problem(16, (1, 8), num_microbatches=8, seed=2)
    progress = []
    result = search(
        problem, SMALL, key=jax.random.key(0), progress_fn=lambda *a: progress.append(a)
    )
    assert [p[0] for p in progress] == [20, 40]
    assert result.loss_curve.shape == (40,)
    assert result.final_losses.shape == (8,)
    assert 0 < result.fraction_best <= 1
    assert result.best_restart in result.polished_costs
    assert result.plan.info["lower_bound"] == result.lower_bound


_MULTI = """
import json, jax
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine.driver import SearchConfig, differentiable
problem = random_problem(20, (2, 4), num_microbatches=8, seed=4)
config = SearchConfig(num_restarts=8, num_steps=40, num_chunks=2, num_polished=2)
plan = differentiable(problem, config, key=jax.random.key(3))
print(json.dumps({"devices": jax.device_count(), "stages": [s.to_json() for s in
      plan.stages], "cost": plan.cost, "best": plan.info["best_restart"]}))
"""


def test_restarts_sharded_over_devices_give_the_same_plan():
    results = []
    for count in (1, 4):
        results.append(json.loads(python_last_line(_MULTI, fake_devices_env(count))))
    assert [r["devices"] for r in results] == [1, 4]
    assert results[0]["stages"] == results[1]["stages"]
    assert results[0]["cost"] == results[1]["cost"]


def test_time_budget_still_returns_a_valid_plan():
    problem = random_problem(24, (2, 4), num_microbatches=8, seed=6)
    config = SearchConfig(
        num_restarts=8, num_steps=40, num_chunks=2, num_polished=4, time_budget_s=1e-6
    )
    result = search(problem, config, key=jax.random.key(0))
    assert len(result.polished_costs) == 1  # stopped after the first candidate
    assert result.plan.cost == evaluate(problem, result.plan)
    with pytest.raises(ValueError, match="time_budget_s"):
        SearchConfig(time_budget_s=0)


def test_restarts_in_memory_limited_batches_give_the_same_plan():
    # The shapes of test_search_result_reports_what_it_did: compiled once.
    problem = random_problem(16, (1, 8), num_microbatches=8, seed=2)
    whole = search(problem, SMALL, key=jax.random.key(2))
    per_restart, _ = engine.restart_bytes(16, 8, 8)
    progress = []
    limited = dataclasses.replace(SMALL, memory_limit_gb=4.5 * per_restart / 2**30)
    batched = search(
        problem,
        limited,
        key=jax.random.key(2),
        progress_fn=lambda *a: progress.append(a),
    )
    assert [p[0] for p in progress][:2] == [0, 20]  # the early line, then steps
    assert progress[-1][:2] == (80, 80)  # 8 restarts in batches of 4
    assert batched.final_losses.shape == (8,)
    np.testing.assert_allclose(batched.final_losses, whole.final_losses, rtol=1e-4)
    assert batched.plan.cost == whole.plan.cost


def test_too_many_restarts_are_refused_before_compiling(capsys):
    from pipedejavu.cli.main import main

    problem = random_problem(16, (1, 8), num_microbatches=8, seed=2)
    config = dataclasses.replace(SMALL, num_restarts=10**6, memory_limit_gb=0.5)
    with pytest.raises(ProblemError, match="memory_limit_gb = 0.5"):
        search(problem, config, key=jax.random.key(0))
    code = main(
        ["solve", "generated-gpt-32layers-2x8", "--method", "diff", "--restarts",
         "100000000"]
    )  # fmt: skip
    assert code == 2  # the command line bounds --restarts before any work
    assert "--restarts must be >= 1 and <= 4096" in capsys.readouterr().err


def test_loss_curve_is_in_seconds_and_never_rises():
    problem = random_problem(16, (1, 8), num_microbatches=8, seed=2)
    progress = []
    result = search(
        problem, SMALL, key=jax.random.key(0), progress_fn=lambda *a: progress.append(a)
    )
    curve = result.loss_curve
    assert np.all(np.diff(curve) <= 0)
    assert curve.tolist() == result.plan.info["loss_curve"]
    # Progress reports the same numbers, in the same unit as the plan's cost.
    assert [p[2] for p in progress] == [curve[19], curve[39]]
    # Seconds, not a normalized loss: the same search on a table ten times
    # slower gives a curve ten times higher (the engine is scale-equivariant).
    slower = problem.replace(compute_cost=problem.compute_cost * 10)
    scaled = search(slower, SMALL, key=jax.random.key(0))
    np.testing.assert_allclose(scaled.loss_curve, 10 * curve, rtol=1e-4)
    assert scaled.plan.cost == pytest.approx(10 * result.plan.cost, rel=1e-12)


def test_polish_stops_once_the_bound_proves_the_plan_optimal():
    problem = random_problem(16, (1, 8), num_microbatches=8, seed=2)
    config = dataclasses.replace(SMALL, num_polished=4)
    result = search(problem, config, key=jax.random.key(0))
    assert result.plan.info["proven_optimal"]
    assert result.plan.cost <= result.lower_bound * (1 + 1e-9)
    assert len(result.polished_costs) == 1  # the others were not needed
    np.testing.assert_allclose(result.plan.cost, exact_dp(problem).cost, rtol=1e-12)


def test_bucketed_layers_share_compiled_code():
    before = restarts.TRACE_COUNT[0]
    for layers in (13, 15):  # both pad to 16 layers
        search(
            random_problem(layers, (1, 4), seed=layers), SMALL, key=jax.random.key(0)
        )
    assert restarts.TRACE_COUNT[0] - before <= 1


def test_a_plan_no_neighbourhood_holds_comes_from_the_exact_dp():
    # Four one-layer stages on four devices: roundings of fewer stages have too
    # few anchors for the polish to reach it (found by hypothesis).
    problem = tiny_problem(np.random.default_rng(3697), max_layers=6)
    plan = differentiable(problem, SMALL, key=jax.random.key(3697))
    assert plan.num_stages == 4
    np.testing.assert_allclose(plan.cost, brute_force(problem).cost, rtol=1e-12)
