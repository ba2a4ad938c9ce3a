"""The Megatron-style search space, defined once: the configurations the
search (:func:`~pipedejavu.search.megatron.planner.search_megatron`) solves and
the proof (:func:`~pipedejavu.search.megatron.certify.certify_predicted`)
bounds.

One-type plans: per GPU type, micro-batch size ``mbs`` (profiled, dividing the
global batch), data-parallel degree ``dp`` (dividing ``gbs / mbs``), a TP degree
for every stage (``uniform_tp``) or a set to choose from per stage, and the
GPUs of one pipeline (a multiple of the TP degree with ``uniform_tp``; at most
``max_stages`` stages; all ``count // dp`` GPUs unless ``allow_fewer_gpus``);
for a mixture of experts, the TP degrees whose stages are whole expert blocks
(:func:`~pipedejavu.core.layout.experts_fit`, the costs' EP and expert TP).

Mixed plans (:class:`Mix`): one mbs, dp and TP degree, each stage on a type of
its own choice, at least two types able to hold a stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.layout import experts_fit
from pipedejavu.core.plan3d import DEFAULT_ZONE, RANK_ORDERS, Plan3D
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import plan_from_stages, usable_degrees

__all__ = [
    "EVERY_CONFIGURATION",
    "ConfigGroup",
    "Mix",
    "OneType",
    "SearchScope",
    "chain_counts",
    "config_groups",
    "cover_counts",
    "divisors",
    "mixes",
    "nested_capacities",
    "type_plan",
]


@dataclasses.dataclass(frozen=True)
class SearchScope:
    """Which one-type configurations a pool's search space holds (module
    docstring): what the search, its proof and the quick memory test read
    alike.

    Attributes:
        uniform_tp: one TP degree for every stage (``False``: a set to choose
            from per stage).
        allow_fewer_gpus: pipelines on fewer GPUs than ``count // dp`` too.
        mbs_values: the micro-batch sizes (``None``: every profiled one).
        max_stages: most pipeline stages (``None``: the model's layers).
        dp_alone: data parallelism only over one-GPU replicas, no TP or PP
            beside it, as torchtitan's DDP runs it.
    """

    uniform_tp: bool = True
    allow_fewer_gpus: bool = True
    mbs_values: tuple[int, ...] | None = None
    max_stages: int | None = None
    dp_alone: bool = False


#: The default scope: a TP degree for every stage, every micro-batch size and
#: stage count, pipelines on fewer GPUs too.
EVERY_CONFIGURATION = SearchScope()


@dataclasses.dataclass(frozen=True)
class ConfigGroup:
    """Configurations sharing (GPU type, mbs, dp) and a set of TP degrees.

    Attributes:
        steps: micro-batches per pipeline, ``gbs / (mbs dp)``.
        tps: the TP degrees a stage may take (one with ``uniform_tp``).
        sizes: the GPUs a pipeline may have (sum of its stages' degrees).
    """

    gpu: str
    mbs: int
    dp: int
    steps: int
    tps: tuple[int, ...]
    sizes: tuple[int, ...]


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending."""
    small, large = [], []
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def config_groups(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    gbs: int,
    scope: SearchScope,
) -> list[ConfigGroup]:
    """The one-type configurations of the pool in ``scope`` (module
    docstring), grouped."""
    info = data.model_info(model)
    ep, etp = info.expert_axes
    offered = scope.mbs_values
    out = []
    for gpu, count in gpus.items():
        table = data.profile(model, gpu)
        stages_cap = min(info.num_layers, scope.max_stages or info.num_layers)
        for mbs in sorted({m for m, _ in table}):
            if gbs % mbs or (offered is not None and mbs not in offered):
                continue
            tps = usable_degrees(data, model, gpu, mbs, count)
            if not tps:
                continue
            for dp in range(1, count // min(tps) + 1):
                if (gbs // mbs) % dp:
                    continue
                budget = count // dp
                # the experts' layout: whole expert blocks in every stage
                fitting = [t for t in tps if experts_fit(t, 1, dp, ep, etp)]
                if not fitting:
                    continue
                sets = [(t,) for t in fitting] if scope.uniform_tp else [tuple(fitting)]
                for tp_set in sets:
                    if scope.dp_alone and dp > 1:
                        if 1 not in tp_set:
                            continue
                        tp_set = (1,)
                    small = min(tp_set)
                    low = small if scope.allow_fewer_gpus else budget
                    high = min(budget, stages_cap * max(tp_set))
                    sizes = tuple(
                        g
                        for g in range(low, high + 1)
                        if not scope.uniform_tp or g % small == 0
                    )
                    if scope.dp_alone and dp > 1:
                        sizes = tuple(g for g in sizes if g == 1)
                    usable = tuple(t for t in tp_set if t <= high)
                    if sizes and usable:
                        steps = gbs // (mbs * dp)
                        out.append(ConfigGroup(gpu, mbs, dp, steps, usable, sizes))
    return out


class OneType(Protocol):
    """What :func:`type_plan` reads of a one-type configuration (a
    :class:`ConfigGroup`, a candidate of the search or of the interleaved
    search)."""

    @property
    def gpu(self) -> str: ...

    @property
    def mbs(self) -> int: ...

    @property
    def dp(self) -> int: ...


def type_plan(
    data: SailorData,
    model: str,
    stages: Sequence[tuple[int, int, int]],
    config: OneType,
    gbs: int,
    rank_order: str = RANK_ORDERS[0],
    experts: tuple[int, int | None] | None = None,
) -> Plan3D:
    """The plan of ``(start, stop, tp)`` stages on ``config``'s GPU type, mbs
    and dp (:func:`~pipedejavu.costmodel.megatron.tables.plan_from_stages`):
    nodes of the type's size in the default zone, placed in ``rank_order``,
    its expert layers over ``experts`` = ``(ep, etp)`` (``None``: the costs'
    ``ModelInfo.expert_axes``)."""
    return plan_from_stages(
        stages,
        gpu_type=config.gpu,
        dp=config.dp,
        mbs=config.mbs,
        gbs=gbs,
        model=model,
        gpus_per_node=data.gpu_spec(config.gpu).gpus_per_node,
        zone=DEFAULT_ZONE,
        experts=data.model_info(model).expert_axes if experts is None else experts,
        rank_order=rank_order,
    )


@dataclasses.dataclass(frozen=True)
class Mix:
    """Plans whose stages may run on different GPU types: one mbs, dp and TP
    degree; ``caps``: (type, most stages of that type) for each usable type."""

    mbs: int
    dp: int
    steps: int
    tp: int
    caps: tuple[tuple[str, int], ...]
    max_stages: int


def mixes(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    gbs: int,
    scope: SearchScope,
) -> list[Mix]:
    """The (mbs, dp, TP) settings at which two types or more can hold stages
    in ``scope`` (its ``uniform_tp`` aside: one TP degree; ``dp_alone``: dp 1
    only, these plans having two stages or more)."""
    info = data.model_info(model)
    profiles = {gpu: data.profile(model, gpu) for gpu in gpus}
    offered = scope.mbs_values
    out = []
    for mbs in sorted({m for table in profiles.values() for m, _ in table}):
        if gbs % mbs or (offered is not None and mbs not in offered):
            continue
        degrees = {
            gpu: usable_degrees(data, model, gpu, mbs, count)
            for gpu, count in gpus.items()
        }
        for tp in info.tp_values:
            usable = {gpu: count for gpu, count in gpus.items() if tp in degrees[gpu]}
            if len(usable) < 2:
                continue
            for dp in range(1, max(usable.values()) // tp + 1):
                if (gbs // mbs) % dp or (scope.dp_alone and dp > 1):
                    continue
                if not experts_fit(tp, 1, dp, *info.expert_axes):
                    continue
                caps = tuple(
                    (gpu, count // dp // tp)
                    for gpu, count in usable.items()
                    if count // dp // tp >= 1
                )
                if len(caps) < 2:
                    continue
                most = min(
                    info.num_layers,
                    scope.max_stages or info.num_layers,
                    sum(c for _, c in caps),
                )
                out.append(Mix(mbs, dp, gbs // (mbs * dp), tp, caps, most))
    return out


def chain_counts(memory: NDArray[np.int64], most: int) -> NDArray[np.bool_]:
    """``fits[k]``, ``k <= most``: a chain of exactly ``k`` stages covers every
    layer, each stage's ``memory[start, end]`` (``end`` inclusive) at least
    the stages after it: a memory rule alone, by reachability (every stage
    count at once; the planner's and the proof's rules both read so)."""
    num_layers = memory.shape[0]
    spans = np.triu(np.ones((num_layers, num_layers), dtype=bool))  # i <= j
    fits = np.zeros(most + 1, dtype=bool)
    reach = np.zeros(num_layers + 1, dtype=bool)
    reach[num_layers] = True  # no layer left, no stage
    for after in range(most):
        # a stage i..j followed by `after` stages that cover j + 1..
        reach = np.append((spans & (memory >= after) & reach[None, 1:]).any(1), False)
        fits[after + 1] = reach[0]
        if not reach.any():
            break
    return fits


def nested_capacities(table: NDArray[np.float64]) -> bool:
    """Whether no span ``a..e`` with ``a >= 1`` (``table[a, e]``, ``e``
    inclusive, the upper triangle) holds more than a span inside it: each at
    most the spans one layer shorter at either end (and so, by induction,
    than every span inside it). Spans from layer 0 are left out: the first
    stage stashes token ids where a later one stashes its input, so it may
    hold more than the same layers without the embedding."""
    rest = table[1:, 1:]
    upper = np.triu(np.ones(rest.shape, dtype=bool), 1)
    shorter_end = np.full(rest.shape, np.inf)
    shorter_end[:, 1:] = rest[:, :-1]  # a..e-1
    shorter_start = np.full(rest.shape, np.inf)
    shorter_start[:-1, :] = rest[1:, :]  # a+1..e
    ok = (rest <= shorter_end) & (rest <= shorter_start)
    return bool(ok[upper].all())


def cover_counts(
    table: NDArray[np.float64], need: float, most: int
) -> NDArray[np.bool_]:
    """``fits[k]``, ``k <= most``: some chain of exactly ``k`` spans covers
    every layer with each span's ``table`` at least ``need``, for a table of
    :func:`nested_capacities` (what :func:`chain_counts` answers for any
    table, in ``O(L)`` per ``need`` instead of ``O(most L^2)``). Past the
    first stage, the spans that hold ``need`` contain every span inside
    them: the fewest stages from layer ``x`` on cover greedily (each as long
    as it may be: no cover of fewer stages reaches as far), and a chain of
    ``k`` stages over ``n > k`` layers splits into one of ``k + 1``; so after
    a first stage ``0..e`` the counts are ``1 + [fewest(e + 1), L - 1 - e]``,
    united over the first stages that hold ``need``."""
    num_layers = table.shape[0]
    fits = np.zeros(most + 1, dtype=bool)
    longest = (table >= need).sum(axis=1)  # from each first layer, contiguous
    fewest = np.full(num_layers + 1, np.inf)
    fewest[num_layers] = 0.0
    for x in range(num_layers - 1, 0, -1):
        if longest[x]:
            fewest[x] = 1.0 + fewest[x + int(longest[x])]
    counts = np.arange(most + 1)
    for stop in np.flatnonzero(table[0] >= need):  # first stage 0..stop
        low, high = 1 + fewest[stop + 1], num_layers - stop
        fits |= (counts >= low) & (counts <= high)
    return fits
