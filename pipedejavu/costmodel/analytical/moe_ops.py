"""One mixture-of-experts block's operations, its dispatch bytes and its
activations, on one GPU for one micro-batch.

An expert block is a transformer block whose MLP is Megatron-Core's
``MoELayer`` (core_v0.16.1): its attention half is the dense block's
(:func:`~pipedejavu.costmodel.analytical.mla_ops.any_block_forward_ops`, cut
after the pre-MLP norm: grouped-query or multi-latent attention), then, in
Megatron-Core's order:

* the shared experts (a dense MLP of ``shared_ffn_hidden_size`` split over
  ``tp``, with the dense MLP's sequence-parallel all-gather and
  reduce-scatter, and the sigmoid gate where the model has one); named
  ``shared_expert.*``;
* the router: ``T x E x h`` GEMM on the ``T`` tokens the GPU holds (``b s /
  tp``: Megatron-Core's MoE layer needs sequence parallelism when ``tp > 1``)
  in the activations' dtype (bf16 under fp8: the router is not a Transformer
  Engine layer), logits in fp32 with ``router_fp32`` (``--moe-router-dtype
  fp32``); softmax and top-k, memory-bound;
* the permutation of the ``T k`` routed copies (memory-bound), the
  expert-parallel all-to-all (not in the list: ``moe_tokens.dispatch_bytes``), with
  ``etp > 1`` the all-gather of the received tokens over the expert-TP group
  (Megatron's dispatcher uses ``expt_tp``, not the attention's TP group: with
  ``etp = 1`` there is no TP collective at all, whatever ``tp`` is), the sort
  by local expert;
* the ``E / ep`` local experts' GEMMs, each on ``n`` tokens
  (``moe_tokens.expert_tokens``) with width ``f / etp``: one batched GEMM with
  ``grouped_gemm`` (``TEGroupedMLP``), else one GEMM pair and activation per
  expert (``SequentialMLP``: each a kernel of its own, priced by the roofline's
  small-GEMM curve and per-kernel overhead); the activation applies the
  routing probabilities;
* the unsort, the reduce-scatter over expert-TP, the combine all-to-all (not in
  the list), the unpermutation, the sum with the shared experts' output.

The backward mirrors it: both gradient GEMMs of every product, the permutations
reversed, the expert-TP all-gather and reduce-scatter swapped, the sum of the
MoE input's gradients (router, routed and shared paths), the gradient
accumulation of the block's dense and expert parameters.

Not priced: the expert-parallel all-to-alls (the caller prices
:func:`~pipedejavu.costmodel.analytical.moe_tokens.dispatch_bytes` and
:func:`~pipedejavu.costmodel.analytical.moe_tokens.combine_bytes` where
the EP group lies), the load-balancing loss, the host synchronisation of
token counts, latent MoE.
"""

from __future__ import annotations

import dataclasses

from pipedejavu.core import moe_counts
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import activation_bytes
from pipedejavu.costmodel.analytical.mla_ops import (
    any_block_backward_ops,
    any_block_forward_ops,
)
from pipedejavu.costmodel.analytical.moe_tokens import (
    INDEX_BYTES,
    ROUTING_MAP_BYTES,
    ExpertPass,
    ExpertShape,
    expert_shape,
)
from pipedejavu.costmodel.analytical.ops import (
    GRAD_ACCUMULATE_BYTES,
    Collective,
    Gemm,
    LayerPass,
    MemoryOp,
    PassOptions,
    backward_gemms,
    linear_gemm,
    tp_collectives,
)
from pipedejavu.costmodel.analytical.recompute import (
    SHARED_EXPERT_PREFIX,
    Recompute,
    selective_modules,
)

__all__ = [
    "expert_activation_bytes",
    "expert_block_backward_ops",
    "expert_block_forward_ops",
    "overlapped_shared_ops",
]


