"""``pipedejavu goodput fit|optimize`` and ``pipedejavu elastic``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from pipedejavu.costmodel.goodput.function import GoodputFunction
from pipedejavu.planning.deepspeed_elastic import compute_elastic_config

_STEPS = """num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time,note
1,1,32,0.11,0.12,a
1,2,32,0.11,0.16,b
1,4,32,0.11,0.17,
2,8,32,0.11,0.31,
1,1,64,0.15,0.16,
1,4,64,0.15,0.21,
2,8,64,0.15,0.36,
4,16,64,0.15,0.42,
"""


def test_elastic_prints_deepspeeds_answer(tmp_path, capsys):
    config = {
        "elasticity": {
            "enabled": True,
            "max_train_batch_size": 2000,
            "micro_batch_sizes": [2, 4, 6],
            "version": 0.1,
        }
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code, out, _ = run_cli(capsys, "elastic", str(path), "--world-size", "8", "--json")
    assert code == 0
    batch, valid, micro = compute_elastic_config(config, "0.16.5", world_size=8)
    assert json.loads(out) == {
        "final_batch_size": batch,
        "valid_gpus": valid,
        "version": 0.1,
        "micro_batch_size": micro,
    }
    code, out, _ = run_cli(capsys, "elastic", str(path))
    assert code == 0 and "global batch size 1680" in out
    code, out, err = run_cli(capsys, "elastic", str(path), "--world-size", "9")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "ElasticityIncompatibleWorldSize" in err


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"elasticity": 3', "invalid JSON"),
        ('{"train_batch_size": 8}', "'elasticity' is missing"),
        ('{"elasticity": {"enabled": true}}', "missing max_train_batch_size"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_elastic_bad_config_is_one_line_and_exit_2(tmp_path, capsys, text, expected):
    path = tmp_path / "ds.json"
    path.write_text(text)
    code, out, err = run_cli(capsys, "elastic", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and str(path) in err and expected in err


def test_goodput_optimize_matches_the_library(capsys):
    perf = (0.05, 0.001, 0.1, 0.01, 0.02, 0.001, 1.5)
    argv = [
        "goodput",
        "optimize",
        "--perf",
        ",".join(map(str, perf)),
        "--grad",
        "0.5,2.0",
        "--init-batch",
        "128",
        "--nodes",
        "1,1,2",
        "--replicas",
        "1,4,8",
        "--max-batch-size",
        "4096",
        "--atomic-bsz-range",
        "16,256",
        "--accumulation",
        "--json",
    ]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    rows = json.loads(out)
    fn = GoodputFunction(perf, (0.5, 2.0), 128)
    goodput, atomic, accum = fn.optimize(
        np.array([1, 1, 2]), np.array([1, 4, 8]), 4096, (16, 256), True
    )
    assert [r["atomic_bsz"] for r in rows] == atomic.tolist()
    assert [r["accum_steps"] for r in rows] == accum.tolist()
    np.testing.assert_allclose([r["goodput"] for r in rows], goodput, rtol=1e-15)
    for row in rows:
        np.testing.assert_allclose(
            row["throughput"] * row["efficiency"], row["goodput"], rtol=1e-12
        )
    code, out, _ = run_cli(capsys, *argv[:-1])
    assert code == 0 and "goodput" in out.splitlines()[0]


@pytest.mark.parametrize(
    "change,expected",
    [
        (("--perf", "1,2"), "--perf needs 7 numbers"),
        (("--perf", "0.05,-1,0.1,0.01,0.02,0.001,1.5"), "must be seconds in"),
        (("--perf", "1e308,0.001,0.1,0.01,0.02,0.001,1.5"), "must be seconds in"),
        (("--perf", "0.05,0.001,0.1,0.01,0.02,0.001,0.5"), "gamma must be in"),
        (("--grad", "1,x"), "--grad must be comma-separated numbers"),
        (("--nodes", "3"), "num_nodes must not exceed num_replicas"),
        (("--max-batch-size", "5"), "--max-batch-size must be at least --init-batch"),
    ],
)
def test_goodput_optimize_bad_arguments(capsys, change, expected):
    argv = {
        "--perf": "0.05,0.001,0.1,0.01,0.02,0.001,1.5",
        "--grad": "0.5,2.0",
        "--init-batch": "128",
        "--nodes": "1",
        "--replicas": "2",
    }
    argv[change[0]] = change[1]
    flat = ["goodput", "optimize", *[x for kv in argv.items() for x in kv]]
    code, out, err = run_cli(capsys, *flat)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


def test_goodput_fit_reads_a_csv_and_feeds_optimize(tmp_path, capsys):
    steps = tmp_path / "steps.csv"
    steps.write_text(_STEPS)
    code, out, _ = run_cli(capsys, "goodput", "fit", str(steps), "--json")
    assert code == 0
    fitted = json.loads(out)
    assert fitted["num_measurements"] == 8
    assert set(fitted["perf_params"]) == {
        "alpha_c",
        "beta_c",
        "alpha_n",
        "beta_n",
        "alpha_r",
        "beta_r",
        "gamma",
    }
    # Two atomic sizes: accum time 0.11 at 32 and 0.15 at 64, fitted exactly.
    np.testing.assert_allclose(fitted["perf_params"]["beta_c"], 0.04 / 32, rtol=1e-3)
    perf = tmp_path / "perf.json"
    perf.write_text(out)
    code, out, _ = run_cli(
        capsys,
        "goodput",
        "optimize",
        "--perf",
        str(perf),
        "--grad",
        "0.5,2",
        "--init-batch",
        "64",
        "--nodes",
        "1",
        "--replicas",
        "4",
        "--max-batch-size",
        "1024",
        "--json",
    )
    assert code == 0 and json.loads(out)[0]["num_replicas"] == 4


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "empty file"),
        ("num_nodes,num_replicas\n1,2\n", "missing column(s) atomic_bsz"),
        (
            "num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time\n"
            "1,1,8,0.1,nan\n",
            "line 2: optim_step_time must be finite",
        ),
        (
            "num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time\n"
            "1,1,x,0.1,0.2\n",
            "line 2: atomic_bsz must be a number",
        ),
        (
            "num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time\n",
            "no measurements",
        ),
        (
            "num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time\n"
            "1,1,8,-0.1,0.2\n",
            "accum_step_time must be positive",
        ),
    ],
)
def test_goodput_fit_bad_csv_is_one_line_and_exit_2(tmp_path, capsys, text, expected):
    path = tmp_path / "steps.csv"
    path.write_text(text)
    code, out, err = run_cli(capsys, "goodput", "fit", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and str(path) in err and expected in err, err


def test_goodput_fit_bounds_the_file_size(tmp_path, capsys, monkeypatch):
    import pipedejavu.cli.goodput as cli_goodput

    monkeypatch.setattr(cli_goodput, "MAX_CSV_BYTES", 100)
    path = tmp_path / "steps.csv"
    path.write_text(_STEPS)
    code, _, err = run_cli(capsys, "goodput", "fit", str(path))
    assert code == 2 and "larger than 100 bytes" in err
