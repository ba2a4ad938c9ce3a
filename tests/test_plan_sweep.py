"""Sweeps over models x global batches x pools (``pipedejavu sweep``): each
row is the plan ``plan`` makes of that pool, the time and cost follow from
it, workers and a local Dask cluster change nothing, an interrupted sweep
resumes from its results file without planning again, and bad questions or
files are one line."""

from __future__ import annotations

import json
import math

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.price_sheet import PriceSheet
from pipedejavu.planning.capacity import (
    CapacityQuestion,
    answer_capacity,
    without_clock,
)
from pipedejavu.planning.plan_sweep import (
    SWEEP_COLUMNS,
    SweepQuestion,
    run_sweep,
)

PRICES = PriceSheet("USD", {"GH-96": 3.0, "RTX-3090": 0.3})
POOLS = {"GH-96": 4, "RTX-3090": 2}


def _question(**changes) -> SweepQuestion:
    fields = dict(
        models=("OPT-350",),
        global_batches=(16, 32),
        available=POOLS,
        tokens=3e7,
        prices=PRICES,
    )
    return SweepQuestion(**{**fields, **changes})


def _plain(rows) -> list[dict]:
    """Rows as JSON without the planning's wall-clock seconds."""
    return [without_clock(row.to_json()) for row in rows]


def test_each_row_is_the_capacity_question_s_plan_of_that_pool():
    """Every (batch, pool) row equals the candidate a capacity question of
    that batch plans for the pool: GPUs used, seconds per iteration, time to
    train and cost; tokens per second per GPU follow from them."""
    rows = run_sweep(_question())
    assert [(r.global_batch, dict(r.pool)) for r in rows] == [
        (b, {gpu: n})
        for b in (16, 32)
        for gpu, n in (("GH-96", 1), ("GH-96", 2), ("GH-96", 4), ("RTX-3090", 1),
                       ("RTX-3090", 2))
    ]  # fmt: skip
    for batch in (16, 32):
        capacity = answer_capacity(
            CapacityQuestion("OPT-350", 3e7, batch, POOLS, PRICES, budget=1e9)
        )
        ours = [r for r in rows if r.global_batch == batch]
        for row, outcome in zip(ours, capacity.outcomes, strict=True):
            assert dict(row.pool) == dict(outcome.pool)
            assert row.planned.used == outcome.used
            assert row.planned.iteration_s == outcome.iteration_s
            assert row.time_s == outcome.time_s and row.cost == outcome.cost
            assert row.planned.shape == outcome.shape
            gpus = sum(outcome.used.values())
            tokens = batch * row.planned.tokens_per_sample
            assert row.tokens_per_s_per_gpu == pytest.approx(
                tokens / outcome.iteration_s / gpus, rel=1e-12
            )
    # without tokens or prices: no time, no cost
    bare = run_sweep(_question(tokens=None, prices=None, global_batches=(16,)))
    assert all(r.time_s is None and r.cost is None for r in bare)
    assert [r.planned.iteration_s for r in bare] == [
        r.planned.iteration_s for r in rows if r.global_batch == 16
    ]


def test_two_workers_and_a_local_dask_cluster_give_the_same_rows():
    question = _question(global_batches=(16,))
    here = _plain(run_sweep(question))
    assert _plain(run_sweep(question, workers=2)) == here
    pytest.importorskip("distributed")  # (installed by the test extra)
    assert _plain(run_sweep(question, workers=2, cluster="local")) == here


