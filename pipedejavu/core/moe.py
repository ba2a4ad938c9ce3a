"""Mixture-of-experts and multi-latent attention: the shape fields a
:class:`~pipedejavu.core.transformer.TransformerSpec` may carry.

* :class:`MoeSpec`: which blocks route their tokens to experts, how many
  experts there are, how many each token visits (``topk``), each expert's MLP
  width, and the shared experts every token passes through (DeepSeek, Qwen2-MoE,
  Llama 4). A block that is not an expert block keeps the spec's dense MLP
  (``ffn_hidden_size``): DeepSeek's first dense layers, Llama 4's interleaved
  layers, Megatron-LM's ``--moe-layer-freq``.
* :class:`MlaSpec`: DeepSeek's multi-latent attention (Megatron-LM's
  ``--multi-latent-attention`` with ``--q-lora-rank``, ``--kv-lora-rank``,
  ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``).

Expert MLPs have the spec's ``gated_mlp`` and ``linear_bias`` as its dense MLP
does (every model read here uses one activation for both).

This module is vocabulary: it imports nothing else of ours.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "MOE_LIMITS",
    "MlaSpec",
    "MoeSpec",
    "dispatch_overlap_needs",
    "expert_tp_needs",
    "moe_layer_pattern",
]

#: The largest value of each size field: arrays of experts and layers stay
#: bounded whatever a config file says.
MOE_LIMITS = {
    "num_experts": 2**16,
    "topk": 2**10,
    "ffn_hidden_size": 2**22,
    "shared_ffn_hidden_size": 2**22,
    "q_lora_rank": 2**20,
    "kv_lora_rank": 2**20,
    "qk_head_dim": 2**16,
    "qk_pos_emb_head_dim": 2**16,
    "v_head_dim": 2**16,
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(where: str, field: str, value: object, *, zero_ok: bool) -> None:
    low = 0 if zero_ok else 1
    limit = MOE_LIMITS[field]
    if not _is_int(value) or not low <= value <= limit:
        kind = "a non-negative" if zero_ok else "a positive"
        raise ValueError(
            f"{where}: {field} must be {kind} integer at most {limit}, got {value!r}"
        )


def moe_layer_pattern(
    num_layers: int, *, freq: int = 1, first_dense: int = 0
) -> tuple[bool, ...]:
    """Which of ``num_layers`` blocks are expert blocks.

    Megatron-LM's ``--moe-layer-freq N`` makes block ``i`` (from 0) an expert
    block when ``i % N == 0``; Hugging Face's ``first_k_dense_replace`` /
    ``decoder_sparse_step`` say the same with the first ``first_dense`` blocks
    dense.

    Raises:
        ValueError: a count is not a positive integer (``first_dense``:
            non-negative, at most ``num_layers``).
    """
    if not _is_int(num_layers) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not _is_int(freq) or not 1 <= freq <= num_layers:
        raise ValueError(
            f"the expert-layer frequency must be an integer in [1, {num_layers}], "
            f"got {freq!r}"
        )
    if not _is_int(first_dense) or not 0 <= first_dense <= num_layers:
        raise ValueError(
            f"the first dense layers must be an integer in [0, {num_layers}], "
            f"got {first_dense!r}"
        )
    return tuple(i >= first_dense and i % freq == 0 for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The expert layers of a mixture-of-experts transformer.

    Args:
        num_experts: routed experts per expert block ``E``.
        topk: experts each token is routed to ``k`` (``k <= E``).
        ffn_hidden_size: one routed expert's MLP width (per matrix when gated).
        shared_ffn_hidden_size: the shared experts' MLP width, all of them
            together (Megatron-LM's ``--moe-shared-expert-intermediate-size``);
            0 if none.
        layers: one flag per block, true for an expert block;
            ``None``: every block (see :func:`moe_layer_pattern`).
        shared_expert_gate: the shared experts' output is scaled by a learned
            sigmoid gate (Qwen2-MoE: ``h`` more parameters a block).

    Raises:
        ValueError: a field is out of range, ``topk > num_experts``, or
            ``layers`` has no expert block.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: int = 0
    layers: tuple[bool, ...] | None = None
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        where = "mixture of experts"
        for field in ("num_experts", "topk", "ffn_hidden_size"):
            _check_size(where, field, getattr(self, field), zero_ok=False)
        _check_size(
            where, "shared_ffn_hidden_size", self.shared_ffn_hidden_size, zero_ok=True
        )
        if self.topk > self.num_experts:
            raise ValueError(
                f"{where}: topk ({self.topk}) must be at most num_experts "
                f"({self.num_experts})"
            )
        if not isinstance(self.shared_expert_gate, bool):
            raise ValueError(
                f"{where}: shared_expert_gate must be true or false, "
                f"got {self.shared_expert_gate!r}"
            )
        if self.layers is not None:
            if not isinstance(self.layers, tuple) or not all(
                isinstance(flag, bool) for flag in self.layers
            ):
                raise ValueError(
                    f"{where}: layers must be a tuple of true/false flags, one per "
                    "block"
                )
            if not any(self.layers):
                raise ValueError(f"{where}: layers names no expert block")

    def is_expert_block(self, block: int) -> bool:
        """Whether block ``block`` (0-based) routes to experts."""
        return True if self.layers is None else self.layers[block]

    def num_expert_blocks(self, num_layers: int) -> int:
        return num_layers if self.layers is None else sum(self.layers)


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """Multi-latent attention (DeepSeek-V2/V3).

    Args:
        q_lora_rank: the queries' low-rank width; 0 projects queries directly
            (DeepSeek-V2-Lite).
        kv_lora_rank: the compressed key/value width.
        qk_head_dim: the part of each query/key head without rotary embedding.
        qk_pos_emb_head_dim: the rotary part of each query/key head (one rotary
            key shared by all heads).
        v_head_dim: each value head's width.

    Raises:
        ValueError: a field is out of range.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        where = "multi-latent attention"
        _check_size(where, "q_lora_rank", self.q_lora_rank, zero_ok=True)
        for field in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim"):
            _check_size(where, field, getattr(self, field), zero_ok=False)
        _check_size(where, "v_head_dim", self.v_head_dim, zero_ok=False)


