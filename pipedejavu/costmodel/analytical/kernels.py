"""Constants fitted on kernels timed on a GPU: the fused attention's.

:func:`fit_attention` fits the five fused-attention constants of
:class:`~pipedejavu.costmodel.analytical.roofline.AnalyticalConstants` on
measured forward and backward times of fused attention calls, through the
roofline's own rule (:func:`~pipedejavu.costmodel.analytical.roofline.
stacked_seconds`), so that the fit, the predictor, the planning tables and the
proof read one definition. ``benchmarks/gpu_attention.py`` times the calls and
fits on every other one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.costmodel.analytical.ops import Gemm
from pipedejavu.costmodel.analytical.roofline import (
    AnalyticalConstants,
    pass_arrays,
    stack_passes,
    stacked_seconds,
)

__all__ = ["ATTENTION_FIELDS", "attention_errors", "fit_attention"]

#: The fields :func:`fit_attention` fits, in its order.
ATTENTION_FIELDS = (
    "attention_softmax_exponentials",
    "attention_half_seconds",
    "attention_exponent",
    "attention_backward_half_seconds",
    "attention_backward_exponent",
)
_START = (0.5, 1e-5, 0.5, 1e-5, 0.5)
_LOWER = (0.0, 1e-8, 0.05, 1e-8, 0.05)
_UPPER = (10.0, 1e-2, 4.0, 1e-2, 4.0)


def _check(ops: Sequence[Gemm], seconds: Sequence[float]) -> NDArray[np.float64]:
    measured = np.asarray(seconds, dtype=np.float64)
    if len(ops) != len(measured) or not len(measured):
        raise ValueError("one measured time per fused attention call, at least one")
    if not (np.isfinite(measured) & (measured > 0)).all():
        raise ValueError("measured times must be positive")
    if not all(isinstance(op, Gemm) and op.attention for op in ops):
        raise ValueError("fused attention calls only (Gemm with attention=True)")
    return measured


def attention_errors(
    ops: Sequence[Gemm],
    seconds: Sequence[float],
    gpu: GpuSheetEntry,
    constants: AnalyticalConstants,
) -> NDArray[np.float64]:
    """f64[N] ``predicted / measured - 1`` of each call under ``constants``."""
    measured = _check(ops, seconds)
    stacked = stack_passes([pass_arrays([op], gpu) for op in ops])
    return stacked_seconds(stacked, constants) / measured - 1.0


def fit_attention(
    ops: Sequence[Gemm],
    seconds: Sequence[float],
    gpu: GpuSheetEntry,
    base: AnalyticalConstants,
) -> AnalyticalConstants:
    """``base`` with :data:`ATTENTION_FIELDS` fitting the measured calls:
    least squares on log time. ``ops`` mixes forward and backward calls (a
    backward's name ends in ``.backward``); both kinds are needed.

    Raises:
        ValueError: lengths differ, a time is not positive, an op is not a
            fused attention call, or a pass has no call.
    """
    measured = _check(ops, seconds)
    stacked = stack_passes([pass_arrays([op], gpu) for op in ops])
    if stacked.gemm_backward.all() or not stacked.gemm_backward.any():
        raise ValueError("fit_attention needs forward and backward calls")

    def constants(values) -> AnalyticalConstants:
        return dataclasses.replace(
            base, **dict(zip(ATTENTION_FIELDS, map(float, values), strict=True))
        )

    def residuals(values):
        return np.log(stacked_seconds(stacked, constants(values)) / measured)

    solution = least_squares(residuals, _START, bounds=(_LOWER, _UPPER), x_scale=_START)
    return constants(solution.x)