def test_an_interrupted_sweep_resumes_without_planning_again(tmp_path, monkeypatch):
    import pipedejavu.planning.plan_sweep as plan_sweep

    results = tmp_path / "sweep.csv"
    full = run_sweep(_question(), results=results)
    lines = results.read_text().splitlines(keepends=True)
    assert lines[0].strip() == ",".join(SWEEP_COLUMNS)
    assert len(lines) == 1 + len(full)
    results.write_text("".join(lines[:4]))  # killed after three rows
    planned = []
    real = plan_sweep.plan_pool

    def counting(model, batch, pool, **options):
        planned.append((model, batch, dict(pool)))
        return real(model, batch, pool, **options)

    monkeypatch.setattr(plan_sweep, "plan_pool", counting)
    again = run_sweep(_question(), results=results)
    assert len(planned) == len(full) - 3
    assert _plain(again) == _plain(full)
    # other tokens and prices price the same plans again, planning nothing
    planned.clear()
    dearer = PriceSheet("USD", {"GH-96": 30.0, "RTX-3090": 0.3})
    priced = run_sweep(_question(tokens=6e7, prices=dearer), results=results)
    assert not planned
    for old, new in zip(full, priced, strict=True):
        if old.planned.used is not None:
            assert new.time_s == pytest.approx(2 * old.time_s, rel=0.01)
            assert new.cost == pytest.approx(dearer.cost(new.planned.used, new.time_s))
    # a wider sweep plans only what is new
    run_sweep(_question(global_batches=(16, 32, 64)), results=results)
    assert {b for _, b, _ in planned} == {64}
    pyarrow = pytest.importorskip("pyarrow.parquet")
    table = pyarrow.read_table(results.with_suffix(".parquet"))
    assert table.num_rows == 3 * 5
    assert str(table.schema.field("global_batch").type) == "int64"
    assert str(table.schema.field("iteration_s").type) == "double"


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda text: "a,b\n1,2\n", "not a sweep results file"),
        (
            lambda text: text.replace("GH-96:1,GH-96:1", "GH-96,GH-96:1", 1),
            "is not a pool",
        ),  # fmt: skip
        (lambda text: text.replace(",2048,", ",20.5,", 1), "tokens_per_sample"),
        (lambda text: text + "x\n", "columns"),
    ],
)
def test_a_bad_results_file_is_one_line_naming_it(tmp_path, edit, words):
    question = _question(global_batches=(16,), available={"GH-96": 1})
    path = tmp_path / "sweep.csv"
    run_sweep(question, results=path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ProblemError) as error:
        run_sweep(question, results=path)
    message = str(error.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message


def test_a_capacity_results_file_is_not_read_as_a_sweep(tmp_path):
    path = tmp_path / "capacity.csv"
    answer_capacity(
        CapacityQuestion("OPT-350", 3e7, 16, {"GH-96": 1}, PRICES, budget=1e9),
        results=path,
    )
    with pytest.raises(ProblemError, match="not a sweep results file"):
        run_sweep(_question(available={"GH-96": 1}), results=path)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"models": ()}, "at least one model"),
        ({"models": ("OPT-350", "OPT-350")}, "a model twice"),
        ({"global_batches": (0,)}, "integers >= 1"),
        ({"global_batches": (16, 16)}, "a global batch twice"),
        ({"available": {}}, "no GPU type"),
        ({"tokens": -1.0}, "positive number"),
        ({"prices": PriceSheet("USD", {"GH-96": 3.0})}, "RTX-3090"),
    ],
)
def test_a_bad_sweep_is_one_line(changes, words):
    with pytest.raises(ProblemError, match=words):
        _question(**changes)


def test_the_command_line_prints_every_row_and_writes_the_file(tmp_path, capsys):
    results = tmp_path / "sweep.csv"
    args = ["sweep", "--models", "OPT-350", "--global-batch", "16,32",
            "--gpus-available", "GH-96:2", "--results", str(results)]  # fmt: skip
    assert main(args) in (0, None)
    out = capsys.readouterr().out
    assert out.count("OPT-350") >= 4 and f"wrote {results}" in out
    assert len(results.read_text().splitlines()) == 1 + 4
    assert main(args + ["--tokens", "30M", "--json"]) in (0, None)
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 4 and all(math.isfinite(r["time_s"]) for r in rows)
    assert all(r["cost"] is None for r in rows)  # no prices given
    assert main(["sweep", "--models", "OPT-350", "--global-batch", "0",
                 "--gpus-available", "GH-96:2"]) == 2  # fmt: skip
    assert main(["sweep", "--global-batch", "16", "--gpus-available", "GH-96:2"]) == 2


def test_a_type_the_model_cannot_be_priced_on_is_a_row_with_the_reason():
    """An RTX-2080 has no bf16 peak: its pools are rows with that reason,
    planned on no GPU, while the other type is planned; a capacity question
    alike; a model priced on no type is one line."""
    question = _question(
        global_batches=(16,),
        available={"GH-96": 2, "RTX-2080": 2},
        precision="bf16",
        prices=PriceSheet("USD", {"GH-96": 3.0, "RTX-2080": 0.2}),
    )
    rows = run_sweep(question)
    by_type = {next(iter(r.pool)): r for r in rows}
    assert "no bf16 peak" in by_type["RTX-2080"].planned.reason
    assert by_type["RTX-2080"].planned.search_s == 0.0
    assert by_type["GH-96"].planned.used is not None
    capacity = answer_capacity(
        CapacityQuestion(
            "OPT-350",
            3e7,
            16,
            {"GH-96": 2, "RTX-2080": 2},
            PriceSheet("USD", {"GH-96": 3.0, "RTX-2080": 0.2}),
            budget=1e9,
            precision="bf16",
        )  # fmt: skip
    )
    refused = [o for o in capacity.outcomes if "RTX-2080" in o.pool]
    assert refused and all("no bf16 peak" in o.reason for o in refused)
    assert "GH-96" in capacity.outcomes[capacity.choice].pool
    with pytest.raises(ProblemError, match="no bf16 peak") as error:
        run_sweep(_question(available={"RTX-2080": 2}, precision="bf16",
                            prices=None))  # fmt: skip
    assert "\n" not in str(error.value)
