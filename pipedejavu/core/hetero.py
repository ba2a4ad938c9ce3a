"""Hardware-aware stage construction: typed devices, placement, activation transfers.

Alpa's formulation (``pipedejavu.core.problem``) counts devices and ignores links. Here:

* ``compute_cost[i, j, m, k, t]``: the stage ``i..j`` (inclusive) on submesh ``m``,
  config ``k``, running on devices of type ``t``;
  ``max_n_succ_stages[i, j, m, k, t]`` the memory rule on that type.
* ``boundary_bytes[b]``: bytes of the activation crossing the boundary after
  layer ``b`` per micro-batch (the gradient sent back has the same size).
* A plan places every stage physically: ``hosts`` (the hosts it occupies) and
  ``first_device`` (its first device on a host, for a submesh smaller than a
  host). Every device of the cluster is used exactly once (Alpa's rule).

**Transfers.** Between stage ``s`` and ``s + 1`` the activation goes forward and
its gradient comes back once per micro-batch: ``c_s = 2 * link.time(bytes)``, on
the intra-host link when the two stages share a host, else on the inter-host
link between the last host of ``s`` and the first host of ``s + 1``.

**Objective.** Transfers are pipeline steps of their own (a link is busy while it
moves a micro-batch, like a stage computing one), so::

    T = sum_s t_s + sum_s c_s + (B - 1) * max(max_s t_s, max_s c_s)

the critical path of one micro-batch through every stage and link, plus
``B - 1`` times the bottleneck, stage or link. With free links it is Alpa's
``sum + (B - 1) * max`` exactly. :mod:`pipedejavu.simulation.simulate` puts the same
``c_s`` on a link resource between the stages (``transfer = c_s / 2`` per
direction); its GPipe schedule equals this formula when the links are never or
always the bottleneck, while 1F1B can differ either way (its tests show where).

**The plan space** (what :func:`check_hetero_plan` accepts, and what the exact
oracle, the engine and the brute force search): contiguous stages covering
every layer; stage ``s`` runs submesh ``(h, d)`` on ``h`` distinct hosts of any
types, using the ``d`` devices ``first_device .. first_device + d - 1`` of each
(an ``(h, d)`` submesh with ``h > 1`` has ``d = devices_per_host``: whole
hosts); every device of the cluster is used exactly once. Stages share a host
only as partial ``(1, d < devices_per_host)`` stages; whether two consecutive
stages share one is a choice of the placement, priced by the links above (on
slow intra-host links the best plans avoid it).

**Stages over several types** run at their slowest devices: ``device_type``
must be a type of the stage's hosts whose speed is the least among them; when
several of its types tie for that speed the plan may name any of them (solvers
take the cheapest), and the memory rule must hold for *every* type the stage
touches.

**Canonical placement** (:func:`place`, the default of :func:`make_hetero_plan`)
is a convenience for plans given as ``(start, stop, submesh, config, type)``
tuples: each type's stages packed in pipeline order onto that type's hosts. It
is one valid placement among many; solvers return explicit placements.

**Device memory.** Solvers read the memory rule ``max_n_succ_stages[..., t]``
of each type; ``DeviceType.memory_bytes`` reaches them through it:
:mod:`pipedejavu.costmodel.stage.hetero_generate` derives each type's rule from its memory, and
:meth:`HeteroProblem.from_problem` does with :class:`LayerMemory` (and refuses a
``memory_bytes`` it has no way to apply).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.cluster import Cluster
from pipedejavu.core.files import parse_json
from pipedejavu.core.npzfile import read_npz, write_npz
from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    PlanError,
    Problem,
    ProblemError,
    certificate,
    objective,
    plan_fields,
    stage_fields,
)
from pipedejavu.core.validation import (
    MAX_MICROBATCHES,
    StageTableSizes,
    as_count,
    cost_table,
    freeze,
    json_float,
    json_int,
    json_list,
    memory_table,
    submesh_table,
)

__all__ = [
    "HeteroPlan",
    "HeteroProblem",
    "HeteroStage",
    "LayerMemory",
    "check_hetero_plan",
    "evaluate_hetero",
    "hetero_objective",
    "make_hetero_plan",
    "place",
    "transfer_times",
]


#: The keys a heterogeneous problem file must hold (besides the optional
#: ``max_n_succ_stages`` and ``boundary_bytes``).
_HETERO_KEYS = ("cluster_json", "compute_cost", "submesh_shapes", "num_microbatches")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerMemory:
    """Per-layer bytes that let each device type's memory bound the stages.

    Alpa's rule on a device of ``capacity`` bytes, for a stage on layers
    ``i..j`` over ``n`` devices (the rule of
    :func:`pipedejavu.costmodel.profiling.profiler.problem_from_layer_profile`)::

        max_n_succ_stages = floor((capacity - weight_factor * params) /
                                  (stash / n)) - 1

    ``params``, ``stash``: the span's summed ``param_bytes`` and
    ``stash_bytes``; weights, gradients and optimizer state are replicated
    over the stage's devices (``weight_factor`` bytes per parameter byte), each
    in-flight micro-batch's stash is split over them. ``-1``: never fits.

    Args:
        param_bytes: f64[L] parameter bytes of each layer.
        stash_bytes: f64[L] bytes each layer keeps per micro-batch in flight.
        weight_factor: bytes held per parameter byte (4: Adam, fp32).
    """

    param_bytes: NDArray[np.float64]
    stash_bytes: NDArray[np.float64]
    weight_factor: float = 4.0

    def __post_init__(self) -> None:
        params = np.array(self.param_bytes, dtype=np.float64)
        stash = np.array(self.stash_bytes, dtype=np.float64)
        if params.ndim != 1 or stash.shape != params.shape:
            raise ProblemError(
                "layer_memory needs param_bytes and stash_bytes of shape (L,), got "
                f"{params.shape} and {stash.shape}"
            )
        if not (np.isfinite(params).all() and np.isfinite(stash).all()) or (
            (params < 0).any() or (stash < 0).any()
        ):
            raise ProblemError("layer_memory bytes must be finite and >= 0")
        if not (math.isfinite(self.weight_factor) and self.weight_factor >= 0):
            raise ProblemError(
                f"layer_memory weight_factor must be >= 0, got {self.weight_factor}"
            )
        object.__setattr__(self, "param_bytes", params)
        object.__setattr__(self, "stash_bytes", stash)

    def max_n_succ_stages(
        self, submesh_sizes: NDArray[np.int64], capacity: float
    ) -> NDArray[np.int64]:
        """i64[L, L, M] the rule on devices of ``capacity`` bytes (lower
        triangle: -1)."""
        num_layers = self.param_bytes.shape[0]
        params = _span_sums(self.param_bytes)
        stash = np.maximum(_span_sums(self.stash_bytes), 1.0)
        sizes = np.asarray(submesh_sizes, dtype=np.float64)
        free = capacity - self.weight_factor * params
        with np.errstate(divide="ignore", invalid="ignore"):
            limit = np.floor(free[..., None] / (stash[..., None] / sizes)) - 1
        limit = np.where(free[..., None] < 0, -1, limit)
        limit = np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
        limit[np.tril_indices(num_layers, -1)] = -1
        return limit


def _span_sums(values: NDArray[np.float64]) -> NDArray[np.float64]:
    """f64[L, L]: ``[i, j]`` = sum of ``values[i..j]`` (meaningful for i <= j)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, 1:] - prefix[:-1, None]


