"""Planning Megatron-style training: the tail term in the shared planning model,
the search against brute force (planning objective and predictor), the planning
tables against the predictor, and the API."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import solved_alike, tiny_problem

from pipedejavu import InfeasibleProblemError, Problem, ProblemError, evaluate
from pipedejavu.baselines.brute import brute_force
from pipedejavu.baselines.megatron_brute import brute_force_megatron
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import compile_tables, plan_from_stages
from pipedejavu.planning.training import parse_gpu_pool, plan_training
from pipedejavu.search import exact_dp
from pipedejavu.search.megatron.planner import search_megatron
from pipedejavu.search.megatron.settings import MegatronSearchConfig

DATA = SailorData()


# --------------------------------------------------------------- the tail term
@pytest.mark.parametrize("seed", range(4))
def test_exact_dp_with_tails_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(40):
        problem = tiny_problem(rng)
        tails = rng.uniform(0, 3, size=problem.compute_cost.shape)
        problem = problem.replace(stage_tail_cost=tails)
        solved = solved_alike(brute_force, exact_dp, problem)
        if solved is None:
            continue
        expected, plan = solved
        assert plan.cost == pytest.approx(expected.cost, rel=1e-12)
        assert plan.cost == pytest.approx(evaluate(problem, plan), rel=1e-12)
        checked += 1
    assert checked > 10


def test_tail_field(tmp_path):
    cost = np.array([[[[1.0]], [[2.0]]], [[[np.inf]], [[1.5]]]])  # L = 2
    tails = np.array([[[[0.5]], [[0.1]]], [[[0.0]], [[0.7]]]])
    problem = Problem(cost, None, np.array([[1, 1]]), (1, 2), 3, stage_tail_cost=tails)
    plan = exact_dp(problem)  # two stages: 1 + 1.5 + 2 * 1.5 + max(0.5, 0.7)
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 1), (1, 2)]
    assert plan.cost == pytest.approx(5.5 + 0.7)
    path = problem.to_npz(tmp_path / "p.npz")
    again = Problem.from_npz(path)
    np.testing.assert_array_equal(again.stage_tail_cost, problem.stage_tail_cost)
    assert (
        Problem.from_npz(
            Problem(cost, None, [[1, 1]], (1, 2), 3).to_npz(tmp_path / "q.npz")
        ).stage_tail_cost
        is None
    )
    with pytest.raises(ProblemError, match="stage_tail_cost must have the shape"):
        Problem(cost, None, np.array([[1, 1]]), (1, 2), 3, stage_tail_cost=tails[0])
    with pytest.raises(ProblemError, match="finite and >= 0"):
        Problem(cost, None, [[1, 1]], (1, 2), 3, stage_tail_cost=-tails)


# ---------------------------------------------------- tables vs the predictor
@pytest.mark.parametrize(
    "model, gpu, mbs, dp, tp, gbs",
    [
        ("OPT-350", "GH-96", 8, 16, 4, 1024),
        ("OPT-350", "GH-96", 2, 32, 1, 512),
        ("GPT-Neo-2.7", "GH-96", 1, 8, 1, 64),  # several all-reduce buckets
        ("OPT-350", "Titan-RTX", 2, 2, 8, 64),
    ],
)
def test_one_stage_objective_is_the_predictor(model, gpu, mbs, dp, tp, gbs):
    """A single stage has no pipeline approximation: the planning objective of
    the compiled tables equals the predictor exactly."""
    steps = gbs // (mbs * dp)
    tables = compile_tables(
        DATA,
        model,
        C,
        gpu_type=gpu,
        mbs=mbs,
        dp=dp,
        num_microbatches=steps,
        tps=[tp],
        zone="us-central1-a",
    )
    last = DATA.model_info(model).num_layers - 1
    cost = tables.compute_cost[0, last, 0, 0]
    tail = tables.stage_tail_cost[0, last, 0, 0]
    plan = plan_from_stages(
        [(0, last + 1, tp)],
        gpu_type=gpu,
        dp=dp,
        mbs=mbs,
        gbs=gbs,
        model=model,
        gpus_per_node=DATA.gpu_spec(gpu).gpus_per_node,
        zone="us-central1-a",
    )
    prediction = predict_plan(plan, DATA, constants=C)
    assert steps * cost + tail == pytest.approx(prediction.iteration_time_s, rel=1e-9)
    fits = tables.max_n_succ_stages[0, last, 0, 0] >= 0
    assert fits == prediction.fits_memory


def test_pipelined_objective_is_close_to_the_predictor():
    tables = compile_tables(
        DATA,
        "OPT-350",
        C,
        gpu_type="GH-96",
        mbs=8,
        dp=8,
        num_microbatches=16,
        tps=[4],
        zone="us-central1-a",
    )
    problem = Problem(
        tables.compute_cost,
        tables.max_n_succ_stages,
        [[1, 4]],
        (1, 8),
        16,
        stage_tail_cost=tables.stage_tail_cost,
    )
    plan = exact_dp(problem)
    built = plan_from_stages(
        [(s.start, s.stop, 4) for s in plan.stages],
        gpu_type="GH-96",
        dp=8,
        mbs=8,
        gbs=1024,
        model="OPT-350",
        gpus_per_node=4,
        zone="us-central1-a",
    )
    predicted = predict_plan(built, DATA, constants=C).iteration_time_s
    assert plan.cost == pytest.approx(predicted, rel=0.02)


# ------------------------------------------------------ search vs brute force
@pytest.mark.parametrize(
    "model, pool, gbs, uniform",
    [
        ("OPT-350", {"RTX-2080": 4}, 8, True),  # a two-stage optimum
        ("OPT-350", {"RTX-2080": 4}, 8, False),
        ("OPT-350", {"GH-96": 3}, 12, True),
        ("OPT-350", {"RTX-2080": 2, "RTX-3090": 2}, 8, True),
        ("GPT-Neo-2.7", {"A100-40": 4}, 16, True),
    ],
)
def test_search_matches_brute_force(model, pool, gbs, uniform):
    config = MegatronSearchConfig(uniform_tp=uniform)
    result = search_megatron(DATA, model, pool, gbs, C, config)
    plan, value = brute_force_megatron(DATA, model, pool, gbs, C, uniform_tp=uniform)
    assert result.optimum_s == pytest.approx(value, rel=1e-12)
    assert result.gap == 0.0 and result.lower_bound_s == result.optimum_s
    assert result.prediction.fits_memory


@pytest.mark.parametrize(
    "pool, gbs", [({"RTX-2080": 4}, 8), ({"GH-96": 2}, 16), ({"RTX-3090": 2}, 4)]
)
def test_chosen_plan_is_the_predictor_optimum(pool, gbs):
    """Every plan of these small settings scored by the full predictor: the
    chosen plan's predicted time is the least."""
    result = search_megatron(DATA, "OPT-350", pool, gbs, C)
    _, best = brute_force_megatron(DATA, "OPT-350", pool, gbs, C, score="predictor")
    assert result.prediction.iteration_time_s == pytest.approx(best, rel=1e-9)


