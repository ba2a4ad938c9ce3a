"""The proof's rules of a mixture of experts are the predictor's: the experts'
optimizer state and step sharded over expert data parallelism (``edp = tp dp
/ (etp ep)``, more than ``dp`` where EP x expert TP < TP, less where it is
more), not over ``dp``. On a small MoE whose state nearly fills its GPUs:
every plan that fits has its stage bounds finite and below its predicted time
(one-chunk plans, 1F1B and ZB-H1), every interleaved candidate's memory test
and tails agree with its prediction, and per-stage recomputation picks the
best counts that fit."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest
from helpers import MOE_STATE_SPEC, largest_stage_bound, stage_bound_tables

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.rules import rank_expert_params
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.search.megatron.interleaved import (
    InterleavedMemo,
    interleaved_candidates,
    search_interleaved,
)
from pipedejavu.search.megatron.interleaved_floor import (
    candidate_fits,
    candidate_floor,
    candidate_plan,
    ranks_fit,
)

SPEC = MOE_STATE_SPEC
POOL = {"A100-40": 4}
GBS = 8


@functools.cache
def _source(ep: int, recompute: str = "none", zero_bubble: bool = False, **more):
    options = TrainingOptions(
        precision="bf16",
        distributed_optimizer=True,
        sequence_parallel=True,  # the experts' TP > 1 needs it
        recompute=recompute,
        zero_bubble=zero_bubble,
        **more,
    )
    experts = ExpertLayers(ExpertPass(ep=ep, etp=1, grouped_gemm=True), False)
    return AnalyticalSource(SPEC, load_gpu_sheet(), options, experts=experts)


@functools.cache
def _plans(ep: int, recompute: str, zero_bubble: bool):
    data = _source(ep, recompute, zero_bubble)
    return [
        (plan, predict_plan(plan, data, constants=C))
        for plan, _ in enumerate_plans(data, SPEC.name, POOL, GBS, C)
    ]


@pytest.mark.parametrize("zero_bubble", [False, True])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_stage_bounds_hold_every_fitting_moe_plan(ep, recompute, zero_bubble):
    """EP 1 at TP 2 and 4 (edp = 2 dp, 4 dp), EP 2 and 4 at TP 1 and 2 (edp
    below dp): no plan that fits is rejected by the proof's memory rule, and
    no stage bound exceeds the predicted time."""
    data = _source(ep, recompute, zero_bubble)
    _, tables = stage_bound_tables(
        data, SPEC.name, tuple(POOL.items()), GBS, uniform=True
    )
    fit = tight = 0
    by_edp = {"more": 0, "less": 0}
    for plan, prediction in _plans(ep, recompute, zero_bubble):
        if not prediction.fits_memory:
            continue
        fit += 1
        bound = largest_stage_bound(tables, plan)
        assert math.isfinite(bound), plan  # the memory rule keeps it
        assert bound <= prediction.iteration_time_s * (1 + 1e-12), plan
        tight += bound >= 0.8 * prediction.iteration_time_s
        edp = plan.layout.edp(0)
        if edp != plan.dp:
            by_edp["more" if edp > plan.dp else "less"] += 1
    assert fit >= 9 and tight >= fit / 2
    # the setting has plans whose experts' state is sharded wider than dp
    # (EP 1 at TP > 1) or narrower (EP > TP)
    assert by_edp["more" if ep == 1 else "less"] > 0


def test_the_experts_sharding_decides_the_fit_at_ep_1():
    """The setting is one where the experts' sharding decides the fit: at
    EP 1 some plans fit only with the experts' optimizer state sharded over
    edp (> dp), and would not over dp."""
    info = _source(1).model_info(SPEC.name)
    decided = 0
    for plan, prediction in _plans(1, "none", False):
        if not prediction.fits_memory:
            continue
        for s, stage in enumerate(plan.stages):
            tp, edp = stage.replicas[0].tp, plan.layout.edp(s)
            experts = rank_expert_params(info, tp, ((stage.start, stage.stop),))
            over_dp = (
                info.sharded_state_bytes_per_param * experts * (1 / plan.dp - 1 / edp)
            )
            room = prediction.memory_limit_bytes[s] - prediction.memory_bytes[s]
            decided += bool((over_dp > room).any())
    assert decided >= 5


@pytest.mark.parametrize("zero_bubble", [False, True])
@pytest.mark.parametrize("ep", [1, 2])  # EP 4: no two-rank candidate holds it
def test_interleaved_floor_matches_the_prediction(ep, zero_bubble):
    """Each interleaved candidate: fitting by the predictor, it passes the
    floor's memory test, and each rank's floor tail (all-reduce and
    optimizer step) is at most the predictor's."""
    data = _source(ep, "none", zero_bubble)
    checked = 0
    for c in interleaved_candidates(data, SPEC.name, POOL, GBS, C):
        plan = candidate_plan(data, SPEC.name, GBS, c)
        fits, tails = candidate_floor(data, SPEC.name, C, plan, c.chunks)
        prediction = predict_plan(plan, data, constants=C, virtual_stages=c.chunks)
        if prediction.fits_memory:
            assert fits, c
        # the same test on one pipeline, before the plan is placed
        assert candidate_fits(data, SPEC.name, C, GBS, c) == fits, c
        if fits:
            after = prediction.dp_allreduce_s + prediction.optimizer_s.max(axis=1)
            assert (tails <= after * (1 + 1e-12)).all(), c
            checked += 1
    assert checked >= 2


