"""Baselines for hardware-aware planning: Alpa's way, and brute force.

**Alpa's way** (:func:`alpa_homogeneous`) is what Alpa would do on a mixed
cluster: it sees ``num_hosts x devices_per_host`` identical devices of the mean
speed and free links (:meth:`HeteroProblem.homogeneous_view`), finds the optimum
of that model with the exact DP, then hands the stages to the hosts blind to
their types. The plan is then priced on the true cluster: a stage on slow
devices runs slowly, a multi-host stage across two types runs at its slowest
type, transfers cost what the links cost.

Placement, ``placement="pipeline"`` (default): the stages take the devices in
pipeline order, host-major over the hosts as the cluster lists them (what a user
launching Alpa with a host list gets when stages are laid out in order). When a
stage would then straddle a host boundary (e.g. ``(1, 4), (1, 8), (1, 4)`` on
8-device hosts) it falls back to Alpa's runtime rule.

``placement="alpa"``: Alpa's runtime rule always. ``get_sliced_virtual_submeshes``
(``alpa/pipeline_parallel/stage_construction.py``) sorts the submeshes by size
(a stable argsort, walked in reverse: largest first, and among equal sizes the
*later* stage first) and slices whole hosts for ``(h, D)`` submeshes, then
device ranges of the current host for ``(1, d)`` ones. Stages of powers of two
therefore never straddle, but consecutive stages may land on different hosts.
Stages of equal size come out in reverse pipeline order, still host-contiguous:
32 ``(1, 1)`` stages on 4 x 8 devices make 3 inter-host hops, the minimum (the
5 hops reported in Alpa issue 752 do not come from this slicing rule).

On hosts whose size is not a power of two, Alpa's runtime can fail to slice
its own plan (e.g. two ``(1, 2)`` stages on hosts of 3 devices: the second
does not fit the one device left on the first host, and
``get_sliced_virtual_submeshes`` asserts); Alpa's way then raises
:class:`~pipedejavu.core.problem.InfeasibleProblemError` saying so. Every failure of
Alpa's way is that error, with the reason.

Alpa's plan, placed, is a valid plan, so the exact oracle
(:mod:`pipedejavu.search.hetero.exact`, over every valid plan) is never worse;
with mixed device types Alpa's way loses by about the ratio of the mean speed to
the speed of the slowest type its stages land on.

**Brute force** (:func:`hetero_brute_force`): every valid plan, enumerated.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import hetero_objective, make_hetero_plan
from pipedejavu.core.problem import InfeasibleProblemError, PlanError, ProblemError
from pipedejavu.search.alpa.exact import exact_dp

__all__ = ["alpa_homogeneous", "alpa_placement", "hetero_brute_force"]

PLACEMENTS = ("pipeline", "alpa")


def _pipeline_order(
    shapes: list[tuple[int, int]], num_hosts: int, dph: int
) -> list[tuple[tuple[int, ...], int]] | None:
    placed, offset = [], 0
    for h, d in shapes:
        host, first = divmod(offset, dph)
        if (h > 1 and first != 0) or first + d > dph or host + h > num_hosts:
            return None
        placed.append((tuple(range(host, host + h)), first))
        offset += h * d
    return placed


def _alpa_sorted(
    shapes: list[tuple[int, int]], num_hosts: int, dph: int
) -> list[tuple[tuple[int, ...], int]]:
    sizes = [h * d for h, d in shapes]
    order = np.argsort(sizes, kind="stable")[::-1].tolist()
    placed: list = [None] * len(shapes)
    host = device = 0
    for index in order:
        h, d = shapes[index]
        if d == dph:
            if device != 0 or host + h > num_hosts:
                raise PlanError(
                    "placement",
                    index,
                    f"Alpa's runtime slicing has no {h} free whole host(s) left for "
                    f"the ({h}, {d}) submesh",
                )
            placed[index] = (tuple(range(host, host + h)), 0)
            host += h
        else:
            if h != 1 or device + d > dph:
                raise PlanError(
                    "placement",
                    index,
                    f"Alpa's runtime slicing puts the ({h}, {d}) submesh at device "
                    f"{device} of host {host}, which has {dph} devices: it would "
                    "straddle two hosts (get_sliced_virtual_submeshes asserts)",
                )
            placed[index] = ((host,), device)
            device += d
            if device == dph:
                host, device = host + 1, 0
    return placed


def alpa_placement(
    problem: HeteroProblem,
    submesh_indices: list[int],
    placement: str = "pipeline",
) -> tuple[list[tuple[tuple[int, ...], int]], str]:
    """Type-blind ``(hosts, first_device)`` per stage, and the rule used.

    Raises:
        ValueError: unknown ``placement``.
        PlanError: the stages do not fill the cluster the way Alpa slices it.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    shapes = [tuple(int(x) for x in problem.submesh_shapes[m]) for m in submesh_indices]
    num_hosts, dph = problem.cluster.shape
    if placement == "pipeline":
        placed = _pipeline_order(shapes, num_hosts, dph)
        if placed is not None:
            return placed, "pipeline"
    return _alpa_sorted(shapes, num_hosts, dph), "alpa"