# ------------------------------------------------------------ dense halves
def _dense_view(spec: TransformerSpec, width: int | None = None) -> TransformerSpec:
    """The spec's block as a dense block (its attention, multi-latent or not,
    an MLP of ``width``)."""
    return dataclasses.replace(
        spec,
        moe=None,
        mtp_layers=0,
        ffn_hidden_size=spec.ffn_hidden_size if width is None else width,
    )


def _index(ops: LayerPass, name: str) -> int:
    return next(i for i, op in enumerate(ops) if op.name == name)


def _prefixed(ops: LayerPass, prefix: str) -> LayerPass:
    out: LayerPass = []
    for op in ops:
        op = op._replace(name=prefix + op.name)
        if isinstance(op, Collective) and op.beside:
            op = op._replace(beside=prefix + op.beside)
        out.append(op)
    return out


def _halves(spec: TransformerSpec, opts: PassOptions, width: int | None = None):
    """``(attention, mlp, residual)`` of the dense view's forward and
    ``(residual, mlp, attention)`` of its backward (no accumulation)."""
    forward = any_block_forward_ops(_dense_view(spec, width), opts)
    backward = any_block_backward_ops(_dense_view(spec, width), opts)
    i = _index(forward, "post_attention_norm")
    j = _index(backward, "post_attention_norm.backward")
    return (
        (forward[: i + 1], forward[i + 1 : -1], forward[-1]),
        (backward[0], backward[1:j], backward[j:-1]),
    )


def _activation_rate(mlp: LayerPass, tokens: float, width: float) -> float:
    """Bytes the dense MLP's activation kernel moves per element of its
    output (the rule of :mod:`~pipedejavu.costmodel.analytical.ops`)."""
    kernel = next(op for op in mlp if isinstance(op, MemoryOp))
    return kernel.bytes / (tokens * width)


# ----------------------------------------------------------------- experts
def _shared_forward(spec, opts, shape: ExpertShape) -> LayerPass:
    moe, h = spec.moe, spec.hidden_size
    if not moe.shared_ffn_hidden_size:
        return []
    (_, mlp, _), _ = _halves(spec, opts, moe.shared_ffn_hidden_size)
    ops = _prefixed(mlp, SHARED_EXPERT_PREFIX)
    if moe.shared_expert_gate:
        t, e = shape.tokens, shape.act
        ops += [
            linear_gemm("shared_expert.gate", t, 1, h, _router_opts(opts)),
            MemoryOp("shared_expert.gate_mul", 2 * t * h * e + 2 * t * e),
        ]
    return ops


def _shared_backward(spec, opts, shape: ExpertShape) -> LayerPass:
    moe, h = spec.moe, spec.hidden_size
    if not moe.shared_ffn_hidden_size:
        return []
    _, (_, mlp, _) = _halves(spec, opts, moe.shared_ffn_hidden_size)
    ops: LayerPass = []
    if moe.shared_expert_gate:
        t, e = shape.tokens, shape.act
        gate = linear_gemm("shared_expert.gate", t, 1, h, _router_opts(opts))
        ops += [MemoryOp("shared_expert.gate_mul.backward", 3 * t * h * e + 3 * t * e)]
        ops += backward_gemms(gate)
    return ops + _prefixed(mlp, SHARED_EXPERT_PREFIX)


def _router_opts(opts: PassOptions) -> PassOptions:
    # fp8 recipes run Transformer Engine's layers in fp8; the router and the
    # shared experts' gate are plain GEMMs in the activations' dtype.
    return (
        dataclasses.replace(opts, precision="bf16") if opts.precision == "fp8" else opts
    )


def _router(spec, opts, shape: ExpertShape) -> Gemm:
    gemm = linear_gemm(
        "router",
        shape.tokens,
        spec.moe.num_experts,
        spec.hidden_size,
        _router_opts(opts),
    )
    return gemm._replace(output_bytes=shape.router)


