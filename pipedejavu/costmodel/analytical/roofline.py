"""Operations to seconds: a roofline with a GEMM efficiency curve.

Each operation of :mod:`pipedejavu.costmodel.analytical.ops` takes

* a GEMM: ``max(flops / (peak(precision) * eff), bytes / (bandwidth *
  memory_efficiency)) + kernel_overhead_s`` with
  ``eff = eff_max / (1 + (half_seconds / w) ** exponent) ** (1 / exponent)``,
  where ``w = flops / peak`` is the GEMM's duration at peak: a smooth maximum
  of ``w`` and ``half_seconds``, so a tiny GEMM takes ``half_seconds /
  eff_max`` (a floor, like one wave of tiles) and a large one ``w / eff_max``.
  Sizing a GEMM in seconds at peak makes one curve serve GPUs of every size
  (a GPU twice as fast needs a GEMM twice as big to fill).
  ``eff_max`` is ``simt_efficiency`` for fp32 on CUDA cores and
  ``tensor_efficiency`` on tensor cores (tf32, fp16, bf16, fp8), times
  ``backward_tensor_efficiency`` for the gradient GEMMs on tensor cores;
* an fp8 GEMM's 16-bit operand that is not a weight (a forward's input, an
  input gradient's output gradient; weight gradients reuse both) quantized
  as Transformer Engine's current scaling does: :data:`FP8_CAST_BYTES` per
  element in two memory-bound kernels (weights, cast once a step: not priced);
* a memory-bound kernel: ``bytes / (bandwidth * memory_efficiency) +
  kernel_overhead_s``, the bandwidth share divided by
  ``backward_memory_efficiency`` more for the kernels of a backward pass;
* a collective: ``link_bytes / (intra_node_bytes_per_s * link_efficiency) +
  collective_latency_s`` (ring algorithm; TP groups stay inside a node); one
  that runs beside a GEMM (``Collective.beside``, Megatron-LM's
  ``--tp-comm-overlap``) split in ``tp`` chunks pipelined with the GEMM's: only
  what outlasts the GEMM, and never less than one chunk, ``max(c - g, c /
  tp)`` for a collective of ``c`` seconds beside a GEMM of ``g``;
* a fused (flash) attention kernel (``Gemm.attention``): ``(w ** p + h **
  p) ** (1 / p)`` with ``w`` its work in seconds at peak (every score of the
  tiles it computes, its softmax's exponentials included) and ``h``, ``p`` a
  floor and how slowly it approaches the peak, the backward's its own
  (:mod:`~pipedejavu.costmodel.analytical.attention`), divided by
  ``attention_efficiency`` for a kernel other than the measured one.

The shared constants: fitted by :mod:`~pipedejavu.costmodel.analytical.
calibrate` (:data:`FITTED_ANALYTICAL`, on all the bundled profiles), the fused
attention's measured (:data:`~.attention.MEASURED_ATTENTION`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.costmodel.analytical.attention import (
    MEASURED_ATTENTION,
    computed_tiles,
    flops_per_exponential,
    fused_attention_seconds,
)
from pipedejavu.costmodel.analytical.ops import Collective, Gemm, MemoryOp

__all__ = [
    "FITTED_ANALYTICAL",
    "HALF_PRECISION_ANALYTICAL",
    "MAX_LINK_EFFICIENCY",
    "FP8_CAST_BYTES",
    "MEASURED_TENSOR_EFFICIENCY",
    "AnalyticalConstants",
    "fp8_cast_bytes",
    "PassArrays",
    "gemm_efficiency",
    "pass_arrays",
    "StackedPasses",
    "pass_seconds",
    "stack_passes",
    "attention_seconds",
    "stacked_seconds",
]

SIMT_PRECISIONS = ("fp32",)

#: Bytes per element quantizing a 16-bit operand under current scaling: amax
#: read 2, read 2, fp8 written row-wise 1 and column-wise 1 (Hopper's fp8 GEMMs
#: take one layout; the weight gradient needs the transposes).
FP8_CAST_BYTES = 6.0


def fp8_cast_bytes(gemm: Gemm) -> float:
    """Bytes quantizing an fp8 GEMM's 16-bit operand (module docstring)."""
    if gemm.precision != "fp8" or gemm.name.endswith(".wgrad"):
        return 0.0
    return FP8_CAST_BYTES * gemm.batch * gemm.m * gemm.k


