"""FLOPs and bytes of every operation of a Megatron-style transformer layer.

A layer pass (the forward or the backward of the embedding, of a block, or of
the head with its loss, for one micro-batch on one GPU of a tensor-parallel
group) is a list of operations of three kinds:

* :class:`Gemm`: a (batched) matrix product ``[batch] x (m x k) @ (k x n)``:
  ``2 * batch * m * n * k`` FLOPs; bytes = both inputs read and the output
  written once.
* :class:`MemoryOp`: an element-wise or reduction kernel (norm, activation,
  softmax, dropout, residual add, gather, cross-entropy, Adam): bytes moved.
* :class:`Collective`: a tensor-parallel collective over the group's ``t``
  GPUs, as the bytes each GPU sends over its link in a ring (all-reduce
  ``2 (t - 1) / t`` of the message, all-gather and reduce-scatter
  ``(t - 1) / t`` of the gathered message).

The splits are Megatron-LM's: the QKV and the first MLP matrix are
column-parallel (their outputs split over ``t``), the output projection and the
second MLP matrix row-parallel (an all-reduce after each, forward and backward:
2 + 2 per block); attention heads split over ``t``; the embedding and the LM
head split the vocabulary. With sequence parallelism the norms, dropouts and
residual adds work on ``s / t`` tokens and each all-reduce becomes an
all-gather plus a reduce-scatter (Korthikanti et al., MLSys'23).

A backward GEMM pass is two GEMMs per forward GEMM (input gradient and weight
gradient, or the two operand gradients of an attention product), so twice the
forward FLOPs. Without flash attention the ``b a s^2 / t`` score matrix is
written and read by the mask, the softmax and the dropout (and their
backwards); with flash attention it never reaches memory and the backward pass
recomputes the scores (2.5x the forward FLOPs; causal masking skips half of
both).

Units: FLOPs, bytes. All functions are pure; shapes come from a
:class:`~pipedejavu.core.transformer.TransformerSpec`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from pipedejavu.core.gpu_sheet import PRECISIONS, Precision
from pipedejavu.core.transformer import TransformerSpec

__all__ = [
    "Collective",
    "Gemm",
    "LayerPass",
    "MemoryOp",
    "PassOptions",
    "attention_core_backward_ops",
    "attention_core_forward_ops",
    "backward_gemms",
    "block_backward_ops",
    "block_forward_ops",
    "eager_elementwise",
    "element_bytes",
    "linear_gemm",
    "optimizer_ops",
    "tp_collectives",
    "tp_half",
    "validate_spec",
]

#: Bytes of a dropout mask element (PyTorch keeps a bool per element).
MASK_BYTES = 1
#: Bytes per parameter moved by one fused Adam step: read weight, gradient and
#: both moments, write weight and both moments (fp32 each).
ADAM_FP32_BYTES = 28
#: With 16-bit training the step also writes the 16-bit copy of the weight.
ADAM_MIXED_BYTES = 30
#: Bytes per element of a weight gradient accumulated in fp32 (read + write).
GRAD_ACCUMULATE_BYTES = 8
#: Causal attention with flash attention skips the masked half of the blocks.
FLASH_CAUSAL_FRACTION = 0.5
#: Flash attention's backward pass: 5 attention products (the recomputed scores,
#: dV, dP, dQ, dK) against the forward's 2.
FLASH_BACKWARD_FACTOR = 2.5


class Gemm(NamedTuple):
    """``batch`` products of ``(m x k) @ (k x n)``.

    Attributes:
        name: what it computes (``qkv``, ``scores``, ``mlp_up.wgrad``, ...).
        batch, m, n, k: the shape.
        input_bytes: bytes per element of both inputs.
        output_bytes: bytes per element of the output.
        precision: the precision whose peak the product runs at.
        fraction: the share of the product's FLOPs actually computed (causal
            flash attention skips half the blocks).
        io_bytes: the bytes the kernel moves, where they are not the inputs and
            the output (a fused attention kernel); ``None``: computed.
        attention: the products of a fused (flash) attention kernel, ``batch``
            of them per pass, ``m`` queries by ``n`` keys of depth ``k``:
            priced by the fused-attention rule of
            :func:`~pipedejavu.costmodel.analytical.roofline.stacked_seconds`
            (its softmax work, its tiles, its own floor and exponent), not
            the GEMM curve.
    """

    name: str
    batch: float
    m: float
    n: float
    k: float
    input_bytes: float
    output_bytes: float
    precision: Precision
    fraction: float = 1.0
    io_bytes: float | None = None
    attention: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k * self.fraction

    @property
    def bytes(self) -> float:
        if self.io_bytes is not None:
            return self.io_bytes
        inputs = self.batch * (self.m * self.k + self.k * self.n)
        return inputs * self.input_bytes + self.batch * self.m * self.n * (
            self.output_bytes
        )


class MemoryOp(NamedTuple):
    """A memory-bound kernel moving ``bytes`` (reads plus writes)."""

    name: str
    bytes: float


class Collective(NamedTuple):
    """A collective of the tensor-parallel group.

    Attributes:
        name: ``all_reduce``, ``all_gather`` or ``reduce_scatter`` and where.
        message_bytes: the full (reduced or gathered) tensor's bytes.
        link_bytes: bytes each GPU sends over its link (ring algorithm).
        beside: the GEMM of the same pass this collective runs beside
            (Transformer Engine's TP-communication overlap); empty: on the
            critical path.
        chunks: the chunks it is pipelined in beside that GEMM (the TP
            degree).
    """

    name: str
    message_bytes: float
    link_bytes: float
    beside: str = ""
    chunks: int = 1


LayerPass = list[Gemm | MemoryOp | Collective]


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """What a pass depends on besides the model.

    Args:
        mbs: micro-batch size ``b`` (samples).
        tp: tensor-parallel degree ``t`` (must divide the heads, the query
            groups, the MLP width and the vocabulary).
        precision: the training precision: ``fp32`` (CUDA-core GEMMs), ``tf32``
            (fp32 storage, tensor-core GEMMs), ``fp16``/``bf16`` (16-bit
            everything), ``fp8`` (fp8 GEMM inputs of the linear layers, bf16
            activations and attention).
        flash_attention: attention without the ``s x s`` matrix in memory.
        sequence_parallel: Megatron's sequence parallelism (needs ``tp > 1`` to
            matter).
        attention_dropout: a dropout on the attention probabilities, only
            without flash attention, where it reads and writes the ``s x s``
            matrix once more. Off by default: modern recipes use none, and the
            bundled fp32 profiles fit better without it (see
            :mod:`pipedejavu.costmodel.analytical.calibrate`).
        query_key_layer_scaling: Megatron's ``apply_query_key_layer_scaling``
            (its default in the Megatron-DeepSpeed the bundled profiles ran):
            without the fused 16-bit softmax kernel, the scores are multiplied
            by the coefficient in a kernel of their own, forward and backward.
        context_parallel: Megatron's context parallelism ``c``: the spec's
            ``seq_length`` is a GPU's share of each sequence (``s / c``
            tokens), whose queries attend to the keys and values of the whole
            sequence (``s`` = ``c`` x the share, causal and load-balanced as
            Transformer Engine splits it); needs flash attention. The exchange
            of keys and values between the ``c`` GPUs runs beside the
            attention it feeds (:func:`context_exchange`).
        tp_comm_overlap: Megatron-LM's ``--tp-comm-overlap`` (needs
            ``sequence_parallel``): each block's all-gathers run beside the
            GEMM they feed and its reduce-scatters beside the GEMM they follow
            (forward: QKV, MLP up; output projection, MLP down; backward: the
            input-gradient GEMMs of the same four), pipelined in ``tp``
            chunks: a collective costs what outlasts its GEMM, never less than
            one chunk (:func:`~pipedejavu.costmodel.analytical.roofline.
            stacked_seconds`). The LM head's and the embedding's stay exposed
            (they are not Transformer Engine layers).
        eager: the block's element-wise kernels as eager PyTorch runs a
            Llama block, unfused (:func:`eager_elementwise`); else fused, as
            Transformer Engine and ``torch.compile`` run them.
    """

    mbs: int
    tp: int
    precision: Precision = "bf16"
    flash_attention: bool = True
    sequence_parallel: bool = False
    attention_dropout: bool = False
    query_key_layer_scaling: bool = False
    context_parallel: int = 1
    tp_comm_overlap: bool = False
    eager: bool = False

    def __post_init__(self) -> None:
        if self.context_parallel > 1 and not self.flash_attention:
            raise ValueError("context parallelism needs flash attention")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap needs sequence_parallel")
        for name in ("mbs", "tp", "context_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)}, got "
                f"{self.precision!r}"
            )


def element_bytes(precision: Precision) -> tuple[float, float]:
    """``(activation_bytes, linear_gemm_input_bytes)`` per element."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    activation = 4.0 if precision in ("fp32", "tf32") else 2.0
    return activation, (1.0 if precision == "fp8" else activation)


