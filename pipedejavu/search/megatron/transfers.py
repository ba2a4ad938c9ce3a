"""Transfer tables of the proof's bounds (:mod:`pipedejavu.search.megatron.certify`).

The point-to-point transfers a stage can take part in, priced with the
predictor's own rules (:mod:`pipedejavu.costmodel.megatron.rules`: message
size, blocking, both directions) at every placement Megatron's rank order
allows, and the bounds they give: per boundary, the least blocking time a
stage spends in it, and the bound its link alone puts on a plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    Replica,
    rank_nodes,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.rules import is_blocking, message_bytes, p2p_pair
from pipedejavu.costmodel.megatron.sailor_data import LayerTimes, SailorData
from pipedejavu.costmodel.megatron.sheet_network import SheetNetwork

__all__ = [
    "links_key",
    "BlockingTransfers",
    "BoundCache",
    "Kind",
    "LayerBounds",
    "SendRow",
    "TransferPrice",
    "blocking_transfers",
    "layer_bounds",
    "link_rows",
    "pipeline_transfers",
    "send_rows",
]

#: What a stage runs on: (GPU type, TP degree).
Kind = tuple[str, int]
Row = NDArray[np.float64]


class TransferPrice(NamedTuple):
    """Seconds per micro-batch over one boundary from a stage of one kind to
    the next of another, least over the placements the plans can have.

    Attributes:
        worst: the dearest pipeline's activation plus gradient.
        anyone: the cheapest pipeline's activation plus gradient.
        there, back: the dearest pipeline's activation (gradient) alone.
    """

    worst: float
    anyone: float
    there: float
    back: float


class BlockingTransfers(NamedTuple):
    """Per boundary after layer ``k`` (``f64[L - 1]``), the least time per
    micro-batch a stage spends in blocking transfers (0 where buffered).

    Attributes:
        sends: ``{kind: row}`` as the sender, in its dearest pipeline, least
            over the next kind.
        receives: ``{kind: row}`` as the receiver, in any pipeline.
        pairs: ``{(kind, next kind): row}`` as the sender to a known next kind.
        links: ``{(kind, next kind): (there, back)}`` the dearest pipeline's
            activation and gradient (buffered or not).
    """

    sends: dict[Kind, Row]
    receives: dict[Kind, Row]
    pairs: dict[tuple[Kind, Kind], Row]
    links: dict[tuple[Kind, Kind], tuple[Row, Row]]


class LayerBounds(NamedTuple):
    """By layer index, at the fastest kind: the forward (backward) of the
    layers before, plus an overhead (``before_f``, ``before_b``), and the
    forward and backward of the layers from there on (``after_fb``)."""

    before_f: Row
    before_b: Row
    after_fb: Row


class SendRow(NamedTuple):
    """By the stage's stop ``b`` (``f64[L + 1]``, 0 at ``b = L``): ``add``, ``B``
    x the least blocking time over the boundary after the stage, which its busy
    time gains; ``link``, the bound the boundary's link alone gives."""

    add: Row
    link: Row