def test_pruning_keeps_the_optimum():
    """Solving every configuration (no pruning) finds the same optimum."""
    pool, gbs = {"RTX-2080": 8}, 32
    pruned = search_megatron(DATA, "OPT-350", pool, gbs, C)
    full = search_megatron(
        DATA, "OPT-350", pool, gbs, C, MegatronSearchConfig(rescore_tolerance=1e6)
    )
    assert full.solved == full.configurations > pruned.solved
    assert pruned.optimum_s == pytest.approx(full.optimum_s, rel=1e-12)
    assert pruned.plan.num_stages == 2  # the memory of an RTX 2080 forces a pipeline


# ----------------------------------------------------------------------- API
def test_plan_training():
    """``plan_training`` on a setting small enough for brute force: its plan's
    predicted time is the least of every plan (the predictor re-run on the
    exported JSON), its objective is the tables' price of that plan, its
    optimum and bounds are brute force's, and the JSON carries those values."""
    pool, gbs = {"RTX-2080": 4}, 8
    result = plan_training("OPT-350", ["RTX-2080:4"], gbs)
    data = result.to_json()
    plan = Plan3D.from_json(json.loads(json.dumps(data)))
    assert plan.model == "OPT-350" and plan.num_gpus <= 4
    again = predict_plan(plan, DATA, constants=C)
    _, best = brute_force_megatron(DATA, "OPT-350", pool, gbs, C, score="predictor")
    _, optimum = brute_force_megatron(DATA, "OPT-350", pool, gbs, C)
    assert again.fits_memory and data["fits_memory"]
    assert data["iteration_time_s"] == again.iteration_time_s
    assert data["iteration_time_s"] == pytest.approx(best, rel=1e-12)
    assert data["peak_memory_bytes"] == again.peak_memory_bytes
    assert data["memory_per_stage_bytes"] == again.stage_memory_bytes.tolist()
    assert data["proven_optimal"]
    assert data["predicted_lower_bound_s"] == pytest.approx(best, rel=1e-12)
    assert data["optimum_s"] == pytest.approx(optimum, rel=1e-12)
    assert data["lower_bound_s"] == data["optimum_s"] and data["gap"] == 0.0
    # The objective: sum c + (B - 1) max c + max tail on the search's tables.
    tps = tuple(sorted({s.replicas[0].tp for s in plan.stages}))
    tables = compile_tables(
        DATA,
        "OPT-350",
        C,
        gpu_type="RTX-2080",
        mbs=plan.mbs,
        dp=plan.dp,
        num_microbatches=plan.num_microbatches,
        tps=tps,
        zone="us-central1-a",
        pipeline_gpus=sum(s.replicas[0].tp for s in plan.stages),
    )
    spans = [(s.start, s.stop - 1, tps.index(s.replicas[0].tp)) for s in plan.stages]
    costs = [tables.compute_cost[a, b, m, 0] for a, b, m in spans]
    tails = [tables.stage_tail_cost[a, b, m, 0] for a, b, m in spans]
    objective = sum(costs) + (plan.num_microbatches - 1) * max(costs) + max(tails)
    assert data["objective_s"] == pytest.approx(objective, rel=1e-12)
    assert data["objective_s"] >= data["optimum_s"] * (1 - 1e-12)
    assert data["gpus_used"] == {"RTX-2080": plan.num_gpus}
    assert data["fewer_gpus"] == (plan.num_gpus < 4)


