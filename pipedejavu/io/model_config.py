"""Model descriptions: Hugging Face ``config.json`` files and bundled presets.

:func:`spec_from_hf_config` reads the ``config.json`` of a decoder-only model
into a :class:`~pipedejavu.core.transformer.TransformerSpec`: dense models
(GPT-2, GPT-Neo, GPT-NeoX, OPT, LLaMA, Mistral, Qwen2, Qwen3) here,
mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3,
GPT-OSS, OLMoE, Llama 4) by :mod:`pipedejavu.io.hf_moe`. Expert keys in a
dense model's config are refused.

:func:`load_model_spec` resolves a bundled preset name (``pipedejavu/data/models``,
each file with its ``source``) or a file path, either a Hugging Face config or
this package's own format: the :class:`TransformerSpec` fields as JSON keys
(``moe`` and ``mla`` as nested objects of their fields) plus ``source`` and an
optional ``note``. Megatron-LM command lines are read by
:mod:`pipedejavu.io.megatron_args`.

Every file is read with a size limit; every problem is one
:class:`ProblemError` line naming the file (and the key).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json
from pipedejavu.core.moe import MlaSpec, MoeSpec
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.hf_config import HfConfig, llama_like
from pipedejavu.io.hf_moe import HF_MOE_MODEL_TYPES, moe_fields

__all__ = [
    "HF_MODEL_TYPES",
    "MAX_MODEL_FILE_BYTES",
    "MODEL_FIFO_WAIT_S",
    "bundled_models_dir",
    "list_model_presets",
    "load_model_spec",
    "spec_from_dict",
    "spec_from_hf_config",
]

#: A model description is a few kilobytes; refuse anything past 1 MiB.
MAX_MODEL_FILE_BYTES = 2**20
#: A model file that is a FIFO (``--model <(cat config.json)``) must start
#: within this many seconds: ``--model`` names a preset or a file, and a named
#: pipe nothing writes to would otherwise wait forever.
MODEL_FIFO_WAIT_S = 15.0
#: ``model_type`` values of dense models :func:`spec_from_hf_config` reads.
_DENSE_MODEL_TYPES = (
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "opt",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
)
#: Dense ``model_type`` values read as LLaMA-like (``head_dim`` included).
_LLAMA_LIKE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: ``model_type`` values :func:`spec_from_hf_config` reads.
HF_MODEL_TYPES = _DENSE_MODEL_TYPES + HF_MOE_MODEL_TYPES
#: A GPT-like ``model_type``'s keys of its hidden size, layers, attention
#: heads, MLP width and context (:func:`_gpt_like`).
_GPT_KEYS = {
    "gpt2": ("n_embd", "n_layer", "n_head", "n_inner", "n_positions"),
    "gpt_neo": (
        "hidden_size",
        "num_layers",
        "num_heads",
        "intermediate_size",
        "max_position_embeddings",
    ),
    "gpt_neox": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
    ),
    "opt": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "ffn_dim",
        "max_position_embeddings",
    ),
}
#: A GPT-like ``model_type``'s key turning its biases off (others: always on).
_GPT_BIAS_KEYS = {"gpt_neox": "attention_bias", "opt": "enable_bias"}
#: Keys that mark a mixture-of-experts configuration (refused in a dense one).
_MOE_KEYS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_layer_freq",
)
#: Keys only a Hugging Face ``config.json`` has (the own format has none).
_HF_ONLY_KEYS = (
    "architectures",
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "num_hidden_layers",
    "n_layer",
    "n_embd",
)
#: Keys of the own format beside the TransformerSpec fields.
_OWN_EXTRA_KEYS = ("source", "note", "format")
_SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(TransformerSpec))
#: The own format's nested objects.
_NESTED: dict[str, type[MoeSpec] | type[MlaSpec]] = {"moe": MoeSpec, "mla": MlaSpec}


def _refuse_moe(config: HfConfig) -> None:
    for key in config.data:
        value = config.data[key]
        if value in (None, 0, False):
            continue
        if key in _MOE_KEYS or key.startswith("moe_"):
            raise ProblemError(
                f"{config.source}: {key} = {value!r} makes a mixture of experts, "
                f"but model_type {config.data.get('model_type')!r} is a dense "
                f"transformer (mixture-of-experts types: "
                f"{', '.join(HF_MOE_MODEL_TYPES)})"
            )


def _seq_length(seq_length: int | None, default: int) -> int:
    if seq_length is None:
        return default
    if (
        isinstance(seq_length, bool)
        or not isinstance(seq_length, int)
        or seq_length <= 0
    ):
        raise ProblemError(f"seq_length must be a positive integer, got {seq_length!r}")
    return seq_length


def _gpt_like(config: HfConfig, model_type: str) -> dict[str, Any]:
    """GPT-2, GPT-Neo, GPT-NeoX, OPT: LayerNorm, biases, a two-matrix MLP."""
    hidden_key, layers, heads, ffn, positions = _GPT_KEYS[model_type]
    hidden = config.get_int(hidden_key)
    if model_type == "opt":
        projection = config.get_int("word_embed_proj_dim", hidden)
        if projection != hidden:
            raise ProblemError(
                f"{config.source}: word_embed_proj_dim {projection} != hidden_size "
                f"{hidden} (OPT's embedding projections) is not supported"
            )
    # GPT-2's and GPT-Neo's MLP width may be left out (4 x hidden)
    ffn_default = 4 * hidden if model_type in ("gpt2", "gpt_neo") else None
    neox = model_type == "gpt_neox"  # rotary positions, an untied head by default
    bias = _GPT_BIAS_KEYS.get(model_type)
    fields = dict(
        num_layers=config.get_int(layers),
        num_attention_heads=config.get_int(heads),
        ffn_hidden_size=config.get_int(ffn, ffn_default),
        positions=config.get_int(positions),
        tied_embeddings=config.get_bool("tie_word_embeddings", not neox),
        position="rotary" if neox else "learned",
        linear_bias=True if bias is None else config.get_bool(bias, True),
    )
    fields.update(hidden_size=hidden, vocab_size=config.get_int("vocab_size"))
    fields["num_query_groups"] = fields["num_attention_heads"]
    return fields


def _spec_from_hf(
    config: HfConfig, name: str | None, seq_length: int | None
) -> TransformerSpec:
    model_type = config.get_str("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ProblemError(
            f"{config.source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(HF_MODEL_TYPES)})"
        )
    if model_type in HF_MOE_MODEL_TYPES:
        fields = moe_fields(config, model_type)
    else:
        _refuse_moe(config)
        if model_type in _LLAMA_LIKE_TYPES:
            fields = llama_like(config, model_type)
            # Qwen3's q_norm and k_norm: one head_dim-wide weight each
            fields["qk_layernorm"] = model_type == "qwen3"
        else:
            fields = _gpt_like(config, model_type)
    positions = fields.pop("positions")
    fields["seq_length"] = _seq_length(seq_length, positions)
    if fields["position"] == "learned":
        fields["max_position_embeddings"] = positions
    if name is None:
        name = config.data.get("_name_or_path") or model_type
        name = name if isinstance(name, str) else model_type
    try:
        return TransformerSpec(name=name, **fields)
    except ValueError as error:
        raise ProblemError(f"{config.source}: {error}") from None


def _read(path: str | os.PathLike, what: str) -> Any:
    return read_json(path, MAX_MODEL_FILE_BYTES, what, fifo_wait_s=MODEL_FIFO_WAIT_S)


def spec_from_hf_config(
    path_or_dict: str | os.PathLike | Mapping[str, Any],
    *,
    name: str | None = None,
    seq_length: int | None = None,
) -> TransformerSpec:
    """A Hugging Face ``config.json`` as a :class:`TransformerSpec`.

    Args:
        path_or_dict: the file, or its parsed contents.
        name: the spec's name (default: ``_name_or_path``, else the model type).
        seq_length: training tokens per sample (default: the model's
            ``max_position_embeddings`` / ``n_positions``, its longest context).

    Returns:
        The spec (``moe``, ``mla``, ``mtp_layers`` set for a mixture of
        experts; see :mod:`pipedejavu.io.hf_moe`). The vocabulary is the
        config's ``vocab_size`` (checkpoints already store it padded), with
        ``vocab_divisible_by`` 1.

    Raises:
        ProblemError: unreadable or oversized file, a missing or mistyped key
            (named), an unsupported ``model_type``, expert keys in a dense
            model's config, or shapes the spec cannot represent (named).
    """
    if isinstance(path_or_dict, Mapping):
        config = HfConfig(dict(path_or_dict), "model config")
    else:
        source = os.fspath(path_or_dict)
        config = HfConfig(_read(source, "model config"), source)
    return _spec_from_hf(config, name, seq_length)


def _nested_from_dict(
    value: Any, key: str, kind: type[MoeSpec] | type[MlaSpec], source: str
) -> MoeSpec | MlaSpec | None:
    """The own format's ``moe`` or ``mla`` object (``null``: none)."""
    if value is None:
        return None
    names = [field.name for field in dataclasses.fields(kind)]
    if not isinstance(value, Mapping):
        raise ProblemError(
            f"{source}: {key} must be a JSON object with keys {', '.join(names)} "
            f"(or null), got {type(value).__name__}"
        )
    unknown = [name for name in value if name not in names]
    if unknown:
        raise ProblemError(
            f"{source}: unknown key {key}.{unknown[0]!r} (known: {', '.join(names)})"
        )
    missing = [
        field.name
        for field in dataclasses.fields(kind)
        if field.default is dataclasses.MISSING and field.name not in value
    ]
    if missing:
        raise ProblemError(f"{source}: missing key {key}.{missing[0]!r}")
    fields = dict(value)
    if isinstance(fields.get("layers"), list):  # JSON has no tuples
        fields["layers"] = tuple(fields["layers"])
    try:
        return kind(**fields)
    except ValueError as error:
        raise ProblemError(f"{source}: {error}") from None