def _expert_gemms(spec, opts, shape: ExpertShape, experts: ExpertPass):
    """``(fc1, fc2, per_kernel, kernels)``: the GEMMs of the local experts (one
    batched GEMM each, or one per expert)."""
    h, width = spec.hidden_size, spec.moe.ffn_hidden_size / shape.etp
    gated = 2 if spec.gated_mlp else 1
    n, experts_here = shape.per_expert, shape.local_experts
    batch, kernels = (experts_here, 1) if experts.grouped_gemm else (1, experts_here)
    fc1 = linear_gemm("expert_fc1", n, gated * width, h, opts)._replace(batch=batch)
    fc2 = linear_gemm("expert_fc2", n, h, width, opts)._replace(batch=batch)
    return fc1, fc2, batch * n * width, kernels


def _etp_collectives(opts, shape: ExpertShape, experts: ExpertPass, h: int) -> dict:
    """The expert-TP all-gather of the received tokens (and probabilities) and
    the reduce-scatter of the experts' output (in the probabilities' dtype),
    alltoall dispatcher only; empty with ``etp = 1``."""
    if experts.dispatcher != "alltoall" or shape.etp == 1:
        return {}
    rows = shape.local_experts * shape.per_expert
    group = dataclasses.replace(
        opts, tp=shape.etp, sequence_parallel=True, tp_comm_overlap=False
    )
    gather = tp_collectives("experts", rows * (h * shape.act + shape.router), group)
    scatter = tp_collectives("experts", rows * h * shape.router, group)
    return {"gather": gather[1], "scatter": scatter[0]}


def _permutations(spec, shape: ExpertShape, experts: ExpertPass) -> dict[str, float]:
    """Bytes of the forward permutation kernels."""
    h, e = spec.hidden_size, shape.act
    rows = shape.local_experts * shape.per_expert
    if experts.dispatcher != "alltoall":  # local selection after the gather
        return {
            "moe_permute": 2 * rows * h * e + rows * (shape.router + INDEX_BYTES),
            "moe_unpermute": rows * h * e + shape.tokens * h * e,
        }
    sent = shape.sent
    out = {
        "moe_permute": 2 * sent * h * e + sent * (shape.router + INDEX_BYTES),
        "moe_unpermute": sent * h * e + shape.tokens * h * e + sent * INDEX_BYTES,
    }
    if shape.local_experts > 1:
        out["moe_sort_chunks"] = 2 * rows * (h * e + shape.router)
        out["moe_unsort_chunks"] = 2 * rows * h * e
    return out


def _routed_parts(spec, opts, shape: ExpertShape, experts: ExpertPass, half: int):
    """What a routed pass's forward (``half`` 0) and backward (1) share: the
    experts' ``fc1`` and ``fc2`` GEMMs and how many times they run, the bytes
    the activation kernel moves (the rule of the dense MLP's kernel of that
    pass), the routing probabilities' bytes, :func:`_permutations` and
    :func:`_etp_collectives`."""
    mlp = _halves(spec, opts)[half][1]
    rate = _activation_rate(
        mlp, opts.mbs * spec.seq_length, spec.ffn_hidden_size / opts.tp
    )
    fc1, fc2, elements, kernels = _expert_gemms(spec, opts, shape, experts)
    probs = fc1.batch * shape.per_expert * shape.router
    perm = _permutations(spec, shape, experts)
    comm = _etp_collectives(opts, shape, experts, spec.hidden_size)
    return fc1, fc2, kernels, rate * elements, probs, perm, comm


def _routed_forward(spec, opts, shape: ExpertShape, experts: ExpertPass) -> LayerPass:
    h, num = spec.hidden_size, spec.moe.num_experts
    t = shape.tokens
    fc1, fc2, kernels, moved, probs, perm, comm = _routed_parts(
        spec, opts, shape, experts, 0
    )
    ops: LayerPass = [
        _router(spec, opts, shape),
        MemoryOp(
            "router_softmax_topk",
            4 * t * num * shape.router + t * num * ROUTING_MAP_BYTES,
        ),
        MemoryOp("moe_permute", perm["moe_permute"]),
    ]
    ops += [comm["gather"]] if comm else []
    ops += (
        [MemoryOp("moe_sort_chunks", perm["moe_sort_chunks"])]
        if "moe_sort_chunks" in perm
        else []
    )
    activation = MemoryOp("expert_activation", moved + probs)
    ops += [fc1, activation, fc2] * kernels
    ops += (
        [MemoryOp("moe_unsort_chunks", perm["moe_unsort_chunks"])]
        if "moe_unsort_chunks" in perm
        else []
    )
    ops += [comm["scatter"]] if comm else []
    ops.append(MemoryOp("moe_unpermute", perm["moe_unpermute"]))
    if spec.moe.shared_ffn_hidden_size:
        ops.append(MemoryOp("moe_add_shared", 3 * t * h * shape.act))
    return ops


