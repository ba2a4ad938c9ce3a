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

* Sailor's ``plan_config`` JSON (detected by its ``pipeline_list`` key; see
  :mod:`pipedejavu.io.sailor_plan`).

Bounds (checked before any work; :class:`ProblemError` otherwise): ``gbs`` and
``mbs`` in ``[1, MAX_GLOBAL_BATCH]`` (65,536 samples) with ``gbs >= mbs x dp``,
at most :data:`~pipedejavu.core.layout.MAX_GPUS` (131,072) GPUs in a plan;
``tp`` and ``gpus_on_node`` in ``[1, MAX_GPUS]``, ``node`` in ``[0, MAX_GPUS)``,
stage bounds in ``[0, 2**20]``. Imports only the vocabulary (layout, placement).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipedejavu.core.layout import (
    LEGACY_ORDERS,
    MAX_GPUS,
    PP_OUTER,
    ParallelLayout,
    StageAxes,
    rank_order,
)
from pipedejavu.core.placement import (
    RANK_ORDERS,
    canonical_nodes,
    check_nodes,
    rank_nodes,
    rank_order_of,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import (
    DEFAULT_ZONE,
    Replica,
    ReplicaRow,
    alike,
    kinds_of,
    replica_of,
)
from pipedejavu.core.validation import describe, positive_int

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
    "ReplicaRow",
    "Stage3D",
    "canonical_nodes",
    "check_nodes",
    "is_stage_plan",
    "rank_nodes",
    "rank_order_of",
    "replica_of",
]

