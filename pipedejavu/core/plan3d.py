"""The vocabulary of Megatron/DeepSpeed-style training plans (3D parallelism).

A :class:`Plan3D` is what practitioners launch with Megatron-LM or DeepSpeed's
pipeline engine: contiguous **stages** over the model's layers; for every stage
``dp`` **replicas** (data parallelism, the same number for every stage), each a
tensor-parallel (TP) group of ``tp`` GPUs of one type inside one node; a
micro-batch size ``mbs`` and a global batch ``gbs``. Every pipeline runs
``ceil(gbs / (mbs * dp))`` micro-batches per iteration.

Layers are the entries of a per-layer profile: for a model with ``L`` transformer
layers there are ``L + 2`` of them, ``0`` = embeddings, ``1..L`` = transformer
layers, ``L + 1`` = final norm + LM head + loss (the Sailor profiles' indexing).
Stages use half-open ranges ``[start, stop)`` like :class:`pipedejavu.Stage`.

Placement: ``Replica.node`` names the physical node a TP group runs on (several
groups may share a node when ``tp`` is smaller than the node). ``None`` means
"a node of its own", the convention of Sailor's ``plan_config`` files, in which
every replica entry is a node.

Files (readers never execute anything and bound what they read):

* our JSON (:meth:`Plan3D.to_json` / :meth:`Plan3D.from_json`)::

    {"format": "pipedejavu.core.plan3d", "kind": "training-plan",
     "model": "OPT-350", "mbs": 8, "gbs": 1024,
     "stages": [{"layers": [0, 12], "replicas": [{"gpu": "GH-96", "tp": 4}]},
                {"layers": [12, 26], "replicas": [{"gpu": "GH-96", "tp": 4}]}]}

  Unknown top-level keys (a planner's ``iteration_time_s``, ...) are ignored;
  ``"kind"`` and ``"format"`` may be absent (files written before them), else
  they must be ``"training-plan"`` and ``"pipedejavu.core.plan3d"``; a
  ``"rank_order"`` (what ``plan --json`` writes) must be one of
  :data:`RANK_ORDERS` or ``null``. A stage plan of ``pipedejavu solve`` (stages with
  ``submesh``) is recognized and refused with a pointer to ``evaluate``.

Bounds (checked before any work; :class:`ProblemError` otherwise): ``gbs`` and
``mbs`` in ``[1, MAX_GLOBAL_BATCH]`` (65,536 samples) with ``gbs >= mbs x dp``
(every replica gets at least one whole micro-batch), at most
:data:`~pipedejavu.core.layout.MAX_GPUS` (131,072) GPUs in a plan (the sum of
its replicas' ``tp``); ``tp`` and ``gpus_on_node`` in ``[1, MAX_GPUS]``,
``node`` in ``[0, MAX_GPUS)``, stage bounds in ``[0, 2**20]``.
* Sailor's ``plan_config`` JSON (detected by its ``pipeline_list`` key; see
  :mod:`pipedejavu.io.sailor_plan`).

This module imports only :mod:`pipedejavu.core.problem` (for :class:`ProblemError`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from pipedejavu.core.layout import MAX_GPUS, ParallelLayout
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.validation import describe

__all__ = [
    "DEFAULT_ZONE",
    "MAX_GLOBAL_BATCH",
    "MAX_GPUS",
    "MAX_PLAN_FILE_BYTES",
    "MAX_SEARCH_GPUS",
    "PLAN3D_FORMAT",
    "PLAN3D_KIND",
    "RANK_ORDERS",
    "Plan3D",
    "Replica",
    "Stage3D",
    "canonical_nodes",
    "check_nodes",
    "is_stage_plan",
    "rank_nodes",
    "rank_order_of",
]

PLAN3D_FORMAT = "pipedejavu.core.plan3d"
#: The ``"kind"`` our 3D plan JSON declares (a stage plan of ``solve`` has none).
PLAN3D_KIND = "training-plan"
#: Largest global batch (samples per iteration) a plan or a search accepts. The
#: predictor simulates every micro-batch, so its time grows with the batch;
#: this keeps a prediction under a second or so.
MAX_GLOBAL_BATCH = 2**16
#: Most GPUs in a pool that ``plan`` searches (all types together): the search
#: grows with the pool's divisors (Llama-3.1-405B on 16,384 H100: ~6 minutes
#: on a 2-core machine, 4,096: ~2.5 minutes).
MAX_SEARCH_GPUS = 2**14
_MAX_ITEMS = MAX_GPUS  # stages x replicas a plan may hold (each >= 1 GPU)
#: Last layer a stage may end at: far above any model (Llama-3.1-405B has 128
#: transformer layers), a bound on a file's value, not a claim.
_MAX_LAYERS = 2**20
#: Zone written into Sailor files when a plan does not name one (Sailor's default).
DEFAULT_ZONE = "us-central1-a"
#: Megatron-LM's rank orders of a 3D plan, innermost first: ``tp-dp-pp`` (its
#: default ``tp-cp-ep-dp-pp``: a stage's replicas take consecutive ranks, then
#: the next stage) and ``tp-pp-dp`` (``--use-tp-pp-dp-mapping``: a pipeline's
#: stages take consecutive ranks, then the next pipeline).
RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")
#: Plan files larger than this are refused before parsing (16 MiB).
MAX_PLAN_FILE_BYTES = 16 * 2**20


def _positive_int(value: Any, name: str, most: int, unit: str = "") -> int:
    """``value`` as an int in ``[1, most]``; an integral float is accepted (JSON
    writers may give ``8.0``). Compared before any arithmetic, so that a huge
    number is refused here instead of overflowing later."""
    integral = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not integral or value < 1:
        raise ProblemError(f"{name} must be a positive integer, got {describe(value)}")
    if value > most:
        raise ProblemError(
            f"{name} must be in [1, {most}]{unit}, got {describe(value)}"
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class Replica:
    """One data-parallel replica of a stage: a TP group on one node.

    Args:
        gpu_type: the GPU type's name as the profiles spell it, e.g. ``"GH-96"``.
        tp: tensor-parallel degree (GPUs in the group), >= 1.
        zone: a key into the network tables (Sailor's zone string).
        node: index of the physical node it runs on, or ``None`` for a node of
            its own.
        gpus_on_node: the GPUs of that node, as Sailor files record it
            (``None``: ``tp``). Kept for the round trip; the predictor uses ``tp``.
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
        object.__setattr__(self, "tp", _positive_int(self.tp, "tp", MAX_GPUS))
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
                _positive_int(self.gpus_on_node, "gpus_on_node", MAX_GPUS),
            )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu_type, "tp": self.tp}
        if self.zone != DEFAULT_ZONE:
            out["zone"] = self.zone
        if self.node is not None:
            out["node"] = self.node
        if self.gpus_on_node is not None:
            out["gpus_on_node"] = self.gpus_on_node
        return out


