"""What to rent: the GPU type and count that train a model on a number of
tokens for the least money by a deadline, or the soonest within a budget.

A capacity question (:class:`CapacityQuestion`) names the model, the tokens,
the global batch, the GPUs one could rent (``{type: most}``), their prices
(:class:`~pipedejavu.io.price_sheet.PriceSheet`) and a deadline or a budget.
:func:`candidate_pools` lists the allocations to consider: for each type,
the powers of two up to a node and then whole nodes doubling up to the most
available (and the most itself), or the counts given; with ``mixed``, also
every pair of the types, each at its counts of whole nodes (or its most, if
less than a node; or at the counts given), planned as ``plan --mixed-types``
plans a pool (a type per stage). Each pool is planned as ``pipedejavu plan``
plans it (:func:`~pipedejavu.planning.plan_model.plan_model`: the fastest
plan on at most that many GPUs, proven optimal under the predictor), the
plan's GPUs are what is rented, and

* time to train = ``ceil(tokens / (global batch x tokens per sample))``
  iterations x the predicted iteration time,
* cost = time x the sum over the plan's GPUs of their price per hour.

:func:`answer_capacity` plans every pool (on a local process pool with
``workers`` > 1, or a Dask cluster: the answers the same in any order) and
chooses: with a deadline, the least cost among the allocations that finish
by it; with a budget, the least time among those within it (ties: the other
measure, then fewer GPUs, then the pool's order). The allocations no other
beats in both time and cost form the Pareto frontier
(:attr:`CapacityAnswer.frontier`). A pool that a frontier pool beats in
both time and cost whatever its plan is searched only until that is
certain and kept as *dominated* (its plan, if one was found, not kept;
:mod:`~pipedejavu.planning.capacity_pruning`); with ``every_plan`` every
pool is planned to its optimum. The choice is the optimum over the
candidate pools under the predictor: every pool is planned to its proven
optimum or proven dominated, and every pool is compared (tested against
every pool planned, and against brute force over every plan of small
pools).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.io.gpu_sheet import GpuSheet, load_gpu_sheet
from pipedejavu.io.price_sheet import PriceSheet
from pipedejavu.planning.capacity_pruning import (
    Floors,
    cutoff_of,
    dominates,
    pool_floors,
)
from pipedejavu.planning.capacity_results import (
    append_row,
    hashed_key,
    number,
    parse_pool,
    plan_cell,
    pool_key,
    read_rows,
    write_parquet,
)
from pipedejavu.planning.pool_planning import (
    PoolPlan,
    plan_pool,
    planning_options,
    unpriced_pools,
)
from pipedejavu.planning.sweep import run_tasks

__all__ = [
    "CandidateOutcome",
    "CapacityAnswer",
    "CapacityQuestion",
    "answer_capacity",
    "candidate_pools",
    "choose_allocation",
    "evaluate_pool",
    "pareto_frontier",
    "question_key",
    "without_clock",
    "without_trace",
]

_MAX_POOLS = 4096


@dataclasses.dataclass(frozen=True)
class CapacityQuestion:
    """A capacity question (module docstring).

    Attributes:
        model: as ``plan --model`` takes it.
        tokens: tokens to train on.
        global_batch: samples per iteration.
        available: the most GPUs of each type one could rent (the sheet's
            names).
        prices: what each type costs per hour.
        deadline_s: finish within this many seconds (or ``budget``).
        budget: spend at most this much, in the prices' currency.
        seq_length: tokens per sample (``None``: the model's).
        precision: as for ``plan`` (``None``: its default).
        counts: the GPU counts to consider for every type (``None``: powers
            of two to a node, then doubling nodes).
        gpu_sheet, profiles: as for ``plan``.
        mixed: also the pools mixing two types (module docstring).
        every_plan: plan every pool to its optimum (``False``: the pools
            certified dominated are not, :mod:`~pipedejavu.planning.
            capacity_pruning`).
    """

    model: str
    tokens: float
    global_batch: int
    available: Mapping[str, int]
    prices: PriceSheet
    deadline_s: float | None = None
    budget: float | None = None
    seq_length: int | None = None
    precision: str | None = None
    counts: tuple[int, ...] | None = None
    gpu_sheet: str | None = None
    profiles: str | None = None
    mixed: bool = False
    every_plan: bool = False

    def __post_init__(self) -> None:
        if (self.deadline_s is None) == (self.budget is None):
            raise ProblemError("give a deadline or a budget (one of them)")
        for what, value in (("deadline", self.deadline_s), ("budget", self.budget)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ProblemError(f"the {what} must be a positive number")
        if not (math.isfinite(self.tokens) and self.tokens > 0):
            raise ProblemError("the tokens to train on must be a positive number")
        if not self.available:
            raise ProblemError("no GPU type to rent: give at least one TYPE:MAX")
        for gpu in self.available:
            self.prices.price(gpu)  # (a type the sheet does not price: one line)


@dataclasses.dataclass(frozen=True)
class CandidateOutcome:
    """One candidate pool, planned.

    Attributes:
        pool: the pool planned (``{type: count}``).
        used: the GPUs the best plan uses, rented (``None``: no plan).
        iteration_s: its predicted seconds per iteration.
        time_s: time to train.
        cost: what the rented GPUs cost for that time.
        proven: the plan is proven optimal under the predictor.
        plan: the plan, as ``plan --json`` writes it (``None``: none).
        reason: why there is no plan (``None``: there is one).
        search_s: seconds the planning took.
        shape: the plan's parallelism in words (``""``: no plan).
        lower_s: the certified least seconds per iteration of the pool's
            plans (its ``iteration_s`` where proven; ``inf``: no plan fits).
        dominated_by: the frontier pool that trains sooner and costs less
            than any plan of this one (its plan not kept: ``used`` is
            ``None``, the bounds in ``reason``); ``None``: not dominated.
    """

    pool: Mapping[str, int]
    used: Mapping[str, int] | None
    iteration_s: float
    time_s: float
    cost: float
    proven: bool
    plan: Mapping[str, Any] | None
    reason: str | None
    search_s: float
    shape: str = ""
    lower_s: float = math.inf
    dominated_by: Mapping[str, int] | None = None

    @property
    def feasible(self) -> bool:
        return self.used is not None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["pool"], out["used"] = dict(self.pool), self.used and dict(self.used)
        out["dominated_by"] = self.dominated_by and dict(self.dominated_by)
        for key in ("iteration_s", "time_s", "cost", "lower_s"):
            if not math.isfinite(out[key]):
                out[key] = None
        return out


@dataclasses.dataclass(frozen=True)
class CapacityAnswer:
    """Every candidate planned, the choice and the frontier.

    Attributes:
        question: what was asked.
        outcomes: every candidate pool, in :func:`candidate_pools`' order.
        choice: the index of the chosen outcome.
        frontier: the indices of the Pareto-optimal outcomes, by time.
    """

    question: CapacityQuestion
    outcomes: tuple[CandidateOutcome, ...]
    choice: int
    frontier: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        q = self.question
        return {
            "model": q.model,
            "tokens": q.tokens,
            "global_batch": q.global_batch,
            "available": dict(q.available),
            "currency": q.prices.currency,
            "prices_per_gpu_hour": {g: q.prices.price(g) for g in q.available},
            "prices_are_an_example": q.prices.example,
            "deadline_s": q.deadline_s,
            "budget": q.budget,
            "mixed": q.mixed,
            "choice": self.choice,
            "frontier": list(self.frontier),
            "candidates": [o.to_json() for o in self.outcomes],
        }


def _counts(most: int, per_node: int) -> list[int]:
    counts, n = [], 1
    while n < per_node and n <= most:
        counts.append(n)
        n *= 2
    n = per_node
    while n <= most:
        counts.append(n)
        n *= 2
    if most not in counts:
        counts.append(most)
    return counts


def candidate_pools(
    available: Mapping[str, int],
    sheet: GpuSheet,
    counts: Sequence[int] | None = None,
    mixed: bool = False,
) -> list[dict[str, int]]:
    """The pools to plan: one type each, its counts (module docstring) up
    to the most available, in the order of ``available``; with ``mixed``,
    then every pair of types (in that order), each at its counts of whole
    nodes (its most, where that is less than a node; the given ``counts``
    where there are some).

    Raises:
        ProblemError: more than 4,096 pools, or no count within reach.
    """
    pools, ladders = [], {}
    for gpu, most in available.items():
        per_node = sheet[gpu].gpus_per_node
        wanted = _counts(most, per_node) if counts is None else sorted(set(counts))
        ladders[gpu] = [n for n in wanted if 1 <= n <= most]
        pools += [{gpu: n} for n in ladders[gpu]]
    if mixed:
        nodes = {
            gpu: ladder
            if counts is not None
            else [n for n in ladder if n % sheet[gpu].gpus_per_node == 0] or ladder[-1:]
            for gpu, ladder in ladders.items()
        }
        for first, second in itertools.combinations(available, 2):
            pools += [
                {first: a, second: b} for a in nodes[first] for b in nodes[second]
            ]
            if len(pools) > _MAX_POOLS:
                break
    if not pools:
        raise ProblemError("no candidate pool: every count is above the most available")
    if len(pools) > _MAX_POOLS:
        raise ProblemError(f"{len(pools)} candidate pools (at most {_MAX_POOLS})")
    return pools


def evaluate_pool(
    question: CapacityQuestion, pool: Mapping[str, int], cutoff_s: float = math.inf
) -> CandidateOutcome:
    """``pool`` planned for ``question`` (module docstring;
    :func:`~pipedejavu.planning.pool_planning.plan_pool`, with its
    ``cutoff_s`` in seconds per iteration); a pool with no plan that fits
    is an outcome with its reason, not an error."""
    planned = plan_pool(
        question.model,
        question.global_batch,
        pool,
        **planning_options(question),
        cutoff_s=cutoff_s,
    )
    if not question.every_plan:  # (its searches had cutoffs)
        planned = dataclasses.replace(planned, plan=without_trace(planned.plan))
    return _candidate(question, pool, planned)


def _evaluate(question: CapacityQuestion, task: tuple) -> CandidateOutcome:
    pool, cutoff_s = task
    return evaluate_pool(question, pool, cutoff_s)


def _candidate(
    question: CapacityQuestion, pool: Mapping[str, int], planned: PoolPlan
) -> CandidateOutcome:
    """``pool``'s outcome: ``planned`` with its time to train and cost."""
    if planned.used is None:
        return CandidateOutcome(
            dict(pool), None, math.inf, math.inf, math.inf, False, None,
            planned.reason, planned.search_s, lower_s=planned.lower_s,
        )  # fmt: skip
    time_s = planned.train_seconds(question.tokens, question.global_batch)
    return CandidateOutcome(
        pool=dict(pool),
        used=planned.used,
        iteration_s=planned.iteration_s,
        time_s=time_s,
        cost=question.prices.cost(planned.used, time_s),
        proven=planned.proven,
        plan=planned.plan,
        reason=None,
        search_s=planned.search_s,
        shape=planned.shape,
        lower_s=planned.lower_s,
    )


def _key(outcome: CandidateOutcome, index: int, by_cost: bool) -> tuple:
    gpus = sum((outcome.used or {}).values())
    first, second = (
        (outcome.cost, outcome.time_s) if by_cost else (outcome.time_s, outcome.cost)
    )
    return (first, second, gpus, index)


def choose_allocation(
    outcomes: Sequence[CandidateOutcome],
    *,
    deadline_s: float | None = None,
    budget: float | None = None,
    currency: str = "",
) -> int:
    """The index of the least cost by ``deadline_s``, or of the least time
    within ``budget`` (module docstring).

    Raises:
        InfeasibleProblemError: no pool has a plan, or none meets the deadline or
            the budget (the reason, with the nearest miss).
    """
    planned = [i for i, o in enumerate(outcomes) if o.feasible]
    if not planned:
        raise InfeasibleProblemError(
            "no candidate pool holds a plan that fits: "
            + (outcomes[0].reason if outcomes else "no pool")
        )
    if deadline_s is not None:
        ok = [i for i in planned if outcomes[i].time_s <= deadline_s]
        if not ok:
            best = outcomes[min(planned, key=lambda i: _key(outcomes[i], i, False))]
            raise InfeasibleProblemError(
                f"no allocation finishes within {_days(deadline_s)}: the fastest "
                f"({pool_key(best.used or {})}) takes {_days(best.time_s)}"
            )
        return min(ok, key=lambda i: _key(outcomes[i], i, True))
    ok = [i for i in planned if outcomes[i].cost <= budget]
    if not ok:
        best = min(planned, key=lambda i: _key(outcomes[i], i, True))
        raise InfeasibleProblemError(
            f"no allocation trains within the budget of {budget:,.0f} {currency}: "
            f"the cheapest ({pool_key(outcomes[best].used or {})}) costs "
            f"{outcomes[best].cost:,.0f} {currency}"
        )
    return min(ok, key=lambda i: _key(outcomes[i], i, False))


def pareto_frontier(outcomes: Sequence[CandidateOutcome]) -> tuple[int, ...]:
    """The planned outcomes no other beats in both time and cost (one of
    equal ones: the first), by time."""
    planned = sorted(
        (i for i, o in enumerate(outcomes) if o.feasible),
        key=lambda i: (outcomes[i].time_s, outcomes[i].cost, i),
    )
    frontier, cheapest = [], math.inf
    for i in planned:
        if outcomes[i].cost < cheapest:
            frontier.append(i)
            cheapest = outcomes[i].cost
    return tuple(frontier)


def without_clock(value: Any, top: bool = True) -> Any:
    """``value`` (an answer's or outcome's JSON) without its wall-clock
    seconds (each search's, each knob choice's ``time_s``; an outcome's own
    ``time_s``, the time to train, stays): what must agree wherever a sweep
    ran."""
    clock = {"search_s", "search_time_s"} | (set() if top else {"time_s"})
    if isinstance(value, dict):
        return {k: without_clock(v, False) for k, v in value.items() if k not in clock}
    if isinstance(value, list):
        return [without_clock(v, top) for v in value]
    return value


def without_trace(plan: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A plan's JSON without how each knob choice was settled
    (``knobs.choices``: it follows the cutoff its search was given)."""
    if plan is None:
        return None
    return {**plan, "knobs": {k: v for k, v in plan["knobs"].items() if k != "choices"}}


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days"


def question_key(question: CapacityQuestion) -> str:
    """What the plans of ``question`` depend on, hashed: model, tokens,
    global batch, sequence length, precision, GPU sheet and profiles (not
    the prices, deadline or budget, which only choose among the plans)."""
    fields = [
        question.model,
        repr(float(question.tokens)),
        question.global_batch,
        question.seq_length,
        question.precision,
        question.gpu_sheet,
        question.profiles,
    ]
    return hashed_key(fields)


def _row(question: CapacityQuestion, outcome: CandidateOutcome) -> dict[str, Any]:
    return {
        "question": question_key(question),
        "model": question.model,
        "pool": pool_key(outcome.pool),
        "used": "" if outcome.used is None else pool_key(outcome.used),
        "iteration_s": outcome.iteration_s,
        "time_s": outcome.time_s,
        "cost": outcome.cost,
        "currency": question.prices.currency,
        "proven": int(outcome.proven),
        "shape": outcome.shape,
        "reason": outcome.reason or "",
        "search_s": outcome.search_s,
        "plan": "" if outcome.plan is None else json.dumps(outcome.plan),
    }


def _outcome(question: CapacityQuestion, row: Mapping[str, str], where: str):
    """A row read back, priced at ``question``'s prices."""
    used = parse_pool(row["used"], where) if row["used"] else None
    time_s = number(row["time_s"], where)
    plan = plan_cell(row, where)
    return CandidateOutcome(
        pool=parse_pool(row["pool"], where),
        used=used,
        iteration_s=number(row["iteration_s"], where),
        time_s=time_s,
        cost=math.inf if used is None else question.prices.cost(used, time_s),
        proven=row["proven"] == "1",
        plan=plan,
        reason=row["reason"] or None,
        search_s=number(row["search_s"], where),
        shape=row["shape"],
        # (the rows keep no bound: a proven plan's is its time)
        lower_s=math.inf if used is None else (
            number(row["iteration_s"], where) if row["proven"] == "1" else 0.0
        ),
    )  # fmt: skip


def answer_capacity(
    question: CapacityQuestion,
    *,
    workers: int = 1,
    cluster: str | None = None,
    results: str | os.PathLike | None = None,
    progress: Callable[[int, int, CandidateOutcome], None] | None = None,
    sheet: GpuSheet | None = None,
) -> CapacityAnswer:
    """Every candidate pool of ``question`` planned, the choice and the
    frontier (module docstring): on ``workers`` local processes, or on a
    Dask ``cluster`` (:func:`~pipedejavu.planning.sweep.run_tasks`); each
    outcome appended to ``results`` (a CSV file) as it finishes, the pools
    the file already holds for this question not planned again (resumed),
    a Parquet copy beside it at the end where pyarrow is installed.
    ``progress`` is told ``(done, total, outcome)`` as each pool finishes.

    Raises:
        ProblemError: a bad question, pool list or results file.
        InfeasibleProblemError: no allocation meets the deadline or budget.
    """
    sheet = sheet or load_gpu_sheet(question.gpu_sheet)
    pools = candidate_pools(question.available, sheet, question.counts, question.mixed)
    outcomes: list[CandidateOutcome | None] = [None] * len(pools)
    if results is not None:
        name = os.fspath(results)
        held = {
            row["pool"]: _outcome(question, row, f"{name}, line {row['line']}")
            for row in read_rows(results, question_key(question))
        }
        outcomes = [held.get(pool_key(p)) for p in pools]
    reasons = unpriced_pools(question.model, pools, **planning_options(question))
    for i, reason in enumerate(reasons):
        if reason is not None and outcomes[i] is None:
            outcomes[i] = _candidate(question, pools[i], PoolPlan.none(reason))
    todo = [i for i, o in enumerate(outcomes) if o is None]
    say = progress or (lambda done, total, outcome: None)
    done = len(pools) - len(todo)
    floors = None if question.every_plan else pool_floors(question, pools)
    # the planned pools' points: what cuts the others' searches
    known = [(o.time_s, o.cost, i) for i, o in enumerate(outcomes) if o and o.feasible]
    cutoffs: dict[int, float] = {}  # the cutoff (time to train) each was given
    cut: set[int] = set()  # the searches stopped at their cutoff
    if floors is not None:  # the cheapest floors first: they cut the others
        todo.sort(key=lambda i: (floors.cost[i], -sum(pools[i].values()), i))

    def task(k: int) -> tuple[dict[str, int], float]:
        i = todo[k]
        if floors is None:
            return pools[i], math.inf
        cutoffs[i], _ = cutoff_of(floors.cost[i], known)
        per_iteration = cutoffs[i] / floors.iterations * (1 + 1e-9)
        return pools[i], per_iteration

    for k, outcome in run_tasks(
        _evaluate, (question,), task, workers=workers, cluster=cluster, count=len(todo)
    ):
        i = todo[k]
        outcomes[i] = outcome
        if floors is not None and dominates(
            outcome.lower_s * floors.iterations, cutoffs[i]
        ):
            cut.add(i)  # (a plan it holds is not its optimum: not kept)
        elif outcome.feasible:
            known.append((outcome.time_s, outcome.cost, i))
        # (what holds at any prices: a plan to its optimum, or none that fits)
        kept = outcome.reason or (outcome.feasible and i not in cut)
        if results is not None and kept:
            append_row(results, _row(question, outcome))
        done += 1
        say(done, len(pools), outcome)
    if results is not None:
        write_parquet(results)
    final = [o for o in outcomes if o is not None]
    if floors is not None:
        final = _settle(question, final, floors, cut)
    choice = choose_allocation(
        final,
        deadline_s=question.deadline_s,
        budget=question.budget,
        currency=question.prices.currency,
    )
    return CapacityAnswer(question, tuple(final), choice, pareto_frontier(final))


def _settle(
    question: CapacityQuestion,
    outcomes: list[CandidateOutcome],
    floors: Floors,
    cut: set[int],
) -> list[CandidateOutcome]:
    """``outcomes`` judged against the frontier of the pools planned to the
    end (``cut``: those whose search stopped at its cutoff): every pool whose
    certified bound reaches the least time of a frontier pool costing less
    than its floor is dominated, its plan (if any) not kept, and so is a pool
    where no plan fits (a search cut at its cutoff need not find that out)
    (:mod:`~pipedejavu.planning.capacity_pruning`: the same pools whatever
    cutoffs the searches were given). A cut pool the frontier does not
    dominate (never met: the cutoffs only fall as pools are planned) is
    planned again, to the end."""
    exact = [o if i not in cut else dataclasses.replace(o, used=None)
             for i, o in enumerate(outcomes)]  # fmt: skip
    frontier = pareto_frontier(exact)
    points = [(exact[j].time_s, exact[j].cost, j) for j in frontier]
    out = list(outcomes)
    for i, o in enumerate(outcomes):
        cutoff, q = cutoff_of(floors.cost[i], points)
        if not dominates(o.lower_s * floors.iterations, cutoff):
            if i in cut or (not o.feasible and o.reason == ""):
                out[i] = evaluate_pool(question, o.pool)  # (to the end)
            continue
        beaten = exact[q]
        currency = question.prices.currency
        reason = (
            f"dominated by {pool_key(beaten.used or {})} ({_days(beaten.time_s)}, "
            f"{beaten.cost:,.0f} {currency}): no plan here trains in less than "
            f"{_days(cutoff)} or costs less than {floors.cost[i]:,.0f} {currency}"
        )
        out[i] = CandidateOutcome(
            dict(o.pool), None, math.inf, math.inf, math.inf, True, None, reason,
            o.search_s, "", cutoff / floors.iterations, dict(beaten.pool),
        )  # fmt: skip
    return out
