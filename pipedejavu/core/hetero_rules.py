"""The rules of a placed heterogeneous plan: transfers, objective, plan space.

The vocabulary (:class:`~pipedejavu.core.hetero.HeteroProblem`,
:class:`~pipedejavu.core.hetero.HeteroStage`,
:class:`~pipedejavu.core.hetero.HeteroPlan`) is in :mod:`pipedejavu.core.hetero`;
this module checks, places and prices plans.

**Transfers.** Between stage ``s`` and ``s + 1`` the activation goes forward and
its gradient comes back once per micro-batch: ``c_s = 2 * link.time(bytes)``, on
the intra-host link when the two stages share a host, else on the inter-host
link between the last host of ``s`` and the first host of ``s + 1``.

**Objective.** Transfers are pipeline steps of their own (a link is busy while
it moves a micro-batch, like a stage computing one), and the schedule is 1F1B
(Alpa's runtime, Megatron's non-interleaved order), which keeps at most
``w_s = min(S - s, B)`` micro-batches in flight at stage ``s``. So::

    T = R_0 + (B - 1) * P
    R_s = sum_{k >= s} t_k + sum_{l >= s} c_l      (one micro-batch's round trip)
    P = max(max_s t_s, max_l c_l,
            max over s <= k with S - s < B of
                (t_s + c_s + ... + c_{k-1} + t_k) / (k - s + 1))

the critical path of one micro-batch through every stage and link (forward and
back) plus ``B - 1`` periods. ``P`` is the maximum cycle mean of 1F1B's
dependency graph with uncontended links: a stage (``t_s``), a link (``c_l``),
and, for each stage ``s`` in steady state (``w_s < B``) and each ``k >= s``,
the loop "forward from ``s`` to ``k``, back to ``s``, then the next forward at
``s``", which ``k - s + 1`` micro-batches share (``w_s - w_k + 1``; for
``k = S - 1`` it is the in-flight limit ``R_s / w_s``). With free links every
loop's mean is at most ``max t``, so ``T`` is Alpa's ``sum + (B - 1) * max``
exactly; with links it charges what a link-blind period misses: on
``hetero-gpt-32layers-a100-v100`` the old ``sum t + sum c + (B - 1) max(max t,
max c)`` (:func:`hetero_bound`) put the optimal plan at 1.15 s against a
simulated 1F1B of 1.71 s. :func:`hetero_bound` stays a lower bound on ``T``
for every plan (the solvers' certified bounds rest on it).

How ``T`` relates to :mod:`pipedejavu.simulation.simulate` (same ``c``,
``transfer = c / 2`` per direction, ``b = 2 f``; each claim is a test in
``tests/test_hetero_consistency.py`` on the plans the planner returns):

* **free links**: ``T`` is Alpa's formula; GPipe ``= T`` (one backward ratio);
  1F1B ``<= T`` on every instance tested (not proven), ``= T`` for equal
  stages;
* **1F1B with transfers** (links shared first come first served, which ``P``
  does not model): ``T`` is an estimate, neither bound. Proven:
  ``T_1F1B >= R_0 + floor((B - 1) / w_s) R_s`` for every ``s`` (the forward
  of micro-batch ``b + w_s`` at ``s`` waits for the backward of ``b``), and
  ``T`` is at least that bound too (``P >= R_s / w_s``); on random pipelines
  and the planner's plans the simulated 1F1B is within 25% of ``T`` either way
  (tested; measured -20% .. +21%; equal stages and links are not exact);
* **GPipe** takes ``sum t + sum c + (B - 1)(max(F, X) + max(Bk, X))`` (``F``,
  ``Bk``, ``X`` the largest forward, backward and one-way transfer), ``>=``
  :func:`hetero_bound` always.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem, HeteroStage
from pipedejavu.core.problem import PlanError, objective

__all__ = [
    "check_hetero_plan",
    "evaluate_hetero",
    "hetero_bound",
    "hetero_objective",
    "make_hetero_plan",
    "place",
    "transfer_times",
]


def hetero_bound(
    latencies: Sequence[float], transfers: Sequence[float], num_microbatches: int
) -> float:
    """``sum(t) + sum(c) + (B - 1) * max(max t, max c)`` in seconds: the
    objective with every micro-batch in flight, ``<=`` :func:`hetero_objective`
    for every plan and ``<=`` GPipe's simulated time (module doc)."""
    return objective(latencies, num_microbatches, tuple(transfers))


def hetero_objective(
    latencies: Sequence[float], transfers: Sequence[float], num_microbatches: int
) -> float:
    """``R_0 + (B - 1) * P`` in seconds: 1F1B's period ``P`` with its in-flight
    loops (module doc); :func:`hetero_bound` when no loop is slower than the
    slowest stage or link (always with free links)."""
    bound = hetero_bound(latencies, transfers, num_microbatches)
    t = [float(x) for x in latencies]
    c = [float(x) for x in transfers]
    stages, count = len(t), int(num_microbatches)
    if count < 2 or not any(c):
        return bound
    period = max(max(t), max(c, default=0.0))
    loop = period
    # prefix[i] = t_0 + c_0 + ... + t_{i-1} + c_{i-1}
    prefix = [0.0]
    for i in range(stages):
        prefix.append(prefix[-1] + t[i] + (c[i] if i < stages - 1 else 0.0))
    for s in range(max(0, stages - count + 1), stages):
        for k in range(s + 1, stages):
            # t_s + c_s + ... + c_{k-1} + t_k
            length = prefix[k] - prefix[s] + t[k]
            loop = max(loop, length / (k - s + 1))
    if loop <= period:
        return bound
    return float(math.fsum(t) + math.fsum(c) + (count - 1) * loop)


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
    """The objective (module doc, :func:`hetero_objective`) after
    :func:`check_hetero_plan`."""
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
