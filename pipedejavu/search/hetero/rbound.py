"""A lower bound from the block relaxation R, refined by the cap branch and bound.

R (:mod:`pipedejavu.search.hetero.dp`) admits every valid plan at its exact
cost (it forgets only which hosts hold the blocks), and one lumped memory
bucket only admits more stages, so ``S_R(c) <= S(c)`` for every cap ``c``.
Every plan's bottleneck is one of the candidate caps
(:func:`pipedejavu.search.hetero.units.candidate_caps`, all ``>=`` R's least
bottleneck); a plan whose bottleneck is a solved cap ``c`` costs ``>=
max(S_R(c) + (B - 1) c, B c)``, one whose bottleneck lies strictly between
solved caps ``c_a < c_b`` costs ``>= max(S_R(c_b) + (B - 1) c_a', B c_a')``
(``c_a'`` the next candidate; ``S_R`` does not increase with the cap), and one
above the last solved cap costs ``>= B`` times the next candidate. The bound is
the least of these pieces. :func:`pipedejavu.search.alpa.caps.search_caps` decides
which caps to solve, pruning a piece once it reaches the best point bound so
far, the incumbent or a plan found on the way: the piece holding the optimum's
bottleneck is at most the optimum, so it is never pruned before it matters.

**Enough is enough.** With a known plan of cost ``U`` (the incumbent, or a
cheaper plan found on the way) and ``P`` the least piece so far, a piece is
also pruned once it reaches ``P - gap_rtol (U - P)``: the result is then at
least that, and since the exact refinement's result ``R*`` is ``<= P``, the
distance ``U - bound`` is at most ``(1 + gap_rtol) (U - R*)``, while the last
passes (at caps a hair apart, each as dear as the first) are saved. When the
bound proves ``U`` optimal (``P = U``) nothing is given up; with no plan
known the refinement is exact. Pieces pruned against an earlier, lower
target are refined again once ``U`` or ``P`` moved (solved caps are reused).

**Plans on the way.** When R's optimal plan under a cap packs onto the hosts
and obeys the memory rule (:mod:`pipedejavu.search.hetero.place`), it is a
valid plan; ``plan_fn`` receives it (the engine keeps the best).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pipedejavu.core.hetero_rules import make_hetero_plan
from pipedejavu.search.alpa.caps import search_caps
from pipedejavu.search.hetero.dp import Interrupted, solve_relaxed
from pipedejavu.search.hetero.exact import between_caps_bound, memory_ok
from pipedejavu.search.hetero.place import realize, stage_tuples
from pipedejavu.search.hetero.units import build, candidate_caps

__all__ = ["relaxed_bound"]


def _cover(sums: dict[int, float], caps: np.ndarray, batches: int) -> float:
    """The least bound over the pieces (module docstring)."""
    bound = math.inf
    for index, total in sums.items():
        cap = float(caps[index])
        bound = min(bound, max(total + (batches - 1) * cap, batches * cap))
    return min(bound, between_caps_bound(sums, caps, batches))


def relaxed_bound(
    problem,
    *,
    incumbent: float = math.inf,
    deadline: float = math.inf,
    plan_fn: Callable[[Any], None] | None = None,
    gap_rtol: float = 0.05,
):
    """A lower bound (s) on every valid plan; ``-inf`` when the deadline
    passed before the first cap; ``inf`` when no plan exists. ``plan_fn``
    receives every valid plan found on the way (a :class:`HeteroPlan`);
    ``gap_rtol``: the refinement stops once it could narrow the distance from
    the cheapest known plan by no more than this share of it (module
    docstring; 0: exact)."""
    if not gap_rtol >= 0:
        raise ValueError(f"gap_rtol must be >= 0, got {gap_rtol}")
    setup = build(problem)
    best = [incumbent]  # the least piece or plan cost so far
    upper = [incumbent]  # the cheapest known plan

    def offer(units) -> None:
        if units is None or not memory_ok(setup, units):
            return
        placement = realize(problem, setup, units)
        if placement is None:
            return
        plan = make_hetero_plan(
            problem, stage_tuples(units), method="diff", placement=placement
        )
        best[0] = min(best[0], plan.cost)
        upper[0] = min(upper[0], plan.cost)
        if plan_fn is not None:
            plan_fn(plan)

    batches = problem.num_microbatches
    try:
        smallest = solve_relaxed(setup, math.inf, np.maximum, 1, deadline).value
    except Interrupted:
        return -math.inf
    if not math.isfinite(smallest):
        return math.inf
    caps = candidate_caps(setup, smallest)
    sums: dict[int, float] = {}

    def target() -> float:
        if not math.isfinite(upper[0]):
            return best[0]
        return best[0] - gap_rtol * max(upper[0] - best[0], 0.0)

    def solve_at(index: int) -> float:
        if index in sums:  # solved in an earlier round
            return sums[index]
        cap = float(caps[index])
        relaxed = solve_relaxed(setup, cap, np.add, 1, deadline)
        total = sums[index] = relaxed.value
        offer(relaxed.units)
        best[0] = min(best[0], max(total + (batches - 1) * cap, batches * cap))
        return total

    try:
        while True:
            solved = len(sums)
            search_caps(caps, solve_at, target, batches)
            # Pieces pruned against an earlier target may sit below this one.
            if len(sums) == solved or min(_cover(sums, caps, batches), best[0]) >= (
                target()
            ):
                break
    except Interrupted:
        if not sums:
            return -math.inf
    return min(_cover(sums, caps, batches), best[0])
