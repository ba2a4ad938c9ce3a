"""Small flax classifiers and their base initialization distributions.

The presets are ReLU multilayer perceptrons on the 64 digit pixels. Every
kernel is drawn from a standard scheme, He (Kaiming) normal,
``N(0, 2 / fan_in)`` (untruncated, as He et al. and PyTorch's
``kaiming_normal_``), or Glorot (Xavier) uniform, ``U(+-sqrt(6 / (fan_in +
fan_out)))``; biases start at zero. These are the base distributions the
search samples from and resamples around.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MODEL_NAMES", "ModelConfig", "init_params", "model_config", "apply_model"]

INIT_SCHEMES = ("he", "glorot")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A ReLU MLP classifier (hashable: a static argument of the jitted steps).

    Attributes:
        hidden: widths of the hidden layers.
        num_inputs: input features (64 pixels).
        num_classes: output logits (10 digits).
        init: base distribution of the kernels, ``"he"`` or ``"glorot"``.
    """

    hidden: tuple[int, ...] = (64, 64)
    num_inputs: int = 64
    num_classes: int = 10
    init: str = "he"

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, tuple) or not all(
            isinstance(w, int) and w >= 1 for w in self.hidden
        ):
            raise ValueError(
                f"hidden must be a tuple of positive integers, got {self.hidden!r}"
            )
        for name in ("num_inputs", "num_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.init not in INIT_SCHEMES:
            raise ValueError(
                f"init must be one of {', '.join(INIT_SCHEMES)}, got {self.init!r}"
            )


PRESETS = {
    # One narrow hidden layer: the tests' model.
    "mlp-small": (16,),
    "mlp": (64, 64),
    # Deep and narrow, where the starting point is said to matter most.
    "mlp-deep": (32,) * 6,
}
#: Names accepted by :func:`model_config`.
MODEL_NAMES: tuple[str, ...] = tuple(PRESETS)


def model_config(name: str, init: str = "he") -> ModelConfig:
    """The preset called ``name`` (one of :data:`MODEL_NAMES`)."""
    if name not in PRESETS:
        raise ValueError(f"model must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    return ModelConfig(hidden=PRESETS[name], init=init)


class _MLP(nn.Module):
    hidden: tuple[int, ...]
    num_classes: int
    kernel_init: Callable[..., Any]

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        x = inputs
        for width in self.hidden:
            x = nn.relu(nn.Dense(width, kernel_init=self.kernel_init)(x))
        return nn.Dense(self.num_classes, kernel_init=self.kernel_init)(x)


def _he_normal(key: jax.Array, shape: tuple[int, int], dtype=jnp.float32):
    # Drawn flat and reshaped: XLA:CPU compiles a vmapped 2-D draw several
    # times slower, for the same numbers' distribution.
    fan_in = shape[0]
    draw = jax.random.normal(key, (math.prod(shape),), dtype)
    return draw.reshape(shape) * jnp.sqrt(2.0 / fan_in).astype(dtype)


def _glorot_uniform(key: jax.Array, shape: tuple[int, int], dtype=jnp.float32):
    limit = math.sqrt(6.0 / (shape[0] + shape[1]))
    draw = jax.random.uniform(key, (math.prod(shape),), dtype, -limit, limit)
    return draw.reshape(shape)


def _module(config: ModelConfig) -> _MLP:
    kernel_init = _he_normal if config.init == "he" else _glorot_uniform
    return _MLP(config.hidden, config.num_classes, kernel_init)


def init_params(config: ModelConfig, key: jax.Array) -> Any:
    """One draw of the parameters from the base distribution.

    Args:
        config: the model.
        key: a ``jax.random`` key; the same key gives the same parameters.

    Returns:
        The flax parameter pytree (kernels f32[fan_in, fan_out], biases zero).
    """
    dummy = jnp.zeros((1, config.num_inputs), jnp.float32)
    return _module(config).init(key, dummy)["params"]


def apply_model(config: ModelConfig, params: Any, inputs: jax.Array) -> jax.Array:
    """Logits f32[n, num_classes] of inputs f32[n, num_inputs]."""
    return _module(config).apply({"params": params}, inputs)
