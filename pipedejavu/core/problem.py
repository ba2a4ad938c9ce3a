"""The vocabulary: a stage-construction problem, a plan, and its exact objective.

Besides its own helpers (:mod:`pipedejavu.core.errors`,
:mod:`pipedejavu.core.validation`,
:mod:`pipedejavu.core.npzfile`) this module imports nothing of the project; every
other package builds on it.

Conventions (stated once, used everywhere):

* Arrays use Alpa's *inclusive* indexing: ``compute_cost[i, j, m, k]`` is the
  latency of the stage holding layers ``i..j`` (both included).
* :class:`Stage` uses Python's *half-open* ranges, like the plan Alpa returns
  (``forward_stage_layer_ids = range(start, stop)``): layers ``start..stop-1``.
  So a stage ``Stage(start=i, stop=j + 1, ...)`` reads ``compute_cost[i, j, ...]``.
* Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.cost_limits import check_cost_magnitude
from pipedejavu.core.errors import InfeasibleProblemError, PlanError, ProblemError
from pipedejavu.core.npzfile import read_npz, write_npz
from pipedejavu.core.stage_record import SubmeshStage
from pipedejavu.core.validation import (
    MAX_DEVICES,
    MAX_MICROBATCHES,
    UNLIMITED_SUCCEEDING_STAGES,
    StageTableSizes,
    as_count,
    cost_table,
    describe,
    field_name,
    freeze,
    json_field,
    json_float,
    json_int,
    json_list,
    memory_limits,
    memory_table,
    submesh_table,
    tail_table,
)

__all__ = [
    "InfeasibleProblemError",
    "Plan",
    "PlanError",
    "Problem",
    "ProblemError",
    "Stage",
    "UNLIMITED_SUCCEEDING_STAGES",
    "check_plan",
    "evaluate",
    "get_submesh_choices",
    "make_plan",
    "memory_limits",
    "objective",
]

SUBMESH_SPACES = ("all", "power_of_two", "small_power_of_two", "manual")

#: The keys of a problem file (DESIGN section 2); ``max_n_succ_stages`` optional.
PROBLEM_KEYS = ("compute_cost", "submesh_shapes", "cluster_shape", "num_microbatches")


def get_submesh_choices(
    num_hosts: int,
    devices_per_host: int,
    space: str = "power_of_two",
    manual_submeshes: Sequence[tuple[int, int]] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shape choices (``get_submesh_choices``), in Alpa's order.

    First ``(1, 1), (1, 2), (1, 4), ..., (1, devices_per_host)``; then, by space:
    ``"all"`` adds ``(h, devices_per_host)`` for h = 2..num_hosts;
    ``"power_of_two"`` for h = 2, 4, 8, ... <= num_hosts; ``"small_power_of_two"``
    for h = 2, 4 (at most num_hosts). ``"manual"`` returns ``manual_submeshes``.

    Raises:
        ProblemError: unknown space, or ``devices_per_host`` not a power of two
            (Alpa supports only those).
    """
    if space not in SUBMESH_SPACES:
        raise ProblemError(
            f"submesh space must be one of {', '.join(SUBMESH_SPACES)}, got {space!r}"
        )
    if num_hosts < 1 or devices_per_host < 1:
        raise ProblemError(
            f"cluster must be positive, got {num_hosts}x{devices_per_host}"
        )
    if space == "manual":
        if not manual_submeshes:
            raise ProblemError("the manual submesh space needs a list of shapes")
        return tuple((int(h), int(d)) for h, d in manual_submeshes)
    if devices_per_host & (devices_per_host - 1):
        raise ProblemError(
            "Alpa's submesh choices need a power-of-two number of devices per "
            f"host, got {devices_per_host}"
        )
    choices = []
    width = 1
    while width <= devices_per_host:
        choices.append((1, width))
        width *= 2
    if space == "all":
        choices += [(hosts, devices_per_host) for hosts in range(2, num_hosts + 1)]
    else:
        limit = num_hosts if space == "power_of_two" else min(num_hosts, 4)
        hosts = 2
        while hosts <= limit:
            choices.append((hosts, devices_per_host))
            hosts *= 2
    return tuple(choices)