def test_one_pipelines_memory_test_is_the_placed_plans():
    """The search tests an interleaved candidate's memory on one pipeline
    before placing its ``P x dp`` replicas (:func:`candidate_fits`): the same
    verdict as the placed plan's floor, for every candidate at reserves from
    14 to 38 GiB (both verdicts taken), including where the experts' state
    sharded over ``edp`` rather than ``dp`` decides it."""
    counts = {"fit": 0, "not": 0, "edp decides": 0}
    for pool, gbs in (({"A100-40": 4}, 8), ({"A100-40": 8}, 16)):
        for ep, zero_bubble in itertools.product((1, 2, 4), (False, True)):
            data = _source(ep, "none", zero_bubble)
            for c in interleaved_candidates(data, SPEC.name, pool, gbs, C):
                plan = candidate_plan(data, SPEC.name, gbs, c)
                for gib in range(14, 40, 2):
                    reserve = (("A100-40", gib * 2**30),)
                    limits = dataclasses.replace(C, reserve_bytes=reserve)
                    placed = candidate_floor(data, SPEC.name, limits, plan, c.chunks)
                    one = candidate_fits(data, SPEC.name, limits, gbs, c)
                    assert one == placed[0], (c, gib)
                    counts["fit" if one else "not"] += 1
                    over_dp = ranks_fit(
                        data, SPEC.name, limits, plan, c.chunks, edp=plan.dp
                    )
                    counts["edp decides"] += over_dp != one
    assert min(counts.values()) >= 50, counts


