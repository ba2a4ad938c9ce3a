"""Collective latency fits: exact recovery, noise, skipped points, predict, report."""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipedejavu.costmodel import MeshProfilingResult, read_prof_database
from pipedejavu.costmodel.alpa.comm import (
    CommModel,
    bandwidth_factor,
    fit_comm_model,
)
from pipedejavu.costmodel.alpa.comm_data import (
    ARTIFACT,
    COLLECTIVES,
    INVALID,
    NO_OP,
    CommKey,
    GroupShape,
    comm_series,
    group_shape_of,
)
from pipedejavu.costmodel.alpa.comm_fit import (
    AlphaBeta,
    CommFitConfig,
    alpha_beta_time,
    fit_alpha_beta,
    held_out_errors,
)
from pipedejavu.costmodel.alpa.comm_plots import (
    TABLE_LEGEND,
    comm_report,
    format_table,
    plot_fits,
    rows_to_dicts,
    summarize,
)

PROF_DB = Path(__file__).parents[1] / "pipedejavu" / "data" / "prof_database.pkl"
BYTES = 2.0 ** np.arange(33)  # 1 B .. 4 GiB, like Alpa's grid
#: One curve per regime structure (float64 truth).
TRUTH = AlphaBeta(
    floor=np.array([0.0, 5e-4, 5e-4, 0.0]),
    alpha=np.array([1e-5, 1e-4, 1e-2, -1e-2]),
    beta=np.array([1e-10, 1e-10, 1e-10, 2e-10]),
    alpha_mid=np.array([1e-5, 1e-4, 1e-4, 1e-4]),
    beta_mid=np.array([1e-10, 1e-10, 2e-10, 1e-10]),
)
#: line; floor + line; floor + two lines (bandwidth rising: min); two lines (max)
TRUTH_REGIMES = np.array([1, 2, 3, 2])


def _times(params: AlphaBeta, num_bytes: np.ndarray) -> np.ndarray:
    with jax.enable_x64(True):
        rows = AlphaBeta(*(np.asarray(p, np.float64)[..., None] for p in params))
        return np.asarray(alpha_beta_time(rows, num_bytes), dtype=np.float64)


def _clean() -> np.ndarray:
    return _times(TRUTH, BYTES)  # [4, 33]


def test_model_formula_by_hand():
    # floor + two lines, bandwidth rising: min of the lines above the floor
    params = AlphaBeta(*(np.float64(p[2]) for p in TRUTH))
    for b in (1e3, 1e7, 1e9):
        expected = max(5e-4, min(1e-4 + 2e-10 * b, 1e-2 + 1e-10 * b))
        np.testing.assert_allclose(_times(params, np.array(b)), expected, rtol=1e-12)


def test_fits_recover_exact_parameters():
    params, regimes = fit_alpha_beta(np.broadcast_to(BYTES, (4, 33)), _clean())
    np.testing.assert_array_equal(regimes, TRUTH_REGIMES)
    for got, want in zip(params, TRUTH, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-15)
    held_out = held_out_errors(np.broadcast_to(BYTES, (4, 33)), _clean(), None)
    assert np.nanmax(held_out) < 1e-9  # every fold recovers the same curve


def test_fit_ignores_point_order_and_padding():
    order = np.random.default_rng(0).permutation(33)
    seconds = _clean()[2].copy()
    seconds[[0, 10, 20]] = [np.inf, np.nan, -1.0]  # ignored, wherever they are
    params, regimes = fit_alpha_beta(BYTES[order], seconds[order])
    assert regimes == 3
    np.testing.assert_allclose(
        [float(p) for p in params], [p[2] for p in TRUTH], rtol=1e-6
    )


@pytest.mark.parametrize("sigma", [0.01, 0.03, 0.1])
def test_noise_degrades_gracefully(sigma):
    clean = _clean()
    rng = np.random.default_rng(int(sigma * 1000))
    noisy = clean * (1.0 + sigma * rng.standard_normal(clean.shape))
    params, _ = fit_alpha_beta(np.broadcast_to(BYTES, clean.shape), noisy)
    predicted = _times(params, BYTES)
    # measured over 20 seeds: <= 2.4 sigma (predictions), <= 1.8 sigma (beta)
    assert np.max(np.abs(predicted - clean) / clean) < 4 * sigma
    np.testing.assert_allclose(params.beta, TRUTH.beta, rtol=3 * sigma)


