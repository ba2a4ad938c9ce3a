"""The bundled real Alpa profiles: the plans and costs Alpa's training_dp gives.

Expected values are derived by hand from Alpa's algorithm and the raw records
(see each test). Alpa's own memory estimate marks most entries infeasible, which
leaves few plans; the tests spell out which.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pipedejavu import InfeasibleProblemError, evaluate
from pipedejavu.baselines import exact_dp
from pipedejavu.baselines.alpa_dp import alpa_training_dp
from pipedejavu.costmodel import read_stage_profile
from pipedejavu.planning.inputs import bundled_examples

EXAMPLES = {example.name: example for example in bundled_examples()}


def _load(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # incomplete records: tested in test_readers
        return EXAMPLES[name].load()


def _record_cost(name, key):
    """forward + backward compute_cost of one raw profile record."""
    record = read_stage_profile(EXAMPLES[name].path)[key]
    return sum(module.compute_cost for module in record.module_profile_results)


def _alpa_float32_cost(latency, num_microbatches):
    # Alpa stores f and f_stage_max as float32 and adds them in float64.
    rounded = float(np.float32(latency))
    return rounded + (num_microbatches - 1) * rounded


@pytest.mark.parametrize("solver", [exact_dp, alpa_training_dp])
def test_6_layers_b128_single_stage_config_3(solver):
    # Only (0..5) on the 1x4 submesh covers all 6 layers with all 4 devices (no
    # profiled record starts at layers 3..5). Its configs: 0 is cheapest
    # (0.2396 s) but Alpa's memory estimate gives max_n_succ_stages = -1;
    # 3 (0.2437 s, limit 0) beats 2 (0.4094 s) and 1 (0.4490 s).
    problem = _load("gpt1.3b-6layers-B128")
    assert problem.max_n_succ_stages[0, 5, 2].tolist() == [-1, 3, 7, 0]
    plan = solver(problem)
    assert [(s.start, s.stop, s.submesh, s.config_index) for s in plan.stages] == [
        (0, 6, (1, 4), 3)
    ]
    latency = _record_cost("gpt1.3b-6layers-B128", (0, 5, 2, 3))
    assert plan.cost == pytest.approx(128 * latency, rel=1e-12)
    assert plan.cost == evaluate(problem, plan)
    if solver is alpa_training_dp:
        assert plan.info["alpa_cost"] == _alpa_float32_cost(latency, 128)
        # caps 0.2396 (memory-infeasible) and 0.2437, then 0.3077 * 128 >= best
        assert plan.info["num_evaluated"] == 2


@pytest.mark.parametrize("solver", [exact_dp, alpa_training_dp])
def test_12_layers_b32_single_stage_config_1(solver):
    # Only (0..11) on 1x4 covers all 12 layers with 4 devices: config 3
    # (0.8644 s) is memory-infeasible, config 1 (1.7147 s) fits with limit 0.
    problem = _load("gpt1.3b-12layers-B32")
    plan = solver(problem)
    assert [(s.start, s.stop, s.submesh, s.config_index) for s in plan.stages] == [
        (0, 12, (1, 4), 1)
    ]
    latency = _record_cost("gpt1.3b-12layers-B32", (0, 11, 2, 1))
    assert plan.cost == pytest.approx(32 * latency, rel=1e-12)
    if solver is alpa_training_dp:
        assert plan.info["alpa_cost"] == _alpa_float32_cost(latency, 32)
        # Alpa evaluates the caps 0.5987, 0.7227, 0.8516, 0.8644 (no plan) and
        # 1.7147; the scan then ends (no larger cap).
        assert plan.info["num_evaluated"] == 5


@pytest.mark.parametrize("solver", [exact_dp, alpa_training_dp])
def test_6_layers_b32_has_no_feasible_plan(solver):
    # All 17 complete records have max_n_succ_stages = -1 (Alpa's estimate puts
    # every profiled stage over memory): Alpa's DP finds no solution.
    problem = _load("gpt1.3b-6layers-B32")
    finite = np.isfinite(problem.compute_cost)
    assert finite.sum() == 17
    assert (problem.max_n_succ_stages[finite] == -1).all()
    with pytest.raises(InfeasibleProblemError, match="memory"):
        solver(problem)