def test_a_memo_shared_by_expert_layouts_changes_no_search():
    """One :class:`InterleavedMemo` kept over the searches of several expert
    layouts (what ``plan`` does): sources of equal sizes share memory tests,
    sources of other sizes do not, and every search finds what it finds with
    a memo of its own. Tight reserves make the memory decide."""
    limits = dataclasses.replace(C, reserve_bytes=(("A100-40", 26 * 2**30),))
    shared = InterleavedMemo()
    pool, gbs = {"A100-40": 8}, 16
    keys = set()
    tests = found = 0
    for ep, dispatcher, overlap, zero_bubble in itertools.product(
        (1, 2, 4), ("alltoall", "flex"), (False, True), (False, True)
    ):
        if dispatcher == "flex" and ep == 1:  # (flex needs etp x ep > 1)
            continue
        options = TrainingOptions(
            precision="bf16",
            distributed_optimizer=True,
            sequence_parallel=True,
            zero_bubble=zero_bubble,
        )
        layer = ExpertPass(ep=ep, etp=1, grouped_gemm=True, dispatcher=dispatcher)
        data = AnalyticalSource(
            SPEC, load_gpu_sheet(), options, experts=ExpertLayers(layer, overlap)
        )
        keys.add(data.model_info(SPEC.name).content_key())
        own = InterleavedMemo()
        alone = search_interleaved(data, SPEC.name, pool, gbs, limits, memo=own)
        tests += len(own.fits)
        found += alone.prediction is not None
        kept = search_interleaved(data, SPEC.name, pool, gbs, limits, memo=shared)
        assert (alone.prediction is None) == (kept.prediction is None)
        if alone.prediction is not None:
            assert kept.plan == alone.plan and kept.chunks == alone.chunks
            assert kept.prediction.iteration_time_s == alone.prediction.iteration_time_s
        assert (kept.lower_bound_s, kept.proven) == (alone.lower_bound_s, alone.proven)
    verdicts = set(shared.fits.values())
    # EP and the schedule change the sizes, the dispatcher and overlap not
    assert len(keys) == 3 and len({key[0] for key in shared.fits}) == 6
    assert verdicts == {False, True} and found >= 10
    assert len(shared.fits) <= tests / 2  # (each layout's tests shared)


def test_per_stage_recomputation_takes_the_predictors_state():
    """Per-stage recomputation of a mixture of experts: each stage reruns the
    least count with which the predictor says it fits, so the counts it
    picks give the best time over every assignment that fits."""
    data = _source(1, "full", False, recompute_choices=(0, 1, None))
    fit = 0
    for plan, _ in enumerate_plans(data, SPEC.name, POOL, GBS, C, max_stages=2):
        auto = predict_plan(plan, data, constants=C)
        best = math.inf
        for counts in itertools.product((0, 1, None), repeat=plan.num_stages):
            given = predict_plan(plan, data, constants=C, stage_layers=counts)
            if given.fits_memory:
                best = min(best, given.iteration_time_s)
        if math.isfinite(best):
            fit += 1
            assert auto.fits_memory
            assert auto.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert fit >= 5


def test_expert_sharding_of_the_bounds_is_the_layouts():
    """The proof's expert split: the costs' EP and expert TP laid out on a
    stage of ``tp x dp`` GPUs (dense models: none)."""
    from pipedejavu.search.megatron.bounds import span_experts

    starts, stops = np.array([0, 1]), np.array([2, 6])
    info = _source(1).model_info(SPEC.name)
    experts, edp = span_experts(info, 2, 3, starts, stops)
    assert edp == 6  # tp 2 x dp 3 over blocks of etp 1 x ep 1
    np.testing.assert_array_equal(
        experts, [info.expert_params[2][0:2].sum(), info.expert_params[2][1:6].sum()]
    )
    assert span_experts(_source(4).model_info(SPEC.name), 1, 8, starts, stops)[1] == 2
    dense = dataclasses.replace(info, expert_params=None)
    assert span_experts(dense, 2, 3, starts, stops) == (0.0, 1)


def test_the_sizes_key_tells_every_field_apart():
    """:meth:`ModelInfo.content_key`, which keys the shared memory tests:
    equal for a copy, different when any one size or setting differs."""
    info = _source(2).model_info(SPEC.name)
    copy = dataclasses.replace(
        info, params={k: v.copy() for k, v in info.params.items()}
    )
    assert copy.content_key() == info.content_key()
    tp = min(info.params)
    for name in ("params", "act_mem", "act_output", "expert_params"):
        arrays = {k: v.copy() for k, v in getattr(info, name).items()}
        arrays[tp][-1] += 1.0
        changed = dataclasses.replace(info, **{name: arrays})
        assert changed.content_key() != info.content_key(), name
    for field, value in (
        ("expert_axes", (4, 1)),
        ("activation_bytes", 4.0 if info.activation_bytes != 4.0 else 2.0),
        ("sharded_state_bytes_per_param", info.sharded_state_bytes_per_param + 1),
        ("recompute_layers", 1),
    ):
        changed = dataclasses.replace(info, **{field: value})
        assert changed.content_key() != info.content_key(), field
