"""Simulated annealing over plans: Metropolis MCMC with geometric cooling.

FlexFlow's search (Jia et al., "Beyond Data and Model Parallelism", 2019)
applied to Alpa's formulation: a random walk over valid plans that accepts a
proposal of score change ``delta`` with probability ``min(1, exp(-delta / T))``.

Moves (each proposal picks one):

* shift — move the boundary between two adjacent stages by one layer, or
  to the cut that balances the pair best on the table;
* rebuild (split / merge / re-cut) — replace a window of adjacent stages
  (mostly 1-3) by mostly one more, one fewer or as many stages (sometimes any
  count the window's devices allow) on the same layers and devices: a
  uniformly random submesh sequence; random cuts, or balanced ones (two
  stages: the best-balanced cut; more: layers in proportion to devices);
* resize — give two stages new shapes with the same total devices;
* config — switch one stage to another admissible config.

The balanced cuts make this stronger than a plain random walk (without them
the chain stalls on L = 64 instances where it must re-balance several stages
at once); they are still local moves scored on the true table.

A reshaped stage takes its cheapest admissible config (the best for the
default objective; the config move explores the others), as do stages whose
config a new stage count makes break the memory rule. A proposal that breaks a
rule (inf entry, memory, devices) is rejected without scoring, so the chain
only visits valid plans. The temperature starts at ``initial_temperature``
times the initial plan's score and falls geometrically to
``final_temperature`` times that score over ``num_steps`` proposals.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from pipedejavu.baselines.heuristics import (
    StageOptions,
    device_compositions,
    greedy,
    random_search,
    sample_composition,
    uniform,
)
from pipedejavu.core.problem import (
    InfeasibleProblemError,
    Plan,
    Problem,
    ProblemError,
    evaluate,
    make_plan,
)

__all__ = ["anneal"]

# A stage in the chain: (start, stop, submesh, config, seconds, memory limit).
_Stage = tuple[int, int, int, int, float, int]

#: Proposal weights of shift, rebuild (split/merge), resize, config.
_MOVE_WEIGHTS = (0.35, 0.30, 0.25, 0.10)

_INITIAL_METHODS = {"greedy": greedy, "uniform": uniform, "random": random_search}


class _Moves:
    """The proposal kernel: each method returns a new stage list or ``None``."""

    def __init__(self, problem: Problem, rng: random.Random):
        self.rng = rng
        self.options = StageOptions(problem)
        self._stages: dict[tuple[int, int, int, int], _Stage | None] = {}
        self.sizes = sizes = problem.submesh_sizes.tolist()
        num_devices = problem.num_devices
        self.ways = device_compositions(problem, min(problem.num_layers, num_devices))
        # shapes[0][t], shapes[1][t]: submesh 1- and 2-tuples using t devices.
        singles: list[list[tuple[int, ...]]] = [[] for _ in range(num_devices + 1)]
        pairs: list[list[tuple[int, ...]]] = [[] for _ in range(num_devices + 1)]
        for first, size in enumerate(sizes):
            singles[size].append((first,))
            for second, other in enumerate(sizes):
                if size + other <= num_devices:
                    pairs[size + other].append((first, second))
        self.shapes = (singles, pairs)

    def _stage(self, start: int, stop: int, submesh: int, followers: int):
        """The stage with its cheapest admissible config, or ``None`` (cached:
        this is the inner loop's hottest lookup)."""
        key = (start, stop, submesh, followers)
        try:
            return self._stages[key]
        except KeyError:
            pass
        option = self.options.cheapest(start, stop, submesh, followers)
        stage = None
        if option is not None:
            stage = (start, stop, submesh, option[1], option[0], option[2])
        self._stages[key] = stage
        return stage

    def _refit(self, stages: list, count: int) -> bool:
        """Give the first ``count`` stages a config admissible for their new
        number of followers where theirs is not; False if impossible."""
        total = len(stages)
        for index in range(count):
            stage = stages[index]
            followers = total - 1 - index
            if stage[5] < followers:
                fixed = self._stage(stage[0], stage[1], stage[2], followers)
                if fixed is None:
                    return False
                stages[index] = fixed
        return True

    def _cut(
        self, start: int, stop: int, shapes: tuple[int, int], followers: int
    ) -> tuple | None:
        """Two stages ``start..cut-1`` and ``cut..stop-1`` on ``shapes``: half
        the time at a random cut, half the time at the cut that balances them
        best on the table (least max, then least sum)."""
        rng = self.rng
        if rng.random() < 0.5:
            cut = rng.randrange(start + 1, stop)
            left = self._stage(start, cut, shapes[0], followers)
            right = self._stage(cut, stop, shapes[1], followers - 1)
            return None if left is None or right is None else (left, right)
        best, best_key = None, (math.inf, math.inf)
        for cut in range(start + 1, stop):
            left = self._stage(start, cut, shapes[0], followers)
            if left is None:
                continue
            right = self._stage(cut, stop, shapes[1], followers - 1)
            if right is None:
                continue
            key = (max(left[4], right[4]), left[4] + right[4])
            if key < best_key:
                best, best_key = (left, right), key
        return best

    def shift(self, stages: list) -> list | None:
        total = len(stages)
        if total < 2:
            return None
        rng = self.rng
        i = rng.randrange(total - 1)
        left, right = stages[i], stages[i + 1]
        if rng.random() < 0.5:
            cut = left[1] + rng.choice((-1, 1))
            if not left[0] < cut < right[1]:
                return None
            new_left = self._stage(left[0], cut, left[2], total - 1 - i)
            new_right = self._stage(cut, right[1], right[2], total - 2 - i)
            if new_left is None or new_right is None:
                return None
        else:
            pair = self._cut(left[0], right[1], (left[2], right[2]), total - 1 - i)
            if pair is None:
                return None
            new_left, new_right = pair
        return [*stages[:i], new_left, new_right, *stages[i + 2 :]]

    def _bounds(self, start: int, stop: int, sizes: list[int]) -> list[int]:
        """Cuts of ``start..stop-1`` into ``len(sizes)`` stages: random, or
        (half the time) layers in proportion to each stage's devices."""
        count = len(sizes)
        if self.rng.random() < 0.5:
            cuts = sorted(self.rng.sample(range(start + 1, stop), count - 1))
            return [start, *cuts, stop]
        layers, devices = stop - start, sum(sizes)
        bounds, used = [start], 0
        for index, size in enumerate(sizes[:-1]):
            used += size
            cut = start + round(layers * used / devices)
            # At least one layer per stage on both sides of the cut.
            cut = max(cut, bounds[-1] + 1)
            bounds.append(min(cut, stop - (count - 1 - index)))
        bounds.append(stop)
        return bounds

    def rebuild(self, stages: list) -> list | None:
        """Split, merge or re-cut: replace a window of ``w`` adjacent stages by
        ``q`` stages (mostly ``|q - w| <= 1``) on the same layers and
        devices, with a random submesh sequence and cuts."""
        rng = self.rng
        total = len(stages)
        # Mostly small windows; sometimes any, so every stage count stays
        # reachable when the submesh sizes allow only big jumps.
        width = rng.randint(1, min(3, total) if rng.random() < 0.8 else total)
        i = rng.randrange(total - width + 1)
        start, stop = stages[i][0], stages[i + width - 1][1]
        devices = sum(self.sizes[stage[2]] for stage in stages[i : i + width])
        ways = self.ways
        counts = [
            q
            for q in range(1, min(stop - start, len(ways) - 1) + 1)
            if ways[q][devices]
        ]
        if not counts:
            return None
        near = [q for q in counts if abs(q - width) <= 1]
        count = rng.choice(near if near and rng.random() < 0.75 else counts)
        shapes = sample_composition(rng, ways, self.sizes, count, devices)
        new_total = total - width + count
        followers = new_total - 1 - i
        if count == 2:
            pair = self._cut(start, stop, (shapes[0], shapes[1]), followers)
            if pair is None:
                return None
            window = list(pair)
        else:
            bounds = self._bounds(start, stop, [self.sizes[m] for m in shapes])
            window = []
            for index, submesh in enumerate(shapes):
                stage = self._stage(
                    bounds[index], bounds[index + 1], submesh, followers - index
                )
                if stage is None:
                    return None
                window.append(stage)
        new = [*stages[:i], *window, *stages[i + width :]]
        return new if count < width or self._refit(new, i) else None

    def resize(self, stages: list) -> list | None:
        rng = self.rng
        total = len(stages)
        if total == 1:
            stage = stages[0]
            choices = [
                c for c in self.shapes[0][self.sizes[stage[2]]] if c[0] != stage[2]
            ]
            if not choices:
                return None
            fixed = self._stage(stage[0], stage[1], rng.choice(choices)[0], 0)
            return None if fixed is None else [fixed]
        i, j = rng.sample(range(total), 2)
        a, b = stages[i], stages[j]
        pairs = self.shapes[1][self.sizes[a[2]] + self.sizes[b[2]]]
        pairs = [pair for pair in pairs if pair != (a[2], b[2])]
        if not pairs:
            return None
        pick = rng.choice(pairs)
        new = list(stages)
        new[i] = self._stage(a[0], a[1], pick[0], total - 1 - i)
        new[j] = self._stage(b[0], b[1], pick[1], total - 1 - j)
        if new[i] is None or new[j] is None:
            return None
        return new

    def config(self, stages: list) -> list | None:
        total = len(stages)
        i = self.rng.randrange(total)
        start, stop, submesh, config = stages[i][:4]
        choices = [
            option
            for option in self.options.options(start, stop, submesh)
            if option[2] >= total - 1 - i and option[1] != config
        ]
        if not choices:
            return None
        cost, new_config, limit = self.rng.choice(choices)
        new = list(stages)
        new[i] = (start, stop, submesh, new_config, cost, limit)
        return new


def _initial_plan(
    problem: Problem, initial: Plan | str | None, seed: int
) -> tuple[Plan, str]:
    if isinstance(initial, Plan):
        evaluate(problem, initial)  # PlanError if it breaks a rule
        return initial, initial.method
    if initial is None:
        for name in ("greedy", "uniform"):
            try:
                return _INITIAL_METHODS[name](problem), name
            except InfeasibleProblemError:
                pass
        return random_search(problem, num_samples=1000, seed=seed), "random"
    if initial not in _INITIAL_METHODS:
        raise ValueError(
            f"initial must be a Plan, None or one of {', '.join(_INITIAL_METHODS)}, "
            f"got {initial!r}"
        )
    if initial == "random":
        return random_search(problem, num_samples=1000, seed=seed), "random"
    return _INITIAL_METHODS[initial](problem), initial


def anneal(
    problem: Problem,
    *,
    num_steps: int = 20_000,
    seed: int = 0,
    initial: Plan | str | None = None,
    initial_temperature: float = 0.05,
    final_temperature: float = 1e-3,
    score_fn: Callable[[Plan], float] | None = None,
    progress_fn: Callable[[int, int, float], None] | None = None,
    time_budget_s: float | None = None,
) -> Plan:
    """Simulated annealing (Metropolis MCMC) over valid plans; see the module doc.

    Args:
        problem: the instance.
        num_steps: proposals to make, >= 0 (rejected ones count).
        seed: seed of Python's ``random.Random``; with no time budget the same
            seed gives the same plan.
        initial: the starting plan: a valid :class:`Plan`, or ``"greedy"``,
            ``"uniform"``, ``"random"`` (1000 samples); ``None`` tries greedy,
            then uniform, then random.
        initial_temperature: starting temperature relative to the initial
            score (0.05: a 5% worse plan is accepted with probability 1/e).
        final_temperature: last temperature relative to the initial score,
            ``0 < final <= initial``.
        score_fn: the score to minimize, called with each proposed valid
            :class:`Plan` (e.g. a simulator); must return a finite float for
            the initial plan and may return ``inf`` to reject. ``None``: the
            objective ``sum + (B - 1) * max`` (seconds).
        progress_fn: called every 1% of the steps with ``(steps done,
            num_steps, best score)``.
        time_budget_s: stop early after this many seconds (> 0).

    Returns:
        The best plan visited (``plan.cost`` is its exact objective even when
        ``score_fn`` is given). ``plan.info``: ``trace`` — the anytime curve, a
        list of ``(seconds since the call, best score so far)`` with one point
        at the start, one per improvement and one at the end; ``best_score``;
        ``initial_method``; ``initial_score``; ``num_steps_run``;
        ``acceptance_rate`` (accepted / valid proposals); ``num_valid``
        (proposals that obey the rules); ``seed``; ``score``
        (``"objective"`` or ``"score_fn"``).

    Raises:
        ValueError: a bad argument.
        InfeasibleProblemError: no starting plan could be found.
        PlanError: ``initial`` is a plan that breaks a rule.
    """
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
    if not 0 < final_temperature <= initial_temperature < math.inf:
        raise ValueError(
            "temperatures must satisfy 0 < final_temperature <= initial_temperature "
            f"< inf, got initial {initial_temperature!r}, final {final_temperature!r}"
        )
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s must be > 0 or None, got {time_budget_s!r}")
    started = time.perf_counter()
    deadline = started + (math.inf if time_budget_s is None else time_budget_s)
    plan, initial_method = _initial_plan(problem, initial, seed)
    rng = random.Random(seed)
    moves = _Moves(problem, rng)
    memory = problem.max_n_succ_stages
    stages = [
        (
            s.start,
            s.stop,
            s.submesh_index,
            s.config_index,
            problem.stage_cost(s.start, s.stop, s.submesh_index, s.config_index),
            int(memory[s.start, s.stop - 1, s.submesh_index, s.config_index]),
        )
        for s in plan.stages
    ]
    micro_minus_one = problem.num_microbatches - 1

    def objective_score(chain: list) -> float:
        latencies = [stage[4] for stage in chain]
        return sum(latencies) + micro_minus_one * max(latencies)

    def plan_score(chain: list) -> float:
        return float(score_fn(_to_plan(problem, chain, "anneal")))

    score = objective_score if score_fn is None else plan_score
    current = score(stages)
    if not math.isfinite(current):
        raise ProblemError(f"score_fn returned {current} for the initial plan")
    initial_score = best = current
    best_stages = stages
    trace = [(time.perf_counter() - started, best)]
    temperature = initial_temperature * abs(current)
    cooling = (final_temperature / initial_temperature) ** (1 / max(num_steps, 1))
    proposals = (moves.shift, moves.rebuild, moves.resize, moves.config)
    thresholds = [sum(_MOVE_WEIGHTS[: i + 1]) for i in range(len(_MOVE_WEIGHTS))]
    report_every = max(1, num_steps // 100)
    accepted = valid = step = 0
    for step in range(1, num_steps + 1):
        draw = rng.random()
        move = 0
        while draw >= thresholds[move] and move < len(proposals) - 1:
            move += 1
        proposed = proposals[move](stages)
        if proposed is not None:
            valid += 1
            value = score(proposed)
            delta = value - current
            if delta <= 0 or (
                temperature > 0 and rng.random() < math.exp(-delta / temperature)
            ):
                accepted += 1
                stages, current = proposed, value
                if current < best:
                    best, best_stages = current, stages
                    trace.append((time.perf_counter() - started, best))
        temperature *= cooling
        if progress_fn is not None and step % report_every == 0:
            progress_fn(step, num_steps, best)
        if time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - started
    trace.append((elapsed, best))
    return _to_plan(
        problem,
        best_stages,
        "anneal",
        elapsed,
        {
            "trace": trace,
            "best_score": best,
            "initial_method": initial_method,
            "initial_score": initial_score,
            "num_steps_run": step,
            "num_valid": valid,
            "acceptance_rate": accepted / valid if valid else 0.0,
            "seed": seed,
            "score": "objective" if score_fn is None else "score_fn",
        },
    )


def _to_plan(
    problem: Problem,
    chain: list,
    method: str,
    search_time_s: float = 0.0,
    info: dict | None = None,
) -> Plan:
    return make_plan(
        problem,
        [stage[:4] for stage in chain],
        method=method,
        search_time_s=search_time_s,
        info=info,
    )
