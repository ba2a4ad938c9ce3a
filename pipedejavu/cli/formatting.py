"""Text the command line prints: plan tables and problem inspections."""

from __future__ import annotations

import numpy as np

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.problem import Plan, Problem
from pipedejavu.search.alpa.caps import explain_infeasible, min_sum_plan

__all__ = [
    "format_duration",
    "format_hetero_inspection",
    "format_hetero_plan",
    "format_inspection",
    "format_plan",
]


def format_duration(seconds: float) -> str:
    """``"12.3 ms"`` below a second, ``"205.08 s"`` from one second on."""
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _stage_cells(stage) -> tuple[str, str]:
    """A plan table's layers (``first-last``) and submesh (``HxD``) of a stage."""
    return f"{stage.start}-{stage.stop - 1}", f"{stage.submesh[0]}x{stage.submesh[1]}"


def _lower_bound_line(plan: Plan | HeteroPlan) -> str:
    """The certified lower bound of a plan whose ``info`` has one, and its gap."""
    return (
        f"lower bound {plan.info['lower_bound']:.6f} s: the plan is within "
        f"{100 * plan.info['gap']:.2f}% of the optimum"
    )


def format_hetero_plan(problem: HeteroProblem, plan: HeteroPlan) -> str:
    """A readable table of a placed plan on typed devices."""
    cluster = problem.cluster
    lines = [
        f"method {plan.method}: {plan.num_stages} stage(s) on {cluster.describe()}, "
        f"B = {plan.num_microbatches}",
        f"{'stage':>5}  {'layers':>9}  {'submesh':>7}  {'type':>8}  {'hosts':>9}  "
        f"{'config':>6}  {'latency (s)':>12}  {'transfer (s)':>12}",
    ]
    for index, stage in enumerate(plan.stages):
        layers, submesh = _stage_cells(stage)
        hosts = ",".join(str(h) for h in stage.hosts)
        kind = cluster.device_types[stage.device_type].name
        transfer = (
            f"{plan.transfers[index]:12.6f}" if index < len(plan.transfers) else ""
        )
        lines.append(
            f"{index:>5}  {layers:>9}  {submesh:>7}  {kind:>8}  {hosts:>9}  "
            f"{stage.config_index:>6}  {stage.latency:>12.6f}  {transfer:>12}"
        )
    if "lower_bound" in plan.info:
        proven = plan.info.get("proven")
        lines.append(
            _lower_bound_line(plan)
            + (
                " (optimal, proven)"
                if proven == "optimal"
                else " (bound: the exact optimum of sum + (B-1) x max(t, c))"
                if proven == "bounded"
                else ""
            )
        )
    placed = _PLACEMENTS.get(plan.info.get("placement"))
    if placed:
        lines.append(f"placed blind to the GPU types: {placed}")
    lines.append(
        f"total: {plan.cost:.6f} s per iteration (1F1B: stages + transfers + "
        f"(B-1) x period), {plan.inter_host_hops(cluster)} inter-host hop(s), "
        f"search {format_duration(plan.search_time_s)}"
    )
    return "\n".join(lines)


#: How Alpa's way placed its stages (``plan.info["placement"]`` of
#: :func:`~pipedejavu.baselines.hetero.alpa_homogeneous`), for the report.
_PLACEMENTS = {
    "pipeline": "in pipeline order over the hosts as the cluster lists them",
    "alpa": "by Alpa's runtime slicing (the larger stages first, whole hosts then "
    "device ranges), since pipeline order would split a stage across two hosts",
}


def format_plan(problem: Problem | HeteroProblem, plan: Plan | HeteroPlan) -> str:
    """A readable plan table."""
    if isinstance(plan, HeteroPlan):
        return format_hetero_plan(problem, plan)
    lines = [
        f"method {plan.method}: {plan.num_stages} stage(s) on "
        f"{problem.cluster_shape[0]}x{problem.cluster_shape[1]} = "
        f"{problem.num_devices} devices, B = {plan.num_microbatches}",
        f"{'stage':>5}  {'layers':>9}  {'submesh':>7}  {'devices':>7}  "
        f"{'config':>6}  {'latency (s)':>12}",
    ]
    for index, stage in enumerate(plan.stages):
        layers, submesh = _stage_cells(stage)
        lines.append(
            f"{index:>5}  {layers:>9}  {submesh:>7}  {stage.num_devices:>7}  "
            f"{stage.config_index:>6}  {stage.latency:>12.6f}"
        )
    latencies = [stage.latency for stage in plan.stages]
    if "lower_bound" in plan.info:
        lines.append(_lower_bound_line(plan))
    lines.append(
        f"total: sum {sum(latencies):.6f} s + (B-1) x max {max(latencies):.6f} s "
        f"= {plan.cost:.6f} s per iteration   "
        f"(search {format_duration(plan.search_time_s)})"
    )
    return "\n".join(lines)


