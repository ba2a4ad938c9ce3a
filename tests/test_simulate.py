"""The pipeline simulator against closed forms, hand-computed schedules and
invariants; the Gantt chart drawn from it."""

from __future__ import annotations

import time
from itertools import pairwise

import numpy as np
import pytest

from pipedejavu import Plan, PlanError
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.alpa.exact import exact_dp
from pipedejavu.simulation.simulate import (
    alpa_formula,
    command_order,
    gpipe_formula,
    run_events,
    run_fixed_order,
    simulate,
    simulate_plan,
    split_latencies,
    transfer_aware_formula,
)

SCHEDULES = ("gpipe", "1f1b")


def random_stages(rng, num_stages, *, links=False):
    forward = rng.uniform(0.1, 2.0, num_stages)
    backward = rng.uniform(0.1, 3.0, num_stages)
    if not links:
        return forward, backward
    transfer = rng.uniform(0.0, 2.0, num_stages - 1)
    transfer[rng.random(num_stages - 1) < 0.25] = 0.0  # some free links
    return forward, backward, transfer


# Closed forms ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_microbatches", [1, 3, 8])
def test_one_stage_runs_back_to_back(schedule, num_microbatches):
    result = simulate([0.5], [1.25], num_microbatches, schedule=schedule)
    np.testing.assert_allclose(result.iteration_time, num_microbatches * 1.75)
    np.testing.assert_allclose(result.idle_fraction, [0.0], atol=1e-12)
    assert [e.kind for e in result.stage_events[0]].count("F") == num_microbatches
    assert result.link_events == ()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 7])
def test_equal_stages_take_s_plus_b_minus_one_slots(
    schedule, num_stages, num_microbatches
):
    forward, backward = 0.75, 1.5
    result = simulate(
        [forward] * num_stages,
        [backward] * num_stages,
        num_microbatches,
        schedule=schedule,
    )
    expected = (num_stages + num_microbatches - 1) * (forward + backward)
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)
    alpa = alpa_formula([forward + backward] * num_stages, num_microbatches)
    np.testing.assert_allclose(result.iteration_time, alpa, rtol=1e-12)
    # The bubble: every stage idles (S - 1) slots of S + B - 1.
    np.testing.assert_allclose(
        result.idle_fraction,
        (num_stages - 1) / (num_stages + num_microbatches - 1),
        atol=1e-12,
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(5))
def test_single_microbatch_is_the_critical_path(schedule, seed):
    rng = np.random.default_rng(seed)
    forward, backward, transfer = random_stages(rng, 4, links=True)
    result = simulate(forward, backward, 1, schedule=schedule, transfer=transfer)
    expected = forward.sum() + backward.sum() + 2 * transfer.sum()
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)


@pytest.mark.parametrize("num_stages", [1, 2, 4, 6])
@pytest.mark.parametrize("num_microbatches", [1, 3, 4, 9])
def test_peak_in_flight_and_memory(num_stages, num_microbatches):
    memory = np.arange(1, num_stages + 1) * 1e9
    stages = np.arange(num_stages)
    one_f_one_b = simulate(
        [1.0] * num_stages,
        [2.0] * num_stages,
        num_microbatches,
        memory_per_microbatch=memory,
    )
    expected = np.minimum(num_stages - stages, num_microbatches)
    np.testing.assert_array_equal(one_f_one_b.peak_in_flight, expected)
    np.testing.assert_allclose(one_f_one_b.peak_memory, expected * memory)
    gpipe = simulate(
        [1.0] * num_stages, [2.0] * num_stages, num_microbatches, schedule="gpipe"
    )
    np.testing.assert_array_equal(gpipe.peak_in_flight, num_microbatches)
    assert gpipe.peak_memory is None


@pytest.mark.parametrize("seed", range(20))
def test_gpipe_closed_form_with_links(seed):
    rng = np.random.default_rng(seed)
    num_stages = int(rng.integers(1, 7))
    num_microbatches = int(rng.integers(1, 10))
    forward, backward, transfer = random_stages(rng, num_stages, links=True)
    result = simulate(
        forward, backward, num_microbatches, schedule="gpipe", transfer=transfer
    )
    expected = gpipe_formula(forward, backward, num_microbatches, transfer)
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)


