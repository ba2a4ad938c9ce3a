"""The fused (flash) attention kernel's rule: its work and its time.

A fused attention call (:attr:`~pipedejavu.costmodel.analytical.ops.Gemm.
attention`) computes every score of the tiles it visits (:data:`ATTENTION_TILE`
queries by as many keys; a causal kernel computes the diagonal tiles whole),
at ``2 k`` matrix FLOPs per score and product plus the softmax's
exponentials, maxima and rescaling, which the tensor cores do not do: each
exponential costs the tensor FLOPs the GPU does in its time
(:func:`flops_per_exponential`). Its work ``w`` in seconds at peak takes
``(w ** p + h ** p) ** (1 / p)`` (:func:`fused_attention_seconds`): ``h`` a
floor, ``p < 1`` a slow approach to the peak. The roofline
(:func:`~pipedejavu.costmodel.analytical.roofline.stacked_seconds`) prices
every fused call with it; :mod:`~pipedejavu.costmodel.analytical.kernels`
fits its constants on timed calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.costmodel.analytical.ops import Gemm

__all__ = [
    "ATTENTION_TILE",
    "DEFAULT_FLOPS_PER_EXPONENTIAL",
    "MEASURED_ATTENTION",
    "computed_tiles",
    "flops_per_exponential",
    "fused_attention_seconds",
]

#: Queries (and keys) per tile of a fused attention kernel: FlashAttention and
#: cuDNN's fused attention tile both by 128 on Hopper and Ampere.
ATTENTION_TILE = 128
#: Tensor FLOPs per exponential on a GPU whose sheet entry does not give its
#: multiprocessors (a user's): Hopper's 16-bit ratio.
DEFAULT_FLOPS_PER_EXPONENTIAL = 256.0

#: The fused attention kernel's constants, fitted on cuDNN's fused attention
#: (the kernel behind Transformer Engine's ``FusedAttention``) timed on an
#: H200, bf16, causal, in ``benchmarks/results/gpu_attention.json``: every
#: other one of its 77 shapes (7 models' heads per GPU at TP 1-8, head
#: dimensions 64, 80 and 128, 1k-8k tokens, 1-4 sequences), the other half held
#: out, by :func:`pipedejavu.costmodel.analytical.kernels.fit_attention`;
#: ``tests/test_attention_kernel.py`` refits and compares; 32 shapes outside
#: that grid (head dimensions 96 and 256, 16k and 32k tokens,
#: ``gpu_attention_extended.json``) are held out whole. Across GPUs, they assume
#: each GPU's best fused kernel approaches its peak as cuDNN's does on Hopper,
#: with the softmax priced by that GPU's exponential units (not measured
#: elsewhere). The softmax costs 0.44 exponentials' time per score and product
#: (each score's forward computes one exponential for its two products: 0.5,
#: less what overlaps the matrix products); floors of 3.3 and 3.5
#: microseconds, exponents 0.47 (forward) and 0.35 (backward): a call of 1 ms
#: of work at peak runs at 87% (forward) and 69% (backward) of it, one of
#: 10 ms at 95% and 84%.
MEASURED_ATTENTION = {
    "attention_softmax_exponentials": 0.4447,
    "attention_half_seconds": 3.26e-06,
    "attention_exponent": 0.4733,
    "attention_backward_half_seconds": 3.49e-06,
    "attention_backward_exponent": 0.3513,
}


def flops_per_exponential(peak: float, gpu: GpuSheetEntry) -> float:
    """Tensor FLOPs at ``peak`` the GPU does in one exponential's time
    (:attr:`~pipedejavu.core.gpu_sheet.GpuSheetEntry.exponentials_per_s`;
    :data:`DEFAULT_FLOPS_PER_EXPONENTIAL` where the sheet does not say)."""
    rate = gpu.exponentials_per_s
    return DEFAULT_FLOPS_PER_EXPONENTIAL if rate is None else peak / rate


def computed_tiles(gemm: Gemm) -> float:
    """A fused attention kernel's computed work over its FLOPs: a causal one
    (``fraction < 1``) computes the diagonal tiles whole, ``(m + T) / m``;
    1 for any other GEMM."""
    if not gemm.attention or gemm.fraction >= 1.0:
        return 1.0
    return 1.0 + min(ATTENTION_TILE, gemm.m) / gemm.m


def fused_attention_seconds(
    matrix_seconds: NDArray[np.float64],
    depth: NDArray[np.float64],
    flops_per_exp: NDArray[np.float64],
    backward: NDArray[np.bool_],
    *,
    softmax_exponentials: float,
    half_seconds: Sequence[float],
    exponent: Sequence[float],
) -> NDArray[np.float64]:
    """f64[G] seconds of fused attention calls.

    Args:
        matrix_seconds: f64[G] the matrix FLOPs of the tiles computed, in
            seconds at peak.
        depth: f64[G] the head dimension ``k``.
        flops_per_exp: f64[G] :func:`flops_per_exponential` of each call.
        backward: bool[G] a backward call.
        softmax_exponentials: exponentials' time per score and product.
        half_seconds, exponent: ``(forward, backward)`` floor ``h`` and
            exponent ``p``.
    """
    softmax = softmax_exponentials * flops_per_exp
    work = np.maximum(matrix_seconds * (1.0 + softmax / (2.0 * depth)), 1e-30)
    floor = np.where(backward, half_seconds[1], half_seconds[0])
    p = np.where(backward, exponent[1], exponent[0])
    return work * (1.0 + (floor / work) ** p) ** (1.0 / p)
