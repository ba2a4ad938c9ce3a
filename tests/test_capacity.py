"""Capacity planning (``plan --gpus-available ... --prices ... --deadline``):
the price sheet is read as untrusted, the choice is the optimum over the
candidate pools and agrees with brute force over every plan of small pools,
the frontier is the set no other outcome beats, workers change nothing, and
impossible questions are one line with the reason."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
from helpers import PRICES_EXAMPLE
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.baselines.megatron_brute import brute_force_megatron
from pipedejavu.cli.capacity import parse_duration, parse_tokens
from pipedejavu.cli.main import main
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.io.price_sheet import PriceSheet, load_price_sheet
from pipedejavu.planning.capacity import (
    CandidateOutcome,
    CapacityQuestion,
    answer_capacity,
    candidate_pools,
    choose_allocation,
    pareto_frontier,
    without_clock,
    without_trace,
)

PRICES = PriceSheet("USD", {"GH-96": 3.0, "RTX-3090": 0.3, "RTX-2080": 0.2})


def _outcome(time_s: float, cost: float, gpus: int = 1) -> CandidateOutcome:
    feasible = math.isfinite(time_s)
    return CandidateOutcome(
        {"H100-SXM": gpus}, {"H100-SXM": gpus} if feasible else None, 1.0, time_s,
        cost, True, None, None if feasible else "does not fit", 0.0,
    )  # fmt: skip


def test_the_example_price_sheet_reads_and_says_it_is_one():
    prices = load_price_sheet(PRICES_EXAMPLE, load_gpu_sheet())
    assert prices.example and prices.currency == "USD"
    assert set(prices.per_gpu_hour) == set(load_gpu_sheet())  # every type priced
    assert prices.cost({"H100-SXM": 8}, 3600) == pytest.approx(8 * 2.5)


@pytest.mark.parametrize(
    "body, words",
    [
        ([1], "expected a JSON object"),
        ({"currency": "USD"}, "per_gpu_hour must map"),
        ({"currency": "USD", "per_gpu_hour": {"H100": -1}}, "must be a number > 0"),
        ({"currency": "USD", "per_gpu_hour": {"H100": True}}, "must be a number > 0"),
        ({"currency": "USD", "per_gpu_hour": {"Z9": 1}}, "not on the GPU sheet"),
        (
            {"currency": "USD", "per_gpu_hour": {"H100": 1, "H100-SXM": 2}},
            "priced twice",
        ),
        ({"currency": "", "per_gpu_hour": {"H100": 1}}, "currency"),
        ({"currency": "USD", "per_gpu_hour": {"H100": 1}, "tax": 1}, "unknown keys"),
    ],
)
def test_a_bad_price_sheet_is_one_line_naming_it(tmp_path, body, words):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ProblemError) as error:
        load_price_sheet(path, load_gpu_sheet())
    message = str(error.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message


def test_durations_and_token_counts():
    assert parse_duration("60d") == 60 * 86400
    assert parse_duration("12h") == 12 * 3600 and parse_duration("2") == 2 * 86400
    assert parse_tokens("1T") == 1e12 and parse_tokens("300B") == 3e11
    assert parse_tokens("15e12") == 15e12
    for bad in ("-1d", "0d", "soon", "1y"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_tokens("many")


def test_candidate_pools_double_to_a_node_then_by_nodes():
    sheet = load_gpu_sheet()
    pools = candidate_pools({"H100-SXM": 100, "GH-96": 16}, sheet)
    h100 = [p["H100-SXM"] for p in pools if "H100-SXM" in p]
    assert h100 == [1, 2, 4, 8, 16, 32, 64, 100]
    assert [p["GH-96"] for p in pools if "GH-96" in p] == [1, 2, 4, 8, 16]
    given = candidate_pools({"H100-SXM": 10}, sheet, counts=(8, 4, 16))
    assert given == [{"H100-SXM": 4}, {"H100-SXM": 8}]


def test_the_choice_under_a_deadline_and_a_budget():
    outcomes = [
        _outcome(10, 100),
        _outcome(5, 150, 2),
        _outcome(20, 80, 1),
        _outcome(math.inf, math.inf),
        _outcome(5, 150, 4),  # a tie: fewer GPUs win
    ]
    assert choose_allocation(outcomes, deadline_s=12) == 0
    assert choose_allocation(outcomes, deadline_s=100) == 2
    assert choose_allocation(outcomes, deadline_s=6) == 1
    assert choose_allocation(outcomes, budget=160) == 1
    assert choose_allocation(outcomes, budget=90) == 2
    with pytest.raises(InfeasibleProblemError, match="the fastest .* takes"):
        choose_allocation(outcomes, deadline_s=1)
    with pytest.raises(InfeasibleProblemError, match="the cheapest .* costs 80"):
        choose_allocation(outcomes, budget=10, currency="USD")
    with pytest.raises(InfeasibleProblemError, match="no candidate pool holds"):
        choose_allocation([_outcome(math.inf, math.inf)], deadline_s=1)


def test_the_frontier_is_what_nothing_beats():
    rng = np.random.default_rng(47)
    for _ in range(50):
        times = rng.integers(1, 10, size=12).astype(float)
        costs = rng.integers(1, 10, size=12).astype(float)
        outcomes = [_outcome(t, c) for t, c in zip(times, costs, strict=True)]
        front = set(pareto_frontier(outcomes))
        for i, o in enumerate(outcomes):
            beaten = any(
                (p.time_s <= o.time_s and p.cost <= o.cost)
                and (p.time_s < o.time_s or p.cost < o.cost or j < i)
                for j, p in enumerate(outcomes)
                if j != i
            )
            assert (i in front) == (not beaten)


def _question(**changes) -> CapacityQuestion:
    fields = dict(
        model="OPT-350",
        tokens=16 * 2048 * 1000,
        global_batch=16,
        available={"GH-96": 4, "RTX-3090": 4, "RTX-2080": 2},
        prices=PRICES,
        deadline_s=3 * 3600.0,
    )
    return CapacityQuestion(**{**fields, **changes})


@pytest.mark.parametrize("goal", [{"deadline_s": 1800.0}, {"deadline_s": 1e6},
                                  {"deadline_s": None, "budget": 3.0}])  # fmt: skip
def test_brute_force_over_every_plan_of_small_pools_agrees(goal):
    """Every 3D plan of every candidate pool scored by the full predictor
    (``baselines.megatron_brute``), the pools compared by the same rule: the
    same allocation, time and cost as the answer, with every pool planned to
    its optimum and with the dominated ones cut (each then beaten in both
    time and cost by the pool it names, by brute force too)."""
    question = _question(**goal)
    answer = answer_capacity(dataclasses.replace(question, every_plan=True))
    pruned = answer_capacity(question)
    data = SailorData()
    spec = load_model_spec("OPT-350")
    iterations = math.ceil(question.tokens / (question.global_batch * spec.seq_length))
    brute = []
    for outcome in answer.outcomes:
        try:
            plan, best = brute_force_megatron(
                data, "OPT-350", outcome.pool, question.global_batch,
                FITTED_CONSTANTS, score="predictor",
            )  # fmt: skip
        except ProblemError:  # no plan fits: the answer has none either
            assert not outcome.feasible
            brute.append(_outcome(math.inf, math.inf))
            continue
        used = plan.gpus_by_type()
        time_s = iterations * best
        brute.append(
            CandidateOutcome(
                outcome.pool,
                used,
                best,
                time_s,
                PRICES.cost(used, time_s),
                True,
                None,
                None,
                0.0,
            )  # fmt: skip
        )
        assert outcome.time_s == pytest.approx(time_s, rel=1e-9)
    chosen = choose_allocation(
        brute, deadline_s=question.deadline_s, budget=question.budget
    )
    assert chosen == answer.choice
    assert brute[chosen].cost == pytest.approx(answer.outcomes[chosen].cost, rel=1e-9)
    assert all(o.proven for o in answer.outcomes if o.feasible)
    assert (pruned.choice, pruned.frontier) == (answer.choice, answer.frontier)
    pools = [o.pool for o in brute]
    for whole, cut, best in zip(answer.outcomes, pruned.outcomes, brute, strict=True):
        if cut.dominated_by is None:
            # (the knob choices' trace follows the cutoffs)
            plans = [without_clock(o.to_json()) for o in (cut, whole)]
            plans = [{**p, "plan": without_trace(p["plan"])} for p in plans]
            assert plans[0] == plans[1]
            continue
        beaten = brute[pools.index(cut.dominated_by)]
        assert best.time_s >= beaten.time_s and best.cost > beaten.cost


def test_two_workers_answer_as_one():
    question = _question(available={"GH-96": 4, "RTX-3090": 2})
    one, two = answer_capacity(question), answer_capacity(question, workers=2)
    assert one.choice == two.choice and one.frontier == two.frontier
    assert without_clock([o.to_json() for o in one.outcomes]) == without_clock(
        [o.to_json() for o in two.outcomes]
    )


def test_questions_that_cannot_be_asked():
    with pytest.raises(ProblemError, match="a deadline or a budget"):
        _question(budget=10.0)
    with pytest.raises(ProblemError, match="no price for"):
        _question(available={"H100-SXM": 8})
    with pytest.raises(ProblemError, match="no GPU type"):
        _question(available={})
    with pytest.raises(ProblemError, match="tokens"):
        _question(tokens=0)


def test_the_cli_answers_and_refuses_in_one_line(tmp_path, capsys):
    prices = tmp_path / "prices.json"
    prices.write_text(
        json.dumps({"currency": "EUR", "per_gpu_hour": dict(PRICES.per_gpu_hour)})
    )
    base = ["plan", "--model", "OPT-350", "--global-batch", "16", "--tokens", "30M"]
    base += ["--gpus-available", "GH-96:4,RTX-3090:2", "--prices", str(prices)]
    assert main(base + ["--deadline", "1h", "--json"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["currency"] == "EUR" and out["choice"] in out["frontier"]
    assert len(out["candidates"]) == 5  # GH-96: 1, 2, 4; RTX-3090: 1, 2
    assert main(base + ["--deadline", "1s"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no allocation finishes within" in err
    assert main(base) == 2
    assert "--deadline or --budget" in capsys.readouterr().err
    assert main(base + ["--budget", "5", "--gpus", "GH-96:4"]) == 2
    assert "capacity planning takes no --gpus" in capsys.readouterr().err


def test_a_local_dask_cluster_answers_as_this_process():
    """The sweep on a Dask LocalCluster of two worker processes the test
    starts: the same outcomes as planned here."""
    pytest.importorskip("distributed")  # (installed by the test extra)
    question = _question(available={"GH-96": 4, "RTX-3090": 2})
    here = answer_capacity(question)
    there = answer_capacity(question, workers=2, cluster="local")
    assert here.choice == there.choice and here.frontier == there.frontier
    assert without_clock([o.to_json() for o in here.outcomes]) == without_clock(
        [o.to_json() for o in there.outcomes]
    )


def test_an_interrupted_sweep_resumes_from_its_results(tmp_path, monkeypatch):
    import pipedejavu.planning.capacity as capacity

    question = _question(available={"GH-96": 4, "RTX-3090": 2}, every_plan=True)
    results = tmp_path / "sweep.csv"
    full = answer_capacity(question, results=results)
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) == 1 + len(full.outcomes)
    results.write_text("".join(lines[:3]))  # killed after two pools
    planned = []
    real = capacity.evaluate_pool

    def counting(q, pool, cutoff_s=math.inf):
        planned.append(dict(pool))
        return real(q, pool, cutoff_s)

    monkeypatch.setattr(capacity, "evaluate_pool", counting)
    again = answer_capacity(question, results=results)
    assert len(planned) == len(full.outcomes) - 2  # the two written: not again
    assert without_clock([o.to_json() for o in again.outcomes]) == without_clock(
        [o.to_json() for o in full.outcomes]
    )
    # other prices choose again among the same plans, planning nothing
    planned.clear()
    dearer = PriceSheet("USD", {**PRICES.per_gpu_hour, "GH-96": 30.0})
    cheap = answer_capacity(
        _question(
            available={"GH-96": 4, "RTX-3090": 2}, prices=dearer, every_plan=True
        ),
        results=results,
    )
    assert not planned
    gh = [o for o in cheap.outcomes if "GH-96" in o.pool and o.feasible]
    assert gh[0].cost == pytest.approx(dearer.cost(gh[0].used, gh[0].time_s))
    # the Parquet copy holds the same rows, numbers as numbers
    pyarrow = pytest.importorskip("pyarrow.parquet")
    table = pyarrow.read_table(results.with_suffix(".parquet"))
    assert table.num_rows == len(full.outcomes)
    assert str(table.schema.field("time_s").type) == "double"


@pytest.mark.parametrize(
    "text, words",
    [
        ("a,b\n1,2\n", "not a capacity results file"),
        (None, "is not a pool"),
        (None, "is not a number"),
    ],
)
def test_a_bad_results_file_is_one_line(tmp_path, text, words):
    question = _question(available={"GH-96": 1})
    path = tmp_path / "sweep.csv"
    if text is None:
        answer_capacity(question, results=path)
        good = path.read_text().splitlines()
        row = good[1].split(",")
        if "pool" in words:
            row[2] = "GH-96"
        else:
            row[4] = "fast"
        text = "\n".join([good[0], ",".join(row)]) + "\n"
    path.write_text(text)
    with pytest.raises(ProblemError) as error:
        answer_capacity(question, results=path)
    message = str(error.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message


def test_an_unreachable_cluster_is_one_line():
    pytest.importorskip("distributed")
    with pytest.raises(ProblemError, match="cannot reach the Dask scheduler"):
        answer_capacity(_question(), cluster="tcp://127.0.0.1:9")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_any_duration_or_token_text_is_a_positive_number_or_refused(text):
    """Every string --deadline or --tokens may get: a finite positive value
    within range, or ArgumentTypeError (one line on the command line)."""
    for parse, high in ((parse_duration, math.inf), (parse_tokens, 1e18)):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError:
            continue
        assert 0 < value < high and math.isfinite(value)


def test_a_duration_too_long_for_a_float_is_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("9e999d")
