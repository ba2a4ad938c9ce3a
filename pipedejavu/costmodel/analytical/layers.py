"""Per-layer times and activation sizes of any model on any GPU, without
profiles.

Layers are numbered as the bundled profiles number them (see
:mod:`pipedejavu.core.transformer`): 0 the embedding, ``1..L`` the blocks,
``L + 1`` the final norm with the LM head and the loss, and the
multi-token-prediction depths (:mod:`~pipedejavu.costmodel.analytical.mtp_ops`:
Megatron-Core runs them on the last stage). Blocks with multi-latent attention
take its operations (:mod:`~pipedejavu.costmodel.analytical.mla_ops`). Times
are for one micro-batch on one GPU of a TP group, TP communication included,
like a Sailor profile entry.

Activation bytes follow Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (MLSys'23): per block
``s b h (34 + 5 a s / h)`` bytes in 16-bit without TP; with TP ``t``
``s b h (10 + 24 / t + 5 a s / (h t))``; with sequence parallelism
``s b h (34 / t + 5 a s / (h t))``; selective recomputation of the attention
core drops the ``5 a s / h`` term (the other modules, what each reruns and
does not keep: :mod:`~pipedejavu.costmodel.analytical.recompute`), full
recomputation keeps only the block's input. For
another element size ``e`` (4 in fp32) every stored tensor scales with ``e``
except the 1-byte dropout masks: ``34 = 16 e + 2`` and ``5 = 2 e + 1``, so fp32
needs ``66 + 9 a s / h``. Grouped-query attention and gated MLPs change the
tensors counted in ``24 / t`` (Q, K, V, the MLP's up-projections and
activation output) as the shapes say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry, Precision
from pipedejavu.core.training_options import TORCHTITAN_OP
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.edge_ops import (
    embedding_backward_ops,
    embedding_forward_ops,
    head_backward_ops,
    head_forward_ops,
)
from pipedejavu.costmodel.analytical.mla_ops import (
    MLA_WEIGHT_GRADIENT_OPS,
    any_block_backward_ops,
    any_block_forward_ops,
    mla_attention_elements,
    mla_up_proj_elements,
)
from pipedejavu.costmodel.analytical.mtp_ops import (
    MTP_WEIGHT_GRADIENT_OPS,
    mtp_kept_bytes,
    mtp_own_backward_ops,
    mtp_own_forward_ops,
    mtp_rerun_ops,
)
from pipedejavu.costmodel.analytical.ops import (
    MASK_BYTES,
    Collective,
    Gemm,
    LayerPass,
    MemoryOp,
    PassOptions,
    element_bytes,
    optimizer_ops,
    validate_spec,
)
from pipedejavu.costmodel.analytical.recompute import (
    Recompute,
    rerun_ops,
    selective_modules,
    separate_norms,
)
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    AnalyticalConstants,
    pass_seconds,
)

__all__ = [
    "WEIGHT_GRADIENT_OPS",
    "activation_bytes",
    "analytical_layer_times",
    "attention_core_forward_seconds",
    "block_forward_seconds",
    "block_rerun_ops",
    "is_weight_gradient",
    "layer_output_bytes",
    "pass_seconds_or_zero",
    "selective_forward_seconds",
    "torchtitan_op_kept",
    "weight_gradient_seconds",
]


def _options(
    spec: TransformerSpec, mbs: int, tp: int, precision: Precision, **knobs: Any
) -> PassOptions:
    """The pass options of ``knobs`` (:class:`~pipedejavu.costmodel.analytical.
    ops.PassOptions`' fields after ``precision``, its defaults), ``spec``
    checked against ``tp``."""
    opts = PassOptions(mbs, tp, precision, **knobs)
    validate_spec(spec, tp)
    return opts


def analytical_layer_times(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    mtp_recompute: Recompute = "none",
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    **knobs: Any,
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Forward, backward and optimizer-step seconds of every layer; the
    multi-token-prediction depths in the last layer, with the head
    (:mod:`~pipedejavu.costmodel.analytical.mtp_ops`).

    Args:
        spec: the model.
        gpu: the GPU type (its TP group stays inside one node).
        mbs: micro-batch size.
        tp: tensor-parallel degree.
        precision: ``fp32``, ``tf32``, ``fp16``, ``bf16`` or ``fp8`` (see
            :class:`~pipedejavu.costmodel.analytical.ops.PassOptions`).
        mtp_recompute: what the multi-token-prediction depths rerun in their
            backward (``full``: their projection, block and final norm, as
            Megatron's ``uniform`` method; selective modules: what they rerun
            of their block, :func:`block_rerun_ops`); the blocks'
            recomputation is the caller's.
        constants: the roofline's constants.
        knobs: the rest of the pass's options, by keyword: ``flash_attention``
            (default on), ``sequence_parallel``, ``attention_dropout``,
            ``query_key_layer_scaling``, ``context_parallel`` (``spec`` then
            holds a GPU's share of each sequence), ``tp_comm_overlap`` and
            ``eager``, each as
            :class:`~pipedejavu.costmodel.analytical.ops.PassOptions` reads it.

    Returns:
        ``(forward, backward, update)``: f64[L + 2] seconds per micro-batch on
        one GPU of the TP group; ``update`` is one Adam step over the layer's
        parameters held by that GPU (the head's without the depths').

    Raises:
        ValueError: bad sizes, a ``tp`` that does not divide the model, or a
            GPU without a peak for ``precision``.
        TypeError: a knob :class:`~pipedejavu.costmodel.analytical.ops.
            PassOptions` does not have.
    """
    opts = _options(spec, mbs, tp, precision, **knobs)

    def layer(
        forward: Callable[[TransformerSpec, PassOptions], LayerPass],
        backward: Callable[[TransformerSpec, PassOptions], LayerPass],
        params: float,
    ) -> tuple[float, float, float]:
        """One layer's three entries: its forward's and backward's seconds
        (the operations ``forward`` and ``backward`` build) and an Adam step's
        over its ``params`` held by a GPU, priced alike for every layer."""
        return (
            pass_seconds(forward(spec, opts), gpu, constants),
            pass_seconds(backward(spec, opts), gpu, constants),
            pass_seconds(optimizer_ops(params, precision), gpu, constants),
        )

    block = layer(
        any_block_forward_ops,
        any_block_backward_ops,
        sum(spec.layer_param_split(tp)[1]),
    )
    first = layer(
        embedding_forward_ops, embedding_backward_ops, spec.embedding_params(tp)
    )
    last = layer(
        head_forward_ops, head_backward_ops, spec.head_params(tp, tied_copy=True)
    )
    if spec.mtp_layers:
        forward, backward = _mtp_seconds(
            spec, opts, gpu, constants, mtp_recompute, block[0], block[1]
        )
        last = (last[0] + forward, last[1] + backward, last[2])
    rows = [_layer_row(spec, block[k], first[k], last[k]) for k in range(3)]
    return rows[0], rows[1], rows[2]


def _mtp_seconds(
    spec: TransformerSpec,
    opts: PassOptions,
    gpu: GpuSheetEntry,
    constants: AnalyticalConstants,
    recompute: Recompute,
    block_forward: float,
    block_backward: float,
) -> tuple[float, float]:
    """Forward and backward seconds of the multi-token-prediction depths: each
    its own operations plus a block priced as the spec's blocks (the last
    block's kind; :mod:`~pipedejavu.costmodel.analytical.moe_layers` puts an
    expert block's time in its place), its rerun in the backward; the
    block's seconds are given."""
    forward = pass_seconds(mtp_own_forward_ops(spec, opts), gpu, constants)
    backward = pass_seconds(mtp_own_backward_ops(spec, opts), gpu, constants)
    if recompute == "full":
        rerun = pass_seconds(mtp_rerun_ops(spec, opts), gpu, constants)
        backward += rerun + block_forward
    else:
        backward += pass_seconds_or_zero(
            block_rerun_ops(spec, opts, recompute), gpu, constants
        )
    depths = spec.mtp_layers
    return depths * (forward + block_forward), depths * (backward + block_backward)


def pass_seconds_or_zero(
    ops: LayerPass, gpu: GpuSheetEntry, constants: AnalyticalConstants
) -> float:
    """:func:`~pipedejavu.costmodel.analytical.roofline.pass_seconds` of
    ``ops``; 0 for no operations."""
    return pass_seconds(ops, gpu, constants) if ops else 0.0


def block_rerun_ops(
    spec: TransformerSpec, opts: PassOptions, recompute: Recompute
) -> LayerPass:
    """What selective recomputation reruns of one dense block's forward (any
    attention; :func:`~pipedejavu.costmodel.analytical.recompute.rerun_ops`);
    empty for ``"none"`` and ``"full"``."""
    ops = any_block_forward_ops(spec, opts)
    return rerun_ops(ops, recompute, spec, opts, expert=False)


def _layer_row(
    spec: TransformerSpec, block: float, first: float, last: float
) -> NDArray[np.float64]:
    """f64[L + 2]: the embedding's value, the blocks', the LM head's (the
    layer numbering of every per-layer row of this module)."""
    row = np.full(spec.num_layers + 2, block, dtype=np.float64)
    row[0], row[-1] = first, last
    return row


#: Backward operations that compute or accumulate weight gradients (the
#: ``W`` pass of a zero-bubble schedule): the weight-gradient GEMM of each
#: parameter matrix, the gradient accumulation and the embedding's scatter-add
#: into its table; the rest of a backward is its ``B``. The unfused attention
#: core's ``scores.wgrad`` and ``context.wgrad`` are not among them: they are
#: the gradients of K and V, activations the input gradient needs (found by
#: ``benchmarks/gpu_blocks.py --split``, whose input-gradient-only backward
#: runs them).
WEIGHT_GRADIENT_OPS = (
    "qkv.wgrad",
    "out_proj.wgrad",
    "mlp_up.wgrad",
    "mlp_down.wgrad",
    "lm_head.wgrad",
    "grad_accumulate",
    "word_scatter_add",
    *MLA_WEIGHT_GRADIENT_OPS,
    *MTP_WEIGHT_GRADIENT_OPS,
)


def is_weight_gradient(op: Gemm | MemoryOp | Collective) -> bool:
    """One of :data:`WEIGHT_GRADIENT_OPS`."""
    return op.name in WEIGHT_GRADIENT_OPS


def weight_gradient_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    **knobs: Any,
) -> NDArray[np.float64]:
    """f64[L + 2] seconds of each layer's weight-gradient operations
    (:func:`is_weight_gradient`): the part of :func:`analytical_layer_times`'
    backward that a zero-bubble schedule runs as its ``W`` pass (the roofline
    prices each operation on its own, so the two parts add up to the backward).

    Args and Raises: as :func:`analytical_layer_times`.
    """
    opts = _options(spec, mbs, tp, precision, **knobs)

    def seconds(ops: LayerPass) -> float:
        return pass_seconds([o for o in ops if is_weight_gradient(o)], gpu, constants)

    block = seconds(any_block_backward_ops(spec, opts))
    depths = spec.mtp_layers * (block + seconds(mtp_own_backward_ops(spec, opts)))
    return _layer_row(
        spec,
        block,
        seconds(embedding_backward_ops(spec, opts)),
        seconds(head_backward_ops(spec, opts)) + depths,
    )


