"""The proof's ZB-H1 bound over paths through several stages.

Under ZB-H1 with fewer micro-batches than stages (``M < P``, what a large pool
with a fixed global batch gives) the predicted time is not set by one stage:
the first micro-batch runs forward through every stage and its input gradient
``B`` back; a stage whose warm-up is shorter than ``M`` then alternates
forwards and ``B`` passes, and the gradients of the later micro-batches come
back through the earlier stages, each of which runs its own ``B`` and ``W``
passes in the order of :func:`~pipedejavu.simulation.zero_bubble.
zero_bubble_order`. The schedule's order is fixed, so the predicted time is at
least the length of every path through its commands (each command waits for
the one before it on its rank and for the command it needs; a boundary's
message takes at least its least transfer). This module bounds a chain of
stages by such paths, in a form a search over the cuts can read stage by
stage:

* every path below runs ``F`` of the first micro-batch on every rank and one
  ``B`` on every rank (the *base*: the forward and input gradient of every
  layer, two overheads per stage, and both ways over every boundary); the base
  is the same for every chain of ``P`` stages;
* **one pivot** ``s``: the first micro-batch's round trip, then rank ``s``'s
  commands from its first ``B`` to its last (or from its first forward to its
  last, then the last micro-batch through the later stages), the last
  gradient back to rank 0 and rank 0's commands after its last ``B``: the base
  plus ``E_s`` (what rank ``s`` runs beyond its share of the base) plus rank
  0's trailing ``W`` passes;
* **two pivots** ``s < t`` and a micro-batch ``j``: the round trip down to
  ``t``, rank ``t``'s commands from its first ``B`` to ``B_j`` (``X_t(j)``
  beyond the base), ``B_j`` down to ``s``, rank ``s``'s from ``B_j`` to its
  last ``B`` (``Y_s(j)``), then as above. Two heavy stages, one late and one
  early, both count (the single-stage bounds of
  :mod:`~pipedejavu.search.megatron.bounds` see one at a time);
* stage 0's all-reduce and optimizer step follow its last command.

So a chain's predicted time is at least ``base + trail_0 + max(max_s E_s,
max_{s<t, j} Y_s(j) + X_t(j))``. The proof reads the least of it over every
chain of a configuration (:meth:`ZeroBubblePaths.least`): stage 0's part
exactly, the rest by bottleneck tables (the least over chains of the rest of
``max E`` and, per ``j``, of ``max X(j)``, each on its own, so a relaxation).
A configuration whose least reaches the incumbent holds no better plan.
``tests/test_zero_bubble_paths.py`` checks the bound of single chains
(:meth:`ZeroBubblePaths.chain`) below the schedule's simulation and the
predictor on random stages and plans, and exact on equal stages.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.costmodel.megatron.rules import span_sums
from pipedejavu.costmodel.megatron.sailor_data import LayerTimes
from pipedejavu.simulation.zero_bubble import zero_bubble_order

__all__ = [
    "PathCounts",
    "PathTimes",
    "ZeroBubblePaths",
    "path_counts",
    "path_times",
]

Table = NDArray[np.float64]
_SHARE = np.array([0.0, 1.0, 0.0])  # the base's B on a rank (its F_0 aside)


class PathCounts(NamedTuple):
    """Commands ``(F, B, W)`` each rank runs on the paths beyond the base.

    Attributes:
        single: ``f64[P, 2, 3]`` the one-pivot paths of each rank (the second
            a repeat of the first where the forward path does not apply).
        late: ``f64[P, M, 3]`` ``X_t(j)``, rank ``t`` from its first ``B`` to
            ``B_j``.
        early: ``f64[P, M, 3]`` ``Y_s(j)``, rank ``s`` from ``B_j`` to its
            last ``B``.
        trail: ``f64[3]`` rank 0's commands after its last ``B``.
    """

    single: NDArray[np.float64]
    late: NDArray[np.float64]
    early: NDArray[np.float64]
    trail: NDArray[np.float64]


class PathTimes(NamedTuple):
    """What :mod:`~pipedejavu.search.megatron.zero_bubble_paths` reads of a
    kind under ZB-H1: ``times``, ``f64[3, L + 1, L + 1]``, a stage's forward,
    input gradient (the fewest reruns in it) and weight gradient, an overhead
    each; ``work``, the forward and input gradient of every layer (no
    overhead, no rerun); ``hop``, the least a message takes over any boundary
    one way (half the least round trip of any pipeline)."""

    times: NDArray[np.float64]
    work: float
    hop: float


def path_times(
    times: LayerTimes,
    starts: NDArray[np.int64],
    stops: NDArray[np.int64],
    again: NDArray[np.float64],
    overhead: float,
    hop: float,
) -> PathTimes:
    """:class:`PathTimes` of a kind's layer ``times`` (``again``: each
    span's fewest reruns)."""
    size = int(stops.max()) + 1
    table = np.full((3, size, size), np.inf)
    grad = times.weight_grad
    table[0][starts, stops] = span_sums(times.forward, starts, stops) + overhead
    table[1][starts, stops] = span_sums(times.backward - grad, starts, stops)
    table[1][starts, stops] += again + overhead
    table[2][starts, stops] = span_sums(grad, starts, stops) + overhead
    work = float(np.sum(times.forward) + np.sum(times.backward - grad))
    return PathTimes(table, work, hop if np.isfinite(hop) else 0.0)


