"""Layer lists for synthetic stage-construction instances.

A model is a sequence of :class:`LayerSpec` (Alpa's clustered layers, in pipeline
order). Each layer states, per micro-batch, the work and the bytes a stage cost
model needs; :mod:`pipedejavu.costmodel.stage.synthesis` turns a list into Alpa's
tables.

Units: FLOPs (multiply and add counted as 2), bytes. All quantities are for one
whole micro-batch and the whole (unsharded) layer; the cost model divides them by
the data- and tensor-parallel degrees.

GPT formulas (:func:`gpt_layers`; b = micro-batch, s = sequence length, h =
hidden size, V = vocabulary, a = heads, p = ``dtype_bytes``), from Narayanan et
al. 2021 (FLOPs) and Korthikanti et al. 2022 (activation memory):

* Transformer block: forward FLOPs ``24 b s h^2 + 4 b s^2 h`` (QKV, attention
  output and the 4h MLP: ``24 b s h^2``; scores and their product with V:
  ``4 b s^2 h``); parameters ``(12 h^2 + 13 h) p`` bytes; output ``b s h p``;
  stash ``b s h (16 p + 2)`` (34 bsh at p = 2: 16 activation tensors of size
  bsh plus two 1-byte dropout masks), plus ``a b s^2 (2 p + 1)`` for the
  attention scores when ``num_heads`` is given (``None``: the scores are
  recomputed, flash-attention style, and not stashed). Tensor parallelism
  (Megatron): 2 all-reduces of ``b s h p`` bytes forward and 2 backward.
* Embedding (first layer): forward FLOPs ``b s h`` (the position add; the lookup
  is a gather); parameters ``(V + s) h p`` (token and position tables); output
  ``b s h p``; stash ``b s (4 + h)`` (int32 token ids and a dropout mask). A
  vocabulary-parallel embedding all-reduces its output once (forward).
* LM head (last layer, untied from the embedding as in pipeline-parallel
  Megatron): forward FLOPs ``2 b s h V``; parameters ``(V h + 2 h) p`` (the
  projection and the final layer norm); output 0 bytes (the loss); stash
  ``b s h p + 4 b s V`` (its input and the fp32 logits of the loss). Tensor
  parallelism shards the vocabulary and all-reduces the input gradient once
  (backward); the scalar all-reduces of the parallel cross-entropy are ignored.

:func:`irregular_layers` mixes dense transformer blocks of different widths,
mixture-of-experts blocks (many parameters, top-2 routing; experts are sharded
by tensor parallelism, expert-parallel all-to-all is not modelled), conv-like
blocks (many FLOPs per parameter, large activations) and light blocks (norms,
pooling), between an embedding and an LM head.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numpy.typing import NDArray

__all__ = ["LayerSpec", "boundary_activation_bytes", "gpt_layers", "irregular_layers"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One (clustered) layer of a model, per micro-batch.

    Args:
        name: a label, e.g. ``"block_3"``.
        forward_flops: FLOPs of the forward pass of one micro-batch (the backward
            pass is modelled as twice this).
        param_bytes: bytes of the layer's parameters (in their training dtype).
        output_bytes: bytes of the activation sent to the next layer per
            micro-batch; the gradient sent back has the same size.
        stash_bytes: bytes kept from the forward pass for the backward pass, per
            micro-batch.
        tp_allreduces: all-reduces over the tensor-parallel group per
            micro-batch, forward and backward together (Megatron block: 4).
        tp_allreduce_bytes: bytes of each of those all-reduces for the whole
            micro-batch (data parallelism divides it).

    Raises:
        ValueError: a negative, NaN or infinite quantity, or a non-string name.
    """

    name: str
    forward_flops: float
    param_bytes: float
    output_bytes: float
    stash_bytes: float
    tp_allreduces: int = 0
    tp_allreduce_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a str, got {type(self.name).__name__}")
        for field in (
            "forward_flops",
            "param_bytes",
            "output_bytes",
            "stash_bytes",
            "tp_allreduce_bytes",
        ):
            value = getattr(self, field)
            if not isinstance(value, (int, float, np.number)) or isinstance(
                value, bool
            ):
                raise ValueError(
                    f"{field} of layer {self.name!r} must be a number, "
                    f"got {type(value).__name__}"
                )
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"{field} of layer {self.name!r} must be finite and >= 0, "
                    f"got {value}"
                )
            object.__setattr__(self, field, float(value))
        count = self.tp_allreduces
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool):
            raise ValueError(
                f"tp_allreduces of layer {self.name!r} must be an integer, "
                f"got {count!r}"
            )
        if count < 0:
            raise ValueError(
                f"tp_allreduces of layer {self.name!r} must be >= 0, got {count}"
            )
        object.__setattr__(self, "tp_allreduces", int(count))


