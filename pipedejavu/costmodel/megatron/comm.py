"""Communication times of a 3D plan on fitted links (Sailor's bandwidth curves).

Building blocks of :mod:`pipedejavu.costmodel.megatron.predictor`. Every time
comes from a :class:`~pipedejavu.costmodel.megatron.sailor_data.BandwidthFit`,
which gives the
*aggregate* bandwidth of ``n`` GPUs on a node sending at once (Sailor measured
``n`` concurrent pairs between two nodes, or ``n / 2`` pairs inside one node) as
a function of the message size per GPU.

Assumptions (stated once, used everywhere):

* **Point-to-point** (pipeline activations and their gradients): DeepSpeed's
  pipeline engine partitions a tensor over the sender's TP group
  (``pipe_partitioned``/``grad_partitioned``, on by default), so ``k = min(tp_a,
  tp_b)`` GPUs each send ``bytes / k`` at once, and the receiving TP group
  all-gathers the pieces. ``r`` replicas whose stages sit on the same node pair
  transfer at the same time (their pipelines run in lockstep), so the node pair
  carries ``r * k`` streams: ``time = r * bytes / bw(r * k GPUs, bytes / k)``.
  Between two TP groups on one node the intra-node fit is used with ``2 r k``
  GPUs.
* **All-gather** of ``bytes`` over a TP group of ``t`` GPUs inside a node: a ring
  of ``t - 1`` steps in which every GPU sends ``bytes / t``; the ``t`` streams
  share the node's fit for ``t`` GPUs: ``(t - 1) * bytes / (2 bw_t(bytes / t))``.
* **Ring all-reduce** of ``bytes`` per GPU over ``n`` ranks (one per replica, for
  each of the replicas' ``tp`` ranks at once, i.e. ``tp`` rings side by side):
  ``2 (n - 1)`` steps in which every rank sends ``bytes / n`` to the next; every
  step lasts as long as the ring's slowest hop. A hop between nodes carries the
  ``tp`` rings' streams; a hop inside a node is priced with the intra-node fit of
  the GPUs the collective uses on that node.
* Links are not shared between different collectives or stages (no contention
  model beyond the ``r`` concurrent replicas above).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import Replica
from pipedejavu.core.replica import alike, one_by_one
from pipedejavu.costmodel.megatron.sailor_data import NetworkTables

__all__ = [
    "all_gather_time",
    "node_key",
    "p2p_time",
    "ring_allreduce_time",
    "ring_allreduce_times",
    "ring_hops",
]


def node_key(replica: Replica, stage: int, index: int) -> Hashable:
    """The physical node of replica ``index`` of stage ``stage``: its ``node`` if
    given, else a node of its own."""
    if replica.node is None:
        return ("own", stage, index)
    return ("node", replica.node)


def node_keys(replicas: Sequence[Replica], stage: int) -> list[Hashable]:
    """:func:`node_key` of each of a stage's replicas (a
    :class:`~pipedejavu.core.replica.ReplicaRow`'s read off its nodes)."""
    kind = alike(replicas)
    if kind is None:
        return [node_key(r, stage, j) for j, r in enumerate(replicas)]
    return [
        ("own", stage, j) if node is None else ("node", node)
        for j, node in enumerate(replicas.nodes)
    ]


