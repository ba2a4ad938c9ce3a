"""A decoder-only transformer's shape: what the analytical cost model reads.

Layers are numbered as in the bundled Sailor profiles: layer 0 is the embedding,
layers ``1..num_layers`` are the transformer blocks, layer ``num_layers + 1`` is
the final norm with the LM head (and the loss). So a model with ``L`` blocks has
``L + 2`` profile layers and Sailor ``plan_config`` files stay valid. (Sailor's
``LLAMA-3-8`` profile keeps the final norm and the LM head apart, ``L + 3``
layers: ``split_head_layer``.)

Parameter counts follow Megatron-LM's tensor-parallel layout: the word embedding
and LM head are split by rows of the (padded) vocabulary, the QKV and first MLP
projections by columns (their biases with them), the attention output and second
MLP projections by rows (their biases replicated), and every norm and the
learned position table are replicated. Mixture-of-experts, multi-latent
attention and multi-token-prediction blocks are counted, split into a dense
and an expert part, by :mod:`pipedejavu.core.moe_counts`
(:meth:`TransformerSpec.layer_param_split`); the dense counts the cost model
reads (:meth:`TransformerSpec.layer_params`) refuse them.

This module is vocabulary: it imports nothing else of ours. Readers of model
configuration files (Hugging Face ``config.json``, Megatron-LM arguments,
bundled presets) build a :class:`TransformerSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, get_args

from pipedejavu.core import moe_counts
from pipedejavu.core.moe import MlaSpec, MoeSpec

__all__ = [
    "DECODER_DESIGN",
    "SPEC_LIMITS",
    "Norm",
    "Position",
    "QkNormScope",
    "TransformerSpec",
]

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rotary", "alibi", "none"]
#: Query/key norms other than Megatron-Core's per-head ones (``qk_layernorm``
#: ``True``): ``"projection"``, one norm over each whole projection (OLMoE).
QkNormScope = Literal["projection"]

#: The layer design of today's open decoders (Llama, Qwen3, DeepSeek, OLMoE):
#: a gated (SwiGLU) MLP, RMSNorm, rotary positions, untied embeddings and
#: linear layers without biases (:class:`TransformerSpec` fields).
DECODER_DESIGN = {
    "gated_mlp": True,
    "norm": "rmsnorm",
    "position": "rotary",
    "tied_embeddings": False,
    "linear_bias": False,
}

#: The largest value of each size field (well past any trained model: 10,000
#: blocks, a 1 Mi-wide hidden state, 16 Mi tokens a sample): arrays of layers
#: and tokens stay bounded whatever a config file or a command line says.
SPEC_LIMITS = {
    "num_layers": 10_000,
    "hidden_size": 2**20,
    "num_attention_heads": 2**16,
    "num_query_groups": 2**16,
    "ffn_hidden_size": 2**22,
    "vocab_size": 2**24,
    "seq_length": 2**24,
    "vocab_divisible_by": 2**16,
    "kv_channels": 2**16,
}
_POSITIVE_INTS = tuple(name for name in SPEC_LIMITS if name != "kv_channels")
_BOOLS = (
    "gated_mlp",
    "tied_embeddings",
    "linear_bias",
    "qkv_bias",
    "split_head_layer",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer: dense, or a mixture of experts.

    Args:
        name: a name for messages and reports.
        num_layers: transformer blocks (the profile has ``num_layers + 2`` layers).
        hidden_size: model width ``h``.
        num_attention_heads: query heads ``a``.
        num_query_groups: key/value heads (``a`` for multi-head attention, fewer
            for grouped-query attention, 1 for multi-query).
        ffn_hidden_size: the MLP's inner width (per matrix for a gated MLP).
        vocab_size: the tokenizer's vocabulary (rows of the word embedding before
            padding; see ``vocab_divisible_by``).
        seq_length: tokens per sample ``s``.
        gated_mlp: SwiGLU-style MLP (three matrices: gate, up, down) instead of
            two.
        norm: the normalization of each block and the final one (``layernorm``:
            weight and bias; ``rmsnorm``: weight only).
        position: the position encoding (``learned`` adds an embedding table of
            ``max_position_embeddings x h``).
        max_position_embeddings: rows of a learned position table (0 if none).
        tied_embeddings: the LM head reuses the word embedding.
        linear_bias: the linear layers carry biases (GPT-2, OPT, GPT-NeoX);
            LLaMA-style models have none.
        qkv_bias: the QKV projection carries a bias even where other linear
            layers do not (Qwen2). The QKV bias exists if either flag is set.
        vocab_divisible_by: the embedding's rows are padded, as Megatron-LM pads
            them, to a multiple of ``vocab_divisible_by * tp`` (Megatron's
            ``--make-vocab-size-divisible-by``, 128 by default there; 1 here, which
            still pads to a multiple of ``tp`` so that the rows split evenly).
        split_head_layer: the final norm and the LM head are two profile layers
            (``L + 3`` in all, as in Sailor's ``LLAMA-3-8`` profile) instead of
            one.
        moe: the expert layers of a mixture of experts (``None``: dense).
        mla: multi-latent attention instead of grouped-query attention.
        mtp_layers: multi-token-prediction blocks after the last block
            (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers``).
        qk_layernorm: the query and key norms with weights. ``False``: none
            (or weightless ones: Llama 4's L2 norm). ``True``: one norm of a
            head's width ``d`` shared by every query head and one shared by
            every key head (Megatron-LM's ``--qk-layernorm``, Qwen3); with
            ``mla``, the norms of the query and key/value latents (Megatron-LM's
            ``--qk-layernorm`` with ``--multi-latent-attention``; DeepSeek).
            ``"projection"``: one norm over the whole query projection (``a d``
            wide) and one over the whole key projection (``g d``; OLMoE).
        kv_channels: each attention head's width ``d`` when the heads are not
            ``h / a`` wide (Megatron-LM's ``--kv-channels``, Hugging Face's
            ``head_dim``: Qwen3, GPT-OSS); ``None``: ``h / a``.

    Raises:
        ValueError: a field is not of its type, not positive, or the shapes do
            not fit (heads must divide the width, query groups the heads).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    gated_mlp: bool = False
    norm: Norm = "layernorm"
    position: Position = "learned"
    max_position_embeddings: int = 0
    tied_embeddings: bool = True
    linear_bias: bool = True
    qkv_bias: bool = False
    vocab_divisible_by: int = 1
    split_head_layer: bool = False
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None
    mtp_layers: int = 0
    qk_layernorm: bool | QkNormScope = False
    kv_channels: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        where = f"model {self.name}"
        self._check_moe(where)
        for field in _POSITIVE_INTS:
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"{where}: {field} must be a positive integer, got {value!r}"
                )
            if value > SPEC_LIMITS[field]:
                raise ValueError(
                    f"{where}: {field} must be at most {SPEC_LIMITS[field]}, "
                    f"got {value}"
                )
        for field in _BOOLS:
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{where}: {field} must be true or false, got {value!r}"
                )
        if self.norm not in get_args(Norm):
            raise ValueError(
                f"{where}: norm must be one of {get_args(Norm)}, got {self.norm!r}"
            )
        if self.position not in get_args(Position):
            raise ValueError(
                f"{where}: position must be one of {get_args(Position)}, "
                f"got {self.position!r}"
            )
        rows = self.max_position_embeddings
        if not _is_int(rows) or not 0 <= rows <= SPEC_LIMITS["seq_length"]:
            raise ValueError(
                f"{where}: max_position_embeddings must be an integer in "
                f"[0, {SPEC_LIMITS['seq_length']}], got {rows!r}"
            )
        if self.position == "learned" and rows < self.seq_length:
            raise ValueError(
                f"{where}: a learned position table needs max_position_embeddings "
                f">= seq_length ({self.seq_length}), got {rows}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) must "
                f"divide hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{where}: num_query_groups ({self.num_query_groups}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    def _check_moe(self, where: str) -> None:
        if self.moe is not None and not isinstance(self.moe, MoeSpec):
            raise ValueError(f"{where}: moe must be a MoeSpec, got {self.moe!r}")
        if self.mla is not None and not isinstance(self.mla, MlaSpec):
            raise ValueError(f"{where}: mla must be a MlaSpec, got {self.mla!r}")
        layers = None if self.moe is None else self.moe.layers
        if layers is not None and len(layers) != self.num_layers:
            raise ValueError(
                f"{where}: the expert-layer pattern names {len(layers)} blocks, "
                f"the model has {self.num_layers}"
            )
        if not _is_int(self.mtp_layers) or not 0 <= self.mtp_layers <= 64:
            raise ValueError(
                f"{where}: mtp_layers must be an integer in [0, 64], "
                f"got {self.mtp_layers!r}"
            )
        scopes = get_args(QkNormScope)
        if not isinstance(self.qk_layernorm, bool) and self.qk_layernorm not in scopes:
            raise ValueError(
                f"{where}: qk_layernorm must be true, false or "
                f"{', '.join(repr(scope) for scope in scopes)}, "
                f"got {self.qk_layernorm!r}"
            )
        if self.mla is not None and self.qk_layernorm in scopes:
            raise ValueError(
                f"{where}: qk_layernorm {self.qk_layernorm!r} needs grouped-query "
                "attention (with mla: true, the latent norms, or false)"
            )
        width, limit = self.kv_channels, SPEC_LIMITS["kv_channels"]
        if width is not None and (not _is_int(width) or not 0 < width <= limit):
            raise ValueError(
                f"{where}: kv_channels must be a positive integer at most {limit} "
                f"or null, got {width!r}"
            )

    @property
    def is_dense(self) -> bool:
        """No experts, no multi-latent attention, no multi-token prediction,
        attention as wide as the model: the shapes the cost model prices."""
        return (
            self.moe is None
            and self.mla is None
            and self.mtp_layers == 0
            and self.num_attention_heads * self.head_dim == self.hidden_size
        )

    def check_dense(self) -> None:
        """Raise ``ValueError`` for a shape the dense counts do not price (the
        cost model reads them; :meth:`layer_param_split` counts every shape)."""
        if not self.is_dense:
            raise ValueError(
                f"model {self.name}: mixture-of-experts, multi-latent attention, "
                "multi-token prediction layers and attention heads wider or "
                "narrower than hidden_size / num_attention_heads are not priced yet"
            )

    def _check_dense_blocks(self) -> None:
        """Blocks alike, each a dense block's parameters (any head width)."""
        if self.moe is not None or self.mla is not None or self.mtp_layers:
            raise ValueError(
                f"model {self.name}: mixture-of-experts, multi-latent attention "
                "and multi-token prediction blocks are counted by "
                "layer_param_split, not as dense blocks"
            )

    @property
    def head_dim(self) -> int:
        """Each attention head's width ``d``: ``kv_channels``, or ``h / a``."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def num_profile_layers(self) -> int:
        """Embedding, blocks, head: the layers a plan splits (``L + 2``, or
        ``L + 3`` with ``split_head_layer``)."""
        return self.num_layers + (3 if self.split_head_layer else 2)

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the word embedding under tensor parallelism ``tp``: the
        vocabulary rounded up to a multiple of ``vocab_divisible_by * tp``, as
        Megatron-LM pads it."""
        self.check_tp(tp)
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` unless Megatron-LM can split this model ``tp`` ways.

        The query heads and the MLP width must divide by ``tp``; the key/value
        heads must divide by ``tp`` or ``tp`` by them (each GPU then holds one
        key/value head, replicated).
        """
        if not _is_int(tp) or tp <= 0:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        where = f"model {self.name}"
        if self.num_attention_heads % tp:
            raise ValueError(
                f"{where}: tp {tp} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.ffn_hidden_size % tp:
            raise ValueError(
                f"{where}: tp {tp} must divide ffn_hidden_size ({self.ffn_hidden_size})"
            )
        groups = self.num_query_groups
        if groups % tp and tp % groups:
            raise ValueError(
                f"{where}: num_query_groups ({groups}) must be a multiple or a "
                f"divisor of tp {tp}"
            )

    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def block_params(self, tp: int = 1) -> int:
        """Parameters of one transformer block held by one GPU of a TP group
        (dense shapes only: :meth:`layer_param_split` counts the others)."""
        self._check_dense_blocks()
        return moe_counts.block_param_split(self, 0, tp)[0]

    def embedding_params(self, tp: int = 1) -> int:
        """Layer 0 on one GPU: its slice of the word embedding, plus the whole
        learned position table (replicated)."""
        word = self.padded_vocab_size(tp) // tp * self.hidden_size
        if self.position == "learned":
            word += self.max_position_embeddings * self.hidden_size
        return word

    def tied_params(self, tp: int = 1) -> int:
        """Word-embedding parameters (one GPU's slice) the LM head shares with
        layer 0; 0 if the embeddings are untied.

        Megatron-LM keeps a copy of them on the last pipeline stage when the
        first and last layers are on different stages, and all-reduces their
        gradients between the two.
        """
        if not self.tied_embeddings:
            self.check_tp(tp)
            return 0
        return self.padded_vocab_size(tp) // tp * self.hidden_size

    def head_params(self, tp: int = 1, *, tied_copy: bool = False) -> int:
        """The final norm and LM head on one GPU: the LM head counts if it is
        untied (or, with ``tied_copy``, as the copy of the tied embedding a
        separate last pipeline stage holds)."""
        self.check_tp(tp)
        return self._norm_params() + self._lm_head_params(tp, tied_copy)

    def _lm_head_params(self, tp: int, tied_copy: bool) -> int:
        if not self.tied_embeddings:
            return self.padded_vocab_size(tp) // tp * self.hidden_size
        return self.tied_params(tp) if tied_copy else 0

    def layer_params(self, tp: int = 1, *, tied_copy: bool = False) -> tuple[int, ...]:
        """Parameters per profile layer held by one GPU of a TP group of ``tp``
        (dense shapes only: the cost model reads these; a mixture of experts
        has :meth:`layer_param_split`).

        Args:
            tp: tensor-parallel degree (Megatron-LM sharding, see the module doc).
            tied_copy: count the tied word embedding again in the last layer, as
                a last pipeline stage without layer 0 holds it.

        Returns:
            ``num_profile_layers`` exact counts (elements, not bytes): embedding,
            blocks, final norm with LM head (or final norm, then LM head, with
            ``split_head_layer``).

        Raises:
            ValueError: ``tp`` does not split the model (see :meth:`check_tp`),
                or the shape is not dense.
        """
        self._check_dense_blocks()
        pairs = self.layer_param_split(tp, tied_copy=tied_copy)
        return tuple(dense for dense, _ in pairs)

    def layer_param_split(
        self,
        tp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        *,
        tied_copy: bool = False,
    ) -> tuple[tuple[int, int], ...]:
        """``(dense, expert)`` parameters per profile layer on one GPU, with the
        experts spread over ``ep`` GPUs and each split over ``etp`` (default
        ``tp``); multi-token-prediction depths in the last layer. See
        :func:`pipedejavu.core.moe_counts.layer_param_split`."""
        return moe_counts.layer_param_split(self, tp, ep, etp, tied_copy=tied_copy)

    @property
    def num_params(self) -> int:
        """Total parameters, each counted once (a tied head is not counted
        twice; multi-token-prediction depths included), with the vocabulary
        padded as for ``tp = 1``."""
        return sum(d + e for d, e in self.layer_param_split(1))

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: :attr:`num_params` less the
        routed experts it is not sent to."""
        return moe_counts.active_params(self)

    def model_flops_per_iteration(
        self,
        global_batch: int,
        tp: int = 1,
        *,
        causal: bool | None = None,
        count_gate: bool | None = None,
    ) -> float:
        """Model FLOPs of one training iteration: the forward and backward
        passes, no recomputation. Divided by the time and the GPUs' peak, the
        model FLOPs utilization (MFU); Megatron-LM's logged TFLOP/s per GPU
        count these (``num_floating_point_operations``: each GEMM three times).

        For a GPT with a 4h MLP this is SC'21's
        ``F = 72 B s l h^2 (1 + s / (6h) + V / (12 l h))``; the count is
        :meth:`hardware_flops_per_iteration` with no block recomputed.

        Args:
            global_batch: samples per iteration ``B``.
            tp: the vocabulary ``V`` is padded as for this TP degree.
            causal, count_gate: the counting conventions of
                :meth:`hardware_flops_per_iteration`.

        Returns:
            FLOPs per iteration (float).
        """
        return self.hardware_flops_per_iteration(
            global_batch, 0, tp, causal=causal, count_gate=count_gate
        )

    def hardware_flops_per_iteration(
        self,
        global_batch: int,
        recomputed_blocks: int | Sequence[bool] | None,
        tp: int = 1,
        *,
        causal: bool | None = None,
        count_gate: bool | None = None,
    ) -> float:
        """Floating-point operations the GPUs run in one training iteration:
        the model FLOPs plus the forward passes recomputation reruns (the
        hardware FLOPs utilization, HFU, divides these by time and peak).

        Narayanan et al. (SC'21, Eq. 3), for a GPT with a 4h MLP and full
        activation recomputation, count
        ``F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h))``, and without
        recomputation ``F = 72 B s l h^2 (1 + s / (6h) + V / (12 l h))``; SC'21's
        published TFLOP/s per GPU are these.

        Generalization used here (it reproduces both exactly for such a GPT):
        every matrix multiply costs 2 FLOPs per multiply-add; a block's forward
        pass per token costs its GEMMs ``2 h (q + 2 g d)`` (QKV: ``q = a d``
        query columns, ``g`` query groups of width ``d``), ``2 q h``
        (attention output), ``2 h f`` times 2 or 3 (MLP, 3 when gated) and the
        attention scores and context ``2 * 2 s q`` (the full ``s x s`` square,
        as Megatron-LM counted it through core_r0.11), or half of that with
        ``causal``; the LM head costs ``2 h V`` per token. The backward pass
        costs twice the forward, and each recomputed block one more forward
        pass (the LM head is never recomputed). Norms, activations, softmax,
        biases and the embedding lookup are not counted. Mixture-of-experts
        blocks (``topk`` routed experts and the shared ones), multi-latent
        attention and multi-token prediction are counted as Megatron-LM counts
        them: :func:`pipedejavu.core.moe_counts.training_flops`.

        Args:
            global_batch: samples per iteration ``B``.
            recomputed_blocks: which of the ``l`` blocks rerun their forward
                in the backward pass (Megatron-LM's full recomputation:
                ``None``, all of them; ``--recompute-method block``: how many
                it reruns, or one flag per block where blocks differ; ``0``:
                none).
            tp: the vocabulary ``V`` is padded as for this TP degree.
            causal: count half the attention square (Megatron-LM since
                core_r0.12, Megatron-Bridge); ``None``: only for
                mixture-of-experts, multi-latent-attention and
                multi-token-prediction shapes, whose published counts are those.
            count_gate: count a gated MLP's third matrix (``None``:
                ``gated_mlp``); ``False`` reproduces Megatron's count of a gate
                that is not SwiGLU.

        Returns:
            FLOPs per iteration (float).
        """
        return moe_counts.training_flops(
            self,
            global_batch,
            recomputed_blocks,
            tp,
            causal=causal,
            count_gate=count_gate,
        )
