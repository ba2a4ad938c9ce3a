"""The published mixture-of-experts runs on H100, predicted as launched.

Each run of ``moe_h100.json`` (:func:`~pipedejavu.planning.published_runs.
load_moe_published_runs`) is read into the :class:`~pipedejavu.io.megatron_args.
MegatronRun` its recipe launches (model, TP, PP, virtual chunks, EP, expert TP,
micro and global batch, precision, sequence parallelism, TP-communication
overlap, recomputation with its modules, dispatcher, all-to-all overlap) and
predicted by
:func:`~pipedejavu.planning.megatron_launch.predict_megatron_run` on ``H100``
nodes of 8, as ``predict --megatron-args`` predicts a launch. Only the three
:data:`MOE_FIELDS` are fitted on them (:func:`fit_moe_constants`; the
benchmark reports the leave-one-out error); every other constant was fitted
before, on the dense profiles and the published dense runs.

What the records set that the prediction does not see (each said in the run's
``notes``): Megatron-FSDP (priced as the distributed optimizer it extends),
CUDA graphs (but that Megatron-Core does not recompute the pre-MLP norm of a
``layernorm`` run whose router's CUDA graph is captured without the
alltoall dispatcher), and routing other than balanced (the benchmarks force
balanced routing; the others run with an auxiliary loss close to it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json
from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.training_options import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE_MODULES,
)
from pipedejavu.costmodel.analytical.roofline import (
    HALF_PRECISION_ANALYTICAL,
    AnalyticalConstants,
)
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import MegatronRun
from pipedejavu.io.megatron_layout import split_pipeline
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.planning.megatron_launch import (
    LaunchPrediction,
    expert_layers,
    options_of_run,
    predict_megatron_run,
)
from pipedejavu.planning.published_runs import (
    MAX_PUBLISHED_FILE_BYTES,
    MoePublishedRun,
    bundled_moe_published_path,
    load_moe_published_runs,
)

__all__ = [
    "MOE_FIELDS",
    "MoeRunPrediction",
    "fit_moe_constants",
    "launch_of_moe_run",
    "moe_launches",
    "moe_leave_one_out",
    "predict_moe_published",
    "predicted_tokens",
]

#: The GPU type of every run (DGX-H100: 8 SXM GPUs a node).
GPU = "H100"


@dataclasses.dataclass(frozen=True)
class MoeRunPrediction:
    """One published run and its prediction.

    Attributes:
        run: the published run.
        launch: its prediction (``None`` where the run is refused: ``refused``).
        published_tokens_per_s_per_gpu: as published, or from the published
            step time (``global batch x sequence / (time x GPUs)``), or from
            the published TFLOP/s and the model FLOPs per token.
        refused: why the run is not predicted (``None``: it is).
        notes: what of the run the prediction does not see.
    """

    run: MoePublishedRun
    launch: LaunchPrediction | None
    published_tokens_per_s_per_gpu: float
    refused: str | None
    notes: tuple[str, ...]

    @property
    def predicted_tokens_per_s_per_gpu(self) -> float | None:
        if self.launch is None:
            return None
        tokens = self.launch.plan.gbs * self.run.spec.seq_length
        time = self.launch.prediction.iteration_time_s
        return tokens / (time * self.run.num_gpus)

    @property
    def error(self) -> float | None:
        """Predicted over published tokens/s per GPU, less one."""
        predicted = self.predicted_tokens_per_s_per_gpu
        if predicted is None:
            return None
        return predicted / self.published_tokens_per_s_per_gpu - 1.0


def _published_tokens(run: MoePublishedRun) -> float:
    if run.tokens_per_s_per_gpu is not None:
        return run.tokens_per_s_per_gpu
    tokens = run.global_batch * run.spec.seq_length
    if run.iteration_time_s is not None:
        return tokens / (run.iteration_time_s * run.num_gpus)
    flops = run.spec.model_flops_per_iteration(run.global_batch) / tokens
    return run.tflops_per_gpu * 1e12 / flops


def launch_of_moe_run(
    run: MoePublishedRun, record: Mapping[str, Any]
) -> tuple[MegatronRun, tuple[str, ...]]:
    """The Megatron-LM launch a published record describes, and the notes on
    what of it the prediction does not see (module doc).

    Raises:
        ProblemError: a field the launch needs is missing or not understood.
    """
    par = record.get("parallelism") or {}
    precision = str(record.get("precision", ""))
    notes = []
    fp8 = precision.lower().startswith("fp8")
    granularity = par.get("recompute_granularity")
    text = str(par.get("recompute") or "")
    if granularity is None:
        granularity = "full" if text.startswith("full") else None
        granularity = "selective" if text.startswith("selective") else granularity
    modules = _recompute_modules(run, par.get("recompute_modules"), text)
    if par.get("fsdp"):
        notes.append("Megatron-FSDP priced as the distributed optimizer")
    graphs = par.get("cuda_graph") or par.get("cuda_graph_scope")
    dispatcher = str(par.get("moe_dispatcher") or "alltoall").split("/")[0]
    if graphs:
        notes.append(f"CUDA graphs ({graphs}) not priced")
        # TransformerLayer: no pre-MLP norm recomputation under the router's
        # graph unless its preprocessing is graphed with alltoall
        scope = str(graphs)
        router = "moe_router" in scope and "local" not in scope
        kept = dispatcher == "alltoall" and "moe_preprocess" in scope
        if router and not kept and "layernorm" in modules and run.spec.mla is None:
            modules = tuple(m for m in modules if m != "layernorm")
            notes.append(
                "layernorm not recomputed under the router's CUDA graph "
                "(Megatron-Core turns it off)"
            )
    if granularity == "selective" and not modules:
        granularity, modules = None, DEFAULT_RECOMPUTE_MODULES
    sequence_parallel = bool(par.get("sequence_parallel")) and run.tp > 1
    # the ModelZoo launcher adds --tp-comm-overlap with PR=bf16 (its note)
    launcher = str(((record.get("source") or {}).get("launcher") or {}).get("note"))
    tp_comm_overlap = sequence_parallel and (
        "--tp-comm-overlap" in precision
        or (not fp8 and "PR=bf16 adds --tp-comm-overlap" in launcher)
    )
    if dispatcher not in ("alltoall", "allgather", "flex"):
        raise ProblemError(f"{run.run_id}: dispatcher {dispatcher!r} not understood")
    options = MoeOptions(
        dispatcher=dispatcher,
        grouped_gemm=True,
        force_load_balancing=True,
        overlap_dispatch=bool(par.get("moe_a2a_overlap")),
    )
    chunks = run.virtual_chunks or 1
    # Qwen3-235B's 94 layers: the recipes count the embedding and the loss
    # in the split (--account-for-embedding/loss-in-pipeline-split)
    counted = run.spec.num_layers % (run.pp * chunks) != 0
    _, stage_layers = split_pipeline(
        run.spec.num_layers,
        run.pp,
        embedding=counted,
        loss=counted,
        chunks_per_rank=chunks if chunks > 1 else None,
    )
    return (
        MegatronRun(
            spec=run.spec,
            stage_layers=stage_layers,
            tp=run.tp,
            pp=run.pp,
            virtual_chunks=chunks,
            micro_batch=run.micro_batch,
            global_batch=run.global_batch,
            sequence_parallel=sequence_parallel,
            tp_comm_overlap=tp_comm_overlap,
            recompute_granularity=granularity,
            recompute_method="uniform" if granularity == "full" else None,
            recompute_num_layers=1 if granularity == "full" else None,
            recompute_modules=modules,
            precision="fp8" if fp8 else "bf16",
            params_dtype="bf16",
            use_distributed_optimizer=bool(par.get("distributed_optimizer", True)),
            padded_vocab_size=run.spec.padded_vocab_size(run.tp),
            grad_reduce_in_bf16=False,
            ep=run.ep,
            etp=run.etp,
            moe_options=options,
            fp8_recipe="tensorwise" if fp8 else None,
        ),
        tuple(notes),
    )


def _recompute_modules(run: MoePublishedRun, listed: Any, text: str) -> tuple[str, ...]:
    """The modules a record recomputes selectively: its ``recompute_modules``,
    else those its ``recompute`` text names (``"selective: layernorm,
    moe_act ('norm, act')"``), else Megatron-Core's default."""
    if not listed:
        named = text.partition(":")[2].partition("(")[0]
        listed = [m.strip() for m in named.split(",") if m.strip()]
    listed = tuple(str(m) for m in listed) or DEFAULT_RECOMPUTE_MODULES
    unknown = [m for m in listed if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ProblemError(
            f"{run.run_id}: recompute module {unknown[0]!r} not understood"
        )
    return tuple(m for m in RECOMPUTE_MODULES if m in listed)


def _records(path: Path) -> list[Mapping[str, Any]]:
    data = read_json(path, MAX_PUBLISHED_FILE_BYTES, "published runs file")
    return list(data["runs"])


def predict_moe_published(
    path: str | None = None,
    sheet: Mapping[str, GpuSheetEntry] | None = None,
    runs: Sequence[int] | None = None,
) -> list[MoeRunPrediction]:
    """Every run of the MoE file (default: the bundled ``moe_h100.json``),
    predicted as launched (module doc); ``runs``: their indices (``None``:
    all)."""
    file = bundled_moe_published_path() if path is None else Path(path)
    published = load_moe_published_runs(str(file))
    records = _records(file)
    sheet = load_gpu_sheet() if sheet is None else sheet
    out = []
    for index, (run, record) in enumerate(zip(published, records, strict=True)):
        if runs is not None and index not in runs:
            continue
        tokens = _published_tokens(run)
        try:
            launch_run, notes = launch_of_moe_run(run, record)
            launch = predict_megatron_run(launch_run, GPU, run.num_gpus, sheet)
        except ProblemError as refused:
            out.append(MoeRunPrediction(run, None, tokens, str(refused), ()))
            continue
        out.append(MoeRunPrediction(run, launch, tokens, None, notes))
    return out


#: The constants fitted on these runs (:func:`fit_moe_constants`): the
#: all-to-alls' share of the links, the share of them overlap hides, and the
#: seconds each expert block pass adds.
MOE_FIELDS = ("alltoall_efficiency", "alltoall_hidden", "expert_block_overhead_s")
#: Bounds of the fit (the overhead in milliseconds).
_LOWER, _UPPER = (0.05, 0.0, 0.0), (1.0, 1.0, 5.0)


def _with(base: AnalyticalConstants, x: Sequence[float]) -> AnalyticalConstants:
    values = dict(zip(MOE_FIELDS, (x[0], x[1], x[2] * 1e-3), strict=True))
    return dataclasses.replace(base, **values)


def moe_launches(
    path: str | None = None,
) -> list[tuple[MoePublishedRun, MegatronRun, float]]:
    """``(run, launch, published tokens/s per GPU)`` of every run of the file
    (default: the bundled ``moe_h100.json``)."""
    file = bundled_moe_published_path() if path is None else Path(path)
    published = load_moe_published_runs(str(file))
    out = []
    for run, record in zip(published, _records(file), strict=True):
        launch, _ = launch_of_moe_run(run, record)
        out.append((run, launch, _published_tokens(run)))
    return out


def predicted_tokens(
    launches: Sequence[tuple[MoePublishedRun, MegatronRun, float]],
    constants: AnalyticalConstants,
    sheet: Mapping[str, GpuSheetEntry],
) -> NDArray[np.float64]:
    """f64[R] tokens/s per GPU of each launch with ``constants``."""
    out = []
    for run, launch, _ in launches:
        source = AnalyticalSource(
            launch.spec,
            sheet,
            options_of_run(launch),
            constants=constants,
            experts=expert_layers(launch),
        )
        time = predict_megatron_run(
            launch, GPU, run.num_gpus, sheet, source=source
        ).prediction.iteration_time_s
        out.append(launch.global_batch * run.spec.seq_length / (time * run.num_gpus))
    return np.asarray(out, dtype=np.float64)


def fit_moe_constants(
    launches: Sequence[tuple[MoePublishedRun, MegatronRun, float]],
    sheet: Mapping[str, GpuSheetEntry],
    base: AnalyticalConstants = HALF_PRECISION_ANALYTICAL,
) -> AnalyticalConstants:
    """:data:`MOE_FIELDS` fitted to ``launches``' published tokens/s per GPU
    (least squares on the log ratio, a soft-L1 loss so that one run the model
    cannot explain does not set the constants)."""
    published = np.array([tokens for *_, tokens in launches])

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.log(predicted_tokens(launches, _with(base, x), sheet) / published)

    fit = least_squares(
        residuals,
        x0=[0.7, 0.5, 0.5],
        bounds=(_LOWER, _UPPER),
        loss="soft_l1",
        f_scale=0.1,
        diff_step=1e-2,
    )
    return _with(base, [round(float(v), 4) for v in fit.x])


def moe_leave_one_out(
    path: str | None = None,
    sheet: Mapping[str, GpuSheetEntry] | None = None,
    base: AnalyticalConstants = HALF_PRECISION_ANALYTICAL,
) -> tuple[NDArray[np.float64], list[AnalyticalConstants]]:
    """Each run's error (predicted / published tokens/s per GPU, less one)
    with :data:`MOE_FIELDS` fitted on the other runs, and those fits."""
    sheet = load_gpu_sheet() if sheet is None else sheet
    launches = moe_launches(path)
    errors, fits = [], []
    for k, item in enumerate(launches):
        others = [x for i, x in enumerate(launches) if i != k]
        constants = fit_moe_constants(others, sheet, base)
        predicted = predicted_tokens([item], constants, sheet)[0]
        errors.append(predicted / item[2] - 1.0)
        fits.append(constants)
    return np.asarray(errors, dtype=np.float64), fits
