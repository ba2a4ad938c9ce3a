"""Polishing a plan's cuts where its proof was left open
(:mod:`pipedejavu.search.megatron.polish`): single-layer moves reach the
optimum of a separable convex cost (an exact oracle), respect the budget and
memory, and on ZB-H1 plans of Llama-3-8B with fewer micro-batches than stages
end at a plan no single move improves under the predictor, alone and at the
end of a proof cut short."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
from helpers import h100_plan

from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.search.megatron.planner import search_megatron
from pipedejavu.search.megatron.polish import polish_cuts, with_sizes
from pipedejavu.search.megatron.settings import MegatronSearchConfig

GPU = "H100-SXM"


def _sizes(plan):
    return [stage.num_layers for stage in plan.stages]


def _plan(sizes, model="Llama-3-8B", dp=1, steps=4):
    edges = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    stages = [(edges[s], edges[s + 1], 1) for s in range(len(sizes))]
    return h100_plan(model, stages, dp, 1, steps)


def _time(data, plan):
    """``plan``'s predicted time, ``inf`` where it does not fit."""
    prediction = predict_plan(plan, data, constants=C)
    return prediction.iteration_time_s if prediction.fits_memory else math.inf


def _assert_no_move_faster(plan, time_s, predict):
    """No single layer moved between two stages of ``plan`` is faster."""
    now = _sizes(plan)
    for i in range(len(now)):
        for j in range(len(now)):
            if i != j and now[i] > 1:
                moved = list(now)
                moved[i] -= 1
                moved[j] += 1
                assert predict(with_sizes(plan, moved)) >= time_s


@pytest.mark.parametrize("seed", range(6))
def test_reaches_the_optimum_of_a_separable_convex_cost(seed):
    """Cost ``sum_s a_s (n_s - t_s)^2`` over the stages' layer counts: moving
    one layer at a time reaches its optimum ``n = t`` from any start (a
    separable convex cost over a fixed total has no other local optimum)."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 9))
    target = rng.integers(1, 7, count)
    weights = rng.uniform(0.5, 2.0, count)
    start = rng.multinomial(int(target.sum()) - count, np.ones(count) / count) + 1

    def cost(plan):
        return float(np.sum(weights * (np.array(_sizes(plan)) - target) ** 2))

    plan = _plan(start.tolist())
    polished, time_s, used = polish_cuts(plan, cost(plan), cost, 10_000)
    assert _sizes(polished) == target.tolist()
    assert time_s == cost(polished) == 0.0
    assert used < 10_000


def test_budget_memory_and_no_gain():
    """At most ``max_predictions`` calls; a move priced ``inf`` (does not fit)
    is never taken; with nothing faster the start comes back unchanged."""
    plan = _plan([3, 3, 3, 3])
    calls = []

    def flat(candidate):
        calls.append(_sizes(candidate))
        return 1.0

    same, time_s, used = polish_cuts(plan, 1.0, flat, 10_000)
    assert same is plan and time_s == 1.0
    assert used == len(calls) == 12  # one round: every ordered pair of stages
    assert calls[0] in ([2, 4, 3, 3], [4, 2, 3, 3])  # nearest stages first

    def cheaper_but_too_big(candidate):
        sizes = _sizes(candidate)
        return math.inf if sizes[0] > 3 else 2.0 - sum(sizes[:2]) / 10

    best, time_s, used = polish_cuts(plan, 1.4, cheaper_but_too_big, 5)
    assert used == 5
    assert _sizes(best)[0] <= 3 and time_s < 1.4


def test_with_sizes_keeps_the_stages_gpus():
    plan = _plan([8, 8, 9, 9])
    moved = with_sizes(plan, [7, 9, 10, 8])
    assert _sizes(moved) == [7, 9, 10, 8]
    assert [s.replicas for s in moved.stages] == [s.replicas for s in plan.stages]
    assert moved.layout == plan.layout and moved.gbs == plan.gbs


def test_zero_bubble_plan_ends_at_a_local_optimum():
    """Llama-3-8B under ZB-H1 on 8 stages with 4 micro-batches (M < P): from
    equal stages the polish finds a faster plan that fits, and no single
    layer moved between two of its stages is faster under the predictor."""
    pool = {GPU: 8}
    base = choose_cost_source("Llama-3-8B", pool, seq_length=2048)
    options = dataclasses.replace(base.options, zero_bubble=True)
    choice = choose_cost_source("Llama-3-8B", pool, seq_length=2048, options=options)
    layers = choice.data.model_info(choice.model).num_layers
    sizes = np.diff(np.linspace(0, layers, 9).round().astype(int)).tolist()

    predict = functools.partial(_time, choice.data)
    start = _plan(sizes)
    start_s = predict(start)
    assert math.isfinite(start_s)
    polished, time_s, used = polish_cuts(start, start_s, predict, 5_000)
    assert used < 5_000  # it stopped at a local optimum, not at the budget
    assert time_s == predict(polished) < start_s
    _assert_no_move_faster(polished, time_s, predict)


def test_with_sizes_refuses_other_totals():
    plan = _plan([3, 3])
    with pytest.raises(ProblemError, match="2 stage sizes adding up to 7"):
        with_sizes(plan, [3, 4])
    with pytest.raises(ProblemError, match="3 stage sizes"):
        with_sizes(plan, [2, 2, 2])


@functools.cache
def _zero_bubble_8b():
    pool = {GPU: 64}
    base = choose_cost_source("Llama-3-8B", pool, seq_length=2048)
    options = dataclasses.replace(base.options, zero_bubble=True)
    return choose_cost_source("Llama-3-8B", pool, seq_length=2048, options=options)


def _search(max_plans, polish):
    choice = _zero_bubble_8b()
    reports = []
    config = MegatronSearchConfig(certify_max_plans=max_plans, polish_max_plans=polish)
    result = search_megatron(
        choice.data, choice.model, {GPU: 64}, 8, C, config, progress_fn=reports.append
    )
    return result, reports


def test_an_open_proof_polishes_its_plan():
    """Llama-3-8B under ZB-H1 on 64 H100 (8 micro-batches): the proof, cut at
    300 predictions, is left open; polished, its plan is faster, of the same
    configuration, fits, stays above the same certified bound, and no single
    layer moved between two of its stages is faster; without the polish (0
    predictions) the search keeps the plan it had, and the progress reports
    count every prediction."""
    plain, _ = _search(300, 0)
    polished, reports = _search(300, 5_000)
    assert not plain.proven and not polished.proven
    assert plain.certificate.plans_predicted == 300
    assert 300 < polished.certificate.plans_predicted < 5_300
    assert reports[-1]["predicted"] == polished.certificate.plans_predicted
    assert polished.certificate.improved
    assert polished.predicted_lower_bound_s == plain.predicted_lower_bound_s
    time_s = polished.prediction.iteration_time_s
    assert (
        polished.predicted_lower_bound_s <= time_s < plain.prediction.iteration_time_s
    )
    assert polished.prediction.fits_memory
    assert polished.plan.num_stages == plain.plan.num_stages
    assert polished.plan.dp == plain.plan.dp
    predict = functools.partial(_time, _zero_bubble_8b().data)
    _assert_no_move_faster(polished.plan, time_s, predict)
    # the default: a third of the proof's budget
    default, _ = _search(300, None)
    assert default.certificate.plans_predicted <= 400
    assert default.prediction.iteration_time_s < plain.prediction.iteration_time_s
    with pytest.raises(ValueError, match="polish_max_plans must be >= 0"):
        MegatronSearchConfig(polish_max_plans=-1)
