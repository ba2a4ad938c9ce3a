"""Stage groups and prefix-cover tables: the bounds of the label-setting DP.

:mod:`pipedejavu.search.alpa.labels` drops a label when its suffix plus the best
cover of the remaining prefix cannot beat the cap. This module builds what that
test reads: the stage candidates grouped by end layer (:class:`StageGroups`), and
per ``theta`` the least sum / least slowest stage of any cover of each prefix
with exactly ``r`` devices (:class:`PrefixTables`), with up to :data:`MAX_LEVELS`
follower levels of the memory rule.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import Problem

__all__ = [
    "MAX_LEVELS",
    "CheapestByFollowers",
    "PrefixTables",
    "StageGroups",
    "cheapest_config",
    "follower_levels",
    "level_prefix_tables",
    "plain_prefix_tables",
    "prefix_tables",
    "row_min",
    "stage_groups",
    "times_or_inf",
]


class StageGroups(NamedTuple):
    """Stage candidates ``(start, end, submesh)`` sorted by end layer.

    ``cost[g, k]`` is inf where config ``k`` is unprofiled, never fits or is
    above the cap's ``theta``; ``limit[g, k]`` its ``max_n_succ_stages``.
    ``by_end[e]`` is the first group ending at layer ``e`` (inclusive).
    """

    start: NDArray[np.int64]  # [G]
    end: NDArray[np.int64]  # [G]
    submesh: NDArray[np.int64]  # [G]
    size: NDArray[np.int64]  # [G]
    cost: NDArray[np.float64]  # [G, K] seconds
    limit: NDArray[np.int64]  # [G, K]
    by_end: NDArray[np.int64]  # [L + 1]

    def below(self, theta: float, num_layers: int) -> StageGroups:
        """The groups with configs costing at most ``theta`` seconds."""
        keep = np.flatnonzero(row_min(self.cost)[0] <= theta)
        cost = self.cost.take(keep, axis=0)
        end = self.end.take(keep)
        return StageGroups(
            self.start.take(keep),
            end,
            self.submesh.take(keep),
            self.size.take(keep),
            np.where(cost <= theta, cost, np.inf),
            self.limit.take(keep, axis=0),
            np.searchsorted(end, np.arange(num_layers + 1)),
        )


def stage_groups(problem: Problem) -> StageGroups:
    table = problem.compute_cost
    memory = problem.max_n_succ_stages
    num_layers, num_submeshes = problem.num_layers, problem.num_submeshes
    sizes = problem.submesh_sizes
    fits = np.isfinite(table) & (memory >= 0)
    # Any config fits (an or over the few configs: faster than any(axis=3)).
    fits_any = fits[..., 0].copy()
    for config in range(1, problem.num_configs):
        fits_any |= fits[..., config]
    # By end, then submesh size: the groups a label has room for are a prefix.
    by_size = np.argsort(sizes, kind="stable")
    if np.unique(sizes).size == sizes.size:
        # Distinct sizes: (end, size, start) order straight from nonzero.
        ends, ranks, starts = np.nonzero(fits_any.transpose(1, 2, 0)[:, by_size])
        submeshes = by_size[ranks]
    else:
        starts, ends, submeshes = np.nonzero(fits_any)
        order = np.lexsort((sizes[submeshes], ends))
        starts, ends, submeshes = starts[order], ends[order], submeshes[order]
    flat = (starts * num_layers + ends) * num_submeshes + submeshes
    num_configs = problem.num_configs
    fitting = fits.reshape(-1, num_configs).take(flat, axis=0)
    return StageGroups(
        start=starts,
        end=ends,
        submesh=submeshes,
        size=sizes[submeshes],
        cost=np.where(
            fitting, table.reshape(-1, num_configs).take(flat, axis=0), np.inf
        ),
        limit=memory.reshape(-1, num_configs).take(flat, axis=0),
        by_end=np.searchsorted(ends, np.arange(num_layers + 1)),
    )


def row_min(
    values: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Least entry of each row of f64[G, K] and its column (i64[G], smallest on
    ties, as ``argmin``): a loop over the few columns, much faster than a
    reduction along a short last axis."""
    least = values[:, 0].copy()
    column = np.zeros(values.shape[0], np.int64)
    for index in range(1, values.shape[1]):
        candidate = values[:, index]
        better = candidate < least
        least = np.where(better, candidate, least)
        column[better] = index
    return least, column