def file_arrays(problem: Any, cluster_shape: Sequence[int]) -> dict[str, Any]:
    """The arrays of ``problem`` (any kind) every problem file holds."""
    return {
        "compute_cost": problem.compute_cost,
        "max_n_succ_stages": problem.max_n_succ_stages,
        "submesh_shapes": problem.submesh_shapes,
        "cluster_shape": np.asarray(cluster_shape, dtype=np.int64),
        "num_microbatches": np.asarray(problem.num_microbatches, dtype=np.int64),
    }


def problem_fields(arrays: dict[str, Any]) -> dict[str, Any]:
    """The fields every problem kind reads alike from its file's arrays
    (checked by the problem built from them)."""
    fields = ("compute_cost", "submesh_shapes", "num_microbatches")
    return {"max_n_succ_stages": arrays.get("max_n_succ_stages")} | {
        name: arrays[name] for name in fields
    }


@dataclasses.dataclass(frozen=True, eq=False)
class Problem(StageTableSizes):
    """Alpa's stage-construction problem for one model on one cluster.

    Args:
        compute_cost: f64[L, L, M, K] seconds per micro-batch (forward + backward)
            of the stage holding layers ``i..j`` inclusive on submesh ``m`` with
            autosharding config ``k``; ``inf`` = not profiled / infeasible. Entries
            below the diagonal (``i > j``) describe no stage and are stored as inf.
            Finite entries at most ``1e300 / (L + B)`` (plan sums stay finite).
        max_n_succ_stages: i64[L, L, M, K] how many stages may follow this stage
            before its 1F1B activation stash overflows memory; ``-1`` = never
            feasible. ``None`` means memory never limits
            (:data:`UNLIMITED_SUCCEEDING_STAGES`).
        submesh_shapes: i64[M, 2] the ``(hosts, devices per host)`` of each
            submesh choice.
        cluster_shape: ``(num_hosts, devices_per_host)``.
        num_microbatches: B >= 1.
        stage_tail_cost: f64[L, L, M, K] seconds a stage adds once per iteration
            after the pipeline (a Megatron-style plan's data-parallel gradient
            all-reduce and optimizer step); the objective adds the largest tail
            of the plan's stages. ``None`` (Alpa's formulation): no tail.

    Raises:
        ProblemError: naming the argument, what was expected and what arrived.
    """

    compute_cost: NDArray[np.float64]
    max_n_succ_stages: NDArray[np.int64] | None
    submesh_shapes: NDArray[np.int64]
    cluster_shape: tuple[int, int]
    num_microbatches: int
    stage_tail_cost: NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        cost = cost_table(self.compute_cost, with_types=False)
        memory = memory_table(self.max_n_succ_stages, cost.shape)
        shapes = submesh_table(self.submesh_shapes, cost.shape[2])
        cluster = np.asarray(self.cluster_shape)
        if cluster.shape != (2,) or not np.issubdtype(cluster.dtype, np.integer):
            raise ProblemError(
                f"cluster_shape must be two integers (hosts, devices per host), "
                f"got {describe(self.cluster_shape)}"
            )
        num_hosts, devices_per_host = (int(x) for x in cluster)
        if num_hosts < 1 or devices_per_host < 1:
            raise ProblemError(
                f"cluster_shape must be positive, got {(num_hosts, devices_per_host)}"
            )
        if num_hosts * devices_per_host > MAX_DEVICES:
            raise ProblemError(
                f"cluster_shape {num_hosts}x{devices_per_host} has more than "
                f"{MAX_DEVICES} devices"
            )
        for index, (hosts, devices) in enumerate(shapes.tolist()):
            if not (1 <= hosts <= num_hosts and 1 <= devices <= devices_per_host):
                raise ProblemError(
                    f"submesh {index} has shape {(hosts, devices)}, which does not "
                    f"fit the {num_hosts}x{devices_per_host} cluster"
                )
        num_microbatches = as_count(
            self.num_microbatches, "num_microbatches", maximum=MAX_MICROBATCHES
        )
        check_cost_magnitude(cost, num_microbatches)
        num_devices = num_hosts * devices_per_host
        sizes = sorted(set((shapes[:, 0] * shapes[:, 1]).tolist()))
        if not _reachable(sizes, num_devices):
            raise ProblemError(
                f"no combination of the submesh sizes {sizes} uses exactly the "
                f"{num_devices} devices of the {num_hosts}x{devices_per_host} cluster"
            )
        freeze(self, compute_cost=cost, max_n_succ_stages=memory, submesh_shapes=shapes)
        tail = tail_table(self.stage_tail_cost, cost)
        if tail is not None:
            freeze(self, stage_tail_cost=tail)
        object.__setattr__(self, "cluster_shape", (num_hosts, devices_per_host))
        object.__setattr__(self, "num_microbatches", num_microbatches)

    # Sizes (num_layers, num_submeshes, num_configs, submesh_sizes and
    # replace() come from StageTableSizes) ----------------------------------
    @property
    def num_devices(self) -> int:
        """D, the devices of the whole cluster."""
        return self.cluster_shape[0] * self.cluster_shape[1]

    def stage_cost(self, start: int, stop: int, submesh: int, config: int) -> float:
        """Latency (s) of the stage holding layers ``start..stop-1`` (half-open)."""
        return float(self.compute_cost[start, stop - 1, submesh, config])

    def stage_tail(self, start: int, stop: int, submesh: int, config: int) -> float:
        """Tail (s) of the stage holding layers ``start..stop-1`` (0 without tails)."""
        if self.stage_tail_cost is None:
            return 0.0
        return float(self.stage_tail_cost[start, stop - 1, submesh, config])

    # Files -----------------------------------------------------------------
    def to_npz(self, path: Any) -> Path:
        """Write the problem file of DESIGN section 2; returns the path written
        (``.npz`` is appended when ``path`` lacks it, as ``numpy.savez`` does).

        Raises:
            ProblemError: the file cannot be written.
        """
        return write_npz(
            path,
            {
                **file_arrays(self, self.cluster_shape),
                **(
                    {}
                    if self.stage_tail_cost is None
                    else {"stage_tail_cost": self.stage_tail_cost}
                ),
            },
        )

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], source: str) -> Problem:
        """A problem from the arrays of a problem file (:data:`PROBLEM_KEYS`).

        Raises:
            ProblemError: invalid contents, the message prefixed by ``source``;
                also for a heterogeneous problem file (it has ``cluster_json``).
        """
        if "cluster_json" in arrays:
            raise ProblemError(
                f"{source} is a heterogeneous problem (typed devices and links); "
                "this reader needs Alpa's homogeneous problem (use "
                "pipedejavu.load_problem or HeteroProblem.from_npz)"
            )
        try:
            return cls(
                **problem_fields(arrays),
                cluster_shape=_cluster_shape(arrays["cluster_shape"]),
                stage_tail_cost=arrays.get("stage_tail_cost"),
            )
        except ProblemError as error:
            raise ProblemError(f"{source}: {error}") from None

    @classmethod
    def from_npz(cls, path: Any) -> Problem:
        """Read a problem file; extra keys are ignored.

        Raises:
            ProblemError: one line naming the file: unreadable, truncated or
                corrupt, a missing key, declared sizes over the reading limit
                (:func:`pipedejavu.core.npzfile.read_npz`), or invalid contents.
        """
        arrays = read_npz(
            path,
            required=PROBLEM_KEYS,
            optional=("max_n_succ_stages", "cluster_json", "stage_tail_cost"),
        )
        return cls.from_arrays(arrays, str(path))