@dataclasses.dataclass(frozen=True, eq=False)
class HeteroProblem(StageTableSizes):
    """Stage construction on a cluster of typed devices with costly links.

    Args:
        compute_cost: f64[L, L, M, K, T] seconds per micro-batch (forward +
            backward) of layers ``i..j`` on submesh ``m``, config ``k``, device
            type ``t``; inf = infeasible / unprofiled.
        max_n_succ_stages: i64[L, L, M, K, T] Alpa's memory rule per type
            (-1 = never feasible); ``None`` = memory never limits.
        submesh_shapes: i64[M, 2] ``(hosts, devices per host)``.
        cluster: the :class:`Cluster` (its shape is the devices' shape).
        num_microbatches: B >= 1.
        boundary_bytes: f64[L - 1] bytes per micro-batch crossing the boundary
            after each layer (one direction); ``None`` = zeros.
    """

    compute_cost: NDArray[np.float64]
    max_n_succ_stages: NDArray[np.int64] | None
    submesh_shapes: NDArray[np.int64]
    cluster: Cluster
    num_microbatches: int
    boundary_bytes: NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, Cluster):
            raise ProblemError(
                f"cluster must be a Cluster, got {type(self.cluster).__name__}"
            )
        cost = cost_table(self.compute_cost, with_types=True)
        num_layers, _, num_submeshes, _, num_types = cost.shape
        if num_types != self.cluster.num_types:
            raise ProblemError(
                f"compute_cost has {num_types} device types, the cluster "
                f"{self.cluster.num_types}"
            )
        memory = memory_table(self.max_n_succ_stages, cost.shape)
        shapes = submesh_table(self.submesh_shapes, num_submeshes)
        dph = self.cluster.devices_per_host
        for h, d in shapes.tolist():
            if d > dph or (h > 1 and d != dph) or h > self.cluster.num_hosts:
                raise ProblemError(
                    f"submesh ({h}, {d}) does not fit hosts of {dph} devices "
                    f"({self.cluster.num_hosts} hosts)"
                )
        if self.boundary_bytes is None:
            boundary = np.zeros(max(num_layers - 1, 0))
        else:
            boundary = np.asarray(self.boundary_bytes)
            if boundary.dtype.kind not in "iuf":
                raise ProblemError(
                    f"boundary_bytes must be numbers, got dtype {boundary.dtype}"
                )
            boundary = boundary.astype(np.float64)
            if boundary.shape != (num_layers - 1,):
                raise ProblemError(
                    f"boundary_bytes must have shape ({num_layers - 1},), "
                    f"got {boundary.shape}"
                )
            if not np.isfinite(boundary).all() or (boundary < 0).any():
                raise ProblemError("boundary_bytes must be finite and >= 0")
        num_microbatches = as_count(
            self.num_microbatches, "num_microbatches", maximum=MAX_MICROBATCHES
        )
        freeze(
            self,
            compute_cost=cost,
            max_n_succ_stages=memory,
            submesh_shapes=shapes,
            boundary_bytes=boundary,
        )
        object.__setattr__(self, "num_microbatches", num_microbatches)

    # ----------------------------------------- shapes (more in StageTableSizes)
    @property
    def num_types(self) -> int:
        """T, the device types of the cluster."""
        return self.compute_cost.shape[4]

    @property
    def num_devices(self) -> int:
        """D, the devices of the whole cluster."""
        return self.cluster.num_devices

    # ------------------------------------------------------------ conversions
    @classmethod
    def from_problem(
        cls,
        problem: Problem,
        cluster: Cluster,
        *,
        boundary_bytes: Sequence[float] | NDArray[np.float64] | None = None,
        num_microbatches: int | None = None,
        max_n_succ_stages: NDArray[np.int64] | None = None,
        layer_memory: LayerMemory | None = None,
    ) -> HeteroProblem:
        """Scale a profiled (reference-device) problem to typed devices.

        ``compute_cost[..., t] = problem.compute_cost / speed_t``. The memory
        rule per type, in order of precedence:

        * ``max_n_succ_stages`` i64[L, L, M, K, T], when given;
        * from ``layer_memory`` for each type with ``memory_bytes``
          (:meth:`LayerMemory.max_n_succ_stages`; the same on every config),
          the profiled rule for types without;
        * the profiled rule on every type, when no type sets ``memory_bytes``.

        Raises:
            ProblemError: the cluster's shape differs from the problem's; or a
                device type sets ``memory_bytes`` that neither argument lets
                bound stages (the profiled rule was measured on one device;
                applying it to a type with other memory would be wrong).
        """
        if cluster.shape != tuple(problem.cluster_shape):
            raise ProblemError(
                f"cluster shape {cluster.shape} differs from the problem's "
                f"{tuple(problem.cluster_shape)}"
            )
        speeds = np.asarray(cluster.speeds)
        cost = problem.compute_cost[..., None] / speeds
        memory = max_n_succ_stages
        if memory is None:
            per_type = []
            sized = [t for t in cluster.device_types if t.memory_bytes is not None]
            if sized and layer_memory is None:
                names = ", ".join(
                    f"{t.name!r} ({t.memory_bytes / 1e9:g} GB)" for t in sized
                )
                raise ProblemError(
                    f"device memory is set for {names} but the problem carries one "
                    "memory rule (max_n_succ_stages) measured on its profiling "
                    "device: give per-layer parameter and stash bytes "
                    "(layer_memory; a `pipedejavu profile` .npz has them) or "
                    "per-type max_n_succ_stages so device memory bounds the "
                    "stages, or leave memory_gb out of the cluster to use the "
                    "profiled rule on every type"
                )
            for kind in cluster.device_types:
                if kind.memory_bytes is None:
                    per_type.append(problem.max_n_succ_stages)
                    continue
                rule = layer_memory.max_n_succ_stages(
                    problem.submesh_sizes, kind.memory_bytes
                )
                if rule.shape[0] != problem.num_layers:
                    raise ProblemError(
                        f"layer_memory covers {rule.shape[0]} layers, the problem "
                        f"{problem.num_layers}"
                    )
                per_type.append(
                    np.broadcast_to(rule[..., None], problem.compute_cost.shape)
                )
            memory = np.stack(per_type, axis=-1)
        return cls(
            compute_cost=cost,
            max_n_succ_stages=memory,
            submesh_shapes=problem.submesh_shapes,
            cluster=cluster,
            num_microbatches=num_microbatches or problem.num_microbatches,
            boundary_bytes=boundary_bytes,
        )

    def homogeneous_view(self, speed: float | None = None) -> Problem:
        """Alpa's view: one device type at ``speed`` relative to type 0's table.

        Default speed: the device-weighted mean speed of the cluster. Costs are
        ``compute_cost[..., 0] * speed_0 / speed``; memory is the type-0 rule.
        Links are dropped (Alpa ignores them).
        """
        speeds = np.asarray(self.cluster.speeds, dtype=np.float64)
        counts = np.asarray(self.cluster.devices_of_type(), dtype=np.float64)
        if speed is None:
            speed = float((speeds * counts).sum() / counts.sum())
        return Problem(
            compute_cost=self.compute_cost[..., 0] * speeds[0] / speed,
            max_n_succ_stages=self.max_n_succ_stages[..., 0],
            submesh_shapes=self.submesh_shapes,
            cluster_shape=self.cluster.shape,
            num_microbatches=self.num_microbatches,
        )

    def to_npz(self, path: Any) -> Path:
        """Write a problem file that also holds ``boundary_bytes`` and the
        cluster (``cluster_json``); returns the path written (``.npz`` appended
        when missing). Homogeneous readers refuse it by its ``cluster_json``.
        """
        return write_npz(
            path,
            {
                "compute_cost": self.compute_cost,
                "max_n_succ_stages": self.max_n_succ_stages,
                "submesh_shapes": self.submesh_shapes,
                "cluster_shape": np.asarray(self.cluster.shape, dtype=np.int64),
                "num_microbatches": np.int64(self.num_microbatches),
                "boundary_bytes": self.boundary_bytes,
                "cluster_json": np.asarray(json.dumps(self.cluster.to_json())),
            },
        )

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], source: str) -> HeteroProblem:
        """A problem from the arrays of its file (see :meth:`to_npz`).

        Raises:
            ProblemError: invalid contents, the message prefixed by ``source``.
        """
        if "cluster_json" not in arrays:
            raise ProblemError(
                f"{source}: not a heterogeneous problem (no cluster_json); give "
                "a cluster file to make one"
            )
        missing = [key for key in _HETERO_KEYS if key not in arrays]
        if missing:
            raise ProblemError(
                f"{source} lacks the key(s) {', '.join(missing)} of a "
                "heterogeneous problem .npz"
            )
        try:
            text = arrays["cluster_json"]
            if text.shape != () or text.dtype.kind != "U":
                raise ProblemError(
                    f"cluster_json must be one text value, got {text.dtype} "
                    f"{tuple(text.shape)}"
                )
            return cls(
                compute_cost=arrays["compute_cost"],
                max_n_succ_stages=arrays.get("max_n_succ_stages"),
                submesh_shapes=arrays["submesh_shapes"],
                cluster=Cluster.from_json(parse_json(str(text), "cluster_json")),
                num_microbatches=arrays["num_microbatches"],
                boundary_bytes=arrays.get("boundary_bytes"),
            )
        except ProblemError as error:
            raise ProblemError(f"{source}: {error}") from None

    @classmethod
    def from_npz(cls, path: Any) -> HeteroProblem:
        """Read a file written by :meth:`to_npz`.

        Raises:
            ProblemError: one line naming the file (see
                :func:`pipedejavu.core.npzfile.read_npz`), also when the file has no
                cluster (a homogeneous problem).
        """
        arrays = read_npz(
            path,
            required=(),
            optional=_HETERO_KEYS + ("max_n_succ_stages", "boundary_bytes"),
            what="a heterogeneous problem .npz",
        )
        return cls.from_arrays(arrays, str(path))


