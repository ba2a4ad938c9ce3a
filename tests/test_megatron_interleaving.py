"""The predictor under Megatron-LM's interleaved 1F1B schedule."""

import numpy as np
import pytest

from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.interleaving import (
    chunk_layers,
    chunk_stash,
    warmup_stash,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.simulation.interleaved import interleaved_order


def _plan(edges, dp=1, gbs=16, model="OPT-350"):
    stages = []
    for s, (start, stop) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        replicas = tuple(Replica("GH-96", 1, node=s) for _ in range(dp))
        stages.append(Stage3D(start, stop, replicas))
    return Plan3D(tuple(stages), mbs=1, gbs=gbs * dp, model=model)


def test_chunks_follow_megatron_round_robin():
    # 8 blocks, P = 2, V = 2: chunks of 2 blocks; rank 0 holds chunks 0 and 2,
    # rank 1 chunks 1 and 3; embedding (layer 0) and head (layer 9) at the ends.
    plan = Plan3D(
        (
            Stage3D(0, 5, (Replica("GH-96", 1),)),
            Stage3D(5, 10, (Replica("GH-96", 1),)),
        ),
        mbs=1,
        gbs=4,
    )
    assert chunk_layers(plan, 2) == [[(0, 3), (5, 7)], [(3, 5), (7, 10)]]
    assert chunk_layers(plan, 4) == [
        [(0, 2), (3, 4), (5, 6), (7, 8)],
        [(2, 3), (4, 5), (6, 7), (8, 10)],
    ]


@pytest.mark.parametrize("chunks", [2, 3, 6])
def test_interleaving_moves_the_same_work(chunks):
    data = load_sailor_data()
    plan = _plan([0, 13, 26])
    one = predict_plan(plan, data, virtual_stages=1)
    many = predict_plan(plan, data, virtual_stages=chunks)
    overhead = FITTED_CONSTANTS.op_overhead_s
    # Each rank runs the same layers, one instruction per chunk.
    np.testing.assert_allclose(
        many.stage_forward_s, one.stage_forward_s + (chunks - 1) * overhead, rtol=1e-9
    )
    np.testing.assert_allclose(
        many.stage_backward_s,
        one.stage_backward_s + (chunks - 1) * overhead,
        rtol=1e-9,
    )
    # Megatron's warm-up: rank r holds (P - r - 1) * 2 + (V - 1) * P + 1 chunks.
    ranks = 2
    expected = [(ranks - r - 1) * 2 + (chunks - 1) * ranks + 1 for r in range(ranks)]
    assert many.peak_in_flight.tolist() == expected
    # Less idle time per rank, more transfers: the bubble shrinks.
    assert many.bubble_fraction < one.bubble_fraction
    # No rank finishes before it has run every micro-batch's chunks.
    work = plan.num_microbatches * (many.stage_forward_s + many.stage_backward_s)
    assert many.pipeline_s >= float(work.max()) * (1 - 1e-12)


def test_interleaving_refuses_what_megatron_cannot_run():
    data = load_sailor_data()
    with pytest.raises(ProblemError, match="transformer layers"):
        predict_plan(_plan([0, 12, 26]), data, virtual_stages=2)
    with pytest.raises(ProblemError, match="equal model chunks"):
        predict_plan(_plan([0, 13, 26]), data, virtual_stages=5)
    with pytest.raises(ProblemError, match="multiple of the pipeline stages"):
        predict_plan(_plan([0, 13, 26], gbs=15), data, virtual_stages=2)


@pytest.mark.parametrize(
    ("edges", "chunks", "gbs"),
    [
        ([0, 13, 26], 2, 2),
        ([0, 13, 26], 3, 16),
        ([0, 9, 17, 26], 2, 3),
        ([0, 9, 17, 26], 4, 12),
        ([0, 7, 13, 19, 26], 3, 40),
    ],
)
def test_warmup_stash_is_the_stash_at_the_first_backward(edges, chunks, gbs):
    # The stash each rank holds when its first backward starts, read off
    # Megatron's command order itself: at most the simulated peak the
    # predictor reports (the search's memory floor relies on both).
    data = load_sailor_data()
    plan = _plan(edges, gbs=gbs)
    info = data.model_info("OPT-350")
    floor = warmup_stash(plan, info, chunks)
    memory = chunk_stash(plan, info, chunk_layers(plan, chunks), 0)
    ranks, count = plan.num_stages, plan.num_microbatches
    for r in range(ranks):
        ops = interleaved_order(r, ranks, chunks, count)
        first = next(i for i, op in enumerate(ops) if op.backward)
        held = sum(memory[r, op.chunk] for op in ops[:first])  # forwards only
        assert floor[r] == pytest.approx(held, rel=1e-12)
    prediction = predict_plan(plan, data, virtual_stages=chunks)
    assert np.all(floor <= prediction.activation_bytes * (1 + 1e-12))
    assert floor.max() > 0
