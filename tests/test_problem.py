"""The vocabulary: validation, the plan rules, the objective, submesh choices."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tiny_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu import (
    InfeasibleProblemError,
    Plan,
    PlanError,
    Problem,
    ProblemError,
    Stage,
    evaluate,
    get_submesh_choices,
    make_plan,
)
from pipedejavu.baselines import exact_dp


def _problem(num_microbatches=4, memory=None):
    # L = 3 layers, cluster 1x4, submeshes (1,1), (1,2), (1,4), K = 2.
    rng = np.random.default_rng(0)
    cost = rng.uniform(1, 2, size=(3, 3, 3, 2))
    cost[np.tril_indices(3, -1)] = np.inf
    cost[2, 2, 0, 1] = np.inf
    return Problem(
        cost, memory, np.array([[1, 1], [1, 2], [1, 4]]), (1, 4), num_microbatches
    )


def test_stage_ranges_are_half_open_and_arrays_inclusive():
    problem = _problem()
    plan = make_plan(problem, [(0, 2, 1, 0), (2, 3, 1, 1)], method="manual")
    assert plan.stages[0].latency == problem.compute_cost[0, 1, 1, 0]  # layers 0, 1
    assert plan.stages[1].latency == problem.compute_cost[2, 2, 1, 1]  # layer 2


def test_objective_is_sum_plus_b_minus_1_times_max():
    problem = _problem(num_microbatches=5)
    plan = make_plan(
        problem, [(0, 1, 0, 0), (1, 2, 0, 1), (2, 3, 1, 0)], method="manual"
    )
    t = [
        problem.compute_cost[0, 0, 0, 0],
        problem.compute_cost[1, 1, 0, 1],
        problem.compute_cost[2, 2, 1, 0],
    ]
    assert plan.cost == pytest.approx(sum(t) + 4 * max(t), rel=1e-15)
    assert evaluate(problem, plan) == plan.cost


def _stage(problem, start, stop, submesh, config, shape=None):
    return Stage(
        start,
        stop,
        shape or tuple(problem.submesh_shapes[submesh]),
        submesh,
        config,
        0.0,
    )


@pytest.mark.parametrize(
    ("stages", "rule", "stage"),
    [
        ([], "coverage", None),
        ([(1, 3, 2, 0)], "contiguity", 0),
        ([(0, 1, 1, 0), (2, 3, 1, 0)], "contiguity", 1),
        ([(0, 0, 2, 0), (0, 3, 2, 0)], "contiguity", 0),
        ([(0, 4, 2, 0)], "coverage", 0),
        ([(0, 2, 2, 0)], "coverage", None),
        ([(0, 3, 3, 0)], "submesh", 0),
        ([(0, 3, 2, 2)], "config", 0),
        ([(0, 1, 1, 0), (1, 2, 0, 0), (2, 3, 0, 1)], "profiled", 2),
        ([(0, 1, 1, 0), (1, 3, 0, 0)], "devices", None),
    ],
)
def test_each_broken_rule_is_named_with_its_stage(stages, rule, stage):
    problem = _problem()
    built = [
        _stage(problem, *s) if s[2] < 3 else Stage(s[0], s[1], (1, 8), 3, s[3], 0.0)
        for s in stages
    ]
    with pytest.raises(PlanError) as error:
        evaluate(problem, built)
    assert error.value.rule == rule
    assert error.value.stage == stage
    assert rule in str(error.value)


def test_submesh_shape_must_match_its_index():
    problem = _problem()
    with pytest.raises(PlanError, match="submesh"):
        evaluate(problem, [_stage(problem, 0, 3, 2, 0, shape=(2, 2))])


def test_memory_rule_names_the_stage():
    memory = np.full((3, 3, 3, 2), 2**20)
    memory[0, 0, 1, 0] = 1  # at most one stage after it
    problem = _problem(memory=memory)
    plan = [(0, 1, 1, 0), (1, 2, 0, 0), (2, 3, 0, 0)]
    with pytest.raises(PlanError) as error:
        make_plan(problem, plan, method="manual")
    assert error.value.rule == "memory" and error.value.stage == 0
    assert "2 stages follow it but memory allows at most 1" in str(error.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compute_cost": np.ones((3, 3, 3))}, "shape (L, L, M, K)"),
        ({"compute_cost": np.ones((3, 2, 3, 2))}, "shape (L, L, M, K)"),
        ({"compute_cost": np.full((3, 3, 3, 2), np.nan)}, "NaN"),
        ({"compute_cost": -np.ones((3, 3, 3, 2))}, ">= 0"),
        ({"max_n_succ_stages": np.zeros((2, 2, 3, 2))}, "max_n_succ_stages"),
        ({"max_n_succ_stages": np.full((3, 3, 3, 2), 0.5)}, "integers"),
        ({"submesh_shapes": np.array([[1, 1], [1, 2]])}, "submesh_shapes"),
        ({"submesh_shapes": np.array([[1, 1], [1, 2], [1, 8]])}, "does not fit"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"num_microbatches": 2.5}, "num_microbatches must be an integer"),
        ({"cluster_shape": (0, 4)}, "cluster_shape must be positive"),
        (
            {
                "submesh_shapes": np.array([[1, 2], [1, 2], [1, 2]]),
                "cluster_shape": (1, 3),
            },
            "no combination",
        ),
    ],
)
def test_validation_names_the_argument(changes, message):
    with pytest.raises(
        ProblemError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        _problem().replace(**changes)


def test_entries_below_the_diagonal_are_ignored():
    problem = _problem()
    cost = np.array(problem.compute_cost)
    cost[2, 0] = 0.0  # "stage 2..0" does not exist
    assert np.isinf(problem.replace(compute_cost=cost).compute_cost[2, 0]).all()


def test_problem_arrays_are_read_only():
    problem = _problem()
    with pytest.raises(ValueError):
        problem.compute_cost[0, 0, 0, 0] = 1.0


def test_plan_json_round_trip():
    problem = _problem()
    plan = make_plan(
        problem, [(0, 2, 1, 0), (2, 3, 1, 1)], method="manual", search_time_s=0.25
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    with pytest.raises(ProblemError):
        Plan.from_json({"stages": [{}]})


@pytest.mark.parametrize(
    ("cluster", "space", "expected"),
    [
        ((1, 4), "small_power_of_two", [(1, 1), (1, 2), (1, 4)]),
        ((4, 8), "all", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)]),
        (
            (8, 8),
            "power_of_two",
            [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)],
        ),
        (
            (8, 8),
            "small_power_of_two",
            [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8)],
        ),
        ((3, 2), "power_of_two", [(1, 1), (1, 2), (2, 2)]),
        ((1, 1), "all", [(1, 1)]),
    ],
)
def test_submesh_choices_follow_alpa(cluster, space, expected):
    assert list(get_submesh_choices(*cluster, space)) == expected


def test_submesh_choice_errors():
    with pytest.raises(ProblemError, match="power-of-two"):
        get_submesh_choices(2, 6, "all")
    with pytest.raises(ProblemError, match="submesh space"):
        get_submesh_choices(2, 8, "odd")
    assert get_submesh_choices(2, 8, "manual", [(1, 4), (2, 8)]) == ((1, 4), (2, 8))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    memory=st.sampled_from([0.0, 0.3, 0.9]),
    missing=st.sampled_from([0.0, 0.2, 0.5]),
)
def test_dp_plans_obey_every_rule(seed, memory, missing):
    problem = tiny_problem(
        np.random.default_rng(seed), p_memory=memory, p_missing=missing
    )
    try:
        plan = exact_dp(problem)
    except InfeasibleProblemError:
        return
    assert plan.stages[0].start == 0 and plan.stages[-1].stop == problem.num_layers
    assert all(
        a.stop == b.start
        for a, b in zip(plan.stages[:-1], plan.stages[1:], strict=True)
    )
    assert sum(s.num_devices for s in plan.stages) == problem.num_devices
    assert plan.cost == evaluate(problem, plan)
    assert math.isfinite(plan.cost)


# --- shared validation and files (issue 10) -----------------------------------
def _small() -> Problem:
    from pipedejavu.costmodel.stage.generate import random_problem

    return random_problem(5, (1, 4), num_microbatches=4, seed=0)


def _reachable_by_loop(sizes, total):
    reachable = [True] + [False] * total
    for value in range(1, total + 1):
        reachable[value] = any(s <= value and reachable[value - s] for s in sizes)
    return reachable[total]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5, unique=True),
    total=st.integers(1, 200),
)
def test_vectorized_device_reachability_equals_the_plain_loop(sizes, total):
    from pipedejavu.core.problem import _reachable

    assert _reachable(sorted(sizes), total) == _reachable_by_loop(sizes, total)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (10**20, "num_microbatches must be <= 2147483647"),
        (True, "must be an integer"),
        ("4", "must be an integer"),
        (2.5, "must be an integer"),
        (np.array([4]), "must be an integer"),
    ],
)
def test_num_microbatches_range_and_type(value, message):
    problem = _small()
    with pytest.raises(ProblemError, match=message):
        problem.replace(num_microbatches=value)
    assert problem.replace(num_microbatches=np.float64(8.0)).num_microbatches == 8


def test_a_cluster_too_large_to_be_real_is_refused_before_any_work():
    problem = _small()
    with pytest.raises(ProblemError, match="more than 1048576 devices"):
        problem.replace(cluster_shape=(2**20, 8))


def test_problem_and_hetero_problem_validate_alike():
    from pipedejavu import Cluster, HeteroProblem

    problem = _small()
    cluster = Cluster.homogeneous(*problem.cluster_shape)
    hetero = HeteroProblem.from_problem(problem, cluster)
    bad = problem.compute_cost[..., None].copy()
    bad[0, 0, 0, 0, 0] = np.nan
    for make, cost in (
        (lambda c: problem.replace(compute_cost=c), bad[..., 0]),
        (lambda c: hetero.replace(compute_cost=c), bad),
    ):
        with pytest.raises(ProblemError, match=r"1 NaN entries \(first at \(0, 0"):
            make(cost)
    with pytest.raises(ProblemError, match="num_microbatches must be an integer"):
        hetero.replace(num_microbatches=1.5)  # was silently truncated to 1
    with pytest.raises(ProblemError, match="submesh_shapes must be integer"):
        hetero.replace(submesh_shapes=problem.submesh_shapes.astype(float) + 0.5)


def test_homogeneous_reader_names_a_heterogeneous_file(tmp_path):
    from pipedejavu import Cluster, HeteroProblem

    problem = _small()
    hetero = HeteroProblem.from_problem(
        problem, Cluster.homogeneous(*problem.cluster_shape)
    )
    path = hetero.to_npz(tmp_path / "het")
    assert path.name == "het.npz"
    with pytest.raises(ProblemError, match="het.npz is a heterogeneous problem"):
        Problem.from_npz(path)


def test_plan_json_keeps_the_certificate():
    problem = _small()
    plan = exact_dp(problem)
    assert "lower_bound" not in plan.to_json()
    certified = Plan(
        plan.stages,
        plan.cost,
        plan.num_microbatches,
        "diff",
        info={"lower_bound": plan.cost * 0.9, "gap": 1 / 0.9 - 1, "trace": []},
    )
    data = certified.to_json()
    assert data["lower_bound"] == pytest.approx(plan.cost * 0.9)
    assert "trace" not in data
    assert Plan.from_json(data).stages == plan.stages


def test_brute_force_counts_its_visits_before_enumerating():
    import sys

    import pipedejavu.baselines  # noqa: F401  (the module, not the function)
    from pipedejavu.costmodel.stage.generate import random_problem

    module = sys.modules["pipedejavu.baselines.brute"]
    for seed in range(4):
        problem = random_problem(
            4 + seed % 3, (2, 2), num_microbatches=4, missing=0.3, seed=seed
        )
        visits = module.count_partial_plans(problem)
        module.brute_force(problem, max_plans=int(visits))  # exactly enough
        with pytest.raises(ProblemError, match="too large for brute force"):
            module.brute_force(problem, max_plans=int(visits) - 1)
    big = random_problem(24, (2, 8), seed=1)
    assert module.count_partial_plans(big, limit=5e6) > 5e6
    with pytest.raises(ProblemError, match=r"would visit .* partial plans"):
        module.brute_force(big)  # refused up front, not after minutes
