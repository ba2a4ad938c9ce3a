"""The planners users would otherwise pick: uniform, greedy balance, random search.

None of these is exact; each returns a valid plan built with
:func:`pipedejavu.core.problem.make_plan` (so ``plan.cost == evaluate(problem, plan)``)
and raises :class:`~pipedejavu.core.problem.InfeasibleProblemError` with a reason when
it finds none.

* :func:`uniform` — the manual plan of Megatron/Alpa's "uniform" mode: ``S``
  stages of ``floor(L/S)`` or ``ceil(L/S)`` layers on equal submeshes of ``D/S``
  devices. It returns the best plan of that family (exactly: every stage count,
  every placement of the longer stages, every shape of that size and config).
* :func:`greedy` — torchgpipe-style balance: per-layer costs from the table's
  single-layer entries, the classical linear partition (least bottleneck) into
  ``S`` blocks, equal submeshes; scored on the true table.
* :func:`random_search` — uniform random valid plans; the best of the samples.

Memory rule everywhere: stage ``s`` of ``S`` may take config ``k`` only if
``S - 1 - s <= max_n_succ_stages``; each stage takes its cheapest admissible
config (which minimizes ``sum + (B - 1) * max`` for fixed spans and submeshes).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time

import numpy as np

from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, make_plan
from pipedejavu.search.alpa.caps import explain_infeasible, min_sum_plan

__all__ = ["greedy", "random_search", "uniform"]

#: A stage as ``(start, stop, submesh, config)`` (half-open layers).
StageTuple = tuple[int, int, int, int]


class StageOptions:
    """Admissible ``(cost, config, memory limit)`` of each (span, submesh), cached.

    Only finite entries with ``max_n_succ_stages >= 0`` are kept, sorted by
    cost then config index, so the cheapest config admissible for ``f``
    followers is the first one with ``limit >= f``. Lookups are lazy (per
    span and submesh), so nothing of size ``L^2 M K`` is copied to Python.
    """

    def __init__(self, problem: Problem):
        self._cost = problem.compute_cost
        self._memory = problem.max_n_succ_stages
        self._cache: dict[tuple[int, int, int], tuple[tuple[float, int, int], ...]] = {}

    def options(
        self, start: int, stop: int, submesh: int
    ) -> tuple[tuple[float, int, int], ...]:
        """``((seconds, config, limit), ...)`` of layers ``start..stop-1``."""
        key = (start, stop, submesh)
        found = self._cache.get(key)
        if found is None:
            costs = self._cost[start, stop - 1, submesh].tolist()
            limits = self._memory[start, stop - 1, submesh].tolist()
            found = tuple(
                sorted(
                    (cost, config, limit)
                    for config, (cost, limit) in enumerate(
                        zip(costs, limits, strict=True)
                    )
                    if cost < math.inf and limit >= 0
                )
            )
            self._cache[key] = found
        return found

    def cheapest(
        self, start: int, stop: int, submesh: int, followers: int
    ) -> tuple[float, int, int] | None:
        """The cheapest ``(seconds, config, limit)`` admissible with ``followers``
        stages after it, or ``None``."""
        for option in self.options(start, stop, submesh):
            if option[2] >= followers:
                return option
        return None


def equal_splits(problem: Problem) -> list[tuple[int, list[int]]]:
    """``(S, [submesh indices of D/S devices])`` for every ``S <= min(L, D)`` that
    splits the cluster into equal allowed submeshes."""
    sizes = problem.submesh_sizes.tolist()
    splits = []
    for num_stages in range(1, min(problem.num_layers, problem.num_devices) + 1):
        if problem.num_devices % num_stages:
            continue
        size = problem.num_devices // num_stages
        shapes = [m for m, n in enumerate(sizes) if n == size]
        if shapes:
            splits.append((num_stages, shapes))
    return splits


def no_plan_error(
    problem: Problem, family: str, reasons: list[str]
) -> InfeasibleProblemError:
    """The error for a heuristic that found no plan: why the problem is
    infeasible, or (when it is not) why the heuristic's family is empty."""
    total, _ = min_sum_plan(problem)
    if not math.isfinite(total):
        return InfeasibleProblemError(explain_infeasible(problem))
    why = "; ".join(reasons) if reasons else "no candidate was valid"
    return InfeasibleProblemError(
        f"{family} found no valid plan ({why}), although the problem has "
        "feasible plans (the dp method finds the best one)"
    )


def _plan_cost(latencies: list[float], num_microbatches: int) -> float:
    return sum(latencies) + (num_microbatches - 1) * max(latencies)


