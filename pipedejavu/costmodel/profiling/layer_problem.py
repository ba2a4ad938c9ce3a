"""A :class:`~pipedejavu.core.problem.Problem` from measured layer costs.

Devices. One device was measured. :func:`problem_from_layer_profile` defaults to
a 1x1 cluster, where ``compute_cost`` is the measured model. Larger clusters need
an explicit :class:`DataParallelScaling`, a stated assumption rather than a
measurement: on a submesh of ``d`` devices each stage runs data-parallel with
Amdahl scaling of the measured time (its working set split over the devices),
plus a ring all-reduce of its gradients once per iteration (alpha-beta), charged
as ``1 / B`` of it per micro-batch.
Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    Problem,
    get_submesh_choices,
)
from pipedejavu.costmodel.profiling.profiler import (
    LayerProfile,
    ProgressFn,
    check_count,
    profile_model,
)
from pipedejavu.costmodel.profiling.stage_overhead import (
    StageOverhead,
    fit_stage_overhead,
    span_sums,
    stage_table,
)

__all__ = ["DataParallelScaling", "problem_from_layer_profile", "profile_to_problem"]


@dataclasses.dataclass(frozen=True)
class DataParallelScaling:
    """Assumed (not measured) cost of a stage on a submesh of ``d > 1`` devices.

    Each micro-batch is split over the ``d`` devices (data parallelism):

    * compute: ``t_1 * ((1 - parallel_fraction) + parallel_fraction / d)``
      (Amdahl), ``t_1`` the measured one-device stage time;
    * gradients: a ring all-reduce of the stage's parameter bytes ``P`` once per
      iteration, ``2 (d - 1) * allreduce_latency_s + 2 (d - 1) / d * P / bw``
      with ``bw`` the intra-host bandwidth on one host, the inter-host one
      otherwise; charged ``1 / B`` of it per micro-batch.

    Defaults are round numbers for a GPU server (NVLink-class 100 GB/s inside a
    host, 100 Gb/s = 12.5 GB/s between hosts); set them for your cluster.
    """

    parallel_fraction: float = 0.95
    allreduce_latency_s: float = 1e-5
    intra_host_bandwidth: float = 100e9
    inter_host_bandwidth: float = 12.5e9

    def __post_init__(self) -> None:
        if not 0.0 <= self.parallel_fraction <= 1.0:
            raise ValueError(
                f"parallel_fraction must be in [0, 1], got {self.parallel_fraction}"
            )
        latency = self.allreduce_latency_s
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(
                f"allreduce_latency_s must be finite and >= 0, got {latency}"
            )
        for name in ("intra_host_bandwidth", "inter_host_bandwidth"):
            if not getattr(self, name) > 0:  # inf: free communication
                raise ValueError(
                    f"{name} must be > 0 bytes/s, got {getattr(self, name)}"
                )

    def stage_time(
        self, one_device_s, param_bytes, hosts: int, devices: int, num_microbatches: int
    ):
        """Seconds per micro-batch on a ``hosts x devices`` submesh (arrays ok)."""
        count = hosts * devices
        if count == 1:
            return one_device_s
        fraction = self.parallel_fraction
        compute = one_device_s * ((1 - fraction) + fraction / count)
        bandwidth = (
            self.intra_host_bandwidth if hosts == 1 else self.inter_host_bandwidth
        )
        allreduce = (
            2
            * (count - 1)
            * (self.allreduce_latency_s + param_bytes / (count * bandwidth))
        )
        return compute + allreduce / num_microbatches


def problem_from_layer_profile(
    profile: LayerProfile,
    cluster: tuple[int, int] = (1, 1),
    *,
    num_microbatches: int,
    scaling: DataParallelScaling | None = None,
    overhead: StageOverhead | None = None,
    submesh_space: str = "power_of_two",
    memory_budget_bytes: float | None = None,
    weight_memory_factor: float = 4.0,
) -> Problem:
    """A one-config :class:`Problem` (K = 1) from measured layer times.

    ``compute_cost[i, j, m, 0]`` is :func:`predict_span_time` of layers ``i..j``
    (inclusive), its working-set term taken per device, scaled to submesh ``m``
    by ``scaling``.

    Args:
        profile: the measurements. cluster: ``(num_hosts, devices_per_host)``.
        num_microbatches: B.
        scaling: required when the cluster has more than one device (only one
            was measured); see :class:`DataParallelScaling`.
        overhead: default :func:`fit_stage_overhead` of the profile.
        submesh_space: Alpa's submesh space (:func:`get_submesh_choices`).
        memory_budget_bytes: device memory for one stage; ``None`` = unlimited.
            Otherwise ``max_n_succ_stages = floor((budget - weight_memory_factor
            * params) / (stash / d)) - 1``: replicated weights, gradients and
            optimizer state (4x the parameters for Adam), and the summed layer
            stashes of each in-flight micro-batch split over ``d`` devices.

    Raises:
        ValueError: a multi-device cluster without ``scaling``, bad arguments.
        ProblemError: from :class:`Problem` / :func:`get_submesh_choices`.
    """
    num_hosts, devices_per_host = (int(x) for x in cluster)
    if num_hosts * devices_per_host > 1 and scaling is None:
        raise ValueError(
            f"cluster {(num_hosts, devices_per_host)} has "
            f"{num_hosts * devices_per_host} devices but the profile measured one; "
            "pass scaling=DataParallelScaling(...) to state how stages scale"
        )
    scaling = DataParallelScaling() if scaling is None else scaling
    overhead = fit_stage_overhead(profile) if overhead is None else overhead
    batches = check_count(num_microbatches, "num_microbatches", 1)
    shapes = get_submesh_choices(num_hosts, devices_per_host, submesh_space)
    params = span_sums(profile.param_bytes)
    cost = np.stack(
        [
            scaling.stage_time(
                stage_table(profile, overhead, h * d), params, h, d, batches
            )
            for h, d in shapes
        ],
        axis=-1,
    )[..., None]
    memory = None
    if memory_budget_bytes is not None:
        if not (memory_budget_bytes > 0 and weight_memory_factor >= 0):
            raise ValueError(
                "memory_budget_bytes must be > 0 and weight_memory_factor >= 0, got "
                f"{memory_budget_bytes} and {weight_memory_factor}"
            )
        stash = np.maximum(span_sums(profile.stash_bytes), 1.0)
        free = memory_budget_bytes - weight_memory_factor * params
        memory = np.stack(
            [np.floor(free / (stash / (h * d))) - 1 for h, d in shapes], axis=-1
        )
        memory = np.clip(memory, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
        memory = memory[..., None]
    return Problem(
        compute_cost=cost,
        max_n_succ_stages=memory,
        submesh_shapes=np.asarray(shapes, dtype=np.int64),
        cluster_shape=(num_hosts, devices_per_host),
        num_microbatches=batches,
    )


def profile_to_problem(
    model_name: str,
    out_path: str | os.PathLike | None = None,
    *,
    cluster: tuple[int, int] = (1, 1),
    num_microbatches: int = 8,
    repeats: int = 10,
    warmup: int = 2,
    scaling: DataParallelScaling | None = None,
    memory_budget_bytes: float | None = None,
    progress_fn: ProgressFn | None = None,
) -> tuple[Problem, LayerProfile]:
    """Profile a preset and build its problem in one call (for the CLI).

    With ``out_path`` the problem file is written (DESIGN section 2) with the
    extra keys ``layer_names``, ``layer_times_s``, ``activation_bytes``,
    ``stash_bytes``, ``param_bytes``, ``backend``, ``model_name``,
    ``per_boundary_s`` and ``boundary_fraction`` (ignored by problem readers).

    Raises:
        ProblemError: ``cluster`` without Alpa's submeshes (devices per host a
            power of two), checked before any profiling.
        ValueError: ``num_microbatches < 1`` (also before profiling), or a bad
            profiling argument.
    """
    # the arguments the problem needs, checked before the (slow) profiling
    get_submesh_choices(*(int(x) for x in cluster), "power_of_two")
    check_count(num_microbatches, "num_microbatches", 1)
    profile = profile_model(
        model_name, repeats=repeats, warmup=warmup, progress_fn=progress_fn
    )
    overhead = fit_stage_overhead(profile)
    problem = problem_from_layer_profile(
        profile,
        cluster,
        num_microbatches=num_microbatches,
        scaling=scaling,
        overhead=overhead,
        memory_budget_bytes=memory_budget_bytes,
    )
    if out_path is not None:
        np.savez(
            out_path,
            compute_cost=problem.compute_cost,
            max_n_succ_stages=problem.max_n_succ_stages,
            submesh_shapes=problem.submesh_shapes,
            cluster_shape=np.asarray(problem.cluster_shape, dtype=np.int64),
            num_microbatches=np.asarray(problem.num_microbatches, dtype=np.int64),
            layer_names=np.asarray(profile.layer_names),
            layer_times_s=profile.layer_times_s,
            activation_bytes=profile.activation_bytes,
            stash_bytes=profile.stash_bytes,
            param_bytes=profile.param_bytes,
            backend=np.asarray(profile.backend),
            model_name=np.asarray(profile.model_name),
            per_boundary_s=np.asarray(overhead.per_boundary_s),
            boundary_fraction=np.asarray(overhead.boundary_fraction),
        )
    return problem, profile
