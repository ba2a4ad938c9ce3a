"""The Megatron-LM export as a whole ``pretrain_gpt.py`` command.

Checked against Megatron Core 0.16.1 (``megatron/training/arguments.py``,
its ``TransformerConfig`` flags and ``validate_args``; no code copied). The
export is one shell-quoted line, after comment lines that say how to launch
it:

* **the model's shape** (:func:`model_flags`, from the
  :class:`~pipedejavu.core.transformer.TransformerSpec` the plan was priced
  for): ``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``,
  ``--num-attention-heads``, ``--group-query-attention --num-query-groups``
  (fewer key/value heads), ``--seq-length`` (the length the plan was priced
  at), ``--max-position-embeddings`` (``validate_args`` requires it: the
  learned table's rows, else the sequence length), ``--normalization``,
  ``--swiglu``, ``--position-embedding-type``,
  ``--untie-embeddings-and-output-weights``, ``--disable-bias-linear``,
  ``--add-qkv-bias`` and ``--make-vocab-size-divisible-by``, then the head
  width, query/key norms and experts
  (:func:`~pipedejavu.io.export_megatron.shape_flags`). ALiBi has no
  Megatron-LM flag: such a model is refused;
* **the plan's flags**: parallelism, batch, the layers' split, the schedule
  and the training options (:mod:`pipedejavu.io.export_megatron`,
  :func:`pipedejavu.io.exports.option_flags`);
* **placeholders** in angle brackets for what a plan does not know
  (:data:`PLACEHOLDERS`): the data, the tokenizer (of the priced vocabulary:
  GPT-2's BPE files for its 50,257 tokens, else a Hugging Face tokenizer with
  ``--vocab-size``, which states the size priced and which Megatron-LM reads
  for its ``NullTokenizer`` only), the training length and the learning
  rate.

Without a model description (a plan from profiles the package has no
description of) the line carries the plan's flags and ``--num-layers`` only,
and a comment says which shape flags to add. From a user's own command
(``plan --megatron-args``), :func:`replace_plan_flags` keeps the user's
tokens, drops every flag the plan sets (:data:`PLAN_FLAGS`) and appends the
plan's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_megatron import MEGATRON_VERSION, shape_flags
from pipedejavu.io.export_rules import ExportRefused, type_comment
from pipedejavu.io.megatron_args import GPT2_VOCAB_SIZE
from pipedejavu.io.megatron_command import flag_takes_value
from pipedejavu.io.megatron_flags import megatron_flags

__all__ = [
    "PLACEHOLDERS",
    "PLAN_FLAGS",
    "megatron_command",
    "model_flags",
    "replace_plan_flags",
]

#: Flags (without ``--``) a plan decides: removed from a user's command
#: before the plan's are added. Context parallelism among them: a plan runs
#: none (Megatron-LM's data parallelism is the world over TP x CP x PP).
PLAN_FLAGS = (
    "tensor-model-parallel-size",
    "pipeline-model-parallel-size",
    "micro-batch-size",
    "global-batch-size",
    "num-layers",
    "num-layers-per-virtual-pipeline-stage",
    "num-virtual-stages-per-pipeline-rank",
    "decoder-first-pipeline-num-layers",
    "decoder-last-pipeline-num-layers",
    "pipeline-model-parallel-layout",
    "account-for-embedding-in-pipeline-split",
    "account-for-loss-in-pipeline-split",
    "use-tp-pp-dp-mapping",
    "context-parallel-size",
    "expert-model-parallel-size",
    "expert-tensor-parallel-size",
    "hierarchical-context-parallel-sizes",
    "sequence-parallel",
    "use-distributed-optimizer",
    "recompute-granularity",
    "recompute-method",
    "recompute-num-layers",
    "recompute-modules",
    "moe-layer-recompute",
    "recompute-activations",
    "checkpoint-activations",
    "activations-checkpoint-method",
    "activations-checkpoint-num-layers",
    "fp16",
    "bf16",
    "fp8-format",
    "fp8-recipe",
    "fp8-e4m3",
    "fp8-hybrid",
    "overlap-grad-reduce",
    "overlap-param-gather",
    "grad-reduce-in-bf16",
    "tp-comm-overlap",
    "attention-backend",
    "use-flash-attn",
)
#: What the plan leaves to the user, as placeholders.
PLACEHOLDERS = {
    "data": ["--data-path", "<DATA_PATH>"],
    "training": ["--train-iters", "<TRAIN_ITERS>", "--lr", "<LR>"],
}
_POSITION = {"learned": "learned_absolute", "rotary": "rope", "none": "none"}


def _tokenizer(spec: TransformerSpec) -> list[str]:
    """The tokenizer placeholders: GPT-2's BPE files for its vocabulary,
    else a Hugging Face tokenizer."""
    if spec.vocab_size == GPT2_VOCAB_SIZE:
        return [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "<VOCAB_FILE>",
            "--merge-file",
            "<MERGE_FILE>",
        ]
    # (--vocab-size states the vocabulary priced: Megatron-LM takes a Hugging
    # Face tokenizer's own and reads the flag for NullTokenizer only)
    return [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        "<TOKENIZER>",
        "--vocab-size",
        str(spec.vocab_size),
    ]


def model_flags(spec: TransformerSpec, seq_length: int) -> list[str]:
    """Megatron-LM's flags for the model ``spec`` at ``seq_length`` tokens per
    sample (module docstring), without ``--num-layers`` (the plan's
    arguments carry it).

    Raises:
        ExportRefused: a position encoding Megatron-LM has no flag for.
    """
    if spec.position not in _POSITION:
        raise ExportRefused(
            f"Megatron-LM has no {spec.position} position encoding (the model "
            f"{spec.name} uses it)"
        )
    rows = spec.max_position_embeddings if spec.position == "learned" else 0
    flags = [
        "--hidden-size",
        str(spec.hidden_size),
        "--ffn-hidden-size",
        str(spec.ffn_hidden_size),
        "--num-attention-heads",
        str(spec.num_attention_heads),
    ]
    if spec.num_query_groups != spec.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups"]
        flags.append(str(spec.num_query_groups))
    flags += [
        "--seq-length",
        str(seq_length),
        "--max-position-embeddings",
        str(max(rows, seq_length)),
        "--position-embedding-type",
        _POSITION[spec.position],
        "--normalization",
        "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm",
    ]
    if spec.gated_mlp:
        flags.append("--swiglu")
    if not spec.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if not spec.linear_bias:
        flags.append("--disable-bias-linear")
        if spec.qkv_bias:
            flags.append("--add-qkv-bias")
    flags += ["--make-vocab-size-divisible-by", str(spec.vocab_divisible_by)]
    return flags + shape_flags(spec)


def replace_plan_flags(user_args: str, plan_args: Sequence[str]) -> list[str]:
    """The user's command (one string, split as a shell would) without the
    flags a plan decides (:data:`PLAN_FLAGS`, ``--flag value``, ``--flag
    value value ...`` for a flag of several values, and ``--flag=value``),
    then ``plan_args``.

    Raises:
        ProblemError: a command a shell cannot split.
    """
    try:
        tokens = shlex.split(user_args, comments=True)
    except ValueError as error:
        raise ProblemError(f"Megatron arguments: cannot split: {error}") from None
    kept: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        flag, has_value, _ = token[2:].partition("=")
        if not token.startswith("--") or flag not in PLAN_FLAGS:
            kept.append(token)
            continue
        if not flag_takes_value(flag) or has_value:
            continue
        many = getattr(megatron_flags().get(token), "value", None) == "many"
        while index < len(tokens) and (not many or not tokens[index].startswith("--")):
            index += 1  # its values go with it
            if not many:
                break
    return kept + list(plan_args)


def megatron_command(
    plan: Plan3D,
    plan_args: Sequence[str],
    *,
    spec: TransformerSpec | None,
    seq_length: int | None,
    user_args: str | None = None,
    notes: Sequence[str] = (),
) -> str:
    """The export (module docstring): comments, then one shell-quoted line.

    Args:
        plan: the plan.
        plan_args: its Megatron-LM flags, ``--num-layers`` among them.
        spec: the model (``None``: not known; the comment says which flags
            to add).
        seq_length: the tokens per sample the plan was priced at (``None``:
            not known, and a comment says so).
        user_args: the user's own command (``plan --megatron-args``), whose
            plan flags the plan's replace.
        notes: comment lines after the first (how the experts were priced).

    Raises:
        ExportRefused: as :func:`model_flags`.
    """
    world = plan.num_gpus
    lines = [
        f"# {MEGATRON_VERSION}: a pretrain_gpt.py command line, quoted for a "
        f"POSIX shell: launch {world} processes (TP x PP x DP = {world}), e.g. "
        "with torchrun",
        *notes,
    ]
    if user_args is not None:
        lines.append(
            "# your --megatron-args command with the plan's parallel, batch, "
            "schedule and training flags in place of yours"
        )
        tokens = replace_plan_flags(user_args, plan_args)
    else:
        tokens = ["pretrain_gpt.py"]
        if spec is None:
            length = "" if seq_length is not None else "--seq-length, "
            lines.append(
                f"# the model's shape is not known here (no description of "
                f"{plan.model}): add its --hidden-size, --ffn-hidden-size, "
                f"--num-attention-heads, {length}--max-position-embeddings, "
                "norm, activation and position flags"
            )
            if seq_length is not None:
                tokens += ["--seq-length", str(seq_length)]
        else:
            tokens += model_flags(spec, seq_length or spec.seq_length)
        tokens += plan_args
        lines.append(
            "# replace the <...> placeholders: your data, a tokenizer of "
            + (
                "the model's vocabulary"
                if spec is None
                else f"{spec.vocab_size:,} tokens (the vocabulary priced)"
            )
            + ", the training length and the learning rate"
        )
        if seq_length is None:
            lines.append(
                "# --seq-length: the length the plan was priced at is not known "
                "(the profiles' own)"
            )
        tokens += PLACEHOLDERS["data"]
        tokens += (
            _tokenizer(spec)
            if spec is not None
            else ["--tokenizer-type", "<TOKENIZER_TYPE>", "--tokenizer-model"]
            + ["<TOKENIZER>"]
        )
        tokens += PLACEHOLDERS["training"]
    return "\n".join(lines) + "\n" + type_comment(plan) + shlex.join(tokens) + "\n"
