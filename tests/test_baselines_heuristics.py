"""Uniform, greedy, random search and annealing against the exact optimum."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import tiny_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedejavu import InfeasibleProblemError, Problem, evaluate
from pipedejavu.baselines import brute_force, exact_dp
from pipedejavu.baselines.annealing import anneal
from pipedejavu.baselines.heuristics import (
    greedy,
    linear_partition,
    random_search,
    uniform,
)
from pipedejavu.core.problem import PlanError, check_plan, objective
from pipedejavu.costmodel.stage.generate import random_problem


def _planners(seed: int = 0):
    return {
        "uniform": uniform,
        "greedy": greedy,
        "random": lambda p: random_search(p, num_samples=200, seed=seed),
        "anneal": lambda p: anneal(p, num_steps=300, seed=seed),
    }


def _check_against_optimum(problem: Problem, optimum: float | None) -> int:
    """Every planner: a valid plan with cost == evaluate, never below the
    optimum; an infeasible problem raises. Returns how many plans came back."""
    returned = 0
    for name, planner in _planners().items():
        try:
            plan = planner(problem)
        except InfeasibleProblemError as error:
            assert str(error)
            if optimum is not None:  # only the heuristic's family may be empty
                assert "feasible plans" in str(error)
            continue
        assert optimum is not None, f"{name} planned an infeasible problem"
        check_plan(problem, plan)
        assert plan.cost == evaluate(problem, plan)
        assert plan.method == name
        assert plan.search_time_s >= 0
        assert plan.cost >= optimum * (1 - 1e-12), name
        returned += 1
    return returned


def _optimum(problem: Problem) -> float | None:
    try:
        return exact_dp(problem).cost
    except InfeasibleProblemError:
        return None


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    num_layers=st.integers(1, 10),
    cluster=st.sampled_from([(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (1, 8)]),
    num_configs=st.integers(1, 3),
    missing=st.sampled_from([0.0, 0.3]),
    tightness=st.sampled_from([None, 1.0, 2.0, 4.0]),
    micro=st.sampled_from([1, 4, 32]),
    seed=st.integers(0, 10_000),
)
def test_plans_are_valid_and_never_beat_the_dp(
    num_layers, cluster, num_configs, missing, tightness, micro, seed
):
    problem = random_problem(
        num_layers,
        cluster,
        num_configs=num_configs,
        missing=missing,
        memory_tightness=tightness,
        num_microbatches=micro,
        seed=seed,
    )
    _check_against_optimum(problem, _optimum(problem))


def test_tiny_problems_against_brute_force():
    rng = np.random.default_rng(31)
    returned = 0
    for _ in range(60):
        problem = tiny_problem(rng)
        try:
            optimum = brute_force(problem).cost
        except InfeasibleProblemError:
            optimum = None
        returned += _check_against_optimum(problem, optimum)
    assert returned >= 120  # most planners find plans on most instances


def _uniform_family_oracle(problem: Problem) -> float:
    """Best uniform plan by enumeration: every S, every placement of the longer
    stages, every equal-size submesh and config per stage."""
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes
    best = math.inf
    for count in range(1, min(num_layers, num_devices) + 1):
        shapes = np.flatnonzero(sizes * count == num_devices).tolist()
        if num_devices % count or not shapes:
            continue
        base, extra = divmod(num_layers, count)
        for longer in itertools.combinations(range(count), extra):
            lengths = [base + (s in longer) for s in range(count)]
            bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            choices = itertools.product(
                itertools.product(shapes, range(problem.num_configs)), repeat=count
            )
            for choice in choices:
                latencies = []
                for s, (m, k) in enumerate(choice):
                    a, b = bounds[s], bounds[s + 1] - 1
                    ok = problem.max_n_succ_stages[a, b, m, k] >= count - 1 - s
                    latencies.append(float(problem.compute_cost[a, b, m, k]))
                    if not (ok and math.isfinite(latencies[-1])):
                        break
                else:
                    best = min(best, objective(latencies, problem.num_microbatches))
    return best


def test_uniform_is_the_best_uniform_plan():
    rng = np.random.default_rng(8)
    compared = 0
    for _ in range(80):
        problem = tiny_problem(rng, max_layers=7, max_devices=4)
        oracle = _uniform_family_oracle(problem)
        if not math.isfinite(oracle):
            with pytest.raises(InfeasibleProblemError):
                uniform(problem)
            continue
        np.testing.assert_allclose(uniform(problem).cost, oracle, rtol=1e-12)
        compared += 1
    assert compared >= 30


def test_uniform_returns_the_optimum_when_uniform_is_optimal():
    # Stage time len / n * (1 + 0.2 log2 n): four 1-device stages of two layers
    # each have the least possible max (2 s = total work / devices) and the
    # same sum as any 1-device split; bigger submeshes only add overhead.
    num_layers, shapes = 8, np.array([[1, 1], [1, 2], [1, 4]])
    sizes = shapes[:, 0] * shapes[:, 1]
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1.0
    cost = spans[:, :, None, None] / sizes[None, None, :, None]
    cost = cost * (1 + 0.2 * np.log2(sizes))[None, None, :, None]
    problem = Problem(cost, None, shapes, (1, 4), 32)
    plan = uniform(problem)
    np.testing.assert_allclose(plan.cost, exact_dp(problem).cost, rtol=1e-12)
    np.testing.assert_allclose(plan.cost, 8.0 + 31 * 2.0, rtol=1e-12)
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert plan.info["num_stages"] == 4


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_linear_partition_minimizes_the_bottleneck(num_stages, seed):
    weights = np.random.default_rng(seed).uniform(0.1, 3.0, 9)
    bounds = linear_partition(weights, num_stages)
    assert bounds[0] == 0 and bounds[-1] == 9 and len(bounds) == num_stages + 1
    assert all(a < b for a, b in itertools.pairwise(bounds))
    got = max(weights[a:b].sum() for a, b in itertools.pairwise(bounds))
    best = min(
        max(weights[a:b].sum() for a, b in itertools.pairwise((0, *cuts, 9)))
        for cuts in itertools.combinations(range(1, 9), num_stages - 1)
    )
    np.testing.assert_allclose(got, best, rtol=1e-12)


def test_greedy_balances_equal_layers_exactly():
    # Additive costs with equal layers: the balanced split is the optimum.
    problem = random_problem(16, (1, 4), irregularity=0.0, edge_weight=1.0, noise=0)
    plan = greedy(problem)
    assert {s.stop - s.start for s in plan.stages} == {16 // plan.num_stages}
    assert plan.cost <= uniform(problem).cost * (1 + 1e-12)


def _small_generated() -> list[Problem]:
    problems = []
    for num_layers, cluster, seed in itertools.product(
        (4, 6, 8), ((1, 4), (2, 2)), range(3)
    ):
        for extra in (
            {},
            {"memory_tightness": 1.5},
            {"missing": 0.3, "num_configs": 3},
        ):
            problems.append(
                random_problem(
                    num_layers,
                    cluster,
                    seed=seed,
                    irregularity=0.6,
                    num_microbatches=(1, 8, 32)[seed],
                    **extra,
                )
            )
    return problems


def test_anneal_reaches_the_optimum_on_small_instances():
    reached = 0
    for index, problem in enumerate(_small_generated()):
        optimum = _optimum(problem)
        if optimum is None:
            continue
        plan = anneal(problem, num_steps=3000, seed=index)
        np.testing.assert_allclose(plan.cost, optimum, rtol=1e-9)
        reached += 1
    assert reached >= 40


def test_anneal_improves_on_its_start_and_records_a_trace():
    problem = random_problem(32, (2, 8), seed=3, irregularity=0.5)
    start = random_search(problem, num_samples=20, seed=1)
    plan = anneal(problem, num_steps=5000, seed=2, initial=start)
    info = plan.info
    assert info["initial_method"] == "random"
    np.testing.assert_allclose(info["initial_score"], start.cost, rtol=1e-12)
    assert plan.cost < start.cost
    times, costs = zip(*info["trace"], strict=True)
    assert times[0] >= 0 and list(times) == sorted(times)
    assert list(costs) == sorted(costs, reverse=True)
    np.testing.assert_allclose(costs[-1], plan.cost, rtol=1e-12)
    assert info["num_steps_run"] == 5000 and 0 < info["acceptance_rate"] <= 1


def test_seeded_planners_are_deterministic():
    problem = random_problem(24, (2, 4), seed=5, missing=0.2)
    for planner in (
        lambda seed: random_search(problem, num_samples=300, seed=seed),
        lambda seed: anneal(problem, num_steps=2000, seed=seed),
    ):
        first, again = planner(11), planner(11)
        assert first.stages == again.stages and first.cost == again.cost


def test_anneal_minimizes_a_user_score():
    # Score each plan with B = 1 (least sum of stage times): anneal must find
    # the optimum of that other problem while staying valid for its own.
    problem = random_problem(8, (1, 4), seed=2, num_microbatches=16)
    other = problem.replace(num_microbatches=1)
    calls = []

    def score_fn(plan):
        calls.append(plan)
        return evaluate(other, plan)

    plan = anneal(problem, num_steps=2000, seed=0, score_fn=score_fn)
    np.testing.assert_allclose(plan.info["best_score"], exact_dp(other).cost, rtol=1e-9)
    assert plan.info["score"] == "score_fn" and len(calls) > 100
    assert plan.cost == evaluate(problem, plan)


def test_anneal_progress_and_time_budget():
    problem = random_problem(16, (1, 8), seed=0)
    seen = []
    anneal(problem, num_steps=1000, progress_fn=lambda *args: seen.append(args))
    assert len(seen) == 100 and seen[-1][:2] == (1000, 1000)
    assert all(a[2] >= b[2] for a, b in itertools.pairwise(seen))
    plan = anneal(problem, num_steps=10**8, time_budget_s=0.2)
    assert plan.info["num_steps_run"] < 10**8 and plan.search_time_s < 5


def _infeasible_uniform() -> Problem:
    # Feasible only as stages of 1, 1, 2 devices: no equal split exists.
    table = np.full((3, 3, 3, 1), np.inf)
    table[0, 0, 0] = table[1, 1, 0] = 1.0
    table[2, 2, 1] = 1.0
    return Problem(table, None, np.array([[1, 1], [1, 2], [1, 4]]), (1, 4), 4)


def test_an_empty_family_says_the_problem_has_plans():
    problem = _infeasible_uniform()
    assert exact_dp(problem).num_stages == 3
    for planner in (uniform, greedy):
        with pytest.raises(InfeasibleProblemError, match="feasible plans"):
            planner(problem)
    np.testing.assert_allclose(random_search(problem).cost, exact_dp(problem).cost)
    np.testing.assert_allclose(anneal(problem).cost, exact_dp(problem).cost)


@pytest.mark.parametrize(
    ("memory_value", "message"),
    [(None, "no stage has a profiled"), (-1, "over its memory limit")],
)
def test_infeasible_problems_raise_with_the_reason(memory_value, message):
    table = np.full((3, 3, 2, 1), np.inf if memory_value is None else 1.0)
    memory = None if memory_value is None else np.full(table.shape, memory_value)
    problem = Problem(table, memory, np.array([[1, 1], [1, 2]]), (1, 2), 4)
    for planner in _planners().values():
        with pytest.raises(InfeasibleProblemError, match=message):
            planner(problem)


def test_bad_arguments_raise():
    problem = random_problem(4, (1, 2))
    with pytest.raises(ValueError, match="num_samples"):
        random_search(problem, num_samples=0)
    with pytest.raises(ValueError, match="num_steps"):
        anneal(problem, num_steps=-1)
    with pytest.raises(ValueError, match="temperature"):
        anneal(problem, initial_temperature=0.01, final_temperature=0.1)
    with pytest.raises(ValueError, match="time_budget_s"):
        anneal(problem, time_budget_s=0)
    with pytest.raises(ValueError, match="initial"):
        anneal(problem, initial="best")
    other = random_problem(4, (1, 4))
    with pytest.raises(PlanError):
        anneal(problem, initial=uniform(other))
