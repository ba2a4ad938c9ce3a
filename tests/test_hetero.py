"""Hardware-aware planning: the vocabulary, the exact oracle, Alpa's way, instances."""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np
import pytest
from helpers import solved_alike
from hetero_reference import random_inter_host, random_problem_on

from pipedejavu.baselines.hetero import (
    alpa_homogeneous,
    alpa_placement,
    hetero_brute_force,
)
from pipedejavu.core.cluster import FREE_LINK, Cluster, DeviceType, Link
from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.hetero_rules import (
    check_hetero_plan,
    evaluate_hetero,
    make_hetero_plan,
    place,
    transfer_times,
)
from pipedejavu.core.problem import (
    InfeasibleProblemError,
    PlanError,
    Problem,
    ProblemError,
    get_submesh_choices,
)
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.costmodel.stage.hetero_generate import (
    GPTSpec,
    hetero_problem,
    three_type_cluster,
    two_type_cluster,
)
from pipedejavu.search.alpa.exact import exact_dp
from pipedejavu.search.hetero.exact import HeteroTimeoutError, hetero_exact

UNLIMITED = 2**20


# ------------------------------------------------------------------ helpers
def tiny_hetero(rng: np.random.Generator, max_layers: int = 5) -> HeteroProblem:
    """1-3 types, hosts of 1-4 devices, links with latency and bandwidth, inf
    entries and memory limits; costs grow with span and shrink with devices."""
    num_types = int(rng.integers(1, 4))
    dph = int(rng.choice([1, 2, 4]))
    num_hosts = int(rng.integers(1, 4))
    types = [
        DeviceType(f"t{i}", float(rng.uniform(0.3, 1.5))) for i in range(num_types)
    ]

    def link() -> Link:
        return Link(float(rng.uniform(0, 0.2)), float(rng.uniform(1, 20)))

    inter = random_inter_host(rng, num_types, link)
    cluster = Cluster.from_types(
        types,
        rng.integers(0, num_types, num_hosts).tolist(),
        dph,
        intra_host={t.name: link() for t in types},
        inter_host=inter,
    )
    shapes = get_submesh_choices(num_hosts, dph, "all")
    return random_problem_on(
        rng,
        cluster,
        shapes,
        max_layers,
        size_exponent=0.8,
        max_microbatches=7,
        max_boundary=10.0,
    )


def small_two_type(**links) -> Cluster:
    """Hosts [fast, fast, slow] of 2 devices; distinct, exactly representable
    link times so each transfer's link can be told apart."""
    return Cluster.from_types(
        [DeviceType("fast", 1.0, 8e9), DeviceType("slow", 0.5, 4e9)],
        ["fast", "fast", "slow"],
        2,
        intra_host={"fast": Link(0.5, 1.0), "slow": Link(0.25, 1.0)},
        inter_host={
            "default": Link(1.0, 1.0),
            "fast-slow": Link(2.0, 1.0),
            **links,
        },
    )


def uniform_problem(cluster: Cluster, num_layers: int = 4, **kwargs) -> HeteroProblem:
    shapes = np.array(get_submesh_choices(*cluster.shape, "all"))
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1
    cost = np.broadcast_to(
        np.clip(spans, 1, None)[:, :, None, None, None]
        / (shapes[:, 0] * shapes[:, 1])[None, None, :, None, None]
        / np.array(cluster.speeds),
        (num_layers, num_layers, len(shapes), 1, cluster.num_types),
    )
    defaults = dict(
        max_n_succ_stages=None,
        submesh_shapes=shapes,
        cluster=cluster,
        num_microbatches=4,
        boundary_bytes=np.full(num_layers - 1, 2.0),
    )
    return HeteroProblem(compute_cost=cost, **{**defaults, **kwargs})


