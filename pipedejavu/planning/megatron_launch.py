"""A Megatron-LM launch as a plan, and its prediction on any GPU.

:func:`plan_from_megatron_run` turns a
:class:`~pipedejavu.io.megatron_args.MegatronRun` and a GPU pool into the
:class:`~pipedejavu.core.plan3d.Plan3D` Megatron-LM would run: ``PP`` stages of
``L / PP`` transformer layers each, or the run's uneven split (the embedding on
the first, the final norm and LM head on the last), ``DP = GPUs / (TP x PP)``
replicas, placed in Megatron's rank order (by default TP fastest, then DP,
then PP: rank ``tp_rank + TP (dp_rank + DP pp_rank)``; with
``--use-tp-pp-dp-mapping`` PP before DP: ``tp_rank + TP (pp_rank + PP
dp_rank)``; node ``rank // gpus_per_node``), and the
:class:`~pipedejavu.core.training_options.TrainingOptions` of the run.

A context-parallel run (``--context-parallel-size CP``) is a plan of layout
``cp = CP``, priced on a cost source of ``1 / CP`` of each sequence as its
sequence shares (:func:`~pipedejavu.core.placement.sequence_shares`): each of
the ``CP`` GPUs of a sequence a data-parallel replica of its own, whose
attention reads the whole sequence's keys and values.

:func:`predict_megatron_run` prices it with an
:class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource` and reports
what a user compares with their logs: iteration time, memory, model FLOPs
(the forward and backward passes, as Megatron-LM logs them:
:meth:`~pipedejavu.core.transformer.TransformerSpec.model_flops_per_iteration`)
with their TFLOP/s per GPU and model FLOPs utilization (MFU), and the hardware
FLOPs (recomputed forwards included, as SC'21 counts them:
:meth:`~pipedejavu.core.transformer.TransformerSpec.hardware_flops_per_iteration`)
with their TFLOP/s and hardware FLOPs utilization (HFU). Without
recomputation the two are equal; with it a slower plan can show a higher HFU,
never a higher MFU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import (
    Plan3D,
    Stage3D,
    canonical_nodes,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import ReplicaRow, replica_of
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.source import AnalyticalSource, gemm_precision
from pipedejavu.costmodel.megatron.interleaving import chunk_layers
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.rules import recomputed_layers
from pipedejavu.costmodel.megatron.sailor_data import ModelInfo
from pipedejavu.costmodel.megatron.sheet_network import sheet_entry
from pipedejavu.io.megatron_args import MegatronRun
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.planning.expert_search import layers_of

__all__ = [
    "sheet_gpu",
    "FLOPS_FORMULA",
    "LaunchPrediction",
    "check_whole_microbatches",
    "launch_batch",
    "options_of_run",
    "plan_from_megatron_run",
    "plan_flops",
    "plan_utilization",
    "predict_megatron_run",
    "rerun_blocks",
    "utilization",
]


def options_of_run(run: MegatronRun) -> TrainingOptions:
    """The training options of a Megatron-LM run.

    Full recomputation with the ``uniform`` method recomputes every layer
    (each checkpointed group is recomputed before its backward); the ``block``
    method recomputes the first ``--recompute-num-layers`` of each stage;
    selective recomputation the run's ``--recompute-modules``.
    """
    recompute = run.recompute_granularity or "none"
    layers = None
    if recompute == "full" and run.recompute_method == "block":
        layers = run.recompute_num_layers
    return TrainingOptions(
        precision=run.precision,
        distributed_optimizer=run.use_distributed_optimizer,
        recompute=recompute,
        recompute_num_layers=layers,
        virtual_stages=run.virtual_chunks,
        sequence_parallel=run.sequence_parallel,
        flash_attention=run.flash_attention,
        attention_dropout=run.attention_dropout and not run.flash_attention,
        overlap_grad_reduce=run.overlap_grad_reduce,
        overlap_param_gather=run.overlap_param_gather,
        grad_reduce_in_bf16=run.grad_reduce_in_bf16,
        tp_comm_overlap=run.tp_comm_overlap,
        recompute_modules=run.recompute_modules,
        zero_stage=run.zero_stage,
    )


def plan_from_megatron_run(
    run: MegatronRun, gpu_type: str, num_gpus: int, gpus_per_node: int
) -> Plan3D:
    """The plan Megatron-LM runs for ``run`` on ``num_gpus`` GPUs (module doc).

    Raises:
        ProblemError: the GPUs do not split into ``TP x PP`` groups, the global
            batch does not split into micro-batches per replica, or the layers
            do not split over the stages as the run says.
    """
    tp, pp, cp = run.tp, run.pp, run.context_parallel
    if num_gpus % (tp * cp * pp):
        raise ProblemError(
            f"{num_gpus} GPUs do not split into groups of TP x "
            f"{'CP x ' if cp > 1 else ''}PP = {tp} x {f'{cp} x ' if cp > 1 else ''}"
            f"{pp}"
        )
    dp = num_gpus // (tp * cp * pp)
    gbs = launch_batch(run, dp)
    if tp > gpus_per_node or gpus_per_node % tp:
        raise ProblemError(
            f"TP {tp} does not fit the {gpus_per_node} GPUs of a {gpu_type} node"
        )
    spec = run.spec
    counts = run.stage_layers or (spec.num_layers // pp,) * pp
    if len(counts) != pp or sum(counts) != spec.num_layers:
        raise ProblemError(
            f"{spec.num_layers} layers do not split into {pp} pipeline stages "
            f"of {list(counts)}"
        )
    last = spec.num_profile_layers
    # each replica's first GPU (a replica holds tp x cp of them)
    nodes = canonical_nodes([tp * cp] * pp, dp, gpus_per_node, run.rank_order)
    stages = []
    for s in range(pp):
        start = 0 if s == 0 else 1 + sum(counts[:s])
        stop = last if s == pp - 1 else 1 + sum(counts[: s + 1])
        replicas = ReplicaRow(replica_of(gpu_type, tp), nodes[s])
        stages.append(Stage3D(start, stop, replicas))
    # The run's layout, Megatron Core's checks with it (the predictor prices a
    # context-parallel plan as its sequence shares).
    return Plan3D(
        tuple(stages),
        mbs=run.micro_batch,
        gbs=gbs,
        model=spec.name,
        layout=run.layout(num_gpus),
    )


@dataclasses.dataclass(frozen=True)
class LaunchPrediction:
    """A predicted launch.

    Attributes:
        plan: the plan Megatron-LM runs.
        options: its training options.
        prediction: the predictor's answer.
        model_flops_per_iteration: model FLOPs, no recomputation
            (Megatron-LM's logged count; MFU's numerator).
        cost_source: ``profiles``, ``analytical`` or ``mixed``.
        peak_flops_per_gpu: the GPU's dense peak at the GEMMs' precision.
        context_parallel: GPUs sharing each sequence (``plan.layout.cp``;
            the predictor prices them as sequence shares).
        hardware_flops_per_iteration: the model FLOPs plus the forwards that
            recomputation reruns (SC'21's count; HFU's numerator); ``None``:
            the model FLOPs (nothing recomputed).
        experts: how a mixture of experts' expert layers were priced
            (``None``: a dense model).
    """

    plan: Plan3D
    options: TrainingOptions
    prediction: Prediction
    model_flops_per_iteration: float
    cost_source: str
    peak_flops_per_gpu: float
    context_parallel: int = 1
    hardware_flops_per_iteration: float | None = None
    experts: ExpertLayers | None = None

    @property
    def experts_line(self) -> str | None:
        """One line on the expert layers: their layout and what the price
        assumes of the routing (``None`` for a dense model)."""
        if self.experts is None:
            return None
        experts, layout = self.experts.experts, self.plan.layout
        overlap = (
            " (all-to-alls beside compute)" if self.experts.overlap_dispatch else ""
        )
        return (
            f"experts: EP {experts.ep} x expert TP {layout.stages[0].expert_tp}, "
            f"expert DP {layout.edp(0)}; {experts.dispatcher} dispatcher{overlap}; "
            f"routing priced balanced (busiest expert x{experts.imbalance:g})"
        )

    @property
    def num_gpus(self) -> int:
        return self.plan.num_gpus

    @property
    def hardware_flops(self) -> float:
        """:attr:`hardware_flops_per_iteration`, the model FLOPs when unset."""
        hardware = self.hardware_flops_per_iteration
        return self.model_flops_per_iteration if hardware is None else hardware

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (as Megatron-LM logs them)."""
        return self._utilization(self.model_flops_per_iteration)[0]

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: model TFLOP/s per GPU over the dense peak."""
        return self._utilization(self.model_flops_per_iteration)[1]

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU, recomputation included (as SC'21
        reports them)."""
        return self._utilization(self.hardware_flops)[0]

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilization: hardware TFLOP/s over the dense peak."""
        return self._utilization(self.hardware_flops)[1]

    def _utilization(self, flops: float) -> tuple[float, float]:
        return utilization(
            flops,
            self.prediction.iteration_time_s,
            self.num_gpus,
            self.peak_flops_per_gpu,
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "model": self.plan.model,
            "plan": self.plan.describe(),
            "options": self.options.to_json(),
        }
        out.update(self.prediction.to_json())
        out.update(
            model_flops_per_iteration=self.model_flops_per_iteration,
            hardware_flops_per_iteration=self.hardware_flops,
            model_flops_formula=FLOPS_FORMULA,
            tflops_per_gpu=self.tflops_per_gpu,
            mfu=self.mfu,
            hardware_tflops_per_gpu=self.hardware_tflops_per_gpu,
            hfu=self.hfu,
            cost_source=self.cost_source,
            context_parallel=self.context_parallel,
        )
        if self.experts is not None:
            experts = self.experts.experts
            out["experts"] = {
                "ep": experts.ep,
                "etp": self.plan.layout.stages[0].expert_tp,
                "edp": self.plan.layout.edp(0),
                "dispatcher": experts.dispatcher,
                "grouped_gemm": experts.grouped_gemm,
                "overlap_dispatch": self.experts.overlap_dispatch,
                "routing": "balanced",
                "imbalance": experts.imbalance,
            }
        return out


#: How the FLOPs are counted (``--json`` outputs carry it).
FLOPS_FORMULA = (
    "Narayanan et al., SC'21, Eq. 3, generalized to grouped-query attention and "
    "gated MLPs. Model FLOPs (tflops_per_gpu, mfu): forward and backward passes "
    "only, as Megatron-LM logs them; hardware FLOPs (hardware_tflops_per_gpu, "
    "hfu): plus the forward of every block full recomputation reruns (all, or "
    "the first N of each stage's model chunks with the block method), as SC'21 "
    "reports them"
)


def rerun_blocks(
    info: ModelInfo, plan: Plan3D, options: TrainingOptions, sizes: tuple[int, ...] = ()
) -> int | None:
    """How many blocks rerun their forward under ``options``' full
    recomputation (the model FLOPs count them): ``None`` for all of them;
    with Megatron's ``block`` method the first blocks of each stage or model
    chunk that :func:`~pipedejavu.costmodel.megatron.rules.recomputed_layers`
    reruns (``sizes``: a layout's virtual stages, ``chunk_layers``)."""
    if options.recompute != "full" or info.recompute_layers is None:
        return None
    chunks = options.virtual_stages
    if chunks > 1:
        rows = chunk_layers(plan, chunks, sizes=sizes or None)
        spans = [span for row in rows for span in row]
    else:
        spans = [(stage.start, stage.stop) for stage in plan.stages]
    starts, stops = (np.array(column) for column in zip(*spans, strict=True))
    first, end = recomputed_layers(info, starts, stops)
    return int(np.sum(end - first))


def predict_megatron_run(
    run: MegatronRun,
    gpu_type: str,
    num_gpus: int,
    sheet: Mapping[str, GpuSheetEntry],
    *,
    source: AnalyticalSource | None = None,
    memory_headroom: MemoryHeadroom | None = None,
) -> LaunchPrediction:
    """Predict a Megatron-LM launch on ``num_gpus`` GPUs of ``gpu_type``.

    Args:
        run: the parsed command line.
        gpu_type: a GPU type of ``sheet``.
        num_gpus: GPUs of the launch.
        sheet: the GPU sheet.
        source: the cost source (``None``: analytical on ``sheet`` for the
            run's options).
        memory_headroom: memory every GPU keeps free (``None``: the source's).

    Raises:
        ProblemError: the GPU type is unknown, or the launch cannot run.
    """
    gpu_type = sheet_gpu(sheet, gpu_type)
    _check_priced(run, gpu_type, sheet[gpu_type], num_gpus)
    options = options_of_run(run)
    cp = run.context_parallel
    # the costs of a sequence's share (the predictor prices the shares)
    share = dataclasses.replace(run.spec, seq_length=run.spec.seq_length // cp)
    if source is None:
        source = AnalyticalSource(
            share,
            sheet,
            options,
            context_parallel=cp,
            experts=expert_layers(run),
        )
    if memory_headroom is not None:
        source = source.with_memory_headroom(memory_headroom)
    entry = sheet[gpu_type]
    plan = plan_from_megatron_run(run, gpu_type, num_gpus, entry.gpus_per_node)
    sizes = run.virtual_stage_layers
    prediction = predict_plan(
        plan, source, virtual_stages=options.virtual_stages, chunk_sizes=sizes or None
    )
    model, hardware = plan_flops(run.spec, plan, options, source, sizes=sizes)
    cost_source = source.cost_source(plan)
    peak = entry.peak(gemm_precision(options, entry))
    return LaunchPrediction(
        plan,
        options,
        prediction,
        model,
        cost_source,
        peak,
        cp,
        hardware,
        getattr(source, "experts", None),
    )


def sheet_gpu(sheet: Mapping[str, GpuSheetEntry], gpu_type: str) -> str:
    """``gpu_type``'s name on ``sheet`` (a :class:`~pipedejavu.io.gpu_sheet.
    GpuSheet` resolves aliases).

    Raises:
        ProblemError: a type the sheet does not have (naming those it has).
    """
    resolve = getattr(sheet, "resolve", None)
    if resolve is not None and gpu_type in sheet:
        gpu_type = resolve(gpu_type)
    sheet_entry(sheet, gpu_type)
    return gpu_type


def _check_priced(
    run: MegatronRun, gpu_type: str, entry: GpuSheetEntry, num_gpus: int
) -> None:
    """Refuse, with one line, a launch the cost model cannot price yet: FP4
    (on a GPU without it, the refusal TE makes); and one Megatron Core
    refuses for its GPU count
    (:meth:`~pipedejavu.io.megatron_args.MegatronRun.layout`)."""
    if run.fp4_recipe is not None:
        if "fp4" not in entry.precisions:
            raise ProblemError(
                f"Megatron arguments: --fp4-format needs a GPU with FP4 tensor "
                f"cores (NVFP4: Blackwell); the GPU sheet gives {gpu_type} none"
            )
        raise ProblemError(
            f"Megatron arguments: FP4 training ({run.fp4_recipe}) is read but its "
            "pricing is not available yet"
        )
    spec = run.spec
    if spec.is_dense:
        return
    try:
        run.layout(num_gpus)
    except ProblemError as refused:
        raise ProblemError(
            f"Megatron arguments on {num_gpus} GPUs: {refused} (Megatron Core's "
            "initialize_model_parallel refuses it)"
        ) from None


def expert_layers(run: MegatronRun) -> ExpertLayers | None:
    """How the run's expert layers run, as the cost model reads it: its EP
    and expert-TP and the MoE switches it sets; routing balanced (what
    ``--moe-router-force-load-balancing`` makes so, and what the prediction
    assumes without it: the reports say so). ``None`` for a dense model."""
    if run.spec.moe is None:
        return None
    return layers_of(run.moe_options or MoeOptions(), run.ep, run.etp)


def plan_flops(
    spec: TransformerSpec,
    plan: Plan3D,
    options: TrainingOptions,
    source: Any,
    *,
    samples: int | None = None,
    sizes: tuple[int, ...] = (),
) -> tuple[float, float]:
    """``(model FLOPs, hardware FLOPs)`` of one iteration of ``plan``
    (:meth:`~pipedejavu.core.transformer.TransformerSpec.model_flops_per_iteration`;
    :meth:`~pipedejavu.core.transformer.TransformerSpec.hardware_flops_per_iteration`
    with the blocks ``options``' full recomputation reruns, all of them or
    those of the block method); ``samples``: the global batch (``None``: the
    plan's); ``sizes``: a layout's virtual stages (:func:`rerun_blocks`)."""
    samples = plan.gbs if samples is None else samples
    tp = plan.stages[0].replicas[0].tp
    rerun = 0
    if options.recompute == "full":
        rerun = rerun_blocks(source.model_info(plan.model), plan, options, sizes)
    return (
        spec.model_flops_per_iteration(samples, tp),
        spec.hardware_flops_per_iteration(samples, rerun, tp),
    )


def plan_utilization(
    spec: TransformerSpec,
    plan: Plan3D,
    options: TrainingOptions,
    source: Any,
    sheet: Mapping[str, GpuSheetEntry],
    iteration_time_s: float,
) -> dict[str, float]:
    """Model and hardware FLOPs per iteration, their TFLOP/s per GPU, MFU and
    HFU (over the dense peaks of the plan's GPUs at its GEMMs' precision,
    averaged over its GPUs) of a plan that takes ``iteration_time_s``, as
    :class:`LaunchPrediction` reports them."""
    model, hardware = plan_flops(spec, plan, options, source)
    peaks = sum(
        count * sheet[gpu].peak(gemm_precision(options, sheet[gpu]))
        for gpu, count in plan.gpus_by_type().items()
    )
    peak = peaks / plan.num_gpus
    tflops, mfu = utilization(model, iteration_time_s, plan.num_gpus, peak)
    hardware_tflops, hfu = utilization(hardware, iteration_time_s, plan.num_gpus, peak)
    return {
        "model_flops_per_iteration": float(model),
        "hardware_flops_per_iteration": float(hardware),
        "tflops_per_gpu": float(tflops),
        "mfu": float(mfu),
        "hardware_tflops_per_gpu": float(hardware_tflops),
        "hfu": float(hfu),
    }


def utilization(
    flops: float, seconds: float, num_gpus: int, peak_flops_per_gpu: float
) -> tuple[float, float]:
    """``(TFLOP/s per GPU, MFU)`` of ``flops`` model FLOPs in ``seconds`` on
    ``num_gpus`` GPUs of (mean) dense peak ``peak_flops_per_gpu``."""
    tflops = flops / (seconds * num_gpus) / 1e12
    return tflops, tflops * 1e12 / peak_flops_per_gpu


def launch_batch(run: MegatronRun, dp: int) -> int:
    """The launch's global batch on ``dp`` data-parallel replicas (Megatron's
    ``micro-batch x DP`` when it gives none).

    Raises:
        ProblemError: it does not split into micro-batches per replica.
    """
    gbs = run.global_batch if run.global_batch is not None else run.micro_batch * dp
    check_whole_microbatches(gbs, run.micro_batch, dp)
    return gbs


def check_whole_microbatches(gbs: int, mbs: int, dp: int) -> None:
    """Megatron-LM, DeepSpeed and torchtitan split the global batch into
    ``gbs / (mbs dp)`` whole micro-batches per pipeline; they refuse any other
    batch, and a plan priced with the count rounded up would train more
    samples than it says.

    Raises:
        ProblemError: ``gbs`` is not a multiple of ``mbs x dp``.
    """
    if gbs % (mbs * dp):
        count = -(-gbs // (mbs * dp))
        raise ProblemError(
            f"the global batch {gbs} is not a multiple of micro-batch x DP = "
            f"{mbs} x {dp} (rounded up to {count} micro-batches a pipeline it "
            f"would train {count * mbs * dp} samples): give a multiple"
        )
