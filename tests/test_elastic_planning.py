"""Elastic mode (pipedejavu.planning.elastic)."""

from __future__ import annotations

import builtins
import json

import pytest

from pipedejavu.core.problem import ProblemError
from pipedejavu.planning.deepspeed_elastic import get_valid_gpus, is_valid_world_size
from pipedejavu.planning.elastic import elastic_counts, parse_gpu_range, plan_elastic
from pipedejavu.planning.elastic_report import (
    format_elastic,
    panel_names,
    plot_elastic,
)

COUNTS = [4, 8, 12]


@pytest.fixture(scope="module")
def result():
    return plan_elastic(
        "OPT-350",
        "GH-96",
        COUNTS,
        96,
        grad_params=(1.0, 2.0),
        init_batch=16,
        batch_multiple=16,
    )


def test_common_batch_valid_for_every_count(result):
    batch = result.common_batch
    assert batch is not None and batch <= result.max_global_batch
    chosen = [c for c in result.candidates if c.batch == batch and c.valid_for_all]
    assert chosen and result.common_choice in chosen
    gpn = result.gpus_per_node
    for c in chosen:
        mp = c.model_parallel_size
        # DeepSpeed's v0.2 sizes, checked against the rule itself.
        for n in COUNTS:
            assert n % mp == 0 and n // mp in c.valid_dp_sizes
            assert is_valid_world_size(batch, result.micro_batch_sizes, n, mp)
        nodes = get_valid_gpus(
            batch // (gpn // mp),
            [m for m in result.micro_batch_sizes if m <= batch // (gpn // mp)],
            COUNTS[0] // gpn,
            COUNTS[-1] // gpn,
        )
        assert all(n // gpn in nodes for n in COUNTS)
    for row in result.rows:
        plan = row.common
        assert plan is not None and plan.plan.gbs == batch
        assert row.common_valid and row.deepspeed_valid
        stages_tp = plan.plan.num_stages * plan.plan.stages[0].replicas[0].tp
        assert is_valid_world_size(
            batch, result.micro_batch_sizes, plan.plan.num_gpus, stages_tp
        )
        assert plan.plan.num_gpus <= row.gpus


def test_every_plan_fits_memory(result):
    for row in result.rows:
        assert row.best.training.prediction.fits_memory
        assert row.common.prediction.fits_memory
        assert row.best.training.plan.num_gpus <= row.gpus


def test_price_and_report(result):
    mean, worst = result.price()
    losses = [1 - r.common_goodput / r.best.goodput for r in result.rows]
    assert mean == pytest.approx(sum(losses) / len(losses))
    assert worst == pytest.approx(max(losses))
    # The chosen batch has the best mean ratio among the valid candidates.
    ratios = [c.mean_ratio for c in result.candidates if c.valid_for_all]
    assert max(ratios) == pytest.approx(1 - mean)
    out = json.loads(json.dumps(result.to_json()))
    assert out["common_batch"] == result.common_batch
    assert [r["gpus"] for r in out["rows"]] == COUNTS
    text = format_elastic(result)
    assert f"common batch {result.common_batch}" in text


def test_plot_degrades_without_matplotlib(result, monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ProblemError, match=r"pipedejavu\[plot\]"):
        plot_elastic(result, str(tmp_path / "x.png"))


def test_parse_range_and_counts():
    assert parse_gpu_range("GH-96:16..128") == ("GH-96", 16, 128)
    for bad in ("GH-96:16", "GH-96:8..4", "GH-96:0..4", ":1..2"):
        with pytest.raises(ProblemError, match="TYPE:LOW..HIGH"):
            parse_gpu_range(bad)
    assert elastic_counts(6, 17, 4) == [8, 12, 16]
    with pytest.raises(ProblemError, match="multiple of 4"):
        elastic_counts(5, 7, 4)


def test_range_without_a_batch_valid_everywhere_is_flagged():
    result = plan_elastic("OPT-350", "GH-96", [4, 12, 20], 48, batch_multiple=16)
    choice = result.common_choice
    assert choice is not None and not choice.valid_for_all
    # DeepSpeed's priority: the most valid counts (no candidate has all three).
    assert choice.valid_counts == max(c.valid_counts for c in result.candidates) < 3
    mp = choice.model_parallel_size
    flags = [r.deepspeed_valid for r in result.rows]
    assert flags == [
        n % mp == 0 and n // mp in choice.valid_dp_sizes for n in [4, 12, 20]
    ]
    assert sum(flags) == choice.valid_counts
    assert "NOT valid for every count" in format_elastic(result)
    assert result.to_json()["common_valid_for_all"] is False


def test_per_count_best_is_never_beaten_and_prices_are_not_negative():
    # Issue 23: the DeepSpeed batch 288 (off the 128-grid) beat the grid's best
    # at 12 GPUs (127.3 > 106.3 samples/s): a negative price.
    lines = []
    result = plan_elastic(
        "OPT-350",
        "GH-96",
        [4, 8, 12],
        300,
        batch_multiple=128,
        progress_fn=lines.append,
    )
    for row in result.rows:
        assert row.best.goodput >= row.common_goodput
        assert row.best.throughput == pytest.approx(
            row.best.global_batch / row.best.training.iteration_time_s
        )
    mean, worst = result.price()
    assert 0 <= mean <= worst <= 1
    assert all(0 <= c.mean_ratio <= 1 + 1e-12 for c in result.candidates)
    # An estimate up front, progress per count, and model-parallel sizes that
    # agree between the progress lines and the summary.
    assert lines[0].startswith(
        "elastic mode: OPT-350 on GH-96, counts [4, 8, 12]: 3 GPU counts"
    )
    assert any("s more" in line for line in lines)
    text = format_elastic(result)
    for line in lines:
        if line.startswith("[") and "DeepSpeed batch" in line:
            batch = line.split("DeepSpeed batch ")[1].split()[0]
            sizes = line.split("size(s) ")[1].split(")")[0]
            assert f"batch {batch} (max" in text
            assert any(
                f"batch {batch} (max" in t and f"size(s) {sizes})" in t
                for t in text.splitlines()
            )
    assert panel_names(result) == ["throughput"]


def test_goodput_panel_only_with_gradient_statistics(result):
    assert panel_names(result) == ["throughput", "goodput"]


def test_common_plans_on_fewer_gpus_are_shown(result):
    text = format_elastic(result)
    for row in result.rows:
        if row.common is not None and row.common.plan.num_gpus < row.gpus:
            assert f"uses {row.common.plan.num_gpus} of {row.gpus} GPUs" in text