def dispatch_overlap_needs(
    *,
    ep: int,
    dispatcher: str,
    pp: int,
    chunks: int,
    full_recompute: bool,
    params_dtype: str,
    shared_expert_overlap: bool = False,
    mtp_layers: int = 0,
) -> str | None:
    """What a training lacks for Megatron-Core to overlap the experts'
    dispatch and combine with another micro-batch's compute
    (``--overlap-moe-expert-parallel-comm``; TransformerConfig.__post_init__,
    core_v0.16.1), in a few words; ``None`` where it runs.

    The one rule: the Megatron-LM reader refuses a launch with it, and the
    planner searches the overlap only where it holds.

    Args:
        ep: expert-parallel degree; ``dispatcher``: ``alltoall``,
            ``allgather`` or ``flex``.
        pp, chunks: pipeline stages and model chunks per pipeline rank.
        full_recompute: ``--recompute-granularity full`` (or a recompute
            method or block count).
        params_dtype: ``fp32``, ``fp16`` or ``bf16``.
        shared_expert_overlap: ``--moe-shared-expert-overlap`` with shared
            experts.
        mtp_layers: multi-token prediction depths.
    """
    if ep == 1:
        return "--expert-model-parallel-size > 1"
    if dispatcher not in ("alltoall", "flex"):
        return "--moe-token-dispatcher-type alltoall or flex"
    if pp > 1 and chunks == 1:
        return "virtual pipeline stages with --pipeline-model-parallel-size > 1"
    if full_recompute:
        return "no full recomputation (no --recompute-method/--recompute-num-layers)"
    if params_dtype not in ("bf16", "fp16"):
        return "--bf16 or --fp16"
    if shared_expert_overlap:
        return "no --moe-shared-expert-overlap"
    if mtp_layers > 1:
        return "at most one MTP layer (--mtp-num-layers 1)"
    if mtp_layers == 1 and pp == 1:
        return "--pipeline-model-parallel-size > 1 with an MTP layer"
    return None


def expert_tp_needs(*, etp: int, linear_bias: bool) -> str | None:
    """What an expert TP degree needs that the model lacks (Megatron-Core's
    TransformerConfig: "Bias in Moe is only supported when ETP==1"), in a
    few words; ``None`` where it runs. The reader refuses launches by it and
    the planner searches expert TP only where it holds."""
    if linear_bias and etp != 1:
        return "expert TP 1 for experts with linear biases (no --disable-bias-linear)"
    return None
