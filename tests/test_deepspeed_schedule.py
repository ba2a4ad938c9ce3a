"""The simulator's DeepSpeed schedule against closed forms and the 1F1B order."""

from __future__ import annotations

import numpy as np
import pytest

from pipedejavu.simulation.deepspeed import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    SEND_ACT,
    compute_order,
    deepspeed_commands,
    run_deepspeed,
)
from pipedejavu.simulation.schedules import command_order
from pipedejavu.simulation.simulate import simulate

SIZES = [(s, b) for s in (1, 2, 3, 4, 7) for b in (1, 2, 3, 5, 8)]


@pytest.mark.parametrize("stages, count", SIZES)
def test_compute_order_is_1f1b(stages, count):
    for s in range(stages):
        commands = deepspeed_commands(s, stages, count)
        assert compute_order(commands, count) == command_order("1f1b", s, stages, count)
        # Every micro-batch is received before its forward, sent after it.
        for b in range(count):
            forward = commands.index((FORWARD, b))
            if s:
                assert commands.index((RECV_ACT, b)) < forward
            if s < stages - 1:
                assert commands.index((SEND_ACT, b)) > forward
                assert commands.index((BACKWARD, b)) > commands.index((SEND_ACT, b))


@pytest.mark.parametrize("stages, count", [*SIZES, (16, 3), (20, 37)])
@pytest.mark.parametrize("blocking", [True, False])
def test_equal_stages_free_links(stages, count, blocking):
    """(S + B - 1)(f + b): the 1F1B closed form, whatever the link mode (and
    from 16 stages, run by steps)."""
    result = simulate(
        [1.5] * stages,
        [2.5] * stages,
        count,
        schedule="deepspeed",
        transfer=np.zeros(stages - 1),
        blocking=blocking,
    )
    assert result.iteration_time == pytest.approx((stages + count - 1) * 4.0)
    expected = [min(stages - s, count) for s in range(stages)]
    assert result.peak_in_flight.tolist() == expected


@pytest.mark.parametrize("count", [1, 2, 3, 6, 11])
def test_one_stage(count):
    result = simulate([0.3], [0.7], count, schedule="deepspeed")
    assert result.iteration_time == pytest.approx(count * 1.0)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("f, b, x", [(1.0, 2.0, 0.5), (2.0, 1.0, 3.0), (1.0, 1.0, 1.0)])
def test_two_equal_stages_rendezvous(count, f, b, x):
    """Two stages, blocking links: ``(B + 1)(f + b) + 2 B x``.

    Hand trace (B = 1): F0 [0, f]; activation [f, f + x]; stage 1 runs F0, B0;
    gradient [2f + x + b, 2f + 2x + b]; stage 0 B0 ends at 2(f + b) + 2x. Each
    further micro-batch adds one forward and one backward on the critical stage
    and two rendezvous transfers it must take part in: (f + b) + 2x.
    """
    result = simulate([f, f], [b, b], count, schedule="deepspeed", transfer=[x])
    assert result.iteration_time == pytest.approx((count + 1) * (f + b) + 2 * count * x)
    # Both ends are busy during every transfer: the link never overlaps compute.
    ends = np.concatenate([result.activation_end[0], result.gradient_end[0]])
    starts = np.concatenate([result.activation_start[0], result.gradient_start[0]])
    for s in range(2):
        for start, end in zip(starts, ends, strict=True):
            overlap = np.minimum(result.forward_end[s], end) - np.maximum(
                result.forward_start[s], start
            )
            assert (overlap <= 1e-12).all()


def test_buffered_links_hide_a_fast_link():
    """A buffered link faster than the compute costs only its latency once per
    direction, on the critical path: ``2(f + b) + 2x`` for B = 1 and, for more
    micro-batches, never more than the blocking time."""
    f, b, x = 1.0, 2.0, 0.25
    for count in (1, 4, 8):
        buffered = simulate(
            [f, f], [b, b], count, schedule="deepspeed", transfer=[x], blocking=False
        ).iteration_time
        blocking = simulate(
            [f, f], [b, b], count, schedule="deepspeed", transfer=[x]
        ).iteration_time
        assert buffered <= blocking + 1e-12
        if count == 1:
            assert buffered == pytest.approx(2 * (f + b) + 2 * x)


def test_slow_buffered_link_binds():
    """A link slower than everything is the bottleneck: one message per direction
    at a time, so ``B`` activations take at least ``B x`` after the first forward."""
    f, b, x = 0.1, 0.1, 5.0
    for count in (2, 5):
        result = simulate(
            [f, f], [b, b], count, schedule="deepspeed", transfer=[x], blocking=False
        )
        assert result.iteration_time >= f + count * x + f + b + x + b - 1e-9


def test_gradient_transfer_and_validation():
    fast = simulate([1.0] * 3, [1.0] * 3, 4, schedule="deepspeed", transfer=[1.0, 1.0])
    slow_back = simulate(
        [1.0] * 3,
        [1.0] * 3,
        4,
        schedule="deepspeed",
        transfer=[1.0, 1.0],
        gradient_transfer=[3.0, 3.0],
    )
    assert slow_back.iteration_time > fast.iteration_time
    np.testing.assert_allclose(
        slow_back.gradient_end - slow_back.gradient_start, 3.0 * np.ones((2, 4))
    )
    with pytest.raises(ValueError, match="deepspeed schedule only"):
        simulate([1.0, 1.0], [1.0, 1.0], 2, gradient_transfer=[1.0])
    with pytest.raises(ValueError, match="blocking must be bools"):
        simulate([1.0, 1.0], [1.0, 1.0], 2, schedule="deepspeed", blocking=[0.5])


