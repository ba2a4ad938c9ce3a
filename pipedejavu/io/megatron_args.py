"""Megatron-LM command lines: the model and the parallel/training settings.

:func:`spec_from_megatron_args` reads the arguments of a ``pretrain_gpt.py`` run
(as a string, split with :mod:`shlex`, or as a list; ``--flag value`` and
``--flag=value`` both work) into a :class:`MegatronRun`: a
:class:`~pipedejavu.core.transformer.TransformerSpec` and the settings a
prediction needs (TP, PP, interleaving, batch sizes, sequence parallelism,
activation recomputation, precision and its FP8/FP4 recipe, distributed
optimizer, expert parallelism). The mixture-of-experts, multi-latent-attention
and multi-token-prediction flags are read by
:func:`~pipedejavu.io.megatron_moe.read_moe`: the spec's ``moe``, ``mla``,
``mtp_layers`` and ``qk_layernorm``, the run's ``ep``/``etp`` and
:class:`~pipedejavu.io.megatron_moe.MoeOptions`.

Defaults and derived values follow Megatron-LM's ``megatron/training/arguments.py``
(github.com/NVIDIA/Megatron-LM): the MLP width is ``4h``, or with ``--swiglu``
``int(4h * 2/3 / 64) * 64``; the vocabulary is padded to a multiple of
``--make-vocab-size-divisible-by`` (128) times TP; ``--disable-bias-linear``
removes every linear bias; ``--num-query-groups`` counts only with
``--group-query-attention``. The recomputation flags (``--recompute-modules``
and the SC'21 scripts' old names among them) are read by
:mod:`~pipedejavu.io.megatron_recompute`. The layers' split over pipeline
stages (even, uneven first/last stages, the embedding or loss counted, an
explicit layout, virtual stages) is read by
:func:`~pipedejavu.io.megatron_layout.split_pipeline`.

The words are read by :func:`~pipedejavu.io.megatron_command.read_flags`:
flags Megatron-LM accepts that change nothing here (learning rate, data
paths, logging, ...) and words that are not flags (``torchrun ...
pretrain_gpt.py``) are returned in :attr:`MegatronRun.ignored`; a flag or
value Megatron-LM refuses, and contradictory or unsupported settings, are
refused with a one-line :class:`ProblemError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import DP_OUTER, ParallelLayout, StageAxes
from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.core.training_options import DEFAULT_RECOMPUTE_MODULES
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.megatron_command import read_flags, split_command
from pipedejavu.io.megatron_layout import pipeline_split
from pipedejavu.io.megatron_moe import MoeOptions, read_moe
from pipedejavu.io.megatron_recompute import read_recompute, read_recompute_modules

__all__ = [
    "GPT2_VOCAB_SIZE",
    "MegatronRun",
    "spec_from_megatron_args",
]

#: Tokens of the GPT-2 BPE vocabulary (``--vocab-file``/``--merge-file``,
#: ``--tokenizer-type GPT2BPETokenizer``).
GPT2_VOCAB_SIZE = 50257

_POSITIONS = {"learned_absolute": "learned", "rope": "rotary", "none": "none"}


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
        virtual_stage_layers: with ``V > 1``, the transformer layers of each
            virtual stage when a layout (or uneven first/last stages) gives
            them (:class:`~pipedejavu.io.megatron_layout.PipelineSplit`).
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
        recompute_modules: what selective recomputation reruns
            (``--recompute-modules``; Megatron-Core's default ``core_attn``,
            and that where the granularity is not selective).
        precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (FP8 GEMMs
            through Transformer Engine; ``params_dtype`` is then fp16 or bf16).
        params_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        use_distributed_optimizer: optimizer states sharded over data parallel.
        zero_stage: what data parallelism shards (``--use-torch-fsdp2``: 3;
            ``--use-megatron-fsdp`` with ``--data-parallel-sharding-strategy``:
            0 to 3; else 1 with the distributed optimizer, 0 without).
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
        ep: expert parallelism (``--expert-model-parallel-size``).
        etp: expert tensor parallelism (``--expert-tensor-parallel-size``);
            ``None``: ``tp``, Megatron-LM's default (as
            :class:`~pipedejavu.core.layout.StageAxes` says it).
        moe_options: the experts' dispatcher, grouped GEMM, capacity and
            overlaps; ``None`` for a dense run.
        fp8_recipe: ``--fp8-recipe`` with FP8 (``delayed``, Megatron-LM's
            default, ``tensorwise``, ``blockwise`` or ``mxfp8``); else ``None``.
        fp4_recipe: ``nvfp4`` with ``--fp4-format`` (``precision`` is then
            the parameters' dtype); else ``None``.
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
    ep: int = 1
    etp: int | None = None
    moe_options: MoeOptions | None = None
    fp8_recipe: str | None = None
    fp4_recipe: str | None = None
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES
    virtual_stage_layers: tuple[int, ...] = ()
    zero_stage: int = 0

    def layout(self, num_gpus: int) -> ParallelLayout:
        """The run's layout on ``num_gpus`` GPUs: Megatron Core's checks of
        the world size (``initialize_model_parallel``) are the layout's own.

        Raises:
            ProblemError: ``num_gpus`` is not whole groups of ``TP x CP x
                PP``, the expert block ``ETP x EP`` does not divide a stage's
                GPUs, or the replicas-outermost order with several stages has
                an expert block other than ``TP x CP``.
        """
        model = self.tp * self.context_parallel * self.pp
        if num_gpus % model:
            raise ProblemError(
                f"{num_gpus} GPUs are not whole groups of TP x CP x PP = {self.tp} "
                f"x {self.context_parallel} x {self.pp}"
            )
        axes = StageAxes(self.tp, self.ep, self.etp)
        return ParallelLayout(
            (axes,) * self.pp, num_gpus // model, self.context_parallel, self.rank_order
        )

    @property
    def recompute_full(self) -> bool:
        """Every block's forward pass is recomputed (Megatron's model-FLOPs
        counting with recomputation applies)."""
        return self.recompute_granularity == "full"


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


def _precision(values: dict[str, Any]) -> tuple[str, str, str | None, str | None]:
    """``(precision, params_dtype, fp8_recipe, fp4_recipe)``."""
    if values.get("fp16") and values.get("bf16"):
        raise ProblemError("Megatron arguments: --fp16 and --bf16 are exclusive")
    params = "fp16" if values.get("fp16") else "bf16" if values.get("bf16") else "fp32"
    fp8 = "fp8-format" in values or values.get("fp8-e4m3") or values.get("fp8-hybrid")
    fp4 = "fp4-format" in values
    if fp8 and fp4:  # validate_args (core_v0.16.1)
        raise ProblemError(
            "Megatron arguments: --fp4-format and --fp8-format are exclusive"
        )
    if fp8 and params == "fp32":
        raise ProblemError("Megatron arguments: FP8 needs --bf16 or --fp16")
    # TransformerConfig's defaults: the delayed FP8 recipe, NVFP4
    fp8_recipe = values.get("fp8-recipe", "delayed") if fp8 else None
    fp4_recipe = values.get("fp4-recipe", "nvfp4") if fp4 else None
    return ("fp8" if fp8 else params), params, fp8_recipe, fp4_recipe


def _spec(values: dict[str, Any], name: str, vocab: int) -> TransformerSpec:
    hidden = _required(values, "hidden-size")
    heads = _required(values, "num-attention-heads")
    kv_channels = values.get("kv-channels")
    if kv_channels is None and hidden % heads:  # validate_args asserts it
        raise ProblemError(
            f"Megatron arguments: --num-attention-heads {heads} does not divide "
            f"--hidden-size {hidden} (give --kv-channels)"
        )
    if kv_channels is not None and kv_channels * heads == hidden:
        kv_channels = None  # (Megatron-LM's default: h / a)
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
            kv_channels=kv_channels,
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
            of the wrong kind (MoE flags: :func:`~pipedejavu.io.megatron_moe.
            read_moe`), context parallelism
            with a sequence not divisible by ``2 CP`` or unfused attention, or
            contradictory settings: ``--fp16`` with ``--bf16``, heads (or
            query groups, or MLP width) not divisible by TP, virtual stages
            with PP 1, a pipeline split that does not divide or is not
            modelled (:func:`~pipedejavu.io.megatron_layout.split_pipeline`),
            recomputation flags Megatron-LM refuses
            (:mod:`~pipedejavu.io.megatron_recompute`), ``--overlap-param-gather``
            without ``--use-distributed-optimizer`` or ``--overlap-grad-reduce``,
            ``--tp-comm-overlap`` without ``--sequence-parallel`` (at TP 1,
            where Megatron-LM turns that off, too), ``--use-tp-pp-dp-mapping``
            with context parallelism.
    """
    values, ignored = read_flags(split_command(argv))
    if "seq-length" not in values and "encoder-seq-length" in values:
        # Megatron-LM's validate_args: the encoder's length when none is given
        values["seq-length"] = values["encoder-seq-length"]
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
    split = pipeline_split(
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
    chunks, stage_layers = split.chunks, split.stage_layers
    micro = _required(values, "micro-batch-size")
    global_batch = values.get("global-batch-size")
    if global_batch is not None and int(global_batch) % micro:
        raise ProblemError(
            f"Megatron arguments: --global-batch-size {global_batch} is not a "
            f"multiple of --micro-batch-size {micro}"
        )
    granularity, method, recompute_layers = read_recompute(values)
    precision, params_dtype, fp8_recipe, fp4_recipe = _precision(values)
    granularity, modules, unread = read_recompute_modules(
        values, granularity, fp8_recipe=fp8_recipe
    )
    ignored += unread
    if granularity is None:  # (Megatron-LM reads them only with a granularity)
        ignored += [
            f"--{flag} {values[flag]} (no effect without --recompute-granularity)"
            for flag in ("recompute-method", "recompute-num-layers")
            if flag in values
        ]
    ignored += [
        f"--{flag}-recipe {values[f'{flag}-recipe']} (no effect without "
        f"--{flag}-format)"
        for flag, recipe in (("fp8", fp8_recipe), ("fp4", fp4_recipe))
        if recipe is None and f"{flag}-recipe" in values
    ]
    experts = read_moe(
        values,
        num_layers=spec.num_layers,
        ffn_hidden_size=spec.ffn_hidden_size,
        tp=tp,
        pp=pp,
        chunks=chunks,
        recompute=(granularity, method, recompute_layers),
        params_dtype=params_dtype,
        position=str(values.get("position-embedding-type", "learned_absolute")),
    )
    ignored += experts.ignored
    split.check_mtp(experts.mtp_layers)
    try:
        spec = dataclasses.replace(
            spec,
            moe=experts.moe,
            mla=experts.mla,
            mtp_layers=experts.mtp_layers,
            qk_layernorm=experts.qk_layernorm,
        )
    except ValueError as error:
        raise ProblemError(f"Megatron arguments: {error}") from None
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
    if mapping:
        # Megatron Core (0.11 on) builds the layout and refuses it when the
        # expert and dense data parallelism differ across several stages:
        # ETP x EP != TP x CP (the layout's own rule; a data-parallel size of
        # ETP x EP leaves only that rule to check before the world is known).
        block = (experts.etp or tp) * experts.ep
        try:
            ParallelLayout.uniform(
                tp=tp,
                pp=pp,
                cp=cp,
                dp=block,
                ep=experts.ep,
                etp=experts.etp,
                order=DP_OUTER,
            )
        except ProblemError as refused:
            expert = f", EP {experts.ep}, ETP {block // experts.ep}"
            raise ProblemError(
                f"Megatron arguments: --use-tp-pp-dp-mapping with "
                f"--context-parallel-size {cp}{expert if experts.moe else ''} and "
                f"{pp} pipeline stages is refused by Megatron Core's "
                f"initialize_model_parallel ({refused})"
            ) from None
    zero = _zero_stage(values, pp, experts.ep, spec.tied_embeddings, ignored)
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
        virtual_stage_layers=split.virtual_layers,
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
        ep=experts.ep,
        etp=experts.etp,
        moe_options=experts.options,
        fp8_recipe=fp8_recipe,
        fp4_recipe=fp4_recipe,
        recompute_modules=modules,
        zero_stage=zero,
    )