# Alpa's formula: where it agrees and where it does not ------------------------


def test_alpa_formula_is_problem_objective():
    np.testing.assert_allclose(alpa_formula([3.0, 1.0, 2.0], 4), 6.0 + 3 * 3.0)


def test_below_alpa_slow_first_stage():
    # f = (2, 1), b = (4, 2) (a common backward ratio of 2), B = 2. 1F1B:
    # stage 0: F0 0-2, F1 2-4; stage 1: F0 2-3, B0 3-5, F1 5-6, B1 6-8;
    # stage 0: B0 5-9 (gradient at 5), B1 9-13. Alpa: (6 + 3) + 1 * 6 = 15.
    forward, backward = [2.0, 1.0], [4.0, 2.0]
    one_f_one_b = simulate(forward, backward, 2)
    np.testing.assert_allclose(one_f_one_b.iteration_time, 13.0)
    np.testing.assert_allclose(one_f_one_b.backward_end[0], [9.0, 13.0])
    np.testing.assert_allclose(one_f_one_b.forward_start[1], [2.0, 5.0])
    np.testing.assert_allclose(alpa_formula([6.0, 3.0], 2), 15.0)
    # GPipe: stage 1 backwards 5-7, 7-9; stage 0 backwards 7-11, 11-15.
    gpipe = simulate(forward, backward, 2, schedule="gpipe")
    np.testing.assert_allclose(gpipe.iteration_time, 15.0)


def test_above_alpa_when_backward_ratios_differ():
    # 1F1B, f = (1, 4, 1), b = (4, 1, 1), B = 2: stage 0 F 0-1, 1-2; stage 1
    # F 1-5, 5-9; stage 2 F0 5-6, B0 6-7, F1 9-10, B1 10-11; stage 1 B 9-10,
    # 11-12; stage 0 B 10-14, 14-18. Alpa: 12 + 1 * 5 = 17.
    result = simulate([1.0, 4.0, 1.0], [4.0, 1.0, 1.0], 2)
    np.testing.assert_allclose(result.iteration_time, 18.0)
    np.testing.assert_allclose(result.backward_start[1], [9.0, 11.0])
    np.testing.assert_allclose(alpa_formula([5.0, 5.0, 2.0], 2), 17.0)
    # GPipe, f = (1, 4), b = (4, 1), B = 2: stage 1 F 1-5, 5-9, B 9-10, 10-11;
    # stage 0 B 10-14, 14-18 against Alpa's 10 + 5 = 15: (B - 1)(max f + max b).
    gpipe = simulate([1.0, 4.0], [4.0, 1.0], 2, schedule="gpipe")
    np.testing.assert_allclose(gpipe.iteration_time, 18.0)
    np.testing.assert_allclose(alpa_formula([5.0, 5.0], 2), 15.0)


@pytest.mark.parametrize("seed", range(40))
def test_common_backward_ratio_never_exceeds_alpa(seed):
    rng = np.random.default_rng(seed)
    num_stages = int(rng.integers(2, 8))
    num_microbatches = int(rng.integers(1, 13))
    latencies = rng.uniform(0.1, 3.0, num_stages)
    forward, backward = split_latencies(latencies, rng.uniform(0.5, 3.0))
    alpa = alpa_formula(latencies, num_microbatches)
    gpipe = simulate(forward, backward, num_microbatches, schedule="gpipe")
    np.testing.assert_allclose(gpipe.iteration_time, alpa, rtol=1e-12)
    one_f_one_b = simulate(forward, backward, num_microbatches)
    assert one_f_one_b.iteration_time <= alpa * (1 + 1e-12)


# Links ----------------------------------------------------------------------


