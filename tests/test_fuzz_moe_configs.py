"""The mixture-of-experts readers against the untrusted-input contract, fuzzed.

A Hugging Face ``config.json`` of any MoE family, or this package's own format
with ``moe`` and ``mla`` objects, with keys dropped, retyped, set to huge,
negative, fractional, nested or deeply nested values, or its bytes cut and
flipped, gives a :class:`~pipedejavu.core.transformer.TransformerSpec` or one
:class:`ProblemError` line; never another exception, and memory stays bounded
(layer counts are checked before an array of layers is built).
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

import pytest
from helpers import fixture_fuzz
from hypothesis import given
from hypothesis import strategies as st
from test_model_config_moe import (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GPT_OSS_120B,
    LLAMA4_MAVERICK_TEXT,
    LLAMA4_SCOUT,
    MIXTRAL_8X7B,
    OLMOE,
    QWEN2_MOE,
    QWEN3_30B,
)

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.model_config import (
    load_model_spec,
    spec_from_dict,
    spec_from_hf_config,
)

FUZZ = fixture_fuzz(150)
FAMILIES = [
    MIXTRAL_8X7B,
    QWEN2_MOE,
    QWEN3_30B,  # heads wider than hidden / heads: kv_channels
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GPT_OSS_120B,
    OLMOE,
    LLAMA4_SCOUT,
    LLAMA4_MAVERICK_TEXT,
]
#: Every key a reader looks at, and some it does not.
KEYS = sorted(
    {key for config in FAMILIES for key in config}
    | set(LLAMA4_SCOUT["text_config"])
    | {"mlp_only_layers", "moe_layers", "qkv_bias", "mlp_bias", "model_type"}
)
MODEL_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
MODEL_TYPES += ["gpt_oss", "olmoe", "llama4", "llama4_text", "llama", "qwen3", "t5"]

#: Hostile JSON values: huge, negative, fractional, wrong types, nesting.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 61, 2**31, 2**63, 10**18, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(MODEL_TYPES),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.sampled_from(KEYS), inner, max_size=6),
    ),
    max_leaves=20,
)


@st.composite
def mutated_configs(draw) -> dict:
    config = dict(draw(st.sampled_from(FAMILIES)))
    if "text_config" in config and draw(st.booleans()):
        config["text_config"] = dict(config["text_config"])
        target = config["text_config"]
    else:
        target = config
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4)):
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(values)
    return config


def _check(read, *args) -> None:
    try:
        spec = read(*args)
    except ProblemError as error:
        text = str(error)
        assert text and "\n" not in text, text
    else:
        assert isinstance(spec, TransformerSpec)


@FUZZ
@given(config=mutated_configs())
def test_mutated_hf_configs_give_a_spec_or_one_line(config):
    _check(spec_from_hf_config, config)


@FUZZ
@given(config=st.sampled_from(FAMILIES), data=st.data())
def test_corrupted_config_files_give_a_spec_or_one_line(tmp_path, config, data):
    text = json.dumps(config).encode()
    cut = data.draw(st.integers(0, len(text)))
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, len(text)), st.integers(0, 255)), max_size=3)
    )
    blob = bytearray(text[:cut] if data.draw(st.booleans()) else text)
    for where, byte in flips:
        if where < len(blob):
            blob[where] = byte
    path = tmp_path / "config.json"
    path.write_bytes(bytes(blob))
    for read in (spec_from_hf_config, load_model_spec):
        try:
            spec = read(path)
        except ProblemError as error:
            assert "\n" not in str(error) and str(path) in str(error)
        else:
            assert isinstance(spec, TransformerSpec)


OWN = {**dataclasses.asdict(load_model_spec("DeepSeek-V3")), "source": "fuzz"}
OWN_KEYS = sorted(OWN["moe"]) + sorted(OWN["mla"])


@FUZZ
@given(data=st.data())
def test_mutated_own_format_gives_a_spec_or_one_line(data):
    spec = json.loads(json.dumps(OWN))
    for _ in range(data.draw(st.integers(1, 4))):
        part = data.draw(st.sampled_from(["moe", "mla", "top"]))
        key = data.draw(st.sampled_from(OWN_KEYS + ["mtp_layers", "qk_layernorm"]))
        value = data.draw(values)
        if part == "top":
            spec[data.draw(st.sampled_from(["moe", "mla", key]))] = value
        elif isinstance(spec.get(part), dict):
            spec[part][key] = value
    _check(spec_from_dict, spec, "own.json")


HUGE = [10**9, 2**63, 10**400]


@pytest.mark.parametrize("count", HUGE)
@pytest.mark.parametrize(
    "key",
    [
        "num_hidden_layers",
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "decoder_sparse_step",
        "interleave_moe_layer_step",
        "n_shared_experts",
        "num_nextn_predict_layers",
    ],
)
def test_huge_counts_are_refused_in_bounded_memory(key, count):
    tracemalloc.start()
    try:
        for config in FAMILIES:
            target = config.get("text_config", config)
            changed = {**target, key: count}
            if target is not config:
                changed = {**config, "text_config": changed}
            _check(spec_from_hf_config, changed)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


def test_long_layer_lists_stay_bounded():
    # 10,000 blocks (the spec's limit) and a list naming each of them.
    config = {**QWEN2_MOE, "num_hidden_layers": 10_000}
    config["mlp_only_layers"] = list(range(0, 10_000, 2))
    spec = spec_from_hf_config(config)
    assert spec.moe.num_expert_blocks(10_000) == 5_000
    with pytest.raises(ProblemError, match="num_hidden_layers must be"):
        spec_from_hf_config({**config, "num_hidden_layers": 10_001})
