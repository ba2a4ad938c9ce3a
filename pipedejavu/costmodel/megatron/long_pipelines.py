"""Pipelines of many micro-batches, simulated in bounded time.

A pipeline's schedule is periodic once it is past its warm-up: with fixed
per-micro-batch times, every further micro-batch (or group of ``step``
micro-batches, for schedules that need a multiple of the stages) moves each
stage's finishing time by the same amount. :func:`pipeline_summary` therefore
simulates ``m0``, ``m0 + step``, ``m0 + 2 step`` and ``m0 + 3 step``
micro-batches, and when the three increments agree (to ``1e-9`` relative) it
extends them linearly to the real count; otherwise it simulates the real
count. Busy time is exactly linear in the count; the peak in flight does not
grow past the warm-up. ``tests/test_long_pipelines.py`` compares the
extrapolation with the full simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = ["DIRECT_LIMIT", "PipelineSummary", "pipeline_summary"]

#: Micro-batch counts up to this many are always simulated directly.
DIRECT_LIMIT = 256


class PipelineSummary(NamedTuple):
    """What the predictor reads of a simulated pipeline.

    Attributes:
        ends: f64[S] seconds at which each stage ends its last backward.
        busy_s: seconds all its stages compute, summed.
        peak_in_flight: i64[S] most micro-batches (or chunks) a stage holds.
        peak_memory: f64[S] the most stashed bytes, or ``None``.
    """

    ends: NDArray[np.float64]
    busy_s: float
    peak_in_flight: NDArray[np.int64]
    peak_memory: NDArray[np.float64] | None


def pipeline_summary(
    run: Callable[[int], PipelineSummary],
    count: int,
    *,
    num_stages: int,
    step: int = 1,
) -> PipelineSummary:
    """``run(count)``, extrapolated from shorter runs when ``count`` is large.

    Args:
        run: simulates the pipeline with that many micro-batches.
        count: the real micro-batch count.
        num_stages: stages (sets where the warm-up surely ended).
        step: counts must stay multiples of it (and so must ``count``).
    """
    first = step * max(-(-(4 * num_stages + 8) // step), 1)
    if count <= max(DIRECT_LIMIT, 4 * (first + 3 * step)):
        return run(count)
    runs = [run(first + k * step) for k in range(4)]
    gaps = [runs[k + 1].ends - runs[k].ends for k in range(3)]
    scale = np.maximum(np.abs(gaps[0]), 1e-300)
    if not all(np.all(np.abs(g - gaps[0]) <= 1e-9 * scale) for g in gaps[1:]):
        return run(count)
    groups = (count - first) // step
    ends = runs[0].ends + groups * gaps[0]
    busy = runs[0].busy_s * count / first
    memory = runs[-1].peak_memory
    return PipelineSummary(ends, busy, runs[-1].peak_in_flight, memory)