@dataclasses.dataclass
class BoundCache:
    """What the bounds of one proof share, or of several proofs over sources
    that price links alike (the knob search's choices: every key names the
    links, :func:`links_key`, and what else its value reads).

    Attributes:
        transfers: :class:`TransferPrice` by (kinds, bytes, dp, rank steps,
            strides, links).
        allreduce: ``(seconds, largest bucket)`` of every span by (type, TP,
            dp, offsets in a node, strides, links, gradient bytes, parameters
            held).
        blocking: :class:`BlockingTransfers` by (kinds, mbs, dp, strides,
            links, the messages' bytes, constants).
        links: :func:`links_key` by the network's ``id`` (with the network,
            kept alive so that the ``id`` is not reused).
        counts: a memory rule's chain counts
            (:func:`~pipedejavu.search.megatron.bounds.memory_counts`) by the
            rule's digest and the most stages.
        fitting: a source's configurations' memory reachability
            (:func:`~pipedejavu.search.megatron.bounds.memory_counts`) by the
            source's and the constants' ``id`` (both kept alive), the model
            and the configuration.
        either: a source's configurations' bounds least over both rank
            orders (:func:`~pipedejavu.search.megatron.certify.
            either_order_bounds`) by the source's and the constants' ``id``
            (both kept alive), the model and the configuration.
        placed_weights: the weight tables of every placed mix
            (:class:`~pipedejavu.search.megatron.mixed.PlacedMix`), to bound
            their total size.
    """

    transfers: dict[tuple, TransferPrice] = dataclasses.field(default_factory=dict)
    allreduce: dict[tuple, tuple[Row, Row]] = dataclasses.field(default_factory=dict)
    blocking: dict[tuple, BlockingTransfers] = dataclasses.field(default_factory=dict)
    links: dict[int, tuple[object, Hashable]] = dataclasses.field(default_factory=dict)
    counts: dict[tuple, NDArray[np.bool_]] = dataclasses.field(default_factory=dict)
    fitting: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    either: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    placed_weights: list[dict] = dataclasses.field(default_factory=list)


def links_key(data: SailorData, cache: BoundCache | None = None) -> Hashable:
    """What prices the links of ``data``: a sheet network's entries, efficiency,
    measured fits and overrides (sources built alike share it), else the
    network object itself; computed once per network of a ``cache``."""
    network = data.network
    if cache is not None:
        if id(network) not in cache.links:
            cache.links[id(network)] = (network, links_key(data))
        return cache.links[id(network)][1]
    if isinstance(network, SheetNetwork):
        measured = None if network.measured is None else id(network.measured)
        return (
            tuple(sorted((name, repr(entry)) for name, entry in network.sheet.items())),
            network.efficiency,
            measured,
            tuple(sorted(network.inter_override.items())),
        )
    return ("network", id(network))


def pipeline_transfers(
    data: SailorData,
    a: Kind,
    b: Kind,
    nbytes: float,
    dp: int,
    first: int,
    second: int,
    memo: dict,
    stride: int | None = None,
) -> list[tuple[float, float]]:
    """Per pipeline ``j``, (activation, gradient) seconds over the boundary
    from a stage of kind ``a`` whose replicas start at rank ``first`` of its
    type to the next of kind ``b`` starting at rank ``second`` of its type (TP
    innermost, then data: replica ``j`` at ``first + j x tp``; with ``stride``,
    the ``tp-pp-dp`` rank order: at ``first + j x stride``). The placement
    fixes whether the two replicas share a node (one type) and how many
    pipelines share their node pair (what ``p2p_time`` reads); ``inf`` where no
    link fit prices it. ``memo``: shared by calls with the same kinds and
    bytes."""
    gpn_a = data.gpu_spec(a[0]).gpus_per_node
    gpn_b = data.gpu_spec(b[0]).gpus_per_node
    nodes = list(
        zip(
            rank_nodes(first, dp, a[1], gpn_a, stride),
            rank_nodes(second, dp, b[1], gpn_b, stride),
            strict=True,
        )
    )
    crowd: dict = {}
    for pair in nodes:
        crowd[pair] = crowd.get(pair, 0) + 1
    out = []
    for pair in nodes:
        key = (a[0] == b[0] and pair[0] == pair[1], crowd[pair])
        if key not in memo:
            sender = Replica(a[0], a[1], zone=DEFAULT_ZONE)
            receiver = Replica(b[0], b[1], zone=DEFAULT_ZONE)
            try:
                memo[key] = p2p_pair(
                    data.network,
                    sender,
                    receiver,
                    nbytes,
                    same_node=key[0],
                    concurrent=key[1],
                )
            except ProblemError:  # no fit: the predictor cannot price it
                memo[key] = (math.inf, math.inf)
        out.append(memo[key])
    return out