def attention_core_forward_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    **knobs: Any,
) -> float:
    """Seconds of one block's attention core forward (scores, softmax,
    context): what selective recomputation of the ``core_attn`` module adds
    to each block's backward (:func:`selective_forward_seconds`)."""
    return selective_forward_seconds(
        spec,
        gpu,
        mbs,
        tp,
        precision,
        recompute=("core_attn",),
        constants=constants,
        **knobs,
    )


def selective_forward_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    recompute: Recompute = "selective",
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    **knobs: Any,
) -> float:
    """Seconds of what selective recomputation (``recompute``: its modules,
    ``"selective"`` the attention core) reruns of one dense block's forward
    (:func:`block_rerun_ops`): what it adds to each block's backward; 0 for
    ``"none"`` and ``"full"``.

    Args and Raises: as :func:`analytical_layer_times`.
    """
    opts = _options(spec, mbs, tp, precision, **knobs)
    return pass_seconds_or_zero(block_rerun_ops(spec, opts, recompute), gpu, constants)


def block_forward_seconds(
    spec: TransformerSpec,
    gpu: GpuSheetEntry,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    **knobs: Any,
) -> float:
    """Seconds of one block's forward: what full recomputation adds to each
    block's backward."""
    opts = _options(spec, mbs, tp, precision, **knobs)
    return pass_seconds(any_block_forward_ops(spec, opts), gpu, constants)


