"""A capacity question's dominated pools (``planning/capacity_pruning``):
searched only until a frontier pool certainly beats them, the answer the
same as with every pool planned to its optimum, the floors below every
plan, the same outcomes whatever cutoffs the searches were given."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import PRICES_EXAMPLE

from pipedejavu.cli.main import main
from pipedejavu.io.price_sheet import PriceSheet
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.capacity import (
    CapacityQuestion,
    _settle,
    answer_capacity,
    without_clock,
    without_trace,
)
from pipedejavu.planning.capacity_pruning import cutoff_of, dominates, pool_floors
from pipedejavu.planning.sharded_search import share_source
from pipedejavu.planning.sweep import run_tasks

PRICES = PriceSheet("USD", {"H100-SXM": 2.5, "A100-80": 1.6, "L40S": 1.0})


def _question(**changes) -> CapacityQuestion:
    fields = dict(
        model="Llama-3-8B",
        tokens=1e11,
        global_batch=256,
        available={"H100-SXM": 32, "A100-80": 32, "L40S": 32},
        prices=PRICES,
        deadline_s=90 * 86400.0,
        counts=(8, 16, 32),
    )
    return CapacityQuestion(**{**fields, **changes})


@pytest.fixture(scope="module")
def answers():
    question = _question()
    every = answer_capacity(dataclasses.replace(question, every_plan=True))
    return question, every, answer_capacity(question)


def _json(outcomes):
    """The outcomes as JSON without the wall clock and without the trace of
    how each knob choice was settled (which follows the cutoffs, and which
    a pruned answer leaves out)."""
    out = without_clock([o.to_json() for o in outcomes])
    return [{**o, "plan": without_trace(o["plan"])} for o in out]


def test_the_answer_is_the_same_with_every_pool_planned(answers):
    question, every, pruned = answers
    assert (pruned.choice, pruned.frontier) == (every.choice, every.frontier)
    dominated = [o for o in pruned.outcomes if o.dominated_by is not None]
    assert dominated, "this question has pools a frontier pool beats"
    floors = pool_floors(question, [o.pool for o in every.outcomes])
    pools = [o.pool for o in every.outcomes]
    for i, (whole, cut) in enumerate(zip(every.outcomes, pruned.outcomes, strict=True)):
        if cut.dominated_by is None:
            assert _json([cut]) == _json([whole])
            continue
        assert not cut.feasible and cut.plan is None
        beaten = every.outcomes[pools.index(cut.dominated_by)]
        assert pools.index(cut.dominated_by) in every.frontier
        # planned to its optimum, the pool is slower and dearer...
        assert whole.time_s >= beaten.time_s and whole.cost > beaten.cost
        # ... than the bounds the answer states, which hold
        assert whole.iteration_s >= cut.lower_s
        assert whole.cost >= floors.cost[i]
        assert "dominated by" in cut.reason


def test_the_floors_are_below_every_plan(answers):
    """The cost floor of each pool (the least GPU-seconds of its layers,
    priced) is below what its best plan costs, pipelines or a sharded plan,
    on pools of one type and mixing two."""
    question, every, _ = answers
    floors = pool_floors(question, [o.pool for o in every.outcomes])
    assert all(f > 0 for f in floors.cost)
    for outcome, floor in zip(every.outcomes, floors.cost, strict=True):
        if outcome.feasible:
            assert outcome.cost >= floor
    mixed = _question(available={"H100-SXM": 8, "A100-80": 8}, mixed=True,
                      counts=(8,), every_plan=True)  # fmt: skip
    answer = answer_capacity(mixed)
    floors = pool_floors(mixed, [o.pool for o in answer.outcomes])
    assert any(len(o.pool) == 2 and o.feasible for o in answer.outcomes)
    for outcome, floor in zip(answer.outcomes, floors.cost, strict=True):
        if outcome.feasible:
            assert outcome.cost >= floor > 0


def test_the_floor_leaves_recomputation_out_because_it_only_adds():
    """The sharded floor prices every layer without recomputation: each
    recomputation's forward and backward are no shorter, at every TP, CP and
    micro-batch."""
    choice = choose_cost_source("Llama-3-8B", ["H100-SXM"], precision="bf16")
    sheet, spec = choice.data.sheet, choice.spec
    for cp in (1, 2, 4):
        base = None
        for how in ("none", "selective", "full"):
            options = dataclasses.replace(choice.options, recompute=how, zero_stage=3)
            source = share_source(spec, sheet, options, cp)
            total = np.array([
                [(lambda t: (t.forward + t.backward).sum())(
                    source.layer_times(choice.model, "H100-SXM", mbs, tp))
                 for tp in (1, 2, 4, 8)] for mbs in (1, 2, 8)
            ])  # fmt: skip
            if base is None:
                base = total
            assert np.all(total >= base * (1 - 1e-12))


def test_the_outcomes_do_not_depend_on_the_cutoffs(answers):
    """Every pool planned to its optimum, then judged against the frontier:
    the same outcomes as the searches cut at whatever cutoffs they had."""
    question, every, pruned = answers
    floors = pool_floors(question, [o.pool for o in every.outcomes])
    settled = _settle(question, list(every.outcomes), floors, set())
    assert _json(settled) == _json(pruned.outcomes)


def test_cutoffs_and_domination():
    known = [(10.0, 5.0, 0), (4.0, 9.0, 1), (4.0, 7.0, 2), (2.0, 20.0, 3)]
    assert cutoff_of(8.0, known) == (4.0, 2)  # the fastest below the floor
    assert cutoff_of(5.0, known) == (math.inf, -1)  # (strictly below)
    assert dominates(4.0, 4.0) and not dominates(3.999, 4.0)
    assert not dominates(math.inf, math.inf)


def test_a_task_is_built_after_the_results_before_it():
    """``run_tasks`` with tasks built as they are sent: never more in flight
    than the workers, so a task sees the results yielded before it."""
    seen: list[int] = []
    built: list[tuple[int, int]] = []

    def task(k: int) -> int:
        built.append((k, len(seen)))
        return k

    for k, value in run_tasks(max, (0,), task, workers=2, count=6):
        assert value == k
        seen.append(k)
    assert sorted(seen) == list(range(6))
    assert all(k - done <= 2 for k, done in built)


def test_a_pruned_sweep_resumes_from_its_results(tmp_path, answers):
    question, _, pruned = answers
    results = tmp_path / "sweep.csv"
    full = answer_capacity(question, results=results)
    assert _json(full.outcomes) == _json(pruned.outcomes)
    lines = results.read_text().splitlines(keepends=True)
    # the dominated pools are not written (their plans are not their optimum)
    written = len(full.outcomes) - sum(
        o.dominated_by is not None for o in full.outcomes
    )
    assert len(lines) == 1 + written
    results.write_text("".join(lines[:3]))  # killed after two pools
    again = answer_capacity(question, results=results)
    assert _json(again.outcomes) == _json(full.outcomes)


def test_the_cli_lists_the_dominated_pools_and_plans_every_pool_on_asking(capsys):
    base = ["plan", "--model", "Llama-3-8B", "--global-batch", "256",
            "--tokens", "100B", "--gpus-available", "H100-SXM:16,L40S:16",
            "--counts", "8,16", "--prices", str(PRICES_EXAMPLE),
            "--deadline", "90d"]  # fmt: skip
    assert main(base) in (0, None)
    out = capsys.readouterr().out
    assert "dominated: dominated by" in out and "or proven dominated" in out
    assert main(base + ["--every-plan"]) in (0, None)
    out = capsys.readouterr().out
    assert "dominated" not in out
