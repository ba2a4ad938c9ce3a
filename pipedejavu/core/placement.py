"""Where a plan's GPUs sit: nodes, and the rank order a placement follows.

A :class:`~pipedejavu.core.plan3d.Plan3D` records the node of each replica
(``Replica.node``); its :class:`~pipedejavu.core.layout.ParallelLayout` says
which rank each GPU has. This module joins the two: the nodes a layout's ranks
fill in order (:func:`canonical_nodes`, :func:`rank_nodes`), whether a plan's
nodes fit the machines (:func:`check_nodes`), and which rank order a plan's
nodes follow (:func:`rank_order_of`, for files written before plans stored
their layout).

Rank orders here are the names :data:`~pipedejavu.core.plan3d.RANK_ORDERS`
gives (``tp-dp-pp``, ``tp-pp-dp``); the layout reads them as its own
(:data:`~pipedejavu.core.layout.LEGACY_ORDERS`).

Vocabulary: imports only :mod:`pipedejavu.core.layout` and the errors. A plan
is read through its ``stages`` (each with ``replicas``: ``gpu_type``, ``tp``,
``node``) and ``dp``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import LEGACY_ORDERS, PP_OUTER, ParallelLayout
from pipedejavu.core.replica import ReplicaRow, alike

__all__ = [
    "RANK_ORDERS",
    "canonical_nodes",
    "check_nodes",
    "orders_of_nodes",
    "plan_rank_order",
    "rank_nodes",
    "rank_order_of",
    "sequence_shares",
]

#: Megatron-LM's rank orders of a 3D plan, innermost first: ``tp-dp-pp`` (its
#: default ``tp-cp-ep-dp-pp``: a stage's replicas take consecutive ranks, then
#: the next stage) and ``tp-pp-dp`` (``--use-tp-pp-dp-mapping``: a pipeline's
#: stages take consecutive ranks, then the next pipeline).
RANK_ORDERS = tuple(LEGACY_ORDERS)


def check_nodes(plan: Any, gpus_per_node: Callable[[str], int]) -> None:
    """Check that no node holds more GPUs than it has.

    A replica without a node has one of its own (``tp <= gpus_per_node``).
    Replicas naming node ``k`` are laid on it in plan order (stage, then
    replica), as Megatron's rank order does, after what spills over from node
    ``k - 1``: each must start on a GPU of the node (a TP group may run on into
    the next node, as the per-stage TP search's rank order places it), and a
    node holds one GPU type.

    Raises:
        ProblemError: naming the node, its GPUs and what the plan puts there.
    """
    if _rows_fit(plan, gpus_per_node):
        return
    # per node, in plan order: [GPUs placed, the last replica's tp, its GPU
    # type, that type's node size, every type placed there]
    placed: dict[int, list[Any]] = {}
    capacities: dict[str, int] = {}  # asked once per GPU type
    for s, stage in enumerate(plan.stages):
        kind = alike(stage.replicas)
        if kind is None:
            groups = [(r, r.node, 1) for r in stage.replicas]
        else:  # one kind: the replicas on each node counted at once
            groups = [(kind, n, k) for n, k in Counter(stage.replicas.nodes).items()]
        for replica, node, count in groups:
            gpu, tp = replica.gpu_type, replica.tp
            capacity = capacities.get(gpu)
            if capacity is None:
                capacity = capacities[gpu] = gpus_per_node(gpu)
            if tp > capacity:
                raise ProblemError(
                    f"stage {s}: tp {tp} exceeds the {capacity} GPUs of a {gpu} node"
                )
            if node is None:
                continue
            entry = placed.get(node)
            if entry is None:
                placed[node] = [tp * count, tp, gpu, capacity, {gpu}]
            else:
                entry[0] += tp * count
                entry[1] = tp
                entry[4].add(gpu)
    if all(e[0] <= e[3] and len(e[4]) == 1 for e in placed.values()):
        return  # no node overfull, none spills over: every replica starts on it
    spill, previous = 0, None
    for node in sorted(placed):
        if previous is None or node != previous + 1:
            spill = 0
        total, last, gpu, capacity, types = placed[node]
        if len(types) > 1:
            raise ProblemError(
                f"node {node} holds replicas of GPU types {sorted(types)}; a "
                "node has one type"
            )
        # replicas start at offsets spill, spill + tp_1, ...: the last the highest
        if spill + total - last >= capacity:
            raise ProblemError(
                f"node {node} has {capacity} {gpu} GPUs, but the plan places "
                f"{spill + total} GPUs on it (replicas' tp summed, with what "
                "spills over from the node before)"
            )
        spill, previous = max(spill + total - capacity, 0), node


def _rows_fit(plan: Any, gpus_per_node: Callable[[str], int]) -> bool:
    """Whether a plan of rows (:class:`~pipedejavu.core.replica.ReplicaRow`)
    of one GPU type fits its nodes at a glance: no TP group larger than a
    node, no node holding more than it has (then no replica spills over and
    each starts on its node: :func:`check_nodes` accepts it). ``False`` when
    it is not such a plan or does not fit so (:func:`check_nodes` then reads
    it replica by replica, and says why where it fails)."""
    kinds = [alike(stage.replicas) for stage in plan.stages]
    if any(kind is None for kind in kinds) or len({k.gpu_type for k in kinds}) > 1:
        return False
    capacity = gpus_per_node(kinds[0].gpu_type)
    if max(kind.tp for kind in kinds) > capacity:
        return False
    nodes, gpus = [], []
    for kind, stage in zip(kinds, plan.stages, strict=True):
        placed = [node for node in stage.replicas.nodes if node is not None]
        nodes += placed
        gpus += [kind.tp] * len(placed)
    return not nodes or int(np.bincount(nodes, weights=gpus).max()) <= capacity


def rank_nodes(
    first: int, dp: int, tp: int, gpus_per_node: int, stride: int | None = None
) -> list[int]:
    """The node of each of the ``dp`` replicas of a stage whose ranks start at
    ``first``, replica ``j`` at ``first + j x stride``: ``stride = tp`` in
    Megatron's default rank order (TP innermost, then data; ``None``), the
    GPUs of a pipeline with ``--use-tp-pp-dp-mapping``."""
    step = tp if stride is None else stride
    return [(first + j * step) // gpus_per_node for j in range(dp)]


def canonical_nodes(
    stage_tps: Sequence[int],
    dp: int,
    gpus_per_node: int,
    order: str = RANK_ORDERS[0],
) -> list:
    """Node of replica ``j`` of stage ``s`` in a rank order of
    :data:`RANK_ORDERS`: its first rank by the layout's
    rule (:meth:`~pipedejavu.core.layout.ParallelLayout.replica_ranks`: ``dp
    sum_{r<s} tp_r + j tp_s`` in ``tp-dp-pp``, ``j G + sum_{r<s} tp_r`` with
    ``G = sum_r tp_r`` in ``tp-pp-dp``) over ``gpus_per_node``."""
    if order not in RANK_ORDERS:
        raise ProblemError(f"rank order must be one of {RANK_ORDERS}, got {order!r}")
    layout = ParallelLayout(tuple(stage_tps), dp, order=order)
    return [
        [rank // gpus_per_node for rank in layout.replica_ranks(s)]
        for s in range(layout.pp)
    ]


def orders_of_nodes(
    plan: Any, gpus_per_node: int | None = None
) -> tuple[str, ...] | None:
    """The rank orders of :data:`RANK_ORDERS` whose placement the plan's
    nodes follow (numbered from its first node), the default first; ``None``:
    the nodes cannot tell (replicas without a node, several GPU types).
    ``gpus_per_node`` ``None``: the most GPUs the plan puts on one node (a
    placement in either order fills its first node, or fits in one)."""
    replicas = [r for stage in plan.stages for r in stage.replicas]
    if any(r.node is None for r in replicas):
        return None
    if gpus_per_node is None:
        load: dict[int, int] = {}
        for r in replicas:
            load[r.node] = load.get(r.node, 0) + r.tp
        gpus_per_node = max(load.values())
    if len({r.gpu_type for r in replicas}) > 1:
        return None
    tps = [stage.replicas[0].tp for stage in plan.stages]
    base = min(r.node for r in replicas)
    have = [[r.node - base for r in stage.replicas] for stage in plan.stages]
    return tuple(
        order
        for order in RANK_ORDERS
        if canonical_nodes(tps, plan.dp, gpus_per_node, order) == have
    )


def rank_order_of(plan: Any, gpus_per_node: int | None = None) -> str | None:
    """The rank order of :data:`RANK_ORDERS` whose placement the plan's nodes
    follow, the default first where both do (:func:`orders_of_nodes`);
    ``None``: neither, or the nodes cannot tell. How files written before
    plans stored their layout are read."""
    orders = orders_of_nodes(plan, gpus_per_node)
    return orders[0] if orders else None


def plan_rank_order(plan: Any, gpus_per_node: int | None = None) -> str:
    """The plan's rank order, its layout's (named as in :data:`RANK_ORDERS`),
    checked against its nodes where they tell.

    Raises:
        ProblemError: the nodes follow only the other order.
    """
    order = _LEGACY_NAMES[plan.layout.order]
    orders = orders_of_nodes(plan, gpus_per_node)
    if orders and order not in orders:
        raise ProblemError(
            f"the plan's layout says rank order {order}, but its nodes are "
            f"placed in {orders[0]}"
        )
    return order


_LEGACY_NAMES = {name: legacy for legacy, name in LEGACY_ORDERS.items()}


def sequence_shares(plan: Any, gpus_per_node: int) -> Any:
    """A context-parallel plan (``plan.layout.cp = c > 1``) in the form the
    predictor prices it: each of the ``c`` GPUs of a sequence a data-parallel
    replica of its own on ``1 / c`` of every sample, so ``c x`` the replicas
    (those of one sequence neighbours, as the rank order ``tp-cp-dp-pp``
    places them: each a TP group of its own, on the node :func:`canonical_nodes`
    gives it), ``c x`` the global batch of such shares, and shard groups of
    ``dp_shard x c`` of them. A plan without context parallelism is returned
    as it is.

    Raises:
        ProblemError: a plan with several GPU types or rank orders other than
            the default with context parallelism (not priced).
    """
    layout = plan.layout
    c = layout.cp
    if c == 1:
        return plan
    types = {r.gpu_type for stage in plan.stages for r in stage.replicas}
    if len(types) > 1 or layout.order != PP_OUTER:
        raise ProblemError(
            "context parallelism is priced on one GPU type in the default rank "
            f"order ({PP_OUTER}); the plan has {sorted(types)}, {layout.order}"
        )
    tps = [axes.tp for axes in layout.stages]
    nodes = canonical_nodes(tps, layout.dp * c, gpus_per_node)
    stages = tuple(
        dataclasses.replace(stage, replicas=ReplicaRow(stage.replicas[0], nodes[s]))
        for s, stage in enumerate(plan.stages)
    )
    shard = layout.shard_replicas * c
    folded = ParallelLayout(
        tuple(axes for axes in layout.stages), layout.dp * c, 1, layout.order, shard
    )
    return dataclasses.replace(plan, stages=stages, gbs=plan.gbs * c, layout=folded)
