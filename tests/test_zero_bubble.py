"""The ZB-H1 zero-bubble schedule: its command order against hand-written ones,
its iteration time against the closed form and against 1F1B, and its memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.simulation.interleaved import Op, simulate_interleaved
from pipedejavu.simulation.zero_bubble import (
    simulate_zero_bubble,
    zero_bubble_in_flight,
    zero_bubble_order,
)


def F(b):  # noqa: N802 - the paper's notation
    return Op(False, 0, b)


def B(b):  # noqa: N802
    return Op(True, 0, b)


def W(b):  # noqa: N802
    return Op(True, 0, b, True)


def test_orders_by_hand():
    # P = 3, M = 4. Rank 0: two warm-up forwards, W right after each B.
    assert zero_bubble_order(0, 3, 4) == [
        F(0), F(1), F(2), B(0), W(0), F(3), B(1), W(1), B(2), W(2), B(3), W(3)
    ]  # fmt: skip
    # Rank 2 (last): no warm-up; keeps two W passes pending for the cool-down.
    assert zero_bubble_order(2, 3, 4) == [
        F(0), B(0), F(1), B(1), F(2), B(2), W(0), F(3), B(3), W(1), W(2), W(3)
    ]  # fmt: skip


@given(st.integers(1, 7), st.integers(1, 20))
def test_every_command_once_and_after_its_dependencies(ranks, count):
    for r in range(ranks):
        order = zero_bubble_order(r, ranks, count)
        assert sorted(order) == sorted(
            [F(b) for b in range(count)]
            + [B(b) for b in range(count)]
            + [W(b) for b in range(count)]
        )
        position = {op: i for i, op in enumerate(order)}
        for b in range(count):
            assert position[F(b)] < position[B(b)] < position[W(b)]
            if b:
                assert position[W(b - 1)] < position[W(b)]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(0, 12),
    st.floats(0.1, 3.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_closed_form_with_equal_stages(ranks, extra, f, share_w, share_b):
    # The closed form's regime: w <= f and w <= b <= w + f (the paper's
    # F = B = W among them); outside it, e.g. w > b, the last rank's pending W
    # passes or gaps in the steady state add to it (found by this test).
    count = ranks + extra
    w = share_w * f
    b = w + share_b * f
    result = simulate_zero_bubble([f] * ranks, [b] * ranks, [w] * ranks, count)
    expected = count * (f + b + w) + (ranks - 1) * (f + b - w)
    assert result.iteration_time == pytest.approx(expected, rel=1e-12)
    # 1F1B with the backward whole has a bubble 2 (P - 1) w longer.
    whole = simulate_interleaved([[f]] * ranks, [[b + w]] * ranks, count)
    assert whole.iteration_time - result.iteration_time == pytest.approx(
        2 * (ranks - 1) * w, rel=1e-9, abs=1e-9
    )
    assert np.all(result.peak_in_flight == min(ranks, count))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 12))
def test_without_weight_passes_it_is_1f1b(data, ranks, count):
    times = st.lists(st.floats(0.0, 4.0), min_size=ranks, max_size=ranks)
    f, b = data.draw(times), data.draw(times)
    links = data.draw(st.lists(st.floats(0.0, 2.0), min_size=ranks, max_size=ranks))
    links[-1] = 0.0  # the wrap-around link is unused with one chunk
    zb = simulate_zero_bubble(f, b, [0.0] * ranks, count, transfer=links[:-1])
    one = simulate_interleaved(
        np.array(f)[:, None], np.array(b)[:, None], count, transfer=links
    )
    assert zb.iteration_time == pytest.approx(one.iteration_time, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(zb.input_grad_end, one.backward_end[:, 0, :])


def test_transfers_delay_and_memory_counts_until_w():
    free = simulate_zero_bubble([1.0, 1.0], [1.0, 1.0], [0.5, 0.5], 4)
    slow = simulate_zero_bubble(
        [1.0, 1.0],
        [1.0, 1.0],
        [0.5, 0.5],
        4,
        transfer=[0.25],
        memory_per_microbatch=[10.0, 3.0],
    )
    assert slow.iteration_time > free.iteration_time
    np.testing.assert_array_equal(slow.peak_in_flight, [2, 2])
    np.testing.assert_array_equal(slow.peak_memory, [20.0, 6.0])
    np.testing.assert_allclose(slow.busy_time, [10.0, 10.0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0], [1.0], [1.0], 0), "num_microbatches must be >= 1"),
        (([1.0], [1.0, 2.0], [1.0], 2), "input_grad must have shape"),
        (([1.0], [1.0], [-1.0], 2), "weight_grad must be finite and >= 0"),
        (([[1.0]], [1.0], [1.0], 2), "forward must have shape"),
    ],
)
def test_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        simulate_zero_bubble(*args)
    with pytest.raises(ValueError, match="rank must be in"):
        zero_bubble_order(3, 3, 2)


def test_in_flight_count_is_the_orders_peak_on_every_rank():
    # What the planning tables hold a ZB-H1 stage to (min(P, M)), read off
    # the command order: +1 at each forward, -1 at each W.
    for ranks in range(1, 9):
        for count in range(1, 20):
            for rank in range(ranks):
                held = peak = 0
                for op in zero_bubble_order(rank, ranks, count):
                    held += 1 if not op.backward else -1 if op.weight else 0
                    peak = max(peak, held)
                assert peak == zero_bubble_in_flight(ranks, count)
