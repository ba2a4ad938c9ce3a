"""The ZB-H1 zero-bubble schedule: its command order against hand-written ones,
its iteration time against the closed form and against 1F1B, and its memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.simulation.interleaved import Op, simulate_interleaved
from pipedejavu.simulation.zero_bubble import (
    held_by_order,
    simulate_zero_bubble,
    zbv_order,
    zero_bubble_in_flight,
    zero_bubble_order,
    zero_bubble_warmup,
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
        (([[[1.0]]], [1.0], [1.0], 2), "forward must have shape"),
        (([[1.0]], [1.0], [1.0], 2), "input_grad must have shape"),
        (([[1.0]] * 2, [[1.0]] * 2, [[1.0]] * 2, 2), None),
        (([[1.0, 1.0]] * 2, [[1.0, 1.0]] * 2, [[1.0, 1.0]] * 2, 3), "a multiple"),
    ],
)
def test_bad_input(args, message):
    if message is None:  # 2-D times with one chunk: ZB-H1 itself
        two = simulate_zero_bubble(*args, transfer=[0.5, 0.0])
        one = simulate_zero_bubble([1.0] * 2, [1.0] * 2, [1.0] * 2, 2, transfer=[0.5])
        assert two.iteration_time == one.iteration_time
        np.testing.assert_array_equal(two.forward_end[:, 0, :], one.forward_end)
        return
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


# ---- the interleaved form: V model chunks per rank -------------------------


def test_interleaved_orders_by_hand():
    # P = 2, V = 2, M = 2. Rank 1: one warm-up forward per chunk beyond the
    # first (P of them), none for its distance to the end; its first B is
    # chunk 1's (the last virtual stage), and it keeps one W pending.
    f = [Op(False, c, b) for c, b in ((0, 0), (0, 1), (1, 0), (1, 1))]
    b = [Op(True, c, m) for c, m in ((1, 0), (1, 1), (0, 0), (0, 1))]
    w = [op._replace(weight=True) for op in b]
    assert zero_bubble_order(1, 2, 2, 2) == [
        f[0], f[1], f[2], b[0], f[3], b[1], w[0], b[2], w[1], b[3], w[2], w[3]
    ]  # fmt: skip
    # Rank 0: P + P - 1 = 3 warm-up forwards, then W right after each B.
    assert zero_bubble_order(0, 2, 2, 2) == [
        f[0], f[1], f[2], f[3], b[0], w[0], b[1], w[1], b[2], w[2], b[3], w[3]
    ]  # fmt: skip
    assert [zero_bubble_warmup(r, 4, 8, 3) for r in range(4)] == [11, 10, 9, 8]


@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4))
def test_interleaved_every_command_once_and_in_dependency_order(ranks, chunks, k):
    count = k * ranks
    for r in range(ranks):
        order = zero_bubble_order(r, ranks, count, chunks)
        expected = [
            Op(kind > 0, c, b, kind == 2)
            for kind in range(3)
            for c in range(chunks)
            for b in range(count)
        ]
        assert sorted(order) == sorted(expected)
        position = {op: i for i, op in enumerate(order)}
        for c in range(chunks):
            for b in range(count):
                fwd, inp = Op(False, c, b), Op(True, c, b)
                assert (
                    position[fwd] < position[inp] < position[inp._replace(weight=True)]
                )
                # a rank's later chunk follows its earlier one (forward), and
                # precedes it (backward), for each micro-batch
                if c:
                    assert position[Op(False, c - 1, b)] < position[fwd]
                    assert position[Op(True, c - 1, b)] > position[inp]
        # W passes run in the order of their B passes
        inputs = [op for op in order if op.backward and not op.weight]
        weights = [op._replace(weight=False) for op in order if op.weight]
        assert inputs == weights


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 5),
    st.integers(2, 4),
    st.integers(1, 3),
    st.floats(0.1, 3.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_interleaved_closed_form_with_equal_chunks(ranks, chunks, k, f, sw, sb):
    # Per-rank f, b, w split equally over V chunks, free links, M = k P, in
    # the regime of the one-chunk closed form: the bubble (P - 1)(f + b - w)
    # divided by V, as interleaving divides 1F1B's.
    count = k * ranks
    w = sw * f
    b = w + sb * f
    shape = (ranks, chunks)
    result = simulate_zero_bubble(
        np.full(shape, f / chunks),
        np.full(shape, b / chunks),
        np.full(shape, w / chunks),
        count,
        memory_per_microbatch=np.full(shape, 1.0 / chunks),
    )
    expected = count * (f + b + w) + (ranks - 1) * (f + b - w) / chunks
    assert result.iteration_time == pytest.approx(expected, rel=1e-9)
    # every rank holds the chunks of P micro-batches at its peak: P
    # micro-batches' worth, as ZB-H1 (no interleaving penalty)
    assert np.all(result.peak_in_flight == chunks * ranks)
    np.testing.assert_allclose(result.peak_memory, ranks)
    assert result.forward_end.shape == (ranks, chunks, count)


def test_interleaved_memory_is_the_orders_peak_per_chunk():
    memory = np.array([[4.0, 1.0], [2.0, 8.0]])
    result = simulate_zero_bubble(
        np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), 4,
        transfer=[0.1, 0.2], memory_per_microbatch=memory,
    )  # fmt: skip
    for r in range(2):
        held = peak = 0.0
        for op in zero_bubble_order(r, 2, 4, 2):
            if not op.backward:
                held += memory[r, op.chunk]
            elif op.weight:
                held -= memory[r, op.chunk]
            peak = max(peak, held)
        assert result.peak_memory[r] == peak
        assert held_by_order(zero_bubble_order(r, 2, 4, 2), memory[r]) == peak
    # rank 0 (chunk 0: 4 bytes, chunk 1: 1): F00 F01 F10 F11 hold 10 at its
    # first B; B10 W10 free 1, F02 adds 4, B11 W11 free 1, F03 adds 4: 16
    assert result.peak_memory[0] == 16.0


# ---- ZB-V: two chunks per rank in a V ---------------------------------------


def test_zbv_order_by_hand():
    # P = 2, M = 3 (PyTorch pads to 2P - 1 = 3 rounds). Rank 1 holds virtual
    # stages 1 (chunk 0) and 2 (chunk 1): one forward of chunk 0, then its
    # chunk-1 forward turns the micro-batch round at once.
    f0, f1 = (lambda b: Op(False, 0, b)), (lambda b: Op(False, 1, b))
    b0, b1 = (lambda b: Op(True, 0, b)), (lambda b: Op(True, 1, b))
    w0, w1 = (lambda b: Op(True, 0, b, True)), (lambda b: Op(True, 1, b, True))
    assert zbv_order(1, 2, 3) == [
        f0(0), f1(0), f0(1),  # warm-up: chunk 0, then chunk 1 beside it
        f1(1), b1(0), w1(0),  # chunk 1 turns round
        f0(2), b0(0), w0(0), f1(2), b1(1), w1(1),  # steady
        b0(1), b1(2),  # cool-down: input gradients first
        b0(2), w0(1), w1(2), w0(2),
    ]  # fmt: skip
    assert [op for op in zbv_order(0, 2, 3) if not op.backward] == [
        f0(0), f0(1), f0(2), f1(0), f1(1), f1(2)
    ]  # fmt: skip


@given(st.integers(1, 6), st.integers(1, 20))
def test_zbv_every_command_once_and_in_dependency_order(ranks, count):
    for r in range(ranks):
        order = zbv_order(r, ranks, count)
        expected = [
            Op(kind > 0, c, b, kind == 2)
            for kind in range(3)
            for c in range(2)
            for b in range(count)
        ]
        assert sorted(order) == sorted(expected)
        position = {op: i for i, op in enumerate(order)}
        for c in range(2):
            for b in range(count):
                fwd, inp = Op(False, c, b), Op(True, c, b)
                assert (
                    position[fwd] < position[inp] < position[inp._replace(weight=True)]
                )
        if r == ranks - 1:  # the V's turn is on this rank: F0 before F1, B1 before B0
            for b in range(count):
                assert position[Op(False, 0, b)] < position[Op(False, 1, b)]
                assert position[Op(True, 1, b)] < position[Op(True, 0, b)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 10), st.floats(0.1, 3.0))
def test_zbv_with_equal_passes_reaches_the_least_time(ranks, extra, f):
    # F = B = W on every chunk (the schedule's design point), M >= 2P - 1: the
    # last rank starts after the P - 1 forwards before it and never waits
    # again; no schedule can do better (each rank computes 6 M f).
    count = 2 * ranks - 1 + extra
    times = np.full((ranks, 2), f)
    result = simulate_zero_bubble(
        times, times, times, count, v_shape=True,
        memory_per_microbatch=np.full((ranks, 2), 0.5),
    )  # fmt: skip
    assert result.iteration_time == pytest.approx(
        (ranks - 1) * f + 6 * count * f, rel=1e-12
    )
    # every rank holds 2 P chunks at its peak (P micro-batches of its layers,
    # as 1F1B's first stage)
    assert np.all(result.peak_in_flight == 2 * ranks)
    np.testing.assert_allclose(result.peak_memory, ranks)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 10), st.floats(0.1, 3.0), st.floats(0.1, 3.0))
def test_zbv_without_weight_passes_halves_the_1f1b_bubble(ranks, extra, f, b):
    # W = 0, each chunk of the V half a rank's layers (per-rank f, b): the
    # bubble is (P - 1) max(f, b), 1F1B's (P - 1)(f + b) halved when f = b
    # (found by this test: with b > f the backward chain sets it).
    count = 2 * ranks - 1 + extra
    result = simulate_zero_bubble(
        np.full((ranks, 2), f / 2), np.full((ranks, 2), b / 2),
        np.zeros((ranks, 2)), count, v_shape=True,
    )  # fmt: skip
    expected = count * (f + b) + (ranks - 1) * max(f, b)
    assert result.iteration_time == pytest.approx(expected, rel=1e-9)


def test_zbv_links_and_shapes():
    # the turn on rank P - 1 uses no link: a slow link 0 delays both ways
    times = np.ones((2, 2))
    free = simulate_zero_bubble(times, times, times, 3, v_shape=True)
    slow = simulate_zero_bubble(times, times, times, 3, v_shape=True, transfer=[0.5])
    assert slow.iteration_time > free.iteration_time
    assert free.forward_end.shape == (2, 2, 3)
    with pytest.raises(ValueError, match="v_shape needs times of shape"):
        simulate_zero_bubble(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), 3,
                             v_shape=True)  # fmt: skip
    with pytest.raises(ValueError, match="transfer must have shape"):
        simulate_zero_bubble(times, times, times, 3, v_shape=True, transfer=[1, 1])
    with pytest.raises(ValueError, match="v_shape must be a bool"):
        simulate_zero_bubble(times, times, times, 3, v_shape=1)
