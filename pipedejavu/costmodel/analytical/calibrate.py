"""Fit the roofline's constants on the bundled Sailor profiles, and
cross-validate them.

The profiles (:mod:`pipedejavu.costmodel.megatron.sailor_data`) are
Megatron-DeepSpeed runs in fp32 without flash attention, GPT-2 vocabulary
padded to 50,304, sequence 2,048 (8,192 for LLAMA-3-8). The model shapes
below are read off ``llm_info.json``'s parameter and activation counts:

* OPT-350: 24 x (h 1024, 16 heads), learned positions: block parameters
  ``12 h^2 + 13 h`` = 12,596,224, the embedding ``50304 h + 2048 h``.
* GPT-Neo-2.7: 32 x (h 2560, 32 heads), same layout.
* OPT-30: 48 x (h 7168, 56 heads), same layout.
* LLAMA-3-8 (Sailor's): 32 x (h 4096, 32 heads, *no* grouped-query
  attention), a SwiGLU MLP of width 16,384 per matrix, biases, RMSNorm,
  rotary positions, sequence 8,192: block parameters ``4 h^2 + 3 h 16384 +
  15 h`` = 268,496,896; layer outputs ``8192 h``.

Attention, from Sailor's model code (``third_party/Megatron-DeepSpeed``):
none of the profiled models applies attention dropout (``llm_info``'s
``act_mem`` keeps one ``s x s`` tensor per head, not the two and a mask a
dropout would keep); LLAMA-3-8 (``llama_model.py``) multiplies the fp32
scores by the query-key layer-scaling coefficient in a kernel of its own,
GPT-Neo-2.7's attention (``gpt_neo_model.py``) does not; the OPT models run
Megatron-DeepSpeed's standard GPT (the README), whose ``ParallelAttention``
applies the scaling by default (assumed on; their launch flags are not
bundled) (:data:`QK_LAYER_SCALING`). GPT-Neo-2.7 has no LM head: its last layer is the
final norm, and the loss runs on the hidden states.

Precision, from the evidence (:func:`precision_hypotheses`): the profiles on
Ampere and Hopper GPUs ran their matmuls in TF32 (NVIDIA's PyTorch containers
enable it), except OPT-30 and LLAMA-3-8 on A100-40, which ran plain fp32: on
A100-40 GPT-Neo-2.7's blocks reach 75 TFLOP/s (4x the fp32 peak of 19.5)
while OPT-30's reach 18 (93% of it, 12% of TF32's). V100 and Turing have no
TF32.

The GPU numbers are vendor numbers (:data:`PROVISIONAL_GPUS`, to be replaced
by the bundled GPU sheet); the intra-node link of each profiled machine is
Sailor's *measured* one (the RTX-3090 machine reaches 1.3 GB/s per GPU with
8 GPUs, far from PCIe 4.0), since the profiles' TP time ran on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry, Precision
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.edge_ops import (
    embedding_forward_ops,
    head_backward_ops,
    head_forward_ops,
)
from pipedejavu.costmodel.analytical.ops import (
    PassOptions,
    block_backward_ops,
    block_forward_ops,
)
from pipedejavu.costmodel.analytical.roofline import (
    AnalyticalConstants,
    PassArrays,
    StackedPasses,
    pass_arrays,
    stack_passes,
    stacked_seconds,
)
from pipedejavu.costmodel.megatron.sailor_data import SailorData, load_sailor_data
from pipedejavu.costmodel.megatron.sheet_network import tp_bandwidth

__all__ = [
    "FIT_FIELDS",
    "PROFILED_MODELS",
    "PROVISIONAL_GPUS",
    "CalibrationSet",
    "calibration_set",
    "cross_validate",
    "fit_constants",
    "precision_hypotheses",
    "profile_precision",
    "relative_errors",
]

_DATASHEETS = {
    "V100": "NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2)",
    "A100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4)",
    "GH200": "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3)",
    "GA102": "NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090)",
    "TU102": "NVIDIA Turing GPU Architecture whitepaper (TITAN RTX, RTX 2080)",
}


def _gpu(name, memory, bandwidth, peaks, per_node, link, network, source):
    return GpuSheetEntry(
        name,
        memory,
        bandwidth,
        tuple(peaks.items()),
        per_node,
        link,
        network,
        (_DATASHEETS[source], "memory and GPUs per node: Sailor's cluster config"),
    )


_T = 1e12
#: Vendor numbers of the GPU types the bundled profiles cover (dense peaks; one
#: direction of NVLink or PCIe). Provisional: the bundled GPU sheet replaces it.
#: ``inter_node_bytes_per_s`` is not used here.
PROVISIONAL_GPUS: dict[str, GpuSheetEntry] = {
    gpu.name: gpu
    for gpu in (
        _gpu(
            "V100-16",
            17179869184,
            900e9,
            {"fp32": 15.7 * _T, "fp16": 125 * _T},
            4,
            150e9,
            4e9,
            "V100",
        ),
        _gpu(
            "A100-40",
            42338615296,
            1555e9,
            {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
            4,
            300e9,
            12.5e9,
            "A100",
        ),
        _gpu(
            "A100-80",
            85899345920,
            2039e9,
            {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
            4,
            300e9,
            12.5e9,
            "A100",
        ),
        _gpu(
            "GH-96",
            102625181696,
            4000e9,
            {
                "fp32": 67 * _T,
                "tf32": 494 * _T,
                "fp16": 990 * _T,
                "bf16": 990 * _T,
                "fp8": 1979 * _T,
            },
            4,
            450e9,
            100e9,
            "GH200",
        ),
        _gpu(
            "RTX-3090",
            25769803776,
            936e9,
            {"fp32": 35.6 * _T, "tf32": 35.6 * _T, "fp16": 71 * _T, "bf16": 71 * _T},
            8,
            31.5e9,
            0.125e9,
            "GA102",
        ),
        _gpu(
            "Titan-RTX",
            25769803776,
            672e9,
            {"fp32": 16.3 * _T, "fp16": 130.5 * _T},
            8,
            15.75e9,
            0.125e9,
            "TU102",
        ),
        _gpu(
            "RTX-2080",
            11811160064,
            448e9,
            {"fp32": 10.07 * _T, "fp16": 40.3 * _T},
            8,
            15.75e9,
            0.125e9,
            "TU102",
        ),
    )
}


def _gpt(name, layers, hidden, heads, seq=2048):
    return TransformerSpec(
        name,
        layers,
        hidden,
        heads,
        heads,
        4 * hidden,
        50304,
        seq,
        max_position_embeddings=seq,
    )


#: The bundled profiles' models (module docstring for the evidence).
PROFILED_MODELS: dict[str, TransformerSpec] = {
    "OPT-350": _gpt("OPT-350", 24, 1024, 16),
    "GPT-Neo-2.7": _gpt("GPT-Neo-2.7", 32, 2560, 32),
    "OPT-30": _gpt("OPT-30", 48, 7168, 56),
    "LLAMA-3-8": TransformerSpec(
        "LLAMA-3-8",
        32,
        4096,
        32,
        32,
        16384,
        50304,
        8192,
        gated_mlp=True,
        norm="rmsnorm",
        position="rotary",
    ),
}

#: The profiled models whose attention code multiplies the fp32 scores by
#: Megatron's query-key layer-scaling coefficient in a kernel of its own
#: (Sailor's ``llama_model.py`` and, by Megatron's default, its standard
#: ``ParallelAttention`` pass ``coeff = layer_number`` to
#: ``FusedScaleMaskSoftmax``; Sailor's ``gpt_neo_model.py`` passes ``None``).
#: A fact of each model's code, not a fitted constant.
QK_LAYER_SCALING = frozenset({"OPT-350", "OPT-30", "LLAMA-3-8"})

#: The profiles that ran their matmuls in plain fp32 on a TF32-capable GPU.
FP32_PROFILES = frozenset({("OPT-30", "A100-40"), ("LLAMA-3-8", "A100-40")})

#: The constants the fit moves, with their bounds.
FIT_FIELDS: dict[str, tuple[float, float]] = {
    "simt_efficiency": (0.05, 1.0),
    "tensor_efficiency": (0.05, 1.0),
    "backward_tensor_efficiency": (0.1, 1.0),
    "gemm_half_seconds": (1e-8, 1e-2),
    "gemm_exponent": (0.2, 4.0),
    "memory_efficiency": (0.05, 1.0),
    "backward_memory_efficiency": (0.2, 1.0),
    "kernel_overhead_s": (1e-9, 1e-3),
    "collective_latency_s": (1e-9, 1e-3),
}
_LOG_FIELDS = ("gemm_half_seconds", "kernel_overhead_s", "collective_latency_s")
#: Where the fit starts.
DEFAULT_CONSTANTS = AnalyticalConstants()


def profile_precision(model: str, gpu: str, hypothesis: str = "evidence") -> Precision:
    """The matmul precision a profile ran at.

    Args:
        hypothesis: ``evidence`` (TF32 where the GPU has it, except
            :data:`FP32_PROFILES`), ``tf32`` (wherever the GPU has it) or
            ``fp32`` (everywhere).
    """
    if hypothesis not in ("evidence", "tf32", "fp32"):
        raise ValueError(
            f"hypothesis must be 'evidence', 'tf32' or 'fp32', got {hypothesis!r}"
        )
    has_tf32 = any(name == "tf32" for name, _ in PROVISIONAL_GPUS[gpu].peak_flops)
    if hypothesis == "fp32" or not has_tf32:
        return "fp32"
    if hypothesis == "evidence" and (model, gpu) in FP32_PROFILES:
        return "fp32"
    return "tf32"


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationSet:
    """Profile entries with their passes prepared.

    Attributes:
        model, gpu: str[N] each entry's model and GPU type.
        mbs, tp: int[N].
        layer: str[N] ``block``, ``embedding`` or ``head``.
        direction: str[N] ``forward`` or ``backward``.
        measured: f64[N] seconds (blocks: median over the model's blocks).
        passes: the prepared passes, in the same order.
        stacked: the same, stacked for pricing.
    """

    model: NDArray[np.str_]
    gpu: NDArray[np.str_]
    mbs: NDArray[np.int64]
    tp: NDArray[np.int64]
    layer: NDArray[np.str_]
    direction: NDArray[np.str_]
    measured: NDArray[np.float64]
    passes: tuple[PassArrays, ...]
    stacked: StackedPasses

    def select(self, mask: NDArray[np.bool_]) -> CalibrationSet:
        """The entries where ``mask`` holds."""
        return _make_set(
            [r for r, keep in zip(self._rows(), mask, strict=True) if keep],
            [a for a, keep in zip(self.passes, mask, strict=True) if keep],
        )

    def _rows(self):
        return list(
            zip(
                self.model,
                self.gpu,
                self.mbs,
                self.tp,
                self.layer,
                self.direction,
                self.measured,
                strict=True,
            )
        )

    def predict(self, constants: AnalyticalConstants) -> NDArray[np.float64]:
        """f64[N] predicted seconds."""
        return stacked_seconds(self.stacked, constants)


def _make_set(rows, arrays) -> CalibrationSet:
    columns = list(zip(*rows, strict=True))
    return CalibrationSet(
        model=np.array(columns[0]),
        gpu=np.array(columns[1]),
        mbs=np.array(columns[2], dtype=np.int64),
        tp=np.array(columns[3], dtype=np.int64),
        layer=np.array(columns[4]),
        direction=np.array(columns[5]),
        measured=np.array(columns[6], dtype=np.float64),
        passes=tuple(arrays),
        stacked=stack_passes(arrays),
    )


def _measured_link(data: SailorData, gpu: GpuSheetEntry, tp: int, message: float):
    """``gpu`` with the profiled machine's link for a TP group of ``tp``
    (:func:`~pipedejavu.costmodel.megatron.sheet_network.tp_bandwidth`; the
    fits stop at the GPUs per node of Sailor's cluster config, 4 on V100,
    A100, GH200: V100 profiles at TP 8 get the widest)."""
    if tp == 1:
        return gpu
    per_gpu = tp_bandwidth(data.network, gpu.name, tp, message)
    return dataclasses.replace(gpu, intra_node_bytes_per_s=per_gpu)


def calibration_set(
    data: SailorData | None = None, *, hypothesis: str = "evidence"
) -> CalibrationSet:
    """Every profile entry of :data:`PROFILED_MODELS`: block forward and
    backward, head forward and backward, embedding forward (the embedding's
    backward was not measured: 1-3 microseconds everywhere)."""
    data = load_sailor_data() if data is None else data
    rows, arrays = [], []
    for model, spec in PROFILED_MODELS.items():
        blocks = slice(1, spec.num_layers + 1)
        for gpu_name in data.gpu_types(model):
            precision = profile_precision(model, gpu_name, hypothesis)
            for (mbs, tp), times in sorted(data.profile(model, gpu_name).items()):
                opts = PassOptions(
                    mbs,
                    tp,
                    precision,
                    flash_attention=False,
                    query_key_layer_scaling=model in QK_LAYER_SCALING,
                )
                message = mbs * spec.seq_length * spec.hidden_size * 4.0
                gpu = _measured_link(data, PROVISIONAL_GPUS[gpu_name], tp, message)
                entries = [
                    (
                        "block",
                        "forward",
                        block_forward_ops,
                        float(np.median(times.forward[blocks])),
                    ),
                    (
                        "block",
                        "backward",
                        block_backward_ops,
                        float(np.median(times.backward[blocks])),
                    ),
                    ("head", "forward", head_forward_ops, times.forward[-1]),
                    ("head", "backward", head_backward_ops, times.backward[-1]),
                    ("embedding", "forward", embedding_forward_ops, times.forward[0]),
                ]
                for layer, direction, ops_fn, measured in entries:
                    if measured <= 0:
                        continue
                    rows.append(
                        (model, gpu_name, mbs, tp, layer, direction, float(measured))
                    )
                    arrays.append(pass_arrays(ops_fn(spec, opts), gpu))
    return _make_set(rows, arrays)


def _to_vector(constants: AnalyticalConstants) -> NDArray[np.float64]:
    return np.array(
        [
            np.log(getattr(constants, f)) if f in _LOG_FIELDS else getattr(constants, f)
            for f in FIT_FIELDS
        ]
    )


def _from_vector(x: NDArray[np.float64], base: AnalyticalConstants):
    values = {
        f: float(np.exp(v)) if f in _LOG_FIELDS else float(v)
        for f, v in zip(FIT_FIELDS, x, strict=True)
    }
    return dataclasses.replace(base, **values)


def fit_constants(
    samples: CalibrationSet,
    *,
    initial: AnalyticalConstants = DEFAULT_CONSTANTS,
) -> AnalyticalConstants:
    """Least squares on ``log(predicted / measured)`` of the samples' block
    passes (forward and backward), every profile file weighted alike.

    Returns:
        the fitted constants (:data:`FIT_FIELDS` move; the others are
        ``initial``'s).
    """
    blocks = samples.select(samples.layer == "block")
    if blocks.measured.size < len(FIT_FIELDS):
        raise ValueError(
            f"fit_constants needs at least {len(FIT_FIELDS)} block samples, got "
            f"{blocks.measured.size}"
        )
    files = np.char.add(np.char.add(blocks.model, "/"), blocks.gpu)
    _, inverse, counts = np.unique(files, return_inverse=True, return_counts=True)
    weights = 1.0 / np.sqrt(counts[inverse])
    log_measured = np.log(blocks.measured)
    bounds = np.array(
        [
            (np.log(lo), np.log(hi)) if f in _LOG_FIELDS else (lo, hi)
            for f, (lo, hi) in FIT_FIELDS.items()
        ]
    ).T

    def residuals(x):
        predicted = blocks.predict(_from_vector(x, initial))
        return weights * (np.log(predicted) - log_measured)

    # SciPy's optimizers load only for a fit (0.3-0.5 s): the planning tables
    # import this module for its constants (QK_LAYER_SCALING) alone.
    from scipy.optimize import least_squares

    x0 = np.clip(_to_vector(initial), bounds[0], bounds[1])
    solution = least_squares(residuals, x0, bounds=bounds, x_scale="jac")
    return _from_vector(solution.x, initial)


def relative_errors(
    samples: CalibrationSet, constants: AnalyticalConstants
) -> NDArray[np.float64]:
    """f64[N] ``|predicted / measured - 1|``."""
    return np.abs(samples.predict(constants) / samples.measured - 1.0)


def _block_sum_errors(samples: CalibrationSet, constants: AnalyticalConstants):
    """``{(model, gpu): f64[entries]}`` errors of forward + backward per block."""
    predicted = samples.predict(constants)
    out: dict[tuple[str, str], list[float]] = {}
    pairs: dict[tuple, list[float]] = {}
    for i in np.flatnonzero(samples.layer == "block"):
        key = (samples.model[i], samples.gpu[i], samples.mbs[i], samples.tp[i])
        measured, guess = pairs.setdefault(key, [0.0, 0.0])[:2]
        pairs[key] = [measured + samples.measured[i], guess + predicted[i]]
    for (model, gpu, _, _), (measured, guess) in pairs.items():
        out.setdefault((str(model), str(gpu)), []).append(abs(guess / measured - 1))
    return {k: np.array(v) for k, v in out.items()}


def _summary(errors: Iterable[float]) -> dict[str, float]:
    errors = np.asarray(list(errors), dtype=np.float64)
    return {
        "median": float(np.median(errors)),
        "max": float(np.max(errors)),
        "count": int(errors.size),
    }


def _layer_errors(samples, constants, layer, models):
    """Per GPU type: errors of one layer kind's (forward [+ backward]) times."""
    predicted = samples.predict(constants)
    sums: dict[tuple, list[float]] = {}
    for i in np.flatnonzero((samples.layer == layer) & np.isin(samples.model, models)):
        key = (samples.gpu[i], samples.model[i], samples.mbs[i], samples.tp[i])
        measured, guess = sums.get(key, (0.0, 0.0))
        sums[key] = (measured + samples.measured[i], guess + predicted[i])
    per_gpu: dict[str, list[float]] = {}
    for (gpu, *_), (measured, guess) in sums.items():
        per_gpu.setdefault(str(gpu), []).append(abs(guess / measured - 1))
    return {gpu: _summary(v) for gpu, v in sorted(per_gpu.items())}


#: GPT-Neo-2.7's last profiled layer holds the final norm only (0.2 ms at mbs
#: 1 on A100-40, where its LM head alone is a 0.5 TFLOP product; llm_info says
#: its output is ``s h + 1`` elements, not logits): it is left out of the head
#: comparison.
HEADLESS_PROFILES = frozenset({"GPT-Neo-2.7"})


def cross_validate(
    samples: CalibrationSet, *, initial: AnalyticalConstants = DEFAULT_CONSTANTS
) -> dict:
    """Leave-one-model-out and leave-one-GPU-type-out accuracy.

    Returns:
        ``{"leave_one_model_out": {model: {"blocks": {gpu: summary},
        "head": ..., "embedding_forward": ..., "constants": {...}}},
        "leave_one_gpu_out": {gpu: {"blocks": {model: summary}, ...}},
        "in_sample": {...}}``; a summary is ``{"median", "max", "count"}`` of
        ``|predicted / measured - 1|`` over the held-out profile entries of
        forward + backward per block (head: forward + backward; embedding:
        forward).
    """
    result: dict = {"leave_one_model_out": {}, "leave_one_gpu_out": {}}
    everything = fit_constants(samples, initial=initial)
    head_models = [m for m in PROFILED_MODELS if m not in HEADLESS_PROFILES]
    for held, column, key in (
        (sorted(set(samples.model)), "model", "leave_one_model_out"),
        (sorted(set(samples.gpu)), "gpu", "leave_one_gpu_out"),
    ):
        for name in held:
            mask = getattr(samples, column) == name
            fitted = fit_constants(samples.select(~mask), initial=initial)
            test = samples.select(mask)
            blocks = _block_sum_errors(test, fitted)
            by = 1 if column == "model" else 0
            models = (
                head_models
                if column == "gpu"
                else [m for m in [name] if m in head_models]
            )
            result[key][str(name)] = {
                "blocks": {k[by]: _summary(v) for k, v in sorted(blocks.items())},
                "head": _layer_errors(test, fitted, "head", models),
                "embedding_forward": _layer_errors(
                    test, fitted, "embedding", list(PROFILED_MODELS)
                ),
                "constants": dataclasses.asdict(fitted),
            }
    result["in_sample"] = {
        f"{m}/{g}": _summary(v)
        for (m, g), v in sorted(_block_sum_errors(samples, everything).items())
    }
    result["constants_all"] = dataclasses.asdict(everything)
    return result


def precision_hypotheses(
    data: SailorData | None = None, gpus: Sequence[str] = ("A100-40", "A100-80")
) -> dict[str, dict[str, dict[str, float]]]:
    """Fit the constants under each precision hypothesis and compare the
    in-sample errors on the profiles of ``gpus``.

    Returns:
        ``{hypothesis: {"model/gpu": summary}}`` for ``evidence``, ``tf32``,
        ``fp32`` (see :func:`profile_precision`).
    """
    out = {}
    for hypothesis in ("evidence", "tf32", "fp32"):
        samples = calibration_set(data, hypothesis=hypothesis)
        fitted = fit_constants(samples)
        errors = _block_sum_errors(samples, fitted)
        out[hypothesis] = {
            f"{m}/{g}": _summary(v) for (m, g), v in sorted(errors.items()) if g in gpus
        }
        out[hypothesis]["all profiles"] = _summary(
            np.concatenate(list(errors.values()))
        )
    return out