def _positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _transformer_block(
    name: str, tokens: int, seq_len: int, hidden: int, dtype_bytes: int
) -> LayerSpec:
    """A dense GPT block without stashed attention scores (see module doc)."""
    activation = float(tokens * hidden * dtype_bytes)
    return LayerSpec(
        name=name,
        forward_flops=24.0 * tokens * hidden**2 + 4.0 * tokens * seq_len * hidden,
        param_bytes=float((12 * hidden**2 + 13 * hidden) * dtype_bytes),
        output_bytes=activation,
        stash_bytes=float(tokens * hidden * (16 * dtype_bytes + 2)),
        tp_allreduces=4,
        tp_allreduce_bytes=activation,
    )


def _embedding(tokens: int, seq_len: int, hidden: int, vocab: int, p: int):
    return LayerSpec(
        name="embedding",
        forward_flops=float(tokens * hidden),
        param_bytes=float((vocab + seq_len) * hidden * p),
        output_bytes=float(tokens * hidden * p),
        stash_bytes=float(tokens * (4 + hidden)),
        tp_allreduces=1,
        tp_allreduce_bytes=float(tokens * hidden * p),
    )


def _lm_head(tokens: int, hidden: int, vocab: int, p: int) -> LayerSpec:
    return LayerSpec(
        name="lm_head",
        forward_flops=2.0 * tokens * hidden * vocab,
        param_bytes=float((vocab * hidden + 2 * hidden) * p),
        output_bytes=0.0,
        stash_bytes=float(tokens * hidden * p + 4 * tokens * vocab),
        tp_allreduces=1,
        tp_allreduce_bytes=float(tokens * hidden * p),
    )


def gpt_layers(
    num_layers: int,
    hidden: int,
    seq_len: int,
    micro_batch: int,
    vocab: int,
    dtype_bytes: int = 2,
    *,
    num_heads: int | None = None,
) -> tuple[LayerSpec, ...]:
    """A GPT: embedding, ``num_layers - 2`` uniform blocks, LM head.

    Args:
        num_layers: L >= 3, the length of the returned list (blocks + 2).
        hidden: h, the hidden size.
        seq_len: s, tokens per sequence.
        micro_batch: b, sequences per micro-batch.
        vocab: V, the vocabulary size.
        dtype_bytes: p, bytes per parameter and activation element (2: fp16/bf16).
        num_heads: a; when given, the blocks also stash their attention scores
            (``a b s^2 (2 p + 1)`` bytes); ``None`` assumes they are recomputed.

    Returns:
        L layer specs (formulas in the module docstring).

    Raises:
        ValueError: a size that is not a positive integer, or ``num_layers < 3``.
    """
    num_layers = _positive_int(num_layers, "num_layers")
    if num_layers < 3:
        raise ValueError(
            f"num_layers counts the embedding and the LM head, so it must be >= 3, "
            f"got {num_layers}"
        )
    hidden = _positive_int(hidden, "hidden")
    seq_len = _positive_int(seq_len, "seq_len")
    micro_batch = _positive_int(micro_batch, "micro_batch")
    vocab = _positive_int(vocab, "vocab")
    dtype_bytes = _positive_int(dtype_bytes, "dtype_bytes")
    tokens = micro_batch * seq_len
    block = _transformer_block("block", tokens, seq_len, hidden, dtype_bytes)
    if num_heads is not None:
        num_heads = _positive_int(num_heads, "num_heads")
        scores = num_heads * micro_batch * seq_len**2 * (2 * dtype_bytes + 1)
        block = dataclasses.replace(block, stash_bytes=block.stash_bytes + scores)
    blocks = [
        dataclasses.replace(block, name=f"block_{index}")
        for index in range(num_layers - 2)
    ]
    return (
        _embedding(tokens, seq_len, hidden, vocab, dtype_bytes),
        *blocks,
        _lm_head(tokens, hidden, vocab, dtype_bytes),
    )


def _moe_block(name: str, rng: np.random.Generator, tokens: int, seq_len: int, p: int):
    hidden = int(rng.choice([1024, 2048]))
    experts = int(rng.choice([4, 8, 16]))
    top_k = 2
    activation = float(tokens * hidden * p)
    # Attention (8 b s h^2 + 4 b s^2 h) plus top_k expert MLPs of 16 b s h^2 each.
    flops = 8.0 * tokens * hidden**2 + 4.0 * tokens * seq_len * hidden
    flops += top_k * 16.0 * tokens * hidden**2
    # The MLP part of a dense block stashes 19 bsh (p = 2); each routed copy does.
    stash = tokens * hidden * (16 * p + 2) + (top_k - 1) * tokens * hidden * 19
    return LayerSpec(
        name=name,
        forward_flops=flops,
        param_bytes=float((4 * hidden**2 + experts * 8 * hidden**2) * p),
        output_bytes=activation,
        stash_bytes=float(stash),
        tp_allreduces=4,
        tp_allreduce_bytes=activation,
    )


