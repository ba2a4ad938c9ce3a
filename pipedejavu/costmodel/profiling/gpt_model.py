"""A small flax GPT cut into Alpa's pipeline layers, and its jitted stage steps.

The model (:class:`GPTConfig`, presets in :data:`MODEL_NAMES`) has ``L =
num_blocks + 2`` pipeline layers: the embedding (token + position), each
transformer block (pre-LayerNorm causal self-attention and a GELU MLP, both
residual), and the head (final LayerNorm, LM projection and the mean
cross-entropy loss). :func:`span_step` builds the jitted forward + backward
(``jax.vjp``) of a contiguous span of layers, the function
:mod:`pipedejavu.costmodel.profiling.profiler` times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

__all__ = ["MODEL_NAMES", "GPTConfig", "gpt_config", "gpt_modules"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT cut into ``num_blocks + 2`` pipeline layers; float32 throughout.

    Args:
        vocab_size: V tokens. hidden_size: h, a multiple of ``num_heads``.
        num_heads: attention heads. num_blocks: transformer blocks.
        seq_len: s tokens per sequence. batch_size: b sequences per micro-batch.
        mlp_ratio: MLP width / h.
    """

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_blocks: int
    seq_len: int
    batch_size: int
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size must be a multiple of num_heads={self.num_heads}, "
                f"got {self.hidden_size}"
            )

    @property
    def num_layers(self) -> int:
        """L pipeline layers: embedding, blocks, head."""
        return self.num_blocks + 2


PRESETS = {
    # 2 blocks: profiles in a few seconds (tests, CLI smoke runs).
    "gpt-micro": GPTConfig(256, 64, 2, 2, 32, 4),
    "gpt-tiny": GPTConfig(512, 128, 4, 4, 64, 8),
    "gpt-small": GPTConfig(1024, 192, 6, 6, 128, 4),
}
#: Names accepted by :func:`gpt_config` and
#: :func:`pipedejavu.costmodel.profiling.profiler.profile_model`.
MODEL_NAMES: tuple[str, ...] = tuple(PRESETS)


def gpt_config(name: str) -> GPTConfig:
    """The preset called ``name`` (one of :data:`MODEL_NAMES`)."""
    if name not in PRESETS:
        raise ValueError(f"model must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    return PRESETS[name]


class Embedding(nn.Module):
    """i32[b, s] token ids -> f32[b, s, h] token + learned position embeddings."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        table = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="tokens")
        init = nn.initializers.normal(0.02)
        positions = self.param("positions", init, (cfg.seq_len, cfg.hidden_size))
        return table(tokens) + positions[: tokens.shape[1]]


class Block(nn.Module):
    """f32[b, s, h] -> f32[b, s, h]: pre-LN causal self-attention and MLP."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        attention = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads)
        x = x + attention(nn.LayerNorm()(x), mask=mask)
        hidden = nn.gelu(nn.Dense(cfg.mlp_ratio * cfg.hidden_size)(nn.LayerNorm()(x)))
        return x + nn.Dense(cfg.hidden_size)(hidden)


class Head(nn.Module):
    """f32[b, s, h], i32[b, s] targets -> f32[] mean next-token cross-entropy."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        logits = nn.Dense(self.config.vocab_size)(nn.LayerNorm()(x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def gpt_modules(config: GPTConfig) -> tuple[nn.Module, ...]:
    """The L pipeline layers of ``config``: embedding, blocks, head."""
    blocks = tuple(Block(config) for _ in range(config.num_blocks))
    return (Embedding(config), *blocks, Head(config))


def layer_names(config: GPTConfig) -> tuple[str, ...]:
    return ("embedding", *(f"block{i}" for i in range(config.num_blocks)), "head")


def span_step(config: GPTConfig, start: int, stop: int) -> Callable:
    """The jitted forward + backward of layers ``start..stop-1`` (half-open).

    ``step(params, x, targets, cotangent) -> (output, gradients)``: ``params`` a
    tuple of the span's layer parameters, ``x`` the span's input (token ids when
    ``start == 0``), ``cotangent`` the gradient of the span's output (1.0 when it
    ends with the head). ``gradients`` holds the parameter gradients and, unless
    ``start == 0``, the input gradient. Blocks are identical, so spans with the
    same layer kinds share one compiled function.
    """
    last = config.num_layers - 1
    kinds = tuple(0 if i == 0 else 2 if i == last else 1 for i in range(start, stop))
    return kinds_step(config, kinds)


@lru_cache(maxsize=128)
def kinds_step(config: GPTConfig, kinds: tuple[int, ...]) -> Callable:
    layers = [(Embedding, Block, Head)[kind](config) for kind in kinds]

    def forward(params, x, targets):
        for kind, layer, layer_params in zip(kinds, layers, params, strict=True):
            x = layer.apply(layer_params, x, *((targets,) if kind == 2 else ()))
        return x

    def step(params, x, targets, cotangent):
        if kinds[0] == 0:  # integer token ids have no gradient
            output, pullback = jax.vjp(lambda p: forward(p, x, targets), params)
        else:
            output, pullback = jax.vjp(lambda p, h: forward(p, h, targets), params, x)
        return output, pullback(cotangent)

    return jax.jit(step)