def _routed_backward(spec, opts, shape: ExpertShape, experts: ExpertPass) -> LayerPass:
    h, num = spec.hidden_size, spec.moe.num_experts
    t, e = shape.tokens, shape.act
    fc1, fc2, kernels, moved, probs, perm, comm = _routed_parts(
        spec, opts, shape, experts, 1
    )
    sent = (
        shape.sent
        if experts.dispatcher == "alltoall"
        else shape.local_experts * shape.per_expert
    )
    ops: LayerPass = [
        # the unpermutation's backward gathers each copy's gradient
        MemoryOp("moe_unpermute.backward", 2 * sent * h * e + sent * INDEX_BYTES),
    ]
    if "moe_unsort_chunks" in perm:
        ops.append(MemoryOp("moe_unsort_chunks.backward", perm["moe_unsort_chunks"]))
    if comm:  # the reduce-scatter's backward is an all-gather, and back
        ops.append(comm["gather"]._replace(name="all_gather.experts.backward"))
    activation = MemoryOp("expert_activation.backward", moved + 2 * probs)
    ops += (backward_gemms(fc2) + [activation] + backward_gemms(fc1)) * kernels
    if comm:
        ops.append(comm["scatter"]._replace(name="reduce_scatter.experts.backward"))
    if "moe_sort_chunks" in perm:
        ops.append(MemoryOp("moe_sort_chunks.backward", perm["moe_sort_chunks"]))
    ops += [
        # the permutation's backward sums each token's copies
        MemoryOp("moe_permute.backward", (sent + t) * h * e + sent * shape.router),
        MemoryOp("router_softmax_topk.backward", 3 * t * num * shape.router),
    ]
    ops += backward_gemms(_router(spec, opts, shape))
    paths = 2 + (1 if spec.moe.shared_ffn_hidden_size else 0)
    paths += 1 if spec.moe.shared_expert_gate and spec.moe.shared_ffn_hidden_size else 0
    ops.append(MemoryOp("moe_input_grad_sum", (paths - 1) * 3 * t * h * e))
    return ops


