"""Capacity planning over pools mixing two GPU types (``plan --gpus-available
... --mixed-types``): the pairs are candidates beside the single types, each
planned as ``plan --mixed-types`` plans that pool, and a mix is chosen where
no single type meets the deadline."""

from __future__ import annotations

import json
import math

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.price_sheet import PriceSheet
from pipedejavu.planning.capacity import (
    CapacityQuestion,
    answer_capacity,
    candidate_pools,
    without_clock,
)
from pipedejavu.planning.plan_model import plan_model


def test_mixed_candidates_pair_the_types_at_whole_nodes():
    sheet = load_gpu_sheet()
    available = {"H100-SXM": 16, "A100-80": 8, "GH-96": 2}
    single = candidate_pools(available, sheet)
    mixed = candidate_pools(available, sheet, mixed=True)
    assert mixed[: len(single)] == single
    pairs = mixed[len(single) :]
    assert all(len(pool) == 2 for pool in pairs)
    # H100 and A100 nodes hold 8: whole nodes; GH-96 nodes 4: its most, 2
    assert pairs == [
        {"H100-SXM": 8, "A100-80": 8},
        {"H100-SXM": 16, "A100-80": 8},
        {"H100-SXM": 8, "GH-96": 2},
        {"H100-SXM": 16, "GH-96": 2},
        {"A100-80": 8, "GH-96": 2},
    ]
    given = candidate_pools({"H100-SXM": 16, "A100-80": 8}, sheet, (4, 8), mixed=True)
    assert given[4:] == [
        {"H100-SXM": 4, "A100-80": 4},
        {"H100-SXM": 4, "A100-80": 8},
        {"H100-SXM": 8, "A100-80": 4},
        {"H100-SXM": 8, "A100-80": 8},
    ]
    many = {f"type{i}": 1 << 20 for i in range(16)}  # 120 pairs x 36
    with pytest.raises(ProblemError, match="candidate pools"):
        candidate_pools(many, _AllH100(sheet), (1, 2, 4, 8, 16, 32), True)


class _AllH100:
    """A sheet answering every name with the H100's entry."""

    def __init__(self, sheet):
        self.sheet = sheet

    def __getitem__(self, name):
        return self.sheet["H100-SXM"]


PRICES = PriceSheet("USD", {"H100-SXM": 2.5, "A100-80": 1.6})


def test_a_mix_is_chosen_where_no_single_type_meets_the_deadline():
    """Llama-3-8B on 16 H100 and 16 A100-80: the mixed pool is planned as
    ``plan --mixed-types`` plans it, runs faster than either type alone, and
    a deadline between the mix's time and the fastest single type's is met
    by the mix alone (and by nothing without ``mixed``)."""
    pool = {"H100-SXM": 16, "A100-80": 16}
    direct = plan_model("Llama-3-8B", pool, 256, mixed_types=True).result
    assert set(direct.plan.gpus_by_type()) == set(pool)  # both types used
    fields = dict(
        model="Llama-3-8B",
        tokens=256 * 8192 * 100,
        global_batch=256,
        available=pool,
        prices=PRICES,
        counts=(16,),
    )
    loose = answer_capacity(CapacityQuestion(**fields, deadline_s=1e9, mixed=True))
    assert [o.pool for o in loose.outcomes] == [
        {"H100-SXM": 16}, {"A100-80": 16}, pool
    ]  # fmt: skip
    single, _, mix = loose.outcomes
    assert mix.iteration_s == direct.prediction.iteration_time_s
    assert mix.used == direct.plan.gpus_by_type() and mix.proven == direct.proven
    assert mix.time_s == pytest.approx(100 * mix.iteration_s, rel=1e-12)
    assert mix.cost == pytest.approx(mix.time_s / 3600 * 16 * (2.5 + 1.6), rel=1e-12)
    assert mix.time_s < min(o.time_s for o in loose.outcomes[:2])
    deadline = (mix.time_s + single.time_s) / 2
    tight = answer_capacity(CapacityQuestion(**fields, deadline_s=deadline, mixed=True))
    assert tight.choice == 2 and tight.outcomes[2].time_s <= deadline
    with pytest.raises(InfeasibleProblemError, match="no allocation finishes"):
        answer_capacity(CapacityQuestion(**fields, deadline_s=deadline))
    assert not math.isinf(tight.outcomes[tight.choice].cost)