def format_inspection(problem: Problem | HeteroProblem) -> str:
    """Sizes, coverage and feasibility of a problem, one fact a line."""
    if isinstance(problem, HeteroProblem):
        return format_hetero_inspection(problem)

    table = problem.compute_cost
    upper = np.triu(np.ones((problem.num_layers,) * 2, dtype=bool))
    entries = table[upper]
    finite = np.isfinite(entries)
    feasible = finite & (problem.max_n_succ_stages[upper] >= 0)
    shapes = ", ".join(f"{h}x{d}" for h, d in problem.submesh_shapes.tolist())
    plan_exists = np.isfinite(min_sum_plan(problem)[0])
    lines = [
        f"layers L = {problem.num_layers}, submeshes M = {problem.num_submeshes} "
        f"({shapes}), configs K = {problem.num_configs}",
        f"cluster {problem.cluster_shape[0]}x{problem.cluster_shape[1]} = "
        f"{problem.num_devices} devices, micro-batches B = {problem.num_microbatches}",
        f"stage entries (i <= j): {entries.size}",
        f"  finite (profiled): {int(finite.sum())}",
        f"  memory-feasible:   {int(feasible.sum())}",
        f"  missing (inf):     {int((~finite).sum())}",
    ]
    if finite.any():
        lines.append(
            f"finite latency range: {entries[finite].min():.6g} .. "
            f"{entries[finite].max():.6g} s"
        )
    lines.append(
        "feasible plan: yes"
        if plan_exists
        else f"feasible plan: no ({explain_infeasible(problem)})"
    )
    return "\n".join(lines)


def _entry_counts(cost: np.ndarray, memory: np.ndarray) -> tuple[int, int, int]:
    """(entries, finite, memory-feasible) over the stages ``i <= j``."""
    upper = np.triu(np.ones(cost.shape[:2], dtype=bool))
    entries = cost[upper]
    finite = np.isfinite(entries)
    return entries.size, int(finite.sum()), int((finite & (memory[upper] >= 0)).sum())


def format_hetero_inspection(problem: HeteroProblem) -> str:
    """Sizes, device types, links and coverage per type, one fact a line."""
    cluster = problem.cluster
    shapes = ", ".join(f"{h}x{d}" for h, d in problem.submesh_shapes.tolist())
    lines = [
        f"layers L = {problem.num_layers}, submeshes M = {problem.num_submeshes} "
        f"({shapes}), configs K = {problem.num_configs}, device types "
        f"T = {problem.num_types}",
        f"cluster {cluster.num_hosts}x{cluster.devices_per_host} = "
        f"{problem.num_devices} devices: {cluster.describe()}; micro-batches "
        f"B = {problem.num_microbatches}",
    ]
    for t, kind in enumerate(cluster.device_types):
        size, finite, feasible = _entry_counts(
            problem.compute_cost[..., t], problem.max_n_succ_stages[..., t]
        )
        memory = (
            "memory unknown"
            if kind.memory_bytes is None
            else f"{kind.memory_bytes / 1e9:g} GB per device"
        )
        lines.append(
            f"type {kind.name} ({len(cluster.hosts_of_type(t))} hosts, speed "
            f"{kind.speed:g}, {memory}): {size} stage entries, {finite} finite, "
            f"{feasible} memory-feasible"
        )
    for t, kind in enumerate(cluster.device_types):
        link = cluster.intra_host[t]
        lines.append(f"link inside a {kind.name} host: {_link_text(link)}")
    for a in range(cluster.num_types):
        for b in range(a, cluster.num_types):
            names = f"{cluster.device_types[a].name}-{cluster.device_types[b].name}"
            lines.append(
                f"link between hosts {names}: {_link_text(cluster.inter_host[a][b])}"
            )
    if problem.num_layers > 1:
        boundary = problem.boundary_bytes
        lines.append(
            f"activation per layer boundary: {boundary.min() / 1e6:.4g} .. "
            f"{boundary.max() / 1e6:.4g} MB per micro-batch"
        )
    lines.append(
        "feasible plan: not checked here (the exact oracle decides: "
        "pipedejavu solve ... --method dp)"
    )
    return "\n".join(lines)


def _link_text(link) -> str:
    bandwidth = (
        "free"
        if not np.isfinite(link.bandwidth)
        else f"{link.bandwidth * 8 / 1e9:g} Gb/s"
    )
    return f"latency {link.latency_s * 1e6:g} us, bandwidth {bandwidth}"
