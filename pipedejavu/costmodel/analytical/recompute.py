"""Selective recomputation, module by module: what each of Megatron-Core's
``--recompute-modules`` reruns in the backward pass and what it frees.

Megatron-Core (core_v0.16.1) checkpoints, under ``--recompute-granularity
selective``, the modules ``--recompute-modules`` names (default
``core_attn``) in every transformer layer, the multi-token-prediction depths'
too, as its Transformer Engine layer spec builds them (Megatron-LM's default
``--transformer-impl``):

* ``core_attn`` (``Attention``): the attention core. Its checkpoint keeps the
  queries, keys and values; the core's own tensors (a fused kernel's softmax
  statistics; an unfused one's scores, softmax and dropout) are not kept.
* ``layernorm`` (``TransformerLayer``, output discarded): the norms that are
  modules of their own, the input norm of a layer with multi-latent attention
  and the pre-MLP norm of an expert layer (the others are fused into the
  next linear layer, ``TELayerNormColumnParallelLinear``, where the module
  finds an ``IdentityOp`` and does nothing). Each one's output (``h`` wide, on
  the tokens a GPU holds) is not kept.
* ``mla_up_proj`` (``MLASelfAttention``, output discarded): the up
  projections with their latent norms and all-gathers, and the rotary
  embedding. The queries, keys and values and, with ``--qk-layernorm``, each
  latent's normed copy are not kept; the rotary key, an input of the
  checkpoint, is.
* ``mlp`` (``TransformerLayer``, dense layers only): the dense MLP with its
  fused norm and TP collectives. Its input is kept; the norm's output, the up
  projection's and the activation's are not.
* ``moe`` (``MoELayer``, expert layers): the whole MoE layer, router,
  permutations, both all-to-alls, experts and shared experts; only its input
  is kept.
* ``shared_experts`` (``SharedExpertMLP``): the shared experts and their
  gate; their up projection's, activation's and gate's outputs are not kept.
* ``moe_act`` (``TEGroupedMLP``, output discarded): the experts' activation;
  its output (the second expert GEMM's input) is not kept.

:func:`rerun_ops` picks what the modules rerun from a block's forward
operations (an expert layer's ``moe`` rerun adds its all-to-alls:
:mod:`~pipedejavu.costmodel.analytical.moe_layers`); the bytes not kept are
counted with the block's own
(:func:`~pipedejavu.costmodel.analytical.layers.activation_bytes`,
:func:`~pipedejavu.costmodel.analytical.moe_ops.expert_activation_bytes`).
A value of :data:`Recompute` names what a pass recomputes: ``"none"``,
``"full"``, ``"selective"`` (Megatron-Core's default module, the attention
core) or a tuple of modules (selective recomputation of those).
"""

from __future__ import annotations

from typing import Literal

from pipedejavu.core.training_options import (
    DEFAULT_RECOMPUTE_MODULES,
    SELECTIVE_MODULES,
    TORCHTITAN_OP,
    TrainingOptions,
)
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.mla_ops import MLA_UP_PROJ_OPS
from pipedejavu.costmodel.analytical.ops import (
    LayerPass,
    PassOptions,
    attention_core_forward_ops,
)

__all__ = [
    "SHARED_EXPERT_PREFIX",
    "Recompute",
    "recompute_of",
    "rerun_ops",
    "selective_modules",
    "separate_norms",
    "torchtitan_op_reruns",
]

#: What a pass recomputes (module doc).
Recompute = Literal["none", "selective", "full"] | tuple[str, ...]
#: The name prefix of the shared experts' operations.
SHARED_EXPERT_PREFIX = "shared_expert."


def selective_modules(recompute: Recompute) -> frozenset[str]:
    """The modules ``recompute`` reruns selectively (none for ``"none"`` and
    ``"full"``).

    Raises:
        ValueError: neither a granularity nor a non-empty tuple of
            Megatron-Core's modules.
    """
    if isinstance(recompute, str):
        if recompute in ("none", "full"):
            return frozenset()
        if recompute == "selective":
            return frozenset(DEFAULT_RECOMPUTE_MODULES)
    elif (
        isinstance(recompute, (tuple, list, frozenset))
        and recompute
        and all(module in SELECTIVE_MODULES for module in recompute)
    ):
        return frozenset(recompute)
    raise ValueError(
        "recompute must be 'none', 'selective', 'full' or a tuple of Megatron-"
        f"Core's recompute modules or torchtitan's ({', '.join(SELECTIVE_MODULES)}"
        f"), got {recompute!r}"[:300]
    )


def recompute_of(options: TrainingOptions) -> Recompute:
    """What ``options`` recompute, as the cost model reads it: ``"none"``,
    ``"full"``, or the selective modules."""
    if options.recompute == "selective":
        return options.recompute_modules
    return options.recompute


