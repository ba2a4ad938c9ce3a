"""Published large-model runs: predicted, and the 16-bit constants fitted on them.

The bundled profiles are fp32 and TF32 (Sailor's Megatron-DeepSpeed runs), so
they say nothing about 16-bit tensor-core GEMMs or Megatron-LM's fused
kernels. For 16-bit training the roofline's constants therefore come from
two other sources:

* the best tensor-core efficiency of a large GEMM (``tensor_efficiency``)
  from measured bf16 GEMMs: 288 Megatron-shaped GEMMs timed on an H200
  (``benchmarks/results/gpu_fp8_gemms.json``), fitted on every other one by
  :func:`fit_tensor_efficiency` (:data:`~pipedejavu.costmodel.analytical.
  roofline.MEASURED_TENSOR_EFFICIENCY`; the held-out half's error is in
  ``tests/test_published_runs.py``);
* three constants of the kernels around the GEMMs (:data:`FITTED_FIELDS`:
  the memory-bound kernels' bandwidth share, forward and backward, and the
  share of the intra-node link a tensor-parallel collective reaches) fitted
  on the *visible* published runs (``pipedejavu/data/published/
  megatron_sc21_table1.json``: Megatron-LM SC'21 Table 1, GPT 1.7B-1T on
  32-3,072 A100-80GB);

every other constant keeps its value fitted on the profiles.
:data:`~pipedejavu.costmodel.analytical.roofline.HALF_PRECISION_ANALYTICAL`
holds the fit on all ten runs; :func:`leave_one_out` refits without each run
and predicts it, the error to quote.

Each run is launched as its authors' script launched it: the model, TP, PP,
interleaving, micro/global batch, fp16, full recomputation of every layer, and
unfused attention (2021's Megatron-LM had no flash attention; its attention
dropout is Megatron's default 0.1), on A100-80 nodes of 8 GPUs with the GPU
sheet's DGX A100 network. The measurement is TFLOP/s per GPU counted with the
paper's Eq. 3; a prediction is compared through the same formula.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares

from pipedejavu.core.files import read_json
from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.moe import MlaSpec, MoeSpec, moe_layer_pattern
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.ops import Gemm
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    MEASURED_TENSOR_EFFICIENCY,
    AnalyticalConstants,
    gemm_efficiency,
    pass_arrays,
    stack_passes,
)
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import MegatronRun, spec_from_megatron_args
from pipedejavu.planning.megatron_launch import options_of_run, predict_megatron_run

__all__ = [
    "bundled_published_file",
    "FITTED_FIELDS",
    "HALF_PRECISION_BASE",
    "bundled_published_path",
    "bundled_moe_published_path",
    "MoePublishedRun",
    "PublishedRun",
    "fit_half_precision",
    "fit_tensor_efficiency",
    "leave_one_out",
    "load_moe_published_runs",
    "load_published_runs",
    "moe_spec_of_record",
    "predict_published",
]

#: The constants fitted on the published runs (the GEMMs' best efficiency comes
#: from measured GEMMs, the rest from the profiles).
FITTED_FIELDS = ("backward_memory_efficiency", "memory_efficiency", "link_efficiency")
#: What the published-run fit starts from: the profiles' constants with the
#: tensor cores' efficiency measured on GEMMs.
HALF_PRECISION_BASE = dataclasses.replace(
    FITTED_ANALYTICAL, tensor_efficiency=MEASURED_TENSOR_EFFICIENCY
)
MAX_PUBLISHED_FILE_BYTES = 4 * 2**20


class PublishedRun(NamedTuple):
    """One published run.

    Attributes:
        run_id: its id in the data file.
        args: the Megatron-LM flags it was launched with (as we rebuild them).
        run: those flags parsed.
        gpu_type: the sheet's GPU type.
        num_gpus: GPUs of the run.
        tflops_per_gpu: the published TFLOP/s per GPU (SC'21 counts the
            recomputed forward: hardware FLOPs).
    """

    run_id: str
    args: str
    run: MegatronRun
    gpu_type: str
    num_gpus: int
    tflops_per_gpu: float


def bundled_published_file(name: str) -> Path:
    """A vendored file of published runs (``pipedejavu/data/published``)."""
    root = importlib.resources.files("pipedejavu") / "data" / "published"
    return Path(str(root / name))


def bundled_published_path() -> Path:
    """The vendored copy of the SC'21 Table 1 runs."""
    return bundled_published_file("megatron_sc21_table1.json")


def _field(record: Mapping[str, Any], path: str, where: str) -> Any:
    value: Any = record
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise ProblemError(f"{where}: missing {path}")
        value = value[key]
    return value


