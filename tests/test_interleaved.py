"""Megatron-LM's interleaved 1F1B schedule: its command order against hand-written
ones and Megatron's warm-up counts, its iteration time against the closed form,
V = 1 against the simulator's "1f1b", and deadlock freedom on random sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.simulation.interleaved import (
    Op,
    interleaved_order,
    peak_in_flight_count,
    simulate_interleaved,
    warmup_count,
)
from pipedejavu.simulation.schedules import command_order
from pipedejavu.simulation.simulate import simulate


def F(chunk, microbatch):  # noqa: N802 - the paper's notation
    return Op(False, chunk, microbatch)


def B(chunk, microbatch):  # noqa: N802
    return Op(True, chunk, microbatch)


def equal_chunks(num_ranks, num_chunks, forward, backward):
    """Per-rank times ``forward`` and ``backward`` split evenly into V chunks."""
    shape = (num_ranks, num_chunks)
    return np.full(shape, forward / num_chunks), np.full(shape, backward / num_chunks)


# Command order -------------------------------------------------------------


def test_order_of_rank_0_by_hand():
    # P = 2, V = 2, M = 4: Megatron's table takes micro-batches in groups of P
    # per chunk: (0,c0) (1,c0) (0,c1) (1,c1) (2,c0) (3,c0) (2,c1) (3,c1); rank 0
    # warms up with 2 (P - 1) + (V - 1) P = 4 forwards.
    assert interleaved_order(0, 2, 2, 4) == [
        F(0, 0), F(0, 1), F(1, 0), F(1, 1),
        F(0, 2), B(1, 0), F(0, 3), B(1, 1), F(1, 2), B(0, 0), F(1, 3), B(0, 1),
        B(1, 2), B(1, 3), B(0, 2), B(0, 3),
    ]  # fmt: skip


def test_order_of_the_last_rank_by_hand():
    # Rank 1 of the same pipeline warms up with (V - 1) P = 2 forwards.
    assert interleaved_order(1, 2, 2, 4) == [
        F(0, 0), F(0, 1),
        F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(0, 2), B(0, 0), F(0, 3), B(0, 1),
        F(1, 2), B(1, 2), F(1, 3), B(1, 3),
        B(0, 2), B(0, 3),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("num_ranks", "num_chunks", "expected"),
    [
        # Megatron: 2 (P - r - 1) + (V - 1) P for V > 1; P - r - 1 for V = 1.
        (4, 2, [10, 8, 6, 4]),
        (4, 3, [14, 12, 10, 8]),
        (2, 4, [8, 6]),
        (4, 1, [3, 2, 1, 0]),
        (1, 3, [2]),
    ],
)
def test_warmup_counts_are_megatrons(num_ranks, num_chunks, expected):
    counts = [warmup_count(r, num_ranks, num_chunks, 32) for r in range(num_ranks)]
    assert counts == expected


def test_warmup_is_capped_at_the_forwards():
    # P = 4, V = 2, M = 4: rank 0 would warm up with 10 of its 8 forwards.
    assert warmup_count(0, 4, 2, 4) == 8
    assert interleaved_order(0, 4, 2, 4)[:8] == [
        op for op in interleaved_order(0, 4, 2, 4) if not op.backward
    ]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 7])
def test_one_chunk_is_the_simulators_1f1b_order(num_ranks, num_microbatches):
    count = num_microbatches
    for rank in range(num_ranks):
        codes = [
            count + op.microbatch if op.backward else op.microbatch
            for op in interleaved_order(rank, num_ranks, 1, count)
        ]
        assert codes == command_order("1f1b", rank, num_ranks, count)


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
@pytest.mark.parametrize("num_chunks", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_every_op_runs_once_forward_first(num_ranks, num_chunks, groups):
    count = groups * num_ranks
    for rank in range(num_ranks):
        order = interleaved_order(rank, num_ranks, num_chunks, count)
        assert sorted(order) == sorted(
            Op(backward, c, b)
            for backward in (False, True)
            for c in range(num_chunks)
            for b in range(count)
        )
        for c in range(num_chunks):
            for b in range(count):
                assert order.index(F(c, b)) < order.index(B(c, b))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, 2, 6), "multiple of the pipeline size 4 .* got 6"),
        ((4, 4, 2, 8), r"rank must be in \[0, 4\), got 4"),
        ((0, 0, 2, 8), "num_ranks must be >= 1, got 0"),
        ((0, 2, 0, 8), "num_chunks must be >= 1, got 0"),
        ((0, 2, 2, 2.0), "num_microbatches must be an int"),
    ],
)
def test_bad_sizes_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        interleaved_order(*args)


def test_one_chunk_takes_any_microbatch_count():
    assert len(interleaved_order(0, 4, 1, 6)) == 12


# Closed forms --------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 5])
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 2.0), (0.7, 0.5)])
def test_equal_chunks_free_links_closed_form(
    num_ranks, num_chunks, groups, forward, backward
):
    count = groups * num_ranks
    f, b = equal_chunks(num_ranks, num_chunks, forward, backward)
    result = simulate_interleaved(f, b, count)
    step = forward + backward
    expected = count * step + (num_ranks - 1) * step / num_chunks
    np.testing.assert_allclose(result.iteration_time, expected, rtol=1e-12)
    # The bubble: (P - 1) / (V M) of the ideal time M (f + b).
    np.testing.assert_allclose(result.busy_time, count * step, rtol=1e-12)
    bubble = (result.iteration_time - count * step) / (count * step)
    np.testing.assert_allclose(
        bubble, (num_ranks - 1) / (num_chunks * count), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 6])
@pytest.mark.parametrize("num_microbatches", [1, 3, 8])
def test_one_chunk_is_the_1f1b_closed_form(num_ranks, num_microbatches):
    result = simulate_interleaved(
        np.ones((num_ranks, 1)), np.full((num_ranks, 1), 2.0), num_microbatches
    )
    np.testing.assert_allclose(
        result.iteration_time, (num_microbatches + num_ranks - 1) * 3.0, rtol=1e-12
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("links", [False, True])
def test_one_chunk_equals_the_simulators_1f1b(seed, links):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        num_ranks, count = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        f, b = rng.uniform(0.1, 2, num_ranks), rng.uniform(0.1, 3, num_ranks)
        x = rng.uniform(0, 2, num_ranks - 1) if links else np.zeros(num_ranks - 1)
        ref = simulate(f, b, count, schedule="1f1b", transfer=x)
        got = simulate_interleaved(
            f[:, None], b[:, None], count, transfer=np.append(x, 0.0)
        )
        np.testing.assert_allclose(got.iteration_time, ref.iteration_time, rtol=1e-12)
        np.testing.assert_allclose(got.forward_start[:, 0], ref.forward_start)
        np.testing.assert_allclose(got.backward_end[:, 0], ref.backward_end)
        np.testing.assert_array_equal(got.peak_in_flight, ref.peak_in_flight)
        np.testing.assert_allclose(
            got.activation_start[:-1, 0], ref.activation_start, equal_nan=True
        )
        np.testing.assert_allclose(
            got.gradient_end[1:, 0], ref.gradient_end, equal_nan=True
        )


# In flight -----------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("num_chunks", [2, 3, 4])
def test_rank_0_peak_is_megatrons_memory_penalty(num_ranks, num_chunks):
    count = 4 * num_ranks
    f, b = equal_chunks(num_ranks, num_chunks, 1.0, 2.0)
    result = simulate_interleaved(f, b, count)
    # Warm-up 2 (P - 1) + (V - 1) P, plus the forward of the first 1F1B step.
    peak = num_chunks * num_ranks + num_ranks - 1
    assert result.peak_in_flight[0] == peak
    # Each micro-batch-chunk holds 1 / V of the rank's layers: Megatron's
    # penalty 1 + (P - 1) / (P V) over the P micro-batches of plain 1F1B.
    np.testing.assert_allclose(
        peak / num_chunks,
        num_ranks * (1 + (num_ranks - 1) / (num_ranks * num_chunks)),
        rtol=1e-12,
    )


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_chunks", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_peak_in_flight_matches_the_closed_form(num_ranks, num_chunks, groups):
    count = groups * num_ranks
    f, b = equal_chunks(num_ranks, num_chunks, 1.0, 2.0)
    result = simulate_interleaved(f, b, count)
    expected = [
        peak_in_flight_count(r, num_ranks, num_chunks, count) for r in range(num_ranks)
    ]
    np.testing.assert_array_equal(result.peak_in_flight, expected)


def test_peak_memory_weighs_each_chunk():
    # Rank 0 of P = 2, V = 2, M = 4 (order above): after its 5 first commands it
    # holds micro-batches 0, 1 of chunk 0 (3 bytes each), 0, 1 of chunk 1 (10
    # each) and 2 of chunk 0: 29 bytes; later states hold less.
    memory = np.array([[3.0, 10.0], [1.0, 1.0]])
    f, b = equal_chunks(2, 2, 1.0, 2.0)
    result = simulate_interleaved(f, b, 4, memory_per_microbatch=memory)
    np.testing.assert_allclose(result.peak_memory, [29.0, 3.0])
    np.testing.assert_array_equal(result.peak_in_flight, [5, 3])


# Timings and deadlock freedom ----------------------------------------------


def check_timings(result):
    """Every op ran once, after its input arrived, one at a time per rank."""
    p, v, count = result.num_ranks, result.num_chunks, result.num_microbatches
    f, b, x = result.forward, result.backward, result.transfer
    fs, fe, bs, be = (
        result.forward_start,
        result.forward_end,
        result.backward_start,
        result.backward_end,
    )
    np.testing.assert_allclose(fe - fs, np.repeat(f[:, :, None], count, 2))
    np.testing.assert_allclose(be - bs, np.repeat(b[:, :, None], count, 2))
    for r in range(p):
        for c in range(v):
            if r or c:
                source = (r - 1, c) if r else (p - 1, c - 1)
                arrival = fe[source] + x[source[0]]
                assert (fs[r, c] >= arrival - 1e-9).all()
            if r < p - 1 or c < v - 1:
                source = (r + 1, c) if r < p - 1 else (0, c + 1)
                link = r if r < p - 1 else p - 1
                assert (bs[r, c] >= be[source] + x[link] - 1e-9).all()
            assert (bs[r, c] >= fe[r, c] - 1e-9).all()
        starts = np.concatenate([fs[r].ravel(), bs[r].ravel()])
        ends = np.concatenate([fe[r].ravel(), be[r].ravel()])
        order = np.lexsort((ends, starts))
        assert (starts[order][1:] >= ends[order][:-1] - 1e-9).all()
    # Each link carries one transfer at a time: link l takes the activations of
    # rank l and the gradients of rank (l + 1) mod P.
    for link in range(p):
        pairs = [
            (result.activation_start[link], result.activation_end[link]),
            (
                result.gradient_start[(link + 1) % p],
                result.gradient_end[(link + 1) % p],
            ),
        ]
        starts = np.concatenate([a.ravel() for a, _ in pairs])
        ends = np.concatenate([e.ravel() for _, e in pairs])
        kept = ~np.isnan(starts)
        starts, ends = starts[kept], ends[kept]
        np.testing.assert_allclose(ends - starts, x[link])
        order = np.lexsort((ends, starts))
        assert (starts[order][1:] >= ends[order][:-1] - 1e-9).all()
    assert result.iteration_time >= result.busy_time.max() - 1e-9


@settings(max_examples=60, deadline=None)
@given(
    num_ranks=st.integers(1, 5),
    num_chunks=st.integers(1, 4),
    groups=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    links=st.booleans(),
)
def test_random_sizes_run_to_the_end(num_ranks, num_chunks, groups, seed, links):
    rng = np.random.default_rng(seed)
    shape = (num_ranks, num_chunks)
    # Rounded to 0.1 s, so that ties and zero durations occur.
    transfer = rng.uniform(0.0, 1.5, num_ranks).round(1) if links else None
    result = simulate_interleaved(
        rng.uniform(0.0, 2.0, shape).round(1),
        rng.uniform(0.0, 3.0, shape).round(1),
        groups * num_ranks,
        transfer=transfer,
    )
    check_timings(result)


# Arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": [1.0, 2.0]}, r"forward must have shape \(P, V\)"),
        ({"backward": np.ones((2, 3))}, r"backward must have shape \(2, 2\)"),
        ({"backward": [[1.0, -1.0], [1.0, 1.0]]}, r"-1.0 at index \(0, 1\)"),
        ({"transfer": [1.0]}, r"transfer must have shape \(2,\)"),
        ({"memory_per_microbatch": [[np.nan, 0], [0, 0]]}, "must be finite"),
        ({"num_microbatches": 3}, "multiple of the pipeline size 2"),
        ({"num_microbatches": True}, "num_microbatches must be an int"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = {
        "forward": np.ones((2, 2)),
        "backward": np.ones((2, 2)),
        "num_microbatches": 4,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        simulate_interleaved(**args)