def test_floor_needs_enough_points_and_can_be_disabled():
    clean = _clean()[1]  # floor on the 22 smallest sizes
    line_only = CommFitConfig(allow_floor=False, max_lines=1)
    params, regimes = fit_alpha_beta(BYTES, clean, config=line_only)
    assert regimes == 1 and params.floor == 0.0
    # the best single line through a floor + line curve misses it
    assert np.max(np.abs(_times(params, BYTES) - clean) / clean) > 0.5
    too_few = fit_alpha_beta(BYTES, clean, np.arange(33) == 5)[0]
    assert all(math.isnan(float(p)) for p in too_few)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="one shape"):
        fit_alpha_beta(BYTES, BYTES[:-1])
    with pytest.raises(ValueError, match="num_folds"):
        held_out_errors(BYTES[None], BYTES[None], None, num_folds=1)
    with pytest.raises(ValueError, match="min_floor_points"):
        CommFitConfig(min_floor_points=0)
    with pytest.raises(ValueError, match="max_lines"):
        CommFitConfig(max_lines=3)


@pytest.mark.parametrize(
    ("groups", "per_host", "expected"),
    [
        (((0, 1, 2, 3), (4, 5, 6, 7)), 8, GroupShape(2, 4, False, 1)),
        (((0, 8), (1, 9)), 8, GroupShape(2, 2, True, 8)),
        (((0, 2), (1, 3)), 4, GroupShape(2, 2, False, 2)),
        (((0,), (1,)), 2, GroupShape(2, 1, False, 0)),
        (((0, 1, 2, 3),), 2, GroupShape(1, 4, True, 1)),
    ],
)
def test_group_shape(groups, per_host, expected):
    assert group_shape_of(groups, per_host) == expected


def test_group_shape_rejects_uneven_groups():
    with pytest.raises(ValueError, match="one size"):
        group_shape_of(((0, 1), (2,)), 4)


def test_bandwidth_factor():
    assert bandwidth_factor("all_reduce", 4) == 1.5
    assert bandwidth_factor("all_gather", 8) == bandwidth_factor("reduce_scatter", 8)
    assert bandwidth_factor("all_to_all", 4) == 3 / 16


def _alpa_monotonic(sizes: np.ndarray, times: np.ndarray) -> np.ndarray:
    """What Alpa's make_monotonic does: time = size / (best bandwidth so far)."""
    out, best = times.copy(), 0.0
    for i, (size, time) in enumerate(zip(sizes, times, strict=True)):
        best = max(best, size / time if time > 0 and np.isfinite(time) else 0.0)
        if size > 0 and best > 0:
            out[i] = size / best
    return out


def _fake_database() -> dict:
    """A 1x4 mesh: an all-gather over 4 devices timed like Alpa's profiler
    (no-op below 4 elements, make_monotonic applied), two inf and a nan."""
    sizes = np.concatenate([[0.0], 2.0 ** np.arange(21)])  # elements
    true = 5e-4 + 2e-10 * sizes * 2  # f16 bytes
    times = np.where(sizes < 4, 1.7e-5, true)  # Alpa ran no collective there
    times = _alpa_monotonic(sizes, times)
    times[[10, 15]] = np.inf
    times[12] = np.nan
    all_gather = {(((0, 1, 2, 3),), "f16"): list(zip(sizes, times, strict=True))}
    return {("default", (1, 4)): MeshProfilingResult(all_gather_cost_dict=all_gather)}


def test_skipped_points_are_counted_and_do_not_bias_the_fit():
    (series,) = comm_series(_fake_database())
    counts = np.bincount(series.kind, minlength=4)
    assert counts[INVALID] == 3
    assert counts[NO_OP] == 3  # sizes 0, 1, 2 elements
    # 4..32 elements: slower than the no-op's 2 elements / 17 us, so clamped to it
    assert counts[ARTIFACT] == 4
    assert series.used.sum() == 22 - 10
    params, regimes = fit_alpha_beta(series.num_bytes, series.seconds, series.used)
    assert regimes == 1
    np.testing.assert_allclose([params.alpha, params.beta], [5e-4, 2e-10], rtol=1e-6)
    (kept,) = comm_series(_fake_database(), config=CommFitConfig(drop_no_op=False))
    assert kept.used.sum() == 22 - 3  # only inf/nan left out


def test_report_counts_on_fake_database():
    (row,) = comm_report(_fake_database(), num_folds=4)
    assert (row.num_points, row.num_used, row.num_skipped) == (22, 12, 10)
    assert (row.num_invalid, row.num_no_op, row.num_artifact) == (3, 3, 4)
    assert row.key == CommKey(
        "all_gather", "default", (1, 4), GroupShape(1, 4, False, 1), "f16"
    )
    np.testing.assert_allclose(row.bandwidth_gbps, 5.0, rtol=1e-6)
    assert row.mape < 1e-9 and row.cv_mape < 1e-9 and row.r2_linear > 1 - 1e-12