def activation_bytes(
    spec: TransformerSpec,
    mbs: int,
    tp: int,
    precision: Precision,
    *,
    recompute: Recompute = "none",
    sequence_parallel: bool = False,
    flash_attention: bool = False,
    attention_dropout: bool = True,
) -> NDArray[np.float64]:
    """Bytes a stage stashes per micro-batch for each layer until its backward.

    Args:
        spec, mbs, tp, precision: as :func:`analytical_layer_times`.
        recompute: ``none``, ``full`` (only the block's input is kept) or
            selective (:data:`~pipedejavu.costmodel.analytical.recompute.
            Recompute`: ``selective`` the attention core, whose ``s x s``
            tensors or softmax statistics are then not kept, or a tuple of
            modules): what each module does not keep of a dense block (module
            doc of :mod:`~pipedejavu.costmodel.analytical.recompute`) is not
            counted.
        sequence_parallel: the non-TP-split tensors (norm inputs, dropout
            masks) are split over ``tp`` too.
        flash_attention: no ``s x s`` tensors (only the per-row softmax
            statistics, fp32).
        attention_dropout: the attention dropout's mask and output are kept
            (Korthikanti et al. count them; the default reproduces their
            formula).

    Returns:
        f64[L + 2] bytes: the embedding keeps its dropout mask; a block the
        tensors above (multi-latent attention's own:
        :func:`~pipedejavu.costmodel.analytical.mla_ops.mla_attention_elements`);
        the head its norm input, its matrix input and the fp32 softmax of the
        logits, and the multi-token-prediction depths
        (:func:`~pipedejavu.costmodel.analytical.mtp_ops.mtp_kept_bytes`, each
        with a block of the spec's blocks).

    Raises:
        ValueError: a bad ``recompute``, or sizes as
            :func:`analytical_layer_times`.
    """
    modules = selective_modules(recompute)
    opts = _options(
        spec,
        mbs,
        tp,
        precision,
        flash_attention=flash_attention,
        sequence_parallel=sequence_parallel,
        attention_dropout=attention_dropout,
    )
    e, _ = element_bytes(precision)
    b, s, h, t = mbs, spec.seq_length, spec.hidden_size, tp
    tokens = b * s
    split = t if sequence_parallel else 1
    d = spec.head_dim
    kv_heads = max(spec.num_query_groups / t, 1.0)
    if recompute == "full":
        block = tokens * h * e / split
    else:
        # Norm inputs (2), QKV input, MLP input; the two hidden dropout masks.
        unsplit = tokens * h * (4 * e + 2 * MASK_BYTES) / split
        heads = spec.num_attention_heads / t
        up = spec.ffn_hidden_size / t * (2 if spec.gated_mlp else 1)
        if spec.mla is None:  # Q, K, V and the core's output
            attention = tokens * d * (2 * heads + 2 * kv_heads)
        else:
            attention = mla_attention_elements(spec, b, t, split)
        mlp = tokens * (up + spec.ffn_hidden_size / t)
        block = unsplit + (attention + mlp) * e
        if "core_attn" not in modules:
            if opts.flash_attention:
                block += b * heads * s * 4.0  # log-sum-exp per row, fp32
            else:
                per_score = e + (e + MASK_BYTES if attention_dropout else 0.0)
                block += b * heads * s * s * per_score
        # the norms' outputs: the input norm's where it is a module of its own
        norms = len(separate_norms(spec, expert=False)) if "layernorm" in modules else 0
        block -= norms * tokens * h * e / split
        if "mla_up_proj" in modules and spec.mla is not None:
            block -= mla_up_proj_elements(spec, b, t, split) * e
        if "mlp" in modules:  # its input is kept: its norm's output is not
            block -= (tokens * h / split + mlp) * e
        if TORCHTITAN_OP in modules:  # the block's input, the saved products
            block = torchtitan_op_kept(spec, b, t, split, e)
    embedding = tokens * h * MASK_BYTES / split
    head = 2 * tokens * h * e / split + tokens * spec.vocab_size / t * 4.0
    out = _layer_row(spec, block, embedding, head)
    if spec.mtp_layers:
        kept = mtp_kept_bytes(
            spec, opts, recompute, embedding=embedding, block=block, head=head
        )
        out[-1] += spec.mtp_layers * kept
    return out