def _commands(rank: int, ranks: int, count: int) -> list[tuple[str, int]]:
    return [
        ("W" if op.weight else "B" if op.backward else "F", op.microbatch)
        for op in zero_bubble_order(rank, ranks, count)
    ]


def _tally(commands) -> NDArray[np.float64]:
    """``(F, B, W)`` counts of ``commands``."""
    return np.array([sum(1 for k, _ in commands if k == c) for c in "FBW"], float)


def _between(commands, first, last) -> NDArray[np.float64]:
    """:func:`_tally` of the commands from ``first`` to ``last`` (both run on
    the path; ``first`` runs before ``last`` in every use)."""
    i, j = commands.index(first), commands.index(last)
    return _tally(commands[i : j + 1])


@functools.cache
def path_counts(ranks: int, count: int) -> PathCounts:
    """The paths' command counts for ``P = ranks`` stages and ``M = count``
    micro-batches (module docstring)."""
    last, end = ranks - 1, count - 1
    orders = [_commands(r, ranks, count) for r in range(ranks)]
    zero = orders[0]
    trail = _tally(zero[zero.index(("B", end)) + 1 :])
    # The forward path (all of a rank's forwards, then the last micro-batch
    # through the later ranks) adds nothing on the last rank only when that
    # rank runs the last micro-batch's F and B back to back.
    forward_path = _between(orders[last], ("F", end), ("B", end)).tolist() == [1, 1, 0]
    single = np.zeros((ranks, 2, 3))
    late = np.zeros((ranks, count, 3))
    early = np.zeros((ranks, count, 3))
    for r, commands in enumerate(orders):
        own = np.array([1.0, 1.0, 0.0]) if r == last else _SHARE
        first = ("F", 0) if r == last else ("B", 0)
        single[r, 0] = _between(commands, first, ("B", end)) - own
        single[r, 1] = single[r, 0]
        if forward_path and r < last:
            single[r, 1] = _between(commands, ("F", 0), ("F", end)) - [1, 0, 0]
        for j in range(count):
            late[r, j] = _between(commands, first, ("B", j)) - own
            early[r, j] = _between(commands, ("B", j), ("B", end)) - _SHARE
    return PathCounts(single, late, early, trail)


class _State(NamedTuple):
    """What the stages fixed so far give the bound: stage 0's trailing commands
    and tail (``nan`` before it is fixed), the largest one-pivot part, per
    ``j`` the largest ``Y_s(j)`` and the largest two-pivot part among them."""

    trail: float
    single: float
    early: NDArray[np.float64]
    pair: float