def _slowest_type(problem: HeteroProblem, hosts: tuple[int, ...], stage) -> int:
    """The type pricing a stage on ``hosts``: its slowest type (the cheapest
    one for this stage among types tied on speed)."""
    cluster = problem.cluster
    types = sorted({cluster.host_types[h] for h in hosts})
    slowest = min(cluster.device_types[t].speed for t in types)
    tied = [t for t in types if cluster.device_types[t].speed == slowest]
    key = (stage.start, stage.stop - 1, stage.submesh_index, stage.config_index)
    return min(tied, key=lambda t: problem.compute_cost[key + (t,)])


def alpa_homogeneous(
    problem: HeteroProblem,
    *,
    placement: str = "pipeline",
    memory: str = "tightest",
) -> HeteroPlan:
    """Alpa's plan for a mixed cluster, priced on the true cluster (module doc).

    Args:
        problem: the heterogeneous instance.
        placement: ``"pipeline"`` (pipeline order, Alpa's rule when a stage
            would straddle) or ``"alpa"`` (Alpa's runtime rule always).
        memory: the memory rule Alpa's view uses: ``"tightest"`` (per entry, the
            smallest ``max_n_succ_stages`` over the types, so the plan fits
            wherever it lands) or ``"reference"`` (type 0's, as
            ``homogeneous_view`` has it; the plan may then not fit).

    Returns:
        The placed plan; ``cost`` is the true heterogeneous objective. ``info``:
        ``alpa_predicted_cost`` (Alpa's own objective on its view, seconds),
        ``placement`` (the rule used), ``inter_host_hops``, ``mixed_stages``.

    Raises:
        InfeasibleProblemError: the only failure, with the reason: Alpa's view
            has no plan, Alpa's runtime cannot slice its plan onto the hosts, or
            the plan breaks the true memory rule (``memory="reference"``).
    """
    if memory not in ("tightest", "reference"):
        raise ValueError(f"memory must be 'tightest' or 'reference', got {memory!r}")
    started = time.perf_counter()
    try:
        view = problem.homogeneous_view()
        if memory == "tightest":
            view = view.replace(
                max_n_succ_stages=problem.max_n_succ_stages.min(axis=-1)
            )
    except ProblemError as error:
        raise InfeasibleProblemError(
            f"Alpa's homogeneous view of this cluster is not a valid problem: {error}"
        ) from None
    alpa_plan = exact_dp(view)
    try:
        placed, rule = alpa_placement(
            problem, [s.submesh_index for s in alpa_plan.stages], placement
        )
    except PlanError as error:
        raise InfeasibleProblemError(
            f"Alpa's plan ({', '.join(str(s.submesh) for s in alpa_plan.stages)}) "
            f"cannot be placed on hosts of {problem.cluster.devices_per_host} "
            f"devices: {error}"
        ) from None
    stages, mixed = [], 0
    for stage, (hosts, _) in zip(alpa_plan.stages, placed, strict=True):
        device_type = _slowest_type(problem, hosts, stage)
        mixed += len({problem.cluster.host_types[h] for h in hosts}) > 1
        stages.append(
            (
                stage.start,
                stage.stop,
                stage.submesh_index,
                stage.config_index,
                device_type,
            )
        )
    try:
        plan = make_hetero_plan(
            problem,
            stages,
            method="alpa_homogeneous",
            placement=placed,
            search_time_s=time.perf_counter() - started,
        )
    except PlanError as error:
        raise InfeasibleProblemError(
            f"Alpa's plan does not run on the true cluster: {error}"
        ) from None
    plan.info.update(
        alpa_predicted_cost=alpa_plan.cost,
        placement=rule,
        inter_host_hops=plan.inter_host_hops(problem.cluster),
        mixed_stages=mixed,
        alpa_num_stages=alpa_plan.num_stages,
    )
    return plan


