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

__all__ = [
    "DIRECT_LIMIT",
    "PipelineSummary",
    "every_pipeline",
    "pipeline_summary",
]

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


def every_pipeline(
    run: Callable[[int], PipelineSummary], *columns: NDArray
) -> tuple[NDArray[np.float64], float, NDArray[np.int64]]:
    """Every pipeline of a plan, each distinct one simulated once.

    Args:
        run: summarizes pipeline ``j`` (e.g. :func:`pipeline_summary` of its
            simulation).
        columns: arrays ``[*, dp]`` of what a pipeline's time depends on
            (column ``j`` pipeline ``j``'s): pipelines with equal columns are
            simulated once (the first of them).

    Returns:
        ``(ends, busy_s, peak_in_flight)``: ``f64[S, dp]`` each pipeline's
        stage ends, the busy seconds of all pipelines summed in pipeline order,
        and ``i64[S]`` the most in flight on each stage over the pipelines.
    """
    stacked = np.concatenate([np.asarray(c, dtype=np.float64) for c in columns]).T
    if (stacked == stacked[:1]).all():  # every pipeline alike (replicas alike)
        first = np.zeros(1, dtype=np.intp)
        which = np.zeros(len(stacked), dtype=np.intp)
    else:
        _, first, which = np.unique(
            stacked, axis=0, return_index=True, return_inverse=True
        )
    summaries = [run(j) for j in first.tolist()]
    which = which.reshape(-1)
    ends = np.stack([summary.ends for summary in summaries], axis=1)[:, which]
    busy = 0.0
    for index in which.tolist():  # the order the pipelines come in
        busy += summaries[index].busy_s
    peak = np.zeros(len(ends), dtype=np.int64)
    for summary in summaries:
        peak = np.maximum(peak, summary.peak_in_flight)
    return ends, busy, peak
