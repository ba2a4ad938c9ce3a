"""The certified lower bound: never above the exact optimum, and tight."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tiny_problem, two_layer_problem

from pipedejavu import InfeasibleProblemError, Problem
from pipedejavu.baselines import exact_dp
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine.bounds import bound_details, lower_bound


def _optimum(problem: Problem) -> float | None:
    try:
        return exact_dp(problem).cost
    except InfeasibleProblemError:
        return None


@pytest.mark.parametrize("seed", range(4))
def test_never_above_the_optimum_on_random_tiny_instances(seed):
    rng = np.random.default_rng(2000 + seed)
    solved = exact = 0
    for index in range(100):
        memory = 0.9 if index % 3 == 0 else 0.3
        problem = tiny_problem(rng, max_layers=7, p_memory=memory)
        bound = lower_bound(problem)
        optimum = _optimum(problem)
        if optimum is None:
            assert isinstance(bound, float)  # any value, inf included: no crash
            continue
        solved += 1
        assert 0 < bound <= optimum * (1 + 1e-12)
        exact += bound >= optimum * (1 - 1e-9)
    assert solved >= 50  # the test has teeth
    assert exact >= 0.6 * solved  # and the bound is usually the optimum itself


@pytest.mark.parametrize("memory", [None, 1.5, 3.0])
@pytest.mark.parametrize(
    ("num_layers", "cluster"),
    [(8, (1, 4)), (16, (1, 8)), (24, (2, 8)), (40, (4, 4)), (64, (4, 8))],
)
def test_tight_on_generated_instances(num_layers, cluster, memory):
    problem = random_problem(
        num_layers,
        cluster,
        num_microbatches=16,
        memory_tightness=memory,
        missing=0.1,
        seed=num_layers,
    )
    optimum = _optimum(problem)
    details = bound_details(problem)
    assert optimum is not None
    assert details.bound <= optimum * (1 + 1e-12)
    assert optimum / details.bound < 1.001  # measured: 1 + 5e-13 at most
    assert 0 < details.bottleneck <= details.bound
    assert 0 < details.device_free <= details.bound
    assert details.min_cap <= optimum / problem.num_microbatches


def test_parts_are_weaker_but_valid():
    problem = random_problem(32, (2, 8), num_microbatches=32, seed=3)
    details = bound_details(problem)
    optimum = exact_dp(problem).cost
    assert details.bottleneck < details.device_free < details.bound <= optimum
    assert details.num_buckets == 1  # memory unlimited: nothing to track
    assert details.bound > 0.999 * optimum


def test_memory_buckets_tighten_the_bound():
    problem = random_problem(
        64, (4, 8), num_microbatches=32, memory_tightness=2.0, seed=68
    )
    optimum = exact_dp(problem).cost
    loose = bound_details(problem, max_buckets=1)
    tight = bound_details(problem, max_buckets=8)
    assert loose.bound < tight.bound <= optimum * (1 + 1e-12)
    assert optimum / loose.bound > 1.02 and optimum / tight.bound < 1.0001


def test_near_tie_and_unit_invariance():
    # Alpa's 1e-6 gap misses this optimum (9.000004 s); the bound finds it.
    costs = {(0, 0, 0): 1.0, (1, 1, 0): 1.0000005, (0, 1, 1): 1.9}
    problem = two_layer_problem(costs, 8)
    np.testing.assert_allclose(lower_bound(problem), 9.000004, rtol=1e-9)
    micro = two_layer_problem({key: 1e-6 * value for key, value in costs.items()}, 8)
    np.testing.assert_allclose(lower_bound(micro), 9.000004e-6, rtol=1e-9)


def test_infeasible_problems_get_an_infinite_bound():
    nothing = two_layer_problem({}, 4)
    assert lower_bound(nothing) == math.inf
    # Layer 1 is never covered.
    uncovered = two_layer_problem({(0, 0, 0): 1.0, (0, 0, 1): 1.0}, 4)
    assert lower_bound(uncovered) == math.inf
    # Every chain uses 1 or 4 devices, never both of the 2.
    shapes = np.array([[1, 1], [1, 2]])
    table = np.full((2, 2, 2, 1), np.inf)
    table[0, 0, 1, 0] = table[1, 1, 1, 0] = 1.0
    table[0, 1, 0, 0] = 3.0
    devices = Problem(table, None, shapes, (1, 2), 4)
    assert _optimum(devices) is None and lower_bound(devices) == math.inf
    # Memory: the first of two stages needs a follower it cannot afford.
    memory = np.zeros((2, 2, 2, 1), dtype=np.int64)
    table = np.full((2, 2, 2, 1), np.inf)
    table[0, 0, 0, 0] = table[1, 1, 0, 0] = 1.0
    tight = Problem(table, memory, shapes, (1, 2), 4)
    assert _optimum(tight) is None and lower_bound(tight) == math.inf


def test_single_layer_and_single_microbatch():
    table = np.array([[[[2.0], [1.5]]]])  # L = 1, submeshes (1, 1) and (1, 2)
    problem = Problem(table, None, np.array([[1, 1], [1, 2]]), (1, 2), 1)
    np.testing.assert_allclose(lower_bound(problem), 1.5, rtol=1e-12)
    assert lower_bound(problem) <= 1.5


def test_memory_can_force_a_slower_config():
    # Three one-device stages on three devices: layer 0 has two stages after it,
    # which only its slower config (1.5 s, memory for 5 followers) allows. With
    # layers 1..2 in one stage its fast config would do, but that uses 2 devices.
    table = np.full((3, 3, 1, 2), np.inf)
    table[0, 0, 0] = [1.0, 1.5]
    table[1, 1, 0, 0] = table[2, 2, 0, 0] = table[1, 2, 0, 0] = 1.0
    memory = np.full(table.shape, 5, dtype=np.int64)
    memory[0, 0, 0, 0] = 1
    problem = Problem(table, memory, np.array([[1, 1]]), (1, 3), 4)
    optimum = exact_dp(problem).cost
    assert optimum == 3.5 + 3 * 1.5
    np.testing.assert_allclose(lower_bound(problem), optimum, rtol=1e-12)
    assert lower_bound(problem) <= optimum


def test_progress_lines_report_valid_bounds(monkeypatch):
    """With every progress call let through, each line's "bound so far" never
    exceeds the final bound, which the lines do not change."""
    import re

    import pipedejavu.search.engine.bounds as bounds

    problem = random_problem(24, (2, 8), num_microbatches=16, seed=3)
    quiet = lower_bound(problem)
    monkeypatch.setattr(bounds, "_REPORT_EVERY_S", 0.0)
    lines: list[str] = []
    assert lower_bound(problem, progress_fn=lines.append) == quiet
    assert lines and all(line.startswith("lower bound: ") for line in lines)
    so_far = [float(re.search(r"bound so far (\S+) s", line)[1]) for line in lines]
    assert all(0 < value <= quiet * (1 + 1e-6) for value in so_far)
    assert so_far == sorted(so_far)
