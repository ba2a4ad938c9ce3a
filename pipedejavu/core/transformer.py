"""A decoder-only transformer's shape: what the analytical cost model reads.

Layers are numbered as in the bundled Sailor profiles: layer 0 is the embedding,
layers ``1..num_layers`` are the transformer blocks, layer ``num_layers + 1`` is
the final norm with the LM head (and the loss). So a model with ``L`` blocks has
``L + 2`` profile layers and Sailor ``plan_config`` files stay valid.

This module is vocabulary: it imports nothing else of ours. Readers of model
configuration files (Hugging Face ``config.json``, Megatron-LM arguments,
bundled presets) build a :class:`TransformerSpec`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Norm", "Position", "TransformerSpec"]

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rotary", "alibi", "none"]


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """A dense decoder-only transformer.

    Args:
        name: a name for messages and reports.
        num_layers: transformer blocks (the profile has ``num_layers + 2`` layers).
        hidden_size: model width ``h``.
        num_attention_heads: query heads ``a``.
        num_query_groups: key/value heads (``a`` for multi-head attention, fewer
            for grouped-query attention, 1 for multi-query).
        ffn_hidden_size: the MLP's inner width (per matrix for a gated MLP).
        vocab_size: the embedding's rows, padded as the framework pads them.
        seq_length: tokens per sample ``s``.
        gated_mlp: SwiGLU-style MLP (three matrices: gate, up, down) instead of
            two.
        norm: the normalization of each block and the final one.
        position: the position encoding (``learned`` adds an embedding table of
            ``max_position_embeddings x h``).
        max_position_embeddings: rows of a learned position table.
        tied_embeddings: the LM head reuses the word embedding.
        linear_bias: the linear layers carry biases (GPT-2, OPT, GPT-NeoX);
            LLaMA-style models have none.
        qkv_bias: the QKV projection carries a bias even where other linear
            layers do not (Qwen2).
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_profile_layers(self) -> int:
        """Embedding, blocks, head: the layers a plan splits."""
        return self.num_layers + 2