def all_gather_time(network: NetworkTables, gpu: str, tp: int, nbytes: float) -> float:
    """Seconds to all-gather ``nbytes`` (the full tensor) over ``tp`` GPUs."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    fit = network.intra(gpu, tp)
    return (tp - 1) * nbytes / (2.0 * fit.bandwidth(nbytes / tp))


def p2p_time(
    network: NetworkTables,
    sender: Replica,
    receiver: Replica,
    nbytes: float,
    *,
    same_node: bool,
    concurrent: int = 1,
) -> float:
    """Seconds to move one pipeline tensor of ``nbytes`` from ``sender``'s TP
    group to ``receiver``'s, the receiver's all-gather included.

    Args:
        network: the link fits.
        sender, receiver: the two replicas (TP groups).
        nbytes: bytes of the whole tensor (activation or its gradient).
        same_node: both groups on one node (intra-node fit).
        concurrent: replicas moving a tensor over the same node pair at once.
    """
    if nbytes <= 0:
        return 0.0
    streams = min(sender.tp, receiver.tp)
    piece = nbytes / streams
    total = concurrent * nbytes
    if same_node:
        fit = network.intra(sender.gpu_type, 2 * concurrent * streams)
    else:
        fit = network.inter(
            sender.zone,
            sender.gpu_type,
            receiver.zone,
            receiver.gpu_type,
            concurrent * streams,
        )
    gather = all_gather_time(network, receiver.gpu_type, receiver.tp, nbytes)
    return total / fit.bandwidth(piece) + gather


#: Rings of replicas alike already priced, by network: ``{(kind, nodes):
#: hops}`` (a proof at 131,072 GPUs prices the all-reduce of 1,024 replicas
#: for every plan it predicts, over a few node layouts; the tables are fixed
#: once built, so a ring's hops are too).
_ALIKE_RINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MOST_RINGS = 4096


def ring_hops(
    network: NetworkTables,
    replicas: Sequence[Replica],
    nodes: Sequence[Hashable],
) -> list[tuple[object, float]]:
    """The distinct hops of a ring: ``(fit, streams)`` pairs, where a hop moving
    ``chunk`` bytes per GPU takes ``streams * chunk / fit.bandwidth(chunk)``
    (a ring of replicas alike, as a :class:`~pipedejavu.core.replica.
    ReplicaRow` holds them, priced once per network and node layout)."""
    kind = alike(replicas)
    if kind is None:
        return _ring_hops(network, replicas, nodes, kind)
    rings = _ALIKE_RINGS.setdefault(network, {})
    key = (kind, tuple(nodes))
    hops = rings.get(key)  # (one lookup: another thread may clear the cache)
    if hops is None:
        hops = _ring_hops(network, replicas, nodes, kind)
        if len(rings) >= _MOST_RINGS:
            rings.clear()
        rings[key] = hops
    return list(hops)


def _ring_hops(
    network: NetworkTables,
    replicas: Sequence[Replica],
    nodes: Sequence[Hashable],
    kind: Replica | None,
) -> list[tuple[object, float]]:
    """:func:`ring_hops`, computed."""
    count = len(replicas)
    replicas = one_by_one(replicas)
    if kind is not None:  # one kind: its replicas counted per node at once
        per_node = {node: k * kind.tp for node, k in Counter(nodes).items()}
    else:
        per_node = {}
        for replica, node in zip(replicas, nodes, strict=True):
            per_node[node] = per_node.get(node, 0) + replica.tp
    links: dict[tuple, tuple[Replica, Replica, int | None]] = {}
    for j in range(count):  # what a hop's price reads, first
        a, b = replicas[j], replicas[(j + 1) % count]
        if nodes[j] == nodes[(j + 1) % count]:
            gpus = per_node[nodes[j]]
            link = (a.gpu_type, gpus)
        else:
            gpus = None
            link = (a.zone, a.gpu_type, b.zone, b.gpu_type, min(a.tp, b.tp))
        links.setdefault(link, (a, b, gpus))
    hops = {}
    for a, b, gpus in links.values():
        if gpus is not None:
            # per stream: the node's aggregate over the gpus / 2 pairs it
            # measured, so a hop takes (gpus / 2) x chunk / aggregate
            key = (network.intra(a.gpu_type, gpus), max(gpus / 2.0, 1.0))
        else:
            streams = min(a.tp, b.tp)
            fit = network.inter(a.zone, a.gpu_type, b.zone, b.gpu_type, streams)
            key = (fit, float(streams))
        hops[key] = None
    return list(hops)


def ring_allreduce_time(
    network: NetworkTables,
    replicas: Sequence[Replica],
    nodes: Sequence[Hashable],
    nbytes: float,
    *,
    hops: list[tuple[object, float]] | None = None,
) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` per GPU over the replicas.

    Args:
        network: the link fits.
        replicas: the ring's members in ring order (one TP group each; their
            ``tp`` rings run side by side).
        nodes: the node of each member (see :func:`node_key`).
        nbytes: bytes each GPU contributes (its gradient shard of the bucket).
        hops: :func:`ring_hops` of the same ring, when already known.
    """
    count = len(replicas)
    if count <= 1 or nbytes <= 0:
        return 0.0
    if hops is None:
        hops = ring_hops(network, replicas, nodes)
    chunk = nbytes / count
    return 2 * (count - 1) * _slowest_hop(hops, chunk)


def _slowest_hop(hops: list[tuple[object, float]], chunk: Any) -> Any:
    """Seconds of one ring step moving ``chunk`` bytes per GPU (a float, or an
    array of chunks): its slowest hop."""
    if isinstance(chunk, np.ndarray):
        per_hop = [streams * chunk / fit.bandwidths(chunk) for fit, streams in hops]
        return np.max(per_hop, axis=0)
    return max(streams * chunk / fit.bandwidth(chunk) for fit, streams in hops)


def ring_allreduce_times(
    hops: list[tuple[object, float]], count: int, nbytes: NDArray[np.float64]
) -> NDArray[np.float64]:
    """:func:`ring_allreduce_time` of each entry of ``nbytes`` on a ring of
    ``count`` members whose :func:`ring_hops` are ``hops``."""
    if count <= 1 or not hops:
        return np.zeros_like(nbytes)
    chunk = nbytes / count
    return np.where(nbytes > 0, 2 * (count - 1) * _slowest_hop(hops, chunk), 0.0)