def _toy_model() -> CommModel:
    """all_reduce curves of group sizes 1, 2 and 8 on a 1x8 mesh (float32)."""
    shapes = [GroupShape(8, 1, False, 0), GroupShape(4, 2, False, 1)]
    shapes.append(GroupShape(1, 8, False, 1))
    keys = tuple(CommKey("all_reduce", "default", (1, 8), s, "f16") for s in shapes)
    params = AlphaBeta(
        floor=jnp.array([2e-5, 0.0, 0.0]),
        alpha=jnp.array([1e-5, 5e-5, 2e-4]),
        beta=jnp.array([2.5e-12, 5e-11, 1e-11]),
        alpha_mid=jnp.array([1e-5, 5e-5, 2e-4]),
        beta_mid=jnp.array([2.5e-12, 5e-11, 1e-11]),
    )
    return CommModel(keys=keys, params=params)


def _row_time(model: CommModel, index: int, num_bytes) -> np.ndarray:
    row = AlphaBeta(*(np.asarray(p, np.float64)[index] for p in model.params))
    return _times(row, np.asarray(num_bytes, np.float64))


def test_fallback_rule():
    model = _toy_model()
    b = np.array([1e3, 1e6, 1e9])

    def predict(num_devices):
        return np.asarray(model.predict_collective("all_reduce", num_devices, b))

    # exact sizes: their own curve (the copy curve only for one device)
    np.testing.assert_allclose(predict(1), _row_time(model, 0, b), rtol=1e-6)
    np.testing.assert_allclose(predict(2), _row_time(model, 1, b), rtol=1e-6)
    # between sizes 2 and 8: geometric interpolation in log(group size)
    geometric = np.sqrt(_row_time(model, 1, b) * _row_time(model, 2, b))
    np.testing.assert_allclose(predict(4), geometric, rtol=1e-5)
    assert model.fallback("all_reduce", 4).weights == pytest.approx((0.5, 0.5))
    # beyond the largest size: its curve, payload scaled by the ring factor
    scale = bandwidth_factor("all_reduce", 16) / bandwidth_factor("all_reduce", 8)
    np.testing.assert_allclose(predict(16), _row_time(model, 2, b * scale), rtol=1e-5)
    with pytest.raises(ValueError, match="num_devices"):
        model.predict_collective("all_reduce", 0, b)
    with pytest.raises(ValueError, match="no fitted curve"):
        model.predict_collective("all_to_all", 2, b)


def test_predict_is_jittable_and_differentiable(caplog):
    model = _toy_model()

    def time(num_bytes):
        return model.predict("all_reduce", (1, 8), (1, 8), "f16", num_bytes)

    np.testing.assert_allclose(time(1e9), 2e-4 + 1e-2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(time)(1e9), 1e-11, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(time)(1e9), time(1e9), rtol=1e-6)
    jitted = jax.jit(lambda m, b: m.predict("all_reduce", (1, 8), (4, 2), "f16", b))
    batch = jnp.array([1e3, 1e6, 1e9])
    np.testing.assert_allclose(jitted(model, batch), 5e-5 + 5e-11 * batch, rtol=1e-6)

    # one compiled predictor for every curve: the index is traced
    def compiles_of_predict_row(call) -> int:
        with caplog.at_level(logging.WARNING), jax.log_compiles():
            caplog.clear()
            call()
        return sum(
            "Compiling jit(_predict_row)" in r.getMessage() for r in caplog.records
        )

    assert (
        compiles_of_predict_row(
            lambda: model.predict("all_reduce", (1, 8), (8, 1), "f16", 1e6)
        )
        == 0
    )
    # the check sees a compilation: new argument shapes do compile
    assert (
        compiles_of_predict_row(
            lambda: model.predict("all_reduce", (1, 8), (8, 1), "f16", jnp.ones(7))
        )
        == 1
    )
    grad = jax.grad(lambda b: model.predict_collective("all_reduce", 4, b))(1e9)
    assert np.isfinite(grad) and grad > 0
    mixed = jax.jit(lambda m, b: m.predict_collective("all_reduce", 4, b))
    np.testing.assert_allclose(
        mixed(model, batch), model.predict_collective("all_reduce", 4, batch), rtol=1e-6
    )


def test_predict_needs_one_matching_curve():
    model = _toy_model()
    with pytest.raises(ValueError, match="exactly one"):
        model.predict("all_reduce", (1, 8), (2, 4), "f16", 1.0)
    with pytest.raises(ValueError, match="collective"):
        model.predict("broadcast", (1, 8), (1, 8), "f16", 1.0)


@pytest.fixture(scope="module")
def rows():
    return comm_report(PROF_DB)


def test_real_database_every_fit_listed(rows):
    database = read_prof_database(PROF_DB)
    expected = {
        (collective, mesh, group_shape_of(groups, mesh[1]), dtype)
        for (_, mesh), result in database.items()
        for collective in COLLECTIVES
        for groups, dtype in getattr(result, f"{collective}_cost_dict")
    }
    listed = {(r.collective, r.mesh, r.key.group, r.dtype) for r in rows}
    assert len(rows) == len(listed) == len(expected) == 248
    assert listed == expected
    assert sum(r.num_invalid for r in rows) == 65
    for row in rows:
        finite = [row.alpha_s, row.beta_s_per_byte, row.floor_s, row.cv_mape]
        if row.num_invalid == row.num_points:  # the failed 4x8 all-reduce batch
            assert row.num_used == 0 and math.isnan(row.alpha_s)
        else:
            assert all(map(math.isfinite, finite)) and row.beta_s_per_byte > 0