# --------------------------------------------------------------- vocabulary
def test_link_units_and_errors():
    link = Link.from_json({"latency_us": 20, "bandwidth_gbps": 100}, "x")
    assert link.latency_s == pytest.approx(20e-6)
    assert link.bandwidth == pytest.approx(12.5e9)
    assert link.time(12.5e6) == pytest.approx(20e-6 + 1e-3)
    assert Link.from_json(link.to_json(), "x") == link
    assert FREE_LINK.time(1e12) == 0.0
    with pytest.raises(ProblemError, match="unknown keys"):
        Link.from_json({"latency_ms": 1}, "here")
    with pytest.raises(ProblemError, match="one unit only"):
        Link.from_json({"latency_us": 1, "latency_s": 1e-6}, "here")
    with pytest.raises(ProblemError, match="latency"):
        Link(-1.0)
    with pytest.raises(ProblemError, match="bandwidth"):
        Link(0.0, 0.0)
    with pytest.raises(ProblemError, match="speed"):
        DeviceType("x", speed=0.0)


def test_cluster_validation_errors():
    fast = DeviceType("fast")
    with pytest.raises(ProblemError, match="unique"):
        Cluster.from_types([fast, fast], [0], 2)
    with pytest.raises(ProblemError, match="not one of"):
        Cluster.from_types([fast], ["slow"], 2)
    with pytest.raises(ProblemError, match="host_types must index"):
        Cluster.from_types([fast], [1], 2)
    with pytest.raises(ProblemError, match="'a-b'"):
        Cluster.from_types([fast], [0], 2, inter_host={"fast+fast": FREE_LINK})
    with pytest.raises(ProblemError, match="symmetric"):
        Cluster(
            (fast, DeviceType("slow")),
            (0, 1),
            2,
            (FREE_LINK, FREE_LINK),
            ((FREE_LINK, Link(1.0)), (FREE_LINK, FREE_LINK)),
        )
    with pytest.raises(ProblemError, match="at least one host"):
        Cluster.from_types([fast], [], 2)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_cluster_file_round_trip(tmp_path, suffix):
    cluster = small_two_type()
    data = cluster.to_json()
    assert Cluster.from_json(json.loads(json.dumps(data))) == cluster
    path = tmp_path / f"cluster{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        if sys.version_info < (3, 11):
            pytest.skip("TOML needs Python >= 3.11")
        path.write_text(
            'devices_per_host = 2\nhosts = ["fast", "fast", "slow"]\n'
            "[device_types.fast]\nspeed = 1.0\nmemory_gb = 8\n"
            "[device_types.slow]\nspeed = 0.5\nmemory_gb = 4\n"
            "[intra_host.fast]\nlatency_s = 0.5\nbandwidth_bytes_per_s = 1.0\n"
            "[intra_host.slow]\nlatency_s = 0.25\nbandwidth_bytes_per_s = 1.0\n"
            "[inter_host.default]\nlatency_s = 1.0\nbandwidth_bytes_per_s = 1.0\n"
            '[inter_host."fast-slow"]\nlatency_s = 2.0\nbandwidth_bytes_per_s = 1.0\n'
        )
    assert Cluster.from_file(path) == cluster
    assert cluster.describe() == "2x2 fast (speed 1) + 1x2 slow (speed 0.5)"


def test_cluster_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProblemError, match="invalid JSON"):
        Cluster.from_file(bad)
    with pytest.raises(ProblemError, match="cannot read"):
        Cluster.from_file(tmp_path / "missing.json")
    data = small_two_type().to_json()
    with pytest.raises(ProblemError, match="unknown keys"):
        Cluster.from_json({**data, "racks": 2})
    with pytest.raises(ProblemError, match="missing key 'hosts'"):
        Cluster.from_json({k: v for k, v in data.items() if k != "hosts"})
    with pytest.raises(ProblemError, match="devices_per_host must be an integer"):
        Cluster.from_json({**data, "devices_per_host": 2.5})