def test_two_stage_transfer_adds_its_delays():
    # B = 1: F0 0-1, activation 1-1.5, F1 1.5-3.5, B1 3.5-6.5, gradient 6.5-7,
    # B0 7-9.
    result = simulate([1.0, 2.0], [2.0, 3.0], 1, transfer=[0.5])
    np.testing.assert_allclose(result.iteration_time, 9.0)
    np.testing.assert_allclose(result.forward_start[:, 0], [0.0, 1.5])
    np.testing.assert_allclose(result.backward_start[:, 0], [7.0, 3.5])
    assert result.link_events == ((("T", 0, 1.0, 1.5, "F"), ("T", 0, 6.5, 7.0, "B")),)
    free = simulate([1.0, 2.0], [2.0, 3.0], 1)
    np.testing.assert_allclose(result.iteration_time - free.iteration_time, 1.0)


def test_one_f_one_b_with_a_slow_link_by_hand():
    # f = 1, b = 2, x = 3, B = 2 over one half-duplex link: a0 1-4, a1 4-7;
    # stage 1 F0 4-5, B0 5-7, g0 7-10, F1 7-8, B1 8-10, g1 10-13; stage 0 B0
    # 10-12, B1 13-15. The link never idles from 1 to 13: f_0 + 2 B x + b_0.
    result = simulate([1.0, 1.0], [2.0, 2.0], 2, transfer=[3.0])
    np.testing.assert_allclose(result.iteration_time, 15.0)
    spans = [(e.start, e.end, e.direction) for e in result.link_events[0]]
    assert spans == [
        (1.0, 4.0, "F"),
        (4.0, 7.0, "F"),
        (7.0, 10.0, "B"),
        (10.0, 13.0, "B"),
    ]
    # The round-trip formula charges both stages' f + b on the critical path.
    np.testing.assert_allclose(transfer_aware_formula([3.0, 3.0], [6.0], 2), 18.0)


@pytest.mark.parametrize("num_microbatches", [2, 4, 6, 10])
@pytest.mark.parametrize("transfer", [3.0, 4.5])
def test_one_f_one_b_two_stages_follows_the_link(num_microbatches, transfer):
    # Two stages, even B, x >= f + b at both: the link alternates two
    # activations and two gradients without idling.
    forward, backward = [1.0, 0.5], [2.0, 1.0]
    result = simulate(forward, backward, num_microbatches, transfer=[transfer])
    expected = forward[0] + 2 * num_microbatches * transfer + backward[0]
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)


@pytest.mark.parametrize("num_stages", [2, 3, 5])
@pytest.mark.parametrize("num_microbatches", [1, 2, 5, 8])
def test_gpipe_follows_a_bottleneck_link(num_stages, num_microbatches):
    forward, backward, transfer = 1.0, 2.0, 2.5  # transfer >= max(f, b)
    result = simulate(
        [forward] * num_stages,
        [backward] * num_stages,
        num_microbatches,
        schedule="gpipe",
        transfer=[transfer] * (num_stages - 1),
    )
    expected = (
        num_stages * (forward + backward)
        + 2 * (num_stages + num_microbatches - 2) * transfer
    )
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)
    formula = transfer_aware_formula(
        [forward + backward] * num_stages,
        [2 * transfer] * (num_stages - 1),
        num_microbatches,
    )
    np.testing.assert_allclose(result.iteration_time, formula, rtol=1e-12)


def test_one_f_one_b_can_exceed_the_transfer_aware_formula():
    # S = 3, f = 1, b = 2, x = 3, B = 4 (traced by hand in the module docstring's
    # terms: stage 0 holds 3 micro-batches, the links idle waiting for its
    # fourth forward): the last gradient reaches stage 0 at 40, B(0, 3) ends 42.
    result = simulate([1.0] * 3, [2.0] * 3, 4, transfer=[3.0, 3.0])
    np.testing.assert_allclose(result.iteration_time, 42.0)
    np.testing.assert_allclose(result.backward_start[0], [19.0, 22.0, 31.0, 40.0])
    np.testing.assert_allclose(result.forward_start[0, 3], 21.0)
    formula = transfer_aware_formula([3.0] * 3, [6.0, 6.0], 4)
    np.testing.assert_allclose(formula, 39.0)