def blocking_transfers(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[Kind],
    mbs: int,
    dp: int,
    cache: BoundCache,
    strides: tuple[int | None, ...] | None = None,
) -> BlockingTransfers:
    """The blocking transfers of every boundary (:class:`BlockingTransfers`;
    a rendezvous keeps both stages busy). The least is over the other stage's
    kind and over the placements the plans can have: in Megatron's rank order
    a type's stages start at multiples of ``dp x`` the gcd of its degrees
    within its nodes, the next stage of the same type takes the next ranks, a
    stage of another type sits on nodes of its own; each placement fixes, per
    pipeline, whether the two replicas share a node and how many pipelines
    share their node pair (what ``p2p_time`` reads). ``inf`` where no link fit
    prices it (no plan the predictor prices has it). ``strides``: the
    ``tp-pp-dp`` rank order (one GPU type), a pipeline's GPUs in each plan the
    bound covers: a stage starts at a multiple of the gcd of the degrees, its
    neighbour right after it, replica ``j`` ``j x stride`` later (a ``None``
    stride: Megatron's order, the neighbour ``dp`` replicas later)."""
    info = data.model_info(model)
    boundaries = info.num_layers - 1
    links = links_key(data, cache)
    spans = slice(0, boundaries)
    messages = tuple(
        (t, np.asarray(message_bytes(info, t, spans, mbs)).tobytes())
        for t in sorted({t for _, t in kinds})
    )
    whole = (tuple(kinds), mbs, dp, strides, links, messages, constants)
    if whole in cache.blocking:
        return cache.blocking[whole]
    step: dict[str, int] = {}  # a type's stages start at multiples of dp x gcd
    for gpu, t in kinds:
        step[gpu] = math.gcd(step.get(gpu, 0), t if strides else dp * t)

    def offsets(gpu: str) -> list[int]:
        gpn = data.gpu_spec(gpu).gpus_per_node
        return sorted({(m * step[gpu]) % gpn for m in range(gpn)})

    def price(a: Kind, b: Kind, nbytes: float) -> TransferPrice:
        if a[0] == b[0]:  # the next stage takes the type's next ranks
            combos = [(o, o + dp * a[1]) for o in offsets(a[0])]
        else:  # nodes of their own
            combos = [(o, r) for o in offsets(a[0]) for r in offsets(b[0])]
        memo: dict = {}
        worst = anyone = dear_there = dear_back = math.inf
        if strides:  # one type: the next stage takes the pipeline's next ranks
            placed = [
                (o, o + (a[1] if g else dp * a[1]), g)
                for o in offsets(a[0])
                for g in strides
            ]
        else:
            placed = [(o, r, None) for o, r in combos]
        for o, r, g in placed:
            each = pipeline_transfers(data, a, b, nbytes, dp, o, r, memo, g)
            both = [x + y for x, y in each]
            if max(both) < math.inf:
                worst = min(worst, max(both))
                anyone = min(anyone, min(both))
                dear_there = min(dear_there, max(x for x, _ in each))
                dear_back = min(dear_back, max(y for _, y in each))
        return TransferPrice(worst, anyone, dear_there, dear_back)

    def blocked(a: Kind, b: Kind, k: int) -> TransferPrice:
        """A stage of kind ``a`` sends to one of kind ``b`` over boundary ``k``."""
        nbytes = float(message_bytes(info, a[1], k, mbs))
        key = (a, b, nbytes, dp, step[a[0]], step[b[0]], strides, links)
        if key not in cache.transfers:
            cache.transfers[key] = price(a, b, nbytes)
        found = cache.transfers[key]
        if not is_blocking(nbytes, a[1], b[1], constants):
            return found._replace(worst=0.0, anyone=0.0)  # nobody waits
        return found

    def row(a: Kind, b: Kind, part: str) -> Row:
        return np.array([getattr(blocked(a, b, k), part) for k in range(boundaries)])

    pairs = {(a, b): row(a, b, "worst") for a in kinds for b in kinds}
    anyone = {(a, b): row(a, b, "anyone") for a in kinds for b in kinds}
    links = {
        (a, b): (row(a, b, "there"), row(a, b, "back")) for a in kinds for b in kinds
    }
    sends = {a: np.min([pairs[(a, b)] for b in kinds], axis=0) for a in kinds}
    receives = {b: np.min([anyone[(a, b)] for a in kinds], axis=0) for b in kinds}
    cache.blocking[whole] = BlockingTransfers(sends, receives, pairs, links)
    return cache.blocking[whole]