def validate_spec(spec: TransformerSpec, tp: int = 1) -> None:
    """``ValueError`` unless ``spec`` splits ``tp`` ways: its own rule
    (:meth:`~pipedejavu.core.transformer.TransformerSpec.check_tp`; the fields
    were checked when it was built), and a vocabulary the head splits evenly
    (price :meth:`~pipedejavu.core.transformer.TransformerSpec.padded_vocab_size`
    rows, as Megatron-LM pads them)."""
    spec.check_tp(tp)
    if spec.vocab_size % tp:
        raise ValueError(
            f"{spec.name}: tp {tp} must divide vocab_size {spec.vocab_size}"
        )


# ------------------------------------------------------------------ helpers
def _attention_precision(precision: Precision) -> Precision:
    # fp8 recipes (Transformer Engine) keep the attention products in bf16.
    return "bf16" if precision == "fp8" else precision


def _kv_heads(spec: TransformerSpec, tp: int) -> float:
    """Key/value heads one GPU holds (replicated when ``tp`` exceeds them)."""
    return max(spec.num_query_groups / tp, 1.0)


def _core_dims(spec: TransformerSpec, tp: int) -> tuple[float, float, float]:
    """``(query/key depth, value depth, key/value heads)`` of one GPU's
    attention core: multi-latent attention's keys carry the rotary part and
    every head its own keys and values."""
    mla = spec.mla
    if mla is None:
        return spec.head_dim, spec.head_dim, _kv_heads(spec, tp)
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    return qk, mla.v_head_dim, spec.num_attention_heads / tp