def _cluster_shape(value: Any) -> tuple[int, int]:
    cluster = np.asarray(value)
    if cluster.shape != (2,) or not np.issubdtype(cluster.dtype, np.integer):
        raise ProblemError(
            f"cluster_shape must be two integers (hosts, devices per host), got "
            f"{cluster.dtype} {tuple(cluster.shape)}"
        )
    return (int(cluster[0]), int(cluster[1]))


def _reachable(sizes: Sequence[int], total: int) -> bool:
    """Whether some multiset of ``sizes`` sums to exactly ``total`` (vectorized
    unbounded coin change: once ``n`` is reachable, so is ``n + size``)."""
    reachable = np.zeros(total + 1, dtype=bool)
    reachable[0] = True
    for size in sizes:
        for residue in range(min(size, total + 1)):
            column = reachable[residue::size]
            np.logical_or.accumulate(column, out=column)
    return bool(reachable[total])


@dataclasses.dataclass(frozen=True)
class Stage(SubmeshStage):
    """One pipeline stage of a plan.

    Args:
        start: first layer (inclusive).
        stop: one past the last layer (half-open, like ``range``).
        submesh: ``(hosts, devices per host)`` of its submesh.
        submesh_index: index into ``Problem.submesh_shapes``.
        config_index: autosharding config slot.
        latency: seconds per micro-batch, ``compute_cost[start, stop-1, m, k]``.
    """

    start: int
    stop: int
    submesh: tuple[int, int]
    submesh_index: int
    config_index: int
    latency: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """A pipeline plan: contiguous stages, each on a submesh with a config.

    ``cost`` is always the exact objective ``sum + (B - 1) * max`` of this discrete
    plan re-evaluated on the problem's own table (see :func:`evaluate`).
    ``info`` carries solver-specific extras (not part of the plan JSON).
    """

    stages: tuple[Stage, ...]
    cost: float
    num_microbatches: int
    method: str
    search_time_s: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_json(self) -> dict[str, Any]:
        """The plan JSON of DESIGN section 2, plus ``lower_bound`` and ``gap``
        when the solver certified the plan (``info`` has them)."""
        return {
            "method": self.method,
            "cost": self.cost,
            "num_microbatches": self.num_microbatches,
            "stages": [stage.to_json() for stage in self.stages],
            "search_time_s": self.search_time_s,
            **certificate(self.info),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "plan JSON") -> Plan:
        """The plan of a plan JSON object (as :meth:`to_json` writes it).

        Raises:
            ProblemError: naming ``source`` and the field that is missing or of
                the wrong kind. (Whether the plan obeys a problem's rules is
                :func:`check_plan`'s question.)
        """
        stages = tuple(
            Stage(**stage_fields(entry, f"{source}: stages[{index}]"))
            for index, entry in enumerate(json_list(data, "stages", source))
        )
        return cls(stages=stages, **plan_fields(data, source))