def spec_from_dict(
    data: Mapping[str, Any], source: str = "model spec"
) -> TransformerSpec:
    """This package's own format: the :class:`TransformerSpec` fields by name,
    plus ``source`` (where the shape comes from) and an optional ``note``;
    ``moe`` and ``mla`` are objects of the :class:`~pipedejavu.core.moe.MoeSpec`
    and :class:`~pipedejavu.core.moe.MlaSpec` fields (``layers``: a list of
    true/false, one per block, or null for every block), or null.

    Raises:
        ProblemError: an unknown or missing key, or an invalid value.
    """
    if not isinstance(data, Mapping):
        raise ProblemError(
            f"{source}: a model spec must be a JSON object, got {type(data).__name__}"
        )
    unknown = sorted(set(data) - set(_SPEC_FIELDS) - set(_OWN_EXTRA_KEYS))
    if unknown:
        raise ProblemError(
            f"{source}: unknown key {unknown[0]!r} (known: {', '.join(_SPEC_FIELDS)})"
        )
    fields = {key: data[key] for key in _SPEC_FIELDS if key in data}
    for key, kind in _NESTED.items():
        fields[key] = _nested_from_dict(fields.get(key), key, kind, source)
    try:
        return TransformerSpec(**fields)
    except TypeError:
        missing = [
            field.name
            for field in dataclasses.fields(TransformerSpec)
            if field.default is dataclasses.MISSING and field.name not in data
        ]
        raise ProblemError(f"{source}: missing key {missing[0]!r}") from None
    except ValueError as error:
        raise ProblemError(f"{source}: {error}") from None


