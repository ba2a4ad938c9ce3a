"""Hugging Face ``config.json`` of mixture-of-experts models, as far as their
shapes go.

:func:`moe_fields` reads Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 (with
multi-latent attention, shared experts, first dense layers and multi-token
prediction), GPT-OSS, OLMoE and Llama 4 (interleaved expert layers, the text
model of a ``llama4`` config) into the fields of a
:class:`~pipedejavu.core.transformer.TransformerSpec` with its
:class:`~pipedejavu.core.moe.MoeSpec` (and :class:`~pipedejavu.core.moe.MlaSpec`).

Which keys map to which field, and what is not modelled (routing details,
sliding windows, attention sinks, chunked attention, vision encoders), is
written out in ``docs/any-model.md``. Every problem is one
:class:`~pipedejavu.core.errors.ProblemError` line naming the file and the key;
every count is bounded before an array of layers is built.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import MOE_LIMITS, MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.io.hf_config import HfConfig, llama_like

__all__ = ["HF_MOE_MODEL_TYPES", "moe_fields"]


def _experts(config: HfConfig, key: str) -> int:
    return config.get_int(key, limit=MOE_LIMITS["num_experts"])


def _topk(config: HfConfig, *keys: str) -> int:
    """Experts per token: the first of ``keys`` given; all given must agree."""
    given = [key for key in keys if config.has(key)]
    if not given:
        raise ProblemError(f"{config.source}: missing key {keys[0]!r}")
    values = {key: config.get_int(key, limit=MOE_LIMITS["topk"]) for key in given}
    if len(set(values.values())) > 1:
        said = " and ".join(f"{key} {value}" for key, value in values.items())
        raise ProblemError(f"{config.source}: {said} contradict each other")
    return values[given[0]]


def _width(config: HfConfig, key: str, default: int | None = None) -> int:
    limit = MOE_LIMITS["ffn_hidden_size"]
    return config.get_int(key, default, low=0 if default == 0 else 1, limit=limit)


def _moe(config: HfConfig, layers: tuple[bool, ...], **fields: Any) -> MoeSpec:
    """The :class:`MoeSpec` (``layers`` all true: ``None``, every block)."""
    try:
        return MoeSpec(layers=None if all(layers) else layers, **fields)
    except ValueError as error:
        raise ProblemError(f"{config.source}: {error}") from None


def _sparse_every(
    config: HfConfig, num_layers: int, step_key: str, dense: Collection[int]
) -> tuple[bool, ...]:
    """Hugging Face's Qwen2-MoE and Llama 4 rule: block ``i`` (from 0) is an
    expert block when ``(i + 1) % step == 0`` and it is not in ``dense``."""
    step = config.get_int(step_key, 1, limit=num_layers)
    return tuple((i + 1) % step == 0 and i not in dense for i in range(num_layers))


def _mixtral(config: HfConfig) -> dict[str, Any]:
    fields = llama_like(config, "mixtral")
    layers = (True,) * fields["num_layers"]
    fields["moe"] = _moe(
        config,
        layers,
        num_experts=_experts(config, "num_local_experts"),
        topk=_topk(config, "num_experts_per_tok"),
        ffn_hidden_size=fields["ffn_hidden_size"],
    )
    return fields


def _qwen_moe(config: HfConfig, model_type: str) -> dict[str, Any]:
    """Qwen2-MoE (shared experts behind a sigmoid gate, q/k/v biases) and
    Qwen3-MoE (query/key norms, no shared expert)."""
    fields = llama_like(config, model_type)
    count = fields["num_layers"]
    dense = config.get_indices("mlp_only_layers", count)
    shared = 0
    if model_type == "qwen2_moe":
        shared = _width(config, "shared_expert_intermediate_size", 0)
    else:  # Qwen3's q_norm and k_norm: one head_dim-wide weight each
        fields["qk_layernorm"] = True
    fields["moe"] = _moe(
        config,
        _sparse_every(config, count, "decoder_sparse_step", dense),
        num_experts=_experts(config, "num_experts"),
        topk=_topk(config, "num_experts_per_tok"),
        ffn_hidden_size=_width(config, "moe_intermediate_size"),
        shared_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
    )
    return fields


def _deepseek(config: HfConfig, model_type: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-latent attention, shared experts, the first
    ``first_k_dense_replace`` blocks dense, then every ``moe_layer_freq``-th
    block an expert block; V3's multi-token-prediction modules."""
    fields = llama_like(config, model_type, head_dim=False)
    count = fields["num_layers"]
    fields["qk_layernorm"] = True  # q_a_layernorm, kv_a_layernorm: always there
    try:
        fields["mla"] = MlaSpec(
            q_lora_rank=config.get_int("q_lora_rank", 0, low=0),  # null: none
            kv_lora_rank=config.get_int("kv_lora_rank"),
            qk_head_dim=config.get_int("qk_nope_head_dim"),
            qk_pos_emb_head_dim=config.get_int("qk_rope_head_dim"),
            v_head_dim=config.get_int("v_head_dim"),
        )
    except ValueError as error:
        raise ProblemError(f"{config.source}: {error}") from None
    fields["mtp_layers"] = config.get_int(
        "num_nextn_predict_layers", 0, low=0, limit=64
    )
    if not config.has("n_routed_experts"):  # no expert layer at all
        return fields
    width = _width(config, "moe_intermediate_size")
    shared = config.get_int("n_shared_experts", 0, low=0, limit=MOE_LIMITS["topk"])
    if shared * width > MOE_LIMITS["shared_ffn_hidden_size"]:
        raise ProblemError(
            f"{config.source}: n_shared_experts {shared} x moe_intermediate_size "
            f"{width} must be at most {MOE_LIMITS['shared_ffn_hidden_size']}"
        )
    first_dense = config.get_int("first_k_dense_replace", 0, low=0, limit=count - 1)
    freq = config.get_int("moe_layer_freq", 1, limit=count)
    fields["moe"] = _moe(
        config,
        moe_layer_pattern(count, freq=freq, first_dense=first_dense),
        num_experts=_experts(config, "n_routed_experts"),
        topk=_topk(config, "num_experts_per_tok"),
        ffn_hidden_size=width,
        shared_ffn_hidden_size=shared * width,
    )
    return fields