MAX_LINK_EFFICIENCY = 4.0  # (the most link_efficiency may be: see the field)


@dataclasses.dataclass(frozen=True)
class AnalyticalConstants:
    """The roofline's free constants, shared by all GPU types.

    Args:
        simt_efficiency: best fraction of the fp32 (CUDA-core) peak a large
            GEMM reaches.
        tensor_efficiency: best fraction of the tensor-core peak (tf32, fp16,
            bf16, fp8) a large forward GEMM reaches.
        backward_tensor_efficiency: the gradient GEMMs' efficiency on tensor
            cores relative to the forward ones (transposed operands, reductions
            over tokens).
        gemm_half_seconds: the shortest a GEMM can take at best efficiency (a
            GEMM lasting this long at peak reaches ``2 ** (-1 / exponent)`` of
            it).
        gemm_exponent: how sharply efficiency saturates with GEMM size.
        memory_efficiency: fraction of the memory bandwidth memory-bound
            kernels reach.
        kernel_overhead_s: seconds per kernel beyond its roofline (launch,
            the framework's per-operation work).
        link_efficiency: fraction of ``intra_node_bytes_per_s`` a ring
            collective reaches (a cluster's calibration fits it to its TP > 1
            profiles: above 1 where TP beats the pairs a link was measured with).
        collective_latency_s: seconds per collective beyond its bytes.
        backward_memory_efficiency: the memory-bound kernels of a backward pass
            (``*.backward``, ``grad_*``) relative to the forward ones.
        attention_softmax_exponentials: a fused attention kernel's
            non-matrix work (exponentials, running maxima, rescaling) per
            score and product, in the time of exponentials (each worth the
            tensor FLOPs the GPU does meanwhile).
        attention_half_seconds, attention_exponent: a fused attention
            kernel's forward takes ``(w ** p + h ** p) ** (1 / p)`` for ``w``
            seconds of work at peak: ``h`` its floor, ``p`` how slowly it
            approaches the peak (the module's docstring).
        attention_backward_half_seconds, attention_backward_exponent: the
            same for its backward.
        alltoall_efficiency: fraction of the links' bandwidth an expert-parallel
            all-to-all reaches (:mod:`~pipedejavu.costmodel.analytical.moe_layers`).
        alltoall_hidden: with the all-to-alls overlapped with another
            micro-batch's compute, the fraction of them (at most the compute)
            hidden.
        expert_block_overhead_s: seconds each expert block's forward and
            backward add beyond their operations (the token counts' trip to the
            host, the dispatcher's bookkeeping).
        attention_efficiency: a fused attention kernel's speed relative to
            the measured cuDNN one's (another kernel's seconds divided by it).
        loss_logit_bytes: bytes per logit the loss holds at its peak beyond
            the fp32 softmax it keeps for the backward (a fact of the
            launcher's loss code, not fitted; 0: Megatron's in-place one).

    Defaults: generic values, except the fused attention's (measured:
    :data:`~pipedejavu.costmodel.analytical.attention.MEASURED_ATTENTION`).
    """

    simt_efficiency: float = 0.9
    tensor_efficiency: float = 0.8
    backward_tensor_efficiency: float = 0.6
    gemm_half_seconds: float = 1e-5
    gemm_exponent: float = 2.0
    memory_efficiency: float = 0.7
    kernel_overhead_s: float = 2e-5
    link_efficiency: float = 1.0
    collective_latency_s: float = 1e-5
    backward_memory_efficiency: float = 1.0
    attention_softmax_exponentials: float = MEASURED_ATTENTION[
        "attention_softmax_exponentials"
    ]
    attention_half_seconds: float = MEASURED_ATTENTION["attention_half_seconds"]
    attention_exponent: float = MEASURED_ATTENTION["attention_exponent"]
    attention_backward_half_seconds: float = MEASURED_ATTENTION[
        "attention_backward_half_seconds"
    ]
    attention_backward_exponent: float = MEASURED_ATTENTION[
        "attention_backward_exponent"
    ]
    alltoall_efficiency: float = 1.0
    alltoall_hidden: float = 1.0
    expert_block_overhead_s: float = 0.0
    attention_efficiency: float = 1.0
    loss_logit_bytes: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or not np.isfinite(value):
                raise ValueError(f"{field.name} must be a finite number, got {value!r}")
        for name, top in (
            ("simt_efficiency", 1.0),
            ("tensor_efficiency", 1.0),
            ("backward_tensor_efficiency", 1.0),
            ("memory_efficiency", 1.0),
            ("backward_memory_efficiency", 1.0),
            ("alltoall_efficiency", 1.0),
            ("attention_efficiency", 1.0),
            ("link_efficiency", MAX_LINK_EFFICIENCY),
        ):
            value = getattr(self, name)
            if not 0 < value <= top:
                raise ValueError(f"{name} must be in (0, {top:g}], got {value}")
        for name in (
            "gemm_half_seconds",
            "gemm_exponent",
            "attention_half_seconds",
            "attention_exponent",
            "attention_backward_half_seconds",
            "attention_backward_exponent",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "kernel_overhead_s",
            "collective_latency_s",
            "attention_softmax_exponentials",
            "expert_block_overhead_s",
            "loss_logit_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.alltoall_hidden <= 1:
            raise ValueError(
                f"alltoall_hidden must be in [0, 1], got {self.alltoall_hidden}"
            )


#: Fitted on every bundled Sailor profile (all models, all GPU types) by
#: :func:`pipedejavu.costmodel.analytical.calibrate.fit_constants`;
#: ``tests/test_analytical.py`` refits and compares. Large GEMMs reach 96% of
#: the fp32 (CUDA-core) peak and 68% of the TF32 peak, forward and backward
#: alike; no GEMM takes less than 62 microseconds (at best efficiency);
#: forward memory-bound kernels 86% of the bandwidth, backward ones 38% of
#: that (autograd's extra reads and writes, not counted one by one); no
#: measurable per-kernel overhead beyond that; 45 microseconds per collective.
FITTED_ANALYTICAL = AnalyticalConstants(
    simt_efficiency=0.964617,
    tensor_efficiency=0.680627,
    backward_tensor_efficiency=0.999944,
    gemm_half_seconds=6.2379e-05,
    gemm_exponent=4.0,
    memory_efficiency=0.858576,
    kernel_overhead_s=1.00135e-09,
    link_efficiency=1.0,
    collective_latency_s=4.47147e-05,
    backward_memory_efficiency=0.384102,
)


#: The tensor cores' best efficiency on a large 16-bit GEMM, fitted on
#: measured bf16 GEMMs (144 of the 288 Megatron-shaped GEMMs timed on an H200
#: in ``benchmarks/results/gpu_fp8_gemms.json``, every other one; the other
#: half is held out) by
#: :func:`pipedejavu.planning.published_runs.fit_tensor_efficiency`;
#: ``tests/test_published_runs.py`` refits and compares.
MEASURED_TENSOR_EFFICIENCY = 0.8091

#: For 16-bit training (fp16, bf16, fp8 GEMMs), because no bundled profile is
#: 16-bit: :data:`FITTED_ANALYTICAL` with :data:`MEASURED_TENSOR_EFFICIENCY`,
#: and the memory-bound kernels' bandwidth share (forward, and backward
#: relative to it) and the TP collectives' share of the link refitted on the
#: visible published runs (Megatron-LM SC'21 Table 1, fp16 on A100-80) by
#: :func:`pipedejavu.planning.published_runs.fit_half_precision`: Megatron-LM's
#: kernels of 2021 reach 72% of the memory bandwidth, its TP all-reduces half
#: the NVLink bandwidth. ``tests/test_published_runs.py`` refits and compares,
#: and the benchmark reports the leave-one-out error.
HALF_PRECISION_ANALYTICAL = dataclasses.replace(
    FITTED_ANALYTICAL,
    tensor_efficiency=MEASURED_TENSOR_EFFICIENCY,
    backward_memory_efficiency=0.8676,
    memory_efficiency=0.7179,
    link_efficiency=0.4971,
    # the mixtures of experts' three, fitted on the thirteen published MoE
    # runs on H100 (benchmarks/moe_published.py; leave-one-out errors in
    # docs/moe.md): read by the expert blocks only
    alltoall_efficiency=1.0,
    alltoall_hidden=0.7766,
    expert_block_overhead_s=0.0016797,
)


@dataclasses.dataclass(frozen=True, eq=False)
class PassArrays:
    """A layer pass as arrays, priced on one GPU (constants not yet applied).

    Attributes:
        gemm_seconds_at_peak: f64[G] ``flops / peak`` of each GEMM.
        gemm_memory_bytes: f64[G] bytes each GEMM moves.
        gemm_simt: bool[G] the GEMM runs on CUDA cores (fp32).
        gemm_backward: bool[G] a gradient GEMM.
        gemm_attention: bool[G] the products of a fused attention kernel.
        gemm_tiles: f64[G] the work a fused attention kernel computes over
            its FLOPs (the diagonal tiles of a causal one whole); 1 elsewhere.
        gemm_depth: f64[G] each GEMM's depth ``k`` (a head's dimension in a
            fused attention kernel).
        gemm_flops_per_exponential: f64[G] the tensor FLOPs (at each GEMM's
            precision) the GPU does in the time of one exponential.
        memory_bytes: total bytes of the memory-bound kernels.
        memory_backward_bytes: the part of them in backward kernels.
        num_memory_kernels: how many there are.
        link_bytes: total bytes each GPU sends in the pass's collectives on
            the critical path.
        num_collectives: how many collectives on the critical path.
        bandwidth: the GPU's memory bandwidth, bytes/s.
        link_bandwidth: its intra-node bandwidth, bytes/s.
        beside_link_bytes: f64[K] bytes each GPU sends in each collective
            that runs beside a GEMM.
        beside_gemm: i64[K] that GEMM's index in ``gemm_seconds_at_peak``.
        beside_chunks: f64[K] the chunks it is pipelined in.
    """

    gemm_seconds_at_peak: NDArray[np.float64]
    gemm_memory_bytes: NDArray[np.float64]
    gemm_simt: NDArray[np.bool_]
    gemm_backward: NDArray[np.bool_]
    gemm_attention: NDArray[np.bool_]
    gemm_tiles: NDArray[np.float64]
    gemm_depth: NDArray[np.float64]
    gemm_flops_per_exponential: NDArray[np.float64]
    memory_bytes: float
    memory_backward_bytes: float
    num_memory_kernels: int
    link_bytes: float
    num_collectives: int
    bandwidth: float
    link_bandwidth: float
    beside_link_bytes: NDArray[np.float64] = dataclasses.field(
        default_factory=lambda: np.zeros(0)
    )
    beside_gemm: NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int64)
    )
    beside_chunks: NDArray[np.float64] = dataclasses.field(
        default_factory=lambda: np.zeros(0)
    )


