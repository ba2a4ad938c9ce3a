"""torchtitan's model flavors as :class:`~pipedejavu.core.transformer.TransformerSpec`.

A torchtitan job names its model by ``[model] name`` and ``flavor``; the shape
lives in torchtitan's own code, a dictionary of model arguments per flavor.
:func:`torchtitan_model` builds the spec of a flavor from those arguments,
written out here as numbers (read from torchtitan, never imported), with the
width rules of torchtitan's modules:

* **llama3** (and ``llama3_ft``, the same arguments): ``models/llama3/__init__.py``
  ``llama3_args`` and ``model/model.py`` ``FeedForward`` at v0.2.2 (commit
  73a0e697); ``models/llama/__init__.py`` ``llama3_configs`` and
  ``models/llama/model.py`` at the 2024-12 commit 9dec370a. SwiGLU with the
  width ``multiple_of x ceil(int(m x int(2 x 4 dim / 3)) / multiple_of)``
  (:func:`llama_ffn_width`; ``m`` is ``ffn_dim_multiplier``, skipped when
  unset), RMSNorm, rotary positions, grouped-query attention (``n_kv_heads``;
  unset: one per head), no biases, untied embeddings. 8B: 32 blocks of 4096,
  32 heads, 8 key/value heads, MLP 14,336; 70B: 80 of 8192, 64 and 8, 28,672;
  405B: 126 of 16,384, 128 and 8, 53,248. The vocabulary: v0.2 sets it in the
  model arguments (128,256 for 8B/70B/405B, 2,048 for the debug flavors);
  at 9dec370 ``train.py`` sets it from the tokenizer file
  (``model_config.vocab_size = tokenizer.n_words``), read here as Llama 3's
  tokenizer, 128,000 BPE tokens and 256 reserved special tokens: 128,256 for
  every flavor (the debug flavor's test tokenizer has 2,256: pass
  ``vocab_size``).
* **qwen3** (v0.2 only): ``models/qwen3/__init__.py`` ``qwen3_args`` and
  ``model/model.py``: each flavor's ``hidden_dim``, heads of ``head_dim``
  128 (``kv_channels`` where that is not ``dim / n_heads``), per-head query
  and key RMSNorms (``qk_layernorm``), ``enable_weight_tying`` for the small
  flavors; the MoE flavors route every block's tokens to ``top_k`` of
  ``num_experts`` experts of width ``moe_inter_dim``, no shared expert.
* **deepseek_v3** (v0.2 only): ``models/deepseek_v3/__init__.py`` and
  ``model/model.py``: multi-latent attention (``q_lora_rank`` 0: queries
  projected directly; the latent norms: ``qk_layernorm``), the first
  ``n_dense_layers`` blocks dense of width ``inter_dim``, the others experts of
  width ``moe_inter_dim`` beside ``num_shared_experts`` shared ones (one
  shared MLP ``num_shared_experts`` times as wide). torchtitan's DeepSeek-V3
  has no multi-token-prediction module. Routing groups are not modelled.
* **llama4** (v0.2 only): ``models/llama4/__init__.py``, ``model/args.py`` and
  ``model/model.py``: block ``i`` is an expert block when ``(i + 1)`` is a
  multiple of ``interleave_moe_layer_step`` (2 unless the flavor says 1);
  dense blocks have llama3's MLP rule on ``4 dim``; an expert's width is
  ``int(m x int(2 x 4 dim / 3)) / (top_k + num_shared_experts)`` rounded up to
  ``multiple_of`` (``auto_scale_hidden_dim``), with ``MoEArgs``' defaults of
  one routed expert per token and one shared expert of that width; no query
  or key norms, untied embeddings, vocabulary 202,048.

What a spec does not carry is said in :attr:`TorchtitanModel.notes`:
FlexAttention or varlen attention with block-causal masks (the ``_flex``,
``_varlen`` and DeepSeek 16B/236B/671B flavors), Llama 4's iRoPE (no positions
every fourth block, chunked attention in the others). ``gpt_oss`` (attention
sinks, sliding windows, biased experts) and ``flux`` (a diffusion model) are
refused, as is any flavor not listed here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.core.transformer import DECODER_DESIGN, TransformerSpec

__all__ = [
    "LLAMA3_TOKENIZER_VOCAB",
    "MODEL_FLAVORS",
    "TorchtitanModel",
    "llama_ffn_width",
    "torchtitan_model",
]

#: Llama 3's tiktoken vocabulary: 128,000 BPE tokens and 256 reserved special
#: tokens (torchtitan's ``TikTokenizer.n_words`` at 9dec370).
LLAMA3_TOKENIZER_VOCAB = 128_256


@dataclasses.dataclass(frozen=True)
class _Llama:
    """llama3/llama4 arguments: ``dim, n_layers, n_heads, n_kv_heads
    (None: n_heads), multiple_of, ffn_dim_multiplier, vocab (None: the
    tokenizer's)``, the attention kernel, and for llama4 the experts."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    multiple_of: int
    multiplier: float | None
    vocab: int | None
    attention: str = "sdpa"
    num_experts: int = 0  # llama4: routed experts (top 1, 1 shared)
    moe_step: int = 2  # llama4: interleave_moe_layer_step
    irope: bool = False


_DEBUG = _Llama(256, 6, 16, None, 256, None, 2048)
_L8B = _Llama(4096, 32, 32, 8, 1024, 1.3, 128_256)
_LLAMA3 = {
    "debugmodel": _DEBUG,
    "debugmodel_flex_attn": dataclasses.replace(_DEBUG, attention="flex"),
    "debugmodel_varlen_attn": dataclasses.replace(_DEBUG, attention="varlen"),
    "8B": _L8B,
    "8B_flex": dataclasses.replace(_L8B, attention="flex"),
    "8B_varlen": dataclasses.replace(_L8B, attention="varlen"),
    "70B": _Llama(8192, 80, 64, 8, 4096, 1.3, 128_256),
    "405B": _Llama(16384, 126, 128, 8, 4096, 1.2, 128_256),
}
_LLAMA3_2024_12 = {
    "debugmodel": _Llama(256, 8, 16, None, 256, None, None),
    **{
        flavor: dataclasses.replace(_LLAMA3[flavor], vocab=None)
        for flavor in ("8B", "70B", "405B")
    },
}
_L4_DEBUG = _Llama(256, 6, 16, None, 256, None, 2048, num_experts=8)
_L4 = _Llama(5120, 48, 40, 8, 2048, 1.2, 202_048, num_experts=16, moe_step=1)
_L4_128 = dataclasses.replace(_L4, num_experts=128, moe_step=2)
_FLEX_IROPE = {"attention": "flex", "irope": True}
_LLAMA4 = {
    "debugmodel": _L4_DEBUG,
    "17bx16e": _L4,
    "17bx128e": _L4_128,
    "debugmodel_irope": dataclasses.replace(_L4_DEBUG, **_FLEX_IROPE),
    "17bx16e_irope": dataclasses.replace(_L4, **_FLEX_IROPE),
    "17bx128e_irope": dataclasses.replace(_L4_128, **_FLEX_IROPE),
}

# qwen3: (dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab, tied,
# MoE (num_experts, top_k, moe_inter_dim) or None); head_dim 128 throughout.
_QWEN3: dict[str, tuple[Any, ...]] = {
    "debugmodel": (256, 8, 16, 8, 3072, 2048, True, None),
    "0.6B": (1024, 28, 16, 8, 3072, 151_936, True, None),
    "1.7B": (2048, 28, 16, 8, 6144, 151_936, True, None),
    "4B": (2560, 36, 32, 8, 9728, 151_936, True, None),
    "8B": (4096, 36, 32, 8, 12288, 151_936, False, None),
    "14B": (5120, 40, 40, 8, 17408, 151_936, False, None),
    "32B": (5120, 64, 64, 8, 25600, 151_936, False, None),
    "debugmodel_moe": (256, 8, 16, 8, 3072, 2048, False, (64, 8, 768)),
    "30B-A3B": (2048, 48, 32, 4, 6144, 151_936, False, (128, 8, 768)),
    "235B-A22B": (4096, 94, 64, 4, 12288, 151_936, False, (128, 8, 1536)),
}

# deepseek_v3: (vocab, dim, inter_dim, moe_inter_dim, n_layers, n_dense_layers,
# n_heads, num_experts, num_shared_experts, top_k, q_lora_rank, attention);
# kv_lora_rank 512, head dims 128 + 64 rotary, values 128 throughout.
_DEEPSEEK: dict[str, tuple[Any, ...]] = {
    "debugmodel": (2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, 0, "sdpa"),
    "debugmodel_flex_attn": (2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, 0, "flex"),
    "16B": (102_400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, 0, "flex"),
    "236B": (102_400, 5120, 12288, 1536, 60, 1, 128, 160, 2, 6, 1536, "flex"),
    "671B": (129_280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, 1536, "flex"),
}

#: The flavors read for each schema and model name (``llama3_ft`` trains
#: llama3's flavors under torchft).
MODEL_FLAVORS: dict[str, dict[str, tuple[str, ...]]] = {
    "v0.2": {
        "llama3": tuple(_LLAMA3),
        "llama3_ft": tuple(_LLAMA3),
        "qwen3": tuple(_QWEN3),
        "deepseek_v3": tuple(_DEEPSEEK),
        "llama4": tuple(_LLAMA4),
    },
    "2024-12": {"llama3": tuple(_LLAMA3_2024_12)},
}
#: Models a v0.2 train spec builds without a pipelining function
#: (``pipelining_fn=None``: torchtitan raises with PP > 1).
_NO_PIPELINING = ("qwen3",)
_REFUSED = {
    "gpt_oss": "attention sinks, sliding windows and biased experts are not modelled",
    "flux": "a diffusion model, not a decoder-only transformer",
}


@dataclasses.dataclass(frozen=True)
class TorchtitanModel:
    """A torchtitan flavor's shape and what the shape does not say.

    Attributes:
        spec: the model at the job's sequence length.
        attention: ``"sdpa"``, ``"flex"`` or ``"varlen"`` (the flavor's
            ``attn_type``; flex and varlen run block-causal masks).
        pipelining: the train spec can pipeline it (PP > 1).
        notes: what the spec does not model, one phrase each.
    """

    spec: TransformerSpec
    attention: str
    pipelining: bool
    notes: tuple[str, ...] = ()


def llama_ffn_width(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """torchtitan's llama ``FeedForward`` width for ``hidden_dim = 4 dim``:
    ``int(2 x 4 dim / 3)``, times ``multiplier`` (truncated) when given,
    rounded up to a multiple of ``multiple_of``.

    Example:
        >>> llama_ffn_width(4096, 1024, 1.3)  # llama3 8B
        14336
    """
    width = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        width = int(multiplier * width)
    return multiple_of * math.ceil(width / multiple_of)


def _llama4_expert_width(args: _Llama) -> int:
    """An expert's width with ``auto_scale_hidden_dim`` (one routed expert
    per token and one shared expert: ``MoEArgs``' defaults)."""
    width = int(2 * (4 * args.dim) / 3)
    if args.multiplier is not None:
        width = int(args.multiplier * width)
    width = int(width / (1 + 1))
    return width + (-width % args.multiple_of)


def _llama(name: str, args: _Llama, seq_len: int, vocab: int) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        name=name,
        num_layers=args.n_layers,
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        num_query_groups=args.n_kv_heads or args.n_heads,
        ffn_hidden_size=llama_ffn_width(args.dim, args.multiple_of, args.multiplier),
        vocab_size=vocab,
        seq_length=seq_len,
    )
    if args.num_experts:
        layers = tuple((i + 1) % args.moe_step == 0 for i in range(args.n_layers))
        width = _llama4_expert_width(args)
        fields["moe"] = MoeSpec(
            num_experts=args.num_experts,
            topk=1,
            ffn_hidden_size=width,
            shared_ffn_hidden_size=width,
            layers=None if all(layers) else layers,
        )
    return fields


def _qwen3(name: str, flavor: str, seq_len: int) -> dict[str, Any]:
    dim, layers, heads, groups, hidden, vocab, tied, experts = _QWEN3[flavor]
    fields: dict[str, Any] = dict(
        name=name,
        num_layers=layers,
        hidden_size=dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=hidden,
        vocab_size=vocab,
        seq_length=seq_len,
        tied_embeddings=tied,
        qk_layernorm=True,
        kv_channels=None if heads * 128 == dim else 128,
    )
    if experts is not None:
        num, topk, width = experts
        fields["moe"] = MoeSpec(num_experts=num, topk=topk, ffn_hidden_size=width)
    return fields


def _deepseek(name: str, flavor: str, seq_len: int) -> dict[str, Any]:
    vocab, dim, inter, width, layers, dense, heads, num, shared, topk, q_rank, _ = (
        _DEEPSEEK[flavor]
    )
    return dict(
        name=name,
        num_layers=layers,
        hidden_size=dim,
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=inter,
        vocab_size=vocab,
        seq_length=seq_len,
        qk_layernorm=True,
        mla=MlaSpec(
            q_lora_rank=q_rank,
            kv_lora_rank=512,
            qk_head_dim=128,
            qk_pos_emb_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoeSpec(
            num_experts=num,
            topk=topk,
            ffn_hidden_size=width,
            shared_ffn_hidden_size=width * shared,
            layers=moe_layer_pattern(layers, first_dense=dense),
        ),
    )


def _notes(attention: str, irope: bool) -> tuple[str, ...]:
    notes = []
    if attention != "sdpa":
        notes.append(
            f"{attention} attention with block-causal masks (priced as causal "
            "attention over the whole sequence)"
        )
    if irope:
        notes.append(
            "iRoPE: no positions every fourth block and chunked attention in "
            "the others (priced as full causal attention)"
        )
    return tuple(notes)


def torchtitan_model(
    name: str,
    flavor: str,
    *,
    schema: str,
    seq_len: int,
    source: str,
    vocab_size: int | None = None,
) -> TorchtitanModel:
    """The spec of torchtitan's ``name``/``flavor`` (module docstring).

    Args:
        name, flavor: ``[model] name`` and ``flavor``.
        schema: ``"v0.2"`` or ``"2024-12"`` (the job file's).
        seq_len: ``[training] seq_len``.
        source: the job file, for messages.
        vocab_size: the tokenizer's vocabulary where torchtitan takes it from
            the tokenizer (2024-12: ``None`` reads Llama 3's 128,256); a v0.2
            flavor's own vocabulary is its model arguments', and a different
            ``vocab_size`` is refused.

    Raises:
        ProblemError: a model or flavor not read here (the line names the
            flavors that are), or a ``vocab_size`` a v0.2 flavor contradicts.
    """
    if name in _REFUSED:
        raise ProblemError(
            f"{source}: [model] name {name!r} is not read ({_REFUSED[name]})"
        )
    models = MODEL_FLAVORS[schema]
    if name not in models:
        raise ProblemError(
            f"{source}: [model] name {name!r} is not a model read for torchtitan "
            f"{schema} job files (read: {', '.join(models)})"
        )
    if flavor not in models[name]:
        raise ProblemError(
            f"{source}: [model] flavor {flavor!r} is not a flavor of torchtitan "
            f"{schema}'s {name} (read: {', '.join(models[name])})"
        )
    spec_name = f"torchtitan {name} {flavor}"
    attention, irope = "sdpa", False
    if name in ("llama3", "llama3_ft", "llama4"):
        table = _LLAMA3_2024_12 if schema == "2024-12" else _LLAMA3
        args = (_LLAMA4 if name == "llama4" else table)[flavor]
        vocab = _vocab(args.vocab, vocab_size, source, spec_name)
        fields = _llama(spec_name, args, seq_len, vocab)
        attention, irope = args.attention, args.irope
    elif name == "qwen3":
        fields = _qwen3(spec_name, flavor, seq_len)
        _vocab(fields["vocab_size"], vocab_size, source, spec_name)
    else:
        fields = _deepseek(spec_name, flavor, seq_len)
        _vocab(fields["vocab_size"], vocab_size, source, spec_name)
        attention = _DEEPSEEK[flavor][-1]
    try:
        spec = TransformerSpec(**{**DECODER_DESIGN, **fields})
    except ValueError as error:
        raise ProblemError(f"{source}: {error}") from None
    return TorchtitanModel(
        spec=spec,
        attention=attention,
        pipelining=name not in _NO_PIPELINING,
        notes=_notes(attention, irope),
    )


def _vocab(own: int | None, given: int | None, source: str, name: str) -> int:
    """The vocabulary: the flavor's own, else ``given``, else Llama 3's."""
    if own is None:
        return LLAMA3_TOKENIZER_VOCAB if given is None else given
    if given is not None and given != own:
        raise ProblemError(
            f"{source}: {name} has a vocabulary of {own} in torchtitan's model "
            f"arguments, not {given}"
        )
    return own