def bundled_models_dir() -> Path:
    """The bundled presets: one JSON file per model."""
    return Path(str(importlib.resources.files("pipedejavu") / "data" / "models"))


@functools.cache
def _presets() -> dict[str, tuple[Path, dict[str, Any]]]:
    presets: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(bundled_models_dir().glob("*.json")):
        data = _read(path, "model preset")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ProblemError(f"{path}: a model preset must have a string 'name'")
        presets[data["name"]] = (path, data)
    return presets


def list_model_presets() -> dict[str, str]:
    """The bundled presets: ``{name: source}``, in name order."""
    return {name: str(data.get("source", "")) for name, (_, data) in _presets().items()}


def _spec_from_data(data: Any, source: str, seq_length: int | None) -> TransformerSpec:
    if isinstance(data, dict) and "model_type" in data:
        return _spec_from_hf(HfConfig(data, source), None, seq_length)
    hf_keys = [key for key in _HF_ONLY_KEYS if isinstance(data, dict) and key in data]
    if hf_keys:  # not the own format with a stray key: say what is missing
        raise ProblemError(
            f"{source}: a Hugging Face config.json (it has {hf_keys[0]!r}) needs "
            f"'model_type', which says how to read its keys: one of "
            f"{', '.join(HF_MODEL_TYPES)}"
        )
    spec = spec_from_dict(data, source)
    if _seq_length(seq_length, spec.seq_length) != spec.seq_length:
        try:
            spec = dataclasses.replace(spec, seq_length=seq_length)
        except ValueError as error:
            raise ProblemError(f"{source}: {error}") from None
    return spec


def load_model_spec(
    name_or_path: str | os.PathLike,
    *,
    seq_length: int | None = None,
    longest_context: int | None = None,
) -> TransformerSpec:
    """A bundled preset by name (case-insensitive), or a model file.

    Args:
        name_or_path: a preset name (see :func:`list_model_presets`), or a JSON
            file: a Hugging Face ``config.json`` (it has ``model_type``) or this
            package's own format (see :func:`spec_from_dict`).
        seq_length: override the tokens per sample.
        longest_context: a Hugging Face ``config.json`` gives the model's
            context, not its training length: without ``seq_length``, a
            context of more tokens than this is refused (``None``: planned at
            its context).

    Raises:
        ProblemError: neither a preset nor a readable file, or an invalid one;
            a config whose context exceeds ``longest_context`` and no
            ``seq_length``.
    """
    key = os.fspath(name_or_path)
    by_lower = {name.lower(): name for name in _presets()}
    if key.lower() in by_lower:
        path, data = _presets()[by_lower[key.lower()]]
        return _spec_from_data(data, os.fspath(path), seq_length)
    if not os.path.exists(key):
        raise ProblemError(
            f"unknown model {key!r}: not a preset ({', '.join(_presets())}) and "
            f"no such file"
        )
    data = _read(key, "model file")
    spec = _spec_from_data(data, key, seq_length)
    context = spec.seq_length  # a config's, given no seq_length
    hf = isinstance(data, dict) and "model_type" in data
    if hf and seq_length is None and longest_context is not None:
        if context > longest_context:
            raise ProblemError(
                f"{key} takes up to {context:,} tokens of context, which says "
                "nothing of the length it trains at (planned at that length, an "
                "iteration costs many times a pretraining one): give the training "
                f"length (--seq-len, seq_length), e.g. 4096 or 8192, at most {context}"
            )
    return spec