def _is_backward(name: str) -> bool:
    return name.endswith((".dgrad", ".wgrad", ".backward")) or name.startswith("grad_")


def pass_arrays(
    ops: Sequence[Gemm | MemoryOp | Collective],
    gpu: GpuSheetEntry,
    *,
    fp8_casts: bool = True,
) -> PassArrays:
    """The operations of a pass as :class:`PassArrays` on ``gpu``; a
    collective beside a GEMM not in ``ops`` is on the critical path; the fp8
    GEMMs' quantizations priced unless ``fp8_casts`` is false (a GEMM alone).

    Raises:
        ValueError: ``gpu`` lacks the peak of a GEMM's precision.
    """
    gemms = [op for op in ops if isinstance(op, Gemm)]
    index = {gemm.name: k for k, gemm in enumerate(gemms)}
    collectives = [op for op in ops if isinstance(op, Collective)]
    beside = [op for op in collectives if op.beside in index]
    peaks = {}
    for gemm in gemms:
        if gemm.precision not in peaks:
            try:
                peaks[gemm.precision] = gpu.peak(gemm.precision)
            except KeyError:
                have = ", ".join(name for name, _ in gpu.peak_flops) or "none"
                raise ValueError(
                    f"GPU {gpu.name} has no {gemm.precision} peak (it has: {have})"
                ) from None
    casts = [(fp8_cast_bytes(g), _is_backward(g.name)) for g in gemms if fp8_casts]
    casts = [(size, backward) for size, backward in casts if size]
    memory = [op.bytes for op in ops if isinstance(op, MemoryOp)]
    memory_backward = [b for b, back in casts if back] + [
        op.bytes for op in ops if isinstance(op, MemoryOp) and _is_backward(op.name)
    ]
    memory += [size for size, _ in casts]
    links = [op.link_bytes for op in collectives if op.beside not in index]
    return PassArrays(
        gemm_seconds_at_peak=np.array(
            [g.flops / peaks[g.precision] for g in gemms], dtype=np.float64
        ),
        gemm_memory_bytes=np.array([g.bytes for g in gemms], dtype=np.float64),
        gemm_simt=np.array([g.precision in SIMT_PRECISIONS for g in gemms], bool),
        gemm_backward=np.array([_is_backward(g.name) for g in gemms], bool),
        memory_bytes=float(sum(memory)),
        memory_backward_bytes=float(sum(memory_backward)),
        num_memory_kernels=len(memory) + len(casts),
        link_bytes=float(sum(links)),
        num_collectives=len(links),
        bandwidth=gpu.memory_bandwidth_bytes_per_s,
        link_bandwidth=gpu.intra_node_bytes_per_s,
        beside_link_bytes=np.array([op.link_bytes for op in beside], np.float64),
        beside_gemm=np.array([index[op.beside] for op in beside], np.int64),
        beside_chunks=np.array([op.chunks for op in beside], np.float64),
        gemm_attention=np.array([g.attention for g in gemms], bool),
        gemm_tiles=np.array([computed_tiles(g) for g in gemms], dtype=np.float64),
        gemm_depth=np.array([g.k for g in gemms], dtype=np.float64),
        gemm_flops_per_exponential=np.array(
            [flops_per_exponential(peaks[g.precision], gpu) for g in gemms],
            dtype=np.float64,
        ),
    )