@dataclasses.dataclass(frozen=True)
class HeteroStage:
    """One stage, placed.

    Args:
        start, stop: half-open layer range.
        submesh_index, config_index: indices into the tables.
        device_type: the type whose table row prices it.
        hosts: host indices it occupies (``submesh[0]`` of them).
        first_device: first device on its host (0 for whole-host submeshes).
        latency: seconds per micro-batch from the table.
    """

    start: int
    stop: int
    submesh: tuple[int, int]
    submesh_index: int
    config_index: int
    device_type: int
    hosts: tuple[int, ...]
    first_device: int
    latency: float

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "stop": self.stop,
            "submesh": list(self.submesh),
            "submesh_index": self.submesh_index,
            "config_index": self.config_index,
            "device_type": self.device_type,
            "hosts": list(self.hosts),
            "first_device": self.first_device,
            "latency": self.latency,
        }


@dataclasses.dataclass(frozen=True)
class HeteroPlan:
    """A placed plan; ``cost`` is :func:`evaluate_hetero` of it, transfers included.

    ``transfers[s]`` is the round-trip transfer time between stage ``s`` and
    ``s + 1`` (seconds per micro-batch).
    """

    stages: tuple[HeteroStage, ...]
    transfers: tuple[float, ...]
    cost: float
    num_microbatches: int
    method: str
    search_time_s: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def inter_host_hops(self, cluster: Cluster) -> int:
        """Boundaries whose two stages share no host."""
        return sum(
            not set(a.hosts) & set(b.hosts)
            for a, b in zip(self.stages, self.stages[1:], strict=False)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "cost": self.cost,
            "num_microbatches": self.num_microbatches,
            "stages": [s.to_json() for s in self.stages],
            "transfers": list(self.transfers),
            "search_time_s": self.search_time_s,
            **certificate(self.info),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "plan JSON") -> HeteroPlan:
        """The plan of a placed-plan JSON object (as :meth:`to_json` writes it).

        Raises:
            ProblemError: naming ``source`` and the field that is missing or of
                the wrong kind (the rules are :func:`check_hetero_plan`'s).
        """
        stages = []
        for index, entry in enumerate(json_list(data, "stages", source)):
            where = f"{source}: stages[{index}]"
            hosts = json_list(entry, "hosts", where)
            stages.append(
                HeteroStage(
                    **stage_fields(entry, where),
                    device_type=json_int(entry, "device_type", where),
                    hosts=tuple(
                        as_count(host, f"{where}.hosts[{i}]", minimum=0)
                        for i, host in enumerate(hosts)
                    ),
                    first_device=json_int(entry, "first_device", where),
                )
            )
        transfers = tuple(
            json_float({"transfer": t}, "transfer", f"{source}: transfers[{i}]")
            for i, t in enumerate(json_list(data, "transfers", source))
        )
        return cls(
            stages=tuple(stages), transfers=transfers, **plan_fields(data, source)
        )


