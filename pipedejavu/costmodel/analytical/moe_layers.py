"""Per-layer times of a mixture of experts: the expert blocks' rows, with the
expert-parallel all-to-alls priced where the EP group lies.

:func:`expert_layer_times` takes the rows
:func:`~pipedejavu.costmodel.analytical.layers.analytical_layer_times` gives
for the model's dense view (its dense blocks, embedding and head) and puts the
expert blocks' own in their places:

* each expert block's forward and backward from
  :func:`~pipedejavu.costmodel.analytical.moe_ops.expert_block_forward_ops` /
  :func:`~pipedejavu.costmodel.analytical.moe_ops.expert_block_backward_ops`
  priced by the roofline, and its optimizer step on its dense and local
  expert parameters;
* two all-to-alls in the forward (dispatch, combine) and two in the backward
  (their gradients), each :func:`alltoall_seconds` of the bytes a GPU sends
  (:func:`~pipedejavu.costmodel.analytical.moe_tokens.dispatch_bytes`,
  :func:`~pipedejavu.costmodel.analytical.moe_tokens.combine_bytes`);
* shared experts that run beside the all-to-alls
  (``--moe-shared-expert-overlap``): the pass without them, plus what of them
  outlasts the all-to-alls;
* with ``overlap_dispatch`` (Megatron-LM's ``--overlap-moe-expert-parallel-comm``:
  one micro-batch's all-to-alls beside another's compute in the 1F1B steady
  state) the all-to-alls cost what of them is not hidden: the constants'
  ``alltoall_hidden`` share of what the block's compute covers;
* each expert block pass ``expert_block_overhead_s`` more (the constants':
  the token counts' trip to the host, the dispatcher's bookkeeping); the
  all-to-alls reach ``alltoall_efficiency`` of the links.

Where the EP group lies (:func:`alltoall_seconds`): Megatron-Core lays an EP
group on ``etp x ep`` consecutive ranks (:class:`~pipedejavu.core.layout.
ParallelLayout`); when that fits a node the all-to-all runs over NVLink,
otherwise each GPU sends the share of its bytes bound for other nodes over
its share of the node's network, beside the rest over NVLink.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry, Precision
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import (
    block_rerun_ops,
    pass_seconds_or_zero,
)
from pipedejavu.costmodel.analytical.moe_ops import (
    expert_activation_bytes,
    expert_block_backward_ops,
    expert_block_forward_ops,
    overlapped_shared_ops,
)
from pipedejavu.costmodel.analytical.moe_tokens import (
    ExpertPass,
    combine_bytes,
    dispatch_bytes,
    expert_shape,
    miss_probability,
)
from pipedejavu.costmodel.analytical.ops import LayerPass, PassOptions, optimizer_ops
from pipedejavu.costmodel.analytical.recompute import (
    Recompute,
    rerun_ops,
    selective_modules,
)
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    AnalyticalConstants,
    pass_seconds,
)

__all__ = [
    "ExpertLayers",
    "alltoall_seconds",
    "dense_view",
    "expert_layer_activations",
    "expert_layer_times",
    "expert_rerun_seconds",
    "flex_seconds",
]


@dataclasses.dataclass(frozen=True)
class ExpertLayers:
    """How a source prices a mixture of experts' expert blocks.

    Args:
        experts: the expert layers' layout and kernels (:class:`ExpertPass`).
        overlap_dispatch: the all-to-alls run beside another micro-batch's
            compute (``--overlap-moe-expert-parallel-comm``).
    """

    experts: ExpertPass
    overlap_dispatch: bool = False


def dense_view(spec: TransformerSpec) -> TransformerSpec:
    """The model with its expert blocks read as dense ones (what prices the
    embedding, the head and the dense blocks of a mixture of experts)."""
    return dataclasses.replace(spec, moe=None)


def alltoall_seconds(
    nbytes: float, ep: int, etp: int, gpu: GpuSheetEntry, efficiency: float = 1.0
) -> float:
    """Seconds of one all-to-all in which each GPU of an EP group of ``ep``
    (``etp x ep`` consecutive ranks) sends ``nbytes`` to the others, evenly.

    Inside a node it runs at the GPU's NVLink bandwidth; spread over nodes of
    ``gpus_per_node``, each GPU has ``gpus_per_node / etp`` group members on
    its node and sends the rest's share of ``nbytes`` over its share of the
    node's network, both at once. ``efficiency``: the share of the links'
    bandwidth an all-to-all reaches.
    """
    if ep <= 1 or nbytes <= 0:
        return 0.0
    per_node = gpu.gpus_per_node
    intra = gpu.intra_node_bytes_per_s * efficiency
    if etp * ep <= per_node:
        return nbytes / intra
    near = max(per_node // etp, 1)  # group members on a GPU's node
    far = ep - near
    network = gpu.inter_node_bytes_per_s / per_node * efficiency
    return max(
        nbytes * (near - 1) / (ep - 1) / intra, nbytes * far / (ep - 1) / network
    )


def flex_seconds(
    spec: TransformerSpec,
    opts: PassOptions,
    experts: ExpertPass,
    gpu: GpuSheetEntry,
    efficiency: float = 1.0,
) -> float:
    """Seconds of one dispatch (or combine) of the ``flex`` dispatcher
    (DeepEP, HybridEP), whose group spans nodes: a token crosses to each other
    node holding one of its ``k`` experts once, over the GPU's share of the
    node's network, and is forwarded there over NVLink to the GPUs holding
    them (each GPU's NVLink carries its own node's share and what it forwards
    from every node), the two at once. Inside a node, :func:`alltoall_seconds`
    of :func:`~pipedejavu.costmodel.analytical.moe_tokens.dispatch_bytes`."""
    shape = expert_shape(spec, opts, experts)
    per_node = gpu.gpus_per_node
    sent = dispatch_bytes(spec, opts, experts)
    if shape.etp * experts.ep <= per_node:
        return alltoall_seconds(sent, experts.ep, shape.etp, gpu, efficiency)
    ranks = max(per_node // shape.etp, 1)  # EP ranks of a node
    nodes = -(-experts.ep // ranks)
    moe = spec.moe
    row = spec.hidden_size * shape.act
    node_miss = miss_probability(moe.num_experts, shape.local_experts * ranks, moe.topk)
    rank_miss = miss_probability(moe.num_experts, shape.local_experts, moe.topk)
    far = shape.tokens * row * (nodes - 1) * (1.0 - node_miss)
    near = shape.tokens * row * nodes * (ranks - 1) * (1.0 - rank_miss)
    network = gpu.inter_node_bytes_per_s / per_node * efficiency
    return max(far / network, near / (gpu.intra_node_bytes_per_s * efficiency))


def _block_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    opts: PassOptions,
    layers: ExpertLayers,
    constants: AnalyticalConstants,
    link_efficiency: float,
    recompute: Recompute = "none",
) -> tuple[float, float, float, float]:
    """``(forward, backward, recomputed forward, selective rerun)`` of one
    expert block: the last what ``recompute``'s selective modules rerun
    (:func:`~pipedejavu.costmodel.analytical.recompute.rerun_ops`), ``moe``
    priced as the forward prices the MoE layer, all-to-alls and pass
    overhead included."""
    experts = layers.experts
    etp = opts.tp if experts.etp is None else experts.etp
    efficiency = link_efficiency * constants.alltoall_efficiency
    if experts.dispatcher == "flex":
        one = 2 * flex_seconds(spec, opts, experts, gpu, efficiency)
    else:
        one = alltoall_seconds(
            dispatch_bytes(spec, opts, experts), experts.ep, etp, gpu, efficiency
        )
        one += alltoall_seconds(
            combine_bytes(spec, opts, experts), experts.ep, etp, gpu, efficiency
        )
    overhead = constants.expert_block_overhead_s

    def priced(ops: LayerPass) -> float:
        # shared experts beside the two all-to-alls: what outlasts them
        beside = overlapped_shared_ops(ops, experts)
        rest = [op for op in ops if op not in beside]
        return pass_seconds_or_zero(rest, gpu, constants) + max(
            pass_seconds_or_zero(beside, gpu, constants) - one, 0.0
        )

    forward_ops = expert_block_forward_ops(spec, opts, experts)
    forward = priced(forward_ops) + overhead
    backward = priced(expert_block_backward_ops(spec, opts, experts)) + overhead
    rerun = rerun_ops(forward_ops, recompute, spec, opts, expert=True)
    if "moe" in selective_modules(recompute):  # (its all-to-alls as forward's)
        selective = priced(rerun) + overhead + (0.0 if layers.overlap_dispatch else one)
    else:
        selective = pass_seconds_or_zero(rerun, gpu, constants)
    if layers.overlap_dispatch:
        # beside another micro-batch's compute: the hidden share of what the
        # compute covers
        a2a = 2 * one
        exposed = a2a - constants.alltoall_hidden * min(a2a, forward + backward)
        return forward, backward + exposed, forward, selective
    return forward + one, backward + one, forward + one, selective


def expert_rerun_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    opts: PassOptions,
    layers: ExpertLayers,
    recompute: Recompute,
    dense: NDArray[np.float64],
    *,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    link_efficiency: float = 1.0,
) -> NDArray[np.float64]:
    """f64[L + 2] seconds selective recomputation (``recompute``) adds to
    each layer's backward: ``dense`` (a dense block's, the dense view's)
    with each expert block's own (:func:`_block_seconds`)."""
    out = np.asarray(dense, dtype=np.float64).copy()
    moe = spec.moe
    if moe is None or not selective_modules(recompute):
        return out
    *_, selective = _block_seconds(
        spec, gpu, opts, layers, constants, link_efficiency, recompute
    )
    for block in range(spec.num_layers):
        if moe.is_expert_block(block):
            out[1 + block] = selective
    return out