def test_fewer_gpus_when_faster():
    """7 GH-96 GPUs, gbs 8: every plan divides 8 samples over its replicas, so
    the best one leaves GPUs idle rather than use an odd replica count."""
    result = plan_training("OPT-350", {"GH-96": 7}, 8)
    assert result.plan.num_gpus < 7 and result.to_json()["fewer_gpus"]
    # Without idle GPUs a pipeline spans all GPUs its replica count leaves.
    full = plan_training("OPT-350", {"GH-96": 7}, 8, allow_fewer_gpus=False)
    assert full.plan.num_gpus == full.plan.dp * (7 // full.plan.dp)
    assert result.optimum_s <= full.optimum_s


def test_bad_inputs():
    assert parse_gpu_pool(["GH-96:8", "RTX-3090:8"]) == {"GH-96": 8, "RTX-3090": 8}
    with pytest.raises(ProblemError, match="names GH-96 twice"):  # no silent sum
        parse_gpu_pool(["GH-96:4", "GH-96:4", "RTX-3090:8"])
    for bad in (["GH-96"], ["GH-96:0"], ["GH-96:x"], []):
        with pytest.raises(ProblemError, match="--gpus"):
            parse_gpu_pool(bad)
    with pytest.raises(ProblemError, match="no profile of model OPT-350 on GPU"):
        plan_training("OPT-350", {"H100": 8}, 64)
    with pytest.raises(ProblemError, match="method must be"):
        plan_training("OPT-350", {"GH-96": 4}, 64, method="anneal")
    with pytest.raises(InfeasibleProblemError, match="no plan of GPT-Neo-2.7 fits"):
        plan_training("GPT-Neo-2.7", {"V100-16": 2}, 8)


def test_the_memory_reachability_test_agrees_with_enumeration():
    # The planner skips the DP of a configuration where no chain of exactly P
    # stages meets the memory rule (a stage with n stages after it needs
    # memory >= n); every partition of the layers, enumerated, agrees.
    import itertools

    from pipedejavu.search.megatron.space import chain_counts

    rng = np.random.default_rng(0)
    found = {True: 0, False: 0}
    for _ in range(2000):
        layers, stages = int(rng.integers(1, 7)), int(rng.integers(1, 7))
        memory = rng.integers(-1, 5, size=(layers, layers))
        fits = any(
            all(
                memory[edges[s], edges[s + 1] - 1] >= stages - 1 - s
                for s in range(stages)
            )
            for cuts in itertools.combinations(range(1, layers), stages - 1)
            for edges in [(0, *cuts, layers)]
        )
        assert chain_counts(memory, 7)[stages] == fits
        found[fits] += 1
    assert min(found.values()) > 100  # both answers were exercised


def test_a_probe_result_is_proven_as_the_whole_search():
    # The knob search keeps its probe's DP (certify off) and proves it:
    # the same plan, objective, candidates and proof as one whole search.
    pool, gbs = {"A100-40": 8}, 32
    whole = search_megatron(DATA, "GPT-Neo-2.7", pool, gbs, C)
    config = MegatronSearchConfig()
    probe = search_megatron(
        DATA, "GPT-Neo-2.7", pool, gbs, C, MegatronSearchConfig(certify=False)
    )
    assert probe.certificate is None and not probe.proven
    proven = search_megatron(DATA, "GPT-Neo-2.7", pool, gbs, C, config, solved=probe)
    assert proven.plan == whole.plan and proven.proven and whole.proven
    assert proven.objective_s == whole.objective_s
    assert proven.candidates == whole.candidates
    assert proven.predicted_lower_bound_s == whole.predicted_lower_bound_s
    assert proven.search_time_s >= probe.search_time_s
    with pytest.raises(ProblemError, match="not yet proven"):
        search_megatron(DATA, "GPT-Neo-2.7", pool, gbs, C, config, solved=proven)
