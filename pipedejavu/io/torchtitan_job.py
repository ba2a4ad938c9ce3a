"""torchtitan job files (TOML): the model, the parallel degrees and the
training options, read as torchtitan reads them.

:func:`read_torchtitan_job` reads the ``--job.config_file`` of a torchtitan
run (at most :data:`MAX_JOB_FILE_BYTES`, parsed by :mod:`tomllib`, nothing
executed) into a :class:`TorchtitanJob`; :func:`parse_torchtitan_job` reads
its text. Checked against torchtitan's code (read, never copied):

* **v0.2** (releases v0.2.1 and v0.2.2, commit 73a0e697:
  ``torchtitan/config/job_config.py``, ``config/manager.py``,
  ``distributed/parallel_dims.py``, ``distributed/pipeline_parallel.py``,
  ``distributed/activation_checkpoint.py``, ``components/quantization/
  float8.py``, ``train.py``, the models' ``infra/parallelize.py``). Sections
  ``[job]``, ``[model]``, ``[training]``, ``[parallelism]``,
  ``[activation_checkpoint]``, ``[compile]``, ``[quantize.linear.float8]``,
  ... torchtitan's ``ConfigManager`` refuses a key its dataclasses do not
  have (``ValueError: Invalid field names``), and so does this reader; a
  ``[job] custom_config_module``, which extends the keys with an imported
  Python module, is refused (nothing is imported here).
* **2024-12** (commit 9dec370a, the schema of torchtitan's published
  Llama 3.1 runs of December 2024: ``torchtitan/config_manager.py``,
  ``parallelisms/parallel_dims.py``, ``parallelisms/parallelize_llama.py``,
  ``parallelisms/pipelining_utils.py``, ``float8.py``, ``train.py``).
  ``[training]`` holds ``batch_size``, ``compile`` and the DP/TP degrees,
  ``[experimental]`` the CP and PP ones and async TP, ``[float8]
  enable_float8_linear`` the float8 linears. Its parser merges the file's
  tables into its defaults without checking the keys, so an unknown key
  changes nothing there: it is listed in :attr:`TorchtitanJob.ignored`.

**Which schema.** A key or section only one schema has decides
(``[parallelism]``, ``[compile]``, ``local_batch_size``, ``converters``:
v0.2; ``batch_size``, ``[training] compile``, ``[training]
tensor_parallel_degree``, ``[experimental] pipeline_parallel_degree``,
``[float8]``: 2024-12); a file with both is refused, one with neither (only
keys both have) is read as v0.2.

**The model** (:mod:`pipedejavu.io.torchtitan_models`): ``[model] name`` and
``flavor`` name one of torchtitan's own shapes: llama3 ``8B``, ``70B``,
``405B`` (and the debug and FlexAttention/varlen flavors), qwen3 dense and
MoE, deepseek_v3 and llama4 (v0.2 only), built at the job's ``seq_len``.
2024-12 takes the vocabulary from the tokenizer: Llama 3's 128,256 unless
``vocab_size`` says otherwise. The defaults are torchtitan's: v0.2
``llama3``/``debugmodel``; 2024-12 ``llama``, a name its ``models_config``
lacks (a file without ``[model] name`` is refused, saying so). What the spec
leaves out (FlexAttention or varlen kernels, Llama 4's iRoPE) is listed in
:attr:`TorchtitanJob.ignored`.

**Degrees.** ``data_parallel_replicate_degree``,
``data_parallel_shard_degree`` (-1, the default: the rest of the GPUs),
``tensor_parallel_degree``, ``context_parallel_degree``,
``pipeline_parallel_degree``, ``expert_parallel_degree`` and
``expert_tensor_parallel_degree`` (v0.2); each a TOML integer of at least 1
(the shard degree: -1 too). :meth:`TorchtitanJob.degrees` resolves them on a
number of GPUs as ``ParallelDims`` does: ``dp_shard = -1`` becomes
``world // (dp_replicate x cp x tp x pp)``; ``dp_replicate x dp_shard x cp x tp
x pp`` must be the world; with EP > 1, ETP is 1 or TP; ``ETP x EP`` must
divide ``dp_shard x cp x tp`` (the ``efsdp`` mesh). It refuses, as
``parallelize`` does, data parallelism without sharding (DDP) beside another
parallelism.

**Batch.** ``local_batch_size`` (2024-12: ``batch_size``) is each data-parallel
rank's samples per step; ``global_batch_size`` (v0.2; negative, the default
-1: ``None``) must be a multiple of ``local x dp`` (``dp = dp_replicate x
dp_shard``; CP ranks share a sample), the quotient being gradient
accumulation (:meth:`TorchtitanJob.gradient_accumulation_steps`); 2024-12 has
no accumulation. With PP the schedule splits the local batch into
micro-batches: v0.2 of ``pipeline_parallel_microbatch_size`` (which must divide
it, as torchtitan raises), 2024-12 ``pipeline_parallel_microbatches`` of them
(default: the PP degree; unequal micro-batches are refused here, not priced).
Stages per rank (:attr:`TorchtitanJob.stages_per_rank`): the schedule's
default (1 for ``1F1B``/``GPipe``, 2 for looped ones), or from
``pipeline_parallel_layers_per_stage`` or ``module_fqns_per_model_part``
(2024-12: ``pipeline_parallel_split_points``), checked as
``pipeline_llm``/``pipeline_module_split`` check them. Schedule names are
PyTorch's (``get_schedule_class``, any case: ``1F1B``, ``GPipe``,
``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
``ZBVZeroBubble``, ``DualPipeV`` (v0.2), ``PipelineScheduleSingle``,
``PipelineScheduleMulti``), kept in their canonical spelling.

**Options.** ``[activation_checkpoint] mode`` ``none``, ``selective``
(torchtitan's default), ``full`` or (v0.2) ``memory_budget`` (which needs
the model compiled); ``selective_ac_option`` (a string; default ``"2"``)
``"op"`` (per-op SAC) or digits ``"N"``: every N-th block (``"0"``: every
block), read only with ``selective``. Compile: v0.2 ``[compile] enable`` with
``"model"`` (and ``"loss"``) in ``components``; 2024-12 ``[training]
compile``. Float8 linears: v0.2 the converter ``quantize.linear.float8`` in
``[model] converters`` (v0.1's name ``"float8"`` is refused, as v0.2's
registry lacks it), recipe ``[quantize.linear.float8] recipe_name``
(``tensorwise`` when unset), FSDP float8 all-gather (not with a recipe, as
torchtitan asserts); 2024-12 ``[float8] enable_float8_linear``, recipe
``tensorwise`` (dynamic scaling) or ``delayed`` (any ``scaling_type_*``
delayed). Async TP needs the model compiled at TP > 1 (torchtitan raises);
the sequence length must divide by ``TP x 2 CP`` (v0.2 asserts it always;
2024-12's PyTorch needs it with TP or CP). Also read: ``dtype``,
``mixed_precision_param``/``_reduce``, ``fsdp_reshard_after_forward``,
``context_parallel_rotate_method``, ``enable_cpu_offload``, 2024-12's
``norm_type`` (``fused_rmsnorm`` does not compile; LayerNorm without bias is
counted as RMSNorm's one weight).

**Refused as torchtitan (or the PyTorch under it) refuses it**, before the
world size is known: a value of the wrong type or range, an unknown choice;
``tensor_parallel_degree`` not dividing the query or key/value heads (its TP
splits whole heads); ``expert_parallel_degree`` not dividing the experts; PP
for a model without a pipelining function (qwen3); CP with varlen attention,
or with FlexAttention on an MoE flavor; async TP without compile; DualPipeV
with EP, its overlap and any activation checkpointing. A schedule name, the
micro-batch keys and the split keys are looked up only with PP > 1 (else
listed as ignored, as torchtitan never reads them).

Every other key is listed in :attr:`TorchtitanJob.ignored` (``[section] key =
value``, with the reason where it is not plain bookkeeping: other converters,
a schedule CSV, float8 keys without float8, ``[debug]
moe_force_load_balance``, ...). Every problem is one :class:`ProblemError`
line naming the file (and the section and key). Python 3.10 has no
:mod:`tomllib` (nor is ``tomli`` a dependency): the reader then says so.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import parse_toml, read_text
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.model_config import MODEL_FIFO_WAIT_S
from pipedejavu.io.torchtitan_keys import JobTable, detect_schema, flatten
from pipedejavu.io.torchtitan_models import TorchtitanModel, torchtitan_model
from pipedejavu.io.torchtitan_settings import (
    check_parallelism,
    checkpointing_settings,
    pipeline_settings,
    settings_2024_12,
    settings_v02,
)

__all__ = [
    "MAX_JOB_FILE_BYTES",
    "SCHEMAS",
    "TorchtitanDegrees",
    "TorchtitanJob",
    "parse_torchtitan_job",
    "read_torchtitan_job",
]

#: The schemas read: torchtitan v0.2.1/v0.2.2 and commit 9dec370a (2024-12).
SCHEMAS = ("v0.2", "2024-12")
#: The largest job file read.
MAX_JOB_FILE_BYTES = 2**20
_DEGREE_LIMIT = 2**20


@dataclasses.dataclass(frozen=True)
class TorchtitanDegrees:
    """A job's parallel degrees on a world of GPUs (``ParallelDims``).

    Attributes:
        dp_replicate, dp_shard, cp, tp, pp: the mesh's degrees (their product
            is the world); ``dp_shard`` resolved.
        ep, etp: expert and expert-tensor parallelism, folded out of
            ``dp_shard x cp x tp`` (1 and 1 without experts).
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks, each reading its own samples (the ``batch``
        mesh: ``dp_replicate x dp_shard``; CP ranks share a sample)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards the parameters over (``dp_shard x cp``)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards the experts over: ``dp_shard x cp x tp / (etp x
        ep)``."""
        return self.fsdp * self.tp // (self.etp * self.ep)


@dataclasses.dataclass(frozen=True)
class TorchtitanJob:
    """A torchtitan job file, as torchtitan reads it (module docstring).

    Attributes:
        source: the file, for messages.
        schema: ``"v0.2"`` or ``"2024-12"``.
        model_name, flavor: ``[model] name`` and ``flavor``.
        model: the flavor's shape at ``seq_len`` (``model.spec``), its
            attention kernel, whether it pipelines, and what the spec leaves
            out.
        seq_len: tokens per sample.
        local_batch_size: samples per data-parallel rank and step (2024-12:
            ``batch_size``).
        global_batch_size: samples per step; ``None``: not given (torchtitan
            then uses ``local x dp``, no accumulation; always so in 2024-12).
        dp_replicate, dp_shard, tp, cp, pp, ep, etp: the degrees as written
            (``dp_shard`` -1: the rest; :meth:`degrees` resolves it).
        pipeline_schedule: PyTorch's schedule name, canonical spelling.
        num_microbatches: micro-batches each local batch is split into by the
            pipeline schedule (1 without PP).
        stages_per_rank: model parts per pipeline rank (1 without PP).
        module_fqns_per_model_part: v0.2's explicit parts, or ``None``.
        pipeline_split_points: 2024-12's split points, or ``None``.
        pipeline_first_stage_less_layers, pipeline_last_stage_less_layers:
            v0.2's weights of the embedding and head in the default split
            (1 and 1).
        pipeline_layers_per_stage: v0.2's ``pipeline_parallel_layers_per_stage``.
        activation_checkpoint: ``"none"``, ``"selective"``, ``"full"`` or
            ``"memory_budget"``.
        selective_ac_option: with ``"selective"``, ``"op"`` or the period
            ``N`` of checkpointed blocks (every N-th; 0: every block); else
            ``None``.
        memory_budget: with ``"memory_budget"``, the compiler's budget.
        compile: the model's blocks are compiled; ``compile_loss``: the loss.
        float8: float8 linears (torchao); ``float8_recipe``: ``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"`` or (2024-12) ``"delayed"``;
            ``None`` without float8. ``float8_fsdp_all_gather``: FSDP gathers
            float8 weights (torchtitan uses it only with ``dp_shard > 1``).
        converters: v0.2's ``[model] converters``.
        dtype: ``"float32"`` or ``"bfloat16"`` (v0.2's ``[training] dtype``:
            bf16 weights without fp32 master copies).
        mixed_precision_param, mixed_precision_reduce: FSDP's dtypes.
        fsdp_reshard_after_forward: ``"default"``, ``"always"`` or ``"never"``.
        async_tp: async tensor parallelism (at TP > 1, compiled).
        cp_rotate_method: ``"allgather"`` or ``"alltoall"``.
        cpu_offload: FSDP offloads parameters, gradients and optimizer state.
        ignored: the keys not read (``[section] key = value``, with a reason
            where it is not bookkeeping).
    """

    source: str
    schema: str
    model_name: str
    flavor: str
    model: TorchtitanModel
    seq_len: int
    local_batch_size: int
    global_batch_size: int | None
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    pipeline_schedule: str = "1F1B"
    num_microbatches: int = 1
    stages_per_rank: int = 1
    module_fqns_per_model_part: tuple[tuple[str, ...], ...] | None = None
    pipeline_split_points: tuple[str, ...] | None = None
    pipeline_first_stage_less_layers: int = 1
    pipeline_last_stage_less_layers: int = 1
    pipeline_layers_per_stage: int | None = None
    activation_checkpoint: str = "selective"
    selective_ac_option: str | int | None = 2
    memory_budget: float | None = None
    compile: bool = False
    compile_loss: bool = False
    float8: bool = False
    float8_recipe: str | None = None
    float8_fsdp_all_gather: bool = False
    converters: tuple[str, ...] = ()
    dtype: str = "float32"
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    fsdp_reshard_after_forward: str = "default"
    async_tp: bool = False
    cp_rotate_method: str = "allgather"
    cpu_offload: bool = False
    ignored: tuple[str, ...] = ()

    @property
    def spec(self) -> TransformerSpec:
        """The model's :class:`~pipedejavu.core.transformer.TransformerSpec`."""
        return self.model.spec

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch (the local batch without PP)."""
        return self.local_batch_size // self.num_microbatches

    def degrees(self, num_gpus: int) -> TorchtitanDegrees:
        """The degrees on ``num_gpus`` GPUs, ``data_parallel_shard_degree``
        -1 resolved as torchtitan's ``ParallelDims`` resolves it.

        Raises:
            ProblemError: the degrees do not multiply to ``num_gpus``, the
                expert block ``ETP x EP`` does not divide ``dp_shard x cp x
                tp``, or replication without sharding (DDP) beside another
                parallelism (torchtitan's ``parallelize`` raises).
        """
        if not isinstance(num_gpus, int) or isinstance(num_gpus, bool):
            raise ProblemError(f"the GPU count must be an integer, got {num_gpus!r}")
        if num_gpus < 1:
            raise ProblemError(f"the GPU count must be positive, got {num_gpus}")
        rest = self.dp_replicate * self.cp * self.tp * self.pp
        shard = num_gpus // rest if self.dp_shard == -1 else self.dp_shard
        said = f"-1 (the rest: {shard})" if self.dp_shard == -1 else str(shard)
        if shard < 1 or rest * shard != num_gpus:
            raise ProblemError(
                f"{self.source}: data_parallel_replicate_degree {self.dp_replicate} "
                f"x data_parallel_shard_degree {said} x context_parallel_degree "
                f"{self.cp} x tensor_parallel_degree {self.tp} x "
                f"pipeline_parallel_degree {self.pp} is {rest * shard}, not the "
                f"{num_gpus} GPUs (torchtitan's ParallelDims)"
            )
        degrees = TorchtitanDegrees(
            self.dp_replicate, shard, self.cp, self.tp, self.pp, self.ep, self.etp
        )
        if degrees.fsdp * self.tp % (self.etp * self.ep):
            raise ProblemError(
                f"{self.source}: expert_tensor_parallel_degree {self.etp} x "
                f"expert_parallel_degree {self.ep} does not divide "
                f"data_parallel_shard_degree {shard} x context_parallel_degree "
                f"{self.cp} x tensor_parallel_degree {self.tp} (torchtitan's "
                "efsdp mesh)"
            )
        if self.dp_replicate > 1 and degrees.fsdp == 1 and num_gpus > self.dp_replicate:
            raise ProblemError(
                f"{self.source}: data_parallel_replicate_degree "
                f"{self.dp_replicate} without sharding is DDP, which torchtitan "
                "refuses beside TP or PP (DDP has not supported > 1D parallelism)"
            )
        return degrees

    def global_batch(self, num_gpus: int) -> int:
        """Samples per step on ``num_gpus`` GPUs: ``global_batch_size``, or
        ``local x dp``.

        Raises:
            ProblemError: :meth:`degrees` refuses, or the global batch is not
                a multiple of ``local x dp`` (torchtitan's ``train.py``
                asserts it).
        """
        per_step = self.local_batch_size * self.degrees(num_gpus).dp
        if self.global_batch_size is None:
            return per_step
        if self.global_batch_size % per_step:
            raise ProblemError(
                f"{self.source}: [training] global_batch_size "
                f"{self.global_batch_size} is not a multiple of local_batch_size "
                f"{self.local_batch_size} x data-parallel degree "
                f"{per_step // self.local_batch_size} on {num_gpus} GPUs"
            )
        return self.global_batch_size

    def gradient_accumulation_steps(self, num_gpus: int) -> int:
        """Forward/backward passes of a local batch per optimizer step."""
        dp = self.degrees(num_gpus).dp
        return self.global_batch(num_gpus) // (self.local_batch_size * dp)


def read_torchtitan_job(
    path: str | os.PathLike, *, vocab_size: int | None = None
) -> TorchtitanJob:
    """The torchtitan job file at ``path`` (at most :data:`MAX_JOB_FILE_BYTES`).

    Args:
        path: the ``.toml`` file.
        vocab_size: the tokenizer's vocabulary where torchtitan takes it from
            the tokenizer (2024-12; ``None``: Llama 3's 128,256).

    Raises:
        ProblemError: one line naming the file: unreadable, too large, not
            TOML, or a job torchtitan refuses or this reader does not model
            (module docstring).
    """
    text = read_text(
        path, MAX_JOB_FILE_BYTES, "torchtitan job file", fifo_wait_s=MODEL_FIFO_WAIT_S
    )
    return parse_torchtitan_job(text, os.fspath(path), vocab_size=vocab_size)


def parse_torchtitan_job(
    text: str, source: str = "torchtitan job", *, vocab_size: int | None = None
) -> TorchtitanJob:
    """A torchtitan job file's text as a :class:`TorchtitanJob`
    (:func:`read_torchtitan_job`; ``source`` names it in messages)."""
    data = parse_toml(text, source)
    values, sections = flatten(data, source)
    table = JobTable(values, sections, source, detect_schema(values, sections, source))
    return _read(table, vocab_size)


# Where each setting both schemas have lives: (section, key).
_WHERE = {
    "v0.2": {
        "batch": ("training", "local_batch_size"),
        "compile": ("compile", "enable"),
        "async": ("parallelism", "enable_async_tensor_parallel"),
        **{
            name: ("parallelism", key)
            for name, key in (
                ("dp_replicate", "data_parallel_replicate_degree"),
                ("dp_shard", "data_parallel_shard_degree"),
                ("tp", "tensor_parallel_degree"),
                ("cp", "context_parallel_degree"),
                ("pp", "pipeline_parallel_degree"),
                ("schedule", "pipeline_parallel_schedule"),
                ("csv", "pipeline_parallel_schedule_csv"),
                ("rotate", "context_parallel_rotate_method"),
            )
        },
    },
    "2024-12": {
        "batch": ("training", "batch_size"),
        "compile": ("training", "compile"),
        "async": ("experimental", "enable_async_tensor_parallel"),
        **{
            name: (section, key)
            for name, section, key in (
                ("dp_replicate", "training", "data_parallel_replicate_degree"),
                ("dp_shard", "training", "data_parallel_shard_degree"),
                ("tp", "training", "tensor_parallel_degree"),
                ("cp", "experimental", "context_parallel_degree"),
                ("pp", "experimental", "pipeline_parallel_degree"),
                ("schedule", "experimental", "pipeline_parallel_schedule"),
                ("csv", "experimental", "pipeline_parallel_schedule_csv"),
                ("rotate", "experimental", "context_parallel_rotate_method"),
            )
        },
    },
}


def _read(table: JobTable, vocab_size: int | None) -> TorchtitanJob:
    where, new = _WHERE[table.schema], table.schema == "v0.2"
    fields: dict[str, Any] = {
        "seq_len": table.integer("training", "seq_len", 2048),
        "local_batch_size": table.integer(*where["batch"], 8),
        "cpu_offload": table.flag("training", "enable_cpu_offload"),
        "cp_rotate_method": table.choice(
            *where["rotate"], "allgather", ("allgather", "alltoall")
        ),
    }
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp"):
        also = (-1,) if name == "dp_shard" else ()
        default = -1 if name == "dp_shard" else 1
        fields[name] = table.integer(
            *where[name], default, limit=_DEGREE_LIMIT, also=also
        )
    extra: list[str] = []
    fields.update(settings_v02(table, extra) if new else settings_2024_12(table, extra))
    fields["async_tp"] = table.flag(*where["async"])
    if not new and not table.has("model", "name"):
        raise ProblemError(
            f"{table.source}: no [model] name, and torchtitan 9dec370's default "
            "'llama' is not one of its models (give name = \"llama3\")"
        )
    name = table.text("model", "name", "llama3")
    flavor = table.text("model", "flavor", "debugmodel")
    model = torchtitan_model(
        name,
        flavor,
        schema=table.schema,
        seq_len=fields["seq_len"],
        source=table.source,
        vocab_size=vocab_size,
    )
    extra += model.notes
    check_parallelism(table, model, fields, extra)
    fields.update(pipeline_settings(table, model, fields, where))
    overlap = new and table.flag(
        "parallelism", "pipeline_parallel_expert_parallel_overlap", True
    )
    dual = fields["pipeline_schedule"] == "DualPipeV" and fields["pp"] > 1
    fields.update(
        checkpointing_settings(
            table, fields["compile"], dual and overlap and fields.get("ep", 1) > 1
        )
    )
    return TorchtitanJob(
        source=table.source,
        schema=table.schema,
        model_name=name,
        flavor=flavor,
        model=model,
        ignored=table.ignored() + tuple(extra),
        **fields,
    )