def _stage_latency(problem: HeteroProblem, stage, followers: int):
    """Least latency of a placed stage over its configs and tied slowest
    types (the memory rule holding on every type of its hosts): ``(latency,
    config, type)`` or None."""
    start, stop, m, hosts = stage
    cluster = problem.cluster
    types = sorted({cluster.host_types[x] for x in hosts})
    slowest = min(cluster.device_types[t].speed for t in types)
    best = None
    for k in range(problem.num_configs):
        limits = problem.max_n_succ_stages[start, stop - 1, m, k]
        if any(followers > limits[t] for t in types):
            continue
        for t in types:
            if cluster.device_types[t].speed != slowest:
                continue
            latency = float(problem.compute_cost[start, stop - 1, m, k, t])
            if math.isfinite(latency) and (best is None or latency < best[0]):
                best = (latency, k, t)
    return best


def hetero_brute_force(
    problem: HeteroProblem, *, max_plans: int = 2_000_000
) -> HeteroPlan:
    """The optimum over every plan
    :func:`pipedejavu.core.hetero_rules.check_hetero_plan` accepts, by enumeration.

    Every partition of the layers, every submesh per stage and every host
    assignment (partial stages on any host with room, whole stages on any
    ordered choice of free hosts) that uses every device; each stage's devices
    sit side by side on its hosts in pipeline order (windows never change a
    cost). Per plan, each stage takes its cheapest config and tied slowest type
    that satisfy the memory rule -- the objective only grows with a stage's
    latency, so that choice is optimal. Independent of
    :func:`pipedejavu.search.hetero.exact.hetero_exact` on purpose; only for
    tiny problems (L <= ~5, a few hosts).

    Raises:
        InfeasibleProblemError: no plan satisfies the rules.
        ProblemError: more than ``max_plans`` partial plans would be visited.
    """
    started = time.perf_counter()
    cluster = problem.cluster
    num_layers, dph = problem.num_layers, cluster.devices_per_host
    shapes = problem.submesh_shapes.tolist()
    finite = np.isfinite(problem.compute_cost).any(axis=(3, 4))  # [L, L, M]
    used = [0] * cluster.num_hosts
    chosen: list = []  # (start, stop, m, hosts, first_device)
    best: list = [math.inf, None]
    visited = 0

    def score() -> None:
        num_stages = len(chosen)
        picks = []
        for index, (start, stop, m, hosts, _) in enumerate(chosen):
            pick = _stage_latency(
                problem, (start, stop, m, hosts), num_stages - 1 - index
            )
            if pick is None:
                return
            picks.append(pick)
        transfers = []
        for left, right in zip(chosen, chosen[1:], strict=False):
            shared = [x for x in left[3] if x in right[3]]
            link = (
                cluster.link(shared[0], shared[0])
                if shared
                else cluster.link(left[3][-1], right[3][0])
            )
            transfers.append(
                2.0 * link.time(float(problem.boundary_bytes[left[1] - 1]))
            )
        total = hetero_objective(
            [p[0] for p in picks], transfers, problem.num_microbatches
        )
        if total < best[0]:
            best[0] = total
            best[1] = [
                ((start, stop, m, k, t), (hosts, first))
                for (start, stop, m, hosts, first), (_, k, t) in zip(
                    chosen, picks, strict=True
                )
            ]

    def extend(layer: int) -> None:
        nonlocal visited
        visited += 1
        if visited > max_plans:
            raise ProblemError(
                f"too large for brute force: gave up after {max_plans} partial plans"
            )
        if layer == num_layers:
            if all(u == dph for u in used):
                score()
            return
        for stop in range(layer + 1, num_layers + 1):
            for m in np.flatnonzero(finite[layer, stop - 1]).tolist():
                h, d = shapes[m]
                if d < dph:
                    options = [
                        ((x,), used[x]) for x in range(len(used)) if used[x] + d <= dph
                    ]
                else:
                    free = [x for x in range(len(used)) if used[x] == 0]
                    options = [(hosts, 0) for hosts in itertools.permutations(free, h)]
                for hosts, first in options:
                    for x in hosts:
                        used[x] += d
                    chosen.append((layer, stop, m, hosts, first))
                    extend(stop)
                    chosen.pop()
                    for x in hosts:
                        used[x] -= d

    extend(0)
    if best[1] is None:
        raise InfeasibleProblemError("no valid plan satisfies the rules (brute force)")
    return make_hetero_plan(
        problem,
        [stage for stage, _ in best[1]],
        method="hetero_brute_force",
        placement=[where for _, where in best[1]],
        search_time_s=time.perf_counter() - started,
    )
