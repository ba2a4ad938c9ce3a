"""The embedding's and the LM head's passes (layer 0 and layer ``L + 1`` of
the profiles' numbering), as operations priced by
:mod:`~pipedejavu.costmodel.analytical.roofline`; the blocks' are
:mod:`~pipedejavu.costmodel.analytical.ops`."""

from __future__ import annotations

import dataclasses

from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.ops import (
    GRAD_ACCUMULATE_BYTES,
    MASK_BYTES,
    LayerPass,
    MemoryOp,
    PassOptions,
    backward_gemms,
    element_bytes,
    linear_gemm,
    tp_collectives,
    tp_half,
)

__all__ = [
    "embedding_backward_ops",
    "embedding_forward_ops",
    "head_backward_ops",
    "head_forward_ops",
    "hidden_tensor_bytes",
]


def hidden_tensor_bytes(
    spec: TransformerSpec, opts: PassOptions
) -> tuple[float, float, float]:
    """``(x, local, act)``: bytes of one ``h``-wide tensor of the micro-batch,
    of its share on a GPU (``x / t`` with sequence parallelism), and the
    activation element's bytes."""
    act, _ = element_bytes(opts.precision)
    x = opts.mbs * spec.seq_length * spec.hidden_size * act
    return x, (x / opts.tp if opts.sequence_parallel else x), act


def embedding_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Word-embedding gather (vocabulary split over TP: masked, then summed
    by an all-reduce), position embedding, dropout."""
    x, local, act = hidden_tensor_bytes(spec, opts)
    ops: LayerPass = [MemoryOp("word_gather", 2 * x)]
    if opts.tp > 1:
        ops.append(MemoryOp("vocab_mask", 2 * x))
        ops += tp_half("embedding", x, opts, gather=False)
    if spec.position == "learned":
        ops += [
            MemoryOp("position_gather", 2 * local),
            MemoryOp("position_add", 3 * local),
        ]
    ops.append(MemoryOp("embedding_dropout", 2 * local + MASK_BYTES * local / act))
    return ops


def embedding_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Dropout backward and the dense scatter-add into the table's gradient."""
    x, _, act = hidden_tensor_bytes(spec, opts)
    table = spec.vocab_size / opts.tp * spec.hidden_size
    return [
        MemoryOp("embedding_dropout.backward", 2 * x + MASK_BYTES * x / act),
        MemoryOp("word_scatter_add", 2 * x + table * act),
        MemoryOp(
            "grad_accumulate", GRAD_ACCUMULATE_BYTES * spec.embedding_params(opts.tp)
        ),
    ]


def _head_parts(spec: TransformerSpec, opts: PassOptions):
    h, tokens = spec.hidden_size, opts.mbs * spec.seq_length
    head = linear_gemm("lm_head", tokens, spec.vocab_size / opts.tp, h, opts)
    # The loss works on fp32 logits in every precision.
    logits = tokens * spec.vocab_size / opts.tp * 4.0
    x, local, _ = hidden_tensor_bytes(spec, opts)
    return head, logits, x, local


def head_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Final norm, LM head (vocabulary split over TP), vocab-parallel softmax
    cross-entropy (max, exp, sum, normalize: 4 reads and 3 writes of the
    logits; three small all-reduces of per-token scalars)."""
    head, logits, x, local = _head_parts(spec, opts)
    ops: LayerPass = [MemoryOp("final_norm", 2 * local)]
    if opts.sequence_parallel and opts.tp > 1:
        ops += tp_half("lm_head", x, opts, gather=True)
    ops += [head, MemoryOp("cross_entropy", 7 * logits)]
    if opts.tp > 1:
        per_token = x / spec.hidden_size / (head.output_bytes / 4.0)
        for name in ("max", "target", "sum"):
            ops += [
                c
                for c in tp_collectives(
                    f"loss_{name}",
                    per_token,
                    dataclasses.replace(
                        opts, sequence_parallel=False, tp_comm_overlap=False
                    ),
                )
            ]
    return ops


def head_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Cross-entropy backward (softmax minus one-hot, times the loss
    gradient), both LM-head gradient GEMMs, the all-reduce of the head's input
    gradient, the final norm's backward and the weight-gradient accumulation."""
    head, logits, x, local = _head_parts(spec, opts)
    ops: LayerPass = [MemoryOp("cross_entropy.backward", 4 * logits)]
    ops += backward_gemms(head)
    ops += tp_half("lm_head", x, opts, gather=False)
    ops += [
        MemoryOp("final_norm.backward", 3 * local),
        MemoryOp(
            "grad_accumulate",
            GRAD_ACCUMULATE_BYTES * spec.head_params(opts.tp, tied_copy=True),
        ),
    ]
    return ops