def stage_fields(entry: Any, where: str) -> dict[str, Any]:
    """The fields every stage JSON has (start, stop, submesh, indices,
    latency), checked; shared by :class:`Plan` and placed plans."""
    submesh = json_list(entry, "submesh", where, length=2)
    return {
        "start": json_int(entry, "start", where),
        "stop": json_int(entry, "stop", where),
        "submesh": (
            as_count(submesh[0], f"{where}.submesh[0]"),
            as_count(submesh[1], f"{where}.submesh[1]"),
        ),
        "submesh_index": json_int(entry, "submesh_index", where),
        "config_index": json_int(entry, "config_index", where),
        "latency": json_float(entry, "latency", where),
    }


def plan_fields(data: Any, source: str) -> dict[str, Any]:
    """The plan-level fields of a plan JSON (cost, B, method, search time)."""
    method = json_field(data, "method", source)
    if not isinstance(method, str):
        name = field_name(source, "method")
        raise ProblemError(f"{name} must be text, got {describe(method)}")
    return {
        "cost": json_float(data, "cost", source),
        "num_microbatches": json_int(data, "num_microbatches", source, minimum=1),
        "method": method,
        "search_time_s": (
            json_float(data, "search_time_s", source)
            if "search_time_s" in data
            else 0.0
        ),
    }


def certificate(info: dict[str, Any]) -> dict[str, float]:
    """``lower_bound`` and ``gap`` of a plan's ``info``, when a solver set them."""
    return {key: float(info[key]) for key in ("lower_bound", "gap") if key in info}