def _gpt_oss(config: HfConfig) -> dict[str, Any]:
    """GPT-OSS: every block an expert block, biases everywhere."""
    fields = llama_like(config, "gpt_oss")
    fields["moe"] = _moe(
        config,
        (True,) * fields["num_layers"],
        num_experts=_experts(config, "num_local_experts"),
        topk=_topk(config, "experts_per_token", "num_experts_per_tok"),
        ffn_hidden_size=fields["ffn_hidden_size"],
    )
    return fields


def _olmoe(config: HfConfig) -> dict[str, Any]:
    """OLMoE: every block an expert block, query and key norms over the
    whole projections (``q_norm`` h wide, ``k_norm`` g d)."""
    fields = llama_like(config, "olmoe")
    fields["qk_layernorm"] = "projection"
    fields["moe"] = _moe(
        config,
        (True,) * fields["num_layers"],
        num_experts=_experts(config, "num_experts"),
        topk=_topk(config, "num_experts_per_tok"),
        ffn_hidden_size=fields["ffn_hidden_size"],
    )
    return fields


def _llama4(config: HfConfig) -> dict[str, Any]:
    """Llama 4's text model: dense blocks of ``intermediate_size_mlp``, expert
    blocks (every ``interleave_moe_layer_step``-th, or those ``moe_layers``
    names) of ``intermediate_size`` with one shared expert as wide."""
    fields = llama_like(config, "llama4_text")
    count = fields["num_layers"]
    expert_width = _width(config, "intermediate_size")
    fields["ffn_hidden_size"] = _width(config, "intermediate_size_mlp")
    if config.has("moe_layers"):
        chosen = config.get_indices("moe_layers", count)
        layers = tuple(i in chosen for i in range(count))
    else:
        layers = _sparse_every(config, count, "interleave_moe_layer_step", ())
    fields["moe"] = _moe(
        config,
        layers,
        num_experts=_experts(config, "num_local_experts"),
        topk=_topk(config, "num_experts_per_tok"),
        ffn_hidden_size=expert_width,
        shared_ffn_hidden_size=expert_width,
    )
    return fields


_READERS: dict[str, Callable[[HfConfig], dict[str, Any]]] = {
    "mixtral": _mixtral,
    "qwen2_moe": lambda config: _qwen_moe(config, "qwen2_moe"),
    "qwen3_moe": lambda config: _qwen_moe(config, "qwen3_moe"),
    "deepseek_v2": lambda config: _deepseek(config, "deepseek_v2"),
    "deepseek_v3": lambda config: _deepseek(config, "deepseek_v3"),
    "gpt_oss": _gpt_oss,
    "olmoe": _olmoe,
    "llama4": lambda config: _llama4(config.nested("text_config")),
    "llama4_text": _llama4,
}
#: ``model_type`` values :func:`moe_fields` reads.
HF_MOE_MODEL_TYPES = tuple(_READERS)


def moe_fields(config: HfConfig, model_type: str) -> dict[str, Any]:
    """The :class:`~pipedejavu.core.transformer.TransformerSpec` fields of a
    mixture-of-experts config (``moe`` and, for DeepSeek, ``mla`` set), plus
    ``positions`` (the model's context, ``max_position_embeddings``).

    Args:
        config: the config (a ``llama4`` config: the top level, whose
            ``text_config`` is read).
        model_type: one of :data:`HF_MOE_MODEL_TYPES`.

    Raises:
        ProblemError: a missing, mistyped or out-of-range key (named), shapes
            the spec cannot represent, or contradicting keys.
    """
    return _READERS[model_type](config)
