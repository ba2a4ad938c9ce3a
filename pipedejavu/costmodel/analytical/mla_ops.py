"""Multi-latent attention's operations (DeepSeek-V2/V3), on one GPU for one
micro-batch, and the block operations of either kind of attention.

Megatron-Core's ``MLASelfAttention`` (core_v0.16.1, Transformer Engine layer
spec) runs, after the block's input norm, on the ``T = b s`` tokens of a
micro-batch split over ``t`` GPUs:

* the down projections, ``TELinear`` with ``parallel_mode="duplicated"``:
  every GPU holds them whole and runs them on the tokens it holds (``T / t``
  with sequence parallelism, else all ``T``): ``q_down`` ``h -> q_lora``
  (with ``q_lora_rank``), ``kv_down`` ``h -> kv_lora + d_rope``;
* the latent norms (``--qk-layernorm``: fused into the up projections'
  ``TELayerNormColumnParallelLinear``), on the same tokens;
* with sequence parallelism, the all-gathers of the query latent, the
  key/value latent (each feeding its up projection) and of the shared rotary
  key (``gather_from_sequence_parallel_region``);
* the up projections, column-parallel over ``t``: ``q_up`` ``q_lora -> a
  (d_qk + d_rope)`` (without ``q_lora_rank`` one ``q_proj`` ``h -> a (d_qk +
  d_rope)``, whose input is gathered as a dense block's QKV input),
  ``kv_up`` ``kv_lora -> a (d_qk + d_v)``;
* the rotary embedding of the queries' and the shared key's rotary parts,
  priced as Megatron-Core's fused kernels (``fused_apply_mla_rope_for_q``,
  ``..._for_kv``): they read the projections and write the queries, the keys
  (the rotary key copied to every head) and the values;
* the attention core (:func:`~pipedejavu.costmodel.analytical.ops.
  attention_core_forward_ops`: queries and keys ``d_qk + d_rope`` deep,
  values ``d_v``);
* the output projection ``a d_v -> h``, row-parallel, and its all-reduce (or
  reduce-scatter with sequence parallelism), as a dense block's.

The backward mirrors it: both gradient GEMMs of every projection, the up
projections' input gradients reduced over ``t`` (reduce-scatter with
sequence parallelism, all-reduce without), the rotary key's gradient
reduce-scattered (sequence parallelism only: without it Megatron-Core runs no
collective there), the two down projections' input gradients summed.

Selective recomputation's ``mla_up_proj`` module reruns the latent norms, the
up projections with their all-gathers and the rotary embedding
(:data:`MLA_UP_PROJ_OPS`; what it does not keep: :func:`mla_up_proj_elements`).
Not priced: the once-an-iteration all-reduce over ``t`` of the down
projections' and norms' gradients under sequence parallelism (Megatron's
``_allreduce_non_tensor_model_parallel_grads``), latent caching (inference
only).

The rest of a block (residual, MLP) is the dense block's
(:func:`any_block_forward_ops`); expert blocks take their attention half from
it (:mod:`~pipedejavu.costmodel.analytical.moe_ops`).
"""

from __future__ import annotations

import dataclasses

from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.ops import (
    GRAD_ACCUMULATE_BYTES,
    LayerPass,
    MemoryOp,
    PassOptions,
    attention_core_backward_ops,
    attention_core_forward_ops,
    backward_gemms,
    block_backward_ops,
    block_forward_ops,
    element_bytes,
    linear_gemm,
    tp_half,
)

__all__ = [
    "MLA_UP_PROJ_OPS",
    "MLA_WEIGHT_GRADIENT_OPS",
    "any_block_backward_ops",
    "any_block_forward_ops",
    "mla_attention_backward_ops",
    "mla_attention_elements",
    "mla_attention_forward_ops",
    "mla_up_proj_elements",
]

#: The weight-gradient GEMMs of multi-latent attention's projections (the
#: output projection keeps the dense block's name, ``out_proj``).
MLA_WEIGHT_GRADIENT_OPS = (
    "q_down.wgrad",
    "q_up.wgrad",
    "q_proj.wgrad",
    "kv_down.wgrad",
    "kv_up.wgrad",
)
#: The forward operations Megatron-Core's ``mla_up_proj`` checkpoint
#: (``qkv_up_proj_and_rope_apply``) reruns: the latent norms (fused into the
#: up projections with ``--qk-layernorm``), the up projections and their
#: inputs' all-gathers, the rotary embedding.
MLA_UP_PROJ_OPS = (
    "q_norm",
    "kv_norm",
    "all_gather.q_up",
    "q_up",
    "all_gather.q_proj",
    "q_proj",
    "all_gather.kv_up",
    "kv_up",
    "mla_rope_q",
    "mla_rope_kv",
)