def _args(record: Mapping[str, Any], where: str) -> str:
    def number(path: str) -> int:
        value = _field(record, path, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProblemError(f"{where}: {path} must be a positive integer")
        return value

    seq = number("model.seq_length")
    parts = [
        f"--num-layers {number('model.num_layers')}",
        f"--hidden-size {number('model.hidden_size')}",
        f"--num-attention-heads {number('model.num_attention_heads')}",
        f"--seq-length {seq} --max-position-embeddings {seq}",
        f"--vocab-size {number('model.vocab_size')} --make-vocab-size-divisible-by 1",
        f"--micro-batch-size {number('batch.micro_batch_size')}",
        f"--global-batch-size {number('batch.global_batch_size')}",
        f"--tensor-model-parallel-size {number('parallelism.tp')}",
        f"--pipeline-model-parallel-size {number('parallelism.pp')}",
        "--fp16 --checkpoint-activations --attention-backend unfused",
    ]
    chunk = _field(record, "parallelism.num_layers_per_virtual_pipeline_stage", where)
    if chunk is not None:
        parts.append(f"--num-layers-per-virtual-pipeline-stage {int(chunk)}")
    return " ".join(parts)


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple[PublishedRun, ...]:
    data = read_json(Path(path), MAX_PUBLISHED_FILE_BYTES, "published runs file")
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ProblemError(f"{path}: expected an object with a list of runs")
    out = []
    for index, record in enumerate(runs):
        where = f"{path}: run {index}"
        if not isinstance(record, dict):
            raise ProblemError(f"{where} is not an object")
        args = _args(record, where)
        gpus = _field(record, "hardware.num_gpus", where)
        measured = _field(record, "measured.tflops_per_gpu", where)
        if not isinstance(gpus, int) or not isinstance(measured, int | float):
            raise ProblemError(f"{where}: num_gpus and tflops_per_gpu must be numbers")
        out.append(
            PublishedRun(
                str(record.get("id", index)),
                args,
                spec_from_megatron_args(args, name=str(record.get("id", index))),
                "A100-80",
                gpus,
                float(measured),
            )
        )
    return tuple(out)


def load_published_runs(path: str | None = None) -> tuple[PublishedRun, ...]:
    """The runs of a published-runs file (default: the bundled SC'21 table)."""
    return _load(str(bundled_published_path() if path is None else path))


class MoePublishedRun(NamedTuple):
    """One published mixture-of-experts run (``moe_h100.json``).

    Attributes:
        run_id: its id in the data file.
        spec: the model, as the record's ``model`` fields define it.
        count_gate: whether Megatron's FLOP count includes the gate matrix of
            the model's gated MLP (SwiGLU only: not GPT-OSS's gated quick-GELU).
        tp, pp, cp, ep, etp, dp: the parallel degrees.
        virtual_chunks: interleaved pipeline chunks per stage (``None``: none).
        micro_batch, global_batch: samples.
        num_gpus: GPUs of the run.
        tflops_per_gpu: the published model TFLOP/s per GPU.
        tokens_per_s_per_gpu: the published throughput (``None`` if not given).
        iteration_time_s: the published step time (``None`` if not given).
    """

    run_id: str
    spec: TransformerSpec
    count_gate: bool
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    virtual_chunks: int | None
    micro_batch: int
    global_batch: int
    num_gpus: int
    tflops_per_gpu: float
    tokens_per_s_per_gpu: float | None
    iteration_time_s: float | None

    @property
    def published_flops_per_token(self) -> float | None:
        """Model FLOPs per token the published TFLOP/s imply with the published
        throughput or step time; ``None`` when neither is published (the
        record then derives them from the TFLOP/s)."""
        flops = self.tflops_per_gpu * 1e12
        if self.tokens_per_s_per_gpu is not None:
            return flops / self.tokens_per_s_per_gpu
        if self.iteration_time_s is not None:
            tokens = self.global_batch * self.spec.seq_length
            return flops * self.iteration_time_s * self.num_gpus / tokens
        return None


def bundled_moe_published_path() -> Path:
    """The vendored copy of the thirteen MoE runs on H100."""
    return bundled_published_file("moe_h100.json")


def _count(record: Mapping[str, Any], path: str, where: str, *, null_ok=False):
    value = _field(record, path, where)
    if value is None and null_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProblemError(f"{where}: {path} must be a non-negative integer")
    return value


def moe_spec_of_record(
    record: Mapping[str, Any], where: str, vocab_size: int | None = None
) -> tuple[TransformerSpec, bool]:
    """The model of a ``moe_h100.json`` record and whether Megatron's FLOP
    count includes its gate matrix.

    The activation names the MLP: ``swiglu`` is gated (and counted so);
    ``gated_linear_unit=True`` with another activation is gated, but
    Megatron-LM (``--swiglu``) and Megatron-Bridge up to v0.4 (a SiLU gate)
    count it as two matrices; ``add_bias_linear=True`` gives the linear
    layers biases. ``vocab_size``: the vocabulary when the record leaves it
    null (its tokenizer's, from a record of the same model).

    Raises:
        ProblemError: a field is missing or not of its type.
    """
    model = _field(record, "model", where)

    def count(key: str, *, null_ok: bool = False) -> int | None:
        if null_ok and key not in model:
            return None
        return _count(record, f"model.{key}", where, null_ok=null_ok)

    activation = str(model.get("activation", ""))
    swiglu = activation.startswith("swiglu")
    gated = swiglu or "gated_linear_unit=True" in activation
    norm = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}.get(
        str(model.get("normalization")), None
    )
    if norm is None:
        raise ProblemError(f"{where}: model.normalization must be RMSNorm or LayerNorm")
    layers = count("num_layers")
    pattern = moe_layer_pattern(
        layers, freq=count("moe_layer_freq"), first_dense=count("first_k_dense")
    )
    mla = None
    if model.get("q_lora_rank") is not None or model.get("kv_lora_rank") is not None:
        mla = MlaSpec(
            count("q_lora_rank", null_ok=True) or 0,
            count("kv_lora_rank"),
            count("qk_head_dim"),
            count("qk_pos_emb_head_dim"),
            count("v_head_dim"),
        )
    vocab = count("vocab_size", null_ok=True) or vocab_size
    if vocab is None:
        raise ProblemError(f"{where}: model.vocab_size is null for every record")
    try:
        spec = TransformerSpec(
            name=str(model.get("name", "model")),
            num_layers=layers,
            hidden_size=count("hidden_size"),
            num_attention_heads=count("num_attention_heads"),
            num_query_groups=count("num_query_groups"),
            ffn_hidden_size=count("ffn_hidden_size"),
            vocab_size=vocab,
            seq_length=count("seq_length"),
            gated_mlp=gated,
            norm=norm,
            position="rotary",
            tied_embeddings=bool(model.get("tied_embeddings")),
            linear_bias="add_bias_linear=True" in activation,
            vocab_divisible_by=count("make_vocab_size_divisible_by"),
            moe=MoeSpec(
                count("num_experts"),
                count("experts_per_token"),
                count("moe_ffn_hidden_size"),
                count("shared_expert_intermediate_size", null_ok=True) or 0,
                layers=pattern,
            ),
            mla=mla,
            mtp_layers=count("mtp_num_layers", null_ok=True) or 0,
            qk_layernorm=model.get("qk_layernorm") is True,
            kv_channels=count("kv_channels"),
        )
    except ValueError as error:  # the spec's message names the model
        raise ProblemError(f"{where}: {error}") from None
    return spec, swiglu or not gated


