"""The proof's stage bounds read at each stage's position, and its one-type
branch and bound: the chains of stages below the incumbent
(:mod:`pipedejavu.search.megatron.certify`, whose module docstring derives
the bounds; the tables of every span are
:mod:`~pipedejavu.search.megatron.bounds`')."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.search.megatron.bounds import StageTable
from pipedejavu.search.megatron.space import ConfigGroup, type_plan
from pipedejavu.search.megatron.transfers import SendRow
from pipedejavu.search.megatron.zero_bubble_paths import ZeroBubblePaths
from pipedejavu.simulation.zero_bubble import zero_bubble_in_flight

__all__ = [
    "Incumbent",
    "StageBounds",
    "chains",
    "crossed_to",
    "reach",
    "single_plans",
    "stages_after",
]

Table = NDArray[np.float64]


@dataclasses.dataclass
class Incumbent:
    """The best predicted time known; it falls as the proof finds better plans
    (the enumerations read it at each step)."""

    time_s: float


def stages_after(group: ConfigGroup, tp: int, left: int) -> tuple[int, int]:
    """Least and most stages after a stage at degree ``tp`` when it and the
    stages after it have ``left`` GPUs."""
    rest = left - tp
    return -(-rest // max(group.tps)), rest // min(group.tps)


class StageBounds:
    """A group's stage bounds for a stage with ``left`` GPUs for it and the
    stages after it (memory and the warm-up depend on how many follow).

    ``zero_bubble``: the tables are ZB-H1's, whose stages all hold ``min(P,
    B)`` micro-batches at their peak (:meth:`pipeline`); ``in_flight``: the
    least micro-batches every stage holds, whatever follows it (0: 1F1B's
    rule alone)."""

    def __init__(
        self,
        group: ConfigGroup,
        tables: dict[int, StageTable],
        overhead: float,
        zero_bubble: bool = False,
        in_flight: int = 0,
    ) -> None:
        self.group, self.tables, self.overhead = group, tables, overhead
        self.zero_bubble, self.in_flight = zero_bubble, in_flight
        self._weights: dict[tuple[int, int, Any], Table] = {}
        self._chain_weights: dict[tuple[int, int], Table] = {}
        self._chain_g: dict[int, NDArray[np.float64]] = {}
        self._g: dict[int, NDArray[np.float64]] = {}
        self._pipelines: dict[int, StageBounds] = {}
        self._paths: dict[int, ZeroBubblePaths | None] = {}

    def pipeline(self, size: int) -> StageBounds:
        """The bounds of the group's pipelines of ``size`` GPUs: these, but
        under ZB-H1 with one TP degree, where each of the ``P = size / tp``
        stages holds ``min(P, B)`` micro-batches at its peak (the predictor's
        own count, :func:`~pipedejavu.simulation.zero_bubble.
        zero_bubble_in_flight`), bounds whose memory rule asks that many of
        every stage (one per count: pipelines of ``B`` stages or more share
        theirs)."""
        if not self.zero_bubble or len(self.tables) != 1:
            return self
        (t,) = self.tables
        need = zero_bubble_in_flight(max(size // t, 1), self.group.steps)
        if need not in self._pipelines:
            self._pipelines[need] = StageBounds(
                self.group, self.tables, self.overhead, True, need
            )
        return self._pipelines[need]

    def paths(self, size: int) -> ZeroBubblePaths | None:
        """Under ZB-H1 with one TP degree, the path bound of the pipelines
        of ``size`` GPUs, two stages or more
        (:mod:`~pipedejavu.search.megatron.zero_bubble_paths`; its memory rule
        this object's); ``None`` otherwise."""
        if not self.zero_bubble or len(self.tables) != 1:
            return None
        ((t, table),) = self.tables.items()
        if table.paths is None:
            return None
        ranks, steps = size // t, self.group.steps
        if ranks < 2 or table.tail is None:
            return None
        if ranks not in self._paths:
            need = max(zero_bubble_in_flight(ranks, steps), self.in_flight)
            times = np.where(table.cap >= need, table.paths.times, np.inf)
            base = table.paths.work + 2 * ranks * self.overhead
            base += 2 * (ranks - 1) * table.paths.hop
            self._paths[ranks] = ZeroBubblePaths(times, table.tail, base, ranks, steps)
        return self._paths[ranks]

    def least(self, g: NDArray[np.float64], size: int, below: float) -> float:
        """The least bound of the pipelines of ``size`` GPUs: ``g[size,
        0]``, and where that is below ``below``, at least the path bound's
        least (:meth:`paths`)."""
        value = float(g[size, 0])
        paths = self.paths(size) if value < below else None
        return value if paths is None else max(value, paths.least())

    def weights(
        self, tp: int, left: int, send: tuple[Any, SendRow] | None = None
    ) -> Table:
        """``w[a, b]`` of a stage at degree ``tp`` followed by ``left - tp``
        GPUs of stages: ``inf`` where its memory cannot hold the micro-batches
        in flight. The warm-up bound: the stage's first backward waits for one
        micro-batch's forward to it (``F``), its own forward, the blocking
        pair over the boundary after it and the forward and backward of every
        layer after it (an overhead each per stage, and the least pair over
        each later boundary, ``StageTable.later``); before it the stage runs
        at most ``k = min(stages after + 1, B)`` forwards (the schedule's peak
        in flight), so ``B`` backwards, ``B - k`` forwards and their ``B - k``
        pairs over both boundaries follow (DeepSpeed's command stream:
        ``tests/test_megatron_certify.py`` checks the bound below every
        prediction; ZB-H1's, with input gradients ``B`` for the backwards
        after it, no pairs, and every ``B`` and ``W`` after the first ``B``:
        ``tests/test_zero_bubble_warmup_bound.py``). Memory: the stage holds
        at least ``min(fewest stages after + 1, B)`` micro-batches, and at
        least :attr:`in_flight`. ``send``: ``(name, SendRow)`` for a known
        next stage: its blocking transfers added to the first bound, and its
        link's bound."""
        key = (tp, left, None if send is None else send[0])
        if key not in self._weights:
            table = self.tables[tp]
            fewest, k, crossed = self.warm_up(tp, left)
            need = max(min(fewest + 1, self.group.steps), self.in_flight)
            # per-stage recomputation: the least over the counts that fit
            out = None
            for one in table.variants or (table,):
                bound = one.late + 2 * self.overhead * fewest
                bound -= k * one.fwd  # (in place: the bottleneck's hot loop)
                if crossed is not None:
                    bound += crossed[None, :]
                if send is None:
                    np.maximum(one.w, bound, out=bound)
                else:
                    add, link = send[1]
                    np.maximum(one.w + add[None, :], bound, out=bound)
                    np.maximum(bound, link[None, :], out=bound)
                np.putmask(bound, one.cap < need, np.inf)
                out = bound if out is None else np.minimum(out, bound, out=out)
            self._weights[key] = out
        return self._weights[key]

    def warm_up(
        self, tp: int, left: int
    ) -> tuple[int, int, NDArray[np.float64] | None]:
        """What the warm-up bound of a stage at degree ``tp`` with ``left``
        GPUs for it and the stages after reads of its position: the fewest
        stages after it, the most forwards ``k`` before its first backward,
        and by stop the pairs over the boundaries the round trip crosses after
        the next stage's (``None``: none counted)."""
        fewest, most = stages_after(self.group, tp, left)
        k = min(most + 1, self.group.steps)
        table = self.tables[tp]
        crossed = None
        if fewest > 1 and table.later is not None:
            # each later stage but the last holds a block and reruns it
            crossed = (fewest - 1) * (table.later + table.rerun)
        return fewest, k, crossed

    def row(
        self,
        tp: int,
        left: int,
        start: int,
        tails: Sequence[float] = (),
        reruns: Sequence[float] = (),
    ) -> NDArray[np.float64]:
        """``weights(tp, left)[start]``, and with ``tails`` (the
        :meth:`tail_after` of each stage before it, in order) at least the
        stage's gradient chain (``StageTable.chain``, and by the warm-up bound
        ``StageTable.warm_chain``) to an earlier stage ``r``, plus ``r``'s
        all-reduce and optimizer step, which follow its last backward.

        The chains count the layers' times and one overhead each way; the
        first forward crosses the ``n`` boundaries before the stage and runs
        on ``n`` stages, the last gradient crosses ``n - r`` boundaries back
        to ``r`` and runs backward on ``n - r`` stages, each with an overhead
        and (both ways over a boundary) at least its least blocking pair
        (``StageTable.earlier``); ``reruns``: what the block method adds to
        each of those stages' backward (:meth:`rerun_after`; none: 0)."""
        stage = self.weights(tp, left)[start]
        table = self.tables[tp]
        if not tails or table.chain is None or start == 0:
            return stage
        pair = 0.0 if table.earlier is None else float(table.earlier[start])
        most = reach(tails, reruns, len(tails), pair, self.overhead)
        if most == -math.inf:  # no tail tabled
            return stage
        return np.maximum(stage, self.chain_weights(tp, left)[start] + most)

    def rerun_after(self, tp: int, start: int) -> NDArray[np.float64]:
        """By stop, what the block method adds to each backward of a stage
        from ``start`` at degree ``tp`` (``StageTable.recomputed``; 0 where
        not tabled)."""
        table = self.tables[tp]
        if table.recomputed is None:
            return np.zeros(table.w.shape[1])
        return table.recomputed[start]

    def tail_row(self, tp: int, start: int) -> NDArray[np.float64]:
        """:meth:`tail_after` of every stop at once (``-inf`` where not
        tabled; ``inf`` off the stages)."""
        table = self.tables[tp]
        if table.tail is None:
            return np.full(table.w.shape[1], -np.inf)
        back = 0.0 if table.back is None else float(table.back[start])
        return table.tail[start] - back

    def tail_after(self, tp: int, start: int, stop: int) -> float:
        """A stage ``start..stop - 1`` at degree ``tp``: its least all-reduce
        and optimizer step less the backward of the layers before it
        (``StageTable.back``), what a later stage's gradient chain to stage 0
        adds for it (:meth:`row`; ``-inf``: not tabled)."""
        table = self.tables[tp]
        if table.tail is None:
            return -math.inf
        back = 0.0 if table.back is None else float(table.back[start])
        return float(table.tail[start, stop]) - back

    def bottleneck(self, most_gpus: int, chain: bool = False) -> NDArray[np.float64]:
        """``g[u, p]``: the least ``max w`` over chains of stages covering
        layers ``p..`` to the end on exactly ``u`` GPUs (sum of the stages' TP
        degrees); with ``chain``, of their gradient chains instead
        (:meth:`chain_weights`: what :func:`chains` adds to the tails of the
        stages before ``p``)."""
        done = self._chain_g if chain else self._g
        if most_gpus in done:
            return done[most_gpus]
        weight = self.chain_weights if chain else self.weights
        size = next(iter(self.tables.values())).w.shape[0]
        g = np.full((most_gpus + 1, size), np.inf)
        g[0, size - 1] = -np.inf  # nothing left to cover, no GPU used
        # a chain has at most size - 1 stages (a layer each or more): on more
        # GPUs than that many of the largest degree, none (g stays inf)
        for u in range(1, min(most_gpus, (size - 1) * max(self.tables)) + 1):
            best = g[u]
            for t in self.tables:
                # a stage a..b-1 at degree t, the rest from b on u - t GPUs
                # (none where no chain covers any rest on u - t GPUs: with one
                # degree, every u not a multiple of it)
                if t <= u and (g[u - t] < np.inf).any():
                    stage = weight(t, u)
                    rest = np.maximum(stage, g[u - t][None, :]).min(axis=1)
                    best = np.minimum(best, rest)
            g[u] = best
        done[most_gpus] = g
        return g

    def chain_weights(self, tp: int, left: int) -> Table:
        """The gradient chains of :meth:`row` before the reach is added (the
        larger of ``StageTable.chain`` and the warm-up's), ``inf`` where
        :meth:`weights` is (memory), ``-inf`` where none is tabled."""
        key = (tp, left)
        if key not in self._chain_weights:
            table = self.tables[tp]
            stage = self.weights(tp, left)
            if table.chain is None:
                out = np.where(np.isinf(stage), stage, -np.inf)
            else:
                out = table.chain.copy()
                if table.warm_chain is not None:
                    fewest, k, crossed = self.warm_up(tp, left)
                    warm = table.warm_chain + 2 * self.overhead * fewest
                    warm -= k * table.fwd
                    if crossed is not None:
                        warm += crossed[None, :]
                    np.maximum(out, warm, out=out)
                out[0, :] = -np.inf  # stage 0 has no chain before it
                out[np.isposinf(stage)] = np.inf
            self._chain_weights[key] = out
        return self._chain_weights[key]

    def least_pair(self) -> float:
        """The least blocking pair over any boundary (``StageTable.earlier``
        at the last layer; 0 where none is tabled)."""
        least = [t.earlier[-1] for t in self.tables.values() if t.earlier is not None]
        return float(min(least)) if least else 0.0


def crossed_to(position: int, r: int, pair: float, overhead: float) -> float:
    """What the first forward to stage ``position`` and the last gradient
    back from it to an earlier stage ``r`` cross beyond the layers' times
    (:meth:`StageBounds.row`): ``position`` boundaries forward and
    ``position - r`` back, each at least ``pair`` both ways, and an overhead
    per stage each way but the one the chains count (stage 0's on the way
    back, where ``r = 0``, is in ``G``)."""
    stages = position - 1 + position - r - (r == 0)
    return (position - r) * pair + stages * overhead


def reach(
    tails: Sequence[float],
    reruns: Sequence[float],
    position: int,
    pair: float,
    overhead: float,
) -> float:
    """The most a stage at ``position`` (stages before it: ``tails``, the
    :meth:`StageBounds.tail_after` of the first ones, and ``reruns``, their
    :meth:`StageBounds.rerun_after`; none: 0) adds past its gradient chain:
    over the earlier stages ``r``, ``r``'s tail, the reruns of the stages from
    ``r`` on and :func:`crossed_to` (``-inf`` with no tail)."""
    again = np.zeros(len(tails) + 1)  # the reruns of stages r.., by r
    if len(reruns) == len(tails):
        again[:-1] = np.cumsum(np.asarray(reruns, dtype=float)[::-1])[::-1]
    return max(
        (
            tail + again[r] + crossed_to(position, r, pair, overhead)
            for r, tail in enumerate(tails)
        ),
        default=-math.inf,
    )


def chains(
    bounds: StageBounds,
    g: NDArray[np.float64],
    size: int,
    best: Incumbent,
    least_first: bool = False,
) -> Iterator[list[tuple[int, int, int]]]:
    """Chains of ``(start, stop, tp)`` stages on exactly ``size`` GPUs whose every
    stage bound, and the bound of the rest, stay below ``best.time_s`` (read at
    each step: it falls as better plans are found). Depth first, the next
    stage shortest first (front stages hold the most micro-batches in flight
    under 1F1B: on GPT-3 175B this finds the best plans early, which lowers
    ``best``, a seventh of the plans against least bound first) or, with
    ``least_first``, of least bound (with the rest's) first: the first chain
    is then the bottleneck DP's."""
    last = g.shape[1] - 1
    top = float(g[size, 0])
    h = bounds.bottleneck(g.shape[0] - 1, chain=True)  # g's rows: once a group
    pair, o = bounds.least_pair(), bounds.overhead
    stack: list[tuple[int, int, tuple, float, tuple, tuple]] = [
        (0, size, (), top, (), ())
    ]
    while stack:
        start, left, stages, bound, tails, reruns = stack.pop()
        if bound >= best.time_s:
            continue
        if start == last:
            if left == 0:
                yield list(stages)
            continue
        # the stages after the next one: their gradient chains (h) plus the
        # least reach of the tails before them (StageBounds.row with the
        # least pair of any boundary)
        # (the next stage is stage n, the first after it stage n + 1)
        n = len(tails)
        earlier = reach(tails, reruns, n + 1, pair, o)
        children = []
        for t in bounds.tables:
            if t > left:
                continue
            stage = bounds.row(t, left, start, tails, reruns)
            row = np.maximum(stage, g[left - t])
            # and the next stage's own tail (r = n), all past its reruns
            most = np.maximum(
                earlier, bounds.tail_row(t, start) + crossed_to(n + 1, n, pair, o)
            )
            most += bounds.rerun_after(t, start)
            with np.errstate(invalid="ignore"):  # inf - inf: no such stage
                rest = h[left - t] + most
            np.maximum(row, np.where(np.isnan(rest), np.inf, rest), out=row)
            for stop in np.flatnonzero(row < best.time_s).tolist()[::-1]:
                children.append((float(row[stop]), stop, t))
        if least_first:  # else the shortest is popped first
            children.sort(reverse=True)  # the least bound is popped first
        for value, stop, t in children:
            chain = (*stages, (start, stop, t))
            more = (*tails, bounds.tail_after(t, start, stop))
            again = (*reruns, float(bounds.rerun_after(t, start)[stop]))
            stack.append((stop, left - t, chain, max(bound, value), more, again))


def single_plans(
    data: SailorData,
    model: str,
    gbs: int,
    group: ConfigGroup,
    bounds: StageBounds,
    g: NDArray[np.float64],
    size: int,
    best: Incumbent,
    rank_order: str = RANK_ORDERS[0],
    least_first: bool = False,
) -> Iterator[Plan3D]:
    """The plans of a one-type configuration left to predict, placed in
    ``rank_order`` (``least_first``: as :func:`chains`)."""
    for stages in chains(bounds, g, size, best, least_first):
        yield type_plan(data, model, stages, group, gbs, rank_order)