def test_random_pipelines_respect_every_dependency():
    """Random stage times, link times and link modes: each stage computes one
    thing at a time, a forward follows its activation's arrival and a backward
    its gradient's, a message leaves after the compute that made it, and a
    rendezvous keeps both stages from computing; the iteration ends with the
    last compute, and some op starts exactly when what it waits for ends."""
    rng = np.random.default_rng(3)
    tight = 0
    for _ in range(150):
        stages, count = int(rng.integers(2, 8)), int(rng.integers(1, 12))
        blocking = rng.integers(0, 2, stages - 1).astype(bool)
        r = simulate(
            rng.uniform(0.1, 2, stages),
            rng.uniform(0.1, 4, stages),
            count,
            schedule="deepspeed",
            transfer=rng.uniform(0, 1, stages - 1),
            gradient_transfer=rng.uniform(0, 1, stages - 1),
            blocking=blocking,
        )
        eps = 1e-12
        for s in range(stages):
            spans = sorted(
                zip(
                    np.r_[r.forward_start[s], r.backward_start[s]],
                    np.r_[r.forward_end[s], r.backward_end[s]],
                    strict=True,
                )
            )
            assert all(
                a[1] <= b[0] + eps for a, b in zip(spans[:-1], spans[1:], strict=True)
            )
            if s:  # activation from s - 1, gradient back to s - 1 over link s - 1
                assert (r.forward_start[s] >= r.activation_end[s - 1] - eps).all()
                assert (r.gradient_start[s - 1] >= r.backward_end[s] - eps).all()
            if s < stages - 1:
                assert (r.backward_start[s] >= r.gradient_end[s] - eps).all()
                assert (r.activation_start[s] >= r.forward_end[s] - eps).all()
                if blocking[s]:
                    for k in (s, s + 1):
                        for start, end in (
                            (r.activation_start[s], r.activation_end[s]),
                            (r.gradient_start[s], r.gradient_end[s]),
                        ):
                            for a, b in zip(start, end, strict=True):
                                busy = np.minimum(
                                    np.r_[r.forward_end[k], r.backward_end[k]], b
                                ) - np.maximum(
                                    np.r_[r.forward_start[k], r.backward_start[k]], a
                                )
                                assert (busy <= eps).all()
        last = max(r.forward_end.max(), r.backward_end.max())
        assert r.iteration_time == pytest.approx(last, rel=1e-12)
        tight += bool(np.isclose(r.forward_start[1:], r.activation_end).any())
    assert tight > 100  # the dependencies bind, not just hold


def test_by_steps_matches_the_program_bit_for_bit():
    """Running one step of every stage at once (numpy) gives the program's
    orders and times exactly, blocking or buffered, with free or slow links,
    from one stage and one micro-batch up."""
    rng = np.random.default_rng(11)
    shapes = [(1, 1), (1, 5), (2, 1), (17, 1), (16, 3)]
    shapes += [(int(rng.integers(1, 25)), int(rng.integers(1, 40))) for _ in range(200)]
    for k, (stages, count) in enumerate(shapes):
        links = stages - 1
        transfer = rng.uniform(0, 1, links) * (k % 4 != 0)
        args = (
            rng.uniform(0.1, 2, stages).tolist(),
            rng.uniform(0.1, 4, stages).tolist(),
            transfer.tolist(),
            rng.uniform(0, 2, links).tolist(),
            [bool(k % 2)] * links,
            count,
        )
        program = run_deepspeed(*args, method="program")
        steps = run_deepspeed(*args, method="steps")
        assert np.array_equal(np.asarray(program[0]), steps[0])
        for a, b in zip(program[1], steps[1], strict=True):
            a = np.array(a, dtype=np.float64).reshape(-1, count)
            assert np.array_equal(a, b, equal_nan=True), (stages, count, k % 2)
    with pytest.raises(ValueError, match="all block or all buffer"):
        run_deepspeed(
            [1.0] * 3, [1.0] * 3, [1.0] * 2, [1.0] * 2, [True, False], 2, method="steps"
        )
    with pytest.raises(ValueError, match="method must be"):
        run_deepspeed([1.0], [1.0], [], [], [], 2, method="fast")


@pytest.mark.parametrize("blocking", [True, False])
def test_long_pipelines_run_by_steps(blocking):
    """``simulate`` takes the steps for 16 stages and more: the same result as
    the program."""
    rng = np.random.default_rng(5)
    stages, count = 20, 37
    forward, backward = rng.uniform(0.1, 2, stages), rng.uniform(0.1, 4, stages)
    transfer = rng.uniform(0, 1, stages - 1)
    result = simulate(
        forward,
        backward,
        count,
        schedule="deepspeed",
        transfer=transfer,
        blocking=blocking,
    )
    _, grids = run_deepspeed(
        forward.tolist(),
        backward.tolist(),
        transfer.tolist(),
        transfer.tolist(),
        [blocking] * (stages - 1),
        count,
        method="program",
    )
    assert np.array_equal(result.forward_end, np.array(grids[1]))
    assert np.array_equal(result.gradient_start, np.array(grids[6]), equal_nan=True)
    assert result.iteration_time == max(
        max(map(max, grids[1])), max(map(max, grids[3]))
    )