@functools.lru_cache(maxsize=4)
def _load_moe(path: str) -> tuple[MoePublishedRun, ...]:
    data = read_json(Path(path), MAX_PUBLISHED_FILE_BYTES, "published runs file")
    runs = data.get("runs") if isinstance(data, dict) else None
    if (
        not isinstance(runs, list)
        or not runs
        or not all(isinstance(record, dict) for record in runs)
    ):
        raise ProblemError(f"{path}: expected an object with a list of run objects")
    vocabularies = {
        str(r.get("model", {}).get("name")): r["model"]["vocab_size"]
        for r in runs
        if isinstance(r.get("model"), dict) and r["model"].get("vocab_size")
    }
    out = []
    for index, record in enumerate(runs):
        where = f"{path}: run {index}"
        name = str(_field(record, "model.name", where))
        spec, count_gate = moe_spec_of_record(record, where, vocabularies.get(name))
        degrees = [
            _count(record, f"parallelism.{key}", where)
            for key in ("tp", "pp", "cp", "ep", "etp", "dp")
        ]
        chunks = _count(
            record, "parallelism.virtual_pipeline_chunks", where, null_ok=True
        )
        measured = _field(record, "measured", where)
        numbers = [measured.get(key) for key in ("tflops_per_gpu",)]
        optional = [
            measured.get(key) for key in ("tokens_per_s_per_gpu", "iteration_time_s")
        ]
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            for v in numbers + [v for v in optional if v is not None]
        ):
            raise ProblemError(f"{where}: measured numbers must be positive")
        out.append(
            MoePublishedRun(
                str(record.get("id", index)),
                spec,
                count_gate,
                *degrees,
                None if chunks in (None, 1) else chunks,
                _count(record, "batch.micro_batch_size", where),
                _count(record, "batch.global_batch_size", where),
                _count(record, "hardware.num_gpus", where),
                float(numbers[0]),
                *(None if v is None else float(v) for v in optional),
            )
        )
    return tuple(out)