def torchtitan_op_kept(
    spec: TransformerSpec, mbs: int, tp: int, split: int, element: float
) -> float:
    """Bytes a dense block keeps under torchtitan's ``"op"`` policy
    (:data:`~pipedejavu.costmodel.analytical.recompute.TORCHTITAN_OP_GEMMS`):
    its input (the checkpoint's, ``1 / split`` of it per GPU with sequence
    parallelism), the saved products' outputs (``wq``, ``wv``, ``w1``, and
    ``w2``'s partial sums, whole on every GPU of its TP group), the attention
    kernel's output and its fp32 log-sum-exp per query and head."""
    tokens = mbs * spec.seq_length
    d = spec.head_dim
    q = spec.num_attention_heads / tp * d
    v = max(spec.num_query_groups / tp, 1.0) * d
    f = spec.ffn_hidden_size / tp
    h = spec.hidden_size
    products = tokens * (h / split + 2 * q + v + f + h) * element
    return products + tokens * spec.num_attention_heads / tp * 4.0


def layer_output_bytes(
    spec: TransformerSpec, mbs: int, precision: Precision
) -> NDArray[np.float64]:
    """Bytes of each layer's output, the message to the next pipeline stage
    after it: ``b s h`` elements (the full tensor; each GPU of a TP group holds
    it), and the 4-byte loss after the head.

    Returns:
        f64[L + 2] bytes.
    """
    validate_spec(spec)
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        raise ValueError(f"mbs must be an integer >= 1, got {mbs!r}")
    e, _ = element_bytes(precision)
    message = mbs * spec.seq_length * spec.hidden_size * e
    return _layer_row(spec, message, message, 4.0)
