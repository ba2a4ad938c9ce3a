"""Reading the keys of a Hugging Face ``config.json``, one clear line per problem.

:class:`HfConfig` holds a parsed JSON object and the name of where it came from;
its getters check each value's type and range and raise
:class:`~pipedejavu.core.errors.ProblemError` naming the file and the key.
:func:`llama_like` reads the attention, MLP and embedding keys the LLaMA family
shares (LLaMA, Mistral, Qwen2, Qwen3 and the mixture-of-experts models built
on them: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, Llama 4, DeepSeek),
an explicit ``head_dim`` included.

Used by :mod:`pipedejavu.io.model_config` (dense models) and
:mod:`pipedejavu.io.hf_moe` (mixture-of-experts models).
"""

from __future__ import annotations

from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.transformer import SPEC_LIMITS

__all__ = ["HfConfig", "llama_like"]

#: Model types whose q, k and v projections carry biases and nothing else does.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HfConfig:
    """A parsed JSON object and the name of where it came from, for messages."""

    def __init__(self, data: Any, source: str):
        if not isinstance(data, dict):
            raise ProblemError(
                f"{source}: a model config must be a JSON object, "
                f"got {type(data).__name__}"
            )
        self.data = data
        self.source = source

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get_int(
        self,
        key: str,
        default: int | None = None,
        *,
        low: int = 1,
        limit: int | None = None,
    ) -> int:
        """``key`` as an integer in ``[low, limit]``; ``default`` when it is
        missing or null (``None``: the key is required)."""
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise ProblemError(f"{self.source}: missing key {key!r}")
            return default
        if not _is_int(value) or value < low or (limit is not None and value > limit):
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
                low, f"an integer >= {low}"
            )
            bound = "" if limit is None else f" at most {limit}"
            raise ProblemError(
                f"{self.source}: {key} must be {kind}{bound}, got {value!r}"
            )
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ProblemError(
                f"{self.source}: {key} must be true or false, got {value!r}"
            )
        return value

    def get_str(self, key: str, default: str | None = None) -> str:
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise ProblemError(f"{self.source}: missing key {key!r}")
            return default
        if not isinstance(value, str):
            raise ProblemError(f"{self.source}: {key} must be a string, got {value!r}")
        return value

    def get_indices(self, key: str, count: int) -> frozenset[int]:
        """``key`` as a list of distinct indices in ``[0, count)`` (missing or
        null: none)."""
        value = self.data.get(key)
        if value is None:
            return frozenset()
        if not isinstance(value, list):
            raise ProblemError(
                f"{self.source}: {key} must be a list of layer indices, got "
                f"{type(value).__name__}"
            )
        for item in value:
            if not _is_int(item) or not 0 <= item < count:
                raise ProblemError(
                    f"{self.source}: {key} must hold layer indices in [0, {count}), "
                    f"got {item!r}"
                )
        return frozenset(value)

    def nested(self, key: str) -> HfConfig:
        """The JSON object under ``key`` (e.g. Llama 4's ``text_config``)."""
        if not isinstance(self.data.get(key), dict):
            raise ProblemError(
                f"{self.source}: {key} must be a JSON object, got "
                f"{type(self.data.get(key)).__name__}"
            )
        return HfConfig(self.data[key], f"{self.source}: {key}")


def _biases(config: HfConfig, model_type: str) -> tuple[bool, bool]:
    """``(linear_bias, qkv_bias)`` of a LLaMA-like config."""
    if model_type in _QKV_BIAS_TYPES:  # Qwen2: bias on q, k, v only
        return False, config.get_bool("qkv_bias", True)
    attention_bias = config.get_bool("attention_bias", model_type == "gpt_oss")
    if model_type == "gpt_oss":  # its experts carry biases whatever it says
        if not attention_bias:
            raise ProblemError(
                f"{config.source}: attention_bias false is not supported for "
                "gpt_oss (its expert MLPs carry biases)"
            )
        return True, False
    mlp_bias = config.get_bool("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ProblemError(
            f"{config.source}: attention_bias {attention_bias} with mlp_bias "
            f"{mlp_bias} is not supported (both or neither)"
        )
    return attention_bias, False


def _kv_channels(config: HfConfig, heads: int, hidden: int) -> int | None:
    """An explicit ``head_dim`` as ``kv_channels`` (``None`` when it is
    ``hidden_size / num_attention_heads``, as the spec then says)."""
    if not config.has("head_dim"):
        return None
    width = config.get_int("head_dim", limit=SPEC_LIMITS["kv_channels"])
    return None if width * heads == hidden else width


def llama_like(
    config: HfConfig, model_type: str, *, head_dim: bool = True
) -> dict[str, Any]:
    """RMSNorm, rotary positions, SwiGLU, grouped-query attention: the
    :class:`~pipedejavu.core.transformer.TransformerSpec` fields (and
    ``positions``, the context) of a LLaMA-like config.

    Args:
        config: the config.
        model_type: its ``model_type`` (biases differ by family).
        head_dim: read an explicit ``head_dim`` as ``kv_channels`` where it
            is not ``hidden_size / num_attention_heads`` (Qwen3, GPT-OSS,
            Mistral-NeMo); ``False`` where other fields give the heads'
            widths (DeepSeek's multi-latent attention) and ``head_dim`` is not
            read.

    Raises:
        ProblemError: a missing or mistyped key, biases the spec cannot
            represent, an activation other than SiLU.
    """
    heads = config.get_int("num_attention_heads")
    hidden = config.get_int("hidden_size")
    kv_channels = _kv_channels(config, heads, hidden) if head_dim else None
    linear_bias, qkv_bias = _biases(config, model_type)
    hidden_act = config.get_str("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ProblemError(
            f"{config.source}: hidden_act {hidden_act!r} is not supported for "
            f"{model_type} (a SwiGLU MLP needs silu)"
        )
    return dict(
        num_layers=config.get_int("num_hidden_layers", limit=SPEC_LIMITS["num_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.get_int("num_key_value_heads", heads),
        ffn_hidden_size=config.get_int("intermediate_size"),
        vocab_size=config.get_int("vocab_size"),
        positions=config.get_int("max_position_embeddings"),
        gated_mlp=True,
        norm="rmsnorm",
        position="rotary",
        tied_embeddings=config.get_bool("tie_word_embeddings", False),
        linear_bias=linear_bias,
        qkv_bias=qkv_bias,
        kv_channels=kv_channels,
    )