def load_moe_published_runs(path: str | None = None) -> tuple[MoePublishedRun, ...]:
    """The runs of a MoE published-runs file (default: the bundled
    ``moe_h100.json``: Megatron-Bridge's performance summary and the
    Megatron-MoE-ModelZoo table, thirteen H100 runs)."""
    return _load_moe(str(bundled_moe_published_path() if path is None else path))


def fit_tensor_efficiency(
    gemms: Sequence[Gemm],
    measured_seconds: Sequence[float],
    gpu: GpuSheetEntry,
    base: AnalyticalConstants = FITTED_ANALYTICAL,
) -> float:
    """``tensor_efficiency`` fitting measured GEMM times on ``gpu``: least
    squares on log time over the GEMMs that stay compute-bound at the tensor
    cores' peak, the curve's shape from ``base`` (closed form: the geometric
    mean of each GEMM's time at efficiency 1 over its measured time).

    Raises:
        ValueError: lengths differ, a time is not positive, a GEMM runs on
            CUDA cores, or none is compute-bound.
    """
    measured = np.asarray(measured_seconds, dtype=np.float64)
    if len(gemms) != len(measured) or not len(measured):
        raise ValueError("one measured time per GEMM, at least one")
    if not (np.isfinite(measured) & (measured > 0)).all():
        raise ValueError("measured times must be positive")
    arrays = stack_passes([pass_arrays([gemm], gpu) for gemm in gemms])
    if arrays.gemm_simt.any():
        raise ValueError("tensor-core GEMMs only (not fp32)")
    unit = dataclasses.replace(base, tensor_efficiency=1.0)
    at_peak = arrays.gemm_seconds_at_peak / gemm_efficiency(
        arrays.gemm_seconds_at_peak, arrays.gemm_simt, arrays.gemm_backward, unit
    )
    memory = arrays.gemm_memory_bytes / (arrays.gemm_bandwidth * base.memory_efficiency)
    bound = at_peak > memory
    if not bound.any():
        raise ValueError("no compute-bound GEMM to fit")
    return float(np.exp(np.mean(np.log(at_peak[bound] / measured[bound]))))


def _constants(base: AnalyticalConstants, values: Sequence[float]):
    return dataclasses.replace(base, **dict(zip(FITTED_FIELDS, values, strict=True)))


def predict_published(
    runs: Sequence[PublishedRun],
    constants: AnalyticalConstants,
    sheet: Mapping[str, GpuSheetEntry] | None = None,
) -> NDArray[np.float64]:
    """f64[R] predicted TFLOP/s per GPU of each run with ``constants``: the
    hardware TFLOP/s (recomputed forwards included), as SC'21 Table 1
    reports them."""
    sheet = load_gpu_sheet() if sheet is None else sheet
    out = []
    for item in runs:
        source = AnalyticalSource(
            item.run.spec, sheet, options_of_run(item.run), constants=constants
        )
        launch = predict_megatron_run(
            item.run, item.gpu_type, item.num_gpus, sheet, source=source
        )
        out.append(launch.hardware_tflops_per_gpu)
    return np.asarray(out, dtype=np.float64)


def fit_half_precision(
    runs: Sequence[PublishedRun],
    base: AnalyticalConstants = HALF_PRECISION_BASE,
    sheet: Mapping[str, GpuSheetEntry] | None = None,
) -> AnalyticalConstants:
    """:data:`FITTED_FIELDS` by least squares on log TFLOP/s over ``runs``."""
    sheet = load_gpu_sheet() if sheet is None else sheet
    measured = np.array([item.tflops_per_gpu for item in runs])

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        predicted = predict_published(runs, _constants(base, x), sheet)
        return np.log(predicted / measured)

    start = [0.7] * len(FITTED_FIELDS)  # inside the bounds, whatever the base
    count = len(FITTED_FIELDS)
    fit = least_squares(
        residuals, x0=start, bounds=([0.05] * count, [1.0] * count), diff_step=1e-3
    )
    return _constants(base, [round(float(v), 4) for v in fit.x])


def leave_one_out(
    runs: Sequence[PublishedRun],
    base: AnalyticalConstants = HALF_PRECISION_BASE,
    sheet: Mapping[str, GpuSheetEntry] | None = None,
) -> NDArray[np.float64]:
    """f64[R] relative error of each run predicted with the constants fitted on
    the others (predicted / published - 1)."""
    sheet = load_gpu_sheet() if sheet is None else sheet
    errors = []
    for k, item in enumerate(runs):
        others = [run for i, run in enumerate(runs) if i != k]
        constants = fit_half_precision(others, base, sheet)
        predicted = predict_published([item], constants, sheet)[0]
        errors.append(predicted / item.tflops_per_gpu - 1.0)
    return np.asarray(errors, dtype=np.float64)
