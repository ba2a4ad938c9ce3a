"""Multi-token prediction's operations (DeepSeek-V3; Megatron-LM's
``--mtp-num-layers``), one depth on one GPU for one micro-batch.

Megatron-Core (core_v0.16.1, ``MultiTokenPredictionBlock``) builds the depths
on the last pipeline stage (``mtp_on_this_rank`` without a custom pipeline
layout), beside the head: the cost model puts them in the last profile layer,
where :func:`~pipedejavu.core.moe_counts.layer_param_split` counts their
parameters. Each depth, on the ``T = b s`` tokens of a micro-batch over ``t``
GPUs, runs:

* the embedding of the tokens shifted by one (the shared table; the last
  stage holds its copy): :func:`~pipedejavu.costmodel.analytical.edge_ops.
  embedding_forward_ops`;
* the two input norms (``enorm`` on the embedding, ``hnorm`` on the previous
  depth's, or the decoder's, output) and their concatenation, on the tokens a
  GPU holds (``T / t`` with sequence parallelism);
* ``eh_proj``, column-parallel ``2h -> h`` (with sequence parallelism its
  input is all-gathered first), whose output is all-gathered over the last
  dimension (``gather_from_tensor_model_parallel_region``, whenever ``t >
  1``) and, with sequence parallelism, scattered back;
* one transformer block shaped as the model's last block (the caller's:
  dense, multi-latent, or an expert block with its all-to-alls);
* the final norm, the shared LM head and its cross-entropy:
  :func:`~pipedejavu.costmodel.analytical.edge_ops.head_forward_ops`.

The backward mirrors it, with the sum of the decoder output's two gradients
(the head's and the first depth's) and the accumulation of the depth's
projection and norm gradients. Full recomputation with Megatron's
``uniform`` method reruns each depth's projection, block and final norm
(``_checkpointed_forward``); with the ``block`` method Megatron-Core skips
the depths' recomputation; selective recomputation reruns what its modules
rerun of the depth's block, as of every block.
"""

from __future__ import annotations

import dataclasses

from pipedejavu.core import moe_counts
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.edge_ops import (
    embedding_backward_ops,
    embedding_forward_ops,
    head_backward_ops,
    head_forward_ops,
    hidden_tensor_bytes,
)
from pipedejavu.costmodel.analytical.ops import (
    GRAD_ACCUMULATE_BYTES,
    LayerPass,
    MemoryOp,
    PassOptions,
    backward_gemms,
    linear_gemm,
    tp_half,
)

__all__ = [
    "MTP_WEIGHT_GRADIENT_OPS",
    "mtp_kept_bytes",
    "mtp_own_backward_ops",
    "mtp_own_forward_ops",
    "mtp_projection_forward_ops",
    "mtp_rerun_ops",
]

#: The weight-gradient GEMM of a depth's projection.
MTP_WEIGHT_GRADIENT_OPS = ("mtp_eh_proj.wgrad",)


def _eh_proj(spec: TransformerSpec, opts: PassOptions):
    h = spec.hidden_size
    tokens = opts.mbs * spec.seq_length
    return linear_gemm("mtp_eh_proj", tokens, h / opts.tp, 2 * h, opts)


def _last_dim(opts: PassOptions) -> PassOptions:
    """The output's all-gather over the last dimension: an all-gather
    whatever the sequence parallelism."""
    return dataclasses.replace(opts, sequence_parallel=True, tp_comm_overlap=False)


def mtp_projection_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """A depth's norms, concatenation and ``eh_proj`` with their collectives
    (module doc): what full recomputation reruns before the block."""
    x, local, _ = hidden_tensor_bytes(spec, opts)
    ops: LayerPass = [
        MemoryOp("mtp_enorm", 2 * local),
        MemoryOp("mtp_hnorm", 2 * local),
        MemoryOp("mtp_concat", 4 * local),  # two h-wide reads, one 2h write
    ]
    ops += tp_half("mtp_eh_proj", 2 * x, opts, "mtp_eh_proj", gather=True)
    ops.append(_eh_proj(spec, opts))
    if opts.tp > 1:
        ops += tp_half("mtp_eh_proj_output", x, _last_dim(opts), gather=True)
        ops.append(MemoryOp("mtp_gather_layout", 2 * x))  # chunks to columns
    if opts.sequence_parallel and opts.tp > 1:
        ops.append(MemoryOp("mtp_scatter", 2 * local))
    return ops


def mtp_rerun_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """What full recomputation reruns of a depth besides its block's forward:
    :func:`mtp_projection_forward_ops` and the final norm."""
    norm = next(op for op in head_forward_ops(spec, opts) if op.name == "final_norm")
    return mtp_projection_forward_ops(spec, opts) + [norm]


def mtp_own_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """A depth's forward without its block: the shifted tokens' embedding,
    :func:`mtp_projection_forward_ops`, the final norm, LM head and loss."""
    return (
        embedding_forward_ops(spec, opts)
        + mtp_projection_forward_ops(spec, opts)
        + head_forward_ops(spec, opts)
    )


def mtp_own_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """A depth's backward without its block's: the loss, head and final norm
    (their gradients accumulated), the projection's (the scatter's backward
    an all-gather, the output gather's a split, the input gradient's
    reduction), the norms', the sum of the decoder output's gradients, the
    embedding's, and the accumulation of the projection's and norms'
    gradients."""
    x, local, _ = hidden_tensor_bytes(spec, opts)
    ops = head_backward_ops(spec, opts)
    if opts.sequence_parallel:
        ops += tp_half("mtp_scatter", x, opts, gather=True)
    if opts.tp > 1:
        ops.append(MemoryOp("mtp_split.backward", 2 * x / opts.tp))
    ops += backward_gemms(_eh_proj(spec, opts))
    ops += tp_half("mtp_eh_proj", 2 * x, opts, "mtp_eh_proj.dgrad", gather=False)
    ops += [
        MemoryOp("mtp_enorm.backward", 3 * local),
        MemoryOp("mtp_hnorm.backward", 3 * local),
        MemoryOp("mtp_hidden_grad_sum", 3 * local),
    ]
    last = spec.num_layers - 1
    own = moe_counts.mtp_param_split(spec, opts.tp)[0]
    own -= moe_counts.block_param_split(spec, last, opts.tp)[0]
    ops += embedding_backward_ops(spec, opts)
    return ops + [MemoryOp("grad_accumulate", GRAD_ACCUMULATE_BYTES * own)]


def mtp_kept_bytes(
    spec: TransformerSpec,
    opts: PassOptions,
    recompute: str | tuple[str, ...],
    *,
    embedding: float,
    block: float,
    head: float,
) -> float:
    """Bytes one depth keeps per micro-batch until its backward, given what
    the embedding, a block (of the last block's kind) and the head keep
    (:func:`~pipedejavu.costmodel.analytical.layers.activation_bytes`): those,
    plus the two norms' inputs and the projection's ``2h``-wide input. Under
    full recomputation (``uniform``) the checkpointed projection, block and
    final norm keep only their two inputs; the embedding and the LM head
    with its loss are outside the checkpoint. Selective recomputation
    (``recompute`` a tuple of modules, or ``"selective"``) changes only what
    ``block`` keeps."""
    _, local, _ = hidden_tensor_bytes(spec, opts)
    if recompute == "full":
        return embedding + 2 * local + head - local  # no final-norm input
    return embedding + 4 * local + block + head