def gemm_efficiency(
    seconds_at_peak: NDArray[np.float64],
    simt: NDArray[np.bool_],
    backward: NDArray[np.bool_],
    constants: AnalyticalConstants,
) -> NDArray[np.float64]:
    """Fraction of peak reached by GEMMs lasting ``seconds_at_peak`` at peak.

    Args:
        seconds_at_peak: f64[G] each GEMM's ``flops / peak``.
        simt: bool[G] on CUDA cores (fp32) rather than tensor cores.
        backward: bool[G] a gradient GEMM.
        constants: the curve's constants.

    Returns:
        f64[G] in ``(0, eff_max]``.
    """
    c = constants
    best = np.where(
        simt,
        c.simt_efficiency,
        c.tensor_efficiency * np.where(backward, c.backward_tensor_efficiency, 1.0),
    )
    size = np.maximum(np.asarray(seconds_at_peak, dtype=np.float64), 1e-30)
    ratio = (c.gemm_half_seconds / size) ** c.gemm_exponent
    return best / (1.0 + ratio) ** (1.0 / c.gemm_exponent)


@dataclasses.dataclass(frozen=True, eq=False)
class StackedPasses:
    """Many :class:`PassArrays` concatenated, for pricing them all at once.

    Attributes:
        gemm_pass: int[G] the pass each GEMM belongs to.
        gemm_seconds_at_peak, gemm_memory_bytes, gemm_simt, gemm_backward:
            [G] as in :class:`PassArrays`.
        gemm_bandwidth: f64[G] the memory bandwidth of each GEMM's GPU.
        memory_bytes, num_memory_kernels, num_gemms, link_bytes,
        num_collectives, bandwidth, link_bandwidth: f64[N] per pass.
        beside_pass, beside_gemm, beside_link_bytes, beside_chunks: [K] the
            collectives beside a GEMM: their pass, their GEMM's index in the
            ``gemm_*`` arrays, as in :class:`PassArrays`.
        gemm_attention, gemm_tiles, gemm_depth, gemm_flops_per_exponential:
            [G] as in :class:`PassArrays`.
    """

    gemm_pass: NDArray[np.int64]
    gemm_seconds_at_peak: NDArray[np.float64]
    gemm_memory_bytes: NDArray[np.float64]
    gemm_simt: NDArray[np.bool_]
    gemm_backward: NDArray[np.bool_]
    gemm_bandwidth: NDArray[np.float64]
    memory_bytes: NDArray[np.float64]
    memory_backward_bytes: NDArray[np.float64]
    num_memory_kernels: NDArray[np.float64]
    num_gemms: NDArray[np.float64]
    link_bytes: NDArray[np.float64]
    num_collectives: NDArray[np.float64]
    bandwidth: NDArray[np.float64]
    link_bandwidth: NDArray[np.float64]
    beside_pass: NDArray[np.int64]
    beside_gemm: NDArray[np.int64]
    beside_link_bytes: NDArray[np.float64]
    beside_chunks: NDArray[np.float64]
    gemm_attention: NDArray[np.bool_]
    gemm_tiles: NDArray[np.float64]
    gemm_depth: NDArray[np.float64]
    gemm_flops_per_exponential: NDArray[np.float64]

    @property
    def num_passes(self) -> int:
        return len(self.memory_bytes)