@dataclasses.dataclass(frozen=True)
class Stage3D:
    """A pipeline stage: layers ``start..stop-1`` and its data-parallel replicas.

    Args:
        start: first layer (inclusive), in the profile's indexing.
        stop: one past the last layer (half-open).
        replicas: the ``dp`` replicas; replica ``j`` of every stage forms
            pipeline ``j``.
    """

    start: int
    stop: int
    replicas: tuple[Replica, ...]

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProblemError(
                    f"stage {name} must be an integer >= 0, got {describe(value)}"
                )
            if value > _MAX_LAYERS:
                raise ProblemError(
                    f"stage {name} must be at most {_MAX_LAYERS}, got {describe(value)}"
                )
        if self.stop <= self.start:
            raise ProblemError(
                f"a stage must hold at least one layer, got [{self.start}, {self.stop})"
            )
        replicas = tuple(self.replicas)
        if not replicas or not all(isinstance(r, Replica) for r in replicas):
            raise ProblemError("a stage needs at least one Replica")
        object.__setattr__(self, "replicas", replicas)

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas."""
        return len(self.replicas)

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    @property
    def num_gpus(self) -> int:
        return sum(r.tp for r in self.replicas)


@dataclasses.dataclass(frozen=True)
class Plan3D:
    """A 3D-parallel training plan (see the module docstring).

    Args:
        stages: contiguous stages starting at layer 0, each with ``dp`` replicas.
        mbs: micro-batch size (samples per micro-batch), >= 1.
        gbs: global batch (samples per iteration over all replicas), >= 1.
        model: the model's profile name (e.g. ``"OPT-350"``), or ``None``.

    Raises:
        ProblemError: gaps or overlaps between stages, unequal ``dp``, bad sizes.
    """

    stages: tuple[Stage3D, ...]
    mbs: int
    gbs: int
    model: str | None = None

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        if not stages or not all(isinstance(s, Stage3D) for s in stages):
            raise ProblemError("a plan needs at least one Stage3D")
        expected = 0
        for index, stage in enumerate(stages):
            if stage.start != expected:
                raise ProblemError(
                    f"stage {index} starts at layer {stage.start}, expected {expected} "
                    "(stages must be contiguous from layer 0)"
                )
            expected = stage.stop
        dps = {stage.dp for stage in stages}
        if len(dps) != 1:
            raise ProblemError(
                "every stage must have the same number of data-parallel replicas "
                f"(Megatron and DeepSpeed run it so), got {[s.dp for s in stages]}"
            )
        object.__setattr__(self, "stages", stages)
        for name in ("mbs", "gbs"):
            value = _positive_int(
                getattr(self, name), name, MAX_GLOBAL_BATCH, " samples"
            )
            object.__setattr__(self, name, value)
        gpus = sum(r.tp for stage in stages for r in stage.replicas)
        if gpus > MAX_GPUS:
            raise ProblemError(
                f"a plan may use at most {MAX_GPUS} GPUs (the sum of its "
                f"replicas' tp), got {gpus}"
            )
        # ceil(gbs / (mbs * dp)) micro-batches (Sailor's convention) allows a last
        # partial one, but below one micro-batch per replica some replicas would
        # get no sample at all.
        dp = stages[0].dp
        if self.gbs < self.mbs * dp:
            raise ProblemError(
                f"gbs {self.gbs} is smaller than mbs x dp = {self.mbs} x {dp}: "
                "every data-parallel replica needs at least one micro-batch"
            )
        if self.model is not None and (
            not isinstance(self.model, str) or not self.model
        ):
            raise ProblemError(f"model must be a non-empty string, got {self.model!r}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def dp(self) -> int:
        """Data-parallel replicas (pipelines)."""
        return self.stages[0].dp

    @property
    def num_layers(self) -> int:
        """Layers covered (``L + 2`` for a whole model)."""
        return self.stages[-1].stop

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per iteration, ``ceil(gbs / (mbs * dp))``."""
        return math.ceil(self.gbs / (self.mbs * self.dp))

    @property
    def num_gpus(self) -> int:
        return sum(stage.num_gpus for stage in self.stages)

    def gpus_by_type(self) -> dict[str, int]:
        """GPUs used per type."""
        counts: dict[str, int] = {}
        for stage in self.stages:
            for replica in stage.replicas:
                counts[replica.gpu_type] = counts.get(replica.gpu_type, 0) + replica.tp
        return counts

    def replace(self, **changes: Any) -> Plan3D:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line, e.g. ``pp 2 [12+14], dp 8, tp 4, mbs 8, gbs 1024 (64 GPUs)``."""
        sizes = "+".join(str(s.num_layers) for s in self.stages)
        tps = sorted({r.tp for s in self.stages for r in s.replicas})
        tp = "/".join(str(t) for t in tps)
        types = ", ".join(f"{k}:{v}" for k, v in sorted(self.gpus_by_type().items()))
        return (
            f"pp {self.num_stages} [{sizes}], dp {self.dp}, tp {tp}, mbs {self.mbs}, "
            f"gbs {self.gbs} ({types})"
        )

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """Our plan JSON (module docstring)."""
        out: dict[str, Any] = {"format": PLAN3D_FORMAT, "kind": PLAN3D_KIND}
        if self.model is not None:
            out["model"] = self.model
        out.update(
            mbs=self.mbs,
            gbs=self.gbs,
            num_microbatches=self.num_microbatches,
            stages=[
                {
                    "layers": [stage.start, stage.stop],
                    "replicas": [r.to_json() for r in stage.replicas],
                }
                for stage in self.stages
            ],
        )
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str = "plan") -> Plan3D:
        """Parse our plan JSON; unknown keys are ignored.

        Raises:
            ProblemError: naming ``source`` and what is wrong.
        """
        try:
            if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
                raise ProblemError("expected an object with a 'stages' list")
            stages_data = data["stages"]
            if is_stage_plan(data):
                raise ProblemError(
                    "this is a stage plan from `pipedejavu solve` (stages with "
                    "'submesh'); use `pipedejavu evaluate`"
                )
            for key, expected in (("kind", PLAN3D_KIND), ("format", PLAN3D_FORMAT)):
                value = data.get(key, expected)
                if value != expected:
                    raise ProblemError(
                        f"{key!r} must be {expected!r} (or absent), got "
                        f"{describe(value)}"
                    )
            order = data.get("rank_order")
            if order is not None and order not in RANK_ORDERS:
                raise ProblemError(
                    f"'rank_order' must be {' or '.join(RANK_ORDERS)} (or null), "
                    f"got {describe(order)}"
                )
            # Shapes first, so that counting the replicas below is safe.
            for index, item in enumerate(stages_data):
                if not isinstance(item, dict):
                    raise ProblemError(f"stage {index} is not an object")
                if not isinstance(item.get("replicas"), list):
                    raise ProblemError(
                        f"stage {index}: 'replicas' must be a list, got "
                        f"{describe(item.get('replicas'))}"
                    )
            if sum(len(item["replicas"]) for item in stages_data) > _MAX_ITEMS:
                raise ProblemError(
                    f"more than {_MAX_ITEMS} replicas (a plan uses at most "
                    f"{MAX_GPUS} GPUs)"
                )
            stages = []
            for index, item in enumerate(stages_data):
                layers = item.get("layers")
                if not (isinstance(layers, list) and len(layers) == 2):
                    raise ProblemError(f"stage {index}: 'layers' must be [start, stop]")
                built = []
                for r in item["replicas"]:
                    if not isinstance(r, dict):
                        raise ProblemError(f"stage {index}: a replica is not an object")
                    built.append(
                        Replica(
                            gpu_type=r.get("gpu"),
                            tp=r.get("tp"),
                            zone=r.get("zone", DEFAULT_ZONE),
                            node=r.get("node"),
                            gpus_on_node=r.get("gpus_on_node"),
                        )
                    )
                stages.append(Stage3D(layers[0], layers[1], tuple(built)))
            return cls(
                stages=tuple(stages),
                mbs=data.get("mbs"),
                gbs=data.get("gbs"),
                model=data.get("model"),
            )
        except ProblemError as error:
            raise ProblemError(f"{source}: not a valid 3D plan: {error}") from None


def is_stage_plan(data: Any) -> bool:
    """Whether parsed JSON is a stage/submesh plan of ``pipedejavu solve``
    (``{"method", "cost", "stages": [{"start", "stop", "submesh", ...}]}``),
    not a 3D training plan."""
    if not isinstance(data, dict) or data.get("kind") == PLAN3D_KIND:
        return False
    stages = data.get("stages")
    return (
        isinstance(stages, list)
        and bool(stages)
        and isinstance(stages[0], dict)
        and "layers" not in stages[0]
        and ("submesh" in stages[0] or "start" in stages[0])
    )


def check_nodes(plan: Plan3D, gpus_per_node: Callable[[str], int]) -> None:
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
    placed: dict[int, list[tuple[int, int, str]]] = {}
    capacities: dict[str, int] = {}  # asked once per GPU type
    for s, stage in enumerate(plan.stages):
        for replica in stage.replicas:
            if replica.gpu_type not in capacities:
                capacities[replica.gpu_type] = gpus_per_node(replica.gpu_type)
            capacity = capacities[replica.gpu_type]
            if replica.tp > capacity:
                raise ProblemError(
                    f"stage {s}: tp {replica.tp} exceeds the {capacity} GPUs "
                    f"of a {replica.gpu_type} node"
                )
            if replica.node is not None:
                placed.setdefault(replica.node, []).append(
                    (replica.tp, capacity, replica.gpu_type)
                )
    spill, previous = 0, None
    for node in sorted(placed):
        if previous is None or node != previous + 1:
            spill = 0
        items = placed[node]
        gpu, capacity = items[0][2], items[0][1]
        if any(t != gpu for _, _, t in items):
            raise ProblemError(
                f"node {node} holds replicas of GPU types "
                f"{sorted({t for _, _, t in items})}; a node has one type"
            )
        offset = spill
        for tp, _, _ in items:
            if offset >= capacity:
                raise ProblemError(
                    f"node {node} has {capacity} {gpu} GPUs, but the plan places "
                    f"{spill + sum(t for t, _, _ in items)} GPUs on it (replicas' "
                    "tp summed, with what spills over from the node before)"
                )
            offset += tp
        spill, previous = max(offset - capacity, 0), node


def same_structure(a: Plan3D, b: Plan3D) -> bool:
    """Whether two plans have the same stages, replicas, mbs and gbs."""
    return a.stages == b.stages and a.mbs == b.mbs and a.gbs == b.gbs


def replicas_of(stages: Sequence[Stage3D], j: int) -> list[Replica]:
    """Pipeline ``j``: replica ``j`` of every stage."""
    return [stage.replicas[j] for stage in stages]


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
    :data:`~pipedejavu.core.plan3d.RANK_ORDERS`: its first rank by the layout's
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


def rank_order_of(plan: Plan3D, gpus_per_node: int | None = None) -> str | None:
    """The rank order of :data:`~pipedejavu.core.plan3d.RANK_ORDERS` whose
    placement the plan's nodes follow (numbered from its first node), the
    default first where both do; ``None``: neither (or replicas without a
    node, several GPU types, TP degrees differing within a stage).
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
    if any(r.tp != s.replicas[0].tp for s in plan.stages for r in s.replicas):
        return None
    base = min(r.node for r in replicas)
    have = [[r.node - base for r in stage.replicas] for stage in plan.stages]
    for order in RANK_ORDERS:
        if canonical_nodes(tps, plan.dp, gpus_per_node, order) == have:
            return order
    return None
