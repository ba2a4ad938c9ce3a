"""init-search's inputs: documented ranges, a memory limit checked before any
work, one line and exit 2 for anything out of range (issue 23)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from helpers import cli_help, forbid_call, load_benchmark, run_cli

from pipedejavu.core.errors import ProblemError
from pipedejavu.init_search.limits import INT_RANGES, population_bytes
from pipedejavu.init_search.summary import mean_ci


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--num-workers", "100000000", "--seeds", "1"], "[2, 4096]"),
        (["--num-workers", "1"], "[2, 4096]"),
        (["--seeds", "0"], "[1, 100]"),
        (["--seeds", "1000000"], "[1, 100]"),
        (["--epochs", "-3"], "[2, 100000]"),
        (["--rounds", "0"], "[1, 1000]"),
        (["--keep", "0"], "[1, 4095]"),
        (["--chunk-epochs", "99999999"], "[1, 1000]"),
        (["--batch-size", "0"], "[1, 65536]"),
        (["--seed", "-1"], "[0, 2147483647]"),
        (["--resample-scale", "nan"], "(0, 1]"),
        (["--shrink", "2"], "(0, 1]"),
        (["--learning-rate", "inf"], "(0, 10]"),
        (["--memory-limit-gb", "0"], "(0, 1024]"),
        (["--target", "nan"], "finite numbers > 0"),
        (["--target", ","], "finite numbers > 0"),
        (["--num-workers", "2048", "--epochs", "1000"], "<= 1,000,000"),
    ],
)
def test_out_of_range_is_one_line_exit_2(argv, expected, capsys):
    code, out, err = run_cli(capsys, "init-search", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


def test_memory_limit_refuses_before_any_work(capsys, monkeypatch):
    import pipedejavu.init_search.strategies as strategies

    # nothing may be allocated
    forbid_call(monkeypatch, strategies, "device_data", "device_data called")
    code, out, err = run_cli(
        capsys,
        "init-search",
        "--num-workers",
        "4096",
        "--epochs",
        "200",
        "--seeds",
        "1",
    )
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "over the memory limit of 2 GiB" in err and "--memory-limit-gb" in err
    code, _, err = run_cli(
        capsys, "init-search", "--memory-limit-gb", "0.001", "--seeds", "1"
    )
    assert code == 2 and "over the memory limit of 0.001 GiB" in err


def test_run_strategies_checks_memory_before_allocating(monkeypatch):
    import pipedejavu.init_search.strategies as strategies
    from pipedejavu.init_search import (
        InitSearchConfig,
        TrainConfig,
        load_digits,
        model_config,
    )

    monkeypatch.setattr(
        strategies, "device_data", lambda *a: pytest.fail("allocated anyway")
    )
    config = InitSearchConfig(
        num_workers=64, epochs=4, demo_epochs=1, rounds=1, memory_limit_gb=0.001
    )
    with pytest.raises(ProblemError, match="memory limit"):
        strategies.run_strategies(
            load_digits(), TrainConfig(model_config("mlp-small")), config, key=None
        )


def test_config_ranges():
    from pipedejavu.init_search import InitSearchConfig, TrainConfig

    with pytest.raises(ValueError, match=r"num_workers must be an integer in"):
        InitSearchConfig(num_workers=10**8)
    with pytest.raises(ValueError, match="memory_limit_gb"):
        InitSearchConfig(memory_limit_gb=float("nan"))
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig(learning_rate=1e9)


def test_memory_estimate_grows_with_the_workers():
    sizes = (1079, 359, 359)
    small = population_bytes(10, (64, 64), 64, 10, 64, sizes)
    assert population_bytes(20, (64, 64), 64, 10, 64, sizes) > small
    # 10**8 workers: terabytes, as the allocation that failed in issue 23
    assert population_bytes(10**8, (64, 64), 64, 10, 64, sizes) > 2**40


def test_init_search_help_documents_ranges_and_defaults(capsys):
    text = cli_help(capsys, "init-search")
    for option in ("--num-workers", "--seeds", "--epochs", "--rounds", "--keep"):
        assert re.search(re.escape(option) + r" N .*?\d\.\.\d", text), option
    assert "(default: 8)" in text and "(default: 2.0)" in text
    assert "--memory-limit-gb" in text
    low, high = INT_RANGES["num_workers"]
    assert f"{low:,}..{high:,}" in text


def test_positive_quantities_have_positive_intervals():
    # two wall times far apart: the Student-t interval starts below zero
    values = [0.5, 60.0]
    assert mean_ci(values)["ci95"][0] < 0
    low, high = mean_ci(values, positive=True)["ci95"]
    assert 0 < low < np.mean(values) < high
    assert math.isclose(math.sqrt(low * high), math.sqrt(0.5 * 60.0))


def test_candidates_plot_has_a_legend(tmp_path):
    pytest.importorskip("matplotlib")
    from pipedejavu.init_search import plots

    handles = plots.candidate_legend("refine")
    assert [h.get_label() for h in handles] == [
        "final pick",
        "trained to end",
        "discarded",
    ]


def test_benchmark_default_output_is_a_new_dated_file(tmp_path):
    from datetime import datetime, timezone

    module = load_benchmark("init_search", "bench_init_search")
    assert "--out benchmarks/results/init_search.json" in " ".join(
        module.__doc__.split()
    )
    now = datetime(2027, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    first = module.default_out(now, tmp_path)
    assert first.name == "init_search-20270102-030405.json"
    first.write_text("{}")
    assert (
        module.default_out(now, tmp_path).name == "init_search-20270102-030405-1.json"
    )
    assert module.default_out(now).name != "init_search.json"