def _softmax_passes(act: float, opts: PassOptions) -> int:
    # Megatron's fused scale-mask-softmax kernel takes 16-bit inputs only; in
    # fp32 the mask and the softmax are two PyTorch kernels, plus a third that
    # multiplies by the query-key layer-scaling coefficient where it is on.
    if act != 4.0:
        return 1
    return 3 if opts.query_key_layer_scaling else 2


def tp_collectives(
    where: str, message_bytes: float, opts: PassOptions, beside: str = ""
) -> list[Collective]:
    """One all-reduce of ``message_bytes`` (or the all-gather/reduce-scatter
    pair that replaces it with sequence parallelism); empty for ``tp == 1``.
    With ``opts.tp_comm_overlap`` the pair runs beside the GEMM ``beside``
    (a caller keeps the one of the pair that GEMM feeds or follows)."""
    t = opts.tp
    if t == 1:
        return []
    share = (t - 1) / t * message_bytes
    if opts.sequence_parallel:
        gemm, chunks = (beside, t) if opts.tp_comm_overlap and beside else ("", 1)
        return [
            Collective(f"reduce_scatter.{where}", message_bytes, share, gemm, chunks),
            Collective(f"all_gather.{where}", message_bytes, share, gemm, chunks),
        ]
    return [Collective(f"all_reduce.{where}", message_bytes, 2.0 * share)]