# ------------------------------------------------------------------ blocks
def expert_block_forward_ops(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> LayerPass:
    """One expert block's forward on one GPU for one micro-batch (see the
    module's docstring; the expert-parallel all-to-alls are not in it).

    Raises:
        ValueError: a spec without experts, degrees that do not split it
            (``ep`` must divide the experts, ``etp`` their width, ``tp`` the
            shared experts' width), or ``tp > 1`` without sequence parallelism.
    """
    shape = expert_shape(spec, opts, experts)
    (attention, _, residual), _ = _halves(spec, opts)
    return (
        attention
        + _shared_forward(spec, opts, shape)
        + _routed_forward(spec, opts, shape, experts)
        + [residual]
    )


def expert_block_backward_ops(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> LayerPass:
    """One expert block's backward on one GPU for one micro-batch, with the
    accumulation of the weight gradients of its dense and local expert
    parameters (:func:`~pipedejavu.core.moe_counts.block_param_split`).

    Raises:
        ValueError: as :func:`expert_block_forward_ops`.
    """
    shape = expert_shape(spec, opts, experts)
    _, (residual, _, attention) = _halves(spec, opts)
    params = moe_counts.block_param_split(
        spec, shape.block, opts.tp, experts.ep, shape.etp
    )
    return (
        [residual]
        + _routed_backward(spec, opts, shape, experts)
        + _shared_backward(spec, opts, shape)
        + attention
        + [MemoryOp("grad_accumulate", GRAD_ACCUMULATE_BYTES * sum(params))]
    )


def overlapped_shared_ops(ops: LayerPass, experts: ExpertPass) -> LayerPass:
    """The operations of an expert block's pass that run beside its
    all-to-alls: the shared experts' (``shared_expert.*``) with
    ``shared_expert_overlap``, none without. A caller prices the pass without
    them and adds what outlasts the all-to-alls."""
    if not experts.shared_expert_overlap:
        return []
    return [op for op in ops if op.name.startswith(SHARED_EXPERT_PREFIX)]


# ------------------------------------------------------------- activations
def expert_activation_bytes(
    spec: TransformerSpec,
    opts: PassOptions,
    experts: ExpertPass,
    recompute: Recompute = "none",
) -> float:
    """Bytes one expert block keeps per micro-batch until its backward.

    The attention half and the block's h-wide tensors (norm inputs, the MoE
    input, dropout masks) as :func:`~pipedejavu.costmodel.analytical.layers.
    activation_bytes` counts a dense block, the shared experts as its MLP,
    plus the routed tokens: each expert GEMM's input (``n`` rows of ``h``), the
    activation's input and output, the permuted probabilities, the
    permutations' row maps, the router's probabilities and routing map, and
    the shared gate's output with the MLP output it scales. The copies sent
    by the all-to-all are freed once sent. ``full`` keeps only the block's
    input; selective recomputation (``selective``: the attention core, or a
    tuple of modules) does not keep what its modules free
    (:mod:`~pipedejavu.costmodel.analytical.recompute`): the attention half's
    as a dense block's, and ``layernorm`` the MoE input (the pre-MLP norm's
    output), ``moe`` all but it, ``shared_experts`` the shared experts' and
    their gate's tensors, ``moe_act`` the activation's output.

    Raises:
        ValueError: as :func:`expert_block_forward_ops`, or a bad
            ``recompute``.
    """
    shape = expert_shape(spec, opts, experts)
    moe, h, tp = spec.moe, spec.hidden_size, opts.tp
    modules = selective_modules(recompute)
    rest = tuple(sorted(modules - {"mlp"}))  # (``mlp`` is a dense layer's)
    half = (rest or "none") if modules else recompute

    def dense(width: int) -> float:
        return float(
            activation_bytes(
                _dense_view(spec, width),
                opts.mbs,
                tp,
                opts.precision,
                recompute=half,
                sequence_parallel=opts.sequence_parallel,
                flash_attention=opts.flash_attention,
                attention_dropout=opts.attention_dropout,
            )[1]
        )

    # A dense block's bytes grow linearly with its MLP's width: the part
    # without any MLP is the value extrapolated to width 0.
    attention = 2 * dense(tp) - dense(2 * tp)
    if recompute == "full":
        return attention
    e, t = shape.act, shape.tokens
    total = attention
    if "layernorm" in modules:  # the pre-MLP norm's output, on T tokens
        total -= t * h * e
    if "moe" in modules:  # its checkpoint keeps its input only
        return total
    shared = moe.shared_ffn_hidden_size
    if shared and "shared_experts" not in modules:
        total += dense(shared) - attention
        if moe.shared_expert_gate:
            total += t * h * e + t * e
    rows = shape.local_experts * shape.per_expert
    width = moe.ffn_hidden_size / shape.etp
    gated = 2 if spec.gated_mlp else 1
    kept = h + gated * width + (0 if "moe_act" in modules else width)
    total += rows * kept * e + rows * shape.router
    sent = shape.sent if experts.dispatcher == "alltoall" else rows
    total += (sent + (rows if shape.local_experts > 1 else 0)) * INDEX_BYTES
    total += t * moe.num_experts * (shape.router + ROUTING_MAP_BYTES)
    return total
