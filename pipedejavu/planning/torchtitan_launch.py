"""A torchtitan job as a plan, and its prediction on any GPU.

:func:`plan_from_torchtitan_job` turns a
:class:`~pipedejavu.io.torchtitan_job.TorchtitanJob` and a GPU pool into what
torchtitan runs: its mesh ``pp, dp_replicate, dp_shard, cp, tp`` (TP fastest:
:data:`~pipedejavu.core.layout.PP_OUTER` with ``dp = dp_replicate x
dp_shard``, ``dp_shard`` the inner factor), and :func:`torchtitan_options`
the training options it runs with:

* **FSDP2** whenever ``dp_shard x cp > 1`` (torchtitan applies
  ``fully_shard`` over those GPUs; with ``dp_replicate > 1`` too, HSDP):
  ``zero_stage=3``, resharding after the forward as
  ``fsdp_reshard_after_forward`` says (``"default"``: except with PP);
  without it, plain data parallelism (DDP, alone) or none;
* **precision**: float8 linears: ``fp8``; else FSDP's
  ``mixed_precision_param`` ``bfloat16``: ``bf16``; ``float32``: ``fp32``;
  v0.2's ``dtype = "bfloat16"`` (bf16 weights without fp32 master copies)
  is refused (not priced);
* **recomputation**: ``full``: every block; ``selective`` ``"op"``:
  torchtitan's per-operation policy
  (:data:`~pipedejavu.core.training_options.TORCHTITAN_OP`); ``selective``
  ``N``: every ``N``-th block whole (``L // N`` of each stage's blocks,
  Megatron's count; ``0`` and ``1``: every block); ``memory_budget`` refused;
* **sequence parallelism** with every TP above 1 (torchtitan's ``apply_tp``);
* **context parallelism** priced as
  :func:`~pipedejavu.planning.megatron_launch.sequence_shares` prices
  Megatron-LM's: each of the ``cp`` GPUs of a sequence a replica on ``1 / cp``
  of it (its keys and values exchanged beside its attention), FSDP's shard
  group ``dp_shard x cp`` of them;
* **pipelines**: ``1F1B`` (and ``Interleaved1F1B`` without FSDP), the blocks
  split evenly with the embedding and the head counted as a layer of the
  first and last stage where the job says so (v0.2's default), as
  :func:`~pipedejavu.core.layout.split_blocks` splits them; explicit parts
  and split points are refused (not priced yet).

``torch.compile``: a compiled job's element-wise kernels are priced fused; an
eager job's blocks run them unfused, as eager PyTorch runs a Llama block
(:func:`~pipedejavu.costmodel.analytical.ops.eager_elementwise`: counted
kernel by kernel, not fitted). What the prediction does not price is said in
:attr:`TorchtitanPrediction.notes`: the loss and head of an eager job as
compiled, async TP, float8's FSDP all-gather, CP's rotate method (priced as
a ring beside the attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.layout import ParallelLayout, split_blocks
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import Plan3D, Stage3D, canonical_nodes
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import ReplicaRow, replica_of
from pipedejavu.core.training_options import TORCHTITAN_OP, TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.roofline import AnalyticalConstants
from pipedejavu.costmodel.analytical.source import AnalyticalSource, gemm_precision
from pipedejavu.costmodel.analytical.torchtitan_constants import (
    TORCHTITAN_ANALYTICAL,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.io.torchtitan_job import TorchtitanDegrees, TorchtitanJob
from pipedejavu.planning.megatron_launch import (
    LaunchPrediction,
    check_whole_microbatches,
    plan_flops,
    sheet_gpu,
)

__all__ = [
    "TorchtitanPrediction",
    "sharded_plan",
    "plan_from_torchtitan_job",
    "predict_torchtitan_job",
    "torchtitan_options",
]

#: The schedules priced, with FSDP (1F1B only) and without.
_SCHEDULES = ("1F1B", "Interleaved1F1B")


def _refuse(job: TorchtitanJob, why: str) -> ProblemError:
    return ProblemError(f"{job.source}: {why}")


def torchtitan_options(
    job: TorchtitanJob, degrees: TorchtitanDegrees
) -> TrainingOptions:
    """The training options torchtitan runs ``job`` with (module docstring).

    Raises:
        ProblemError: an option the cost model cannot price yet.
    """
    fsdp = degrees.fsdp > 1
    if job.cpu_offload:
        raise _refuse(job, "FSDP's CPU offload is not priced")
    if job.dtype != "float32":
        raise _refuse(
            job,
            f"[training] dtype {job.dtype!r} (weights without fp32 master "
            "copies) is not priced",
        )
    if job.float8:
        precision = "fp8"
    elif not fsdp and (degrees.tp > 1 or degrees.pp > 1):
        precision = "fp32"  # maybe_enable_amp: no autocast beside TP or PP
    else:  # FSDP's policy, or DDP's / one GPU's autocast
        precision = "bf16" if job.mixed_precision_param == "bfloat16" else "fp32"
    recompute, modules, layers = "none", TrainingOptions().recompute_modules, None
    mode, option = job.activation_checkpoint, job.selective_ac_option
    if mode == "memory_budget":
        raise _refuse(job, "[activation_checkpoint] mode 'memory_budget' is not priced")
    if mode == "full":
        recompute = "full"
    elif mode == "selective" and option == "op":
        recompute, modules = "selective", (TORCHTITAN_OP,)
    elif mode == "selective":
        period = int(option or 0)
        blocks = job.spec.num_layers // (degrees.pp * job.stages_per_rank)
        recompute = "full"
        if period > 1:
            layers = blocks // period
            recompute = "full" if layers else "none"
            layers = layers or None
    stages = job.stages_per_rank
    return TrainingOptions(
        precision=precision,
        recompute=recompute,
        recompute_num_layers=layers if recompute == "full" else None,
        recompute_modules=modules,
        virtual_stages=stages,
        sequence_parallel=degrees.tp > 1,
        flash_attention=True,
        zero_stage=3 if fsdp else 0,
        reshard_after_forward=not fsdp
        or {"always": True, "never": False}.get(
            job.fsdp_reshard_after_forward, degrees.pp == 1
        ),
    )


def plan_from_torchtitan_job(
    job: TorchtitanJob, gpu_type: str, num_gpus: int, gpus_per_node: int
) -> tuple[Plan3D, TrainingOptions, TorchtitanDegrees]:
    """The plan torchtitan runs for ``job`` on ``num_gpus`` GPUs, in the form
    the predictor prices (context parallelism as sequence shares: module
    docstring), its options and its degrees.

    Raises:
        ProblemError: the degrees do not fit the GPUs, or the job runs what
            is not priced yet (experts, explicit pipeline parts, a schedule
            other than 1F1B with FSDP...).
    """
    degrees = job.degrees(num_gpus)
    spec = job.spec
    if spec.moe is not None:
        raise _refuse(job, "mixtures of experts run by torchtitan are not priced yet")
    if job.model.attention != "sdpa":
        raise _refuse(
            job, f"attention {job.model.attention!r} (block-causal masks) is not priced"
        )
    options = torchtitan_options(job, degrees)
    tp, pp, cp, dp = degrees.tp, degrees.pp, degrees.cp, degrees.dp
    if tp > gpus_per_node or gpus_per_node % tp:
        raise _refuse(job, f"TP {tp} does not fit the {gpus_per_node} GPUs of a node")
    schedule = job.pipeline_schedule if pp > 1 else "1F1B"
    if schedule not in _SCHEDULES or (options.zero_stage == 3 and schedule != "1F1B"):
        raise _refuse(
            job,
            f"the pipeline schedule {schedule} is not priced "
            f"{'with FSDP ' if options.zero_stage == 3 else ''}yet (priced: "
            f"{'1F1B' if options.zero_stage == 3 else ', '.join(_SCHEDULES)})",
        )
    if job.module_fqns_per_model_part or job.pipeline_split_points:
        raise _refuse(job, "explicit pipeline parts are not priced yet")
    if job.seq_len % (2 * cp) if cp > 1 else False:
        raise _refuse(job, f"seq_len {job.seq_len} does not split over 2 x CP {cp}")
    parts = pp * job.stages_per_rank
    counted = pp > 1 and job.schema == "v0.2"
    embedding = counted and job.pipeline_first_stage_less_layers > 0
    loss = counted and job.pipeline_last_stage_less_layers > 0
    held = split_blocks(spec.num_layers, parts, embedding, loss)
    if held is None or min(held) < 1:
        raise _refuse(
            job,
            f"{spec.num_layers} blocks do not split evenly over {parts} pipeline "
            "parts (priced splits only)",
        )
    mbs = job.microbatch_size
    samples = job.global_batch(num_gpus)
    check_whole_microbatches(samples, mbs, dp)
    shard = degrees.dp_shard if options.zero_stage == 3 else None
    plan = sharded_plan(
        spec, gpu_type, held, mbs, samples, gpus_per_node,
        tp=tp, pp=pp, dp=dp, cp=cp, dp_shard=shard,
    )  # fmt: skip
    return plan, options, degrees


def sharded_plan(
    spec: TransformerSpec,
    gpu_type: str,
    blocks: Sequence[int],
    mbs: int,
    samples: int,
    gpus_per_node: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    cp: int = 1,
    dp_shard: int | None = None,
) -> Plan3D:
    """The plan of ``dp`` replicas of ``pp`` stages of ``tp x cp`` GPUs laid
    out as torchtitan's mesh (``pp, dp, cp, tp``, TP fastest: the layout's
    default order), with ``blocks`` the transformer blocks of each pipeline
    part in order (``pp x`` parts per rank; rank ``r`` holds parts ``r, r +
    pp, ...``), ``samples`` sequences per step and shard groups of
    ``dp_shard`` replicas (``None``: no sharding, or all of ``dp``)."""
    nodes = canonical_nodes([tp * cp] * pp, dp, gpus_per_node)
    stage_blocks = [sum(blocks[s::pp]) for s in range(pp)]
    stages, first = [], 0
    for s, count in enumerate(stage_blocks):
        start = 0 if s == 0 else 1 + first
        first += count
        stop = spec.num_profile_layers if s == pp - 1 else 1 + first
        row = ReplicaRow(replica_of(gpu_type, tp), nodes[s])
        stages.append(Stage3D(start, stop, row))
    layout = ParallelLayout.uniform(tp=tp, pp=pp, dp=dp, cp=cp, dp_shard=dp_shard)
    return Plan3D(tuple(stages), mbs=mbs, gbs=samples, model=spec.name, layout=layout)


@dataclasses.dataclass(frozen=True)
class TorchtitanPrediction:
    """A predicted torchtitan job: the launch prediction and what it does not
    price (:attr:`notes`, one phrase each)."""

    launch: LaunchPrediction
    degrees: TorchtitanDegrees
    notes: tuple[str, ...]
    tokens_per_s_per_gpu: float

    def to_json(self) -> dict:
        out = self.launch.to_json()
        out.update(
            degrees=dataclasses.asdict(self.degrees),
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
            not_priced=list(self.notes),
        )
        return out


def _notes(
    job: TorchtitanJob, degrees: TorchtitanDegrees, num_gpus: int, gpus_per_node: int
) -> tuple[str, ...]:
    notes = list(job.model.notes)
    if not job.compile:
        notes.append(
            "eager (no torch.compile): the blocks' unfused element-wise kernels "
            "counted, the loss's and the head's as compiled"
        )
    if job.async_tp:
        notes.append("async TP priced as plain TP")
    if job.float8_fsdp_all_gather:
        notes.append("FSDP's float8 all-gather priced in bf16")
    if (
        degrees.dp_replicate > 1
        and degrees.fsdp > 1
        and job.num_microbatches
        * (job.global_batch(num_gpus) // (job.local_batch_size * degrees.dp))
        > 1
    ):
        notes.append(
            "HSDP's all-reduce across groups priced once a step; torchtitan runs "
            "it every micro-batch"
        )
    if job.cp > 1 and job.tp * job.cp > gpus_per_node:
        notes.append(
            "CP's ring crosses nodes; its exchange priced on the node's links "
            "(underpriced)"
        )
    if job.cp > 1:
        notes.append(
            f"CP's {job.cp_rotate_method} key/value exchange priced as a ring "
            "beside the attention"
        )
    return tuple(notes)


def predict_torchtitan_job(
    job: TorchtitanJob,
    gpu_type: str,
    num_gpus: int,
    sheet: Mapping[str, GpuSheetEntry],
    *,
    constants: AnalyticalConstants = TORCHTITAN_ANALYTICAL,
    memory_headroom: MemoryHeadroom | None = None,
) -> TorchtitanPrediction:
    """Predict ``job`` on ``num_gpus`` GPUs of ``gpu_type`` with
    ``constants`` (torchtitan's by default:
    :mod:`~pipedejavu.costmodel.analytical.torchtitan_constants`).

    Raises:
        ProblemError: an unknown GPU type, or as :func:`plan_from_torchtitan_job`.
    """
    gpu_type = sheet_gpu(sheet, gpu_type)
    entry = sheet[gpu_type]
    plan, options, degrees = plan_from_torchtitan_job(
        job, gpu_type, num_gpus, entry.gpus_per_node
    )
    cp = degrees.cp
    share = dataclasses.replace(job.spec, seq_length=job.seq_len // cp)
    source = AnalyticalSource(
        share,
        sheet,
        options,
        context_parallel=cp,
        constants=constants,
        eager=not job.compile,
    )
    if memory_headroom is not None:
        source = source.with_memory_headroom(memory_headroom)
    prediction = predict_plan(plan, source, virtual_stages=options.virtual_stages)
    samples = plan.gbs
    model, hardware = plan_flops(job.spec, plan, options, source)
    peak = entry.peak(gemm_precision(options, entry))
    launch = LaunchPrediction(
        plan,
        options,
        prediction,
        model,
        source.cost_source(plan),
        peak,
        cp,
        hardware,
    )
    tokens = samples * job.seq_len / prediction.iteration_time_s / num_gpus
    notes = _notes(job, degrees, num_gpus, entry.gpus_per_node)
    return TorchtitanPrediction(launch, degrees, notes, tokens)
