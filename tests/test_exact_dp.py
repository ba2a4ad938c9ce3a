"""The exact DP against the brute-force oracle and hand-built cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tiny_problem, two_layer_problem

from pipedejavu import InfeasibleProblemError, evaluate
from pipedejavu.baselines import brute_force, exact_dp, min_sum_plan
from pipedejavu.costmodel.stage.generate import random_problem


def _solve_or_none(solver, problem):
    try:
        return solver(problem)
    except InfeasibleProblemError:
        return None


@pytest.mark.parametrize("method", ["labels", "caps"])
@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force_on_random_tiny_instances(seed, method):
    rng = np.random.default_rng(1000 + seed)
    solved = 0
    for _ in range(100):
        problem = tiny_problem(rng)
        oracle = _solve_or_none(brute_force, problem)
        plan = _solve_or_none(lambda p: exact_dp(p, method=method), problem)
        assert (oracle is None) == (plan is None)
        if plan is None:
            continue
        solved += 1
        np.testing.assert_allclose(plan.cost, oracle.cost, rtol=1e-9)
        assert plan.cost == evaluate(problem, plan)
    assert solved >= 60  # most random instances have a plan: the test has teeth


@pytest.mark.parametrize("method", ["labels", "caps"])
def test_dp_handles_tight_memory_like_brute_force(method):
    rng = np.random.default_rng(7)
    compared = 0
    for _ in range(150):
        problem = tiny_problem(rng, p_memory=0.9, p_missing=0.05)
        oracle = _solve_or_none(brute_force, problem)
        plan = _solve_or_none(lambda p: exact_dp(p, method=method), problem)
        assert (oracle is None) == (plan is None)
        if plan is not None:
            compared += 1
            np.testing.assert_allclose(plan.cost, oracle.cost, rtol=1e-9)
    assert compared >= 50


def test_near_tie_that_alpa_skips_is_found():
    # Two 1-device stages (1.0 and 1.0000005 s) or one 2-device stage (1.9 s).
    # B = 8: 2.0000005 + 7 * 1.0000005 = 9.000004 beats 8 * 1.9 = 15.2.
    problem = two_layer_problem(
        {(0, 0, 0): 1.0, (1, 1, 0): 1.0000005, (0, 1, 1): 1.9}, 8
    )
    plan = exact_dp(problem)
    np.testing.assert_allclose(plan.cost, 9.000004, rtol=1e-12)
    assert [(s.start, s.stop, s.submesh) for s in plan.stages] == [
        (0, 1, (1, 1)),
        (1, 2, (1, 1)),
    ]


@pytest.mark.parametrize("scale", [1e-12, 1e-7, 1.0, 1e3, 1e9])
def test_dp_is_unit_free(scale):
    rng = np.random.default_rng(3)
    for _ in range(20):
        problem = tiny_problem(rng)
        base = _solve_or_none(exact_dp, problem)
        scaled = _solve_or_none(
            exact_dp, problem.replace(compute_cost=problem.compute_cost * scale)
        )
        assert (base is None) == (scaled is None)
        if base is not None:
            np.testing.assert_allclose(scaled.cost, base.cost * scale, rtol=1e-9)


def test_fewest_stages_among_equal_sums():
    # Two 1.0 s stages or one 2.0 s stage: equal sums; the DP takes one stage.
    problem = two_layer_problem({(0, 0, 0): 1.0, (1, 1, 0): 1.0, (0, 1, 1): 2.0}, 1)
    total, stages = min_sum_plan(problem)
    assert total == 2.0
    assert stages == [(0, 2, 1, 0)]


def test_memory_limit_changes_the_plan():
    free = two_layer_problem({(0, 0, 0): 1.0, (1, 1, 0): 1.0, (0, 1, 1): 3.0}, 4)
    assert exact_dp(free).num_stages == 2
    memory = np.full((2, 2, 2, 1), 2**20)
    memory[0, 0, 0, 0] = 0  # the first stage may not have a stage after it
    tight = free.replace(max_n_succ_stages=memory)
    plan = exact_dp(tight)
    assert plan.num_stages == 1
    assert plan.cost == pytest.approx(12.0)


@pytest.mark.parametrize(
    ("costs", "memory_limit", "reason"),
    [
        ({(0, 1, 0): 1.0}, None, "exactly the 2 devices"),
        ({(0, 0, 0): 1.0}, None, "covers all 2 layers"),
        ({(0, 0, 0): 1.0, (1, 1, 0): 1.0}, 0, "memory"),
        ({}, None, "no stage has a profiled"),
    ],
)
def test_infeasible_problems_say_why(costs, memory_limit, reason):
    problem = two_layer_problem(costs, 4)
    if memory_limit is not None:
        problem = problem.replace(max_n_succ_stages=np.full((2, 2, 2, 1), memory_limit))
    with pytest.raises(InfeasibleProblemError, match=reason):
        exact_dp(problem)


@pytest.mark.parametrize("tightness", [None, 2.0])
@pytest.mark.parametrize(("layers", "cluster"), [(8, (1, 4)), (12, (2, 4))])
def test_dp_on_generated_instances_matches_exhaustive_caps(layers, cluster, tightness):
    # A second exact reference for sizes brute force cannot reach: the min-sum
    # DP under every distinct cap, as Alpa's scan would do without its gap.
    problem = random_problem(
        layers, cluster, num_microbatches=16, memory_tightness=tightness, seed=5
    )
    plan = exact_dp(problem, method="caps")
    assert exact_dp(problem).stages == plan.stages
    table = problem.compute_cost
    best = math.inf
    for cap in np.unique(table[np.isfinite(table)]):
        total, stages = min_sum_plan(problem, cap)
        if stages is not None:
            latencies = [table[a, b - 1, m, k] for a, b, m, k in stages]
            best = min(best, sum(latencies) + 15 * max(latencies))
    np.testing.assert_allclose(plan.cost, best, rtol=1e-12)
    assert plan.info["num_evaluated"] < plan.info["num_candidates"]


# --- The label-setting DP (the default) against the cap scan -----------------


def _plan_or_none(problem, method):
    try:
        return exact_dp(problem, method=method)
    except InfeasibleProblemError:
        return None


def _caps_and_labels(rng, count, p_memory):
    """``(index, caps, labels)`` of ``count`` tiny problems: the plans of the
    cap scan and of the label DP (``None`` both, checked, where none fits).
    Every second problem has its costs rounded to 0.5 s, so that equal costs
    (and the tie-breaking: fewest stages, then Alpa's loop order) are
    common."""
    for index in range(count):
        problem = tiny_problem(rng, p_memory=p_memory)
        if index % 2:
            problem = problem.replace(
                compute_cost=np.round(problem.compute_cost * 2) / 2
            )
        caps = _plan_or_none(problem, "caps")
        labels = _plan_or_none(problem, "labels")
        assert (caps is None) == (labels is None)
        yield index, caps, labels


@pytest.mark.parametrize("seed", range(2))
def test_labels_and_caps_return_the_same_plan(seed, monkeypatch):
    from pipedejavu.search.alpa import labels as _labels

    if seed:  # follower levels in the prefix tables from the first pass on
        monkeypatch.setattr(_labels, "MANY_LABELS", 0)
    # Half the instances have costs rounded to 0.5 s: ties are common.
    rng = np.random.default_rng(2000 + seed)
    compared = ties = 0
    for index, caps, labels in _caps_and_labels(rng, 150, p_memory=0.5):
        if caps is None:
            continue
        compared += 1
        ties += index % 2
        assert labels.cost == caps.cost
        assert labels.stages == caps.stages
        assert labels.info["method"] == "labels"
    assert compared >= 90 and ties >= 40


def _memory_tight(num_layers, cluster, seed, never_fit=0.6):
    """Parameters sharded over a config-dependent share of the devices,
    small activations, a capacity that ``never_fit`` of the entries exceed:
    memory binds (the model of ``memory_tight_problem`` in
    benchmarks/dp_scaling.py, at test sizes)."""
    base = random_problem(num_layers, cluster, num_microbatches=32, seed=seed)
    rng = np.random.default_rng(seed + 1)
    params = np.where(np.arange(num_layers) == 0, 3.0, 1.0) * rng.uniform(
        0.8, 1.2, num_layers
    )
    acts = 0.06 * rng.uniform(0.8, 1.2, num_layers)
    starts, ends = np.triu_indices(num_layers)
    param_prefix, act_prefix = np.cumsum(np.r_[0, params]), np.cumsum(np.r_[0, acts])
    span_params = param_prefix[ends + 1] - param_prefix[starts]
    span_acts = act_prefix[ends + 1] - act_prefix[starts]
    sizes = base.submesh_sizes.astype(float)
    shard = sizes[:, None] ** np.array([1.0, 0.5])[None, :]  # [M, K]
    stage_params = span_params[:, None, None] / shard[None]
    stage_acts = span_acts[:, None, None] / sizes[None, :, None]
    need = stage_params + stage_acts
    capacity = np.quantile(need, 1 - never_fit)
    limit = np.floor((capacity - stage_params) / stage_acts) - 1
    limit = np.where(need > capacity, -1, np.minimum(limit, 2**20)).astype(np.int64)
    memory = np.full(base.compute_cost.shape, -1, dtype=np.int64)
    memory[starts, ends] = limit
    return base.replace(max_n_succ_stages=memory)


@pytest.mark.parametrize("levels_at_once", [False, True])
@pytest.mark.parametrize(("layers", "seed"), [(24, 0), (24, 1), (32, 0), (32, 2)])
def test_labels_match_caps_when_memory_binds(layers, seed, levels_at_once, monkeypatch):
    from pipedejavu.search.alpa import label_tables
    from pipedejavu.search.alpa import labels as _labels

    if levels_at_once:  # prefix tables with follower levels from the first pass
        monkeypatch.setattr(_labels, "MANY_LABELS", 0)
        monkeypatch.setattr(label_tables, "MAX_LEVELS", 3)
    problem = _memory_tight(layers, (2, 8), seed)
    caps = exact_dp(problem, method="caps")
    labels = exact_dp(problem)
    assert labels.stages == caps.stages
    assert labels.cost == caps.cost
    # Memory binds: the optimum of the problem without limits is cheaper.
    free = exact_dp(problem.replace(max_n_succ_stages=None))
    assert free.cost < labels.cost


def test_label_dp_with_an_incumbent():
    from pipedejavu.search.alpa.labels import label_dp

    problem = random_problem(12, (2, 4), num_microbatches=16, seed=9)
    optimum = exact_dp(problem)
    above = label_dp(problem, incumbent=optimum.cost * 1.01)
    assert above.cost == optimum.cost
    assert label_dp(problem, incumbent=optimum.cost).stages is None  # not cheaper
    assert label_dp(problem, incumbent=optimum.cost * 0.99).stages is None


@pytest.mark.parametrize("method", ["labels", "caps"])
def test_progress_lines(method, monkeypatch):
    from pipedejavu.search.alpa import caps

    monkeypatch.setattr(caps, "REPORT_EVERY_S", 0.0)
    lines = []
    problem = _memory_tight(24, (2, 8), 0)
    exact_dp(problem, method=method, progress_fn=lines.append)
    assert lines and all(line.startswith(f"exact DP ({method})") for line in lines)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        exact_dp(random_problem(4, (1, 2), seed=0), method="scan")


def test_follower_levels_prove_infeasibility(monkeypatch):
    # Instance 38 of this stream has plans under the one-level relaxation but
    # none under the exact memory rule (it once made the cap loop spin).
    from pipedejavu.search.alpa import labels as _labels

    monkeypatch.setattr(_labels, "MANY_LABELS", 0)
    rng = np.random.default_rng(11)
    infeasible = 0
    for _, caps, labels in _caps_and_labels(rng, 40, p_memory=0.7):
        infeasible += caps is None
        if caps is not None:
            assert labels.stages == caps.stages
    assert infeasible >= 5


@pytest.mark.parametrize("memory", ["unlimited", "random"])
@pytest.mark.parametrize("seed", range(3))
def test_plain_prefix_tables_match_the_level_tables(memory, seed):
    """The one-level fast path of the label DP's prefix tables gives exactly
    the general (multi-level) code's tables at one level, with all groups and
    with those below a theta."""
    from pipedejavu.search.alpa import label_tables

    rng = np.random.default_rng(3000 + seed)
    for index in range(20):
        if index % 4 == 0:
            problem = random_problem(
                int(rng.integers(8, 24)),
                (2, 4),
                missing=0.3,
                seed=int(rng.integers(1e6)),
            )
        else:
            problem = tiny_problem(rng, p_memory=0.5)
        if memory == "unlimited":
            problem = problem.replace(max_n_succ_stages=None)
        groups = label_tables.stage_groups(problem)
        finite = groups.cost[np.isfinite(groups.cost)]
        thetas = [math.inf] + ([float(np.median(finite))] if finite.size else [])
        for theta in thetas:
            subset = groups.below(theta, problem.num_layers)
            plain = label_tables.plain_prefix_tables(problem, subset)
            general = label_tables.level_prefix_tables(problem, subset, 1)
            np.testing.assert_array_equal(plain[0], general[0])
            np.testing.assert_array_equal(plain[1], general[1])


@pytest.mark.parametrize("seed", range(3))
def test_groups_are_ordered_by_end_then_size(seed):
    """Groups come sorted by (end, submesh size, start, submesh), with repeated
    submesh sizes (tiny problems) and distinct ones alike, and the row minima
    match ``argmin``."""
    from pipedejavu.search.alpa import label_tables

    rng = np.random.default_rng(4000 + seed)
    for _ in range(30):
        problem = tiny_problem(rng, p_memory=0.5)
        groups = label_tables.stage_groups(problem)
        fits = np.isfinite(problem.compute_cost) & (problem.max_n_succ_stages >= 0)
        starts, ends, submeshes = np.nonzero(fits.any(axis=3))
        order = np.lexsort((problem.submesh_sizes[submeshes], ends))
        np.testing.assert_array_equal(groups.start, starts[order])
        np.testing.assert_array_equal(groups.end, ends[order])
        np.testing.assert_array_equal(groups.submesh, submeshes[order])
        cost = np.where(fits, problem.compute_cost, np.inf)
        expected = cost[starts[order], ends[order], submeshes[order]]
        np.testing.assert_array_equal(groups.cost, expected)
        least, column = label_tables.row_min(groups.cost)
        np.testing.assert_array_equal(column, groups.cost.argmin(axis=1))
        np.testing.assert_array_equal(least, groups.cost.min(axis=1))