def _best_stage(
    options: StageOptions, start: int, stop: int, shapes: list[int], followers: int
) -> tuple[float, int, int] | None:
    """Cheapest admissible ``(seconds, submesh, config)`` over ``shapes``."""
    best = None
    for submesh in shapes:
        option = options.cheapest(start, stop, submesh, followers)
        if option is not None and (best is None or option[0] < best[0]):
            best = (option[0], submesh, option[1])
    return best


def _best_uniform(
    problem: Problem, options: StageOptions, num_stages: int, shapes: list[int]
) -> tuple[float, list[StageTuple]] | None:
    """The best plan with ``num_stages`` stages of ``q`` or ``q + 1`` layers.

    A Pareto DP over (stages placed, longer stages used) keeps every
    non-dominated (sum, max) pair, so the result is exact for the family.
    """
    base, extra = divmod(problem.num_layers, num_stages)
    # labels[e]: non-dominated (sum, max, stage, parent) after s stages, e long.
    labels: dict[int, list[tuple]] = {0: [(0.0, 0.0, None, None)]}
    for s in range(num_stages):
        followers = num_stages - 1 - s
        grown: dict[int, list[tuple]] = {}
        for used, front in labels.items():
            start = s * base + used
            for longer in (0, 1):
                if used + longer > extra or base + longer == 0:
                    continue
                # The long stages still to place must fit in the stages left.
                if extra - used - longer > num_stages - 1 - s:
                    continue
                stop = start + base + longer
                stage = _best_stage(options, start, stop, shapes, followers)
                if stage is None:
                    continue
                cost, submesh, config = stage
                target = grown.setdefault(used + longer, [])
                for label in front:
                    target.append(
                        (
                            label[0] + cost,
                            max(label[1], cost),
                            (start, stop, submesh, config),
                            label,
                        )
                    )
        labels = {used: _pareto(front) for used, front in grown.items() if front}
        if not labels:
            return None
    front = labels.get(extra)
    if not front:
        return None
    micro = problem.num_microbatches
    label = min(front, key=lambda x: x[0] + (micro - 1) * x[1])
    value = label[0] + (micro - 1) * label[1]
    stages = []
    while label[2] is not None:
        stages.append(label[2])
        label = label[3]
    return value, stages[::-1]


def _pareto(labels: list[tuple]) -> list[tuple]:
    """The labels not dominated in (sum, max), smaller sum first."""
    kept: list[tuple] = []
    for label in sorted(labels, key=lambda x: (x[0], x[1])):
        if not kept or label[1] < kept[-1][1]:
            kept.append(label)
    return kept


def uniform(problem: Problem) -> Plan:
    """The best *uniform* plan: equal layers and equal devices per stage.

    Tries every stage count ``S <= min(L, D)`` for which ``D / S`` is an allowed
    submesh size; stages hold ``floor(L/S)`` or ``ceil(L/S)`` layers (the
    longer ones wherever they do best), each on a submesh of ``D/S`` devices
    with its cheapest admissible config. Returns the cheapest such plan (exact
    within this family; not the optimum of the problem).

    Returns:
        The plan; ``info``: ``num_stages``, ``submesh_size`` (devices per stage),
        ``stage_counts_tried``.

    Raises:
        InfeasibleProblemError: no uniform plan exists; says whether the problem
            itself is infeasible, or why the uniform family is empty.
    """
    started = time.perf_counter()
    options = StageOptions(problem)
    splits = equal_splits(problem)
    best_value, best_stages, best_count = math.inf, None, 0
    reasons = []
    for num_stages, shapes in splits:
        found = _best_uniform(problem, options, num_stages, shapes)
        if found is None:
            reasons.append(f"S={num_stages}: a stage has no admissible entry")
        elif found[0] < best_value:
            best_value, (best_stages, best_count) = found[0], (found[1], num_stages)
    if best_stages is None:
        if not splits:
            reasons.append(
                f"no allowed submesh size {sorted(set(problem.submesh_sizes.tolist()))}"
                f" splits the {problem.num_devices} devices into S <= "
                f"{problem.num_layers} equal parts"
            )
        raise no_plan_error(problem, "uniform", reasons)
    return make_plan(
        problem,
        best_stages,
        method="uniform",
        search_time_s=time.perf_counter() - started,
        info={
            "num_stages": best_count,
            "submesh_size": problem.num_devices // best_count,
            "stage_counts_tried": [s for s, _ in splits],
        },
    )