def expert_layer_times(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    opts: PassOptions,
    layers: ExpertLayers,
    rows: tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]],
    precision: Precision,
    *,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    link_efficiency: float = 1.0,
    mtp_recompute: Recompute = "none",
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """``(forward, backward, update)`` rows (f64[L + 2]) of a mixture of
    experts: ``rows`` (the dense view's, module doc) with each expert block's
    own; ``backward`` without the blocks' recomputation (the caller adds it).
    Where the last block is an expert block, the multi-token-prediction
    depths in the last layer (priced in ``rows`` with the dense view's block
    and its rerun as ``mtp_recompute`` says: :func:`~pipedejavu.costmodel.
    analytical.layers.analytical_layer_times`) get the expert block's time
    and rerun in their place.

    Raises:
        ValueError: the model does not split over ``opts.tp`` and the
            experts' layout.
    """
    forward, backward, update = (row.copy() for row in rows)
    moe = spec.moe
    if moe is None:
        return forward, backward, update
    f, b, rerun, selective = _block_seconds(
        spec, gpu, opts, layers, constants, link_efficiency, mtp_recompute
    )
    last = spec.num_layers  # the last block's row
    if spec.mtp_layers and moe.is_expert_block(last - 1):
        depths = spec.mtp_layers
        forward[-1] += depths * (f - rows[0][last])
        backward[-1] += depths * (b - rows[1][last])
        if mtp_recompute == "full":
            backward[-1] += depths * (rerun - rows[0][last])
        elif selective_modules(mtp_recompute):  # in place of a dense block's
            dense = block_rerun_ops(dense_view(spec), opts, mtp_recompute)
            backward[-1] += depths * (
                selective - pass_seconds_or_zero(dense, gpu, constants)
            )
    experts = layers.experts
    pairs = spec.layer_param_split(opts.tp, experts.ep, experts.etp)
    steps: dict[int, float] = {}  # optimizer seconds by parameter count
    for block in range(spec.num_layers):
        if moe.is_expert_block(block):
            held = sum(pairs[1 + block])
            if held not in steps:  # (the expert blocks alike: priced once)
                ops = optimizer_ops(held, precision)
                steps[held] = pass_seconds(ops, gpu, constants)
            forward[1 + block], backward[1 + block] = f, b
            update[1 + block] = steps[held]
    return forward, backward, update


def expert_layer_activations(
    spec: TransformerSpec,
    opts: PassOptions,
    experts: ExpertPass,
    recompute: Recompute,
    dense: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Activation bytes per layer (f64[L + 2], one micro-batch of
    ``opts.mbs``): ``dense`` (:func:`~pipedejavu.costmodel.analytical.layers.
    activation_bytes` of the dense view) with each expert block's own
    (:func:`~pipedejavu.costmodel.analytical.moe_ops.expert_activation_bytes`),
    in the multi-token-prediction depths too where the last block is an expert
    block."""
    out = np.asarray(dense, dtype=np.float64).copy()
    moe = spec.moe
    if moe is None:
        return out
    kept = expert_activation_bytes(spec, opts, experts, recompute)
    last = spec.num_layers
    if spec.mtp_layers and moe.is_expert_block(last - 1) and recompute != "full":
        # the depths' blocks (a full recomputation keeps none of them)
        out[-1] += spec.mtp_layers * (kept - out[last])
    for block in range(spec.num_layers):
        if moe.is_expert_block(block):
            out[1 + block] = kept
    return out