def test_real_database_fit_quality(rows):
    summary = summarize(rows)
    # measured: median held-out MAPE 2.7%, 97% of fits <= 10%; R^2 >= 0.99 on 95%
    assert summary["median_cv_mape"] < 0.04
    assert summary["fraction_cv_mape_within_target"] > 0.93
    assert summary["median_r2_linear"] > 0.999
    assert summary["fraction_r2_linear_within_target"] > 0.9
    assert summary["worst_cv_mape"]["cv_mape"] < 0.25


def test_real_database_model_matches_report(rows):
    model = fit_comm_model(PROF_DB)
    fitted = [r for r in rows if r.regimes > 0]
    assert len(fitted) == len(rows) - 2  # the all-inf 4x8 all-reduce curves
    assert list(model.keys) == [r.key for r in fitted]
    for row in rows[::17]:
        if not math.isfinite(row.alpha_s):
            continue
        b = np.array([1e2, 1e5, 1e8])
        params = AlphaBeta(
            row.floor_s,
            row.alpha_s,
            row.beta_s_per_byte,
            row.alpha_mid_s,
            row.beta_mid_s_per_byte,
        )
        got = model.predict(row.collective, row.mesh, row.key.group, row.dtype, b)
        np.testing.assert_allclose(got, _times(params, b), rtol=1e-5)


def test_table_and_json(rows):
    table = format_table(rows)
    legend = textwrap.wrap(TABLE_LEGEND, width=len(table.splitlines()[0]))
    assert len(table.splitlines()) == len(rows) + 6 + len(legend)  # blank lines
    assert "stride = device-id step" in " ".join(table.split())
    assert "held-out median MAPE" in table
    dicts = rows_to_dicts(rows)
    json.dumps(dicts, allow_nan=False)
    json.dumps(summarize(rows), allow_nan=False)
    assert dicts[0]["mesh"] == list(rows[0].mesh)


def test_plot_fits_writes_pngs(tmp_path):
    database = _fake_database()
    paths = plot_fits(database, comm_report(database, num_folds=4), tmp_path / "out")
    assert [p.name for p in paths] == ["comm_default_1x4.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_on_a_curve_without_fit():
    database = _fake_database()
    ((key, points),) = database["default", (1, 4)].all_gather_cost_dict.items()
    failed = {key: [(size, np.inf) for size, _ in points]}
    database = {("default", (1, 4)): MeshProfilingResult(all_gather_cost_dict=failed)}
    (row,) = comm_report(database, num_folds=4)
    assert (row.regimes, row.num_used, row.num_invalid) == (0, 0, 22)
    assert math.isnan(row.alpha_s) and math.isnan(row.cv_mape)
    summary = summarize([row])
    assert summary["num_without_fit"] == 1 and summary["median_cv_mape"] is None
    assert "n/a" in format_table([row])
    assert fit_comm_model(database).keys == ()


def test_table_rows_are_labelled_uniquely(rows):
    """Two curves differing only in their group's device stride (2x2 groups of
    devices (0,1),(2,3) vs (0,2),(1,3)) used to print the same label."""
    labels = [line.split()[:6] for line in format_table(rows).splitlines()[2:250]]
    assert len(labels) == len(rows) == len({tuple(label) for label in labels})
    header = format_table(rows).splitlines()[0].split()
    assert header[:6] == ["collective", "mesh", "groups", "stride", "X", "dt"]


def test_folds_are_capped_at_the_points_of_a_curve(monkeypatch):
    """k beyond a curve's used points assigns the same folds (leave-one-out);
    the fit must not run thousands of empty folds."""
    from pipedejavu.costmodel.alpa import comm_fit

    seen = []
    real = comm_fit._held_out_batch

    def spy(*args, num_folds, **kwargs):
        seen.append(num_folds)
        return real(*args, num_folds=num_folds, **kwargs)

    monkeypatch.setattr(comm_fit, "_held_out_batch", spy)
    (capped,) = comm_report(_fake_database(), num_folds=10_000)
    (exact,) = comm_report(_fake_database(), num_folds=12)  # 12 used points
    assert seen == [12, 12]
    assert capped.cv_mape == exact.cv_mape and capped.cv_max_ape == exact.cv_max_ape


def test_bundled_database_by_name():
    bundled = read_prof_database("bundled")
    assert bundled.keys() == read_prof_database(PROF_DB).keys()
