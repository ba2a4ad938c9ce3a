"""The proof under the predictor on pools of several nodes: pipelines and
data-parallel rings that cross nodes, stages sharing a node with their
neighbours or not, mixed GPU types on nodes of their own. Its stage bounds
never exceed the prediction of a random plan that fits, and the proven plan is
the brute-force optimum of every plan with up to three stages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import (
    PlacedMixChecks,
    every_mixed_plan,
    mixed_in_pool,
    proof_groups,
)

from pipedejavu.core.plan3d import DEFAULT_ZONE, Plan3D
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import (
    plan_from_stages,
)
from pipedejavu.search.megatron.bounds import stage_bounds
from pipedejavu.search.megatron.chains import StageBounds
from pipedejavu.search.megatron.planner import search_megatron
from pipedejavu.search.megatron.settings import MegatronSearchConfig
from pipedejavu.search.megatron.transfers import BoundCache

DATA = SailorData()
MODEL = "OPT-350"
LAYERS = DATA.model_info(MODEL).num_layers


def _nodes(plan: Plan3D) -> int:
    return len({(r.gpu_type, r.node) for s in plan.stages for r in s.replicas})


def _random_edges(rng, count: int) -> tuple[int, ...]:
    cuts = sorted(rng.choice(np.arange(1, LAYERS), count - 1, replace=False))
    return (0, *map(int, cuts), LAYERS)


@pytest.mark.parametrize(
    "gpu, count, gbs, uniform",
    [("V100-16", 16, 32, True), ("RTX-2080", 32, 32, True), ("V100-16", 16, 32, False)],
)
def test_stage_bounds_below_predictions_on_several_nodes(gpu, count, gbs, uniform):
    """Random plans of the search space spanning two nodes or more (one TP
    degree, or one per stage): the largest stage bound <= the prediction."""
    groups = {
        (g.mbs, g.dp, g.tps): g
        for g in proof_groups(
            DATA, MODEL, {gpu: count}, gbs, uniform=uniform, mbs_values=(1, 2)
        )
    }
    gpn = DATA.gpu_spec(gpu).gpus_per_node
    rng = np.random.default_rng(11)
    cache, bounds = BoundCache(), {}
    keys = sorted(groups)
    checked, ratios = 0, []
    for _ in range(400):
        group = groups[keys[int(rng.integers(len(keys)))]]
        stages = int(rng.integers(1, 7))
        degrees = [int(rng.choice(group.tps)) for _ in range(stages)]
        if uniform:
            degrees = [degrees[0]] * stages
        if sum(degrees) not in group.sizes:
            continue
        edges = _random_edges(rng, stages)
        plan = plan_from_stages(
            list(zip(edges[:-1], edges[1:], degrees, strict=True)),
            gpu_type=gpu,
            dp=group.dp,
            mbs=group.mbs,
            gbs=gbs,
            model=MODEL,
            gpus_per_node=gpn,
            zone=DEFAULT_ZONE,
        )
        if _nodes(plan) < 2:
            continue
        prediction = predict_plan(plan, DATA, constants=C)
        if not prediction.fits_memory:
            continue
        key = (group.mbs, group.dp, group.tps)
        if key not in bounds:
            tables = stage_bounds(DATA, MODEL, C, group, cache)
            bounds[key] = StageBounds(group, tables, C.op_overhead_s)
        left, largest = sum(degrees), -math.inf
        for stage, tp in zip(plan.stages, degrees, strict=True):
            w = bounds[key].weights(tp, left)[stage.start, stage.stop]
            largest = max(largest, float(w))
            left -= tp
        assert largest <= prediction.iteration_time_s * (1 + 1e-12)
        checked += 1
        ratios.append(largest / prediction.iteration_time_s)
    assert checked >= 40 and np.median(ratios) > 0.8 and max(ratios) > 0.99


def test_placed_mixed_bounds_below_predictions_on_several_nodes():
    """Mixed plans on three types of four-GPU nodes, two nodes or more per
    type: every stage bound of the exact placement and the bottleneck DP of
    the plan's stage counts <= the prediction."""
    gbs = 32
    pool = {"A100-40": 8, "V100-16": 8, "GH-96": 8}
    types = list(pool)
    rng = np.random.default_rng(5)
    checks = PlacedMixChecks(DATA, MODEL, C, pool, gbs)
    ratios = []
    for _ in range(600):
        mbs, tp, dp = (int(rng.choice(v)) for v in ((1, 2), (1, 2, 4), (1, 2, 4)))
        count = int(rng.integers(2, 6))
        kinds = [types[int(k)] for k in rng.integers(0, 3, count)]
        if not mixed_in_pool(kinds, tp, dp, pool):
            continue
        if max(kinds.count(gpu) * tp * dp for gpu in pool) <= 4:
            continue  # a type on two nodes at least
        edges = _random_edges(rng, count)
        ratio = checks.ratio(mbs, tp, dp, edges, kinds)
        if ratio is not None:
            ratios.append(ratio)
    assert len(ratios) >= 30 and np.median(ratios) > 0.8 and max(ratios) > 0.99