def kind_times(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[Kind],
    mbs: int,
) -> dict[Kind, LayerTimes]:
    """The layer times of each kind at ``mbs``, as the predictor reads them."""
    return {
        (gpu, t): data.layer_times(model, gpu, mbs, t, smooth=constants.smooth_profiles)
        for gpu, t in kinds
    }


def layer_bounds(times: Mapping[Kind, LayerTimes], overhead: float) -> LayerBounds:
    """:class:`LayerBounds` of these kinds' layer times."""
    fastest_f = np.min([x.forward for x in times.values()], axis=0)
    fastest_b = np.min([x.backward for x in times.values()], axis=0)
    before_f = np.concatenate([[0.0], np.cumsum(fastest_f)])
    before_b = np.concatenate([[0.0], np.cumsum(fastest_b)])
    before_f[1:] += overhead
    before_b[1:] += overhead
    fastest = np.min([x.forward + x.backward for x in times.values()], axis=0)
    after_fb = np.concatenate([np.cumsum(fastest[::-1])[::-1], [0.0]])
    return LayerBounds(before_f, before_b, after_fb)


def _repeated(row: Row, count: int) -> Row:
    """``count x row``, where ``0 x inf`` stays ``inf`` (not NaN)."""
    return count * row if count > 0 else np.where(np.isinf(row), row, 0.0)


def link_rows(
    links: Mapping[tuple[Kind, Kind], tuple[Row, Row]],
    layers: LayerBounds,
    times: Mapping[Kind, LayerTimes],
    steps: int,
) -> dict[tuple[Kind, Kind], Row]:
    """``{(kind, next kind): f64[L + 1]}`` by stop ``b``: a bound on the
    predicted time from the boundary's link alone (``inf`` off, 0 at ``b =
    L``). In each direction a pipeline's messages cross one at a time (a
    rendezvous, or a buffered message the sender hands over only once the
    previous one was taken), so the last of ``B`` activations arrives
    ``(B - 1) x`` after the first, which waits for the forwards before ``b``;
    that micro-batch then runs forward and backward through the layers from
    ``b`` on and backward through those before. The gradients alike: the first
    follows every forward and the backwards from ``b`` on, the last comes
    ``(B - 1)`` gradient transfers later and then runs back through the layers
    before ``b``. ``x``: the dearest pipeline's transfer, least over the
    placements."""
    before_f, before_b, after_fb = layers
    fastest_b = np.min([x.backward for x in times.values()], axis=0)
    after_b = np.concatenate([np.cumsum(fastest_b[::-1])[::-1], [0.0]])
    out = {}
    for pair, (there, back) in links.items():
        stops = np.arange(1, len(there) + 1)
        # (a link that cannot carry the messages stays inf with one step)
        there_all = _repeated(there, steps - 1)
        back_all = _repeated(back, steps - 1)
        forward = before_f[stops] + there_all + after_fb[stops] + before_b[stops]
        gradient = before_f[-1] + after_b[stops] + back_all + before_b[stops]
        row = np.zeros(len(there) + 2)
        row[1:-1] = np.maximum(forward, gradient)
        row[0] = np.inf
        out[pair] = row
    return out


def send_rows(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[Kind],
    mbs: int,
    dp: int,
    steps: int,
    cache: BoundCache,
) -> dict[tuple[Kind, Kind], SendRow]:
    """``{(kind, next kind): SendRow}`` (:class:`SendRow`)."""
    transfers = blocking_transfers(data, model, constants, kinds, mbs, dp, cache)
    times = kind_times(data, model, constants, kinds, mbs)
    layers = layer_bounds(times, constants.op_overhead_s)
    links = link_rows(transfers.links, layers, times, steps)
    return {
        pair: SendRow(steps * np.concatenate([[0.0], row, [0.0]]), links[pair])
        for pair, row in transfers.pairs.items()
    }
