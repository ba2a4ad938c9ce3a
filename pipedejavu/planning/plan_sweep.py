"""Sweeps: every model x global batch x candidate pool planned, one row each.

A sweep (:class:`SweepQuestion`) names models, global batches and the GPUs
one could rent (``{type: most}``, whose candidate counts are
:func:`~pipedejavu.planning.capacity.candidate_pools`', or the counts
given), with the planning options they share (sequence length, precision,
GPU sheet, profiles) and, optionally, the tokens to train on (time to
train) and a price sheet (cost). :func:`run_sweep` plans every (model,
global batch, pool) as ``pipedejavu plan`` plans it
(:func:`~pipedejavu.planning.pool_planning.plan_pool`: the fastest plan on at most
the pool's GPUs, proven optimal under the predictor) in this process, on a
local process pool or on a Dask cluster
(:func:`~pipedejavu.planning.sweep.run_tasks`; the same rows wherever they
run), and appends each outcome to a CSV file as it finishes (a Parquet copy
beside it at the end, with pyarrow). Each row carries a key hashing what its
plan depends on (model, global batch, pool, sequence length, precision, GPU
sheet, profiles): a sweep given a file that already holds some of its rows
plans only the others (an interrupted sweep resumes), and prices the rows it
reads with the tokens and prices it is given now.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.problem import ProblemError
from pipedejavu.io.gpu_sheet import GpuSheet, load_gpu_sheet
from pipedejavu.io.price_sheet import PriceSheet
from pipedejavu.planning.capacity import candidate_pools
from pipedejavu.planning.capacity_results import (
    append_row,
    hashed_key,
    number,
    parse_pool,
    plan_cell,
    pool_key,
    read_table,
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
    "SWEEP_COLUMNS",
    "SweepQuestion",
    "SweepRow",
    "run_sweep",
    "sweep_key",
    "sweep_tasks",
]

#: A sweep results file's columns, in order.
SWEEP_COLUMNS = (
    "key",
    "model",
    "global_batch",
    "pool",
    "used",
    "iteration_s",
    "tokens_per_sample",
    "tokens_per_s_per_gpu",
    "proven",
    "shape",
    "reason",
    "search_s",
    "plan",
)
_MAX_TASKS = 4096


@dataclasses.dataclass(frozen=True)
class SweepQuestion:
    """A sweep (module docstring).

    Attributes:
        models: as ``plan --model`` takes them.
        global_batches: samples per iteration, each planned.
        available: the most GPUs of each type (the sheet's names).
        counts: the GPU counts to plan for every type (``None``: powers of
            two to a node, then doubling nodes, and the most available).
        seq_length, precision, gpu_sheet, profiles: as for ``plan``.
        tokens: tokens to train on (``None``: no time to train).
        prices: a price sheet (``None``: no cost).
        mixed: also the pools mixing two types, planned with
            ``--mixed-types`` (:func:`~pipedejavu.planning.capacity.
            candidate_pools`).
    """

    models: tuple[str, ...]
    global_batches: tuple[int, ...]
    available: Mapping[str, int]
    counts: tuple[int, ...] | None = None
    seq_length: int | None = None
    precision: str | None = None
    gpu_sheet: str | None = None
    profiles: str | None = None
    tokens: float | None = None
    prices: PriceSheet | None = None
    mixed: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise ProblemError("a sweep needs at least one model")
        if len(set(self.models)) != len(self.models):
            raise ProblemError("a sweep names a model twice")
        batches = self.global_batches
        if not batches or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches
        ):
            raise ProblemError("global batches must be integers >= 1 (at least one)")
        if len(set(batches)) != len(batches):
            raise ProblemError("a sweep names a global batch twice")
        if not self.available:
            raise ProblemError("no GPU type to plan: give at least one TYPE:MAX")
        if self.tokens is not None and not (
            math.isfinite(self.tokens) and self.tokens > 0
        ):
            raise ProblemError("the tokens to train on must be a positive number")
        if self.prices is not None:
            for gpu in self.available:
                self.prices.price(gpu)  # (a type the sheet does not price)


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One (model, global batch, pool) planned.

    Attributes:
        model, global_batch, pool: what was planned.
        planned: the outcome (:class:`~pipedejavu.planning.pool_planning.PoolPlan`).
        time_s: days to train in seconds with the question's tokens
            (``None``: no tokens given; ``inf``: no plan).
        cost: what the GPUs used cost for that time (``None``: no tokens or
            no prices; ``inf``: no plan).
    """

    model: str
    global_batch: int
    pool: Mapping[str, int]
    planned: PoolPlan
    time_s: float | None
    cost: float | None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Tokens trained per second per GPU used (0 without a plan)."""
        used = self.planned.used
        if used is None:
            return 0.0
        tokens = self.global_batch * self.planned.tokens_per_sample
        return tokens / self.planned.iteration_s / sum(used.values())

    def to_json(self) -> dict[str, Any]:
        planned = dataclasses.asdict(self.planned)
        planned["used"] = self.planned.used and dict(self.planned.used)
        del planned["lower_s"]  # (a capacity question's: a sweep plans to the end)
        out = {
            "model": self.model,
            "global_batch": self.global_batch,
            "pool": dict(self.pool),
            **planned,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "time_s": self.time_s,
            "cost": self.cost,
        }
        for name in ("iteration_s", "time_s", "cost"):
            if out[name] is not None and not math.isfinite(out[name]):
                out[name] = None
        return out


def sweep_key(question: SweepQuestion, task: tuple[str, int, Mapping]) -> str:
    """What one task's plan depends on, hashed: model, global batch, pool,
    sequence length, precision, GPU sheet and profiles."""
    model, batch, pool = task
    fields = [
        model,
        batch,
        pool_key(pool),
        question.seq_length,
        question.precision,
        question.gpu_sheet,
        question.profiles,
    ]
    return hashed_key(fields)


def _plan_task(
    options: Mapping[str, Any], task: tuple[str, int, Mapping[str, int]]
) -> PoolPlan:
    """One task planned (a module-level function: it runs in other
    processes)."""
    model, batch, pool = task
    return plan_pool(model, batch, pool, **options)


def _priced(question: SweepQuestion, task: tuple, planned: PoolPlan) -> SweepRow:
    model, batch, pool = task
    time_s = cost = None
    if question.tokens is not None:
        time_s = planned.train_seconds(question.tokens, batch)
        if question.prices is not None:
            used = planned.used
            cost = math.inf if used is None else question.prices.cost(used, time_s)
    return SweepRow(model, batch, dict(pool), planned, time_s, cost)


def _row(key: str, row: SweepRow) -> dict[str, Any]:
    p = row.planned
    return {
        "key": key,
        "model": row.model,
        "global_batch": row.global_batch,
        "pool": pool_key(row.pool),
        "used": "" if p.used is None else pool_key(p.used),
        "iteration_s": p.iteration_s,
        "tokens_per_sample": p.tokens_per_sample,
        "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
        "proven": int(p.proven),
        "shape": p.shape,
        "reason": p.reason or "",
        "search_s": p.search_s,
        "plan": "" if p.plan is None else json.dumps(p.plan),
    }


def _read_back(row: Mapping[str, str], where: str) -> PoolPlan:
    """A row of a results file as the plan it recorded (every field checked,
    the pool too, though the key says which task it is)."""
    parse_pool(row["pool"], where)
    used = parse_pool(row["used"], where) if row["used"] else None
    tokens = number(row["tokens_per_sample"], where)
    if tokens != int(tokens) or (used is not None and tokens < 1):
        raise ProblemError(f"{where}: tokens_per_sample is not a whole number >= 1")
    iteration_s = number(row["iteration_s"], where)
    if used is not None and not (math.isfinite(iteration_s) and iteration_s > 0):
        raise ProblemError(f"{where}: a plan's iteration_s must be a number > 0")
    return PoolPlan(
        used=used,
        iteration_s=iteration_s,
        tokens_per_sample=int(tokens),
        proven=row["proven"] == "1",
        plan=plan_cell(row, where),
        reason=row["reason"] or None,
        search_s=number(row["search_s"], where),
        shape=row["shape"],
    )


def sweep_tasks(
    question: SweepQuestion, pools: Sequence[Mapping[str, int]]
) -> list[tuple[str, int, Mapping[str, int]]]:
    """``(model, global batch, pool)`` of every task on ``pools``, models
    outermost."""
    tasks = [
        (model, batch, pool)
        for model in question.models
        for batch in question.global_batches
        for pool in pools
    ]
    if len(tasks) > _MAX_TASKS:
        raise ProblemError(f"{len(tasks)} plans to make (at most {_MAX_TASKS})")
    return tasks


def run_sweep(
    question: SweepQuestion,
    *,
    workers: int = 1,
    cluster: str | None = None,
    results: str | os.PathLike | None = None,
    progress: Callable[[int, int, SweepRow], None] | None = None,
    sheet: GpuSheet | None = None,
) -> list[SweepRow]:
    """Every task of ``question`` planned, in :func:`sweep_tasks`' order on
    its candidate pools (module docstring): on ``workers`` local processes or a Dask
    ``cluster``; each appended to ``results`` (CSV) as it finishes, the tasks
    the file already holds read back instead of planned; ``progress`` told
    ``(done, total, row)`` as each finishes.

    Raises:
        ProblemError: a bad question, too many tasks, a bad results file.
    """
    sheet = sheet or load_gpu_sheet(question.gpu_sheet)
    pools = candidate_pools(question.available, sheet, question.counts, question.mixed)
    tasks = sweep_tasks(question, pools)
    keys = [sweep_key(question, task) for task in tasks]
    planned: list[PoolPlan | None] = [None] * len(tasks)
    if results is not None:
        name = os.fspath(results)
        held = {
            row["key"]: _read_back(row, f"{name}, line {row['line']}")
            for row in read_table(results, SWEEP_COLUMNS, "a sweep results file")
        }
        planned = [held.get(key) for key in keys]
    options = planning_options(question)
    refused = {
        (model, pool_key(pool)): reason
        for model in question.models
        for pool, reason in zip(
            pools, unpriced_pools(model, pools, **options), strict=True
        )
    }
    for i, (model, _, pool) in enumerate(tasks):
        reason = refused[model, pool_key(pool)]
        if reason is not None and planned[i] is None:
            planned[i] = PoolPlan.none(reason)
    todo = [i for i, p in enumerate(planned) if p is None]
    say = progress or (lambda done, total, row: None)
    done = len(tasks) - len(todo)
    jobs = [tasks[i] for i in todo]
    for k, outcome in run_tasks(
        _plan_task, (options,), jobs, workers=workers, cluster=cluster
    ):
        i = todo[k]
        planned[i] = outcome
        row = _priced(question, tasks[i], outcome)
        if results is not None:
            append_row(results, _row(keys[i], row), SWEEP_COLUMNS)
        done += 1
        say(done, len(tasks), row)
    if results is not None:
        floats = ("iteration_s", "tokens_per_s_per_gpu", "search_s")
        write_parquet(
            results,
            SWEEP_COLUMNS,
            floats=floats,
            integers=("global_batch", "tokens_per_sample"),
        )
    return [
        _priced(question, task, p)
        for task, p in zip(tasks, planned, strict=True)
        if p is not None
    ]
