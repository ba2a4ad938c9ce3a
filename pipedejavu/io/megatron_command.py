"""A Megatron-LM command line read flag by flag, as Megatron-LM reads it.

:func:`read_flags` turns the words of a ``pretrain_gpt.py`` launch into the
values of the flags this package reads (:data:`INT_FLAGS`,
:data:`CHOICE_FLAGS`, :data:`STR_FLAGS`, :data:`BOOL_FLAGS`, :data:`LIST_FLAGS`;
the mixture-of-experts ones come from :mod:`pipedejavu.io.megatron_moe`) and
the words it does not read. Every other ``--flag`` must be one Megatron-LM accepts (the
bundled list of :mod:`pipedejavu.io.megatron_flags`: Megatron Core 0.16.1 and
the newest release when it was written): such a flag is taken with the
values it takes and listed as ignored, since it changes nothing a prediction
reads (learning rate, data paths, logging, ...). A flag Megatron-LM refuses
(an unknown name, a prefix: its parser has ``allow_abbrev=False``, a value
outside its choices, a value given to a switch) is refused here too, with
the flag meant where one is close, rather than listed as ignored: a
misspelled ``--tensor-model-paralel-size 8`` would otherwise be priced at
TP 1.

Words before the script (``torchrun --nproc_per_node 8 pretrain_gpt.py``) are
the launcher's and are ignored with it; so are words that are not flags. The
flags of the SC'21 scripts that newer Megatron-LM dropped
(``--activations-checkpoint-method``, ``--activations-checkpoint-num-layers``)
and Transformer Engine's old ``--fp8-e4m3``/``--fp8-hybrid`` are still read.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Sequence
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.io.megatron_flags import megatron_flags
from pipedejavu.io.megatron_moe import (
    MOE_BOOL_FLAGS,
    MOE_CHOICE_FLAGS,
    MOE_INT_FLAGS,
    MOE_LIST_FLAGS,
    MOE_TEXT_FLAGS,
)
from pipedejavu.io.megatron_recompute import RECOMPUTE_BOOL_FLAGS, RECOMPUTE_LIST_FLAGS

__all__ = [
    "BOOL_FLAGS",
    "CHOICE_FLAGS",
    "INT_FLAGS",
    "LIST_FLAGS",
    "READ_FLAGS",
    "STR_FLAGS",
    "flag_takes_value",
    "read_flags",
    "split_command",
]

#: Flags read as positive integers.
INT_FLAGS = (
    "num-layers",
    "hidden-size",
    "num-attention-heads",
    "ffn-hidden-size",
    "seq-length",
    "encoder-seq-length",
    "max-position-embeddings",
    "vocab-size",
    "make-vocab-size-divisible-by",
    "num-query-groups",
    "kv-channels",
    "tensor-model-parallel-size",
    "pipeline-model-parallel-size",
    "num-layers-per-virtual-pipeline-stage",
    "num-virtual-stages-per-pipeline-rank",
    "micro-batch-size",
    "global-batch-size",
    "recompute-num-layers",
    "activations-checkpoint-num-layers",
    "context-parallel-size",
    "decoder-first-pipeline-num-layers",
    "decoder-last-pipeline-num-layers",
    *MOE_INT_FLAGS,
)
#: Flags read as one of some words (those the predictor prices).
CHOICE_FLAGS = {
    "position-embedding-type": ("learned_absolute", "rope", "none"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "recompute-granularity": ("full", "selective"),
    "recompute-method": ("uniform", "block"),
    "activations-checkpoint-method": ("uniform", "block"),
    "fp8-format": ("e4m3", "hybrid"),
    "fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise"),
    "fp4-format": ("e2m1",),
    "fp4-recipe": ("nvfp4",),
    "attention-backend": ("auto", "flash", "fused", "unfused", "local"),
    "data-parallel-sharding-strategy": (
        "no_shard",
        "optim",
        "optim_grads",
        "optim_grads_params",
    ),
    **MOE_CHOICE_FLAGS,
}
#: Flags read as text.
STR_FLAGS = (
    "tokenizer-type",
    "vocab-file",
    "merge-file",
    "name",
    "attention-dropout",
    "pipeline-model-parallel-layout",
    *MOE_TEXT_FLAGS,
    *RECOMPUTE_LIST_FLAGS,
)
#: Flags read as one or more words (a tuple).
LIST_FLAGS = (*MOE_LIST_FLAGS, *RECOMPUTE_LIST_FLAGS)
#: Switches.
BOOL_FLAGS = (
    "swiglu",
    "untie-embeddings-and-output-weights",
    "group-query-attention",
    "disable-bias-linear",
    "add-qkv-bias",
    "sequence-parallel",
    "fp16",
    "bf16",
    "fp8-e4m3",
    "fp8-hybrid",
    "use-distributed-optimizer",
    "recompute-activations",
    "checkpoint-activations",
    "use-rotary-position-embeddings",
    "use-flash-attn",
    "overlap-grad-reduce",
    "overlap-param-gather",
    "grad-reduce-in-bf16",
    "tp-comm-overlap",
    "account-for-embedding-in-pipeline-split",
    "account-for-loss-in-pipeline-split",
    "use-tp-pp-dp-mapping",
    "use-torch-fsdp2",
    "use-megatron-fsdp",
    *MOE_BOOL_FLAGS,
    *RECOMPUTE_BOOL_FLAGS,
)
#: Every flag read here (without ``--``).
READ_FLAGS = tuple(sorted({*INT_FLAGS, *CHOICE_FLAGS, *STR_FLAGS, *BOOL_FLAGS}))
#: How close (:class:`difflib.SequenceMatcher`'s ratio) an unknown flag must
#: be to one Megatron-LM accepts to be named as the flag meant.
_CLOSE = 0.8


def flag_takes_value(flag: str) -> bool | None:
    """Whether Megatron-LM's ``--flag`` (given without ``--``) takes a value:
    ``True`` or ``False`` for a flag read here or one Megatron-LM accepts
    (one value or several: ``True``; a value or none: ``None``), ``None``
    for others."""
    if flag in BOOL_FLAGS:
        return False
    if flag in READ_FLAGS:
        return True
    info = megatron_flags().get(f"--{flag}")
    if info is None or info.value == "optional":
        return None
    return info.value != "none"


def split_command(argv: str | Sequence[str]) -> list[str]:
    """The words of a command line (a string is split as a POSIX shell does,
    ``#`` comments dropped).

    Raises:
        ProblemError: unbalanced quotes, or a list of other than strings.
    """
    if isinstance(argv, str):
        try:
            return shlex.split(argv, comments=True)
        except ValueError as error:
            raise ProblemError(f"Megatron arguments: cannot split: {error}") from None
    if not all(isinstance(token, str) for token in argv):
        raise ProblemError("Megatron arguments must be a string or a list of strings")
    return list(argv)


def _unknown(flag: str) -> ProblemError:
    """Megatron-LM's parser has no ``--flag``: the error, with the flag meant
    where one is close."""
    flags = megatron_flags()
    names = [name[2:] for name in flags if name.startswith("--")]
    close = difflib.get_close_matches(flag, [*READ_FLAGS, *names], n=1, cutoff=_CLOSE)
    meant = f"; did you mean --{close[0]}?" if close else ""
    return ProblemError(
        f"Megatron arguments: unknown flag --{flag[:60]}: Megatron-LM's "
        f"pretrain_gpt.py ({', '.join(flags.refs)}) has no such flag{meant}"
    )


def _launcher_words(tokens: list[str]) -> int:
    """How many leading words belong to the launcher: up to and including the
    training script (``torchrun ... pretrain_gpt.py``), else none."""
    for index, token in enumerate(tokens):
        if token.endswith(".py") and not token.startswith("-"):
            return index + 1
    return 0


def read_flags(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``{flag: value}`` for the flags read here (the last one wins), and the
    words that change nothing here, in order (module docstring).

    Raises:
        ProblemError: a flag Megatron-LM refuses, a value it refuses, a bad
            value of a flag read here.
    """
    launcher = _launcher_words(tokens)
    ignored = [" ".join(tokens[:launcher])] if launcher else []
    values: dict[str, Any] = {}
    index = launcher
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not token.startswith("--") or token == "--":
            ignored.append(token)
            continue
        flag, has_value, inline = token[2:].partition("=")
        if flag in BOOL_FLAGS:
            if has_value:
                raise ProblemError(f"Megatron arguments: --{flag} takes no value")
            values[flag] = True
            continue
        if flag not in READ_FLAGS:
            index, words = _other_flag(flag, token, has_value, tokens, index)
            ignored.append(words)
            continue
        if flag in LIST_FLAGS:
            words = [inline] if has_value else []
            while not has_value and index < len(tokens):
                if tokens[index].startswith("--"):
                    break
                words.append(tokens[index])
                index += 1
            if not words:
                raise ProblemError(f"Megatron arguments: --{flag} needs a value")
            values[flag] = tuple(_value(flag, word) for word in words)
            continue
        if has_value:
            text = inline
        elif index < len(tokens) and not tokens[index].startswith("--"):
            text = tokens[index]
            index += 1
        else:
            raise ProblemError(f"Megatron arguments: --{flag} needs a value")
        values[flag] = _value(flag, text)
    return values, ignored


def _other_flag(
    flag: str, token: str, has_value: bool, tokens: list[str], index: int
) -> tuple[int, str]:
    """A flag Megatron-LM accepts that changes nothing here, with the values
    it takes: ``(index after them, the words)``.

    Raises:
        ProblemError: Megatron-LM refuses the flag or its value.
    """
    info = megatron_flags().get(f"--{flag}")
    if info is None:
        raise _unknown(flag)
    if info.value == "none":
        if has_value:
            raise ProblemError(f"Megatron arguments: --{flag} takes no value")
        return index, token
    words = [token]
    taken = [token.partition("=")[2]] if has_value else []
    while not has_value and index < len(tokens) and not tokens[index].startswith("--"):
        taken.append(tokens[index])
        words.append(tokens[index])
        index += 1
        if info.value != "many":
            break
    if not taken and info.value == "one":
        raise ProblemError(f"Megatron arguments: --{flag} needs a value")
    for text in taken:
        if not info.allows(text):
            raise ProblemError(
                f"Megatron arguments: --{flag} {text[:60]!r} is not one of "
                f"Megatron-LM's choices ({', '.join(map(str, info.choices or ()))})"
            )
    return index, " ".join(words)


def _value(flag: str, text: str) -> object:
    if flag in INT_FLAGS:
        try:
            if len(text) > 40:  # (int() of thousands of digits takes long)
                raise ValueError(text)
            number = int(text)
        except ValueError:
            shown = (
                text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
            )
            raise ProblemError(
                f"Megatron arguments: --{flag} must be an integer of at most 40 "
                f"digits, got {shown!r}"
            ) from None
        if number <= 0:
            raise ProblemError(
                f"Megatron arguments: --{flag} must be positive, got {number}"
            )
        return number
    if flag in CHOICE_FLAGS and text not in CHOICE_FLAGS[flag]:
        raise ProblemError(
            f"Megatron arguments: --{flag} {text!r} is not supported "
            f"(supported: {', '.join(CHOICE_FLAGS[flag])})"
        )
    return text
