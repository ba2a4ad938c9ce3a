"""A data-parallel replica of a pipeline stage, and a stage's row of them.

A :class:`Replica` is one TP group of ``tp`` GPUs of one type on one node; a
stage of a :class:`~pipedejavu.core.plan3d.Plan3D` holds ``dp`` of them.
:func:`replica_of` shares one checked object per value (plans of thousands of
replicas are built many times over by the planners). A :class:`ReplicaRow` is
a stage's replicas when they are alike but for their nodes (what the planners
and the predictor build): a sequence of replicas equal to the tuple of them,
held as one replica and the nodes, so that a stage of 16,384 GPUs costs no
object per replica, and the code that prices it can read its nodes at once
(:func:`alike`).

Vocabulary: imports only the errors, the layout's bounds and the validators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, overload

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import MAX_GPUS
from pipedejavu.core.validation import describe, positive_int

__all__ = [
    "DEFAULT_ZONE",
    "MAX_INTERNED_REPLICAS",
    "Replica",
    "ReplicaRow",
    "alike",
    "kinds_of",
    "one_by_one",
    "replica_of",
]

#: Zone written into Sailor files when a plan does not name one (Sailor's default).
DEFAULT_ZONE = "us-central1-a"


@dataclasses.dataclass(frozen=True)
class Replica:
    """One data-parallel replica of a stage: a TP group on one node.

    Args:
        gpu_type: the GPU type's name as the profiles spell it, e.g. ``"GH-96"``.
        tp: tensor-parallel degree (GPUs in the group), >= 1.
        zone: a key into the network tables (Sailor's zone string).
        node: the physical node it runs on (``None``: a node of its own).
        gpus_on_node: the GPUs of that node, as Sailor files record it
            (``None``: ``tp``), kept for the round trip.
    """

    gpu_type: str
    tp: int
    zone: str = DEFAULT_ZONE
    node: int | None = None
    gpus_on_node: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise ProblemError(
                f"gpu_type must be a non-empty string, got {self.gpu_type!r}"
            )
        if not isinstance(self.zone, str) or not self.zone:
            raise ProblemError(f"zone must be a non-empty string, got {self.zone!r}")
        object.__setattr__(self, "tp", positive_int(self.tp, "tp", MAX_GPUS))
        if self.node is not None:
            if isinstance(self.node, bool) or not isinstance(self.node, int):
                raise ProblemError(
                    f"node must be an integer >= 0, got {describe(self.node)}"
                )
            if not 0 <= self.node < MAX_GPUS:
                raise ProblemError(
                    f"node must be an integer in [0, {MAX_GPUS}) (a plan has at "
                    f"most {MAX_GPUS} GPUs), got {describe(self.node)}"
                )
        if self.gpus_on_node is not None:
            object.__setattr__(
                self,
                "gpus_on_node",
                positive_int(self.gpus_on_node, "gpus_on_node", MAX_GPUS),
            )

    def on_node(self, node: int | None) -> Replica:
        """This replica on ``node`` (a shared object, :func:`replica_of`)."""
        return replica_of(self.gpu_type, self.tp, self.zone, node, self.gpus_on_node)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu_type, "tp": self.tp}
        if self.zone != DEFAULT_ZONE:
            out["zone"] = self.zone
        if self.node is not None:
            out["node"] = self.node
        if self.gpus_on_node is not None:
            out["gpus_on_node"] = self.gpus_on_node
        return out


MAX_INTERNED_REPLICAS = 2**20  #: replicas :func:`replica_of` keeps, at most
_interned: dict[tuple, Replica] = {}


def replica_of(
    gpu_type: str,
    tp: int,
    zone: str = DEFAULT_ZONE,
    node: int | None = None,
    gpus_on_node: int | None = None,
) -> Replica:
    """``Replica(gpu_type, tp, zone, node, gpus_on_node)``, one frozen object
    per value: the planners build plans of thousands of replicas many times
    over, and one checked once need not be built and checked again."""
    key = (gpu_type, tp, zone, node, gpus_on_node)
    found = _interned.get(key)
    if found is None:
        if len(_interned) >= MAX_INTERNED_REPLICAS:
            _interned.clear()
        found = _interned[key] = Replica(*key)
    return found


class ReplicaRow(Sequence[Replica]):
    """``len(nodes)`` replicas like ``kind`` (its ``node`` ignored), replica
    ``j`` on ``nodes[j]``: equal (and hashing alike) to the tuple of them.

    Raises:
        ProblemError: a node that is not an integer in ``[0, MAX_GPUS)`` or
            ``None``, or no node at all.
    """

    __slots__ = ("kind", "nodes")

    def __init__(self, kind: Replica, nodes: Sequence[int | None]) -> None:
        nodes = tuple(nodes)
        if not nodes:
            raise ProblemError("a stage needs at least one Replica")
        for node in set(nodes):  # as Replica checks each (its message)
            if node is not None and (type(node) is not int or not 0 <= node < MAX_GPUS):
                Replica(kind.gpu_type, kind.tp, kind.zone, node)
        self.kind = kind.on_node(None)
        self.nodes = nodes

    def __len__(self) -> int:
        return len(self.nodes)

    @overload
    def __getitem__(self, index: int) -> Replica: ...

    @overload
    def __getitem__(self, index: slice) -> ReplicaRow: ...

    def __getitem__(self, index: int | slice) -> Replica | ReplicaRow:
        if isinstance(index, slice):
            return ReplicaRow(self.kind, self.nodes[index])
        return self.kind.on_node(self.nodes[index])

    def __iter__(self) -> Iterator[Replica]:
        on_node = self.kind.on_node
        return (on_node(node) for node in self.nodes)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, ReplicaRow):
            return self.kind == other.kind and self.nodes == other.nodes
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ReplicaRow({self.kind!r}, nodes={list(self.nodes)!r})"


def alike(replicas: Sequence[Replica]) -> Replica | None:
    """The replica (on no node) that all of ``replicas`` are but for their
    nodes, when they are held as a :class:`ReplicaRow`; ``None`` otherwise
    (they may still be alike: the caller then reads them one by one)."""
    return replicas.kind if isinstance(replicas, ReplicaRow) else None


def kinds_of(replicas: Sequence[Replica]) -> list[Replica]:
    """The distinct replicas of ``replicas`` but for their nodes (on no node),
    in the order they first come: one for a :class:`ReplicaRow`."""
    kind = alike(replicas)
    if kind is not None:
        return [kind]
    fields = dict.fromkeys((r.gpu_type, r.tp, r.zone, r.gpus_on_node) for r in replicas)
    return [replica_of(g, t, zone, None, n) for g, t, zone, n in fields]


def one_by_one(replicas: Sequence[Replica]) -> Sequence[Replica]:
    """``replicas`` one by one as what prices them reads (all but the node):
    a :class:`ReplicaRow`'s kind repeated, no replica built per node."""
    kind = alike(replicas)
    return replicas if kind is None else [kind] * len(replicas)