#: Megatron-FSDP's ``--data-parallel-sharding-strategy`` as a ZeRO stage.
_SHARDING_STAGES = {
    "no_shard": 0,
    "optim": 1,
    "optim_grads": 2,
    "optim_grads_params": 3,
}


def _zero_stage(
    values: dict[str, Any], pp: int, ep: int, tied: bool, ignored: list[str]
) -> int:
    """The ZeRO stage of the launch's data parallelism: ``--use-torch-fsdp2``
    (3, with Megatron-LM's checks: no pipeline or expert parallelism, no
    distributed optimizer, no fp16, untied embeddings), ``--use-megatron-fsdp``
    with ``--data-parallel-sharding-strategy`` (``no_shard`` 0, ``optim`` 1,
    ``optim_grads`` 2, ``optim_grads_params`` 3), else 1 with
    ``--use-distributed-optimizer``, 0 without.

    Raises:
        ProblemError: what Megatron-LM asserts against, both FSDPs, or
            ZeRO-3 with pipeline stages (not priced).
    """
    torch_fsdp, megatron_fsdp = (
        bool(values.get(flag)) for flag in ("use-torch-fsdp2", "use-megatron-fsdp")
    )
    strategy = values.get("data-parallel-sharding-strategy")
    stage = 1 if values.get("use-distributed-optimizer") else 0
    if strategy is not None and not megatron_fsdp:
        ignored.append(
            f"--data-parallel-sharding-strategy {strategy} (read with "
            "--use-megatron-fsdp only)"
        )
    if torch_fsdp and megatron_fsdp:
        raise ProblemError(
            "Megatron arguments: --use-torch-fsdp2 and --use-megatron-fsdp are two "
            "FSDPs; give one"
        )
    if torch_fsdp:
        refused = [
            (pp > 1, "pipeline parallelism"),
            (ep > 1, "expert parallelism"),
            (stage == 1, "MCore's distributed optimizer"),
            (bool(values.get("fp16")), "fp16"),
            (
                tied,
                "tied embeddings (it requires --untie-embeddings-and-output-weights)",
            ),
        ]
        for bad, what in refused:
            if bad:
                raise ProblemError(
                    f"Megatron arguments: --use-torch-fsdp2 is not supported with "
                    f"{what} (Megatron-LM's validate_args)"
                )
        stage = 3
    elif megatron_fsdp:
        stage = max(stage, _SHARDING_STAGES[strategy or "no_shard"])
    if stage == 3 and pp > 1:
        raise ProblemError(
            "Megatron arguments: sharded parameters with pipeline stages are not "
            "priced yet (the predictor prices ZeRO-3 on one stage)"
        )
    return stage


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