def layer_weights(problem: Problem, shapes: list[int]) -> np.ndarray:
    """f64[L] per-layer seconds estimated from single-layer entries on ``shapes``.

    Each layer takes its cheapest single-layer entry over ``shapes`` and
    configs; layers with no finite one take the mean of the others; with no
    finite single-layer entry at all, the whole-model stage cost split evenly
    (or 1.0 each when that is missing too).
    """
    num_layers = problem.num_layers
    diagonal = problem.compute_cost[np.arange(num_layers), np.arange(num_layers)]
    weights = diagonal[:, shapes].reshape(num_layers, -1).min(axis=1)
    finite = np.isfinite(weights)
    if finite.all():
        return weights
    if finite.any():
        return np.where(finite, weights, weights[finite].mean())
    whole = problem.compute_cost[0, num_layers - 1, shapes].min()
    fill = whole / num_layers if math.isfinite(whole) else 1.0
    return np.full(num_layers, fill)


def linear_partition(weights: np.ndarray, num_stages: int) -> list[int]:
    """Contiguous split of ``weights`` into ``num_stages`` non-empty blocks with the
    least largest block sum (the classical linear-partition problem).

    Binary search over the candidate bottlenecks (all span sums) with a greedy
    fill; the fill keeps one layer for each later block, so it always returns
    exactly ``num_stages`` blocks without exceeding the bottleneck.

    Args:
        weights: f64[L] non-negative per-layer costs.
        num_stages: ``1 <= S <= L``.

    Returns:
        The ``S + 1`` boundaries ``[0, b_1, ..., L]``.
    """
    num_layers = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    starts, ends = np.triu_indices(num_layers)
    candidates = np.unique(prefix[ends + 1] - prefix[starts])
    # The widest single layer, measured like the spans (the prefix differences
    # can round a weight down by an ulp).
    candidates = candidates[candidates >= np.diff(prefix).max()].tolist()
    prefix_list = prefix.tolist()

    def fill(bottleneck: float) -> list[int] | None:
        limit = bottleneck * (1 + 1e-12) + 1e-300
        bounds = [0]
        for block in range(num_stages):
            start = bounds[-1]
            if block == num_stages - 1:
                stop = num_layers
            else:
                stop = bisect.bisect_right(prefix_list, prefix_list[start] + limit) - 1
                stop = max(stop, start + 1)
                stop = min(stop, num_layers - (num_stages - 1 - block))
            if prefix_list[stop] - prefix_list[start] > limit:
                return None
            bounds.append(stop)
        return bounds

    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if fill(candidates[middle]) is None:
            low = middle + 1
        else:
            high = middle
    bounds = fill(candidates[low])
    assert bounds is not None  # the largest candidate (the total) always fits
    return bounds


def greedy(problem: Problem) -> Plan:
    """Balanced block partition by cost (torchgpipe's ``balance_by_time`` idea).

    A heuristic: for every stage count ``S`` that splits the devices into equal
    allowed submeshes, estimate per-layer costs on that submesh size
    (:func:`layer_weights`), split the layers into ``S`` blocks with the least
    estimated bottleneck (:func:`linear_partition`), give each stage its
    cheapest admissible shape and config on the true table, and keep the
    cheapest valid plan. Stage costs that are not additive (communication,
    per-stage overheads) and the ``sum`` term of the objective are ignored by
    the partition, so the result can be far from the optimum.

    Returns:
        The plan; ``info``: ``num_stages``, ``submesh_size``,
        ``estimated_bottleneck`` (seconds, from the per-layer estimates),
        ``stage_counts_tried``.

    Raises:
        InfeasibleProblemError: no candidate is valid; the message says why.
    """
    started = time.perf_counter()
    options = StageOptions(problem)
    splits = equal_splits(problem)
    best_value, best_stages, best_info = math.inf, None, {}
    reasons = []
    for num_stages, shapes in splits:
        weights = layer_weights(problem, shapes)
        bounds = linear_partition(weights, num_stages)
        stages, latencies = [], []
        for s in range(num_stages):
            start, stop = bounds[s], bounds[s + 1]
            stage = _best_stage(options, start, stop, shapes, num_stages - 1 - s)
            if stage is None:
                reasons.append(
                    f"S={num_stages}: layers {start}..{stop - 1} have no "
                    f"admissible entry on {problem.num_devices // num_stages} devices"
                )
                break
            latencies.append(stage[0])
            stages.append((start, stop, stage[1], stage[2]))
        else:
            value = _plan_cost(latencies, problem.num_microbatches)
            if value < best_value:
                best_value, best_stages = value, stages
                best_info = {
                    "num_stages": num_stages,
                    "submesh_size": problem.num_devices // num_stages,
                    "estimated_bottleneck": float(
                        max(weights[a:b].sum() for a, b in itertools.pairwise(bounds))
                    ),
                }
    if best_stages is None:
        if not splits:
            reasons.append(
                f"no allowed submesh size splits the {problem.num_devices} devices "
                f"into S <= {problem.num_layers} equal parts"
            )
        raise no_plan_error(problem, "greedy", reasons)
    best_info["stage_counts_tried"] = [s for s, _ in splits]
    return make_plan(
        problem,
        best_stages,
        method="greedy",
        search_time_s=time.perf_counter() - started,
        info=best_info,
    )


