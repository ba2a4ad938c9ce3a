"""Polish a plan's cuts under the predictor, where its proof was left open.

A proof that spends its prediction budget
(:func:`~pipedejavu.search.megatron.certify.certify_predicted`) certifies a
lower bound but keeps the best plan it has met, which may lie far from the
best of its configuration: the search's planning objective (1F1B's
``sum + (B - 1) max``) favours equal stages, while under ZB-H1 with fewer
micro-batches than stages the predicted time rewards heavier early and middle
stages and lighter late ones (Llama-3.1-405B on 16,384 H100: the search's
16 stages of 8 layers predict 5.637 s, stages of 8, 8, 8, 8, 9, 9, 10, 10,
10, 8, 8, 5, 6, 7, 7, 7 layers 5.513 s: ``benchmarks/results/
zero_bubble_landscape.json``).

:func:`polish_cuts` walks from the plan by moving one layer from one stage to
another (every pair of stages, nearest pairs first; the stages keep their
GPUs, TP degrees and order), taking each move the predictor says is faster and
fits in memory, until a full round of moves gains nothing or the prediction
budget is spent. It finds a local optimum of those moves, not the optimum:
the proof's certified bound still says how far the plan can be from it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError

__all__ = ["polish_cuts", "with_sizes"]


def with_sizes(plan: Plan3D, sizes: list[int]) -> Plan3D:
    """``plan`` with its stages holding ``sizes`` layers each, in order (the
    same replicas, TP degrees and layout).

    Raises:
        ProblemError: ``sizes`` not one count per stage adding up to the
            plan's layers (or a count below 1).
    """
    if len(sizes) != plan.num_stages or sum(sizes) != plan.num_layers:
        raise ProblemError(
            f"{len(sizes)} stage sizes adding up to {sum(sizes)} layers for a "
            f"plan of {plan.num_stages} stages and {plan.num_layers} layers"
        )
    stages, start = [], 0
    for stage, size in zip(plan.stages, sizes, strict=True):
        stages.append(dataclasses.replace(stage, start=start, stop=start + size))
        start += size
    return plan.replace(stages=tuple(stages))


def polish_cuts(
    plan: Plan3D,
    time_s: float,
    predict: Callable[[Plan3D], float],
    max_predictions: int,
    tick: Callable[[], object] | None = None,
) -> tuple[Plan3D, float, int]:
    """A local optimum of single-layer moves from ``plan`` (module docstring).

    Args:
        plan: where to start; ``time_s`` its predicted time (``inf`` where it
            does not fit: any fitting move is then taken).
        predict: a plan's predicted time, ``inf`` where it does not fit in
            memory or cannot be priced.
        max_predictions: most calls of ``predict``.
        tick: called at most once a second while it runs (progress).

    Returns:
        ``(plan, time_s, predictions)``: the best plan met (``plan`` itself
        when no move was faster), its time, and the calls made.
    """
    sizes = [stage.num_layers for stage in plan.stages]
    count = len(sizes)
    moves = sorted(
        ((i, j) for i in range(count) for j in range(count) if i != j),
        key=lambda move: (abs(move[0] - move[1]), move),
    )
    used = index = idle = 0
    left: list[int] | None = None  # the sizes the last move left (known slower)
    ticked = time.perf_counter()
    while moves and used < max_predictions and idle < len(moves):
        source, target = moves[index % len(moves)]
        index += 1
        idle += 1
        moved = list(sizes)
        moved[source] -= 1
        moved[target] += 1
        if moved[source] < 1 or moved == left:
            continue
        if tick is not None and time.perf_counter() - ticked > 1.0:
            tick()
            ticked = time.perf_counter()
        candidate = with_sizes(plan, moved)
        used += 1
        value = predict(candidate)
        if value < time_s:
            plan, time_s, left, sizes, idle = candidate, value, sizes, moved, 0
    return plan, time_s, used
