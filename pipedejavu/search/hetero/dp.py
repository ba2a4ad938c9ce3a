"""One cap of the exact search: the relaxed DP over blocks and whole stages.

**Blocks.** A *block* is a maximal run of consecutive partial stages of one
type on one host (the transfers inside it use the intra-host link). Every valid
plan is a sequence of *units* -- blocks and whole stages -- and the transfer
into a unit always uses an inter-host link (consecutive units share no host),
chosen by the type the previous unit ends on and the type the unit starts on.

**The relaxation R.** The DP state before layer ``i`` is ``(b, u, a)``: the
memory bucket ``b`` of the next stage (Alpa's rule ``S - 1 - s <= max_n_succ``,
lumped as in :mod:`pipedejavu.search.alpa.exact`: bucket ``b < NB`` means exactly
``b`` stages remain, ``NB`` means at least ``NB``), ``u`` the devices used of
every type (whole stages count their hosts' devices) and ``a`` the type the
previous unit ends on. A block of type ``t`` and width ``W <= devices_per_host``
moves ``u_t`` by ``W``; a whole stage moves ``u`` by its composition; the plan
ends with every ``u_t`` full. R forgets *which* hosts hold the blocks, so it
admits every valid plan at its exact cost, and possibly sequences of blocks
that cannot be packed onto the hosts: its optimum is a lower bound, attained
whenever its plan packs (:mod:`pipedejavu.search.hetero.place`).

**Block tables.** ``P[W, b'][i, d]`` is the least cost (``combine`` of its
stage costs and intra-host round trips) of a block of total width ``W`` on
layers ``i..i + d`` whose first stage is in bucket ``b_in`` and after which the
next stage is in bucket ``b'``: a DP over widths, one banded min-plus product
per prefix width (batched over the stage widths), ``O(L e d)`` for spans of at
most ``e`` (block) and ``d`` (stage) layers under the cap.

**Cost.** One pass is ``Theta(L E (T dph + W) prod_t (N_t dph + 1))`` for ``E``
span lengths under the cap and ``W`` whole units: the canonical DP it replaces
had the partial submeshes per type where R has ``dph`` block widths.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.search.hetero.units import (
    Setup,
    layer_row,
    layer_rows,
    num_rows,
    stage_table,
)

__all__ = ["Relaxed", "Tables", "Unit", "relaxed_tables", "solve_relaxed"]


class Interrupted(Exception):
    """The deadline passed during a pass."""


class Unit(NamedTuple):
    """One unit of a relaxed plan.

    ``kind`` is ``"block"`` (``type`` its type, ``width`` its devices,
    ``stages`` the ``(start, stop, m, config)`` of its stages) or ``"whole"``
    (``whole`` the index into ``Setup.wholes``, ``stages`` its one stage).
    ``price`` is the type pricing the stages, ``first``/``last`` the types of
    the unit's first and last host; ``buckets`` each stage's memory bucket.
    """

    kind: str
    type: int
    width: int
    whole: int
    stages: tuple[tuple[int, int, int, int], ...]
    price: int
    first: int
    last: int
    buckets: tuple[int, ...]


class _Stack(NamedTuple):
    """Unit rows read together by the pass: ``table`` f64[R, L, L] by (start,
    length - 1), ``targets`` i64[R, G] the state each row lands on from each
    cell, ``lo``/``hi`` per start the band of lengths with finite entries."""

    table: NDArray[np.float64]
    targets: NDArray[np.int64]
    lo: NDArray[np.int64]
    hi: NDArray[np.int64]


class Tables(NamedTuple):
    """The tables of one ``(cap, num_buckets, combine)``.

    ``stage[key][b]``: (f64[L, L] cost, i64[L, L] config) of a unit's stage
    in bucket b (index 0 unused); ``blocks[(t, b_in)]``: ``{(W, b'): f64[L,
    L]}``; ``block_stacks[(t, b_in, b')]``: (widths, :class:`_Stack`);
    ``whole_stacks[(b_in, b')]``: (rows ``(unit, y)``, :class:`_Stack`, per
    first type x the rows it may enter); ``intra``, ``inter``: the link tables
    with entries above the cap set to inf; ``slices``: per block width of a
    type (``("b", t, W)``) and whole unit (``("w", index)``) the grid slices
    it leaves from and lands on; ``entries_of[(index, y)]``: the first types
    of a whole unit that ends on type y.
    """

    cap: float
    num_buckets: int
    combine: Any
    stage: dict
    blocks: dict
    block_stacks: dict
    whole_stacks: dict
    intra: NDArray[np.float64]
    inter: NDArray[np.float64]
    slices: dict
    entries_of: dict


def following(bucket: int, num_buckets: int) -> tuple[int, ...]:
    """Buckets the stage after one in ``bucket`` may be in (0: none)."""
    return (bucket - 1,) if bucket < num_buckets else (bucket, bucket - 1)


def _extend(entering, stages, combine):
    """``out[n, i, e + d] = min combine(entering[i, e], stages[n, i + e, d])``:
    blocks grown by one stage (``stages`` f64[N, L, L] by (start, length - 1))."""
    num_layers = entering.shape[0]
    out = np.full(stages.shape, np.inf)
    lengths = np.flatnonzero(np.isfinite(stages).any(axis=(0, 1)))
    if lengths.size == 0:
        return out
    band = int(lengths[-1]) + 1
    for e in np.flatnonzero(np.isfinite(entering).any(axis=0)).tolist():
        width = min(band, num_layers - e)
        if width <= 0:
            continue
        values = combine(
            entering[: num_layers - e, e][None, :, None],
            stages[:, e:, :width],
        )
        view = out[:, : num_layers - e, e : e + width]
        np.minimum(view, values, out=view)
    return out


def _band(table: NDArray[np.float64]) -> tuple[NDArray, NDArray]:
    """i64[R, L] per row and start: the first and last length index with a
    finite entry (``L`` and -1 when none)."""
    finite = np.isfinite(table)
    num_layers = finite.shape[-1]
    has = finite.any(axis=-1)
    lo = np.where(has, finite.argmax(axis=-1), num_layers)
    hi = np.where(has, num_layers - 1 - finite[..., ::-1].argmax(axis=-1), -1)
    return lo, hi


def _block_tables(setup, stage, intra, num_buckets, combine, deadline):
    blocks = {}
    num_layers = setup.num_layers
    reach = np.minimum(
        np.arange(num_layers)[:, None] + np.arange(num_layers)[None, :], num_layers
    )  # [i, e]: the boundary before the stage that starts at i + e
    for t in range(setup.num_types):
        if not setup.hosts[t] or not setup.partial:
            continue
        for first in range(1, num_buckets + 1):
            if time.perf_counter() > deadline:
                raise Interrupted
            table: dict[tuple[int, int], NDArray] = {}
            for m, width in setup.partial:
                cost = stage["p", m, t][first][0]
                for after in following(first, num_buckets):
                    key = (width, after)
                    table[key] = np.minimum(table.get(key, np.inf), cost)
            for total in range(1, setup.dph):
                for bucket in range(1, num_buckets + 1):
                    prefix = table.get((total, bucket))
                    if prefix is None or not np.isfinite(prefix).any():
                        continue
                    fitting = [
                        (m, w) for m, w in setup.partial if total + w <= setup.dph
                    ]
                    if not fitting:
                        continue
                    entering = np.full_like(prefix, np.inf)
                    entering[:, 1:] = combine(prefix[:, :-1], intra[reach[:, 1:], t])
                    grown = _extend(
                        entering,
                        np.stack([stage["p", m, t][bucket][0] for m, _ in fitting]),
                        combine,
                    )
                    for (_, w), values in zip(fitting, grown, strict=True):
                        for after in following(bucket, num_buckets):
                            key = (total + w, after)
                            table[key] = np.minimum(table.get(key, np.inf), values)
            blocks[t, first] = {
                key: value for key, value in table.items() if np.isfinite(value).any()
            }
    return blocks


def relaxed_tables(
    setup: Setup, cap: float, num_buckets: int, combine: Any, deadline: float
) -> Tables:
    """Stage tables, block tables, the pass's stacks and capped links."""
    stage = {
        key: [None]
        + [
            stage_table(setup, key, cap, bucket - 1)
            for bucket in range(1, num_buckets + 1)
        ]
        for key in setup.unit_cost
    }
    intra = np.where(setup.intra <= cap, setup.intra, np.inf)
    inter = np.where(setup.inter <= cap, setup.inter, np.inf)
    blocks = _block_tables(setup, stage, intra, num_buckets, combine, deadline)
    block_stacks = {}
    for (t, first), table in blocks.items():
        for after in range(num_buckets + 1):
            widths = sorted(w for w, a in table if a == after)
            if widths:
                stack = np.stack([table[w, after] for w in widths])
                targets = setup.block_move[t][np.asarray(widths) - 1]
                block_stacks[t, first, after] = (
                    np.asarray(widths),
                    _Stack(stack, targets, *_band(stack)),
                )
    whole_stacks = {}
    num_types = setup.num_types
    for first in range(1, num_buckets + 1):
        for after in following(first, num_buckets):
            rows, tables, targets = [], [], []
            for index, unit in enumerate(setup.wholes):
                cost = stage["w", index][first][0]
                if not np.isfinite(cost).any():
                    continue
                moved = setup.whole_move[index]
                for y in sorted({y for _, y in unit.pairs}):
                    rows.append((index, y))
                    tables.append(cost)
                    targets.append(
                        np.where(moved >= 0, moved * num_types + y, setup.sentinel)
                    )
            if not rows:
                continue
            stack = np.stack(tables)
            entries = [
                (
                    x,
                    np.asarray(
                        [
                            r
                            for r, (index, y) in enumerate(rows)
                            if (x, y) in setup.wholes[index].pairs
                        ]
                    ),
                )
                for x in range(num_types)
            ]
            whole_stacks[first, after] = (
                rows,
                _Stack(stack, np.asarray(targets), *_band(stack)),
                [(x, r) for x, r in entries if r.size],
            )
    slices = {
        ("b", t, w): _grid_slices(
            setup, tuple(w if axis == t else 0 for axis in range(num_types))
        )
        for t in range(num_types)
        for w in range(1, setup.dph + 1)
    }
    entries_of = {}
    for index, unit in enumerate(setup.wholes):
        slices["w", index] = _grid_slices(
            setup, tuple(setup.dph * c for c in unit.composition)
        )
        for x, y in unit.pairs:
            entries_of.setdefault((index, y), []).append(x)
    return Tables(
        cap,
        num_buckets,
        combine,
        stage,
        blocks,
        block_stacks,
        whole_stacks,
        intra,
        inter,
        slices,
        entries_of,
    )


def _window(setup: Setup, lo: int, hi: int, after: int, start: int):
    """The lengths ``lo..hi`` a row may take from ``start`` (None: none)."""
    if after == 0:  # the last stage must end at layer L - 1
        last = setup.num_layers - 1 - start
        if not lo <= last <= hi:
            return None
        lo = hi = last
    return (lo, hi) if lo <= hi else None


def _row_windows(setup: Setup, stack: _Stack, after: int, start: int):
    """``(row, lo, hi)`` for each row of ``stack`` with lengths it may take
    from ``start`` (:func:`_window` of the row's band), in row order."""
    lows, highs = stack.lo[:, start].tolist(), stack.hi[:, start].tolist()
    for r, (lo, hi) in enumerate(zip(lows, highs, strict=True)):
        window = _window(setup, lo, hi, after, start)
        if window is not None:
            yield r, *window


def _grid_slices(setup: Setup, shift) -> tuple[tuple, tuple]:
    """Grid slices a unit moving ``shift`` leaves from and lands on."""
    source = tuple(slice(0, n - s) for n, s in zip(setup.grid, shift, strict=True))
    target = tuple(slice(s, None) for s in shift)
    return source, target


def _unit_values(setup: Setup, tables: Tables, values, start: int):
    """f64[NB + 1, *grid, T]: the best value of a unit starting at ``start`` by
    its first bucket, the cell and its first type (transfer into it excluded).
    Each row reads its own band of lengths, on views of ``values``."""
    combine = tables.combine
    grid = values[..., : setup.sentinel].reshape(
        values.shape[:2] + setup.grid + (setup.num_types,)
    )
    best = np.full((tables.num_buckets + 1,) + setup.grid + (setup.num_types,), np.inf)
    ones = (1,) * setup.num_types
    for (t, first, after), (widths, stack) in tables.block_stacks.items():
        width_of = widths.tolist()
        for r, lo, hi in _row_windows(setup, stack, after, start):
            source, target = tables.slices["b", t, width_of[r]]
            layers = layer_rows(setup, start + lo + 1, start + hi + 2)
            rows = grid[(after, layers) + target + (t,)]
            cost = stack.table[r, start, lo : hi + 1].reshape((-1,) + ones)
            view = best[(first,) + source + (t,)]
            np.minimum(view, combine(cost, rows).min(axis=0), out=view)
    for (first, after), (rows_of, stack, _) in tables.whole_stacks.items():
        for r, lo, hi in _row_windows(setup, stack, after, start):
            index, y = rows_of[r]
            source, target = tables.slices["w", index]
            layers = layer_rows(setup, start + lo + 1, start + hi + 2)
            rows = grid[(after, layers) + target + (y,)]
            cost = stack.table[r, start, lo : hi + 1].reshape((-1,) + ones)
            candidate = combine(cost, rows).min(axis=0)
            for x in tables.entries_of[index, y]:
                view = best[(first,) + source + (x,)]
                np.minimum(view, candidate, out=view)
    return best.reshape(tables.num_buckets + 1, setup.num_cells, setup.num_types)


def _pass(setup: Setup, tables: Tables, deadline: float):
    """The backward pass: ``values`` f64[NB + 1, rows, G T + 1] (the row of
    layer i by :func:`~pipedejavu.search.hetero.units.layer_row`: before
    layer i, next stage in bucket b, state ``cell * T + a``: previous unit
    ending on type a; the transfer into layer i included; the last state
    always inf) and the root values f64[NB + 1, T] (first stage in bucket b,
    first type x)."""
    combine = tables.combine
    num_layers, num_types = setup.num_layers, setup.num_types
    num_buckets, num_cells = tables.num_buckets, setup.num_cells
    values = np.full((num_buckets + 1, num_rows(setup), setup.sentinel + 1), np.inf)
    full = (num_cells - 1) * num_types
    values[0, layer_row(setup, num_layers), full : full + num_types] = 0.0
    root = np.full((num_buckets + 1, num_types), np.inf)
    for start in np.flatnonzero(setup.mask.any(axis=1))[::-1].tolist():
        if time.perf_counter() > deadline:
            raise Interrupted
        best = _unit_values(setup, tables, values, start)
        if start == 0:
            root = best[:, 0, :]
            break
        entered = combine(best[:, :, None, :], tables.inter[start][None, None])
        values[:, layer_row(setup, start), : setup.sentinel] = entered.min(
            axis=-1
        ).reshape(num_buckets + 1, -1)
    return values, root


def _union(setup: Setup, stack: _Stack, after: int, start: int):
    """The union of a stack's bands at ``start``."""
    lo, hi = int(stack.lo[:, start].min()), int(stack.hi[:, start].max())
    return _window(setup, lo, hi, after, start)


def _options(setup: Setup, tables: Tables, values, start: int, cell: int):
    """Every unit from ``start`` at one cell, with its candidate values (the
    same arithmetic as :func:`_unit_values`): ``(kind, key, first, after, x,
    y, lengths f64, candidates f64)``."""
    combine = tables.combine
    found = []
    for (t, first, after), (widths, stack) in tables.block_stacks.items():
        window = _union(setup, stack, after, start)
        if window is None:
            continue
        lo, hi = window
        rows = values[after, layer_rows(setup, start + lo + 1, start + hi + 2)]
        for r, width in enumerate(widths.tolist()):
            candidate = combine(
                stack.table[r, start, lo : hi + 1], rows[:, stack.targets[r, cell]]
            )
            found.append(("block", (t, width), first, after, t, t, lo, candidate))
    for (first, after), (rows_of, stack, _) in tables.whole_stacks.items():
        window = _union(setup, stack, after, start)
        if window is None:
            continue
        lo, hi = window
        rows = values[after, layer_rows(setup, start + lo + 1, start + hi + 2)]
        for r, (index, y) in enumerate(rows_of):
            candidate = combine(
                stack.table[r, start, lo : hi + 1], rows[:, stack.targets[r, cell]]
            )
            for x, yy in setup.wholes[index].pairs:
                if yy == y:
                    found.append(("whole", index, first, after, x, y, lo, candidate))
    return found


def _trace(setup: Setup, tables: Tables, values, root) -> list[Unit]:
    """An optimal relaxed plan by recomputation (same operations as the pass)."""
    combine = tables.combine
    num_types = setup.num_types
    bucket, x = (int(v) for v in np.unravel_index(int(np.argmin(root)), root.shape))
    target = float(root[bucket, x])
    start, cell = 0, 0
    units: list[Unit] = []
    while True:
        chosen = None
        for kind, key, first, after, xx, y, lo, candidate in _options(
            setup, tables, values, start, cell
        ):
            if first != bucket or xx != x:
                continue
            hits = np.flatnonzero(candidate == target)
            if hits.size:
                chosen = (kind, key, after, y, start + lo + int(hits[0]))
                break
        if chosen is None:  # pragma: no cover - internal invariant
            raise RuntimeError("tracing lost the optimal relaxed plan")
        kind, key, after, y, end = chosen
        if kind == "block":
            t, width = key
            stages, buckets = trace_block(
                setup, tables, t, bucket, width, after, start, end
            )
            units.append(Unit("block", t, width, -1, stages, t, t, t, buckets))
            landed = setup.block_move[t][width - 1, cell] // num_types
        else:
            units.append(whole_unit(setup, tables, key, bucket, x, y, start, end))
            landed = int(setup.whole_move[key][cell])
        start, cell = end + 1, int(landed)
        if start == setup.num_layers:
            return units
        target = float(values[after, layer_row(setup, start), cell * num_types + y])
        best = np.full(num_types, np.inf)
        for _, _, first, _, xx, _, _, candidate in _options(
            setup, tables, values, start, cell
        ):
            if first == after and candidate.size:
                best[xx] = min(best[xx], candidate.min())
        entered = combine(best, tables.inter[start, y])
        x = int(np.flatnonzero(entered == target)[0])
        target, bucket = float(best[x]), after


def whole_unit(setup, tables, index, bucket, x, y, start, end) -> Unit:
    """The :class:`Unit` of whole unit ``index`` on layers ``start..end``."""
    whole = setup.wholes[index]
    config = int(tables.stage["w", index][bucket][1][start, end - start])
    price = int(setup.unit_cost["w", index][1][start, end - start, config])
    return Unit(
        "whole",
        price,
        setup.dph * sum(whole.composition),
        index,
        ((start, end + 1, whole.m, config),),
        price,
        x,
        y,
        (bucket,),
    )


def trace_block(setup, tables, t, first, width, after, start, end):
    """The stages and buckets of a block whose table value is attained
    (recomputation, the arithmetic of :func:`_block_tables`)."""
    combine = tables.combine
    table = tables.blocks[t, first]
    target = table[width, after][start, end - start]
    stages: list[tuple[int, int, int, int]] = []
    buckets: list[int] = []
    while True:
        if after in following(first, tables.num_buckets):
            for m, w in setup.partial:
                cost, config = tables.stage["p", m, t][first]
                if w == width and cost[start, end - start] == target:
                    stages.append((start, end + 1, m, int(config[start, end - start])))
                    buckets.append(first)
                    return tuple(stages[::-1]), tuple(buckets[::-1])
        found = None
        for m, w in setup.partial:
            if w >= width:
                continue
            for bucket in range(1, tables.num_buckets + 1):
                prefix = table.get((width - w, bucket))
                if prefix is None or after not in following(bucket, tables.num_buckets):
                    continue
                cost, config = tables.stage["p", m, t][bucket]
                for k in range(start + 1, end + 1):
                    entering = combine(prefix[start, k - 1 - start], tables.intra[k, t])
                    if combine(entering, cost[k, end - k]) == target:
                        found = (m, w, bucket, k, int(config[k, end - k]))
                        break
                if found:
                    break
            if found:
                break
        if found is None:  # pragma: no cover - internal invariant
            raise RuntimeError("tracing lost the optimal block")
        m, w, bucket, k, config = found
        stages.append((k, end + 1, m, config))
        buckets.append(bucket)
        target = table[width - w, bucket][start, k - 1 - start]
        width, after, end = width - w, bucket, k - 1


class Relaxed(NamedTuple):
    """One pass: ``value`` (inf: no relaxed plan), the ``units`` of an optimal
    relaxed plan, the ``tables`` and ``values`` (see :func:`_pass`)."""

    value: float
    units: list[Unit] | None
    tables: Tables
    values: NDArray[np.float64]


def solve_relaxed(
    setup: Setup,
    cap: float,
    combine: Any,
    num_buckets: int,
    deadline: float = math.inf,
) -> Relaxed:
    """R under ``cap`` (min-sum with ``np.add``, min-max with ``np.maximum``)."""
    tables = relaxed_tables(setup, cap, num_buckets, combine, deadline)
    values, root = _pass(setup, tables, deadline)
    if not np.isfinite(root).any():
        return Relaxed(math.inf, None, tables, values)
    units = _trace(setup, tables, values, root)
    return Relaxed(float(root.min()), units, tables, values)