def test_the_cli_plans_the_mixed_pools_with_mixed_types(tmp_path, capsys):
    prices = tmp_path / "prices.json"
    prices.write_text(
        json.dumps({"currency": "USD", "per_gpu_hour": {"GH-96": 3.0, "RTX-3090": 0.3}})
    )
    base = ["plan", "--model", "OPT-350", "--global-batch", "16", "--tokens", "30M"]
    base += ["--gpus-available", "GH-96:2,RTX-3090:2", "--prices", str(prices)]
    base += ["--deadline", "10d", "--counts", "1,2", "--json"]
    assert main(base) in (0, None)
    alone = json.loads(capsys.readouterr().out)
    assert main(base + ["--mixed-types"]) in (0, None)
    mixed = json.loads(capsys.readouterr().out)
    assert not alone["mixed"] and mixed["mixed"]
    assert len(alone["candidates"]) == 4
    assert without_clock(mixed["candidates"][:4]) == without_clock(alone["candidates"])
    pools = [c["pool"] for c in mixed["candidates"]]
    assert pools[4:] == [{"GH-96": g, "RTX-3090": r} for g in (1, 2) for r in (1, 2)]


def test_a_sweep_with_mixed_types_plans_the_same_mixed_pools():
    """``sweep --mixed-types``: the mixed pools are rows beside the single
    types, each planned as the capacity question plans it."""
    from pipedejavu.planning.plan_sweep import SweepQuestion, run_sweep

    available = {"GH-96": 2, "RTX-3090": 2}
    prices = PriceSheet("USD", {"GH-96": 3.0, "RTX-3090": 0.3})
    rows = run_sweep(
        SweepQuestion(("OPT-350",), (16,), available, counts=(1, 2), mixed=True)
    )
    answer = answer_capacity(
        CapacityQuestion(
            "OPT-350",
            30e6,
            16,
            available,
            prices,
            deadline_s=1e9,
            counts=(1, 2),
            mixed=True,
        )  # fmt: skip
    )
    assert [r.pool for r in rows] == [o.pool for o in answer.outcomes]
    assert sum(len(r.pool) == 2 for r in rows) == 4
    for row, outcome in zip(rows, answer.outcomes, strict=True):
        assert row.planned.used == outcome.used
        assert row.planned.iteration_s == outcome.iteration_s


def test_the_report_lines_up_mixed_pools(tmp_path, capsys):
    """The text report's columns stay in line with pools' longer names."""
    prices = tmp_path / "prices.json"
    prices.write_text(
        json.dumps(
            {"currency": "USD", "per_gpu_hour": {"RTX-3090": 0.3, "RTX-2080": 0.2}}
        )
    )
    argv = ["plan", "--model", "OPT-350", "--global-batch", "16", "--tokens", "30M"]
    argv += ["--gpus-available", "RTX-3090:2,RTX-2080:2", "--prices", str(prices)]
    argv += ["--deadline", "100d", "--counts", "2", "--mixed-types"]
    assert main(argv) in (0, None)
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if "rented" in line)
    rows = lines[head + 1 : head + 4]  # RTX-3090:2, RTX-2080:2, the mix
    assert "RTX-3090:2,RTX-2080:2 " in rows[2]  # (21 characters)
    column = lines[head].index("rented")
    for row in (rows[0], rows[2]):  # (RTX-2080 alone has no plan)
        assert row[column - 1] == " " and row[column] != " "  # rented starts there
