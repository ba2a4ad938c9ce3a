"""The vocabulary: a stage-construction problem, a plan, and its exact objective.

This module imports nothing else of the project; every other package builds on it.

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
from typing import Any

import numpy as np
from numpy.typing import NDArray

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
    "objective",
]

SUBMESH_SPACES = ("all", "power_of_two", "small_power_of_two", "manual")

#: Value of ``max_n_succ_stages`` meaning "memory never limits this stage"
#: (Alpa's ``INFINITY_N_STAGES``).
UNLIMITED_SUCCEEDING_STAGES = 2**20


class ProblemError(ValueError):
    """The input does not describe a valid problem (bad shapes, NaNs, ...)."""


class InfeasibleProblemError(Exception):
    """A valid problem that has no feasible plan; the message says why."""


class PlanError(ValueError):
    """A plan breaks one of the problem's rules.

    Attributes:
        rule: short name of the broken rule, e.g. ``"contiguity"``, ``"memory"``.
        stage: index of the offending stage, or ``None`` for whole-plan rules.
    """

    def __init__(self, rule: str, stage: int | None, message: str):
        where = "plan" if stage is None else f"stage {stage}"
        super().__init__(f"{where} breaks the {rule} rule: {message}")
        self.rule = rule
        self.stage = stage


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


def _as_int(value: Any, name: str) -> int:
    array = np.asarray(value)
    if array.shape != () or not np.issubdtype(array.dtype, np.integer):
        if array.shape == () and np.issubdtype(array.dtype, np.floating):
            if math.isfinite(float(array)) and float(array).is_integer():
                return int(array)
        raise ProblemError(f"{name} must be an integer, got {value!r}")
    return int(array)


def memory_limits(memory: NDArray[Any]) -> NDArray[np.int64]:
    """``max_n_succ_stages`` as i64 in ``[-1, UNLIMITED_SUCCEEDING_STAGES]``.

    Floats are accepted when they hold integers; ``+inf`` means unlimited and
    ``-inf`` never feasible.

    Raises:
        ProblemError: NaN, fractions, or a non-numeric dtype.
    """
    if np.issubdtype(memory.dtype, np.floating):
        finite = memory[np.isfinite(memory)]
        if np.isnan(memory).any() or (finite != np.round(finite)).any():
            raise ProblemError(
                "max_n_succ_stages must hold integers (or +inf for unlimited)"
            )
        memory = np.where(np.isposinf(memory), UNLIMITED_SUCCEEDING_STAGES, memory)
        memory = np.where(np.isneginf(memory), -1, memory)
    elif not np.issubdtype(memory.dtype, np.integer):
        raise ProblemError(
            f"max_n_succ_stages must be integer, got dtype {memory.dtype}"
        )
    return np.clip(memory, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Alpa's stage-construction problem for one model on one cluster.

    Args:
        compute_cost: f64[L, L, M, K] seconds per micro-batch (forward + backward)
            of the stage holding layers ``i..j`` inclusive on submesh ``m`` with
            autosharding config ``k``; ``inf`` = not profiled / infeasible. Entries
            below the diagonal (``i > j``) describe no stage and are stored as inf.
        max_n_succ_stages: i64[L, L, M, K] how many stages may follow this stage
            before its 1F1B activation stash overflows memory; ``-1`` = never
            feasible. ``None`` means memory never limits
            (:data:`UNLIMITED_SUCCEEDING_STAGES`).
        submesh_shapes: i64[M, 2] the ``(hosts, devices per host)`` of each
            submesh choice.
        cluster_shape: ``(num_hosts, devices_per_host)``.
        num_microbatches: B >= 1.

    Raises:
        ProblemError: naming the argument, what was expected and what arrived.
    """

    compute_cost: NDArray[np.float64]
    max_n_succ_stages: NDArray[np.int64] | None
    submesh_shapes: NDArray[np.int64]
    cluster_shape: tuple[int, int]
    num_microbatches: int

    def __post_init__(self) -> None:
        cost = np.asarray(self.compute_cost)
        if cost.ndim != 4 or cost.shape[0] != cost.shape[1]:
            raise ProblemError(
                f"compute_cost must have shape (L, L, M, K), got {tuple(cost.shape)}"
            )
        if not (
            np.issubdtype(cost.dtype, np.floating)
            or np.issubdtype(cost.dtype, np.integer)
        ):
            raise ProblemError(f"compute_cost must be numeric, got dtype {cost.dtype}")
        cost = cost.astype(np.float64, copy=True)
        num_layers, _, num_submeshes, num_configs = cost.shape
        if num_layers < 1 or num_submeshes < 1 or num_configs < 1:
            raise ProblemError(
                f"compute_cost must have L, M, K >= 1, got {tuple(cost.shape)}"
            )
        below = np.tril(np.ones((num_layers, num_layers), dtype=bool), k=-1)
        cost[below] = np.inf
        if np.isnan(cost).any():
            where = tuple(int(x) for x in np.argwhere(np.isnan(cost))[0])
            raise ProblemError(
                f"compute_cost has {int(np.isnan(cost).sum())} NaN entries "
                f"(first at {where}); use inf for unprofiled entries"
            )
        if (cost < 0).any():
            where = tuple(int(x) for x in np.argwhere(cost < 0)[0])
            raise ProblemError(
                f"compute_cost must be >= 0 seconds, got {cost[where]} at {where}"
            )

        if self.max_n_succ_stages is None:
            memory = np.full(cost.shape, UNLIMITED_SUCCEEDING_STAGES, dtype=np.int64)
        else:
            memory = np.asarray(self.max_n_succ_stages)
            if memory.shape != cost.shape:
                raise ProblemError(
                    "max_n_succ_stages must have the shape of compute_cost "
                    f"{tuple(cost.shape)}, got {tuple(memory.shape)}"
                )
            memory = memory_limits(memory)

        shapes = np.asarray(self.submesh_shapes)
        if shapes.shape != (num_submeshes, 2) or not np.issubdtype(
            shapes.dtype, np.integer
        ):
            raise ProblemError(
                f"submesh_shapes must be integer with shape (M, 2) = "
                f"({num_submeshes}, 2), got {shapes.dtype} {tuple(shapes.shape)}"
            )
        shapes = shapes.astype(np.int64)
        cluster = np.asarray(self.cluster_shape)
        if cluster.shape != (2,) or not np.issubdtype(cluster.dtype, np.integer):
            raise ProblemError(
                f"cluster_shape must be two integers (hosts, devices per host), "
                f"got {self.cluster_shape!r}"
            )
        num_hosts, devices_per_host = (int(x) for x in cluster)
        if num_hosts < 1 or devices_per_host < 1:
            raise ProblemError(
                f"cluster_shape must be positive, got {(num_hosts, devices_per_host)}"
            )
        for index, (hosts, devices) in enumerate(shapes.tolist()):
            if not (1 <= hosts <= num_hosts and 1 <= devices <= devices_per_host):
                raise ProblemError(
                    f"submesh {index} has shape {(hosts, devices)}, which does not "
                    f"fit the {num_hosts}x{devices_per_host} cluster"
                )
        num_microbatches = _as_int(self.num_microbatches, "num_microbatches")
        if num_microbatches < 1:
            raise ProblemError(f"num_microbatches must be >= 1, got {num_microbatches}")

        num_devices = num_hosts * devices_per_host
        sizes = shapes[:, 0] * shapes[:, 1]
        reachable = np.zeros(num_devices + 1, dtype=bool)
        reachable[0] = True
        for total in range(1, num_devices + 1):
            reachable[total] = any(
                size <= total and reachable[total - size] for size in sizes.tolist()
            )
        if not reachable[num_devices]:
            raise ProblemError(
                f"no combination of the submesh sizes {sorted(set(sizes.tolist()))} "
                f"uses exactly the {num_devices} devices of the "
                f"{num_hosts}x{devices_per_host} cluster"
            )

        for name, value in (
            ("compute_cost", cost),
            ("max_n_succ_stages", memory),
            ("submesh_shapes", shapes),
        ):
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "cluster_shape", (num_hosts, devices_per_host))
        object.__setattr__(self, "num_microbatches", num_microbatches)

    # Sizes -----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """L, the number of (clustered) layers."""
        return self.compute_cost.shape[0]

    @property
    def num_submeshes(self) -> int:
        """M, the number of submesh choices."""
        return self.compute_cost.shape[2]

    @property
    def num_configs(self) -> int:
        """K, the number of autosharding config slots per submesh."""
        return self.compute_cost.shape[3]

    @property
    def num_devices(self) -> int:
        """D, the devices of the whole cluster."""
        return self.cluster_shape[0] * self.cluster_shape[1]

    @property
    def submesh_sizes(self) -> NDArray[np.int64]:
        """i64[M] devices in each submesh choice."""
        return self.submesh_shapes[:, 0] * self.submesh_shapes[:, 1]

    def stage_cost(self, start: int, stop: int, submesh: int, config: int) -> float:
        """Latency (s) of the stage holding layers ``start..stop-1`` (half-open)."""
        return float(self.compute_cost[start, stop - 1, submesh, config])

    def replace(self, **changes: Any) -> Problem:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    # Files -----------------------------------------------------------------
    def to_npz(self, path: Any) -> None:
        """Write the problem file of DESIGN section 2 (``numpy.savez``)."""
        np.savez(
            path,
            compute_cost=self.compute_cost,
            max_n_succ_stages=self.max_n_succ_stages,
            submesh_shapes=self.submesh_shapes,
            cluster_shape=np.asarray(self.cluster_shape, dtype=np.int64),
            num_microbatches=np.asarray(self.num_microbatches, dtype=np.int64),
        )

    @classmethod
    def from_npz(cls, path: Any) -> Problem:
        """Read a problem file; extra keys are ignored.

        Raises:
            ProblemError: the file is not a readable ``.npz`` or lacks a key.
        """
        try:
            archive = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as error:
            raise ProblemError(
                f"cannot read {path} as a problem .npz: {error}"
            ) from None
        with archive:
            if not hasattr(archive, "files"):
                raise ProblemError(f"{path} is a single array, not a problem .npz")
            required = (
                "compute_cost",
                "submesh_shapes",
                "cluster_shape",
                "num_microbatches",
            )
            missing = [key for key in required if key not in archive.files]
            if missing:
                raise ProblemError(
                    f"{path} lacks the key(s) {', '.join(missing)} of a problem file"
                )
            try:
                arrays = {key: archive[key] for key in required}
                memory = (
                    archive["max_n_succ_stages"]
                    if "max_n_succ_stages" in archive.files
                    else None
                )
            except (ValueError, OSError) as error:
                raise ProblemError(f"cannot read {path}: {error}") from None
        cluster = arrays["cluster_shape"]
        if cluster.shape != (2,):
            raise ProblemError(
                f"cluster_shape must have shape (2,), got {tuple(cluster.shape)}"
            )
        return cls(
            compute_cost=arrays["compute_cost"],
            max_n_succ_stages=memory,
            submesh_shapes=arrays["submesh_shapes"],
            cluster_shape=tuple(int(x) for x in cluster),
            num_microbatches=arrays["num_microbatches"],
        )


