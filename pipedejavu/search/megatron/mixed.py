"""The proof's bounds on plans whose stages run on different GPU types
(``mixed_types``; :mod:`pipedejavu.search.megatron.certify`, module docstring).

Per (mbs, dp, TP) (:class:`~pipedejavu.search.megatron.space.Mix`) a coarse DP
over (layers covered, stages left per type, the next stage's type) bounds every
vector of stage counts per type (:func:`mixed_bottleneck`; placements and the
previous neighbour taken at their cheapest); :class:`PlacedMix` gives a vector
its exact-placement bound and enumerates its plans.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import DEFAULT_ZONE, Plan3D
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.rules import is_blocking, message_bytes
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import plan_from_mixed_stages
from pipedejavu.search.megatron.bounds import StageTable, kind_bounds
from pipedejavu.search.megatron.chains import Incumbent, StageBounds
from pipedejavu.search.megatron.space import Mix
from pipedejavu.search.megatron.transfers import (
    BoundCache,
    Kind,
    SendRow,
    kind_times,
    layer_bounds,
    link_rows,
    pipeline_transfers,
)

__all__ = [
    "WEIGHT_TABLES",
    "PairRows",
    "PlacedMix",
    "PlanSource",
    "coarse_mixed_bound",
    "mixed_bottleneck",
    "mixed_weights",
    "refine",
]

#: A stage of a mixed plan: (GPU type, its index among the stages of its type).
Stage = tuple[str, int]
#: The plans of a configuration left to predict, read against the incumbent.
PlanSource = Callable[[Incumbent], Iterator[Plan3D]]


class PairRows(NamedTuple):
    """Over the boundaries between two stages of known placement: the least
    and dearest blocking time per micro-batch of any pipeline (``f64[L - 1]``,
    0 where buffered) and the link bound by the first stage's stop
    (``f64[L + 1]``)."""

    least: NDArray[np.float64]
    dearest: NDArray[np.float64]
    link: NDArray[np.float64]


def mixed_bottleneck(
    mix: Mix,
    bounds: dict[str, StageBounds],
    sends: dict[tuple[Kind, Kind], SendRow],
    limit: int,
) -> dict | None:
    """``{(counts, type): g[p]}``: the least ``max w`` over chains covering
    layers ``p..`` to the end with ``counts[i]`` stages of the ``i``-th type of
    ``mix.caps`` and the first stage of ``type`` (each stage's bound counts its
    blocking transfers to the next one). Built for count vectors with up to
    ``mix.max_stages`` stages, in increasing total; ``None`` if more than
    ``limit`` vectors would be needed."""
    types = [gpu for gpu, _ in mix.caps]
    caps = [cap for _, cap in mix.caps]
    vectors = [
        c
        for c in itertools.product(*(range(cap + 1) for cap in caps))
        if sum(c) <= mix.max_stages
    ]
    if len(vectors) > limit:
        return None
    vectors.sort(key=sum)
    size = bounds[types[0]].tables[mix.tp].w.shape[0]
    end = np.full(size, np.inf)
    end[size - 1] = -np.inf
    g: dict = {}
    for c in vectors:
        k = sum(c)
        if k == 0:
            continue
        for i, gpu in enumerate(types):
            if c[i] == 0:
                continue
            rest = c[:i] + (c[i] - 1,) + c[i + 1 :]
            best = np.full(size, np.inf)
            for after in types:
                tail = end if k == 1 else g.get((rest, after))
                if tail is None or (k == 1 and after != gpu):
                    continue
                stage = mixed_weights(mix, bounds, sends, gpu, after, k)
                best = np.minimum(best, np.maximum(stage, tail[None, :]).min(axis=1))
            g[(c, gpu)] = best
    return g


def coarse_mixed_bound(mix: Mix, bounds: dict[str, StageBounds]) -> float:
    """A lower bound on every mixed plan of ``mix`` that ignores the per-type
    stage counts and the transfers to the next stage."""
    size = next(iter(bounds.values())).tables[mix.tp].w.shape[0]
    g = np.full(size, np.inf)
    g[size - 1] = -np.inf
    least = math.inf
    for k in range(1, mix.max_stages + 1):
        stage = np.min([b.weights(mix.tp, k * mix.tp) for b in bounds.values()], axis=0)
        g = np.maximum(stage, g[None, :]).min(axis=1)
        if k >= 2:
            least = min(least, float(g[0]))
    return least


def mixed_weights(
    mix: Mix,
    bounds: dict[str, StageBounds],
    sends: dict[tuple[Kind, Kind], SendRow],
    gpu: str,
    after: str,
    k: int,
) -> NDArray[np.float64]:
    """Bounds of a stage of type ``gpu`` followed by ``k - 1`` stages, the next
    of type ``after``."""
    row = sends[((gpu, mix.tp), (after, mix.tp))]
    return bounds[gpu].weights(mix.tp, k * mix.tp, send=(after, row))


def refine(
    placed: PlacedMix,
    gpus: Mapping[str, int],
    gbs: int,
    counts: tuple[int, ...],
    limit: int,
) -> tuple[float, PlanSource | None]:
    """A mixed item's exact-placement bound and its plans left to predict;
    ``(-inf, None)`` (left open at its coarse bound) when its DP would have
    more than ``limit`` count vectors."""
    if math.prod(c + 1 for c in counts) > limit:
        return -math.inf, None
    value, g = placed.value(counts)
    return value, functools.partial(placed.plans, gpus, gbs, counts, g)


# Most (L + 1) x (L + 1) weight tables the mixes of one proof keep at once
# (about 170 MB at L = 26, 300 MB at L = 35); beyond, they are recomputed.
WEIGHT_TABLES = 30_000


class PlacedMix:
    """Exact-placement bounds of the mixed plans of one
    :class:`~pipedejavu.search.megatron.space.Mix` with a given number of
    stages per type (``counts``, one entry per ``mix.caps``).

    With the counts fixed, every stage's placement is known from its type and
    how many stages of its type come before it (Megatron's rank order:
    :func:`~pipedejavu.costmodel.megatron.tables.plan_from_mixed_stages`), so
    a stage's bound can price, exactly:

    * its data-parallel all-reduce at the offset its replicas have in a node;
    * the blocking transfers over both its boundaries, with the actual
      neighbour kinds and placements: in pipeline ``j`` a stage is busy for
      ``R_j + S_j`` per micro-batch beside its layers (``R``: the boundary
      before, ``S``: after), and ``max_j (R_j + S_j) >= max(min R + max S,
      max R + min S)``;
    * the link bound of the boundary after it
      (:func:`~pipedejavu.search.megatron.transfers.link_rows`) at the actual
      placements.

    The state of the bottleneck DP is (stages left per type, type of the next
    stage, type of the stage before it): the index of each stage in its type
    follows from the counts. Tables are shared by the count vectors of one
    mix (``self._weights``); DP rows are per count vector."""

    def __init__(
        self,
        data: SailorData,
        model: str,
        constants: PredictorConstants,
        mix: Mix,
        cache: BoundCache,
    ) -> None:
        self.data, self.model, self.constants = data, model, constants
        self.mix, self.cache = mix, cache
        self.types = [gpu for gpu, _ in mix.caps]
        self.kinds = [(gpu, mix.tp) for gpu in self.types]
        info = data.model_info(model)
        self.layers = info.num_layers
        self.nbytes = message_bytes(info, mix.tp, slice(0, self.layers - 1), mix.mbs)
        self._times = kind_times(data, model, constants, self.kinds, mix.mbs)
        self._layer_bounds = layer_bounds(self._times, constants.op_overhead_s)
        self._tables: dict[tuple[str, int], StageTable] = {}
        self._pairs: dict[tuple[Stage, Stage], PairRows] = {}
        self._weights: dict[tuple, NDArray[np.float64]] = {}
        # Every mix's weight tables, to bound them together (see weights).
        self._all_weights = cache.placed_weights
        self._all_weights.append(self._weights)

    def _rank(self, gpu: str, index: int) -> int:
        return index * self.mix.dp * self.mix.tp

    def _table(self, gpu: str, index: int) -> StageTable:
        """The bounds of a stage of ``gpu``, ``index``-th of its
        type: no transfers in ``w``, the all-reduce at its placement."""
        spot = self._rank(gpu, index) % self.data.gpu_spec(gpu).gpus_per_node
        key = (gpu, spot)
        if key not in self._tables:
            out = kind_bounds(
                self.data,
                self.model,
                self.constants,
                self.kinds,
                self.mix.mbs,
                self.mix.dp,
                self.mix.steps,
                self.cache,
                with_sends=False,
                placed={g: (spot if g == gpu else 0) for g in self.types},
            )
            self._tables[key] = out[(gpu, self.mix.tp)]
        return self._tables[key]

    def _pair(self, a: Stage, b: Stage) -> PairRows:
        """Over the boundaries between stage ``a = (type, index)`` and the next,
        ``b`` (:class:`PairRows`)."""
        if (a, b) not in self._pairs:
            mix = self.mix
            first, second = self._rank(*a), self._rank(*b)
            ka, kb = (a[0], mix.tp), (b[0], mix.tp)
            rows = np.empty((self.layers - 1, mix.dp, 2))
            memo: dict = {}
            for k, nbytes in enumerate(self.nbytes.tolist()):
                if nbytes not in memo:
                    memo[nbytes] = pipeline_transfers(
                        self.data, ka, kb, nbytes, mix.dp, first, second, {}
                    )
                rows[k] = memo[nbytes]
            both = rows.sum(axis=2)
            buffered = ~is_blocking(self.nbytes, mix.tp, mix.tp, self.constants)
            both[buffered] = 0.0
            link = link_rows(
                {0: (rows[:, :, 0].max(axis=1), rows[:, :, 1].max(axis=1))},
                self._layer_bounds,
                self._times,
                mix.steps,
            )[0]
            self._pairs[(a, b)] = PairRows(both.min(axis=1), both.max(axis=1), link)
        return self._pairs[(a, b)]

    def weights(
        self, stage: Stage, before: Stage | None, after: Stage | None, count: int
    ) -> NDArray[np.float64]:
        """``w[a, b]`` of ``stage = (type, index)`` with ``before`` and
        ``after`` its neighbours (``None`` at the ends: ``a`` must then be 0,
        ``b`` must be ``L``) and ``count`` stages from it to the end."""
        key = (stage, before, after, count)
        if key in self._weights:
            return self._weights[key]
        if sum(len(table) for table in self._all_weights) > WEIGHT_TABLES:
            for table in self._all_weights:
                table.clear()
        steps, size = self.mix.steps, self.layers + 1
        table = self._table(*stage)  # (per-stage recomputation: relaxed)
        w, cap, late, fwd = table.w, table.cap, table.late, table.fwd
        low_r = high_r = np.zeros(size)
        if before is not None:
            least, dear, _ = self._pair(before, stage)
            low_r = np.concatenate([[np.inf], steps * least, [np.inf]])
            high_r = np.concatenate([[np.inf], steps * dear, [np.inf]])
        if after is None:
            low_s = high_s = np.full(size, np.inf)
            low_s[-1] = high_s[-1] = 0.0
            link = np.zeros(size)
        else:
            least, dear, link = self._pair(stage, after)
            low_s = np.concatenate([[np.inf], steps * least, [np.inf]])
            high_s = np.concatenate([[np.inf], steps * dear, [np.inf]])
        busy = np.maximum(
            low_r[:, None] + high_s[None, :], high_r[:, None] + low_s[None, :]
        )
        warm = late + 2 * self.constants.op_overhead_s * (count - 1)
        warm = warm - min(count, steps) * fwd
        bound = np.maximum(np.maximum(w + busy, warm), link[None, :])
        bound = np.where(cap >= min(count, steps), bound, np.inf)
        self._weights[key] = bound
        return bound

    def bottleneck(self, counts: tuple[int, ...]) -> dict:
        """``{(left, type, before): g[p]}`` for every state reachable from
        ``counts``: the least ``max w`` over chains covering layers ``p..``
        with ``left`` stages per type, the first of ``type``, the stage before
        it of type ``before`` (``None``: it is the first stage)."""
        g: dict = {}
        size = self.layers + 1

        def index(left, i):
            return counts[i] - left[i]

        def solve(left, i, before):
            key = (left, i, before)
            if key in g:
                return g[key]
            stage = (self.types[i], index(left, i))
            prev = None
            if before is not None:
                prev = (self.types[before], index(left, before) - 1)
            total = sum(left)
            rest = left[:i] + (left[i] - 1,) + left[i + 1 :]
            best = np.full(size, np.inf)
            if total == 1:
                best = self.weights(stage, prev, None, 1)[:, -1].copy()
            else:
                for j, n in enumerate(rest):
                    if n == 0:
                        continue
                    nxt = (self.types[j], index(rest, j))
                    tail = solve(rest, j, i)
                    w = self.weights(stage, prev, nxt, total)
                    best = np.minimum(best, np.maximum(w, tail[None, :]).min(axis=1))
            g[key] = best
            return best

        for i, n in enumerate(counts):
            if n:
                solve(counts, i, None)
        return g

    def value(self, counts: tuple[int, ...]) -> tuple[float, dict]:
        g = self.bottleneck(counts)
        least = min(
            (float(g[(counts, i, None)][0]) for i, n in enumerate(counts) if n),
            default=math.inf,
        )
        return least, g

    def plans(
        self,
        gpus: Mapping[str, int],
        gbs: int,
        counts: tuple[int, ...],
        g: dict,
        best: Incumbent,
    ) -> Iterator[Plan3D]:
        """The plans with ``counts`` stages per type whose stage bounds and
        rest bound stay below ``best.time_s``, depth first and, among the
        children of a node, least bound first."""
        data, mix = self.data, self.mix
        gpn = {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in gpus}
        last = self.layers
        stack = [
            (0, counts, i, None, (), float(g[(counts, i, None)][0]))
            for i, n in enumerate(counts)
            if n
        ]
        stack.sort(key=lambda item: -item[5])
        while stack:
            start, left, i, before, stages, bound = stack.pop()
            if bound >= best.time_s:
                continue
            gpu = self.types[i]
            stage = (gpu, counts[i] - left[i])
            prev = None
            if before is not None:
                prev = (self.types[before], counts[before] - left[before] - 1)
            total = sum(left)
            if total == 1:
                value = max(bound, float(self.weights(stage, prev, None, 1)[start, -1]))
                if value < best.time_s:
                    yield plan_from_mixed_stages(
                        [*stages, (start, last, mix.tp, gpu)],
                        dp=mix.dp,
                        mbs=mix.mbs,
                        gbs=gbs,
                        model=self.model,
                        pool=gpus,
                        gpus_per_node=gpn,
                        zone=DEFAULT_ZONE,
                        experts=data.model_info(self.model).expert_axes,
                    )
                continue
            rest = left[:i] + (left[i] - 1,) + left[i + 1 :]
            children = []
            for j, n in enumerate(rest):
                if n == 0:
                    continue
                nxt = (self.types[j], counts[j] - rest[j])
                w = self.weights(stage, prev, nxt, total)[start]
                row = np.maximum(w, g[(rest, j, i)])
                for stop in np.flatnonzero(row < best.time_s).tolist():
                    chain = (*stages, (start, stop, mix.tp, gpu))
                    value = max(bound, float(row[stop]))
                    children.append((stop, rest, j, i, chain, value))
            children.sort(key=lambda child: -child[5])
            stack.extend(children)