def device_compositions(problem: Problem, max_stages: int) -> list[list[int]]:
    """``ways[s][d]``: ordered choices of ``s`` submeshes using ``d`` devices."""
    sizes = problem.submesh_sizes.tolist()
    num_devices = problem.num_devices
    ways = [[1] + [0] * num_devices]
    for _ in range(max_stages):
        previous = ways[-1]
        ways.append(
            [
                sum(previous[d - n] for n in sizes if n <= d)
                for d in range(num_devices + 1)
            ]
        )
    return ways


def sample_composition(
    rng: random.Random, ways: list[list[int]], sizes: list[int], count: int, total: int
) -> list[int]:
    """A uniformly random sequence of ``count`` submesh indices whose sizes sum to
    ``total`` (``ways`` from :func:`device_compositions`; needs
    ``ways[count][total] > 0``)."""
    shapes = []
    for placed in range(count):
        # Each submesh with probability proportional to its completions.
        pick = rng.randrange(ways[count - placed][total])
        for submesh, size in enumerate(sizes):
            if size <= total:
                pick -= ways[count - placed - 1][total - size]
                if pick < 0:
                    shapes.append(submesh)
                    total -= size
                    break
    return shapes


def random_search(problem: Problem, *, num_samples: int = 2000, seed: int = 0) -> Plan:
    """The best of ``num_samples`` random valid-by-construction plans.

    Each sample draws a stage count uniformly among those that can use exactly
    all devices, stage boundaries uniformly (``S - 1`` distinct cuts), a
    submesh sequence uniformly among those summing to ``D``, and for each
    stage a config uniformly among its admissible ones (finite, memory rule);
    a sample with a stage that has none is rejected.

    Args:
        problem: the instance.
        num_samples: plans drawn, >= 1.
        seed: seed of Python's ``random.Random``; the same seed, the same plan.

    Returns:
        The plan; ``info``: ``num_samples``, ``num_valid``, ``seed``.

    Raises:
        ValueError: ``num_samples < 1``.
        InfeasibleProblemError: no sample was valid; the message says why.
    """
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    started = time.perf_counter()
    rng = random.Random(seed)
    options = StageOptions(problem)
    num_layers, num_devices = problem.num_layers, problem.num_devices
    sizes = problem.submesh_sizes.tolist()
    max_stages = min(num_layers, num_devices)
    ways = device_compositions(problem, max_stages)
    counts = [s for s in range(1, max_stages + 1) if ways[s][num_devices]]
    if not counts:
        raise no_plan_error(
            problem,
            "random search",
            [f"no {max_stages} or fewer submeshes use exactly {num_devices} devices"],
        )
    best_value, best_stages, num_valid = math.inf, None, 0
    micro = problem.num_microbatches
    for _ in range(num_samples):
        num_stages = rng.choice(counts)
        cuts = sorted(rng.sample(range(1, num_layers), num_stages - 1))
        bounds = [0, *cuts, num_layers]
        shapes = sample_composition(rng, ways, sizes, num_stages, num_devices)
        stages, latencies = [], []
        for s, submesh in enumerate(shapes):
            admissible = [
                option
                for option in options.options(bounds[s], bounds[s + 1], submesh)
                if option[2] >= num_stages - 1 - s
            ]
            if not admissible:
                break
            cost, config, _ = rng.choice(admissible)
            latencies.append(cost)
            stages.append((bounds[s], bounds[s + 1], submesh, config))
        else:
            num_valid += 1
            value = _plan_cost(latencies, micro)
            if value < best_value:
                best_value, best_stages = value, stages
    if best_stages is None:
        raise no_plan_error(
            problem,
            "random search",
            [f"all {num_samples} samples had a stage with no admissible entry"],
        )
    return make_plan(
        problem,
        best_stages,
        method="random",
        search_time_s=time.perf_counter() - started,
        info={"num_samples": num_samples, "num_valid": num_valid, "seed": seed},
    )
