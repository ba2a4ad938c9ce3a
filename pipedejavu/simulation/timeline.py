"""One iteration as bars: what each pipeline stage does, and when.

A :class:`Bar` is one busy interval of a stage (a rank of the pipeline): its
``kind``, ``F`` a forward, ``B`` a backward (under the zero-bubble schedules
its input-gradient half), ``W`` a weight gradient, ``T`` a transfer the stage
sends (an activation forward, a gradient back); the micro-batch and the model
chunk (``0`` without interleaving); start and end in seconds from the
iteration's start. :func:`timeline_bars` reads them off the result of any of
the simulators: 1F1B (:class:`~pipedejavu.simulation.simulate.SimulationResult`),
interleaved 1F1B (:class:`~pipedejavu.simulation.interleaved.InterleavedResult`)
and the zero-bubble schedules
(:class:`~pipedejavu.simulation.zero_bubble.ZeroBubbleResult`, which records
when commands end: their starts are the ends less the durations given).

Pictures (:mod:`pipedejavu.planning.plan_pictures`) draw these bars; what
lies between a stage's bars is its bubble.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from pipedejavu.simulation.interleaved import InterleavedResult
from pipedejavu.simulation.simulate import SimulationResult
from pipedejavu.simulation.zero_bubble import ZeroBubbleResult

__all__ = ["BAR_KINDS", "Bar", "timeline_bars"]

#: The kinds of bar, in the order pictures list them.
BAR_KINDS = {
    "F": "forward",
    "B": "backward",
    "W": "weight gradient",
    "T": "send (activation / gradient)",
}


class Bar(NamedTuple):
    """One busy interval of a stage (module docstring)."""

    stage: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


def _grid_bars(kind: str, starts: Any, ends: Any) -> list[Bar]:
    """Bars of ``[stage, chunk, microbatch]`` grids of starts and ends; NaN
    entries (nothing modelled) are left out."""
    out = []
    for (stage, chunk, microbatch), start in np.ndenumerate(starts):
        end = float(ends[stage, chunk, microbatch])
        if not (math.isnan(start) or math.isnan(end)):
            out.append(Bar(stage, kind, microbatch, chunk, float(start), end))
    return out


def timeline_bars(
    result: SimulationResult | InterleavedResult | ZeroBubbleResult,
    durations: tuple[ArrayLike, ArrayLike, ArrayLike] | None = None,
) -> tuple[Bar, ...]:
    """Every bar of one simulated iteration, by stage, then start.

    Args:
        result: a simulator's result.
        durations: for a :class:`ZeroBubbleResult`, the ``(forward,
            input_grad, weight_grad)`` seconds it was simulated with (f64[P]
            or f64[P, V]); not used otherwise.

    Raises:
        ValueError: a zero-bubble result without its durations, or another
            kind of result.
    """
    bars: list[Bar] = []
    if isinstance(result, SimulationResult):
        grids = (
            ("F", result.forward_start, result.forward_end),
            ("B", result.backward_start, result.backward_end),
        )
        for kind, starts, ends in grids:
            bars += _grid_bars(kind, starts[:, None, :], ends[:, None, :])
        # an activation leaves stage l, a gradient stage l + 1
        bars += _grid_bars(
            "T", result.activation_start[:, None, :], result.activation_end[:, None, :]
        )
        gradients = _grid_bars(
            "T", result.gradient_start[:, None, :], result.gradient_end[:, None, :]
        )
        bars += [bar._replace(stage=bar.stage + 1) for bar in gradients]
    elif isinstance(result, InterleavedResult):
        for kind, starts, ends in (
            ("F", result.forward_start, result.forward_end),
            ("B", result.backward_start, result.backward_end),
            ("T", result.activation_start, result.activation_end),
            ("T", result.gradient_start, result.gradient_end),
        ):
            bars += _grid_bars(kind, starts, ends)
    elif isinstance(result, ZeroBubbleResult):
        if durations is None:
            raise ValueError("a zero-bubble result needs the durations it ran")
        for kind, ends, seconds in zip(
            "FBW",
            (result.forward_end, result.input_grad_end, result.weight_grad_end),
            durations,
            strict=True,
        ):
            ends = ends if ends.ndim == 3 else ends[:, None, :]
            width = np.asarray(seconds, dtype=np.float64).reshape(ends.shape[:2])
            bars += _grid_bars(kind, ends - width[:, :, None], ends)
    else:
        raise ValueError(f"not a simulator's result: {type(result).__name__}")
    return tuple(sorted(bars, key=lambda bar: (bar.stage, bar.start, bar.end)))