def cheapest_config(
    cost: NDArray[np.float64], limit: NDArray[np.int64], followers: int
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Cheapest config with ``followers`` stages after it (f64[G] seconds, inf:
    none fits) and that config (i64[G], smallest on ties)."""
    return row_min(np.where(limit >= followers, cost, np.inf))


class CheapestByFollowers:
    """:func:`cheapest_config` of a group set per follower count, computed once per
    distinct answer (it changes only where a memory limit is crossed)."""

    def __init__(self, groups: StageGroups):
        self.groups = groups
        self.limits = np.unique(groups.limit[np.isfinite(groups.cost)])
        self.known: dict[int, tuple[NDArray[np.float64], NDArray[np.int64]]] = {}

    def __call__(self, followers: int) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        key = int(np.searchsorted(self.limits, followers))  # limits below it
        if key not in self.known:
            self.known[key] = cheapest_config(
                self.groups.cost, self.groups.limit, followers
            )
        return self.known[key]


#: Most follower levels the prefix tables distinguish (the last one lumps
#: every larger count); their cost grows linearly with it.
MAX_LEVELS = 8


def follower_levels(problem: Problem, groups: StageGroups) -> int:
    """Follower levels that matter: one per binding memory limit (limits below
    the largest possible follower count), plus one, at most MAX_LEVELS."""
    most = min(problem.num_layers, problem.num_devices) - 1
    limits = groups.limit[np.isfinite(groups.cost)]
    binding = limits[limits < most]
    return int(min(binding.max() + 2, MAX_LEVELS)) if binding.size else 1


class PrefixTables(NamedTuple):
    """Prefix covers under a ``theta`` and the bounds they give.

    ``least_sum[k, i, r]`` / ``least_max[k, i, r]``: least sum / least slowest
    stage (seconds) of a cover of layers ``0..i-1`` with exactly ``r`` devices
    whose last stage has at least ``k + 1`` stages after it, the one before it
    ``k + 2``, and so on (level ``R - 1`` lumps every count ``>= R``), each
    stage with the cheapest config its memory admits; ``sigma``: least
    stage-latency sum of a whole plan; ``lower``: least cost of a whole plan
    (both relaxed, inf: none).
    """

    groups: StageGroups
    least_sum: NDArray[np.float64]  # [R, L + 1, D + 1]
    least_max: NDArray[np.float64]  # [R, L + 1, D + 1]
    sigma: float
    lower: float


def level_prefix_tables(
    problem: Problem, groups: StageGroups, levels: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``least_sum`` and ``least_max`` of :class:`PrefixTables`
    (f64[R, L + 1, D + 1])."""
    num_layers, num_devices = problem.num_layers, problem.num_devices
    width = num_devices + 1
    sizes = problem.submesh_sizes
    num_submeshes = sizes.size
    pad = int(sizes.max())
    # least_*[k, i, pad + r]: r devices (columns < pad: inf).
    shape = (levels, num_layers + 1, pad + width)
    least_sum, least_max = np.full(shape, np.inf), np.full(shape, np.inf)
    least_sum[:, 0, pad] = least_max[:, 0, pad] = 0.0
    # Row (m, i) of shifted_*[k] is least_*[k, i] shifted right by submesh m's
    # size: column r holds r - size(m) devices, so a stage on m that starts at
    # layer i reads its prefix row as one contiguous gather.
    shifted_sum = np.full((levels, num_submeshes * (num_layers + 1), width), np.inf)
    shifted_max = np.full_like(shifted_sum, np.inf)
    shifted_sum[:, np.arange(num_submeshes) * (num_layers + 1)] = np.where(
        np.arange(width)[None, :] == sizes[:, None], 0.0, np.inf
    )[None]
    shifted_max[:, np.arange(num_submeshes) * (num_layers + 1)] = shifted_sum[
        :, np.arange(num_submeshes) * (num_layers + 1)
    ]
    columns = np.arange(width)[None, :] + pad - sizes[:, None]  # [M, W]
    rows_of = np.arange(num_submeshes) * (num_layers + 1)  # [M]
    # cost[k, g]: with k + 1 followers; the stage before follows at level k + 1.
    cost = np.stack(
        [cheapest_config(groups.cost, groups.limit, k + 1)[0] for k in range(levels)]
    )
    usable = np.isfinite(cost).any(axis=0)
    row = groups.submesh * (num_layers + 1) + groups.start  # [G]
    # Level k reads level k + 1 (the last level reads itself).
    src_sum = shifted_sum[1:] if levels > 1 else shifted_sum
    src_max = shifted_max[1:] if levels > 1 else shifted_max
    for end in range(num_layers):
        first, last = groups.by_end[end], groups.by_end[end + 1]
        keep = np.flatnonzero(usable[first:last]) + first
        if keep.size == 0:
            continue
        index = row[keep]
        costs = cost[:, keep, None]  # [R, G, 1]
        sums = np.take(src_sum, index, axis=1)  # [R', G, W]
        maxes = np.take(src_max, index, axis=1)
        out_sum, out_max = least_sum[:, end + 1, pad:], least_max[:, end + 1, pad:]
        if levels > 1:
            out_sum[:-1] = (sums + costs[:-1]).min(axis=1)
            out_max[:-1] = np.maximum(maxes, costs[:-1]).min(axis=1)
            out_sum[-1] = (sums[-1] + costs[-1]).min(axis=0)
            out_max[-1] = np.maximum(maxes[-1], costs[-1]).min(axis=0)
        else:
            out_sum[:] = (sums + costs).min(axis=1)
            out_max[:] = np.maximum(maxes, costs).min(axis=1)
        target = rows_of + end + 1
        shifted_sum[:, target] = least_sum[:, end + 1][:, columns]
        shifted_max[:, target] = least_max[:, end + 1][:, columns]
    return least_sum[:, :, pad:], least_max[:, :, pad:]


def plain_prefix_tables(
    problem: Problem, groups: StageGroups
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """:func:`level_prefix_tables` with one level (f64[1, L + 1, D + 1]); the
    sum and slowest-stage tables are stacked so each end layer is a few calls."""
    num_layers, num_devices = problem.num_layers, problem.num_devices
    width = num_devices + 1
    sizes = problem.submesh_sizes
    num_submeshes = sizes.size
    pad = int(sizes.max())
    # least[0 / 1, i, pad + r]: least sum / slowest stage (columns < pad: inf).
    least = np.full((2, num_layers + 1, pad + width), np.inf)
    least[:, 0, pad] = 0.0
    # Row i * M + m of shifted[t] is least[t, i] shifted right by submesh m's
    # size (column r holds r - size(m) devices): a stage on m that starts at
    # layer i reads its prefix as one row, and a finished layer's rows are one
    # contiguous block.
    shifted = np.full((2, (num_layers + 1) * num_submeshes, width), np.inf)
    shifted[:, :num_submeshes] = np.where(
        np.arange(width)[None, :] == sizes[:, None], 0.0, np.inf
    )[None]
    columns = (np.arange(width)[None, :] + pad - sizes[:, None]).ravel()  # [M * W]
    cost, _ = cheapest_config(groups.cost, groups.limit, 1)
    usable = np.flatnonzero(np.isfinite(cost))
    cost = cost[usable, None]  # [G, 1]
    row = (groups.start * num_submeshes + groups.submesh)[usable]  # [G]
    by_end = np.searchsorted(groups.end[usable], np.arange(num_layers + 1)).tolist()
    block = shifted.reshape(2, num_layers + 1, num_submeshes * width)
    for end in range(num_layers):
        first, last = by_end[end], by_end[end + 1]
        if first == last:
            continue
        prefix = shifted.take(row[first:last], axis=1)  # [2, G, W]
        np.add(prefix[0], cost[first:last], out=prefix[0])
        np.maximum(prefix[1], cost[first:last], out=prefix[1])
        prefix.min(axis=1, out=least[:, end + 1, pad:])
        np.take(least[:, end + 1], columns, axis=1, out=block[:, end + 1], mode="clip")
    return least[:1, :, pad:], least[1:, :, pad:]


def prefix_tables(problem: Problem, groups: StageGroups, levels: int) -> PrefixTables:
    if levels == 1:
        least_sum, least_max = plain_prefix_tables(problem, groups)
    else:
        least_sum, least_max = level_prefix_tables(problem, groups, levels)
    num_layers, num_devices = problem.num_layers, problem.num_devices
    # The last stage (no follower) on top of every prefix.
    first, last = groups.by_end[num_layers - 1], groups.by_end[num_layers]
    final, _ = cheapest_config(groups.cost[first:last], groups.limit[first:last], 0)
    left = num_devices - groups.size[first:last]
    ok = left >= 0
    start, left, final = groups.start[first:last][ok], left[ok], final[ok]
    sums = final + least_sum[0, start, left]
    slowest = np.maximum(final, least_max[0, start, left])
    lowers = sums + times_or_inf(problem.num_microbatches - 1, slowest)
    return PrefixTables(
        groups,
        least_sum,
        least_max,
        float(sums.min(initial=np.inf)),
        float(lowers.min(initial=np.inf)),
    )


def times_or_inf(factor: int, value: NDArray[np.float64]) -> NDArray[np.float64]:
    """``factor * value`` with inf kept inf when the factor is 0."""
    if factor > 0:
        return factor * value
    return np.where(np.isfinite(value), 0.0, np.inf)
