"""``alpa_compatible=True`` reproduces Alpa's own training_dp answers exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import solved_alike, tiny_problem, two_layer_problem

from pipedejavu import InfeasibleProblemError, Problem, evaluate
from pipedejavu.baselines import exact_dp
from pipedejavu.baselines.alpa_dp import alpa_training_dp

FIXTURE = Path(__file__).parent / "fixtures" / "alpa_reference.json"


def _cases():
    data = json.loads(FIXTURE.read_text())
    for index, case in enumerate(data["cases"]):
        yield pytest.param(case, id=f"{case['kind']}-{index}")


def _problem(case: dict) -> Problem:
    shape = case["shape"]
    cost = np.array([np.inf if x is None else x for x in case["compute_cost"]]).reshape(
        shape
    )
    return Problem(
        compute_cost=cost,
        max_n_succ_stages=np.array(case["max_n_succ_stages"]).reshape(shape),
        submesh_shapes=np.array(case["submesh_shapes"]),
        cluster_shape=tuple(case["cluster_shape"]),
        num_microbatches=case["num_microbatches"],
    )


@pytest.mark.parametrize("case", list(_cases()))
def test_same_plan_and_cost_as_alpas_training_dp(case):
    """Expected values: Alpa's training_dp run under numba (see the fixture's
    make_alpa_reference.py); equality is exact, float32 rounding included."""
    problem = _problem(case)
    if case["alpa"] is None:
        with pytest.raises(InfeasibleProblemError):
            alpa_training_dp(problem)
        return
    plan = alpa_training_dp(problem)
    stages = [[s.start, s.stop, s.submesh_index, s.config_index] for s in plan.stages]
    assert stages == case["alpa"]["stages"]
    assert plan.info["alpa_cost"] == case["alpa"]["cost"]
    assert plan.cost == evaluate(problem, plan)


def test_fixture_exercises_the_hard_parts():
    cases = [c for c in json.loads(FIXTURE.read_text())["cases"] if c["alpa"]]
    exact_costs = []
    for case in cases:
        problem = _problem(case)
        exact_costs.append(
            exact_dp(problem).cost
            / evaluate(problem, [_stage(problem, s) for s in case["alpa"]["stages"]])
        )
    ratios = np.array(exact_costs)
    assert (ratios <= 1 + 1e-12).all()  # the exact DP is never worse than Alpa
    assert (ratios < 1 - 1e-3).sum() >= 3  # and Alpa's gap skip costs it somewhere


def _stage(problem, stage):
    from pipedejavu import Stage

    start, stop, submesh, config = stage
    return Stage(
        start,
        stop,
        tuple(problem.submesh_shapes[submesh]),
        submesh,
        config,
        problem.stage_cost(start, stop, submesh, config),
    )


def test_gap_skip_returns_alpas_worse_plan():
    # Caps 1.0 (no plan), 1.0000005 (skipped: < 1e-6 above 1.0), 1.9 (one stage).
    problem = two_layer_problem(
        {(0, 0, 0): 1.0, (1, 1, 0): 1.0000005, (0, 1, 1): 1.9}, 8
    )
    alpa = alpa_training_dp(problem)
    assert [(s.start, s.stop) for s in alpa.stages] == [(0, 2)]
    assert alpa.cost == pytest.approx(15.2, rel=1e-12)
    assert alpa.info["num_skipped_gap"] == 1
    assert alpa.info["num_evaluated"] == 2
    assert exact_dp(problem).cost == pytest.approx(9.000004, rel=1e-12)


def test_all_costs_below_the_gap():
    problem = two_layer_problem({(0, 0, 0): 1e-7, (1, 1, 0): 2e-7, (0, 1, 1): 5e-7}, 8)
    with pytest.raises(InfeasibleProblemError, match="below its 1e-06 candidate gap"):
        alpa_training_dp(problem)
    plan = exact_dp(problem)
    assert plan.cost == pytest.approx(2e-7 + 1e-7 + 7 * 2e-7, rel=1e-12)


def test_float32_sums_decide_alpas_plan():
    # Derived by hand from Alpa's algorithm, B = 1. Cap 0.1: no plan. Cap 0.2:
    # two 1-device stages, 0.1 + 0.2 = 0.30000000000000004, stored as float32
    # 0.3 -> Alpa's cost float32(0.3). Cap 0.3: the one-stage plan (0.3) also
    # rounds to float32(0.3), is not strictly cheaper, so Alpa keeps two stages.
    # In float64 the one-stage plan is cheaper, which the exact DP returns.
    problem = two_layer_problem({(0, 0, 0): 0.1, (1, 1, 0): 0.2, (0, 1, 1): 0.3}, 1)
    alpa = alpa_training_dp(problem)
    assert [(s.start, s.stop) for s in alpa.stages] == [(0, 1), (1, 2)]
    assert alpa.info["alpa_cost"] == float(np.float32(0.3))
    assert alpa.cost == 0.1 + 0.2
    exact = exact_dp(problem)
    assert [(s.start, s.stop) for s in exact.stages] == [(0, 2)]
    assert exact.cost == 0.3


@pytest.mark.parametrize("seed", range(3))
def test_alpa_mode_is_near_exact_away_from_the_gap(seed):
    """Costs around 1 s: Alpa's scan is exact up to its float32 sums."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        solved = solved_alike(exact_dp, alpa_training_dp, tiny_problem(rng))
        if solved is None:
            continue
        exact, alpa = solved
        assert alpa.cost >= exact.cost * (1 - 1e-12)
        np.testing.assert_allclose(alpa.cost, exact.cost, rtol=1e-6)


def test_progress_and_time_limit_of_the_scan():
    from pipedejavu import solve
    from pipedejavu.baselines.alpa_dp import ScanTimeout
    from pipedejavu.costmodel.stage.generate import random_problem

    problem = random_problem(10, (1, 4), num_microbatches=8, seed=2)
    calls = []
    plan = solve(
        problem,
        "dp",
        alpa_compatible=True,
        progress_fn=lambda *args: calls.append(args),
    )
    assert len(calls) == plan.info["num_evaluated"]
    assert [c[2] for c in calls] == list(range(1, len(calls) + 1))
    assert all(c[1] == plan.info["num_candidates"] for c in calls)
    with pytest.raises(ScanTimeout, match="caps evaluated"):
        alpa_training_dp(problem, time_limit_s=0.0)