def stack_passes(passes: Sequence[PassArrays]) -> StackedPasses:
    """Concatenate ``passes`` (built once; priced many times by a fit)."""
    if not passes:
        raise ValueError("stack_passes needs at least one pass")
    counts = [len(p.gemm_seconds_at_peak) for p in passes]

    def per_pass(name: str) -> NDArray[np.float64]:
        return np.array([float(getattr(p, name)) for p in passes], dtype=np.float64)

    bandwidth = per_pass("bandwidth")
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    besides = [len(p.beside_gemm) for p in passes]
    return StackedPasses(
        gemm_pass=np.repeat(np.arange(len(passes)), counts),
        gemm_seconds_at_peak=np.concatenate([p.gemm_seconds_at_peak for p in passes]),
        gemm_memory_bytes=np.concatenate([p.gemm_memory_bytes for p in passes]),
        gemm_simt=np.concatenate([p.gemm_simt for p in passes]),
        gemm_backward=np.concatenate([p.gemm_backward for p in passes]),
        gemm_bandwidth=np.repeat(bandwidth, counts),
        memory_bytes=per_pass("memory_bytes"),
        memory_backward_bytes=per_pass("memory_backward_bytes"),
        num_memory_kernels=per_pass("num_memory_kernels"),
        num_gemms=np.array(counts, dtype=np.float64),
        link_bytes=per_pass("link_bytes"),
        num_collectives=per_pass("num_collectives"),
        bandwidth=bandwidth,
        link_bandwidth=per_pass("link_bandwidth"),
        beside_pass=np.repeat(np.arange(len(passes)), besides),
        beside_gemm=np.concatenate(
            [p.beside_gemm + offsets[k] for k, p in enumerate(passes)]
        ).astype(np.int64),
        beside_link_bytes=np.concatenate([p.beside_link_bytes for p in passes]).astype(
            np.float64
        ),
        beside_chunks=np.concatenate([p.beside_chunks for p in passes]).astype(
            np.float64
        ),
        gemm_attention=np.concatenate([p.gemm_attention for p in passes]).astype(bool),
        gemm_tiles=np.concatenate([p.gemm_tiles for p in passes]).astype(np.float64),
        gemm_depth=np.concatenate([p.gemm_depth for p in passes]).astype(np.float64),
        gemm_flops_per_exponential=np.concatenate(
            [p.gemm_flops_per_exponential for p in passes]
        ).astype(np.float64),
    )