@dataclasses.dataclass(frozen=True)
class Stage:
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
            "latency": self.latency,
        }


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
        """The plan JSON of DESIGN section 2."""
        return {
            "method": self.method,
            "cost": self.cost,
            "num_microbatches": self.num_microbatches,
            "stages": [stage.to_json() for stage in self.stages],
            "search_time_s": self.search_time_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        try:
            stages = tuple(
                Stage(
                    start=int(s["start"]),
                    stop=int(s["stop"]),
                    submesh=(int(s["submesh"][0]), int(s["submesh"][1])),
                    submesh_index=int(s["submesh_index"]),
                    config_index=int(s["config_index"]),
                    latency=float(s["latency"]),
                )
                for s in data["stages"]
            )
            return cls(
                stages=stages,
                cost=float(data["cost"]),
                num_microbatches=int(data["num_microbatches"]),
                method=str(data["method"]),
                search_time_s=float(data.get("search_time_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ProblemError(f"not a plan JSON object: {error!r}") from None


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


def objective(latencies: Sequence[float], num_microbatches: int) -> float:
    """Alpa's pipeline latency ``sum(t) + (B - 1) * max(t)`` in seconds."""
    return float(math.fsum(latencies) + (num_microbatches - 1) * max(latencies))


def evaluate(problem: Problem, plan: Plan | Sequence[Stage]) -> float:
    """The exact objective of a plan on the problem's own table.

    Checks every rule first (:func:`check_plan`), then returns
    ``sum_s t_s + (B - 1) * max_s t_s`` with ``t_s`` read from
    ``problem.compute_cost`` (never from the plan's recorded latencies).

    Raises:
        PlanError: naming the broken rule and the stage.
    """
    stages = plan.stages if isinstance(plan, Plan) else tuple(plan)
    check_plan(problem, stages)
    latencies = [
        problem.stage_cost(s.start, s.stop, s.submesh_index, s.config_index)
        for s in stages
    ]
    return objective(latencies, problem.num_microbatches)


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