def separate_norms(spec: TransformerSpec, *, expert: bool) -> tuple[str, ...]:
    """The forward operations of a block's norms that are modules of their own
    (what ``layernorm`` reruns, module doc): the input norm with multi-latent
    attention, the pre-MLP norm of an expert block."""
    names = ("input_norm",) if spec.mla is not None else ()
    return names + (("post_attention_norm",) if expert else ())


def _span(ops: LayerPass, first: str, last: str | None) -> set[int]:
    """Indices strictly between the operations named ``first`` and ``last``
    (``None``: the pass's last operation)."""
    names = [op.name for op in ops]
    start = names.index(first) + 1
    stop = len(ops) - 1 if last is None else names.index(last)
    return set(range(start, stop))


def rerun_ops(
    ops: LayerPass,
    recompute: Recompute,
    spec: TransformerSpec,
    opts: PassOptions,
    *,
    expert: bool,
) -> LayerPass:
    """The operations of one block's forward ``ops`` (a dense block's:
    :func:`~pipedejavu.costmodel.analytical.mla_ops.any_block_forward_ops`,
    or an expert block's: ``expert=True``) that the selective modules of
    ``recompute`` rerun in its backward (module doc), in their order; empty
    for ``"none"`` and ``"full"``. A module that is not in the block (``mlp``
    in an expert block, ``moe`` in a dense one, ``mla_up_proj`` without
    multi-latent attention) reruns nothing.

    Raises:
        ValueError: a bad ``recompute``.
    """
    modules = selective_modules(recompute)
    if TORCHTITAN_OP in modules:
        return torchtitan_op_reruns(ops, spec, expert=expert)
    picked: set[int] = set()
    names: set[str] = set()
    if "core_attn" in modules:
        core = attention_core_forward_ops(spec, opts)
        picked |= {i for i, op in enumerate(ops) if op in core}
    if "layernorm" in modules:
        names |= set(separate_norms(spec, expert=expert))
    if "mla_up_proj" in modules and spec.mla is not None:
        names |= set(MLA_UP_PROJ_OPS)
    if "mlp" in modules and not expert:  # with its fused norm
        picked |= _span(ops, "bias_dropout_add.attention", "bias_dropout_add.mlp")
    if "moe" in modules and expert:  # after its norm, before the residual
        picked |= _span(ops, "post_attention_norm", None)
    if "moe_act" in modules and expert:
        names.add("expert_activation")
    for i, op in enumerate(ops):
        shared = "shared_experts" in modules and expert
        if op.name in names or (shared and op.name.startswith(SHARED_EXPERT_PREFIX)):
            picked.add(i)
    return [op for i, op in enumerate(ops) if i in picked]


#: What torchtitan's ``"op"`` policy reruns of a dense block's forward
#: (torchtitan's ``_apply_op_sac``: a block's matrix multiplications counted
#: in their order, ``wq wk wv wo w1 w3 w2``, every even one not saved; the
#: attention kernel's output kept; element-wise operations and the norms'
#: reductions rerun): the share of each of our fused products rerun
#: (``qkv``: the keys, half its key-value columns; ``mlp_up``: ``w3``, half;
#: ``out_proj``: ``wo``) and the memory-bound kernels, by name.
TORCHTITAN_OP_GEMMS = {"out_proj": 1.0, "mlp_up": 0.5}
TORCHTITAN_OP_MEMORY = (
    "input_norm",
    "bias_dropout_add.attention",
    "post_attention_norm",
    "swiglu",
    "gelu",
    "bias_dropout_add.mlp",
    "eager_elementwise",
)


def torchtitan_op_reruns(
    ops: LayerPass, spec: TransformerSpec, *, expert: bool
) -> LayerPass:
    """The operations torchtitan's ``"op"`` policy reruns of a dense block's
    forward ``ops`` (:data:`TORCHTITAN_OP_GEMMS`; the keys' columns of the
    fused ``qkv``), in their order.

    Raises:
        ValueError: an expert block or multi-latent attention (torchtitan's
            policy over their operations is not priced).
    """
    if expert or spec.mla is not None:
        raise ValueError(
            f"torchtitan's per-operation recomputation ({TORCHTITAN_OP}) is "
            "priced for dense blocks with grouped-query attention only"
        )
    d = spec.head_dim
    q = spec.num_attention_heads * d
    kv = 2 * spec.num_query_groups * d
    shares = {**TORCHTITAN_OP_GEMMS, "qkv": (kv / 2) / (q + kv)}
    out: LayerPass = []
    for op in ops:
        share = shares.get(op.name) if hasattr(op, "n") else None
        if share is not None:
            out.append(op._replace(n=op.n * share))
        elif op.name in TORCHTITAN_OP_MEMORY:
            out.append(op)
    return out
