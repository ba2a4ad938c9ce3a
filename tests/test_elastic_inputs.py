"""``pipedejavu elastic`` and ``goodput optimize`` inputs: documented ranges,
one line and exit 2 (issue 23)."""

from __future__ import annotations

import json

import pytest
from helpers import cli_help, run_cli

_CONFIG = {
    "elasticity": {
        "enabled": True,
        "max_train_batch_size": 2000,
        "micro_batch_sizes": [2, 4, 6],
        "min_gpus": 1,
        "max_gpus": 10000,
        "version": 0.2,
    }
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_CONFIG))
    return str(path)


@pytest.mark.parametrize(
    "world,expected",
    [
        ("-8", "[1, 1000000]"),
        ("0", "[1, 1000000]"),
        ("1000000000000", "[1, 1000000]"),
        ("x", "[1, 1000000]"),
        ("100000", "no global batch"),
    ],
)
def test_world_size_out_of_range_is_one_line_exit_2(config, capsys, world, expected):
    code, out, err = run_cli(capsys, "elastic", config, f"--world-size={world}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


def test_missing_world_size_says_which_option(config, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = run_cli(capsys, "elastic", config)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--world-size N" in err


def test_world_size_in_range_keeps_deepspeeds_answer(config, capsys):
    code, out, _ = run_cli(capsys, "elastic", config, "--world-size", "8")
    assert code == 0
    assert "global batch size 1680" in out and "at world size 8: 6" in out


_OPTIMIZE = [
    "goodput",
    "optimize",
    "--perf",
    "0.05,0.001,0.1,0.01,0.02,0.001,1.5",
    "--grad",
    "1,16",
    "--init-batch",
    "32",
    "--nodes",
    "1",
    "--replicas",
    "4",
]


@pytest.mark.parametrize(
    "change,expected",
    [
        (("--init-batch", "0"), "--init-batch must be an integer in [1,"),
        (("--init-batch", "10000000000000"), "--init-batch must be an integer"),
        (("--nodes", "0"), "--nodes must be 1 to 4096"),
        (("--replicas", "-3"), "--replicas must be 1 to 4096"),
        (("--replicas", "1e300"), "--replicas must be 1 to 4096"),
        (("--grad", "-1,2"), "--grad must be SQR,VAR"),
        (("--grad", "0,0"), "--grad must be SQR,VAR"),
        (("--max-batch-size", "-5"), "--max-batch-size must be an integer"),
        (("--atomic-bsz-range", "1,2,3"), "--atomic-bsz-range needs MIN,MAX"),
    ],
)
def test_optimize_out_of_range_is_one_line_exit_2(capsys, change, expected):
    argv = list(_OPTIMIZE)
    if change[0] in argv:
        del argv[argv.index(change[0]) : argv.index(change[0]) + 2]
    argv.append("=".join(change))  # "=": a value may start with "-"
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


def test_optimize_help_documents_grad_and_defaults(capsys):
    text = cli_help(capsys, "goodput", "optimize")
    assert "--grad SQR,VAR gradient statistics" in text
    assert "1..1,000,000,000" in text
    text = cli_help(capsys, "elastic")
    assert "(default: 0.16.5)" in text and "1..1,000,000" in text