def tp_half(
    where: str, message_bytes: float, opts: PassOptions, beside: str = "", *, gather
) -> list[Collective]:
    """One side of :func:`tp_collectives`: its all-gather (``gather``: before
    a column-parallel GEMM; none without sequence parallelism), or the other,
    its reduce-scatter or all-reduce (after a row-parallel GEMM, or a
    column-parallel GEMM's input gradient)."""
    pair = tp_collectives(where, message_bytes, opts, beside)
    return [c for c in pair if ("gather" in c.name) == gather]


def linear_gemm(
    name: str, tokens: float, n: float, k: float, opts: PassOptions
) -> Gemm:
    act, gemm_in = element_bytes(opts.precision)
    return Gemm(name, 1.0, tokens, n, k, gemm_in, act, opts.precision)


def backward_gemms(gemm: Gemm) -> list[Gemm]:
    """Input gradient ``dY @ W^T`` (m x k) and weight gradient ``X^T @ dY``
    (k x n); same FLOPs each as the forward."""
    return [
        gemm._replace(name=gemm.name + ".dgrad", n=gemm.k, k=gemm.n),
        gemm._replace(name=gemm.name + ".wgrad", m=gemm.k, n=gemm.n, k=gemm.m),
    ]


# ------------------------------------------------------------------- block
def attention_core_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """The attention core's forward: scores, mask, softmax, dropout, context
    (what selective recomputation reruns)."""
    b, s, t = opts.mbs, spec.seq_length, opts.tp
    heads, (dqk, dv, kv_heads) = spec.num_attention_heads / t, _core_dims(spec, t)
    precision = _attention_precision(opts.precision)
    act, _ = element_bytes(precision)
    if opts.flash_attention:
        # One fused kernel: both products (scores, of depth dqk, and context,
        # of depth dv: two of their mean depth), reading Q, K, V and writing
        # the output; with context parallelism the local queries meet the keys
        # and values of the whole sequence.
        keys = s * opts.context_parallel
        io = b * (dqk + dv) * (heads * s + kv_heads * keys) * act
        return [*context_exchange(b * s * kv_heads * (dqk + dv) * act, opts)] + [
            Gemm(
                "flash_attention",
                2 * b * heads,
                s,
                keys,
                (dqk + dv) / 2,
                act,
                act,
                precision,
                FLASH_CAUSAL_FRACTION,
                io,
                attention=True,
            ),
        ]
    scores = b * heads * s * s
    passes = _softmax_passes(act, opts)
    ops: LayerPass = [
        Gemm("scores", b * heads, s, s, dqk, act, act, precision),
        MemoryOp("mask_softmax", passes * 2 * scores * act),
    ]
    if opts.attention_dropout:
        ops.append(MemoryOp("attention_dropout", scores * (2 * act + MASK_BYTES)))
    return ops + [
        Gemm("context", b * heads, s, dv, s, act, act, precision),
        MemoryOp("context_layout", 2 * b * s * heads * dv * act),
    ]


def context_exchange(share_bytes: float, opts: PassOptions) -> LayerPass:
    """Context parallelism's exchange of keys and values for one attention
    core's forward (``share_bytes``: a GPU's keys and values of its share):
    each GPU receives the ``c - 1`` other shares, in ``c`` steps of a ring
    beside the fused attention they feed (Megatron's ``--cp-comm-type p2p``,
    PyTorch's ring attention): what outlasts the kernel is paid, never less
    than one step. None without context parallelism. The backward
    (:func:`attention_core_backward_ops`) moves the keys and values again and
    their gradients back: twice the bytes. The ring is priced on the node's
    links (a group of ``tp x c`` GPUs within a node)."""
    c = opts.context_parallel
    if c == 1:
        return []
    return [
        Collective(
            "cp_kv_exchange",
            c * share_bytes,
            (c - 1) * share_bytes,
            beside="flash_attention",
            chunks=c,
        )
    ]


