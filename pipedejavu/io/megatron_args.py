"""Megatron-LM command lines: the model and the parallel/training settings.

:func:`spec_from_megatron_args` reads the arguments of a ``pretrain_gpt.py`` run
(as a string, split with :mod:`shlex`, or as a list; ``--flag value`` and
``--flag=value`` both work) into a :class:`MegatronRun`: a
:class:`~pipedejavu.core.transformer.TransformerSpec` and the settings a
prediction needs (TP, PP, interleaving, batch sizes, sequence parallelism,
activation recomputation, precision, distributed optimizer).

Defaults and derived values follow Megatron-LM's ``megatron/training/arguments.py``
(github.com/NVIDIA/Megatron-LM): the MLP width is ``4h``, or with ``--swiglu``
``int(4h * 2/3 / 64) * 64``; the vocabulary is padded to a multiple of
``--make-vocab-size-divisible-by`` (128) times TP; ``--disable-bias-linear``
removes every linear bias; ``--num-query-groups`` counts only with
``--group-query-attention``. The old names of the SC'21 scripts are read too:
``--checkpoint-activations`` and ``--activations-checkpoint-method`` mean full
recomputation (``--activations-checkpoint-num-layers``, default 1). The
layers' split over pipeline stages (even, uneven first/last stages, the
embedding or loss counted, an explicit layout, virtual stages) is read by
:func:`~pipedejavu.io.megatron_layout.split_pipeline`.

Flags that change nothing here (learning rate, data paths, logging, ...) and
words that are not flags (``torchrun``, ``pretrain_gpt.py``) are returned in
:attr:`MegatronRun.ignored`; contradictory or unsupported settings are refused
with a one-line :class:`ProblemError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import shlex
from collections.abc import Sequence
from typing import Any, Literal

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.megatron_layout import split_pipeline

__all__ = ["GPT2_VOCAB_SIZE", "MegatronRun", "spec_from_megatron_args"]

#: Tokens of the GPT-2 BPE vocabulary (``--vocab-file``/``--merge-file``,
#: ``--tokenizer-type GPT2BPETokenizer``).
GPT2_VOCAB_SIZE = 50257

_INT_FLAGS = (
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
    "num-experts",
    "decoder-first-pipeline-num-layers",
    "decoder-last-pipeline-num-layers",
)
_CHOICE_FLAGS = {
    "position-embedding-type": ("learned_absolute", "rope", "none"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "recompute-granularity": ("full", "selective"),
    "recompute-method": ("uniform", "block"),
    "activations-checkpoint-method": ("uniform", "block"),
    "fp8-format": ("e4m3", "hybrid"),
    "attention-backend": ("auto", "flash", "fused", "unfused", "local"),
}
_STR_FLAGS = (
    "tokenizer-type",
    "vocab-file",
    "merge-file",
    "name",
    "attention-dropout",
    "pipeline-model-parallel-layout",
)
_BOOL_FLAGS = (
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
)
_POSITIONS = {"learned_absolute": "learned", "rope": "rotary", "none": "none"}
_KNOWN_FLAGS = sorted({*_INT_FLAGS, *_CHOICE_FLAGS, *_STR_FLAGS, *_BOOL_FLAGS})


@dataclasses.dataclass(frozen=True)
class MegatronRun:
    """A Megatron-LM run's model and settings.

    Attributes:
        spec: the model (``vocab_size`` unpadded, ``vocab_divisible_by`` the
            ``--make-vocab-size-divisible-by`` value).
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        virtual_chunks: model chunks per pipeline rank (interleaved 1F1B);
            1 without interleaving.
        stage_layers: transformer layers of each pipeline stage when they
            differ (uneven first/last stages, the embedding or loss counted in
            the split, a layout; :func:`~pipedejavu.io.megatron_layout.
            split_pipeline`); ``()``: Megatron's even split.
        context_parallel: GPUs sharing each sequence
            (``--context-parallel-size``; the world is ``TP x CP x PP x DP``).
        overlap_grad_reduce, overlap_param_gather: ``--overlap-grad-reduce``,
            ``--overlap-param-gather`` (the latter needs the distributed
            optimizer, as Megatron-LM asserts).
        grad_reduce_in_bf16: ``--grad-reduce-in-bf16`` (with ``--bf16``).
        tp_comm_overlap: ``--tp-comm-overlap`` (with ``--sequence-parallel``,
            as Megatron-LM asserts).
        micro_batch: samples per micro-batch.
        global_batch: samples per iteration; ``None`` if not given (Megatron
            then uses ``micro_batch x data-parallel size``).
        sequence_parallel: Megatron's sequence parallelism.
        recompute_granularity: ``"full"``, ``"selective"`` or ``None``.
        recompute_method: ``"uniform"``, ``"block"`` or ``None``.
        recompute_num_layers: Megatron's ``--recompute-num-layers``.
        precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (FP8 GEMMs
            through Transformer Engine; ``params_dtype`` is then fp16 or bf16).
        params_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        use_distributed_optimizer: optimizer states sharded over data parallel.
        padded_vocab_size: the embedding's rows at this TP.
        flash_attention: fused attention that never holds the ``s x s``
            scores: ``--use-flash-attn``, or ``--attention-backend`` ``flash``,
            ``fused`` or ``auto`` (Megatron-LM's default, which picks
            Transformer Engine's fused kernels); ``unfused`` and ``local`` hold
            them (as Megatron-LM did before flash attention, e.g. in SC'21).
        attention_dropout: dropout on the attention probabilities
            (``--attention-dropout``, Megatron-LM's default 0.1, > 0).
        ignored: the arguments read and ignored, in order.
        rank_order: ``"tp-dp-pp"`` (Megatron-LM's default order of the ranks,
            ``tp-cp-ep-dp-pp``) or ``"tp-pp-dp"`` (``--use-tp-pp-dp-mapping``:
            a pipeline's stages on consecutive ranks).
    """

    spec: TransformerSpec
    tp: int
    pp: int
    virtual_chunks: int
    micro_batch: int
    global_batch: int | None
    sequence_parallel: bool
    recompute_granularity: Literal["full", "selective"] | None
    recompute_method: Literal["uniform", "block"] | None
    recompute_num_layers: int | None
    precision: Literal["fp32", "fp16", "bf16", "fp8"]
    params_dtype: Literal["fp32", "fp16", "bf16"]
    use_distributed_optimizer: bool
    padded_vocab_size: int
    ignored: tuple[str, ...] = ()
    flash_attention: bool = True
    stage_layers: tuple[int, ...] = ()
    context_parallel: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    attention_dropout: bool = True
    tp_comm_overlap: bool = False
    rank_order: str = RANK_ORDERS[0]

    @property
    def recompute_full(self) -> bool:
        """Every block's forward pass is recomputed (Megatron's model-FLOPs
        counting with recomputation applies)."""
        return self.recompute_granularity == "full"


def _tokens(argv: str | Sequence[str]) -> list[str]:
    if isinstance(argv, str):
        try:
            return shlex.split(argv, comments=True)
        except ValueError as error:
            raise ProblemError(f"Megatron arguments: cannot split: {error}") from None
    if not all(isinstance(token, str) for token in argv):
        raise ProblemError("Megatron arguments must be a string or a list of strings")
    return list(argv)


def _refuse_a_typo(flag: str) -> None:
    """Refuse a flag this reader does not know that is a letter or two from
    one it reads (``--tensor-model-paralel-size``): Megatron-LM would refuse it,
    and listing it as ignored would price another run. The cutoff (0.91 of
    :class:`difflib.SequenceMatcher`'s ratio) leaves every flag spelled in
    Megatron-LM's sources alone (the closest, ``--fp4-format``, is 0.90 from
    ``--fp8-format``).

    Raises:
        ProblemError: naming the flag and the one meant.
    """
    close = difflib.get_close_matches(flag, _KNOWN_FLAGS, n=1, cutoff=0.91)
    if close:
        raise ProblemError(
            f"Megatron arguments: unknown flag --{flag[:60]}; did you mean "
            f"--{close[0]}?"
        )


def _parse(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``{flag: value}`` for the known flags (last one wins), and the rest."""
    values: dict[str, Any] = {}
    ignored: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not token.startswith("--") or token == "--":
            ignored.append(token)
            continue
        flag, has_value, inline = token[2:].partition("=")
        takes_value = flag in _INT_FLAGS or flag in _CHOICE_FLAGS or flag in _STR_FLAGS
        if flag in _BOOL_FLAGS:
            if has_value:
                raise ProblemError(f"Megatron arguments: --{flag} takes no value")
            values[flag] = True
            continue
        if not takes_value:
            _refuse_a_typo(flag)
            if not has_value and index < len(tokens):
                if not tokens[index].startswith("--"):
                    token = f"{token} {tokens[index]}"
                    index += 1
            ignored.append(token)
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


def _value(flag: str, text: str) -> object:
    if flag in _INT_FLAGS:
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
    if flag in _CHOICE_FLAGS and text not in _CHOICE_FLAGS[flag]:
        raise ProblemError(
            f"Megatron arguments: --{flag} {text!r} is not supported "
            f"(supported: {', '.join(_CHOICE_FLAGS[flag])})"
        )
    return text


def _required(values: dict[str, Any], flag: str) -> int:
    if flag not in values:
        raise ProblemError(f"Megatron arguments: missing --{flag}")
    return int(values[flag])


def _vocab_size(values: dict[str, Any], vocab_size: int | None) -> int:
    if "vocab-size" in values:
        return int(values["vocab-size"])
    gpt2 = values.get("tokenizer-type") == "GPT2BPETokenizer" or (
        "tokenizer-type" not in values and "merge-file" in values
    )
    if gpt2:
        return GPT2_VOCAB_SIZE
    if vocab_size is not None:
        return vocab_size
    raise ProblemError(
        "Megatron arguments: the vocabulary size is unknown (give --vocab-size, "
        "or a GPT-2 BPE --merge-file / --tokenizer-type GPT2BPETokenizer)"
    )


def _recompute(values: dict[str, Any]) -> tuple[Any, Any, int | None]:
    granularity = values.get("recompute-granularity")
    method = values.get("recompute-method")
    num_layers = values.get("recompute-num-layers")
    if values.get("recompute-activations"):
        if granularity == "full":
            raise ProblemError(
                "Megatron arguments: --recompute-activations (selective) contradicts "
                "--recompute-granularity full"
            )
        granularity = "selective"
    old_method = values.get("activations-checkpoint-method")
    if old_method is None and values.get("checkpoint-activations"):
        old_method = "uniform"
    if old_method is not None:
        if granularity == "selective" or (method not in (None, old_method)):
            raise ProblemError(
                "Megatron arguments: the old --checkpoint-activations / "
                "--activations-checkpoint-method contradict the --recompute-* flags"
            )
        granularity, method = "full", old_method
        num_layers = values.get("activations-checkpoint-num-layers", num_layers or 1)
    if granularity == "selective" and (method is not None or num_layers is not None):
        raise ProblemError(
            "Megatron arguments: --recompute-method and --recompute-num-layers apply "
            "only to --recompute-granularity full"
        )
    if granularity is None:
        method = num_layers = None
    total = values.get("num-layers")
    if num_layers is not None and total is not None:
        # Megatron-LM accepts more; a stage recomputes as with all its layers
        # (block: min(N, its layers); uniform: one unit of its layers)
        num_layers = min(num_layers, total)
    return granularity, method, num_layers


def _precision(values: dict[str, Any]) -> tuple[str, str]:
    if values.get("fp16") and values.get("bf16"):
        raise ProblemError("Megatron arguments: --fp16 and --bf16 are exclusive")
    params = "fp16" if values.get("fp16") else "bf16" if values.get("bf16") else "fp32"
    fp8 = "fp8-format" in values or values.get("fp8-e4m3") or values.get("fp8-hybrid")
    if fp8 and params == "fp32":
        raise ProblemError("Megatron arguments: FP8 needs --bf16 or --fp16")
    return ("fp8" if fp8 else params), params


def _spec(values: dict[str, Any], name: str, vocab: int) -> TransformerSpec:
    hidden = _required(values, "hidden-size")
    heads = _required(values, "num-attention-heads")
    if hidden % heads:
        raise ProblemError(
            f"Megatron arguments: --num-attention-heads {heads} does not divide "
            f"--hidden-size {hidden}"
        )
    if values.get("kv-channels", hidden // heads) != hidden // heads:
        raise ProblemError(
            f"Megatron arguments: --kv-channels {values['kv-channels']} != hidden / "
            f"heads = {hidden // heads} is not supported"
        )
    swiglu = bool(values.get("swiglu"))
    default_ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    groups = heads
    if values.get("group-query-attention"):
        groups = int(values.get("num-query-groups", 1))
    position = values.get("position-embedding-type", "learned_absolute")
    if values.get("use-rotary-position-embeddings"):
        position = "rope"
    seq_length = _required(values, "seq-length")
    rows = 0
    if position == "learned_absolute":
        rows = _required(values, "max-position-embeddings")
    bias = not values.get("disable-bias-linear")
    try:
        return TransformerSpec(
            name=name,
            num_layers=_required(values, "num-layers"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            ffn_hidden_size=int(values.get("ffn-hidden-size", default_ffn)),
            vocab_size=vocab,
            seq_length=seq_length,
            gated_mlp=swiglu,
            norm="rmsnorm" if values.get("normalization") == "RMSNorm" else "layernorm",
            position=_POSITIONS[str(position)],
            max_position_embeddings=rows,
            tied_embeddings=not values.get("untie-embeddings-and-output-weights"),
            linear_bias=bias,
            qkv_bias=bool(values.get("add-qkv-bias")),
            vocab_divisible_by=int(values.get("make-vocab-size-divisible-by", 128)),
        )
    except ValueError as error:
        raise ProblemError(f"Megatron arguments: {error}") from None


def spec_from_megatron_args(
    argv: str | Sequence[str],
    *,
    name: str = "megatron-gpt",
    vocab_size: int | None = None,
) -> MegatronRun:
    """A Megatron-LM ``pretrain_gpt.py`` command line as a :class:`MegatronRun`.

    Args:
        argv: the arguments, as one string (split as a shell would, ``#``
            comments dropped) or as a list.
        name: the spec's name (``--name`` overrides it).
        vocab_size: the tokenizer's vocabulary, for when the arguments do not
            give it (``--vocab-size``, or a GPT-2 BPE tokenizer: 50,257).

    Returns:
        The run. Flags it does not read are listed in ``ignored``.

    Raises:
        ProblemError: a missing model flag (``--num-layers``, ``--hidden-size``,
            ``--num-attention-heads``, ``--seq-length``, ``--micro-batch-size``,
            and ``--max-position-embeddings`` with learned positions), a value
            of the wrong kind, a mixture-of-experts run, context parallelism
            with a sequence not divisible by ``2 CP`` or unfused attention, or
            contradictory settings: ``--fp16`` with ``--bf16``, heads (or
            query groups, or MLP width) not divisible by TP, virtual stages
            with PP 1, a pipeline split that does not divide or is not
            modelled (:func:`~pipedejavu.io.megatron_layout.split_pipeline`),
            selective recomputation with a method, ``--overlap-param-gather``
            without ``--use-distributed-optimizer`` or ``--overlap-grad-reduce``,
            ``--tp-comm-overlap`` without ``--sequence-parallel`` (at TP 1,
            where Megatron-LM turns that off, too), ``--use-tp-pp-dp-mapping``
            with context parallelism.
    """
    values, ignored = _parse(_tokens(argv))
    if "seq-length" not in values and "encoder-seq-length" in values:
        # Megatron-LM's validate_args: the encoder's length when none is given
        values["seq-length"] = values["encoder-seq-length"]
    if values.get("num-experts", 1) != 1:
        raise ProblemError(
            f"Megatron arguments: mixture-of-experts runs (--num-experts "
            f"{values['num-experts']}) are not supported; only dense models are"
        )
    tp = int(values.get("tensor-model-parallel-size", 1))
    pp = int(values.get("pipeline-model-parallel-size", 1))
    if values.get("sequence-parallel") and tp == 1:
        # Megatron-LM turns it off at TP 1 (validate_args), with a warning
        del values["sequence-parallel"]
        ignored.append("--sequence-parallel (off at TP 1, as Megatron-LM turns it)")
    if values.get("tp-comm-overlap") and not values.get("sequence-parallel"):
        at_tp1 = " (which Megatron-LM turns off at TP 1)" if tp == 1 else ""
        raise ProblemError(
            "Megatron arguments: --tp-comm-overlap needs --sequence-parallel"
            f"{at_tp1}, as Megatron-LM asserts"
        )
    if "num-query-groups" in values and not values.get("group-query-attention"):
        # Megatron-LM reads the groups only with --group-query-attention
        ignored.append(
            f"--num-query-groups {values['num-query-groups']} (without "
            "--group-query-attention every head has its own keys and values)"
        )
    vocab = _vocab_size(values, vocab_size)
    spec = _spec(values, str(values.get("name", name)), vocab)
    try:
        spec.check_tp(tp)
    except ValueError as error:
        raise ProblemError(f"Megatron arguments: {error}") from None
    chunks, stage_layers = split_pipeline(
        spec.num_layers,
        pp,
        first=values.get("decoder-first-pipeline-num-layers"),
        last=values.get("decoder-last-pipeline-num-layers"),
        embedding=bool(values.get("account-for-embedding-in-pipeline-split")),
        loss=bool(values.get("account-for-loss-in-pipeline-split")),
        layout=values.get("pipeline-model-parallel-layout"),
        layers_per_chunk=values.get("num-layers-per-virtual-pipeline-stage"),
        chunks_per_rank=values.get("num-virtual-stages-per-pipeline-rank"),
    )
    micro = _required(values, "micro-batch-size")
    global_batch = values.get("global-batch-size")
    if global_batch is not None and int(global_batch) % micro:
        raise ProblemError(
            f"Megatron arguments: --global-batch-size {global_batch} is not a "
            f"multiple of --micro-batch-size {micro}"
        )
    granularity, method, recompute_layers = _recompute(values)
    precision, params_dtype = _precision(values)
    flash = _flash_attention(values)
    if values.get("overlap-param-gather") and not values.get(
        "use-distributed-optimizer"
    ):
        raise ProblemError(
            "Megatron arguments: --overlap-param-gather needs "
            "--use-distributed-optimizer"
        )
    if values.get("grad-reduce-in-bf16") and params_dtype != "bf16":
        raise ProblemError("Megatron arguments: --grad-reduce-in-bf16 needs --bf16")
    if values.get("overlap-param-gather") and not values.get("overlap-grad-reduce"):
        raise ProblemError(
            "Megatron arguments: --overlap-param-gather needs --overlap-grad-reduce"
        )
    cp = int(values.get("context-parallel-size", 1))
    if cp > 1 and spec.seq_length % (2 * cp):
        raise ProblemError(
            f"Megatron arguments: --seq-length {spec.seq_length} is not divisible "
            f"by 2 x --context-parallel-size = {2 * cp}"
        )
    mapping = bool(values.get("use-tp-pp-dp-mapping"))
    if mapping and cp > 1:
        raise ProblemError(
            "Megatron arguments: --use-tp-pp-dp-mapping is not used with "
            "--context-parallel-size > 1 (Megatron-LM's rule)"
        )
    if cp > 1 and not flash:
        raise ProblemError(
            "Megatron arguments: context parallelism runs Transformer Engine's "
            "fused attention, not --attention-backend "
            f"{values.get('attention-backend')}"
        )
    return MegatronRun(
        spec=spec,
        tp=tp,
        pp=pp,
        virtual_chunks=chunks,
        stage_layers=stage_layers,
        micro_batch=micro,
        global_batch=global_batch,
        sequence_parallel=bool(values.get("sequence-parallel")),
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=recompute_layers,
        precision=precision,
        params_dtype=params_dtype,
        use_distributed_optimizer=bool(values.get("use-distributed-optimizer")),
        padded_vocab_size=spec.padded_vocab_size(tp),
        ignored=tuple(ignored),
        flash_attention=flash,
        context_parallel=cp,
        overlap_grad_reduce=bool(values.get("overlap-grad-reduce")),
        overlap_param_gather=bool(values.get("overlap-param-gather")),
        grad_reduce_in_bf16=bool(values.get("grad-reduce-in-bf16")),
        attention_dropout=_attention_dropout(values) > 0,
        tp_comm_overlap=bool(values.get("tp-comm-overlap")),
        rank_order=RANK_ORDERS[1] if mapping else RANK_ORDERS[0],
    )


def _flash_attention(values: dict[str, Any]) -> bool:
    backend = values.get("attention-backend")
    if backend is not None:
        if values.get("use-flash-attn") and backend in ("unfused", "local"):
            raise ProblemError(
                f"Megatron arguments: --use-flash-attn contradicts "
                f"--attention-backend {backend}"
            )
        return backend in ("auto", "flash", "fused")
    return True


def _attention_dropout(values: dict[str, Any]) -> float:
    text = values.get("attention-dropout", "0.1")
    try:
        rate = float(text)
    except ValueError:
        raise ProblemError(
            f"Megatron arguments: --attention-dropout must be a number, got {text!r}"
        ) from None
    if not 0.0 <= rate < 1.0:
        raise ProblemError(
            f"Megatron arguments: --attention-dropout must be in [0, 1), got {rate}"
        )
    return rate