def _best_single(gpu, count, gbs, mbs_values, max_stages):
    """The least predicted time of every one-type plan of one TP degree with
    up to ``max_stages`` stages (enumerated here, not by the search)."""
    info = DATA.model_info(MODEL)
    gpn = DATA.gpu_spec(gpu).gpus_per_node
    best, best_plan = math.inf, None
    for mbs, tp, dp in itertools.product(mbs_values, info.tp_values, range(1, 33)):
        if (gbs // mbs) % dp or (mbs, tp) not in DATA.profile(MODEL, gpu) or gpn % tp:
            continue
        for stages in range(1, max_stages + 1):
            if stages * tp * dp > count:
                continue
            for cuts in itertools.combinations(range(1, LAYERS), stages - 1):
                edges = (0, *cuts, LAYERS)
                plan = plan_from_stages(
                    [(a, b, tp) for a, b in zip(edges[:-1], edges[1:], strict=True)],
                    gpu_type=gpu,
                    dp=dp,
                    mbs=mbs,
                    gbs=gbs,
                    model=MODEL,
                    gpus_per_node=gpn,
                    zone=DEFAULT_ZONE,
                )
                prediction = predict_plan(plan, DATA, constants=C)
                if prediction.fits_memory and prediction.iteration_time_s < best:
                    best, best_plan = prediction.iteration_time_s, plan
    return best, best_plan


def _best_mixed(pool, gbs, mbs_values, max_stages):
    """The least predicted time of every plan with 2..``max_stages`` stages on
    two types or more (one TP degree, Megatron's rank order per type)."""
    best, best_plan = math.inf, None
    for _, plan, prediction in every_mixed_plan(
        DATA, C, MODEL, pool, gbs, mbs_values, range(1, 33), range(2, max_stages + 1)
    ):
        if prediction is None:  # no link fit between the types
            continue
        if prediction.fits_memory and prediction.iteration_time_s < best:
            best, best_plan = prediction.iteration_time_s, plan
    return best, best_plan


@pytest.mark.parametrize(
    "gpu, count, gbs, mbs_values",
    [("RTX-2080", 16, 32, (2,)), ("V100-16", 8, 16, (2,))],
)
def test_proven_plan_is_brute_force_on_several_nodes(gpu, count, gbs, mbs_values):
    """One TP degree, up to three stages, a pool of two nodes or more: the
    proven plan's predicted time is the least of every plan, whose optimum
    spans two nodes."""
    best, best_plan = _best_single(gpu, count, gbs, mbs_values, 3)
    config = MegatronSearchConfig(mbs_values=mbs_values, max_stages=3)
    result = search_megatron(DATA, MODEL, {gpu: count}, gbs, C, config)
    assert result.proven and _nodes(best_plan) >= 2
    assert result.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert result.predicted_lower_bound_s == pytest.approx(best, rel=1e-12)


def test_mixed_proven_plan_is_brute_force_on_several_nodes():
    """Mixed GPU types, two four-GPU nodes per type, up to three stages: the
    proven plan is the best of every mixed and one-type plan."""
    pool, gbs, mbs_values = {"A100-40": 8, "V100-16": 8}, 16, (2,)
    mixed_best, mixed_plan = _best_mixed(pool, gbs, mbs_values, 3)
    single = [_best_single(gpu, n, gbs, mbs_values, 3) for gpu, n in pool.items()]
    best = min([mixed_best] + [value for value, _ in single])
    config = MegatronSearchConfig(mbs_values=mbs_values, max_stages=3, mixed_types=True)
    result = search_megatron(DATA, MODEL, pool, gbs, C, config)
    assert result.proven and _nodes(mixed_plan) >= 3
    assert result.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert mixed_best < min(value for value, _ in single) * 1.01  # a close race