def hetero_objective(
    latencies: Sequence[float], transfers: Sequence[float], num_microbatches: int
) -> float:
    """``sum(t) + sum(c) + (B - 1) * max(max t, max c)`` in seconds
    (:func:`pipedejavu.core.problem.objective` with transfers)."""
    return objective(latencies, num_microbatches, tuple(transfers))


def place(
    problem: HeteroProblem, stages: Sequence[tuple[int, int, int, int, int]]
) -> list[tuple[tuple[int, ...], int]]:
    """Canonical placement of ``(start, stop, submesh, config, type)`` stages:
    each type's stages packed in pipeline order onto that type's hosts (a
    convenience, not the space solvers search; module docstring).

    Returns ``(hosts, first_device)`` per stage. Raises :class:`PlanError`
    (rule ``"placement"`` or ``"devices"``) when a stage would straddle a host
    boundary or a type's devices are not used exactly.
    """
    cluster = problem.cluster
    dph = cluster.devices_per_host
    hosts_by_type = [cluster.hosts_of_type(t) for t in range(cluster.num_types)]
    used = [0] * cluster.num_types
    placed = []
    for index, (_, _, submesh, _, device_type) in enumerate(stages):
        if not 0 <= device_type < cluster.num_types:
            raise PlanError("indices", index, f"device type {device_type} out of range")
        if not 0 <= submesh < problem.num_submeshes:
            raise PlanError("indices", index, f"submesh {submesh} out of range")
        h, d = (int(x) for x in problem.submesh_shapes[submesh])
        offset = used[device_type]
        host_slot, first = divmod(offset, dph)
        if (h > 1 and first != 0) or first + d > dph:
            raise PlanError(
                "placement",
                index,
                f"a ({h}, {d}) submesh at device {first} of a host of {dph} would "
                "straddle hosts",
            )
        mine = hosts_by_type[device_type]
        if host_slot + h > len(mine):
            raise PlanError(
                "devices",
                index,
                f"type {cluster.device_types[device_type].name} has "
                f"{len(mine) * dph} devices; the stages ask for more",
            )
        placed.append((tuple(mine[host_slot : host_slot + h]), first))
        used[device_type] += h * d
    wanted = cluster.devices_of_type()
    if tuple(used) != wanted:
        raise PlanError(
            "devices",
            None,
            f"devices used per type {tuple(used)} must equal the cluster's {wanted}",
        )
    return placed


