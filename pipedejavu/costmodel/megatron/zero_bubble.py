"""The pipeline phase of a plan under the ZB-H1 zero-bubble schedule.

Each stage's backward per micro-batch splits into ``B`` (input gradient, with
any recomputation) and ``W`` (its layers' weight-gradient operations,
:attr:`~pipedejavu.costmodel.megatron.sailor_data.LayerTimes.weight_grad`, plus
one instruction overhead: ``W`` is a command of its own); every pipeline runs
:func:`~pipedejavu.simulation.zero_bubble.simulate_zero_bubble` with each
boundary's transfer the slower of the activation and the gradient priced as for
1F1B, sent without blocking the sender (PyTorch's pipelining runtime posts its
sends and receives asynchronously).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import kinds_of
from pipedejavu.costmodel.megatron.long_pipelines import (
    PipelineSummary,
    every_pipeline,
    pipeline_summary,
)
from pipedejavu.costmodel.megatron.sailor_data import LayerTimes
from pipedejavu.simulation.timeline import Bar, timeline_bars
from pipedejavu.simulation.zero_bubble import ZeroBubbleResult, simulate_zero_bubble

__all__ = ["ZeroBubblePipelines", "stage_weight_grad", "zero_bubble_pipelines"]


class ZeroBubblePipelines(NamedTuple):
    """What :func:`zero_bubble_pipelines` returns.

    Attributes:
        ends: f64[S, dp] seconds at which each stage of each pipeline ends its
            last command.
        busy_s: seconds all GPUs compute, summed.
        peak_in_flight: i64[S] most micro-batches a stage holds (forward done,
            ``W`` not yet).
        weight_s: f64[S, dp] seconds of each stage's ``W`` per micro-batch.
        timeline: the slowest pipeline's bars, simulated in full when called.
    """

    ends: NDArray[np.float64]
    busy_s: float
    peak_in_flight: NDArray[np.int64]
    weight_s: NDArray[np.float64]
    timeline: Callable[[], tuple[Bar, ...]]


def stage_weight_grad(times: LayerTimes, start: int, stop: int) -> float:
    """Seconds of the weight-gradient operations of layers ``[start, stop)``.

    Raises:
        ProblemError: the times do not split the backward (profiles).
    """
    if times.weight_grad is None:
        raise ProblemError(
            "the zero-bubble schedule needs each layer's weight-gradient time, "
            "which the profiles do not give; price the model analytically"
        )
    return float(times.weight_grad[start:stop].sum())


def zero_bubble_pipelines(
    plan: Plan3D,
    times: Mapping[tuple[str, int], LayerTimes],
    overhead_s: float,
    forward: NDArray[np.float64],
    backward: NDArray[np.float64],
    transfer: NDArray[np.float64],
) -> ZeroBubblePipelines:
    """Time every pipeline of ``plan`` under ZB-H1.

    Args:
        plan: the plan.
        times: layer times by ``(gpu_type, tp)`` of every replica kind.
        overhead_s: seconds each command adds.
        forward, backward: f64[S, dp] seconds per micro-batch of each stage's
            forward and whole backward, one overhead each included.
        transfer: f64[S - 1, dp] seconds per micro-batch per direction over
            each boundary.

    Raises:
        ProblemError: the times do not split the backward.
    """
    stages, dp, count = plan.num_stages, plan.dp, plan.num_microbatches
    weight = np.zeros((stages, dp))
    for s, stage in enumerate(plan.stages):
        kinds = {(r.gpu_type, r.tp): 0.0 for r in kinds_of(stage.replicas)}
        for kind in kinds:
            kinds[kind] = stage_weight_grad(times[kind], stage.start, stage.stop)
        if len(kinds) == 1:
            weight[s] = next(iter(kinds.values()))
        else:
            weight[s] = [kinds[r.gpu_type, r.tp] for r in stage.replicas]
    work = (forward, backward - weight, weight + overhead_s, transfer)

    def simulated(j: int, m: int) -> ZeroBubbleResult:
        columns = (column[:, j] for column in work[:3])
        return simulate_zero_bubble(*columns, m, transfer=transfer[:, j])

    def run(j: int) -> PipelineSummary:
        def steps(m: int) -> PipelineSummary:
            result = simulated(j, m)
            last = np.maximum(
                result.input_grad_end.max(axis=1),
                result.weight_grad_end.max(axis=1),
            )
            return PipelineSummary(
                last, float(result.busy_time.sum()), result.peak_in_flight, None
            )

        return pipeline_summary(steps, count, num_stages=stages)

    ends, busy, peak = every_pipeline(run, *work)
    slowest = int(np.argmax(ends.max(axis=0)))

    def timeline() -> tuple[Bar, ...]:
        durations = tuple(column[:, slowest] for column in work[:3])
        return timeline_bars(simulated(slowest, count), durations)

    return ZeroBubblePipelines(ends, busy, peak, weight + overhead_s, timeline)