def test_problem_validation_and_views(tmp_path):
    cluster = small_two_type()
    problem = uniform_problem(cluster)
    with pytest.raises(ProblemError, match=r"\(L, L, M, K, T\)"):
        problem.replace(compute_cost=problem.compute_cost[..., 0])
    with pytest.raises(ProblemError, match="device types"):
        problem.replace(compute_cost=problem.compute_cost[..., :1])
    with pytest.raises(ProblemError, match="boundary_bytes must have shape"):
        problem.replace(boundary_bytes=np.ones(5))
    with pytest.raises(ProblemError, match="finite and >= 0"):
        problem.replace(boundary_bytes=-np.ones(3))
    with pytest.raises(ProblemError, match="num_microbatches"):
        problem.replace(num_microbatches=0)
    with pytest.raises(ProblemError, match="does not fit"):
        problem.replace(submesh_shapes=np.array([[1, 4]] * problem.num_submeshes))
    # Alpa's view: mean speed (2 * 2 * 1 + 2 * 0.5) / 6 = 5 / 6 of type 0's.
    view = problem.homogeneous_view()
    np.testing.assert_allclose(
        view.compute_cost, problem.compute_cost[..., 0] * 6 / 5, rtol=1e-12
    )
    path = tmp_path / "problem.npz"
    problem.to_npz(path)
    again = HeteroProblem.from_npz(path)
    np.testing.assert_array_equal(again.compute_cost, problem.compute_cost)
    np.testing.assert_array_equal(again.boundary_bytes, problem.boundary_bytes)
    assert again.cluster == cluster and again.num_microbatches == 4
    np.savez(tmp_path / "plain.npz", compute_cost=np.zeros((1, 1, 1, 1)))
    with pytest.raises(ProblemError, match="not a heterogeneous problem"):
        HeteroProblem.from_npz(tmp_path / "plain.npz")


def test_canonical_placement_and_transfers():
    cluster = small_two_type()
    problem = uniform_problem(cluster)
    m = {tuple(s): i for i, s in enumerate(problem.submesh_shapes.tolist())}
    # fast (1,1), slow (1,2), fast (1,1), fast (1,2): fast packs host 0 then 1.
    stages = [
        (0, 1, m[1, 1], 0, 0),
        (1, 2, m[1, 2], 0, 1),
        (2, 3, m[1, 1], 0, 0),
        (3, 4, m[1, 2], 0, 0),
    ]
    assert place(problem, stages) == [((0,), 0), ((2,), 0), ((0,), 1), ((1,), 0)]
    plan = make_hetero_plan(problem, stages, method="test")
    # bytes 2, bandwidth 1: fast-slow 2 * (2 + 2), then the same back, then
    # fast host 0 -> fast host 1 across hosts: 2 * (1 + 2).
    assert plan.transfers == (8.0, 8.0, 6.0)
    assert plan.inter_host_hops(cluster) == 3
    latencies = [s.latency for s in plan.stages]
    assert plan.cost == pytest.approx(sum(latencies) + 22.0 + 3 * 8.0)
    # Two fast (1,1) stages share host 0: intra-host link, 2 * (0.5 + 2).
    shared = make_hetero_plan(
        problem,
        [(0, 1, m[1, 1], 0, 0), (1, 2, m[1, 1], 0, 0), (2, 4, m[2, 2], 0, 1)],
        method="test",
        placement=[((0,), 0), ((0,), 1), ((1, 2), 0)],
    )
    assert transfer_times(problem, shared.stages)[0] == 5.0
    with pytest.raises(PlanError, match="straddle"):
        place(problem, [(0, 1, m[1, 1], 0, 0), (1, 4, m[1, 2], 0, 0)])
    with pytest.raises(PlanError, match="devices"):
        place(problem, [(0, 4, m[1, 2], 0, 0)])


def test_check_hetero_plan_rules():
    cluster = small_two_type()
    problem = uniform_problem(cluster)
    m = {tuple(s): i for i, s in enumerate(problem.submesh_shapes.tolist())}
    good = make_hetero_plan(
        problem, [(0, 2, m[2, 2], 0, 0), (2, 4, m[1, 2], 0, 1)], method="x"
    )
    check_hetero_plan(problem, good)
    first, second = good.stages
    import dataclasses

    def broken(**change):
        return [first, dataclasses.replace(second, **change)]

    with pytest.raises(PlanError, match="contiguity"):
        check_hetero_plan(problem, broken(start=3))
    with pytest.raises(PlanError, match="slowest type"):
        check_hetero_plan(problem, broken(device_type=0))
    with pytest.raises(PlanError, match="used twice"):
        check_hetero_plan(problem, broken(hosts=(1,)))
    with pytest.raises(PlanError, match="unused"):
        check_hetero_plan(problem, [dataclasses.replace(first, stop=4)])
    # A mixed (2, 2) stage on a fast and the slow host runs at the slow type.
    mixed = make_hetero_plan(
        problem,
        [(0, 2, m[1, 2], 0, 0), (2, 4, m[2, 2], 0, 1)],
        method="x",
        placement=[((0,), 0), ((1, 2), 0)],
    )
    assert mixed.stages[1].latency == pytest.approx(
        problem.compute_cost[2, 3, m[2, 2], 0, 1]
    )
    memory = np.full(problem.compute_cost.shape, UNLIMITED)
    memory[0, 1, :, :, :] = 0  # a first stage of layers 0..1 allows no successor
    tight = problem.replace(max_n_succ_stages=memory)
    with pytest.raises(PlanError, match="memory"):
        check_hetero_plan(tight, good)