def _parts(spec: TransformerSpec, opts: PassOptions, backward: bool) -> dict:
    """The projections, their inputs' collectives (:func:`_gathers`, of the
    forward or of the ``backward``), the query's up projection's name and
    the sizes a pass needs.

    Raises:
        ValueError: ``spec`` has no multi-latent attention.
    """
    _check(spec)
    mla, h, t = spec.mla, spec.hidden_size, opts.tp
    act, _ = element_bytes(opts.precision)
    tokens = opts.mbs * spec.seq_length
    local = tokens / t if opts.sequence_parallel else tokens
    heads = spec.num_attention_heads / t
    qk, rope, v = mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim
    q_rank, kv_rank = mla.q_lora_rank, mla.kv_lora_rank
    gemms = {"kv_down": linear_gemm("kv_down", local, kv_rank + rope, h, opts)}
    if q_rank:
        gemms["q_down"] = linear_gemm("q_down", local, q_rank, h, opts)
        gemms["q_up"] = linear_gemm("q_up", tokens, heads * (qk + rope), q_rank, opts)
    else:
        gemms["q_proj"] = linear_gemm("q_proj", tokens, heads * (qk + rope), h, opts)
    gemms["kv_up"] = linear_gemm("kv_up", tokens, heads * (qk + v), kv_rank, opts)
    gemms["out_proj"] = linear_gemm("out_proj", tokens, h, heads * v, opts)
    rope_q = 2 * tokens * heads * (qk + rope) * act
    rope_kv = tokens * (heads * (2 * qk + rope + 2 * v) + rope) * act
    norms = {}
    if spec.qk_layernorm:
        norms["kv_norm"] = local * kv_rank * act
        if q_rank:
            norms["q_norm"] = local * q_rank * act
    parts = dict(
        gemms=gemms,
        act=act,
        tokens=tokens,
        local=local,
        rope=(rope_q, rope_kv),
        norms=norms,
        q_up="q_up" if "q_up" in gemms else "q_proj",
        message=tokens * h * act,
    )
    parts["collectives"] = _gathers(spec, opts, parts, backward)
    return parts


def _gathers(
    spec: TransformerSpec, opts: PassOptions, p: dict, backward: bool
) -> dict[str, LayerPass]:
    """``{up projection: its input's collective}`` and the rotary key's: the
    all-gathers of the forward, or the input gradients' reductions."""
    mla, h, act, tokens = spec.mla, spec.hidden_size, p["act"], p["tokens"]
    suffix = ".dgrad" if backward else ""
    widths = {"kv_up": mla.kv_lora_rank}
    widths |= {"q_up": mla.q_lora_rank} if mla.q_lora_rank else {"q_proj": h}
    out = {
        name: tp_half(
            name, tokens * width * act, opts, name + suffix, gather=not backward
        )
        for name, width in widths.items()
    }
    # the shared rotary key: gathered (and its gradient reduce-scattered)
    # only with sequence parallelism
    key = tokens * mla.qk_pos_emb_head_dim * act
    out["k_pos_emb"] = (
        tp_half("k_pos_emb", key, opts, gather=not backward)
        if opts.sequence_parallel
        else []
    )
    return out


