"""``pipedejavu costmodel report|predict`` and ``profile`` as a user meets them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import forbid_call, run_cli

from pipedejavu.core.errors import ProblemError


def test_report_json_lists_every_fit_and_meets_the_target(capsys, tmp_path):
    code, out, err = run_cli(
        capsys, "costmodel", "report", "bundled", "--json", "--plot", tmp_path
    )
    assert code == 0
    data = json.loads(out)
    fits = data["fits"]
    # 4 collectives x (group shapes x 2 dtypes) over 6 meshes: 248 curves.
    assert len(fits) == 248
    mapes = [f["cv_mape"] for f in fits if f.get("cv_mape") is not None]
    assert len(mapes) >= 240
    assert np.median(mapes) <= 0.10
    np.testing.assert_allclose(data["summary"]["median_cv_mape"], np.median(mapes))
    pngs = sorted(p.name for p in tmp_path.iterdir())
    assert len(pngs) == 6 and all(name.endswith(".png") for name in pngs)


def test_report_missing_file_is_bad_input(capsys, tmp_path):
    code, _, err = run_cli(capsys, "costmodel", "report", tmp_path / "nope.pkl")
    assert code == 2 and "nope.pkl" in err


def test_predict_generated_example_json(capsys):
    code, out, _ = run_cli(
        capsys,
        "costmodel",
        "predict",
        "generated-gpt-32layers-2x8",
        "--fraction",
        "0.25",
        "--seeds",
        "2",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["optimum"] > 0
    text = json.dumps(report)
    assert "0.25" in text


def test_predict_bad_fraction_is_bad_input(capsys):
    code, _, err = run_cli(
        capsys, "costmodel", "predict", "generated-gpt-32layers-2x8", "--fraction", "2"
    )
    assert code == 2 and "fraction" in err


def test_profile_writes_a_solvable_problem(capsys, tmp_path):
    out = tmp_path / "micro.npz"
    code, text, _ = run_cli(
        capsys, "profile", "--model", "gpt-micro", "--out", out, "--repeats", "2"
    )
    assert code == 0 and "block0" in text
    code, text, _ = run_cli(capsys, "solve", out, "--json")
    assert code == 0
    plan = json.loads(text)
    assert plan["stages"][-1]["stop"] == 4 and plan["cost"] > 0


def test_profile_unknown_model_is_bad_input(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "profile", "--model", "gpt-huge", "--out", tmp_path / "x.npz"
    )
    assert code == 2 and "gpt-tiny" in err


def test_profile_bad_cluster_is_refused_before_profiling(capsys, tmp_path, monkeypatch):
    # issue 23: a 3x3 cluster was refused only after ~17 s of profiling
    from pipedejavu.costmodel.profiling import layer_problem

    forbid_call(
        monkeypatch,
        layer_problem,
        "profile_model",
        "profiled before checking the cluster",
    )
    code, _, err = run_cli(
        capsys,
        "profile",
        "--model",
        "gpt-micro",
        "--cluster",
        "3x3",
        "--out",
        tmp_path / "x.npz",
    )
    assert code == 2 and "3x3" in err and "power-of-two" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ProblemError, match="power-of-two"):
        layer_problem.profile_to_problem("gpt-micro", cluster=(3, 3))
    with pytest.raises(ValueError, match="num_microbatches"):
        layer_problem.profile_to_problem("gpt-micro", num_microbatches=0)