def check_plan(problem: Problem, plan: Plan | Sequence[Stage]) -> None:
    """Check every rule of the problem; raise :class:`PlanError` on the first break.

    Rules: at least one stage; contiguity (each stage starts where the previous
    stopped, and holds at least one layer); coverage (layers ``0..L-1``); known
    submesh and config indices whose shape matches; a profiled (finite) latency;
    exactly all ``D`` devices used; memory (``S - 1 - s <= max_n_succ_stages``
    for stage ``s`` of ``S``).
    """
    stages = plan.stages if isinstance(plan, Plan) else tuple(plan)
    if not stages:
        raise PlanError("coverage", None, "the plan has no stages")
    num_stages = len(stages)
    expected_start = 0
    for index, stage in enumerate(stages):
        if stage.start != expected_start:
            raise PlanError(
                "contiguity",
                index,
                f"starts at layer {stage.start}, expected {expected_start}",
            )
        if stage.stop <= stage.start:
            raise PlanError(
                "contiguity",
                index,
                f"holds no layers (start {stage.start}, stop {stage.stop})",
            )
        if stage.stop > problem.num_layers:
            raise PlanError(
                "coverage",
                index,
                f"stops at layer {stage.stop} but the model has "
                f"{problem.num_layers} layers",
            )
        if not 0 <= stage.submesh_index < problem.num_submeshes:
            raise PlanError(
                "submesh",
                index,
                f"submesh index {stage.submesh_index} is not in "
                f"[0, {problem.num_submeshes})",
            )
        shape = tuple(int(x) for x in problem.submesh_shapes[stage.submesh_index])
        if tuple(stage.submesh) != shape:
            raise PlanError(
                "submesh",
                index,
                f"submesh {tuple(stage.submesh)} does not match choice "
                f"{stage.submesh_index} = {shape}",
            )
        if not 0 <= stage.config_index < problem.num_configs:
            raise PlanError(
                "config",
                index,
                f"config index {stage.config_index} is not in "
                f"[0, {problem.num_configs})",
            )
        latency = problem.stage_cost(
            stage.start, stage.stop, stage.submesh_index, stage.config_index
        )
        if not math.isfinite(latency):
            raise PlanError(
                "profiled",
                index,
                f"layers {stage.start}..{stage.stop - 1} on submesh {shape} config "
                f"{stage.config_index} have no profiled cost (inf)",
            )
        limit = int(
            problem.max_n_succ_stages[
                stage.start, stage.stop - 1, stage.submesh_index, stage.config_index
            ]
        )
        followers = num_stages - 1 - index
        if followers > limit:
            raise PlanError(
                "memory",
                index,
                f"{followers} stages follow it but memory allows at most {limit}",
            )
        expected_start = stage.stop
    if expected_start != problem.num_layers:
        raise PlanError(
            "coverage",
            None,
            f"the stages cover layers 0..{expected_start - 1}, "
            f"not all {problem.num_layers}",
        )
    used = sum(stage.num_devices for stage in stages)
    if used != problem.num_devices:
        raise PlanError(
            "devices",
            None,
            f"the submeshes use {used} devices, the cluster has {problem.num_devices}",
        )


def objective(
    latencies: Sequence[float],
    num_microbatches: int,
    transfers: Sequence[float] = (),
) -> float:
    """The pipeline latency in seconds: Alpa's ``sum(t) + (B - 1) * max(t)``,
    and with transfers between stages (``pipedejavu.core.hetero``)
    ``sum(t) + sum(c) + (B - 1) * max(max t, max c)``."""
    if not transfers:
        return float(math.fsum(latencies) + (num_microbatches - 1) * max(latencies))
    bottleneck = max(max(latencies), max(transfers))
    return float(
        math.fsum(latencies)
        + math.fsum(transfers)
        + (num_microbatches - 1) * bottleneck
    )


def evaluate(problem: Problem, plan: Plan | Sequence[Stage]) -> float:
    """The exact objective of a plan on the problem's own table.

    Checks every rule first (:func:`check_plan`), then returns
    ``sum_s t_s + (B - 1) * max_s t_s`` with ``t_s`` read from
    ``problem.compute_cost`` (never from the plan's recorded latencies), plus
    ``max_s tail_s`` when the problem has ``stage_tail_cost``.

    Raises:
        PlanError: naming the broken rule and the stage.
    """
    stages = plan.stages if isinstance(plan, Plan) else tuple(plan)
    check_plan(problem, stages)
    latencies = [
        problem.stage_cost(s.start, s.stop, s.submesh_index, s.config_index)
        for s in stages
    ]
    tail = max(
        problem.stage_tail(s.start, s.stop, s.submesh_index, s.config_index)
        for s in stages
    )
    return objective(latencies, problem.num_microbatches) + tail


def make_plan(
    problem: Problem,
    stages: Sequence[tuple[int, int, int, int]],
    *,
    method: str,
    search_time_s: float = 0.0,
    info: dict[str, Any] | None = None,
) -> Plan:
    """Build a checked :class:`Plan` from ``(start, stop, submesh, config)`` tuples.

    The stage latencies and the plan cost are read from the table, so every solver
    that builds its plan here reports ``cost == evaluate(problem, plan)``.
    """
    built = tuple(
        Stage(
            start=int(start),
            stop=int(stop),
            submesh=tuple(int(x) for x in problem.submesh_shapes[submesh]),
            submesh_index=int(submesh),
            config_index=int(config),
            latency=problem.stage_cost(start, stop, submesh, config),
        )
        for start, stop, submesh, config in stages
    )
    cost = evaluate(problem, built)
    return Plan(
        stages=built,
        cost=cost,
        num_microbatches=problem.num_microbatches,
        method=method,
        search_time_s=float(search_time_s),
        info=dict(info or {}),
    )
