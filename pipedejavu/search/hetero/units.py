"""The plan space of :mod:`pipedejavu.core.hetero` as tables the exact search reads.

A *partial* stage is a ``(1, d)`` submesh with ``d < devices_per_host``: it
lives on one host, next to other partial stages. A *whole* stage is an
``(h, devices_per_host)`` submesh: it holds ``h`` hosts alone. Host identity
never enters a cost (links depend on the hosts' types only), so a whole stage
is described by its *composition* (hosts of each type), the type of its first
host ``x`` (the link into it) and of its last host ``y`` (the link out of it);
it is priced at the cheapest of its tied slowest types and obeys the memory
rule of every type it holds. A partial stage of type ``t`` enters and leaves
on type ``t``.

Span tables are indexed ``[start, length - 1]`` (a band under a cap is then a
contiguous slice): entry ``[i, d]`` is the span ``i..i + d`` (inclusive),
inf where ``i + d >= L``. :func:`build` gathers, once per problem (and span
restriction): the units (partial submeshes, whole compositions with their
``(x, y)`` pairs), their cost and memory tables, the round-trip link times at
every layer boundary, and the flat indices of the DP's grid moves.
:func:`stage_table` cuts a unit's table at a cap and a memory threshold.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.problem import ProblemError

__all__ = [
    "Setup",
    "Whole",
    "build",
    "by_length",
    "candidate_caps",
    "layer_row",
    "layer_rows",
    "num_rows",
    "span_mask",
    "stage_table",
]

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Whole(NamedTuple):
    """A whole-host unit: submesh ``m`` on ``composition[t]`` hosts of type t.

    ``pairs`` lists the allowed ``(first host type, last host type)``;
    ``price`` the tied slowest types; ``present`` every type it holds.
    """

    m: int
    composition: tuple[int, ...]
    present: tuple[int, ...]
    price: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]


class Setup(NamedTuple):
    """Everything the exact search reads about one problem.

    Attributes:
        num_layers, num_types, dph: L, T, devices per host.
        hosts: hosts of each type ``N_t``.
        grid: ``N_t * dph + 1`` per type (devices used: the DP's grid axes).
        num_cells: ``prod(grid)``; the DP's states are ``cell * T + a`` plus
            one last, always-inf state (the target of moves off the grid).
        cells: i64[G, T] devices used per type of every cell.
        partial: ``(m, width)`` of every partial submesh.
        wholes: the whole-host units.
        unit_cost: per unit key (``("p", m, t)`` or ``("w", index)``) the cost
            f64[L, L, K] by (start, length - 1) (whole units: the least over
            their price types) and the price type i64[L, L, K] achieving it;
            spans outside ``mask`` are not cut here (:func:`stage_table` does).
        unit_memory: per unit key the memory rule i64[L, L, K] (whole units:
            the least over the types they hold).
        intra: f64[L + 1, T] round trip at the boundary before layer i on the
            intra-host link of each type (inf at 0 and L: no boundary).
        inter: f64[L + 1, T, T] the same on the inter-host links.
        conflict: bool[L + 1, T] the intra-host link is strictly slower than
            the inter-host link between two hosts of the type there.
        mask: bool[L, L] usable spans by (start, length - 1); ``spans`` its
            nonzero (start, length - 1) indices.
        rows: None, or for a sparse mask i64[L + 1] the row of the DP's value
            table holding each layer: only layers where a usable span starts
            or ends after are stored (and L); the others share one row that
            stays inf (see :func:`layer_rows`).
        full_buckets: memory buckets that make the lumped rule exact (one more
            than the largest binding ``max_n_succ_stages + 1`` below the most
            stages a plan can have).
        block_move: per type i64[dph, G] the state a block of width ``W``
            (row ``W - 1``) lands on from each cell, ending on the type.
        whole_move: per whole unit i64[G] the cell it lands on (-1: none).
    """

    num_layers: int
    num_types: int
    dph: int
    hosts: tuple[int, ...]
    grid: tuple[int, ...]
    num_cells: int
    cells: NDArray[np.int64]
    partial: tuple[tuple[int, int], ...]
    wholes: tuple[Whole, ...]
    unit_cost: dict[Any, tuple[NDArray[np.float64], NDArray[np.int64]]]
    unit_memory: dict[Any, NDArray[np.int64]]
    intra: NDArray[np.float64]
    inter: NDArray[np.float64]
    conflict: NDArray[np.bool_]
    mask: NDArray[np.bool_]
    block_move: dict[int, NDArray[np.int64]]
    whole_move: tuple[NDArray[np.int64], ...]
    spans: tuple[NDArray[np.int64], NDArray[np.int64]]
    rows: NDArray[np.int64] | None
    full_buckets: int

    @property
    def sentinel(self) -> int:
        """The always-inf state."""
        return self.num_cells * self.num_types


def span_mask(problem: HeteroProblem, allowed: Any) -> NDArray[np.bool_]:
    """bool[L, L] spans ``[start, end]`` (inclusive) the search may use.

    ``allowed``: ``None`` (all), a bool[L, L] mask, or stage stops in
    ``1..L - 1`` (the stop ``L`` is always allowed; stages start at 0 or at an
    allowed stop).
    """
    num_layers = problem.num_layers
    if allowed is None:
        return np.ones((num_layers, num_layers), dtype=bool)
    if isinstance(allowed, np.ndarray) and allowed.dtype == bool:
        if allowed.shape != (num_layers, num_layers):
            raise ProblemError(
                f"allowed_boundaries as a span mask must have shape "
                f"({num_layers}, {num_layers}), got {allowed.shape}"
            )
        return allowed
    stops = np.zeros(num_layers + 1, dtype=bool)
    for stop in allowed:
        if isinstance(stop, bool) or int(stop) != stop or not 0 <= stop <= num_layers:
            raise ProblemError(
                f"allowed_boundaries must hold stage stops in 0..{num_layers}, "
                f"got {stop!r}"
            )
        stops[int(stop)] = True
    stops[num_layers] = True
    starts = stops.copy()
    starts[0] = True
    return starts[:num_layers, None] & stops[None, 1:]


def by_length(table: NDArray, fill: Any) -> NDArray:
    """``[start, end, ...]`` -> ``[start, length - 1, ...]`` (``fill`` past L)."""
    num_layers = table.shape[0]
    out = np.full(table.shape, fill, dtype=table.dtype)
    for length in range(num_layers):
        out[: num_layers - length, length] = table[
            np.arange(num_layers - length), np.arange(length, num_layers)
        ]
    return out


def _compositions(total: int, limits: tuple[int, ...]):
    """Vectors ``c`` with ``sum(c) == total`` and ``0 <= c[t] <= limits[t]``."""
    for c in itertools.product(*(range(min(n, total) + 1) for n in limits)):
        if sum(c) == total:
            yield c


def _wholes(problem: HeteroProblem, hosts: tuple[int, ...]) -> list[Whole]:
    dph = problem.cluster.devices_per_host
    speeds = problem.cluster.speeds
    units = []
    for m, (h, d) in enumerate(problem.submesh_shapes.tolist()):
        if d != dph:
            continue
        for composition in _compositions(h, hosts):
            present = tuple(t for t, c in enumerate(composition) if c)
            slowest = min(speeds[t] for t in present)
            price = tuple(t for t in present if speeds[t] == slowest)
            if h == 1:
                pairs = ((present[0], present[0]),)
            else:
                pairs = tuple(
                    (x, y)
                    for x in present
                    for y in present
                    if x != y or composition[x] >= 2
                )
            units.append(Whole(m, composition, present, price, pairs))
    return units


def _links(problem: HeteroProblem) -> tuple[NDArray, NDArray]:
    """Round trips ``2 * link.time(bytes)`` at every boundary, as
    :func:`pipedejavu.core.hetero_rules.transfer_times` computes them."""
    cluster = problem.cluster
    num_layers, num_types = problem.num_layers, problem.num_types
    intra = np.full((num_layers + 1, num_types), np.inf)
    inter = np.full((num_layers + 1, num_types, num_types), np.inf)
    for layer in range(1, num_layers):
        size = float(problem.boundary_bytes[layer - 1])
        for a in range(num_types):
            intra[layer, a] = 2.0 * cluster.intra_host[a].time(size)
            for b in range(num_types):
                inter[layer, a, b] = 2.0 * cluster.inter_host[a][b].time(size)
    return intra, inter


def _moves(grid, num_types, dph, wholes):
    num_cells = int(np.prod(grid))
    cells = np.stack(np.unravel_index(np.arange(num_cells), grid), axis=1)
    strides = np.asarray(
        [int(np.prod(grid[t + 1 :], dtype=np.int64)) for t in range(num_types)]
    )
    sentinel = num_cells * num_types
    block_move = {}
    for t in range(num_types):
        rows = []
        for width in range(1, dph + 1):
            fits = cells[:, t] + width < grid[t]
            landed = (np.arange(num_cells) + width * strides[t]) * num_types + t
            rows.append(np.where(fits, landed, sentinel))
        block_move[t] = np.asarray(rows, dtype=np.int64)
    whole_move = []
    for unit in wholes:
        shift = dph * np.asarray(unit.composition)
        fits = (cells + shift < np.asarray(grid)).all(axis=1)
        landed = np.arange(num_cells) + int(shift @ strides)
        whole_move.append(np.where(fits, landed, -1).astype(np.int64))
    return num_cells, cells.astype(np.int64), block_move, tuple(whole_move)


def build(problem: HeteroProblem, allowed: Any = None) -> Setup:
    """The :class:`Setup` of a problem restricted to ``allowed`` spans (the
    unrestricted tables are built once per problem object and cached)."""
    setup = _CACHE.get(problem)
    if setup is None:
        setup = _build(problem)
        _CACHE[problem] = setup
    if allowed is None:
        return setup
    mask = by_length(span_mask(problem, allowed), False)
    starts, lengths = np.nonzero(mask)
    rows = None
    if starts.size * 4 < mask.size:
        kept = np.unique(
            np.concatenate([starts, starts + lengths + 1, [mask.shape[0]]])
        )
        rows = np.full(mask.shape[0] + 1, kept.size, dtype=np.int64)
        rows[kept] = np.arange(kept.size)
    return setup._replace(mask=mask, spans=(starts, lengths), rows=rows)


def layer_rows(setup: Setup, first: int, last: int):
    """Index of the value rows of layers ``first..last - 1``: a slice when
    every layer is stored, else an array (a copy when read)."""
    if setup.rows is None:
        return slice(first, last)
    return setup.rows[first:last]


def layer_row(setup: Setup, layer: int) -> int:
    return layer if setup.rows is None else int(setup.rows[layer])


def num_rows(setup: Setup) -> int:
    return setup.num_layers + 1 if setup.rows is None else int(setup.rows.max()) + 1


def _full_buckets(problem: HeteroProblem, unit_cost, unit_memory) -> int:
    max_stages = min(problem.num_layers, problem.num_devices)
    limits = [
        unit_memory[key][np.isfinite(cost)] + 1 for key, (cost, _) in unit_cost.items()
    ]
    if not limits:
        return 1
    limits = np.concatenate(limits)
    binding = limits[(limits >= 1) & (limits < max_stages)]
    return int(binding.max()) + 1 if binding.size else 1


def _build(problem: HeteroProblem) -> Setup:
    cluster = problem.cluster
    dph = cluster.devices_per_host
    hosts = tuple(len(cluster.hosts_of_type(t)) for t in range(cluster.num_types))
    mask = by_length(np.ones((problem.num_layers,) * 2, dtype=bool), False)
    cost = by_length(
        np.where(problem.max_n_succ_stages >= 0, problem.compute_cost, np.inf), np.inf
    )
    memory = by_length(problem.max_n_succ_stages, -1)
    unit_cost: dict[Any, tuple[NDArray, NDArray]] = {}
    unit_memory: dict[Any, NDArray] = {}
    partial = []
    for m, (_, d) in enumerate(problem.submesh_shapes.tolist()):
        if d == dph:
            continue
        partial.append((m, d))
        for t in range(problem.num_types):
            if hosts[t]:
                table = cost[:, :, m, :, t]
                unit_cost["p", m, t] = (table, np.full(table.shape, t, np.int64))
                unit_memory["p", m, t] = memory[:, :, m, :, t]
    wholes = _wholes(problem, hosts)
    for index, unit in enumerate(wholes):
        priced = cost[:, :, unit.m][..., list(unit.price)]  # [L, L, K, P]
        which = priced.argmin(axis=3)
        unit_cost["w", index] = (
            np.take_along_axis(priced, which[..., None], 3)[..., 0],
            np.asarray(unit.price, np.int64)[which],
        )
        unit_memory["w", index] = memory[:, :, unit.m][..., list(unit.present)].min(
            axis=3
        )
    intra, inter = _links(problem)
    diagonal = inter[:, np.arange(problem.num_types), np.arange(problem.num_types)]
    grid = tuple(n * dph + 1 for n in hosts)
    num_cells, cells, block_move, whole_move = _moves(
        grid, problem.num_types, dph, wholes
    )
    return Setup(
        num_layers=problem.num_layers,
        num_types=problem.num_types,
        dph=dph,
        hosts=hosts,
        grid=grid,
        num_cells=num_cells,
        cells=cells,
        partial=tuple(partial),
        wholes=tuple(wholes),
        unit_cost=unit_cost,
        unit_memory=unit_memory,
        intra=intra,
        inter=inter,
        conflict=intra > diagonal,
        mask=mask,
        block_move=block_move,
        whole_move=whole_move,
        spans=np.nonzero(mask),
        rows=None,
        full_buckets=_full_buckets(problem, unit_cost, unit_memory),
    )


def stage_table(
    setup: Setup, key: Any, cap: float, threshold: int
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """f64[L, L] a unit's least cost by (start, length - 1) over configs with
    memory rule ``>= threshold`` and cost ``<= cap`` (inf: none), and
    i64[L, L] the config."""
    cost, _ = setup.unit_cost[key]
    memory = setup.unit_memory[key]
    starts, lengths = setup.spans
    if starts.size * 4 < setup.mask.size:  # few spans: only those
        entries = cost[starts, lengths]
        admitted = np.where(
            (memory[starts, lengths] >= threshold) & (entries <= cap), entries, np.inf
        )
        table = np.full(setup.mask.shape, np.inf)
        config = np.zeros(setup.mask.shape, dtype=np.int64)
        config[starts, lengths] = admitted.argmin(axis=1)
        table[starts, lengths] = admitted.min(axis=1)
        return table, config
    admitted = np.where(
        setup.mask[:, :, None] & (memory >= threshold) & (cost <= cap), cost, np.inf
    )
    config = admitted.argmin(axis=2)
    return np.take_along_axis(admitted, config[..., None], 2)[..., 0], config


def candidate_caps(setup: Setup, smallest: float) -> NDArray[np.float64]:
    """Sorted distinct stage costs and link times ``>= smallest``: every plan's
    bottleneck is one of them."""
    if setup.rows is None:
        values = [
            cost[setup.mask[:, :, None] & np.isfinite(cost)]
            for cost, _ in setup.unit_cost.values()
        ]
    else:
        starts, lengths = setup.spans
        values = [cost[starts, lengths].ravel() for cost, _ in setup.unit_cost.values()]
        values = [v[np.isfinite(v)] for v in values]
    values += [setup.intra[np.isfinite(setup.intra)]]
    values += [setup.inter[np.isfinite(setup.inter)]]
    values = np.unique(np.concatenate(values))
    return values[values >= smallest]
