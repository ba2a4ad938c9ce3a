"""Stage-cost prediction from a profiled fraction, the memory model and plan regret."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from pipedejavu.costmodel import (
    read_stage_profile,
    stage_memory_stats,
    stage_profile_tables,
)
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.costmodel.stage.memory_model import (
    MemoryStatsTable,
    alpa_max_n_succ_stages,
    fit_memory_model,
    memory_stats_table,
    predict_memory_stats,
    synthetic_memory_stats,
)
from pipedejavu.costmodel.stage.predict import (
    SubsetConfig,
    planning_problem,
    predict_stage_costs,
    profile_subset,
)
from pipedejavu.planning.inputs import bundled_examples
from pipedejavu.planning.predict_regret import (
    format_predictor_report,
    load_instance,
    plan_regret,
    predictor_report,
    true_optimum,
)


def additive_problem(num_layers=16, cluster=(2, 4), seed=0, **kwargs):
    """random_problem without noise is exactly additive per layer."""
    return random_problem(
        num_layers, cluster, irregularity=0.3, noise=0.0, seed=seed, **kwargs
    )


def span_design_rank(mask_2d):
    starts, ends = np.nonzero(mask_2d)
    layers = np.arange(mask_2d.shape[0])
    inside = (starts[:, None] <= layers) & (layers <= ends[:, None])
    design = np.concatenate([inside, np.ones((len(starts), 1))], axis=1)
    return np.linalg.matrix_rank(design.astype(float)) if len(starts) else 0


def real_profile(index):
    example = bundled_examples()[index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # incomplete records
        return load_instance(
            example.path,
            cluster_shape=example.cluster_shape,
            num_microbatches=example.num_microbatches,
        )


# Sampling ---------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("design", ["short", "uniform"])
def test_subset_counts_rank_and_determinism(fraction, seed, design):
    problem = random_problem(12, (1, 4), missing=0.3, seed=seed)
    profiled = np.isfinite(problem.compute_cost)
    config = SubsetConfig(design=design)
    chosen = profile_subset(profiled, fraction, seed=seed, config=config)
    again = profile_subset(profiled, fraction, seed=seed, config=config)
    np.testing.assert_array_equal(chosen, again)
    assert not (chosen & ~profiled).any()
    for m in range(problem.num_submeshes):
        for k in range(problem.num_configs):
            count = int(profiled[:, :, m, k].sum())
            drawn = int(chosen[:, :, m, k].sum())
            assert drawn >= min(count, max(2, math.ceil(fraction * count - 1e-9)))
            # the draw determines the additive model as well as all entries do
            assert span_design_rank(chosen[:, :, m, k]) == span_design_rank(
                profiled[:, :, m, k]
            )
    if fraction == 1.0:
        np.testing.assert_array_equal(chosen, profiled)


def test_short_design_prefers_short_stages():
    profiled = np.isfinite(random_problem(32, (1, 4)).compute_cost)
    lengths = np.arange(32)[None, :] - np.arange(32)[:, None] + 1

    def mean_length(design):
        chosen = profile_subset(
            profiled, 0.1, seed=0, config=SubsetConfig(design=design)
        )
        return np.broadcast_to(lengths[:, :, None, None], chosen.shape)[chosen].mean()

    # one draw over the 528 spans of L = 32: uniform, mean length (L + 2) / 3;
    # weights 1 / length, 528 / ((L + 1) H_L - L) = 5.18
    harmonic = np.sum(1 / np.arange(1, 33))
    assert mean_length("uniform") == pytest.approx(34 / 3, rel=0.15)
    assert mean_length("short") == pytest.approx(528 / (33 * harmonic - 32), rel=0.15)


def test_subset_depends_on_seed():
    profiled = np.isfinite(random_problem(16, (1, 4)).compute_cost)
    assert (
        profile_subset(profiled, 0.25, seed=0) != profile_subset(profiled, 0.25, seed=1)
    ).any()


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), True, "0.5", None])
def test_fraction_validation(fraction):
    problem = additive_problem(6, (1, 2))
    with pytest.raises(ValueError, match="fraction must be a number in \\(0, 1\\]"):
        predict_stage_costs(problem, fraction, seed=0)
    with pytest.raises(ValueError, match="fraction must be"):
        plan_regret(problem, fraction, seed=0)


def test_argument_validation():
    problem = additive_problem(6, (1, 2))
    profiled = np.isfinite(problem.compute_cost)
    with pytest.raises(ValueError, match="min_per_slot must be a positive integer"):
        SubsetConfig(min_per_slot=0)
    with pytest.raises(ValueError, match="design must be one of"):
        SubsetConfig(design="greedy")
    with pytest.raises(ValueError, match="complete_rank must be a bool"):
        SubsetConfig(complete_rank=1)
    with pytest.raises(ValueError, match="config must be a SubsetConfig"):
        profile_subset(profiled, 0.5, seed=0, config={"design": "short"})
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        profile_subset(profiled, 0.5, seed=-1)
    with pytest.raises(ValueError, match="profiled must have shape"):
        profile_subset(profiled[0], 0.5, seed=0)
    with pytest.raises(ValueError, match="support must be one of"):
        plan_regret(problem, 0.5, seed=0, support="some")
    with pytest.raises(ValueError, match="memory_stats must have the table shape"):
        stats, _ = synthetic_memory_stats(additive_problem(5, (1, 2)))
        predict_stage_costs(problem, 0.5, seed=0, memory_stats=stats)
    with pytest.raises(ValueError, match="fractions must be a non-empty sequence"):
        predictor_report(problem, fractions=())
    with pytest.raises(ValueError, match="needs cluster_shape"):
        load_instance(bundled_examples()[0].path)


# Cost prediction ----------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_noiseless_additive_is_recovered(fraction):
    problem = additive_problem(16, (2, 4), missing=0.2)
    result = predict_stage_costs(problem, fraction, seed=1)
    finite = np.isfinite(problem.compute_cost)
    np.testing.assert_allclose(
        result.predicted_cost[finite], problem.compute_cost[finite], rtol=1e-6
    )
    assert result.fit_max_relative_error < 1e-6
    assert result.held_out_mape < 1e-6
    assert result.num_held_out > 0.6 * finite.sum()
    # at 10% of 136 spans a slot needs a few more to pin its L + 1 = 17 unknowns
    assert fraction <= result.effective_fraction <= fraction + 0.08


def test_noisy_fit_residual_and_held_out_error():
    noise = 0.02
    problem = random_problem(24, (2, 4), noise=noise, seed=2)
    result = predict_stage_costs(problem, 0.25, seed=0)
    cost = problem.compute_cost
    with np.errstate(invalid="ignore"):  # inf / inf below the diagonal
        error = np.abs(result.predicted_cost / cost - 1)
    sampled = result.sampled
    # the reported residual is the largest error on the fitted entries, and a
    # relative least-squares fit stays within about twice the noise
    assert result.fit_max_relative_error == pytest.approx(error[sampled].max())
    assert result.fit_max_relative_error < 2.5 * noise
    held_out = np.isfinite(cost) & ~sampled
    assert result.held_out_mape == pytest.approx(error[held_out].mean())
    assert result.held_out_mape < noise  # uniform noise has mean |e| = noise / 2


def test_prediction_is_deterministic():
    problem = random_problem(12, (1, 4), noise=0.05, seed=4)
    stats, problem = synthetic_memory_stats(problem, tightness=2.0, seed=4)
    first = predict_stage_costs(problem, 0.25, seed=7, memory_stats=stats)
    second = predict_stage_costs(problem, 0.25, seed=7, memory_stats=stats)
    np.testing.assert_array_equal(first.sampled, second.sampled)
    np.testing.assert_array_equal(first.predicted_cost, second.predicted_cost)
    np.testing.assert_array_equal(
        first.predicted_max_n_succ, second.predicted_max_n_succ
    )
    assert first.to_json() == second.to_json()


# Memory model -------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, 2])
def test_memory_table_reproduces_alpa_on_real_profiles(index):
    example = bundled_examples()[index]
    records = read_stage_profile(example.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cost, limit = stage_profile_tables(records, num_submeshes=3)
    stats = memory_stats_table(records, cost.shape)
    finite = np.isfinite(cost)
    np.testing.assert_array_equal(stats.profiled, finite)
    np.testing.assert_array_equal(stats.max_n_succ_stages()[finite], limit[finite])
    for key, record in records.items():
        if record.fully_profiled:
            expected = stage_memory_stats([record])
            assert stats.peak[key] == expected.peak_memory
            assert stats.intermediate[key] == expected.intermediate_size


def test_alpa_formula_edges():
    limits = alpa_max_n_succ_stages(
        np.array([10.0, 10.0, 10.0, 10.0, np.nan]),
        np.array([2.0, 2.0, 12.0, 2.0, 1.0]),
        np.array([1.0, 1.0, 0.0, 1.0, 1.0]),
        np.array([2.0, 0.0, 1.0, 7.0, 1.0]),
    )
    # 7 // 2 - 1 = 2; no stash -> unlimited; over memory -> -1; 7 // 7 - 1 = 0
    np.testing.assert_array_equal(limits, [2, 2**20, -1, 0, -1])


def test_memory_model_recovers_additive_components():
    problem = additive_problem(16, (2, 4))
    stats, problem = synthetic_memory_stats(problem, tightness=2.0, seed=1)
    finite = np.isfinite(problem.compute_cost)
    sampled = profile_subset(finite, 0.25, seed=0)
    predicted = predict_memory_stats(fit_memory_model(stats, sampled))
    for name in ("initial", "intermediate"):  # sums over layers: exact
        np.testing.assert_allclose(
            getattr(predicted, name)[finite], getattr(stats, name)[finite], rtol=1e-9
        )
    limit = predicted.max_n_succ_stages()
    disagree = (limit[finite] >= 0) != (problem.max_n_succ_stages[finite] >= 0)
    assert disagree.mean() < 0.01  # the peak holds a max over layers


def test_memory_model_exact_on_additive_statistics():
    problem = additive_problem(12, (1, 4))
    stats, _ = synthetic_memory_stats(problem, tightness=2.0, seed=2)
    # make the peak additive too: then every limit is predicted exactly
    additive = MemoryStatsTable(
        available=stats.available,
        peak=stats.initial / 4 + 2 * stats.intermediate,
        initial=stats.initial,
        intermediate=stats.intermediate,
    )
    truth = additive.max_n_succ_stages()
    sampled = profile_subset(additive.profiled, 0.25, seed=3)
    predicted = predict_memory_stats(fit_memory_model(additive, sampled))
    finite = additive.profiled
    np.testing.assert_array_equal(predicted.max_n_succ_stages()[finite], truth[finite])
    assert (truth[finite] >= 0).any() and (truth[finite] < 0).any()


def test_memory_stats_table_validation():
    with pytest.raises(ValueError, match="peak must have the shape of available"):
        MemoryStatsTable(
            available=np.zeros((2, 2, 1, 1)),
            peak=np.zeros((2, 2, 1, 2)),
            initial=np.zeros((2, 2, 1, 1)),
            intermediate=np.zeros((2, 2, 1, 1)),
        )


def test_planning_problem_keeps_measured_entries():
    problem = random_problem(12, (1, 4), noise=0.05, seed=5)
    stats, problem = synthetic_memory_stats(problem, tightness=2.0, seed=5)
    prediction = predict_stage_costs(problem, 0.25, seed=0, memory_stats=stats)
    planning = planning_problem(problem, prediction)
    sampled = prediction.sampled
    np.testing.assert_array_equal(
        planning.compute_cost[sampled], problem.compute_cost[sampled]
    )
    np.testing.assert_array_equal(
        planning.max_n_succ_stages[sampled], problem.max_n_succ_stages[sampled]
    )
    held_out = np.isfinite(problem.compute_cost) & ~sampled
    np.testing.assert_array_equal(
        planning.max_n_succ_stages[held_out], prediction.predicted_max_n_succ[held_out]
    )
    assert (
        np.isfinite(planning.compute_cost).sum()
        == np.isfinite(problem.compute_cost).sum()
    )


# Regret -------------------------------------------------------------------------


@pytest.mark.parametrize("memory", [False, True])
def test_zero_regret_on_noiseless_additive(memory):
    problem = additive_problem(16, (2, 4))
    stats = None
    if memory:
        stats, problem = synthetic_memory_stats(problem, tightness=2.0, seed=0)
    optimum = true_optimum(problem)
    assert optimum[0] is not None
    for seed in range(3):
        result = plan_regret(
            problem, 0.25, seed=seed, memory_stats=stats, optimum=optimum
        )
        assert result.status == "ok", result.detail
        assert result.regret == pytest.approx(0.0, abs=1e-9)
        assert result.plan_cost == pytest.approx(optimum[0], rel=1e-9)


def test_regret_is_never_negative_and_refinement_does_not_fail():
    problem = random_problem(16, (2, 4), noise=0.05, missing=0.3, seed=6)
    stats, problem = synthetic_memory_stats(problem, tightness=2.0, seed=6)
    optimum = true_optimum(problem)
    statuses = []
    for seed in range(4):
        for support in ("profiled", "all"):
            plain = plan_regret(
                problem,
                0.25,
                seed=seed,
                memory_stats=stats,
                support=support,
                optimum=optimum,
            )
            statuses.append(plain.status)
            if plain.status == "ok":
                assert plain.regret >= -1e-12
            else:
                assert plain.status in ("failed-profiled", "failed-memory")
                assert support == "all" and plain.regret is None
            refined = plan_regret(
                problem,
                0.25,
                seed=seed,
                memory_stats=stats,
                support=support,
                refine=True,
                optimum=optimum,
            )
            assert refined.status == "ok"
            assert refined.regret >= -1e-12
            assert refined.refine_rounds >= 1
            assert refined.num_refined <= len(refined.stages) * refined.refine_rounds
    # planning on stages that were never profiled does fail sometimes
    assert any(status.startswith("failed") for status in statuses)


def test_real_profiles_feasible_and_infeasible():
    problem, stats = real_profile(0)  # every profiled stage is over memory
    result = plan_regret(problem, 0.25, seed=0, memory_stats=stats)
    # 1-4 entries per slot: completing the rank profiles all of them
    assert result.prediction.effective_fraction == 1.0
    plain = SubsetConfig(complete_rank=False)
    result = plan_regret(problem, 0.25, seed=0, memory_stats=stats, config=plain)
    assert result.status == "true-infeasible"
    assert result.optimum is None and result.regret is None
    assert "memory" in result.detail
    assert result.prediction.num_held_out > 0  # errors are still measured
    problem, stats = real_profile(1)
    result = plan_regret(problem, 0.25, seed=0, memory_stats=stats)
    assert result.status == "ok" and result.regret == pytest.approx(0.0, abs=1e-12)


def test_report_is_json_and_formats():
    example = bundled_examples()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = predictor_report(
            example.path,
            fractions=(0.25, 1.0),
            seeds=(0, 1),
            cluster_shape=example.cluster_shape,
            num_microbatches=example.num_microbatches,
            name=example.name,
        )
    assert json.loads(json.dumps(report)) == report
    assert report["optimum"] is None and "memory" in report["infeasible_reason"]
    assert report["memory_model"] == "fitted"
    assert [row["fraction"] for row in report["rows"]] == [0.25, 1.0]
    assert len(report["runs"]) == 4
    assert report["rows"][1]["held_out_mape"] is None  # nothing held out at 100%
    text = format_predictor_report(report)
    assert "true problem infeasible" in text and "regret%med" in text

    problem = random_problem(10, (1, 4), noise=0.02, seed=1)
    report = predictor_report(problem, fractions=(0.5,), seeds=(0,))
    assert report["memory_model"] == "table" and report["optimum"] > 0
    assert report["rows"][0]["num_ok"] == 1
    assert "true optimum" in format_predictor_report(report)