def test_free_links_give_alpa_objective():
    base = random_problem(6, (1, 4), num_configs=1, seed=3)
    problem = HeteroProblem.from_problem(base, Cluster.homogeneous(1, 4))
    plan = exact_dp(base)
    stages = [
        (s.start, s.stop, s.submesh_index, s.config_index, 0) for s in plan.stages
    ]
    hetero = make_hetero_plan(problem, stages, method="x")  # one host: it packs
    assert hetero.cost == pytest.approx(plan.cost, rel=1e-12)


# ------------------------------------------------------------------- oracle
@pytest.mark.parametrize("seed", range(4))
def test_oracle_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    compared = 0
    for _ in range(60):
        problem = tiny_hetero(rng)
        solved = solved_alike(hetero_brute_force, hetero_exact, problem)
        if solved is None:
            continue
        expected, plan = solved
        compared += 1
        np.testing.assert_allclose(plan.cost, expected.cost, rtol=1e-9)
        assert plan.cost == pytest.approx(evaluate_hetero(problem, plan), rel=1e-12)
        assert plan.transfers == tuple(transfer_times(problem, plan.stages))
    assert compared >= 45


@pytest.mark.parametrize("seed", range(3))
def test_allowed_boundaries_equal_brute_force_on_restriction(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(30):
        problem = tiny_hetero(rng)
        num_layers = problem.num_layers
        stops = [b for b in range(1, num_layers) if rng.random() < 0.5]
        mask = np.zeros((num_layers, num_layers), dtype=bool)
        ends = set(stops) | {num_layers}
        for start in {0} | set(stops):
            for stop in ends:
                if stop > start:
                    mask[start, stop - 1] = True
        restricted = problem.replace(
            compute_cost=np.where(
                mask[:, :, None, None, None], problem.compute_cost, np.inf
            )
        )
        try:
            expected = hetero_brute_force(restricted).cost
        except InfeasibleProblemError:
            with pytest.raises(InfeasibleProblemError, match="allowed_boundaries"):
                hetero_exact(problem, allowed_boundaries=stops)
            continue
        by_stops = hetero_exact(problem, allowed_boundaries=stops)
        by_mask = hetero_exact(problem, allowed_boundaries=mask)
        np.testing.assert_allclose(by_stops.cost, expected, rtol=1e-9)
        np.testing.assert_allclose(by_mask.cost, expected, rtol=1e-9)
        assert {s.stop for s in by_stops.stages} <= ends


def test_allowed_boundaries_errors():
    problem = uniform_problem(small_two_type())
    with pytest.raises(ProblemError, match="stage stops in 0..4"):
        hetero_exact(problem, allowed_boundaries=[5])
    with pytest.raises(ProblemError, match="span mask must have shape"):
        hetero_exact(problem, allowed_boundaries=np.ones((3, 3), dtype=bool))


def test_incumbent_prunes_and_returns_none_when_nothing_is_cheaper():
    problem = hetero_problem(12, two_type_cluster(1, 1, 4), seed=1)
    best = hetero_exact(problem)
    assert hetero_exact(problem, incumbent_cost=best.cost) is None
    again = hetero_exact(problem, incumbent_cost=best.cost * 1.05)
    assert again is not None and again.cost == pytest.approx(best.cost, rel=1e-12)
    assert again.info["num_evaluated"] <= best.info["num_evaluated"]


def test_infeasible_reasons():
    cluster = small_two_type()
    problem = uniform_problem(cluster)
    with pytest.raises(InfeasibleProblemError, match="profiled"):
        hetero_exact(
            problem.replace(compute_cost=np.full(problem.compute_cost.shape, np.inf))
        )
    with pytest.raises(InfeasibleProblemError, match="memory limit"):
        hetero_exact(
            problem.replace(max_n_succ_stages=np.full(problem.compute_cost.shape, -1))
        )
    # One layer, and no submesh holds all six devices: too few stages.
    one = uniform_problem(cluster, num_layers=1, boundary_bytes=None)
    whole = one.submesh_shapes.tolist().index([3, 2])
    cost = one.compute_cost.copy()
    cost[:, :, whole] = np.inf
    with pytest.raises(InfeasibleProblemError, match="uses exactly the devices"):
        hetero_exact(one.replace(compute_cost=cost))
    # Three (1, 2) stages hold six devices but not on two hosts of three.
    threes = Cluster.from_types([DeviceType("d")], [0, 0], 3)
    packing = HeteroProblem(
        np.where(np.eye(3, dtype=bool), 1.0, np.inf)[:, :, None, None, None],
        None,
        np.array([[1, 2]]),
        threes,
        2,
    )
    with pytest.raises(InfeasibleProblemError, match="straddling two hosts"):
        hetero_exact(packing)
    # Every stage allows one successor at most, and three are needed.
    memory = np.full(problem.compute_cost.shape, 1)
    memory[..., 0, :, :] = -1  # no (1, 1) stages
    shapes = problem.submesh_shapes.tolist()
    memory[:, :, shapes.index([3, 2])] = -1
    memory[:, :, shapes.index([2, 2])] = -1
    with pytest.raises(InfeasibleProblemError, match="max_n_succ_stages"):
        hetero_exact(problem.replace(max_n_succ_stages=memory))


def test_time_limit_and_progress():
    problem = hetero_problem(16, two_type_cluster(), seed=0)
    with pytest.raises(HeteroTimeoutError, match="time limit") as caught:
        hetero_exact(problem, time_limit_s=0.0)
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.best_plan is None and caught.value.lower_bound == -math.inf
    optimum = hetero_exact(problem).cost

    def slow_progress(report):  # the deadline passes after the first cap
        time.sleep(0.3)

    with pytest.raises(HeteroTimeoutError) as caught:
        hetero_exact(problem, time_limit_s=0.2, progress_fn=slow_progress)
    partial = caught.value
    assert partial.caps_evaluated == 1 and partial.best_plan is not None
    assert partial.lower_bound <= optimum * (1 + 1e-12)
    assert partial.best_plan.cost >= optimum * (1 - 1e-12)
    seen = []
    plan = hetero_exact(problem, progress_fn=seen.append)
    assert seen and seen[-1]["best_cost"] == pytest.approx(plan.cost)
    assert all(r["lower_bound"] <= r["best_cost"] + 1e-12 for r in seen)
    assert plan.info["num_evaluated"] == len(seen) + 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cluster_shape", [(1, 4), (1, 8), (2, 2), (2, 4)])
def test_homogeneous_reduction(seed, cluster_shape):
    """Power-of-two submeshes always pack onto power-of-two hosts, so with free
    links the oracle equals the homogeneous exact DP."""
    base = random_problem(
        7, cluster_shape, num_microbatches=8, memory_tightness=2.0, seed=seed
    )
    # Free links, or costly links that move zero bytes (no latency).
    links = {"intra_host": Link(0.0, 1.0), "inter_host": Link(0.0, 2.0)}
    problem = HeteroProblem.from_problem(
        base,
        Cluster.homogeneous(*cluster_shape, **({} if seed % 2 else links)),
        boundary_bytes=np.zeros(6),
    )
    np.testing.assert_allclose(
        hetero_exact(problem).cost, exact_dp(base).cost, rtol=1e-9
    )


def test_homogeneous_reduction_when_alpa_plan_is_not_canonical():
    """(1, 4), (1, 8), (1, 4) on two 8-device hosts is Alpa's optimum; packing
    in pipeline order would straddle, the oracle puts the (1, 4)s on one host."""
    cost = np.full((3, 3, 2, 1), 10.0)
    cost[0, 0, 0] = cost[1, 1, 1] = cost[2, 2, 0] = 1.0  # submeshes (1,4), (1,8)
    base = Problem(cost, None, np.array([[1, 4], [1, 8]]), (2, 8), 4)
    problem = HeteroProblem.from_problem(base, Cluster.homogeneous(2, 8))
    alpa = exact_dp(base)
    assert [s.submesh for s in alpa.stages] == [(1, 4), (1, 8), (1, 4)]
    oracle = hetero_exact(problem)
    np.testing.assert_allclose(oracle.cost, alpa.cost, rtol=1e-12)
    assert oracle.stages[0].hosts == oracle.stages[2].hosts != oracle.stages[1].hosts
    np.testing.assert_allclose(oracle.cost, hetero_brute_force(problem).cost)
    way = alpa_homogeneous(problem)
    assert way.info["placement"] == "alpa"
    np.testing.assert_allclose(way.cost, alpa.cost, rtol=1e-12)


# -------------------------------------------------------------- Alpa's way
def test_alpa_sorted_slicing_follows_alpa():
    problem = uniform_problem(Cluster.homogeneous(2, 8), num_layers=3)
    index = {tuple(s): i for i, s in enumerate(problem.submesh_shapes.tolist())}
    stages = [index[1, 4], index[1, 8], index[1, 4]]
    # Pipeline order would straddle; Alpa's rule: largest first, then equal
    # sizes in reverse (stable argsort walked backwards).
    placed, rule = alpa_placement(problem, stages, "pipeline")
    assert rule == "alpa"
    assert placed == [((1,), 4), ((0,), 0), ((1,), 0)]
    in_order, rule = alpa_placement(problem, [index[1, 8], index[1, 4], index[1, 4]])
    assert rule == "pipeline" and in_order == [((0,), 0), ((1,), 0), ((1,), 4)]
    with pytest.raises(ValueError, match="placement"):
        alpa_placement(problem, stages, "random")


def test_alpa_homogeneous_prices_the_true_cluster():
    problem = hetero_problem(16, two_type_cluster(), seed=0)
    plan = alpa_homogeneous(problem)
    assert plan.cost == pytest.approx(evaluate_hetero(problem, plan), rel=1e-12)
    view = problem.homogeneous_view().replace(
        max_n_succ_stages=problem.max_n_succ_stages.min(axis=-1)
    )
    assert plan.info["alpa_predicted_cost"] == pytest.approx(exact_dp(view).cost)
    assert [s.start for s in plan.stages] == [s.start for s in exact_dp(view).stages]
    oracle = hetero_exact(problem)
    # Alpa balances for the mean speed; the slow half makes its plan slower.
    assert plan.cost > 1.15 * oracle.cost


def test_alpa_mixed_stage_runs_at_slowest_type():
    cluster = two_type_cluster(1, 1, 2, memory_gb=(None, None))
    problem = uniform_problem(cluster, num_layers=2)
    index = {tuple(s): i for i, s in enumerate(problem.submesh_shapes.tolist())}
    # One (2, 2) stage is Alpa's plan when it is far the cheapest.
    cost = np.array(problem.compute_cost)
    cost[0, 1, index[2, 2]] /= 100
    plan = alpa_homogeneous(problem.replace(compute_cost=cost))
    assert len(plan.stages) == 1 and plan.info["mixed_stages"] == 1
    assert plan.stages[0].device_type == 1


def test_alpa_equals_dp_on_free_homogeneous_cluster():
    base = random_problem(8, (1, 8), num_microbatches=8, seed=2)
    problem = HeteroProblem.from_problem(base, Cluster.homogeneous(1, 8))
    plan = alpa_homogeneous(problem)
    np.testing.assert_allclose(plan.cost, exact_dp(base).cost, rtol=1e-12)
    np.testing.assert_allclose(hetero_exact(problem).cost, plan.cost, rtol=1e-9)


@pytest.mark.parametrize("rule", ["pipeline", "alpa"])
def test_issue_752_hops(rule):
    """Alpa issue 752: 32 (1, 1) stages on 4 x 8 devices; 3 hops are the minimum
    and the oracle's canonical placement attains it."""
    cluster = Cluster.homogeneous(
        4, 8, intra_host=Link(5e-6, 300e9), inter_host=Link(20e-6, 12.5e9)
    )
    problem = hetero_problem(32, cluster, num_microbatches=16, seed=0)
    cost = np.array(problem.compute_cost)
    cost[:, :, 1:] = np.inf  # only (1, 1) submeshes
    problem = problem.replace(compute_cost=cost)
    plan = hetero_exact(problem)
    assert plan.num_stages == 32
    assert plan.inter_host_hops(cluster) == 3
    assert [s.hosts[0] for s in plan.stages] == [h for h in range(4) for _ in range(8)]
    alpa = alpa_homogeneous(problem, placement=rule)
    # Alpa's slicing (stable argsort of equal sizes, walked backwards) puts the
    # stages in reverse order, host-contiguous: 3 hops as well.
    assert alpa.info["inter_host_hops"] == 3
    np.testing.assert_allclose(alpa.cost, plan.cost, rtol=1e-9)


# ---------------------------------------------------------------- instances
def test_generated_instance_model():
    cluster = two_type_cluster(slow_speed=0.5)
    spec = GPTSpec()
    problem = hetero_problem(16, cluster, seed=5, model=spec, type_noise=0.0)
    assert problem.compute_cost.shape == (16, 16, 6, 2, 2)
    np.testing.assert_allclose(problem.boundary_bytes, 2 * 2048 * 4096)
    finite = np.isfinite(problem.compute_cost[..., 0])
    np.testing.assert_allclose(
        problem.compute_cost[..., 1][finite], 2 * problem.compute_cost[..., 0][finite]
    )
    # The reference device's table is random_problem's (same draws), in units of
    # one layer's flops at 150 Tflop/s (two blocks per layer here).
    head_flops = 6.0 * spec.tokens * spec.hidden_size * spec.vocab_size
    layer_flops = 2 * spec.block_flops
    reference = random_problem(
        16,
        cluster.shape,
        num_microbatches=32,
        submesh_space="power_of_two",
        num_configs=2,
        irregularity=0.05,
        edge_weight=1.0 + 0.5 * head_flops / layer_flops,
        noise=0.02,
        seed=5,
    )
    np.testing.assert_allclose(
        problem.compute_cost[..., 0],
        reference.compute_cost * layer_flops / 150e12,
        rtol=1e-12,
    )
    # The 16 GB type never allows more succeeding stages than the 40 GB one.
    assert (
        problem.max_n_succ_stages[..., 1] <= problem.max_n_succ_stages[..., 0]
    ).all()
    assert (problem.max_n_succ_stages[..., 1] < problem.max_n_succ_stages[..., 0]).any()
    again = hetero_problem(16, cluster, seed=5, model=spec, type_noise=0.0)
    np.testing.assert_array_equal(again.compute_cost, problem.compute_cost)


def test_cluster_builders():
    cluster = two_type_cluster(2, 1, 4, host_order="interleaved", cross_type_gbps=50)
    assert cluster.host_types == (0, 1, 0)
    assert cluster.inter_host[0][1].bandwidth == pytest.approx(50e9 / 8)
    assert cluster.inter_host[0][0].bandwidth == pytest.approx(100e9 / 8)
    assert cluster.intra_host[1].bandwidth == pytest.approx(1200e9 / 8)
    three = three_type_cluster()
    assert three.devices_of_type() == (8, 8, 16)
    assert three.speeds == (2.0, 1.0, 0.45)
    with pytest.raises(ProblemError, match="host_order"):
        two_type_cluster(host_order="random")
    with pytest.raises(ProblemError, match="some host"):
        two_type_cluster(0, 0)
    with pytest.raises(ProblemError, match="GPTSpec.hidden_size"):
        GPTSpec(hidden_size=0)


def test_oracle_beats_alpa_on_three_types():
    problem = hetero_problem(16, three_type_cluster(), seed=0)
    oracle = hetero_exact(problem)
    alpa = alpa_homogeneous(problem)
    assert oracle.cost < alpa.cost
    assert math.isfinite(oracle.cost)