PLAN3D_FORMAT = "pipedejavu.core.plan3d"
#: The ``"kind"`` our 3D plan JSON declares (a stage plan of ``solve`` has none).
PLAN3D_KIND = "training-plan"
#: Largest global batch (samples per iteration) a plan or a search accepts.
MAX_GLOBAL_BATCH = 2**16
#: Most GPUs in a pool that ``plan`` searches (all types together; as many
#: as a plan holds; its time grows with the pool:
#: ``benchmarks/results/large_pools.json``).
MAX_SEARCH_GPUS = 2**17
_MAX_ITEMS = MAX_GPUS  # stages x replicas a plan may hold (each >= 1 GPU)
#: Last layer a stage may end at: far above any model (Llama-3.1-405B has 128
#: transformer layers), a bound on a file's value, not a claim.
_MAX_LAYERS = 2**20
#: Plan files larger than this are refused before parsing (16 MiB).
MAX_PLAN_FILE_BYTES = 16 * 2**20


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
    replicas: tuple[Replica, ...] | ReplicaRow

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
        if isinstance(self.replicas, ReplicaRow):  # checked as it was built
            return
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
        layout: the plan's named axes
            (:class:`~pipedejavu.core.layout.ParallelLayout`): each stage's TP
            (its replicas' ``tp``), expert axes, CP, DP (the replicas) and the
            rank order. ``None``: the stages' TP and DP, no CP or experts, and
            Megatron's default order (:data:`~pipedejavu.core.layout.PP_OUTER`);
            a plan of one stage always stores that order (both are one layout).

    Raises:
        ProblemError: gaps or overlaps between stages, unequal ``dp``, a stage
            whose replicas differ in TP, a layout that does not match the
            stages, bad sizes.
    """

    stages: tuple[Stage3D, ...]
    mbs: int
    gbs: int
    model: str | None = None
    layout: ParallelLayout | None = None

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
        object.__setattr__(self, "layout", _stage_layout(stages, self.layout))
        for name in ("mbs", "gbs"):
            value = positive_int(
                getattr(self, name), name, MAX_GLOBAL_BATCH, " samples"
            )
            object.__setattr__(self, name, value)
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
        return self.layout.num_gpus

    def gpus_by_type(self) -> dict[str, int]:
        """GPUs used per type (a replica holds ``tp x cp`` of them)."""
        counts: dict[str, int] = {}
        cp = self.layout.cp
        for stage in self.stages:
            kind = alike(stage.replicas)
            for replica, count in (
                [(r, 1) for r in stage.replicas] if kind is None else [(kind, stage.dp)]
            ):
                counts[replica.gpu_type] = (
                    counts.get(replica.gpu_type, 0) + replica.tp * cp * count
                )
        return counts

    def replace(self, **changes: Any) -> Plan3D:
        """A copy with ``changes``; new ``stages`` without a new ``layout``
        keep the plan's CP, rank order and (as many stages) expert axes, with
        the new stages' TP and DP."""
        if "stages" in changes and "layout" not in changes:
            stages = tuple(changes["stages"])
            old = self.layout
            if len(stages) == old.pp:
                axes = tuple(
                    a._replace(tp=s.replicas[0].tp)
                    for a, s in zip(old.stages, stages, strict=True)
                )
            else:
                axes = tuple(s.replicas[0].tp for s in stages)
            dp = len(stages[0].replicas) if stages else old.dp
            shard = old.dp_shard if old.dp_shard and dp % old.dp_shard == 0 else None
            changes["layout"] = ParallelLayout(axes, dp, old.cp, old.order, shard)
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line, e.g. ``pp 2 [12+14], dp 8, tp 4, mbs 8, gbs 1024 (64 GPUs)``."""
        sizes = "+".join(str(s.num_layers) for s in self.stages)
        tps = sorted({r.tp for s in self.stages for r in s.replicas})
        tp = "/".join(str(t) for t in tps)
        types = ", ".join(f"{k}:{v}" for k, v in sorted(self.gpus_by_type().items()))
        layout = self.layout
        extra = f", cp {layout.cp}" if layout.cp > 1 else ""
        eps = sorted({axes.ep for axes in layout.stages})
        if eps != [1]:
            extra += ", ep " + "/".join(str(e) for e in eps)
        etps = sorted({a.expert_tp for a in layout.stages if a.etp is not None})
        if etps:
            extra += ", etp " + "/".join(str(e) for e in etps)
        if layout.dp_shard is not None:
            extra += f", dp_shard {layout.dp_shard}"
        if layout.order != PP_OUTER:
            extra += f", order {layout.order}"
        return (
            f"pp {self.num_stages} [{sizes}], dp {self.dp}, tp {tp}{extra}, "
            f"mbs {self.mbs}, gbs {self.gbs} ({types})"
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
            layout={
                "order": self.layout.order,
                "dp": self.layout.dp,
                "cp": self.layout.cp,
                **(
                    {}
                    if self.layout.dp_shard is None
                    else {"dp_shard": self.layout.dp_shard}
                ),
            },
            stages=[
                _stage_json(stage, axes)
                for stage, axes in zip(self.stages, self.layout.stages, strict=True)
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
            order, cp, shard = _file_layout(data.get("layout"), order)
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
            stages, axes = [], []
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
                axes.append(StageAxes(built[0].tp, item.get("ep", 1), item.get("etp")))
            layout = ParallelLayout(
                tuple(axes), len(stages[0].replicas), cp, order or PP_OUTER, shard
            )
            stated = (data.get("layout") or {}).get("dp", layout.dp)
            if stated != layout.dp:
                raise ProblemError(
                    f"the layout's dp {describe(stated)} is not the "
                    f"{layout.dp} replicas of each stage"
                )
            plan = cls(
                stages=tuple(stages),
                mbs=data.get("mbs"),
                gbs=data.get("gbs"),
                model=data.get("model"),
                layout=layout,
            )
            inferred = None if order is not None else rank_order_of(plan)
            if inferred is not None:  # a file written before plans had layouts
                layout = dataclasses.replace(layout, order=LEGACY_ORDERS[inferred])
                plan = dataclasses.replace(plan, layout=layout)
            return plan
        except ProblemError as error:
            raise ProblemError(f"{source}: not a valid 3D plan: {error}") from None


def _stage_layout(
    stages: tuple[Stage3D, ...], layout: ParallelLayout | None
) -> ParallelLayout:
    """The plan's layout: ``layout`` checked against the stages, or the one
    they imply (module docstring of :class:`Plan3D`)."""
    tps = []
    for index, stage in enumerate(stages):
        found = sorted({kind.tp for kind in kinds_of(stage.replicas)})
        tp = stage.replicas[0].tp
        if len(found) > 1:
            raise ProblemError(
                f"stage {index} mixes TP degrees {found}: the replicas of a stage "
                "share its tensor-parallel layout"
            )
        tps.append(tp)
    dp = len(stages[0].replicas)
    if layout is None:
        layout = ParallelLayout(tuple(tps), dp)
    elif not isinstance(layout, ParallelLayout):
        raise ProblemError(f"layout must be a ParallelLayout, got {describe(layout)}")
    else:
        if (layout.pp, layout.dp) != (len(stages), dp):
            raise ProblemError(
                f"the layout has pp {layout.pp} and dp {layout.dp}, the plan "
                f"{len(stages)} stages of {dp} replicas"
            )
        for index, (axes, tp) in enumerate(zip(layout.stages, tps, strict=True)):
            if axes.tp != tp:
                raise ProblemError(
                    f"stage {index}: the layout says tp {axes.tp}, its replicas {tp}"
                )
    if layout.pp == 1 and layout.order != PP_OUTER:
        layout = dataclasses.replace(layout, order=PP_OUTER)
    return layout


def _stage_json(stage: Stage3D, axes: StageAxes) -> dict[str, Any]:
    out: dict[str, Any] = {
        "layers": [stage.start, stage.stop],
        "replicas": [r.to_json() for r in stage.replicas],
    }
    if axes.ep != 1:
        out["ep"] = axes.ep
    if axes.etp is not None:
        out["etp"] = axes.etp
    return out


_LAYOUT_KEYS = ("order", "dp", "cp", "dp_shard")


def _file_layout(
    data: Any, legacy_order: str | None
) -> tuple[str | None, int, int | None]:
    """A file's ``"layout"`` object: its order (``None``: not stated; the
    legacy ``"rank_order"`` read as the layout's name), its ``cp`` and its
    ``dp_shard`` (``None``: all of ``dp``)."""
    order = None if legacy_order is None else LEGACY_ORDERS[legacy_order]
    if data is None:
        return order, 1, None
    if not isinstance(data, dict):
        raise ProblemError(f"'layout' must be an object, got {describe(data)}")
    unknown = sorted(set(data) - set(_LAYOUT_KEYS))
    if unknown:
        raise ProblemError(
            f"'layout': unknown key {unknown[0]!r} (known: {', '.join(_LAYOUT_KEYS)})"
        )
    if "order" in data:
        order = rank_order(data["order"])
    return order, data.get("cp", 1), data.get("dp_shard")


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