def stacked_seconds(
    stacked: StackedPasses, constants: AnalyticalConstants
) -> NDArray[np.float64]:
    """Seconds of every pass of ``stacked``: f64[N]."""
    c = constants
    eff = gemm_efficiency(
        stacked.gemm_seconds_at_peak,
        stacked.gemm_simt,
        stacked.gemm_backward,
        c,
    )
    compute = stacked.gemm_seconds_at_peak / eff
    if stacked.gemm_attention.any():
        compute = np.where(
            stacked.gemm_attention, attention_seconds(stacked, c), compute
        )
    gemm = np.maximum(
        compute,
        stacked.gemm_memory_bytes / (stacked.gemm_bandwidth * c.memory_efficiency),
    )
    total = np.bincount(stacked.gemm_pass, gemm, minlength=stacked.num_passes).astype(
        np.float64
    )
    forward_bytes = stacked.memory_bytes - stacked.memory_backward_bytes
    total += (
        forward_bytes + stacked.memory_backward_bytes / c.backward_memory_efficiency
    ) / (stacked.bandwidth * c.memory_efficiency)
    total += c.kernel_overhead_s * (stacked.num_gemms + stacked.num_memory_kernels)
    has_links = stacked.num_collectives > 0
    total += np.where(
        has_links,
        stacked.link_bytes
        / (np.where(has_links, stacked.link_bandwidth, 1.0) * c.link_efficiency),
        0.0,
    )
    total += c.collective_latency_s * stacked.num_collectives
    if len(stacked.beside_pass):
        pass_of = stacked.beside_pass
        link = (
            stacked.beside_link_bytes
            / (stacked.link_bandwidth[pass_of] * c.link_efficiency)
            + c.collective_latency_s
        )
        exposed = np.maximum(
            link - gemm[stacked.beside_gemm], link / stacked.beside_chunks
        )
        total += np.bincount(pass_of, exposed, minlength=stacked.num_passes)
    return total


