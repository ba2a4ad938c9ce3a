"""Sharded data parallelism's rules (ZeRO stages 2 and 3, FSDP2), each
defined once: what ZeRO-3 gathers and reduce-scatters per micro-batch, what
of it the passes hide, and the gathered modules' memory. The predictor
(:func:`~pipedejavu.costmodel.megatron.predictor.predict_plan`) calls them;
the model state's split into replicated and sharded bytes per stage is
:func:`~pipedejavu.costmodel.megatron.options.param_state_bytes`.

What a shard group is (``dp_shard x cp`` GPUs of a stage) is the layout's:
:attr:`~pipedejavu.core.layout.ParallelLayout.shard_group`. A plan with
context parallelism is priced as its sequence shares
(:func:`context_shares`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.placement import sequence_shares
from pipedejavu.core.plan3d import Plan3D, Replica
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.comm import ring_allreduce_time, ring_hops
from pipedejavu.costmodel.megatron.rules import rank_params
from pipedejavu.costmodel.megatron.sailor_data import ModelInfo, NetworkTables

__all__ = [
    "context_shares",
    "fsdp_buffer_bytes",
    "fsdp_collectives",
    "fsdp_exposed",
    "sharded_passes",
    "sharded_schedule",
]

Number = Any  # a float, or an array of one value per span


def fsdp_collectives(
    network: NetworkTables,
    info: ModelInfo,
    members: Sequence[Replica],
    nodes: list,
    held: float,
) -> tuple[float, float]:
    """``(gather, reduce)`` seconds per micro-batch of ZeRO-3 / FSDP2 over a
    shard group of ``members`` (on ``nodes``): the all-gather of the ``held``
    parameters' weights (``info.weight_bytes`` each) and the reduce-scatter of
    their gradients (``info.gradient_bytes`` each: torchtitan reduces in
    fp32). Each moves what half a ring all-reduce of its bytes moves (a ring
    all-reduce is a reduce-scatter and an all-gather). 0 for one member."""
    if len(members) <= 1 or held <= 0:
        return 0.0, 0.0
    hops = ring_hops(network, members, nodes)
    gather = ring_allreduce_time(
        network, members, nodes, held * info.weight_bytes, hops=hops
    )
    reduce = ring_allreduce_time(
        network, members, nodes, held * info.gradient_bytes, hops=hops
    )
    return gather / 2, reduce / 2


def fsdp_exposed(
    gather: Number,
    reduce: Number,
    forward: Number,
    backward: Number,
    units: Number,
    reshard: bool,
) -> tuple[Number, Number]:
    """``(forward, backward)`` seconds ZeRO-3's collectives add to a stage's
    passes of one micro-batch: each of its ``units`` sharded modules (its
    layers) gathers its weights before its forward, prefetched beside the
    previous module's (``gather``: the whole stage's all-gather), and again
    before its backward when ``reshard`` (FSDP2's ``reshard_after_forward``),
    and reduce-scatters its gradients after its backward, beside the next
    module's (``reduce``). The passes hide what they outlast; the first
    gather and the last reduce-scatter are never hidden: ``max(c - pass, c /
    units)`` for ``c`` seconds of collectives beside a pass."""
    units = np.maximum(units, 1)
    behind = reduce + (gather if reshard else 0.0)
    return (
        np.maximum(gather - forward, gather / units),
        np.maximum(behind - backward, behind / units),
    )


def fsdp_buffer_bytes(info: ModelInfo, held: Number, largest: Number) -> Number:
    """Bytes ZeRO-3's gathered modules hold at their peak on a GPU: the
    weights of the module running and of the one prefetched, and one
    module's unsharded gradient with its copy in the reduction's dtype
    (``largest``: the parameters of the stage's largest layer); without
    resharding (``info.reshard_after_forward`` off) the weights of every
    layer of the stage (``held``) stay gathered from the forward to the
    backward."""
    gathered = 2 * largest if info.reshard_after_forward else held + largest
    return gathered * info.weight_bytes + largest * (
        info.weight_bytes + info.gradient_bytes
    )


def sharded_passes(
    plan: Plan3D,
    info: ModelInfo,
    network: NetworkTables,
    nodes: list[list],
    spans: list,
    forward: NDArray[np.float64],
    backward: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """``(forward, backward, buffers)``: the seconds ZeRO-3 adds to each
    stage's passes of one micro-batch (f64[S, 1], :func:`fsdp_exposed` of
    :func:`fsdp_collectives` over the stage's first shard group: groups
    alike) and the bytes of its gathered modules (f64[S],
    :func:`fsdp_buffer_bytes`); ``forward``/``backward``: f64[S, dp] the
    passes' seconds without them, ``spans`` each rank's layers."""
    shard = plan.layout.shard_replicas
    stages = len(plan.stages)
    extra_f, extra_b = np.zeros((stages, 1)), np.zeros((stages, 1))
    buffers = np.zeros(stages)
    for s, stage in enumerate(plan.stages):
        tp = stage.replicas[0].tp
        held = rank_params(info, tp, spans[s])
        gather, reduce = fsdp_collectives(
            network, info, stage.replicas[:shard], nodes[s][:shard], held
        )
        extra_f[s], extra_b[s] = fsdp_exposed(
            gather,
            reduce,
            float(forward[s].min()),
            float(backward[s].min()),
            stage.stop - stage.start,
            info.reshard_after_forward,
        )
        largest = float(info.dense_params(tp)[stage.start : stage.stop].max())
        buffers[s] = fsdp_buffer_bytes(info, held, largest)
    return extra_f, extra_b, buffers


def sharded_schedule(info: ModelInfo, virtual_stages: int, zero_bubble: bool) -> bool:
    """Whether ``info`` prices ZeRO-3 (sharded parameters), which is priced
    with the 1F1B schedule only.

    Raises:
        ProblemError: ZeRO-3 with an interleaved or zero-bubble schedule.
    """
    if info.zero_stage == 3 and (virtual_stages > 1 or zero_bubble):
        raise ProblemError(
            "ZeRO-3 (sharded parameters) is priced with the 1F1B schedule "
            "only, not yet with interleaved or zero-bubble pipelines"
        )
    return info.zero_stage == 3


def context_shares(plan: Plan3D, data: Any) -> Plan3D:
    """``plan`` as the predictor prices it: with context parallelism ``c``,
    its sequence shares (:func:`~pipedejavu.core.placement.sequence_shares`),
    priced by a cost source of ``1 / c`` of each sequence
    (``data.context_parallel``, an
    :class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource`'s).

    Raises:
        ProblemError: the source prices another context parallelism.
    """
    cp, priced = plan.layout.cp, getattr(data, "context_parallel", 1)
    if cp != priced:
        raise ProblemError(
            f"the plan has context parallelism {cp}; the costs are for {priced} "
            "(a cost source of the sequences' shares: AnalyticalSource("
            "context_parallel=))"
        )
    gpu = plan.stages[0].replicas[0].gpu_type
    return sequence_shares(plan, data.gpu_spec(gpu).gpus_per_node)