def test_link_tie_goes_to_the_gradient():
    # f = (1, 1), b = (1, 2), x = 1, B = 3: at t = 8 stage 1 ends B(1, 1) and
    # stage 0 ends F(0, 2); the gradient crosses 8-9, the activation 9-10.
    result = simulate([1.0, 1.0], [1.0, 2.0], 3, transfer=[1.0])
    np.testing.assert_allclose(result.gradient_start[0, 1], 8.0)
    np.testing.assert_allclose(result.activation_start[0, 2], 9.0)
    np.testing.assert_allclose(result.iteration_time, 15.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(15))
def test_schedule_invariants_with_links(schedule, seed):
    rng = np.random.default_rng(100 + seed)
    num_stages = int(rng.integers(1, 6))
    count = int(rng.integers(1, 8))
    forward, backward, transfer = random_stages(rng, num_stages, links=True)
    r = simulate(forward, backward, count, schedule=schedule, transfer=transfer)
    tol = 1e-9
    np.testing.assert_allclose(
        r.forward_end - r.forward_start, np.tile(forward, (count, 1)).T
    )
    np.testing.assert_allclose(
        r.backward_end - r.backward_start, np.tile(backward, (count, 1)).T
    )
    for s in range(num_stages):
        events = r.stage_events[s]
        assert len(events) == 2 * count
        kinds = [(e.kind, e.microbatch) for e in events]
        assert kinds == [
            ("F", c) if c < count else ("B", c - count)
            for c in command_order(schedule, s, num_stages, count)
        ]
        assert all(a.end <= b.start + tol for a, b in pairwise(events))
        assert (r.backward_start[s] >= r.forward_end[s] - tol).all()
    for link in range(num_stages - 1):
        if transfer[link] == 0:
            assert r.link_events[link] == ()
            arrive_f, arrive_b = r.forward_end[link], r.backward_end[link + 1]
        else:
            events = r.link_events[link]
            assert len(events) == 2 * count
            assert all(a.end <= b.start + tol for a, b in pairwise(events))
            assert (r.activation_start[link] >= r.forward_end[link] - tol).all()
            assert (r.gradient_start[link] >= r.backward_end[link + 1] - tol).all()
            arrive_f, arrive_b = r.activation_end[link], r.gradient_end[link]
        assert (r.forward_start[link + 1] >= arrive_f - tol).all()
        assert (r.backward_start[link] >= arrive_b - tol).all()
    # Lower bounds: one micro-batch's critical path; each link's 2 B transfers.
    path = forward.sum() + backward.sum() + 2 * transfer.sum()
    assert r.iteration_time >= path - tol
    for link in range(num_stages - 1):
        ahead = forward[: link + 1].sum() + backward[: link + 1].sum()
        assert r.iteration_time >= ahead + 2 * count * transfer[link] - tol
    np.testing.assert_allclose(r.busy_time, count * (forward + backward))
    np.testing.assert_allclose(r.idle_fraction, 1 - r.busy_time / r.iteration_time)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(10))
def test_event_engine_matches_fixed_order_engine(schedule, seed):
    rng = np.random.default_rng(200 + seed)
    num_stages = int(rng.integers(1, 7))
    count = int(rng.integers(1, 9))
    forward, backward = (x.tolist() for x in random_stages(rng, num_stages))
    orders = [command_order(schedule, s, num_stages, count) for s in range(num_stages)]
    fixed = run_fixed_order(forward, backward, orders, count)
    events = run_events(forward, backward, [0.0] * (num_stages - 1), orders, count)
    for a, b in zip(fixed, events, strict=True):
        np.testing.assert_allclose(np.array(a, float), np.array(b, float))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("links", [False, True])
def test_sixty_four_stages_256_microbatches_is_fast(schedule, links):
    rng = np.random.default_rng(7)
    arrays = random_stages(rng, 64, links=links)
    simulate(*arrays[:2], 4, schedule=schedule)  # warm caches
    start = time.process_time()
    result = simulate(
        *arrays[:2], 256, schedule=schedule, transfer=arrays[2] if links else None
    )
    elapsed = time.process_time() - start
    assert elapsed < 0.5, f"simulate took {elapsed:.3f} s of CPU at S=64, B=256"
    slowest = (arrays[0] + arrays[1]).max()
    assert result.iteration_time >= 256 * slowest
    if schedule == "gpipe":
        expected = gpipe_formula(*arrays[:2], 256, arrays[2] if links else None)
        np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)