def attention_seconds(
    stacked: StackedPasses, constants: AnalyticalConstants
) -> NDArray[np.float64]:
    """f64[G] each GEMM's seconds as a fused attention kernel's products (the
    rule of the module's docstring, :func:`~pipedejavu.costmodel.analytical.
    attention.fused_attention_seconds`; meaningful where ``gemm_attention``)."""
    c = constants
    return (1.0 / c.attention_efficiency) * fused_attention_seconds(
        stacked.gemm_seconds_at_peak * stacked.gemm_tiles,
        stacked.gemm_depth,
        stacked.gemm_flops_per_exponential,
        stacked.gemm_backward,
        softmax_exponentials=c.attention_softmax_exponentials,
        half_seconds=(c.attention_half_seconds, c.attention_backward_half_seconds),
        exponent=(c.attention_exponent, c.attention_backward_exponent),
    )


def pass_seconds(
    ops: Sequence[Gemm | MemoryOp | Collective],
    gpu: GpuSheetEntry,
    constants: AnalyticalConstants = FITTED_ANALYTICAL,
    *,
    fp8_casts: bool = True,
) -> float:
    """Seconds of one pass on one GPU of its TP group (``fp8_casts``: see
    :func:`pass_arrays`).

    Example:
        >>> from pipedejavu.costmodel.analytical.ops import MemoryOp
        >>> gpu = GpuSheetEntry("X", 1e9, 1e12, (("fp32", 1e13),), 1, 1e11, 1e10)
        >>> c = AnalyticalConstants(memory_efficiency=1.0, kernel_overhead_s=0.0)
        >>> round(pass_seconds([MemoryOp("copy", 1e9)], gpu, c), 9)
        0.001
    """
    arrays = pass_arrays(ops, gpu, fp8_casts=fp8_casts)
    return float(stacked_seconds(stack_passes([arrays]), constants)[0])
