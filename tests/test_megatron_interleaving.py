"""The predictor under Megatron-LM's interleaved 1F1B schedule."""

import numpy as np
import pytest

from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.interleaving import (
    chunk_layers,
    chunk_stash,
    rank_layers,
    warmup_stash,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.rules import rank_params
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.simulation.interleaved import interleaved_order
from pipedejavu.simulation.zero_bubble import zbv_order, zero_bubble_order


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


# ---- the zero-bubble forms: interleaved (loop) and ZB-V ---------------------


def _zero_bubble_source(v_shape: bool, recompute: str = "none"):
    options = TrainingOptions(
        "bf16",
        recompute=recompute,
        zero_bubble=True,
        virtual_stages=2 if v_shape else 1,
        v_shape=v_shape,
    )
    return choose_cost_source("Llama-3-8B", {"A100-80": 8}, options=options,
                              seq_length=2048)  # fmt: skip


def _even(choice, ranks, gbs, dp=1):
    blocks = choice.data.model_info(choice.model).num_layers - 2
    per = blocks // ranks
    edges = [0] + [1 + per * r for r in range(1, ranks)] + [blocks + 2]
    return plan_from_stages(
        [(a, b, 1) for a, b in zip(edges, edges[1:], strict=False)],
        gpu_type="A100-80", dp=dp, mbs=1, gbs=gbs, model=choice.model,
        gpus_per_node=8, zone="z",
    )  # fmt: skip


def test_v_chunks_hold_the_embedding_and_head_on_rank_0():
    choice = _zero_bubble_source(True)
    plan = _even(choice, 4, 8)  # 32 blocks: 8 virtual stages of 4
    chunks = chunk_layers(plan, 2, v_shape=True)
    assert chunks[0] == [(0, 5), (29, 34)]  # stages 0 and 7
    assert chunks[3] == [(13, 17), (17, 21)]  # stages 3 and 4: the turn
    assert rank_layers(plan, v_shape=True) == chunks
    assert rank_layers(plan) == [[(s.start, s.stop)] for s in plan.stages]
    info = choice.data.model_info(choice.model)
    # rank 0 holds the (untied) head's parameters, rank 3 only blocks
    head = float(info.params[1][-1])
    assert rank_params(info, 1, chunks[0]) == pytest.approx(
        float(info.params[1][0:5].sum()) + float(info.params[1][29:34].sum())
    )
    assert rank_params(info, 1, chunks[0]) > head
    prediction = predict_plan(plan, choice.data, virtual_stages=2)
    loop = predict_plan(
        plan, _zero_bubble_source(False).data, virtual_stages=2, zero_bubble=True
    )
    state = prediction.model_state_bytes[:, 0]
    assert state[0] > state[-1]  # the head moved to rank 0
    assert loop.model_state_bytes[0, 0] < loop.model_state_bytes[-1, 0]
    assert np.all(prediction.tied_allreduce_s == 0)
    with pytest.raises(ProblemError, match="2 chunks per rank"):
        predict_plan(plan, choice.data, virtual_stages=4)


@pytest.mark.parametrize(
    ("v_shape", "ranks", "chunks", "gbs"),
    [(False, 2, 2, 4), (False, 4, 2, 8), (False, 2, 4, 6), (True, 2, 2, 3),
     (True, 4, 2, 5), (True, 4, 2, 16), (True, 8, 2, 20)],
)  # fmt: skip
def test_zero_bubble_warmup_stash_is_the_stash_at_the_first_b(
    v_shape, ranks, chunks, gbs
):
    # The memory floor of the interleaved search under the zero-bubble forms:
    # what each rank holds when its first B starts, read off the orders, and
    # at most the simulated peak the predictor reports.
    choice = _zero_bubble_source(v_shape, recompute="selective")
    plan = _even(choice, ranks, gbs)
    info = choice.data.model_info(choice.model)
    floor = warmup_stash(plan, info, chunks, zero_bubble=True, v_shape=v_shape)
    layers = chunk_layers(plan, chunks, v_shape)
    memory = chunk_stash(plan, info, layers, 0)
    count = plan.num_microbatches
    for r in range(ranks):
        if v_shape:
            ops = zbv_order(r, ranks, count)
        else:
            ops = zero_bubble_order(r, ranks, count, chunks)
        first = next(i for i, op in enumerate(ops) if op.backward)
        held = sum(memory[r, op.chunk] for op in ops[:first])  # forwards only
        assert floor[r] == pytest.approx(held, rel=1e-12)
    prediction = predict_plan(plan, choice.data, virtual_stages=chunks,
                              zero_bubble=True)  # fmt: skip
    assert np.all(floor <= prediction.activation_bytes * (1 + 1e-12))
    assert floor.min() > 0