def _stage_tuples(stages: Sequence[HeteroStage]) -> list[HeteroStage]:
    return list(stages.stages if isinstance(stages, HeteroPlan) else stages)


def check_hetero_plan(
    problem: HeteroProblem, plan: HeteroPlan | Sequence[HeteroStage]
) -> None:
    """Every rule; raise :class:`PlanError` (rule name + stage) on the first break.

    Rules: contiguity and coverage; indices and submesh shape; hosts exist, are
    distinct, number ``submesh[0]``, and the devices fit on them; no device used
    twice and every device used; ``device_type`` is a type of the stage's hosts
    whose speed is the least among them (any of the types tied for it); finite
    latency; the memory rule on every type the stage touches.
    """
    stages = _stage_tuples(plan)
    if not stages:
        raise PlanError("coverage", None, "a plan needs at least one stage")
    cluster = problem.cluster
    dph = cluster.devices_per_host
    expected = 0
    taken = np.zeros((cluster.num_hosts, dph), dtype=bool)
    num_stages = len(stages)
    for index, stage in enumerate(stages):
        if stage.start != expected or stage.stop <= stage.start:
            raise PlanError(
                "contiguity",
                index,
                f"layers [{stage.start}, {stage.stop}) after {expected}",
            )
        expected = stage.stop
        if stage.stop > problem.num_layers:
            raise PlanError(
                "coverage", index, f"stop {stage.stop} > {problem.num_layers}"
            )
        if not 0 <= stage.submesh_index < problem.num_submeshes:
            raise PlanError(
                "indices", index, f"submesh {stage.submesh_index} out of range"
            )
        if not 0 <= stage.config_index < problem.num_configs:
            raise PlanError(
                "indices", index, f"config {stage.config_index} out of range"
            )
        if not 0 <= stage.device_type < problem.num_types:
            raise PlanError(
                "indices", index, f"device type {stage.device_type} out of range"
            )
        h, d = (int(x) for x in problem.submesh_shapes[stage.submesh_index])
        if tuple(stage.submesh) != (h, d):
            raise PlanError(
                "indices", index, f"submesh {stage.submesh} != table's ({h}, {d})"
            )
        hosts = tuple(stage.hosts)
        if len(hosts) != h or len(set(hosts)) != h:
            raise PlanError(
                "placement", index, f"needs {h} distinct hosts, got {hosts}"
            )
        if any(not 0 <= x < cluster.num_hosts for x in hosts):
            raise PlanError("placement", index, f"hosts {hosts} out of range")
        if not 0 <= stage.first_device or stage.first_device + d > dph:
            raise PlanError(
                "placement",
                index,
                f"devices {stage.first_device}..+{d} exceed the host",
            )
        for host in hosts:
            window = taken[host, stage.first_device : stage.first_device + d]
            if window.any():
                raise PlanError(
                    "devices", index, f"a device of host {host} is used twice"
                )
            window[:] = True
        types = {cluster.host_types[x] for x in hosts}
        slowest = min(cluster.device_types[t].speed for t in types)
        if cluster.device_types[stage.device_type].speed != slowest or (
            stage.device_type not in types
        ):
            raise PlanError(
                "device type",
                index,
                f"device_type {stage.device_type} must be the slowest type of "
                f"hosts {hosts}",
            )
        key = (stage.start, stage.stop - 1, stage.submesh_index, stage.config_index)
        if not math.isfinite(problem.compute_cost[key + (stage.device_type,)]):
            raise PlanError("profiled", index, "no finite latency for this stage")
        for t in types:
            allowed = problem.max_n_succ_stages[key + (t,)]
            if num_stages - 1 - index > allowed:
                raise PlanError(
                    "memory",
                    index,
                    f"{num_stages - 1 - index} stages follow; type "
                    f"{cluster.device_types[t].name} allows {allowed}",
                )
    if expected != problem.num_layers:
        raise PlanError(
            "coverage", None, f"layers end at {expected}, not {problem.num_layers}"
        )
    if not taken.all():
        raise PlanError("devices", None, f"{int((~taken).sum())} devices are unused")


