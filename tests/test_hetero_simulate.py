"""Transfers enter the simulator and the objective the same way (issue 6).

With one backward/forward ratio for every stage (b = 2 f) and per-direction
transfer x = c / 2 on each link, the simulated GPipe iteration is
``sum t + sum c + (B - 1) * max(max t, max c)`` -- the objective of
``pipedejavu.core.hetero`` -- whenever the links are never the bottleneck
(``max x <= max f``) or always are (``max x >= max b``).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipedejavu.core.cluster import Cluster, DeviceType, Link
from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.hetero_rules import evaluate_hetero, make_hetero_plan
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.planning.compare import simulate_schedule


def _problem(bytes_per_boundary: float, seed: int) -> HeteroProblem:
    base = random_problem(8, (2, 4), num_microbatches=6, seed=seed)
    cluster = Cluster.from_types(
        [DeviceType("fast", 1.0), DeviceType("slow", 0.5)],
        ["fast", "slow"],
        4,
        intra_host=Link(1e-6, 1e11),
        inter_host=Link(1e-5, 1e9),
    )
    return HeteroProblem.from_problem(
        base, cluster, boundary_bytes=np.full(7, bytes_per_boundary)
    )


def _plan(problem):
    # four stages, two per host type; stage 0/1 share a host, 2/3 share a host
    return make_hetero_plan(
        problem,
        [(0, 2, 1, 0, 0), (2, 4, 1, 0, 0), (4, 6, 1, 0, 1), (6, 8, 1, 0, 1)],
        method="hand",
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("regime", ["links never bind", "links always bind"])
def test_gpipe_simulation_equals_the_objective(seed, regime):
    probe = _plan(_problem(1.0, seed))
    max_f = max(s.latency for s in probe.stages) / 3
    # inter-host link: 1e-5 s + bytes / 1e9; pick bytes for each regime
    target = 0.2 * max_f if regime == "links never bind" else 5.0 * max_f
    problem = _problem(max(target - 1e-5, 0.0) * 1e9, seed)
    plan = _plan(problem)
    x = np.asarray(plan.transfers) / 2
    f = np.asarray([s.latency for s in plan.stages]) / 3
    if regime == "links never bind":
        assert x.max() <= f.max()
    else:
        assert x.max() >= 2 * f.max()
    simulated = simulate_schedule(problem, plan, "gpipe").iteration_time
    np.testing.assert_allclose(simulated, evaluate_hetero(problem, plan), rtol=1e-9)
    np.testing.assert_allclose(plan.cost, evaluate_hetero(problem, plan), rtol=0)


def test_free_links_reduce_to_alpa_formula():
    problem = _problem(0.0, 0).replace(
        cluster=Cluster.from_types(
            [DeviceType("fast", 1.0), DeviceType("slow", 0.5)], ["fast", "slow"], 4
        )
    )
    plan = _plan(problem)
    latencies = [s.latency for s in plan.stages]
    expected = sum(latencies) + (problem.num_microbatches - 1) * max(latencies)
    np.testing.assert_allclose(plan.cost, expected, rtol=1e-12)
    simulated = simulate_schedule(problem, plan, "gpipe").iteration_time
    np.testing.assert_allclose(simulated, expected, rtol=1e-9)


def test_float_memory_limits_with_inf_are_read_like_problem():
    # +inf = unlimited, -inf = never, as pipedejavu.Problem reads them.
    problem = _problem(1.0, 0)
    memory = np.full(problem.compute_cost.shape, np.inf)
    memory[0, 0] = -np.inf
    memory[1, 1] = 3.0
    typed = problem.replace(max_n_succ_stages=memory)
    assert typed.max_n_succ_stages.dtype == np.int64
    assert typed.max_n_succ_stages[0, 0].max() == -1
    assert typed.max_n_succ_stages[1, 1].max() == 3
    assert typed.max_n_succ_stages[2, 3].min() == 2**20
    with pytest.raises(Exception, match="integers"):
        problem.replace(max_n_succ_stages=memory * 0.5 + 0.25)
