"""Parameters and FLOPs of a transformer's blocks, mixture-of-experts included,
as Megatron-Core lays them out.

A block's parameters are split in two, because the distributed optimizer
shards them over different GPUs:

* **dense**: the attention (its projections, the multi-latent projections and
  norms, the query/key norms), the two block norms, a dense block's MLP,
  and in an expert block the router, the shared experts and their gate.
  Split over the stage's ``tp`` GPUs as Megatron-LM splits a dense block
  (column-parallel inputs, row-parallel outputs; query/key norms over a whole
  projection, OLMoE's, with the heads they normalize); other norms, the router
  (``E x h`` and its bias), the shared experts' gate and multi-latent
  attention's down projections (``TELinear`` with ``parallel_mode
  "duplicated"`` in Megatron-Core's Transformer Engine layer spec) are held
  whole by every GPU of the group. Their gradients reduce, and the
  distributed optimizer shards them, over ``dp x cp``.
* **expert**: the routed experts, ``E / ep`` of them on each GPU, each MLP
  split over ``etp`` (Megatron-Core's folded layout: ``etp x ep`` GPUs of the
  stage share an expert layer, ``edp = tp cp dp / (etp ep)`` replicas).

Multi-token prediction (``mtp_layers`` depths, DeepSeek-V3) lives on the last
pipeline stage, as Megatron-Core builds it (``mtp_on_this_rank``): each depth
has two input norms, the ``2h -> h`` projection (column-parallel), a block
shaped as the model's last block and a final norm; it reuses the LM head, and
the last stage holds its own copy of the embedding (``GPTModel`` builds the
embedding wherever MTP runs). Here they are counted in the last profile
layer, with the head.

FLOPs are counted as Megatron-LM's ``num_floating_point_operations``
(``megatron/training/training.py``, core_v0.16.1) and Megatron-Bridge's
``flop_utils`` (v0.4) count them: see :func:`training_flops`.

This module is vocabulary: it imports nothing else of ours.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

#: A :class:`~pipedejavu.core.transformer.TransformerSpec` (whose module imports
#: this one, so it is not imported here).
TransformerSpec = Any

__all__ = [
    "BlockParams",
    "active_params",
    "block_param_parts",
    "block_param_split",
    "check_expert_split",
    "layer_param_split",
    "moe_state_bytes",
    "mtp_param_split",
    "training_flops",
]

#: A profile layer's parameters on one GPU: ``(dense, expert)`` elements.
BlockParams = tuple[int, int]


def _norm(spec: TransformerSpec, width: int) -> int:
    return 2 * width if spec.norm == "layernorm" else width


def check_expert_split(spec: TransformerSpec, ep: int, etp: int) -> None:
    """Raise ``ValueError`` unless Megatron-Core can spread the experts over
    ``ep`` GPUs and split each over ``etp`` (both positive; ``ep`` must divide
    the experts, ``etp`` each expert's width). A dense spec takes ``ep = 1``
    only."""
    for name, value in (("ep", ep), ("etp", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    moe = spec.moe
    where = f"model {spec.name}"
    if moe is None:
        if ep != 1:
            raise ValueError(f"{where}: expert parallelism {ep} without experts")
        return
    if moe.num_experts % ep:
        raise ValueError(
            f"{where}: ep {ep} must divide num_experts ({moe.num_experts})"
        )
    if moe.ffn_hidden_size % etp:
        raise ValueError(
            f"{where}: etp {etp} must divide the experts' ffn_hidden_size "
            f"({moe.ffn_hidden_size})"
        )


def _mlp_params(spec: TransformerSpec, width: int, tp: int) -> tuple[int, int]:
    """(weights, biases) of one MLP of inner ``width`` on one of ``tp`` GPUs:
    first projection split by columns (its bias with it), second by rows (its
    bias replicated); none at all for ``width`` 0 (no shared expert)."""
    if width == 0:
        return 0, 0
    h = spec.hidden_size
    in_columns = (2 if spec.gated_mlp else 1) * width // tp
    weights = h * in_columns + (width // tp) * h
    biases = in_columns + h if spec.linear_bias else 0
    return weights, biases


def _attention_parts(spec: TransformerSpec, tp: int) -> dict[str, int]:
    h, heads, d = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    mla = spec.mla
    if mla is None:
        kv_heads_per_gpu = max(spec.num_query_groups // tp, 1)
        q_columns = heads * d // tp
        qkv_columns = q_columns + 2 * kv_heads_per_gpu * d
        has_qkv_bias = spec.linear_bias or spec.qkv_bias
        if spec.qk_layernorm == "projection":  # split with the heads they norm
            norms = _norm(spec, q_columns) + _norm(spec, kv_heads_per_gpu * d)
        else:  # one d-wide norm for the queries, one for the keys
            norms = 2 * _norm(spec, d) if spec.qk_layernorm else 0
        return {
            "attention": h * qkv_columns + q_columns * h,
            "attention_duplicated": 0,
            "attention_norms": norms,
            "attention_bias": (qkv_columns if has_qkv_bias else 0)
            + (h if spec.linear_bias else 0),
        }
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank:
        split = mla.q_lora_rank * heads * qk // tp  # q up projection
        duplicated = h * mla.q_lora_rank  # q down projection
    else:
        split, duplicated = h * heads * qk // tp, 0  # q projection
    duplicated += h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)  # kv down
    split += mla.kv_lora_rank * heads * (mla.qk_head_dim + mla.v_head_dim) // tp
    split += heads * mla.v_head_dim // tp * h  # output projection
    norms = 0
    if spec.qk_layernorm:  # the latent norms (Megatron's --qk-layernorm with MLA)
        norms = _norm(spec, mla.kv_lora_rank)
        norms += _norm(spec, mla.q_lora_rank) if mla.q_lora_rank else 0
    return {
        "attention": split,
        "attention_duplicated": duplicated,
        "attention_norms": norms,
        "attention_bias": h if spec.linear_bias else 0,
    }


def block_param_parts(
    spec: TransformerSpec, block: int, tp: int = 1, ep: int = 1, etp: int | None = None
) -> dict[str, int]:
    """One GPU's parameters of block ``block`` (0-based), by part.

    Keys: ``attention`` (projections split over ``tp``),
    ``attention_duplicated`` (multi-latent down projections, held whole),
    ``attention_norms`` (query/key or latent norms), ``attention_bias``,
    ``norms`` (the two block norms), ``mlp`` and ``mlp_bias`` (a dense block's
    MLP, or an expert block's shared experts, split over ``tp``), ``router``
    (weights and bias), ``shared_gate``, ``experts`` and ``expert_bias`` (the
    ``E / ep`` local experts split over ``etp``). Elements, not bytes.

    Raises:
        ValueError: the degrees do not split the model (see
            :meth:`~pipedejavu.core.transformer.TransformerSpec.check_tp`,
            :func:`check_expert_split`) or ``block`` is out of range.
    """
    etp = tp if etp is None else etp
    spec.check_tp(tp)
    check_expert_split(spec, ep, etp)
    if not 0 <= block < spec.num_layers:
        raise ValueError(f"block must be in [0, {spec.num_layers}), got {block!r}")
    parts = _attention_parts(spec, tp)
    parts["norms"] = 2 * _norm(spec, spec.hidden_size)
    moe, h = spec.moe, spec.hidden_size
    if moe is None or not moe.is_expert_block(block):
        parts["mlp"], parts["mlp_bias"] = _mlp_params(spec, spec.ffn_hidden_size, tp)
        keys = ("router", "shared_gate", "experts", "expert_bias")
        return parts | dict.fromkeys(keys, 0)
    shared = moe.shared_ffn_hidden_size
    if shared % tp:
        raise ValueError(
            f"model {spec.name}: tp {tp} must divide the shared experts' "
            f"ffn_hidden_size ({shared})"
        )
    parts["mlp"], parts["mlp_bias"] = _mlp_params(spec, shared, tp)
    parts["router"] = moe.num_experts * h + (moe.num_experts if spec.linear_bias else 0)
    parts["shared_gate"] = h if moe.shared_expert_gate and shared else 0
    weights, biases = _mlp_params(spec, moe.ffn_hidden_size, etp)
    local = moe.num_experts // ep
    parts["experts"], parts["expert_bias"] = local * weights, local * biases
    return parts


def block_param_split(
    spec: TransformerSpec, block: int, tp: int = 1, ep: int = 1, etp: int | None = None
) -> BlockParams:
    """``(dense, expert)`` parameters of block ``block`` on one GPU (see
    :func:`block_param_parts`)."""
    parts = block_param_parts(spec, block, tp, ep, etp)
    expert = parts.pop("experts") + parts.pop("expert_bias")
    return sum(parts.values()), expert


def mtp_param_split(
    spec: TransformerSpec, tp: int = 1, ep: int = 1, etp: int | None = None
) -> BlockParams:
    """``(dense, expert)`` parameters of one multi-token-prediction depth on one
    GPU: its two input norms, the ``2h -> h`` projection split over ``tp``, a
    block shaped as the last block, its final norm (the embedding copy and the
    shared LM head not included)."""
    h = spec.hidden_size
    dense, expert = block_param_split(spec, spec.num_layers - 1, tp, ep, etp)
    return dense + 3 * _norm(spec, h) + 2 * h * (h // tp), expert


@functools.lru_cache(maxsize=256)  # (pure; a tuple of tuples: immutable)
def layer_param_split(
    spec: TransformerSpec,
    tp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    *,
    tied_copy: bool = False,
) -> tuple[BlockParams, ...]:
    """``(dense, expert)`` parameters per profile layer on one GPU.

    Layer 0 is the embedding, then the blocks, then the final norm with the LM
    head (two layers with ``split_head_layer``) and, in the last layer, the
    multi-token-prediction depths. ``tied_copy``: the last layer is on a
    pipeline stage without layer 0, which then holds a copy of the word
    embedding if the head is tied to it, and of the whole embedding if
    multi-token prediction runs there.

    Returns:
        ``num_profile_layers`` pairs of exact counts (elements).
    """
    tp_blocks = tuple(
        block_param_split(spec, b, tp, ep, etp) for b in range(spec.num_layers)
    )
    norm = _norm(spec, spec.hidden_size)
    word = spec.padded_vocab_size(tp) // tp * spec.hidden_size
    head = 0 if spec.tied_embeddings else word
    if tied_copy and spec.mtp_layers:
        head += spec.embedding_params(tp)
    elif tied_copy and spec.tied_embeddings:
        head += word
    mtp_dense = mtp_expert = 0
    if spec.mtp_layers:
        dense, expert = mtp_param_split(spec, tp, ep, etp)
        mtp_dense, mtp_expert = spec.mtp_layers * dense, spec.mtp_layers * expert
    last = (head + mtp_dense, mtp_expert)
    tail = ((norm, 0), last) if spec.split_head_layer else ((norm + last[0], last[1]),)
    return ((spec.embedding_params(tp), 0), *tp_blocks, *tail)


def active_params(spec: TransformerSpec) -> int:
    """Parameters a token passes through (``tp = 1``): every parameter but the
    routed experts it is not sent to, ``E - topk`` of each expert block's
    (multi-token-prediction depths included); the head counted once if tied."""
    total = sum(d + e for d, e in layer_param_split(spec))
    moe = spec.moe
    if moe is None:
        return total
    weights, biases = _mlp_params(spec, moe.ffn_hidden_size, 1)
    blocks = moe.num_expert_blocks(spec.num_layers)
    blocks += spec.mtp_layers if moe.is_expert_block(spec.num_layers - 1) else 0
    return total - blocks * (moe.num_experts - moe.topk) * (weights + biases)


def moe_state_bytes(
    dense: float,
    expert: float,
    *,
    dense_shards: float,
    expert_shards: float,
    bytes_per_param: float,
    sharded_bytes_per_param: float,
) -> float:
    """Weights, gradients and optimizer state of one GPU holding ``dense`` and
    ``expert`` parameters: ``bytes_per_param`` each, plus
    ``sharded_bytes_per_param`` divided over the GPUs that shard them
    (``dense_shards``: the dense data-parallel GPUs, ``dp x cp``;
    ``expert_shards``: the expert data-parallel GPUs, ``edp``).

    Megatron-LM's rule (bf16 weights, fp32 gradients, fp32 main weights and
    Adam moments): 18 bytes a parameter, 0 sharded, without the distributed
    optimizer; 6 and 12 with it.
    """
    if dense_shards <= 0 or expert_shards <= 0:
        raise ValueError(
            f"shards must be positive, got {dense_shards!r} and {expert_shards!r}"
        )
    held = bytes_per_param * (dense + expert)
    return held + sharded_bytes_per_param * (
        dense / dense_shards + expert / expert_shards
    )


def _block_forward_flops(
    spec: TransformerSpec, expert_block: bool, causal: bool, ffn_factor: int
) -> int:
    """Forward FLOPs per token of one block, as Megatron-LM counts them."""
    h, s, heads = spec.hidden_size, spec.seq_length, spec.num_attention_heads
    mla = spec.mla
    if mla is None:
        q = heads * spec.head_dim
        kv = 2 * spec.num_query_groups * spec.head_dim
        attention = 2 * (h * (q + kv) + q * h) + (2 if causal else 4) * q * s
    else:
        qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
        if mla.q_lora_rank:  # the "+ 1": Megatron counts the latent norms
            q_term = mla.q_lora_rank * (h + heads * qk + 1)
        else:
            q_term = h * heads * qk
        kv_term = mla.kv_lora_rank * (
            h + heads * (mla.qk_head_dim + mla.v_head_dim) + 1
        )
        projections = q_term + kv_term + h * mla.qk_pos_emb_head_dim
        projections += heads * mla.v_head_dim * h
        core = s * heads * (qk + mla.v_head_dim)  # QK^T and AV, full square
        attention = 2 * projections + (core if causal else 2 * core)
    moe = spec.moe
    if expert_block and moe is not None:
        width = moe.ffn_hidden_size * moe.topk + moe.shared_ffn_hidden_size
    else:
        width = spec.ffn_hidden_size
    return attention + 2 * h * width * ffn_factor


def training_flops(
    spec: TransformerSpec,
    global_batch: int,
    recomputed_blocks: int | Sequence[bool] | None,
    tp: int = 1,
    *,
    causal: bool | None = None,
    count_gate: bool | None = None,
) -> float:
    """FLOPs of one training iteration: three passes' GEMMs (forward, and the
    backward's two) plus a forward of each recomputed block.

    Megatron-LM's count (``num_floating_point_operations``, core_v0.16.1;
    Megatron-Bridge's ``flop_utils`` the same for these shapes): per token, 2
    FLOPs a multiply-add of each GEMM; a block's attention ``2 (h (q + 2 g d)
    + q h)`` (``q = a d``) plus the scores and context, ``4 q s`` over the
    full square or ``2 q s`` causal; multi-latent attention its projections
    (the latent norms as one FLOP an element) and its core ``2 s a (d_qk +
    d_rope + d_v)``, halved when causal; the MLP ``2 h f`` times 3 (gated) or
    2, an expert block's width ``f_e topk + f_shared``; each
    multi-token-prediction depth a block shaped as the last one, ``2 (3h +
    2h^2)`` for its norms and projection, and an LM head; the LM head ``2 h
    V``. Norms, activations, softmax, the router, biases and the embedding
    lookup are not counted.

    Args:
        spec: the model.
        global_batch: samples per iteration.
        recomputed_blocks: the blocks whose forward reruns: ``None`` all,
            ``0`` none, a count (only where every block costs the same), or
            one flag per block. Multi-token-prediction depths and the head
            are never rerun.
        tp: the vocabulary is padded as for this TP degree.
        causal: count the causal half of the attention square (Megatron-LM
            since core_r0.12, Megatron-Bridge) or all of it (Megatron-LM
            through core_r0.11, SC'21's Eq. 3). ``None``: causal for
            mixture-of-experts, multi-latent attention and multi-token
            prediction (whose only published counts are the newer ones), the
            full square for the others.
        count_gate: count a gated MLP's third matrix. ``None``: the spec's
            ``gated_mlp`` (the GEMMs run). Megatron-LM counts it only with
            ``--swiglu`` and Megatron-Bridge up to v0.4 only for a SiLU gate:
            ``False`` reproduces their count of another gated activation
            (GPT-OSS's gated quick-GELU).

    Returns:
        FLOPs per iteration (float).
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int):
        raise ValueError(
            f"global_batch must be a positive integer, got {global_batch!r}"
        )
    if global_batch <= 0:
        raise ValueError(
            f"global_batch must be a positive integer, got {global_batch!r}"
        )
    if causal is None:
        causal = spec.moe is not None or spec.mla is not None or spec.mtp_layers > 0
    gated = spec.gated_mlp if count_gate is None else count_gate
    if not isinstance(causal, bool) or not isinstance(gated, bool):
        raise ValueError("causal and count_gate must be true, false or None")
    ffn_factor = 3 if gated else 2
    moe, layers = spec.moe, spec.num_layers
    kinds = [moe is not None and moe.is_expert_block(b) for b in range(layers)]
    cost = {
        kind: _block_forward_flops(spec, kind, causal, ffn_factor)
        for kind in set(kinds)
    }
    rerun = _rerun_flops(recomputed_blocks, kinds, cost)
    h = spec.hidden_size
    head = 2 * h * spec.padded_vocab_size(tp)
    mtp = spec.mtp_layers * (cost[kinds[-1]] + 2 * (3 * h + 2 * h * h) + head)
    forward = sum(cost[kind] for kind in kinds) + head + mtp
    tokens = global_batch * spec.seq_length
    return float(tokens * (3 * forward + rerun))


def _rerun_flops(
    recomputed: int | Sequence[bool] | None, kinds: list[bool], cost: dict[bool, int]
) -> int:
    layers = len(kinds)
    if recomputed is None:
        return sum(cost[kind] for kind in kinds)
    if isinstance(recomputed, int) and not isinstance(recomputed, bool):
        if not 0 <= recomputed <= layers:
            raise ValueError(
                f"recomputed_blocks must be an integer in [0, {layers}], "
                f"got {recomputed!r}"
            )
        if recomputed == layers:
            return sum(cost[kind] for kind in kinds)
        if recomputed == 0 or len(cost) == 1:
            return recomputed * cost[kinds[0]]
        raise ValueError(
            "blocks differ in cost (dense and expert blocks): name the recomputed "
            "blocks, one flag per block"
        )
    flags = tuple(recomputed) if isinstance(recomputed, Sequence) else None
    if (
        flags is None
        or len(flags) != layers
        or not all(isinstance(flag, bool) for flag in flags)
    ):
        raise ValueError(
            f"recomputed_blocks must be None, a count or {layers} true/false "
            f"flags, got {recomputed!r}"
        )
    return sum(cost[kind] for kind, flag in zip(kinds, flags, strict=True) if flag)