def transfer_times(
    problem: HeteroProblem, stages: Sequence[HeteroStage]
) -> list[float]:
    """Round-trip transfer seconds per micro-batch between consecutive stages."""
    stages = _stage_tuples(stages)
    cluster = problem.cluster
    times = []
    for a, b in zip(stages, stages[1:], strict=False):
        shared = [x for x in a.hosts if x in b.hosts]
        link = (
            cluster.link(shared[0], shared[0])
            if shared
            else cluster.link(a.hosts[-1], b.hosts[0])
        )
        times.append(2.0 * link.time(float(problem.boundary_bytes[a.stop - 1])))
    return times


def evaluate_hetero(
    problem: HeteroProblem, plan: HeteroPlan | Sequence[HeteroStage]
) -> float:
    """The exact objective (module doc) after :func:`check_hetero_plan`."""
    stages = _stage_tuples(plan)
    check_hetero_plan(problem, stages)
    latencies = [
        float(
            problem.compute_cost[
                s.start, s.stop - 1, s.submesh_index, s.config_index, s.device_type
            ]
        )
        for s in stages
    ]
    return hetero_objective(
        latencies, transfer_times(problem, stages), problem.num_microbatches
    )


def make_hetero_plan(
    problem: HeteroProblem,
    stages: Sequence[tuple[int, int, int, int, int]],
    *,
    method: str,
    placement: Sequence[tuple[tuple[int, ...], int]] | None = None,
    search_time_s: float = 0.0,
    info: dict[str, Any] | None = None,
) -> HeteroPlan:
    """A checked plan from ``(start, stop, submesh, config, type)`` tuples.

    ``placement`` (``(hosts, first_device)`` per stage) defaults to
    :func:`place`. Cost and transfers are computed, never taken from a solver.
    """
    stages = [tuple(int(x) for x in s) for s in stages]
    if placement is None:
        placement = place(problem, stages)
    built = tuple(
        HeteroStage(
            start=start,
            stop=stop,
            submesh=tuple(int(x) for x in problem.submesh_shapes[m]),
            submesh_index=m,
            config_index=k,
            device_type=t,
            hosts=tuple(int(x) for x in hosts),
            first_device=int(first),
            latency=float(problem.compute_cost[start, stop - 1, m, k, t]),
        )
        for (start, stop, m, k, t), (hosts, first) in zip(
            stages, placement, strict=True
        )
    )
    cost = evaluate_hetero(problem, built)
    return HeteroPlan(
        stages=built,
        transfers=tuple(transfer_times(problem, built)),
        cost=cost,
        num_microbatches=problem.num_microbatches,
        method=method,
        search_time_s=float(search_time_s),
        info=dict(info or {}),
    )