class ZeroBubblePaths:
    """The path bound of the chains of ``P`` stages of one kind (module
    docstring).

    Args:
        times: ``f64[3, L + 1, L + 1]`` a stage ``a..b-1``'s forward, input
            gradient (its recomputation in it) and weight gradient, one
            overhead each (``inf`` off the upper triangle and where its memory
            cannot hold the micro-batches in flight).
        tail: ``f64[L + 1, L + 1]`` a stage's least all-reduce and optimizer
            step.
        base: the base (module docstring).
        ranks, count: ``P`` and ``M``.
    """

    def __init__(
        self, times: Table, tail: Table, base: float, ranks: int, count: int
    ) -> None:
        self.base, self.ranks = base, ranks
        self.counts = counts = path_counts(ranks, count)
        size = times.shape[1]
        # no stage where the forward is inf: the times read as 0 there (a
        # command count of 0 times them is no command), the weights as inf
        self._finite = np.where(np.isinf(times), 0.0, times)
        self._blocked = np.isinf(times[0])
        self.trail = self._weights(counts.trail, 0) + tail[0]
        # bottleneck tables of the rest, by first position n and layer p
        self.single_rest = np.full((ranks + 1, size), np.inf)
        self.late_rest = np.full((ranks + 1, count, size), np.inf)
        self.single_rest[ranks, -1] = -np.inf
        self.late_rest[ranks, :, -1] = -np.inf
        for n in range(ranks - 1, -1, -1):
            one = self._weights(counts.single[n]).max(axis=0)
            self.single_rest[n] = np.maximum(one, self.single_rest[n + 1]).min(axis=1)
            late = self._weights(counts.late[n])
            rest = self.late_rest[n + 1][:, None, :]
            self.late_rest[n] = np.maximum(late, rest).min(axis=2)

    def _weights(self, counts: NDArray[np.float64], start: int | None = None) -> Table:
        """``counts @ times`` (of the stages from ``start`` when given)."""
        if start is None:
            out = np.tensordot(counts, self._finite, 1)
            out[..., self._blocked] = np.inf
        else:
            out = np.tensordot(counts, self._finite[:, start], 1)
            out[..., self._blocked[start]] = np.inf
        return out

    def least(self) -> float:
        """The least bound over every chain of ``P`` stages."""
        return float(np.min(self._row(self._start(), 0, 0)[0]))

    def chain(self, cuts: list[int]) -> float:
        """The bound of one chain, its stages' boundaries ``cuts`` (from 0 to
        the last layer)."""
        state, value = self._start(), -np.inf
        for n, (start, stop) in enumerate(zip(cuts, cuts[1:], strict=False)):
            row, parts = self._row(state, n, start)
            value = float(row[stop])
            state = self._child(state, parts, stop)
        return value

    def _start(self) -> _State:
        early = np.full(self.counts.early.shape[1], -np.inf)
        return _State(np.nan, -np.inf, early, -np.inf)

    def _row(
        self, state: _State, position: int, start: int
    ) -> tuple[NDArray[np.float64], tuple]:
        """The bound of every next stage ``start..b-1`` at ``position`` (by
        ``b``), the rest bounded by the tables, and what :meth:`_child`
        reads."""
        counts = self.counts
        single = np.maximum(
            state.single, self._weights(counts.single[position], start).max(axis=0)
        )
        late = self._weights(counts.late[position], start)  # [M, L + 1]
        early = np.maximum(
            state.early[:, None], self._weights(counts.early[position], start)
        )
        # -inf + inf (no earlier stage, or nothing left, beside a stage that
        # cannot be): NaN, which the value reads as inf, as that stage is
        with np.errstate(invalid="ignore"):
            pair = np.maximum(state.pair, (state.early[:, None] + late).max(axis=0))
            rest = (early + self.late_rest[position + 1]).max(axis=0)
        ahead = np.maximum(self.single_rest[position + 1], rest)
        trail = self.trail if position == 0 else state.trail
        value = self.base + trail + np.maximum(np.maximum(single, pair), ahead)
        value[np.isnan(value)] = np.inf
        return value, (single, early, pair)

    def _child(self, state: _State, parts: tuple, stop: int) -> _State:
        """The state once the next stage ends at ``stop``."""
        single, early, pair = parts
        trail = float(self.trail[stop]) if np.isnan(state.trail) else state.trail
        parts = float(single[stop]), early[:, stop].copy(), float(pair[stop])
        return _State(trail, *parts)