def _block_parts(spec: TransformerSpec, opts: PassOptions):
    if spec.mla is not None:  # its projections: mla_ops
        raise ValueError(f"model {spec.name}: multi-latent attention: see mla_ops")
    b, s, t, h = opts.mbs, spec.seq_length, opts.tp, spec.hidden_size
    act, _ = element_bytes(opts.precision)
    tokens = b * s
    local = tokens / t if opts.sequence_parallel else tokens  # norm/dropout tokens
    q = spec.num_attention_heads * spec.head_dim / t
    kv = 2 * _kv_heads(spec, t) * spec.head_dim
    f = spec.ffn_hidden_size / t
    gated = 2 if spec.gated_mlp else 1
    gemms = {
        "qkv": linear_gemm("qkv", tokens, q + kv, h, opts),
        "out_proj": linear_gemm("out_proj", tokens, h, q, opts),
        "mlp_up": linear_gemm("mlp_up", tokens, gated * f, h, opts),
        "mlp_down": linear_gemm("mlp_down", tokens, h, f, opts),
    }
    message = tokens * h * act
    return gemms, local * h * act, local * h, tokens * f * act, message, act


#: Bytes per element eager PyTorch moves beyond the fused kernels, in a
#: 16-bit Llama block (torchtitan's model code; counted kernel by kernel, not
#: fitted): an RMSNorm casts to fp32, squares, averages, scales, casts back and
#: multiplies by its weight (36 bytes an element forward, about 74 backward,
#: against 4 and 6 fused); the rotary embedding of the queries and keys casts
#: to fp32, multiplies as complex numbers and casts back (about 20 bytes an
#: element each way, against 4); SwiGLU's SiLU and product are two kernels
#: (10 bytes an element of the MLP's width forward, 16 backward, against 6 and
#: 10). Keys: norm, rope, swiglu; values: (forward, backward).
EAGER_EXTRA_BYTES = {"norm": (32.0, 68.0), "rope": (16.0, 16.0), "swiglu": (4.0, 6.0)}


def eager_elementwise(
    spec: TransformerSpec, opts: PassOptions, *, backward: bool
) -> LayerPass:
    """The memory traffic eager PyTorch adds to a dense block's pass beyond
    the fused kernels (:data:`EAGER_EXTRA_BYTES`: its two norms, the rotary
    embedding of the queries and keys, SwiGLU), one memory-bound operation;
    none unless ``opts.eager`` and 16-bit activations."""
    if not opts.eager or element_bytes(opts.precision)[0] != 2.0:
        return []
    _, _, x_elems, f_bytes, _, act = _block_parts(spec, opts)
    tokens = opts.mbs * spec.seq_length
    rotated = (
        tokens
        * spec.head_dim
        * (spec.num_attention_heads / opts.tp + _kv_heads(spec, opts.tp))
    )
    k = 1 if backward else 0
    extra = (
        2 * x_elems * EAGER_EXTRA_BYTES["norm"][k]
        + rotated * EAGER_EXTRA_BYTES["rope"][k]
        + f_bytes / act * EAGER_EXTRA_BYTES["swiglu"][k]
    )
    return [MemoryOp("eager_elementwise" + (".backward" if backward else ""), extra)]


def block_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """One transformer block's forward pass (TP collectives included)."""
    gemms, x_bytes, x_elems, f_bytes, message, act = _block_parts(spec, opts)
    gated = spec.gated_mlp
    ops: LayerPass = [MemoryOp("input_norm", 2 * x_bytes)]
    ops += tp_half("qkv", message, opts, "qkv", gather=True)
    ops.append(gemms["qkv"])
    ops += attention_core_forward_ops(spec, opts)
    ops.append(gemms["out_proj"])
    ops += tp_half("out_proj", message, opts, "out_proj", gather=False)
    ops += [
        MemoryOp("bias_dropout_add.attention", 3 * x_bytes + MASK_BYTES * x_elems),
        MemoryOp("post_attention_norm", 2 * x_bytes),
    ]
    ops += tp_half("mlp_up", message, opts, "mlp_up", gather=True)
    ops += [
        gemms["mlp_up"],
        MemoryOp("swiglu" if gated else "gelu", (3 if gated else 2) * f_bytes),
        gemms["mlp_down"],
    ]
    ops += tp_half("mlp_down", message, opts, "mlp_down", gather=False)
    ops.append(MemoryOp("bias_dropout_add.mlp", 3 * x_bytes + MASK_BYTES * x_elems))
    return ops + eager_elementwise(spec, opts, backward=False)