def mla_attention_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Multi-latent attention's forward (module doc), from the block's input
    norm's output to the output projection's all-reduce or reduce-scatter.

    Raises:
        ValueError: ``spec`` has no multi-latent attention.
    """
    p = _parts(spec, opts, backward=False)
    gemms, gathers, q_up = p["gemms"], p["collectives"], p["q_up"]
    ops: LayerPass = [gemms[name] for name in ("q_down", "kv_down") if name in gemms]
    ops += [MemoryOp(name, 2 * size) for name, size in p["norms"].items()]
    ops += gathers[q_up] + [gemms[q_up]] + gathers["kv_up"] + [gemms["kv_up"]]
    ops += gathers["k_pos_emb"]
    rope_q, rope_kv = p["rope"]
    ops += [MemoryOp("mla_rope_q", rope_q), MemoryOp("mla_rope_kv", rope_kv)]
    ops += attention_core_forward_ops(spec, opts)
    ops.append(gemms["out_proj"])
    return ops + tp_half("out_proj", p["message"], opts, "out_proj", gather=False)


def mla_attention_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """Multi-latent attention's backward (module doc), from the output
    projection's gradient to the sum of the down projections' input gradients
    (the block's input norm's backward and the accumulation not included).

    Raises:
        ValueError: ``spec`` has no multi-latent attention.
    """
    p = _parts(spec, opts, backward=True)
    gemms, reduce, q_up = p["gemms"], p["collectives"], p["q_up"]
    ops = tp_half("out_proj", p["message"], opts, "out_proj.dgrad", gather=True)
    ops += backward_gemms(gemms["out_proj"])
    ops += attention_core_backward_ops(spec, opts)
    rope_q, rope_kv = p["rope"]
    ops += [
        MemoryOp("mla_rope_kv.backward", rope_kv),
        MemoryOp("mla_rope_q.backward", rope_q),
    ]
    ops += reduce["k_pos_emb"]
    ops += backward_gemms(gemms["kv_up"]) + reduce["kv_up"]
    ops += backward_gemms(gemms[q_up]) + reduce[q_up]
    # a norm's backward reads its input and the output's gradient, writes one
    ops += [MemoryOp(name + ".backward", 3 * size) for name, size in p["norms"].items()]
    for name in ("kv_down", "q_down"):
        ops += backward_gemms(gemms[name]) if name in gemms else []
    # the block input's gradient: the down projections' (and q_proj's) summed
    x = p["local"] * spec.hidden_size * p["act"]
    return ops + [MemoryOp("mla_input_grad_sum", 3 * x)]


def mla_attention_elements(
    spec: TransformerSpec, mbs: int, tp: int, split: int
) -> float:
    """Elements one GPU keeps of multi-latent attention until its backward
    (beside the dense block's input and norm tensors): the queries, keys and
    values the core reads and its output (the output projection's input), all
    split over the heads; each latent's norm input and up projection's input
    (one tensor without the norm), on the tokens the GPU holds (``split``:
    ``tp`` with sequence parallelism, else 1). The projections' outputs are
    not kept: the rotary embedding needs none of its inputs."""
    mla = spec.mla
    tokens = mbs * spec.seq_length
    heads = spec.num_attention_heads / tp
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    core = tokens * heads * (2 * qk + 2 * mla.v_head_dim)
    latents = (2 if spec.qk_layernorm else 1) * (mla.q_lora_rank + mla.kv_lora_rank)
    return core + tokens / split * latents


def mla_up_proj_elements(spec: TransformerSpec, mbs: int, tp: int, split: int) -> float:
    """Elements one GPU no longer keeps under the ``mla_up_proj`` module
    (arguments as :func:`mla_attention_elements`): the queries, keys and
    values (its discarded outputs) and, with the latent norms fused into the
    up projections, each latent's normed copy; less the rotary key its
    checkpoint keeps as an input (gathered over the sequence)."""
    mla = spec.mla
    tokens = mbs * spec.seq_length
    heads = spec.num_attention_heads / tp
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    freed = tokens * heads * (2 * qk + mla.v_head_dim)
    if spec.qk_layernorm:
        freed += tokens / split * (mla.q_lora_rank + mla.kv_lora_rank)
    return freed - tokens * mla.qk_pos_emb_head_dim


def _check(spec: TransformerSpec) -> None:
    if spec.mla is None:
        raise ValueError(f"model {spec.name}: no multi-latent attention (mla)")


def _index(ops: LayerPass, name: str) -> int:
    return next(i for i, op in enumerate(ops) if op.name == name)


def any_block_forward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """One dense block's forward:
    :func:`~pipedejavu.costmodel.analytical.ops.block_forward_ops`, its
    attention multi-latent attention's (:func:`mla_attention_forward_ops`)
    where the spec has it."""
    if spec.mla is None:
        return block_forward_ops(spec, opts)
    ops = block_forward_ops(dataclasses.replace(spec, mla=None), opts)
    end = _index(ops, "bias_dropout_add.attention")
    return ops[:1] + mla_attention_forward_ops(spec, opts) + ops[end:]


def any_block_backward_ops(spec: TransformerSpec, opts: PassOptions) -> LayerPass:
    """One dense block's backward:
    :func:`~pipedejavu.costmodel.analytical.ops.block_backward_ops`, its
    attention multi-latent attention's (:func:`mla_attention_backward_ops`)
    where the spec has it, and the accumulation of the block's own
    parameters."""
    if spec.mla is None:
        return block_backward_ops(spec, opts)
    ops = block_backward_ops(dataclasses.replace(spec, mla=None), opts)
    start = _index(ops, "bias_dropout_add.attention.backward") + 1
    end = _index(ops, "input_norm.backward")
    params = sum(spec.layer_param_split(opts.tp)[1])
    accumulate = MemoryOp("grad_accumulate", GRAD_ACCUMULATE_BYTES * params)
    return ops[:start] + mla_attention_backward_ops(spec, opts) + [ops[end], accumulate]