# Problem and plan -------------------------------------------------------------


def test_simulate_plan_splits_the_table_latencies():
    problem = random_problem(12, (1, 8), num_microbatches=6, seed=3)
    plan = exact_dp(problem)
    latencies = np.array([stage.latency for stage in plan.stages])
    result = simulate_plan(problem, plan)
    np.testing.assert_allclose(result.forward, latencies / 3, rtol=1e-12)
    np.testing.assert_allclose(result.backward, 2 * latencies / 3, rtol=1e-12)
    gpipe = simulate_plan(problem, plan, schedule="gpipe", backward_ratio=1.0)
    np.testing.assert_allclose(gpipe.forward, latencies / 2, rtol=1e-12)
    np.testing.assert_allclose(gpipe.iteration_time, plan.cost, rtol=1e-12)
    assert result.iteration_time <= plan.cost * (1 + 1e-12)
    assert simulate_plan(problem, plan, num_microbatches=1).num_microbatches == 1
    broken = Plan(plan.stages[:-1], plan.cost, 6, "broken")
    with pytest.raises(PlanError, match="coverage"):
        simulate_plan(problem, broken)


# Validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward": [1.0, -1.0]}, r"forward must be finite and >= 0, got -1.0 at"),
        ({"backward": [1.0, np.nan]}, r"backward must be finite and >= 0"),
        ({"backward": [1.0]}, r"backward must have shape \(2,\), got \(1,\)"),
        ({"forward": [[1.0, 1.0]]}, r"forward must have shape \(S,\), got \(1, 2\)"),
        ({"forward": []}, r"at least one stage"),
        ({"forward": ["a", "b"]}, r"forward must be numeric"),
        ({"transfer": [1.0, 1.0]}, r"transfer must have shape \(1,\), got \(2,\)"),
        ({"transfer": [-0.5]}, r"transfer must be finite and >= 0"),
        ({"memory_per_microbatch": [1.0]}, r"memory_per_microbatch must have shape"),
        (
            {"schedule": "zb"},
            r"schedule must be one of \('gpipe', '1f1b', 'deepspeed'\), got 'zb'",
        ),
        ({"num_microbatches": 0}, r"num_microbatches must be >= 1, got 0"),
        ({"num_microbatches": 2.0}, r"num_microbatches must be an int, got 2.0"),
        ({"num_microbatches": True}, r"num_microbatches must be an int"),
    ],
)
def test_validation_errors(kwargs, match):
    args = {"forward": [1.0, 1.0], "backward": [2.0, 2.0], "num_microbatches": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate(**args)


def test_formula_validation():
    with pytest.raises(ValueError, match=r"transfers must have S - 1 = 2 entries"):
        transfer_aware_formula([1.0, 2.0, 3.0], [1.0], 2)
    with pytest.raises(ValueError, match=r"backward_ratio must be finite and >= 0"):
        split_latencies([1.0], -1.0)
    np.testing.assert_allclose(transfer_aware_formula([1.0, 2.0], [0.0], 3), 7.0)
    np.testing.assert_allclose(transfer_aware_formula([1.0, 2.0], [5.0], 3), 18.0)


# Gantt ----------------------------------------------------------------------


def _pixels_of(image, hex_color, tol=0.02):
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tol).sum())


@pytest.mark.parametrize("links", [False, True])
def test_plot_gantt_writes_a_chart(tmp_path, links):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from pipedejavu.planning.plots import _COLORS, plot_gantt

    result = simulate(
        [1.0, 1.5, 1.0],
        [2.0, 3.0, 2.0],
        4,
        transfer=[0.5, 0.8] if links else None,
    )
    path = plot_gantt(result, tmp_path / "gantt.png")
    assert path.exists() and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 800
    assert _pixels_of(image, _COLORS["F"]) > 500
    assert _pixels_of(image, _COLORS["B"]) > 500
    for kind in ("TF", "TB"):
        assert (_pixels_of(image, _COLORS[kind]) > 100) == links
