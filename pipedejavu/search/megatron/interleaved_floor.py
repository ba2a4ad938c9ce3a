"""One interleaved candidate (:mod:`pipedejavu.search.megatron.interleaved`'s
branch and bound): the plan it stands for, and its floor before any
simulation: whether each rank's model state and stash fit (on one pipeline,
no placement), and the all-reduce and optimizer step after each rank's last
backward, as the predictor prices them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.layout import split_blocks
from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D
from pipedejavu.costmodel.megatron.comm import node_key
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.interleaving import rank_layers, warmup_stash
from pipedejavu.costmodel.megatron.rules import (
    buckets,
    expert_allreduce,
    expert_buckets,
    expert_ring,
    least_gradient_sync,
    memory_bytes,
    model_state_bytes,
    optimizer_time,
    rank_expert_params,
    rank_params,
    stage_allreduce,
)
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.search.megatron.space import type_plan

__all__ = [
    "Candidate",
    "candidate_fits",
    "candidate_floor",
    "candidate_plan",
    "ranks_fit",
]


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """An interleaved plan, least bound first.

    ``parts``: the bound's three terms (module docstring), each before the tail
    of its rank: the busiest rank's (any rank), rank 0's and rank ``P - 1``'s;
    ``tails``: whether :attr:`bound` already adds the tails."""

    bound: float
    gpu: str = dataclasses.field(compare=False)
    mbs: int = dataclasses.field(compare=False)
    tp: int = dataclasses.field(compare=False)
    ranks: int = dataclasses.field(compare=False)
    dp: int = dataclasses.field(compare=False)
    chunks: int = dataclasses.field(compare=False)
    parts: tuple[float, float, float] = dataclasses.field(
        default=(0.0, 0.0, 0.0), compare=False
    )
    tails: bool = dataclasses.field(default=False, compare=False)
    split: tuple[bool, bool] = dataclasses.field(default=(False, False), compare=False)

    def rank_blocks(self, blocks: int) -> list[int]:
        """The transformer blocks of each rank (module docstring)."""
        held = split_blocks(blocks, self.ranks, *self.split)
        assert held is not None  # (a candidate splits evenly)
        return held


def candidate_plan(
    data: SailorData,
    model: str,
    global_batch: int,
    c: Candidate,
    rank_order: str = RANK_ORDERS[0],
    experts: tuple[int, int | None] | None = None,
) -> Plan3D:
    """The candidate as a plan: ``P`` stages of its ranks' blocks
    (:meth:`Candidate.rank_blocks`), placed in ``rank_order``, its expert
    layers over ``experts`` = ``(ep, etp)`` (``None``: the costs'
    ``ModelInfo.expert_axes``)."""
    info = data.model_info(model)
    blocks = info.num_layers - 2
    bounds = [0, *(1 + int(b) for b in np.cumsum(c.rank_blocks(blocks)))]
    bounds[-1] = blocks + 2  # (the head with the last rank)
    stages = [(bounds[r], bounds[r + 1], c.tp) for r in range(c.ranks)]
    return type_plan(data, model, stages, c, global_batch, rank_order, experts)


def ranks_fit(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    plan: Plan3D,
    chunks: int,
    dp: int | None = None,
    edp: int | None = None,
    stash: bool = True,
) -> bool:
    """Whether every rank's model state and its stash at its first backward
    (:func:`~pipedejavu.costmodel.megatron.interleaving.warmup_stash`) fit
    its GPUs (else the predicted memory does not), as the predictor counts
    them (a mixture of experts: their state sharded over expert data
    parallelism, their largest gradient bucket where it is all-reduced). No
    placement enters. ``dp``: the replicas the dense state is sharded over,
    ``edp``: the expert data-parallel GPUs of every stage (``None`` each: the
    plan's), so that one pipeline answers for the plan (:func:`candidate_fits`).
    ``stash`` ``False``: the model state alone (it not fitting, no micro-batch
    size or chunk count of these stages fits)."""
    info = data.model_info(model)
    dp = plan.dp if dp is None else dp
    v_shape = bool(data.options.v_shape)
    zero_bubble = bool(data.options.zero_bubble)
    stashed = np.zeros(plan.num_stages)
    if stash:
        stashed = warmup_stash(plan, info, chunks, zero_bubble, v_shape)
    spans = rank_layers(plan, v_shape)  # each rank's layers
    for s, stage in enumerate(plan.stages):
        tp = stage.replicas[0].tp
        (start, stop), *more = spans[s]
        largest = max(buckets(info, tp, start, stop, more))
        held = rank_params(info, tp, spans[s])
        experts, stage_edp = rank_expert_params(info, tp, spans[s]), 1
        if experts:
            stage_edp = plan.layout.edp(s) if edp is None else edp
            if stage_edp > 1:  # (a gradient bucket only where all-reduced)
                biggest = max(expert_buckets(info, tp, spans[s]), default=0.0)
                largest = max(largest, biggest)
        state = model_state_bytes(info, held, largest, dp, experts, stage_edp)
        for gpu in {r.gpu_type for r in stage.replicas}:
            used = memory_bytes(state, stashed[s], constants, gpu)
            if used > data.gpu_spec(gpu).memory_bytes:
                return False
    return True


def candidate_floor(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    plan: Plan3D,
    chunks: int,
    dp: int | None = None,
) -> tuple[bool, NDArray[np.float64]]:
    """``(fits, tails)`` of an interleaved plan without simulating it:
    :func:`ranks_fit`, and ``f64[P]`` the all-reduce and optimizer step that
    follow each rank's last backward, as the predictor prices them (the
    slowest replica's; of an overlapped all-reduce, the least the predictor
    waits for; a mixture of experts' with their gradients' all-reduce, and
    their step over expert data parallelism, as the predictor's). ``dp``: the
    replicas the dense model state is sharded over (``None``: the plan's)."""
    dp = plan.dp if dp is None else dp
    tails = np.zeros(plan.num_stages)
    if not ranks_fit(data, model, constants, plan, chunks, dp):
        return False, tails
    info = data.model_info(model)
    spans = rank_layers(plan, bool(data.options.v_shape))
    for s, stage in enumerate(plan.stages):
        replicas = list(stage.replicas)
        nodes = [node_key(r, s, j) for j, r in enumerate(replicas)]
        (start, stop), *more = spans[s]
        allreduce, _ = stage_allreduce(
            data.network, info, replicas, nodes, start, stop, more
        )
        held = rank_params(info, replicas[0].tp, spans[s])
        # a mixture of experts: their gradients reduced and their step over
        # expert data parallelism, as the predictor's
        experts, edp = rank_expert_params(info, replicas[0].tp, spans[s]), 1
        if experts:
            edp = plan.layout.edp(s)
            members, ring = expert_ring(plan.layout, s, replicas, nodes)
            seconds, _ = expert_allreduce(
                data.network, info, replicas[0].tp, members, ring, spans[s]
            )
            allreduce += seconds
        step = 0.0
        for gpu, tp in {(r.gpu_type, r.tp) for r in replicas}:
            update = data.layer_times(
                model, gpu, plan.mbs, tp, smooth=constants.smooth_profiles
            ).update
            seconds = optimizer_time(float(update[0]), held, info, tp, dp, experts, edp)
            step = max(step, seconds)
        sync = least_gradient_sync(allreduce, held, plan.dp, data.options)
        tails[s] = sync + step
    return True, tails


def candidate_fits(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    global_batch: int,
    c: Candidate,
    stash: bool = True,
) -> bool:
    """:func:`ranks_fit` of a candidate on one of its pipelines (its
    replicas alike, each rank's stash and model state do not depend on the
    placement; a mixture of experts' expert data parallelism is the
    candidate's, ``tp dp / (etp ep)``): no plan of ``P x dp`` replicas is
    built. ``stash``: as :func:`ranks_fit`'s."""
    one = dataclasses.replace(c, dp=1)
    skeleton = candidate_plan(data, model, global_batch // c.dp, one, experts=(1, None))
    ep, etp = data.model_info(model).expert_axes
    edp = c.tp * c.dp // ((c.tp if etp is None else etp) * ep)
    return ranks_fit(data, model, constants, skeleton, c.chunks, c.dp, edp, stash)