def attention_core_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """The attention core's backward (flash: one fused kernel)."""
    ops: LayerPass = []
    act, _ = element_bytes(_attention_precision(opts.precision))
    for op in attention_core_forward_ops(spec, opts):
        if isinstance(op, Gemm) and opts.flash_attention:
            # Recomputed scores, dV, dP, dQ, dK; reads Q, K, V, O, dO and
            # writes dQ, dK, dV.
            ops.append(
                op._replace(
                    name=op.name + ".backward",
                    batch=op.batch * FLASH_BACKWARD_FACTOR,
                    io_bytes=2 * op.io_bytes,
                )
            )
        elif isinstance(op, Gemm):
            ops += backward_gemms(op)
        elif isinstance(op, Collective):  # keys, values and their gradients
            ops.append(
                op._replace(
                    name=op.name + ".backward",
                    link_bytes=2 * op.link_bytes,
                    beside=op.beside + ".backward",
                )
            )
        elif op.name == "mask_softmax":
            # Softmax backward reads Y and dY and writes dX; the unfused mask's
            # backward reads and writes once more.
            scores = op.bytes / (2 * _softmax_passes(act, opts))
            ops.append(
                MemoryOp(
                    "mask_softmax.backward",
                    scores * (3 + 2 * (_softmax_passes(act, opts) - 1)),
                )
            )
        else:  # dropout (reads dY and the mask, writes dX), layout copy
            ops.append(op._replace(name=op.name + ".backward"))
    return ops


def block_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """One transformer block's backward pass: both gradient GEMMs of every
    product, the element-wise backwards, the weight-gradient accumulation and
    the TP collectives of the column-parallel inputs (2 all-reduces)."""
    gemms, x_bytes, x_elems, f_bytes, message, act = _block_parts(spec, opts)
    gated = spec.gated_mlp
    ops: LayerPass = [
        MemoryOp("bias_dropout_add.mlp.backward", 2 * x_bytes + MASK_BYTES * x_elems)
    ]
    ops += tp_half("mlp_down", message, opts, "mlp_down.dgrad", gather=True)
    ops += backward_gemms(gemms["mlp_down"])
    ops.append(
        MemoryOp(
            "swiglu.backward" if gated else "gelu.backward",
            (5 if gated else 3) * f_bytes,
        )
    )
    ops += backward_gemms(gemms["mlp_up"])
    ops += tp_half("mlp_up", message, opts, "mlp_up.dgrad", gather=False)
    ops += [
        MemoryOp("post_attention_norm.backward", 3 * x_bytes),
        MemoryOp(
            "bias_dropout_add.attention.backward", 2 * x_bytes + MASK_BYTES * x_elems
        ),
    ]
    ops += tp_half("out_proj", message, opts, "out_proj.dgrad", gather=True)
    ops += backward_gemms(gemms["out_proj"])
    ops += attention_core_backward_ops(spec, opts)
    ops += backward_gemms(gemms["qkv"])
    ops += tp_half("qkv", message, opts, "qkv.dgrad", gather=False)
    ops += [
        MemoryOp("input_norm.backward", 3 * x_bytes),
        MemoryOp(
            "grad_accumulate",
            GRAD_ACCUMULATE_BYTES * sum(spec.layer_param_split(opts.tp)[1]),
        ),
    ]
    return ops + eager_elementwise(spec, opts, backward=True)


# --------------------------------------------------------- embedding, head
def optimizer_ops(params: float, precision: Precision) -> LayerPass:
    """One fused Adam step over ``params`` parameters (fp32 master weights,
    gradients and moments; a 16-bit copy written back when training in
    16-bit or fp8)."""
    if params < 0:
        raise ValueError(f"params must be >= 0, got {params}")
    per_param = ADAM_FP32_BYTES if precision in ("fp32", "tf32") else ADAM_MIXED_BYTES
    return [MemoryOp("adam", per_param * params)]
