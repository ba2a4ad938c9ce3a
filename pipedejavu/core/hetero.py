"""Hardware-aware stage construction, the vocabulary: typed devices, placed stages.

Alpa's formulation (``pipedejavu.core.problem``) counts devices and ignores links. Here:

* ``compute_cost[i, j, m, k, t]``: the stage ``i..j`` (inclusive) on submesh ``m``,
  config ``k``, running on devices of type ``t``;
  ``max_n_succ_stages[i, j, m, k, t]`` the memory rule on that type.
* ``boundary_bytes[b]``: bytes of the activation crossing the boundary after
  layer ``b`` per micro-batch (the gradient sent back has the same size).
* A plan places every stage physically: ``hosts`` (the hosts it occupies) and
  ``first_device`` (its first device on a host, for a submesh smaller than a
  host). Every device of the cluster is used exactly once (Alpa's rule).

The rules of a plan -- transfers, the objective, the plan space, canonical
placement -- and the functions that check and price plans are in
:mod:`pipedejavu.core.hetero_rules`.

**Device memory.** Solvers read the memory rule ``max_n_succ_stages[..., t]``
of each type; ``DeviceType.memory_bytes`` reaches them through it:
:mod:`pipedejavu.costmodel.stage.hetero_generate` derives each type's rule from its
memory, and :meth:`HeteroProblem.from_problem` does with
:class:`~pipedejavu.core.layer_memory.LayerMemory` (and refuses a
``memory_bytes`` it has no way to apply).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.cluster import Cluster
from pipedejavu.core.cost_limits import check_cost_magnitude
from pipedejavu.core.files import parse_json
from pipedejavu.core.layer_memory import LayerMemory
from pipedejavu.core.npzfile import read_npz, write_npz
from pipedejavu.core.problem import (
    Problem,
    ProblemError,
    certificate,
    file_arrays,
    plan_fields,
    problem_fields,
    stage_fields,
)
from pipedejavu.core.stage_record import SubmeshStage
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

__all__ = ["HeteroPlan", "HeteroProblem", "HeteroStage"]


#: The keys a heterogeneous problem file must hold (besides the optional
#: ``max_n_succ_stages`` and ``boundary_bytes``).
_HETERO_KEYS = ("cluster_json", "compute_cost", "submesh_shapes", "num_microbatches")


@dataclasses.dataclass(frozen=True, eq=False)
class HeteroProblem(StageTableSizes):
    """Stage construction on a cluster of typed devices with costly links.

    Args:
        compute_cost: f64[L, L, M, K, T] seconds per micro-batch (forward +
            backward) of layers ``i..j`` on submesh ``m``, config ``k``, device
            type ``t``; inf = infeasible / unprofiled; finite entries at most
            ``1e300 / (L + B)`` (plan sums stay finite).
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
        check_cost_magnitude(cost, num_microbatches)
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
                **file_arrays(self, self.cluster.shape),
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
                **problem_fields(arrays),
                cluster=Cluster.from_json(parse_json(str(text), "cluster_json")),
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
class HeteroStage(SubmeshStage):
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


@dataclasses.dataclass(frozen=True)
class HeteroPlan:
    """A placed plan; ``cost`` is
    :func:`~pipedejavu.core.hetero_rules.evaluate_hetero` of it, transfers included.

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
                the wrong kind (the rules are
                :func:`~pipedejavu.core.hetero_rules.check_hetero_plan`'s).
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
