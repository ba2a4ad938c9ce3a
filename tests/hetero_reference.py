"""An independent brute force over every valid heterogeneous plan (tests only).

Written from the rules of :mod:`pipedejavu.core.hetero` (module docstring and
:func:`pipedejavu.core.hetero_rules.check_hetero_plan`), sharing no code with the
solvers:

* stages cover layers ``0..L-1`` contiguously; stage ``s`` runs submesh
  ``(h, d)`` on ``h`` distinct hosts, ``d`` devices of each (a window of the
  host); every device of the cluster is used exactly once;
* it is priced at a type of its hosts whose speed is the least among them (any
  tied type may price it), and obeys the memory rule of every type it touches;
* between stages ``s`` and ``s + 1``: ``c_s = 2 * link.time(bytes)``, on the
  intra-host link when they share a host, else on the inter-host link between
  the last host of ``s`` and the first host of ``s + 1``;
* ``T = sum t + sum c + (B - 1) * P``, 1F1B's period ``P``: the largest of
  every ``t_s``, every ``c_l`` and, for every stage ``s`` with fewer than ``B``
  stages from it on (``S - s < B``) and every ``k > s``, the mean
  ``(t_s + c_s + ... + c_{k-1} + t_k) / (k - s + 1)``; with
  ``objective="bound"`` ``P = max(max t, max c)`` (``hetero_bound``).

Device windows never change a cost (any widths that sum to a host's size can be
laid side by side), so a placement is enumerated as the hosts of each stage in
order (its first and last host matter for the links). Placements that give the
same stage and link data are scored once; every partition of the layers into
the stages is then scored at once with numpy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from pipedejavu.core.hetero import HeteroProblem, HeteroStage


def _placements(problem: HeteroProblem, sequence: tuple[int, ...]):
    """Every host assignment of the submesh sequence that uses all devices:
    a list per stage of host tuples (partial stages: one host)."""
    cluster = problem.cluster
    dph = cluster.devices_per_host
    num_hosts = cluster.num_hosts
    shapes = problem.submesh_shapes.tolist()
    used = [0] * num_hosts
    chosen: list[tuple[int, ...]] = []

    def rec(index: int):
        if index == len(sequence):
            if all(u == dph for u in used):
                yield list(chosen)
            return
        h, d = shapes[sequence[index]]
        if d < dph:  # one host, part of it
            for host in range(num_hosts):
                if used[host] + d <= dph:
                    used[host] += d
                    chosen.append((host,))
                    yield from rec(index + 1)
                    chosen.pop()
                    used[host] -= d
            return
        free = [x for x in range(num_hosts) if used[x] == 0]
        for group in itertools.combinations(free, h):
            for x in group:
                used[x] = dph
            orders = {(group[0],)} if h == 1 else set()
            for first in group:
                for last in group:
                    if first != last:
                        rest = [x for x in group if x not in (first, last)]
                        orders.add((first, *rest, last))
            for hosts in sorted(orders):
                chosen.append(hosts)
                yield from rec(index + 1)
                chosen.pop()
            for x in group:
                used[x] = 0

    yield from rec(0)


def _sequences(problem: HeteroProblem, num_stages: int):
    sizes = problem.submesh_sizes.tolist()
    total = problem.num_devices

    def rec(prefix, left):
        if len(prefix) == num_stages:
            if left == 0:
                yield tuple(prefix)
            return
        for m, size in enumerate(sizes):
            if size <= left - (num_stages - len(prefix) - 1):
                prefix.append(m)
                yield from rec(prefix, left - size)
                prefix.pop()

    yield from rec([], total)


def _stage_table(problem, m, price_types, memory_types, followers):
    """f64[L, L] least cost of the stage on submesh m over configs whose memory
    rule holds on every touched type, and over the allowed price types;
    i64[L, L, 2] the (config, type) achieving it."""
    cost = problem.compute_cost[:, :, m, :, :]  # [L, L, K, T]
    memory = problem.max_n_succ_stages[:, :, m, :, :]
    ok = np.all(memory[..., list(memory_types)] >= followers, axis=-1)  # [L, L, K]
    best = np.full(cost.shape[:2], np.inf)
    arg = np.zeros(cost.shape[:2] + (2,), dtype=np.int64)
    for t in price_types:
        values = np.where(ok, cost[..., t], np.inf)
        k = values.argmin(axis=2)
        v = np.take_along_axis(values, k[..., None], 2)[..., 0]
        better = v < best
        best = np.where(better, v, best)
        arg[better] = np.stack([k[better], np.full(better.sum(), t)], axis=-1)
    return best, arg


def brute_force_all(
    problem: HeteroProblem,
    *,
    max_placements: int = 2_000_000,
    objective: str = "1f1b",
):
    """The optimum over every valid plan and one optimal plan (``objective``:
    ``"1f1b"``, the planner's, or ``"bound"``, the all-in-flight one).

    Returns:
        ``(cost, stages)``: ``cost`` in seconds (``inf`` when no valid plan
        exists) and a list of :class:`HeteroStage` (``None`` when none).
    """
    cluster = problem.cluster
    num_layers = problem.num_layers
    speeds = np.asarray(cluster.speeds)
    host_types = cluster.host_types
    sent = problem.boundary_bytes
    best_cost, best_plan = math.inf, None
    seen = 0
    for num_stages in range(1, min(num_layers, problem.num_devices) + 1):
        combos = list(itertools.combinations(range(1, num_layers), num_stages - 1))
        cuts = np.zeros((len(combos), num_stages - 1), dtype=np.int64)
        for row, combo in enumerate(combos):
            cuts[row] = combo
        starts = np.concatenate(
            [np.zeros((len(cuts), 1), np.int64), cuts], axis=1
        )  # [P, S]
        stops = np.concatenate(
            [cuts, np.full((len(cuts), 1), num_layers, np.int64)], axis=1
        )
        scored: dict = {}
        for sequence in _sequences(problem, num_stages):
            for hosts in _placements(problem, sequence):
                seen += 1
                if seen > max_placements:
                    raise RuntimeError("brute force: too many placements")
                stage_keys = []
                for hs in hosts:
                    types = sorted({host_types[x] for x in hs})
                    slowest = min(speeds[t] for t in types)
                    price = tuple(t for t in types if speeds[t] == slowest)
                    stage_keys.append((price, tuple(types)))
                links = []
                for a, b in zip(hosts, hosts[1:], strict=False):
                    shared = [x for x in a if x in b]
                    if shared:
                        links.append(("intra", host_types[shared[0]]))
                    else:
                        pair = sorted((host_types[a[-1]], host_types[b[0]]))
                        links.append(("inter", *pair))
                key = (sequence, tuple(stage_keys), tuple(links))
                if key not in scored:
                    scored[key] = hosts
        for (sequence, stage_keys, links), hosts in scored.items():
            tables = [
                _stage_table(problem, m, price, memory, num_stages - 1 - s)
                for s, (m, (price, memory)) in enumerate(
                    zip(sequence, stage_keys, strict=True)
                )
            ]
            latency = np.stack(
                [
                    tables[s][0][starts[:, s], stops[:, s] - 1]
                    for s in range(num_stages)
                ],
                axis=1,
            )  # [P, S]
            transfer = np.zeros((len(starts), max(num_stages - 1, 0)))
            for s, link in enumerate(links):
                if link[0] == "intra":
                    chosen = cluster.intra_host[link[1]]
                else:
                    chosen = cluster.inter_host[link[1]][link[2]]
                size = sent[stops[:, s] - 1]
                transfer[:, s] = 2.0 * (chosen.latency_s + size / chosen.bandwidth)
            finite = np.isfinite(latency).all(axis=1)
            bottleneck = np.maximum(
                np.where(finite, latency.max(axis=1), 0.0),
                transfer.max(axis=1) if num_stages > 1 else 0.0,
            )
            count = problem.num_microbatches
            period = bottleneck
            if objective == "1f1b":
                for first in range(max(0, num_stages - count + 1), num_stages):
                    for last in range(first + 1, num_stages):
                        loop = latency[:, first : last + 1].sum(axis=1)
                        loop = loop + transfer[:, first:last].sum(axis=1)
                        period = np.maximum(period, loop / (last - first + 1))
            total = latency.sum(axis=1) + transfer.sum(axis=1) + (count - 1) * period
            total = np.where(finite, total, np.inf)
            if not np.isfinite(total).any():
                continue
            p = int(np.argmin(total))
            if total[p] < best_cost:
                best_cost = float(total[p])
                best_plan = _plan(problem, sequence, hosts, tables, starts[p], stops[p])
    return best_cost, best_plan


def _plan(problem, sequence, hosts, tables, starts, stops) -> list[HeteroStage]:
    """HeteroStages of one scored plan (device windows laid side by side)."""
    offset = [0] * problem.cluster.num_hosts
    stages = []
    for s, (m, hs) in enumerate(zip(sequence, hosts, strict=True)):
        h, d = (int(x) for x in problem.submesh_shapes[m])
        first = offset[hs[0]]
        for x in hs:
            offset[x] += d
        start, stop = int(starts[s]), int(stops[s])
        k, t = (int(x) for x in tables[s][1][start, stop - 1])
        stages.append(_stage(problem, start, stop, int(m), k, t, hs, first))
    return stages


def _stage(problem, start, stop, m, k, t, hosts, first) -> HeteroStage:
    """The stage of layers ``start..stop-1`` on submesh ``m``, config ``k``
    and type ``t``, on ``hosts`` from device ``first`` of the first."""
    return HeteroStage(
        start=start,
        stop=stop,
        submesh=tuple(int(x) for x in problem.submesh_shapes[m]),
        submesh_index=m,
        config_index=k,
        device_type=t,
        hosts=tuple(hosts),
        first_device=first,
        latency=float(problem.compute_cost[start, stop - 1, m, k, t]),
    )


def random_instance(rng: np.random.Generator, *, max_layers: int = 5):
    """A tiny instance drawn to stress placement: 1-3 device types (speeds
    often tied, sometimes a type without hosts), 1-4 hosts of 1-4 devices
    (hosts of 3 use manual submeshes), some submesh shapes missing, links that
    are free, slow inside hosts or slow between them, inf entries and memory
    limits."""
    from pipedejavu.core.cluster import Cluster, DeviceType, Link
    from pipedejavu.core.problem import get_submesh_choices

    num_types = int(rng.integers(1, 4))
    speeds = rng.choice([0.5, 0.7, 1.0, 1.0], num_types)
    memory = [float(rng.choice([8e9, 16e9])) for _ in range(num_types)]
    types = [DeviceType(f"t{i}", float(s), memory[i]) for i, s in enumerate(speeds)]
    dph = int(rng.choice([1, 2, 2, 3, 4]))
    num_hosts = int(rng.integers(1, 5 if dph <= 2 else 4))
    host_types = rng.integers(0, num_types, num_hosts).tolist()
    if num_types > 1 and rng.random() < 0.2:  # a type without hosts
        host_types = [t for t in host_types if t != num_types - 1] or [0]
        num_hosts = len(host_types)

    def link() -> Link:
        kind = rng.integers(0, 4)
        if kind == 0:
            return Link()
        return Link(float(rng.uniform(0, 0.3)), float(rng.choice([0.5, 2.0, 20.0])))

    intra = {t.name: link() for t in types}
    inter = random_inter_host(rng, num_types, link)
    cluster = Cluster.from_types(
        types, host_types, dph, intra_host=intra, inter_host=inter
    )
    if dph & (dph - 1):
        shapes = [(1, d) for d in range(1, dph + 1)]
        shapes += [(h, dph) for h in range(2, num_hosts + 1)]
    else:
        shapes = list(get_submesh_choices(num_hosts, dph, "all"))
    if len(shapes) > 2 and rng.random() < 0.3:
        keep = rng.random(len(shapes)) < 0.7
        shapes = [s for s, k in zip(shapes, keep, strict=True) if k] or shapes[:1]
    # costs rounded: exact ties between types and configs happen
    return random_problem_on(rng, cluster, shapes, max_layers, decimals=3)


def random_inter_host(rng: np.random.Generator, num_types: int, link) -> dict:
    """Inter-host links between types ``t0``, ``t1``, ...: a default one and,
    for each pair of types (a type with itself included), one drawn by
    ``link()`` half the time."""
    inter = {"default": link()}
    for a in range(num_types):
        for b in range(a, num_types):
            if rng.random() < 0.5:
                inter[f"t{a}-t{b}"] = link()
    return inter


def random_problem_on(
    rng: np.random.Generator,
    cluster,
    shapes,
    max_layers: int,
    *,
    size_exponent: float | None = None,
    decimals: int | None = None,
    max_microbatches: int = 8,
    max_boundary: float = 4.0,
) -> HeteroProblem:
    """An instance on ``cluster`` and submesh ``shapes`` of 1 to ``max_layers``
    layers and 1 or 2 configs: costs grow with a stage's span and shrink with
    its submesh's devices ** ``size_exponent`` (drawn from [0.5, 1) when None)
    and with its type's speed, rounded to ``decimals``; 15 % of them inf, 30 %
    of the memory limits drawn (the rest unlimited); 1 to ``max_microbatches``
    micro-batches, boundary bytes up to ``max_boundary``."""
    shapes = np.array(shapes, dtype=np.int64)
    num_types = len(cluster.speeds)
    num_layers = int(rng.integers(1, max_layers + 1))
    num_configs = int(rng.integers(1, 3))
    shape = (num_layers, num_layers, len(shapes), num_configs, num_types)
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1
    sizes = shapes[:, 0] * shapes[:, 1]
    cost = rng.uniform(0.5, 2.0, shape) * np.clip(spans, 1, None)[..., None, None, None]
    if size_exponent is None:
        size_exponent = rng.uniform(0.5, 1.0)
    cost = cost / sizes[None, None, :, None, None] ** size_exponent
    cost = cost / np.asarray(cluster.speeds)
    if decimals is not None:
        cost = np.round(cost, decimals)
    cost[rng.random(shape) < 0.15] = np.inf
    limits = np.where(
        rng.random(shape) < 0.3, rng.integers(-1, num_layers, shape), 2**20
    )
    return HeteroProblem(
        compute_cost=cost,
        max_n_succ_stages=limits,
        submesh_shapes=shapes,
        cluster=cluster,
        num_microbatches=int(rng.integers(1, max_microbatches + 1)),
        boundary_bytes=rng.uniform(0, max_boundary, max(num_layers - 1, 0)),
    )


def canonical_optimum(problem: HeteroProblem) -> float:
    """The optimum over canonically placed plans only (every stage on one
    type, each type's stages packed in pipeline order by
    :func:`pipedejavu.core.hetero_rules.place`): what the oracle searched before it
    covered every valid plan. inf when none."""
    from pipedejavu.core.hetero_rules import evaluate_hetero, make_hetero_plan
    from pipedejavu.core.problem import PlanError

    num_layers = problem.num_layers
    best = math.inf
    options = [
        (m, k, t)
        for m in range(problem.num_submeshes)
        for k in range(problem.num_configs)
        for t in range(problem.num_types)
    ]
    for num_stages in range(1, num_layers + 1):
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
            bounds = [0, *cuts, num_layers]
            for choice in itertools.product(options, repeat=num_stages):
                stages = [
                    (bounds[s], bounds[s + 1], m, k, t)
                    for s, (m, k, t) in enumerate(choice)
                ]
                try:
                    plan = make_hetero_plan(problem, stages, method="canonical")
                except PlanError:
                    continue
                best = min(best, evaluate_hetero(problem, plan))
    return best


def _reprice(problem: HeteroProblem, places):
    """HeteroStages for ``(start, stop, m, hosts, first)`` places: each stage's
    cheapest config and tied slowest type under the memory rule of every type
    it touches; None when some stage has none."""
    cluster = problem.cluster
    speeds = np.asarray(cluster.speeds)
    stages = []
    for index, (start, stop, m, hosts, first) in enumerate(places):
        types = sorted({cluster.host_types[x] for x in hosts})
        price = [t for t in types if speeds[t] == min(speeds[types])]
        table, arg = _stage_table(problem, m, price, types, len(places) - 1 - index)
        if not math.isfinite(table[start, stop - 1]):
            return None
        k, t = (int(x) for x in arg[start, stop - 1])
        stages.append(_stage(problem, start, stop, m, k, t, hosts, first))
    return stages


def _neighbours(problem: HeteroProblem, places):
    index_of = {tuple(s): m for m, s in enumerate(problem.submesh_shapes.tolist())}
    dph = problem.cluster.devices_per_host
    count = len(places)
    for i in range(count - 1):  # shift a boundary
        for delta in (-3, -2, -1, 1, 2, 3):
            stop = places[i][1] + delta
            if places[i][0] < stop < places[i + 1][1]:
                trial = list(places)
                trial[i] = (places[i][0], stop, *places[i][2:])
                trial[i + 1] = (stop, places[i + 1][1], *places[i + 1][2:])
                yield trial
    for i in range(count):
        for j in range(i + 1, count):  # swap two stages' devices
            trial = list(places)
            trial[i] = places[i][:2] + places[j][2:]
            trial[j] = places[j][:2] + places[i][2:]
            yield trial
        start, stop, m, hosts, first = places[i]
        h, d = (int(x) for x in problem.submesh_shapes[m])
        if h > 1:  # another first or last host
            for a in range(h):
                for b in range(h):
                    if a != b:
                        rest = [x for k, x in enumerate(hosts) if k not in (a, b)]
                        order = (hosts[a], *rest, hosts[b])
                        if order != hosts:
                            trial = list(places)
                            trial[i] = (start, stop, m, order, first)
                            yield trial
        if stop - start >= 2:  # split in two
            middle = (start + stop) // 2
            if h == 1 and d % 2 == 0 and (1, d // 2) in index_of:
                half = index_of[1, d // 2]
                yield (
                    places[:i]
                    + [
                        (start, middle, half, hosts, first),
                        (middle, stop, half, hosts, first + d // 2),
                    ]
                    + places[i + 1 :]
                )
            for cut in range(1, h):
                if (cut, d) in index_of and (h - cut, d) in index_of:
                    yield (
                        places[:i]
                        + [
                            (start, middle, index_of[cut, d], hosts[:cut], 0),
                            (middle, stop, index_of[h - cut, d], hosts[cut:], 0),
                        ]
                        + places[i + 1 :]
                    )
        if i + 1 < count:  # merge with the next stage
            _, stop2, m2, hosts2, first2 = places[i + 1]
            h2, d2 = (int(x) for x in problem.submesh_shapes[m2])
            merged = None
            if h == h2 == 1 and hosts == hosts2 and d + d2 < dph:
                low = min(first, first2)
                if max(first, first2) == low + (d if first < first2 else d2):
                    if (1, d + d2) in index_of:
                        merged = (start, stop2, index_of[1, d + d2], hosts, low)
            elif d == d2 == dph and (h + h2, dph) in index_of:
                merged = (start, stop2, index_of[h + h2, dph], hosts + hosts2, 0)
            if merged is not None:
                yield places[:i] + [merged] + places[i + 2 :]


def local_search_all(problem: HeteroProblem, stages, *, max_steps: int = 50):
    """Best-improvement hill climbing from a plan over the neighbourhood above,
    every trial checked and priced by
    :func:`pipedejavu.core.hetero_rules.evaluate_hetero`.
    Returns ``(cost, stages)`` of the local optimum reached."""
    from pipedejavu.core.hetero_rules import evaluate_hetero
    from pipedejavu.core.problem import PlanError

    places = [
        (s.start, s.stop, s.submesh_index, s.hosts, s.first_device) for s in stages
    ]
    current = _reprice(problem, places)
    cost = evaluate_hetero(problem, current)
    for _ in range(max_steps):
        best = (cost, None)
        for trial in _neighbours(problem, places):
            priced = _reprice(problem, trial)
            if priced is None:
                continue
            try:
                value = evaluate_hetero(problem, priced)
            except PlanError:
                continue
            if value < best[0] * (1 - 1e-12):
                best = (value, (trial, priced))
        if best[1] is None:
            return cost, current
        cost, (places, current) = best[0], best[1]
    return cost, current