def _conv_block(name: str, rng: np.random.Generator, micro_batch: int, p: int):
    channels_in = int(rng.choice([128, 256, 512, 1024]))
    channels_out = int(rng.choice([128, 256, 512, 1024]))
    side = int(rng.choice([16, 32, 64, 128]))
    pixels = micro_batch * side * side
    output = float(pixels * channels_out * p)
    return LayerSpec(
        name=name,
        forward_flops=2.0 * pixels * channels_in * channels_out * 9,  # 3x3 kernel
        param_bytes=float(9 * channels_in * channels_out * p),
        output_bytes=output,
        stash_bytes=float(pixels * channels_in * p) + 2.0 * output,  # input, norm
        tp_allreduces=2,
        tp_allreduce_bytes=output,
    )


def _light_block(name: str, rng: np.random.Generator, tokens: int, p: int):
    hidden = int(rng.choice([1024, 2048, 4096]))
    activation = float(tokens * hidden * p)
    return LayerSpec(
        name=name,
        forward_flops=10.0 * tokens * hidden,  # a norm / pooling: O(elements)
        param_bytes=float(2 * hidden * p),
        output_bytes=activation,
        stash_bytes=activation,
    )


def irregular_layers(
    num_layers: int,
    *,
    seed: int,
    micro_batch: int = 8,
    seq_len: int = 2048,
    vocab: int = 51200,
    dtype_bytes: int = 2,
) -> tuple[LayerSpec, ...]:
    """A model of mixed layers: embedding, random blocks, LM head.

    The blocks between the embedding (hidden 2048) and the LM head (hidden 2048)
    are drawn independently: dense transformer blocks of hidden 1024/2048/4096
    (45 %), mixture-of-experts blocks of hidden 1024/2048 with 4/8/16 experts
    and top-2 routing (20 %), 3x3 conv-like blocks of 128-1024 channels on
    16-128 pixel squares (20 %) and light norm/pooling blocks (15 %); see the
    module docstring.

    Args:
        num_layers: L >= 3 (blocks + 2).
        seed: seed of ``numpy.random.default_rng``; the same seed gives the same
            list.
        micro_batch: sequences (or images) per micro-batch.
        seq_len: tokens per sequence.
        vocab: vocabulary of the embedding and the LM head.
        dtype_bytes: bytes per parameter and activation element.

    Returns:
        L layer specs.

    Raises:
        ValueError: a size that is not a positive integer, or ``num_layers < 3``.
    """
    num_layers = _positive_int(num_layers, "num_layers")
    if num_layers < 3:
        raise ValueError(f"num_layers must be >= 3, got {num_layers}")
    micro_batch = _positive_int(micro_batch, "micro_batch")
    seq_len = _positive_int(seq_len, "seq_len")
    vocab = _positive_int(vocab, "vocab")
    p = _positive_int(dtype_bytes, "dtype_bytes")
    rng = np.random.default_rng(seed)
    tokens = micro_batch * seq_len
    layers = [_embedding(tokens, seq_len, 2048, vocab, p)]
    kinds = rng.choice(4, size=num_layers - 2, p=[0.45, 0.2, 0.2, 0.15])
    for index, kind in enumerate(kinds.tolist()):
        if kind == 0:
            hidden = int(rng.choice([1024, 2048, 4096]))
            layer = _transformer_block(f"dense_{index}", tokens, seq_len, hidden, p)
        elif kind == 1:
            layer = _moe_block(f"moe_{index}", rng, tokens, seq_len, p)
        elif kind == 2:
            layer = _conv_block(f"conv_{index}", rng, micro_batch, p)
        else:
            layer = _light_block(f"light_{index}", rng, tokens, p)
        layers.append(layer)
    layers.append(_lm_head(tokens, 2048, vocab, p))
    return tuple(layers)


def boundary_activation_bytes(layers: tuple[LayerSpec, ...]) -> NDArray[np.float64]:
    """Bytes crossing each layer boundary per micro-batch, both directions.

    Args:
        layers: L layer specs.

    Returns:
        f64[L - 1]: entry ``l`` is the forward activation layer ``l`` sends to
        layer ``l + 1`` plus the gradient sent back (the same size), i.e.
        ``2 * layers[l].output_bytes``; what a stage boundary after layer ``l``
        transfers per micro-batch.
    """
    output = np.array([layer.output_bytes for layer in layers], dtype=np.float64)
    return 2.0 * output[:-1]
