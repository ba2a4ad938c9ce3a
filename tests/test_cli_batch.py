"""``pipedejavu plan`` in goodput and elastic mode: outputs, JSON, exit codes."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from pipedejavu.planning.batch import plan_goodput


def test_goodput_mode_json_matches_api(capsys):
    argv = ["plan", "--model", "OPT-350", "--gpus", "GH-96:4", "--goodput-grad"]
    argv += ["1,2", "--init-batch", "8", "--max-global-batch", "32"]
    code, out, err = run_cli(capsys, *argv, "--batch-multiple", "8", "--json")
    assert code == 0 and "goodput mode" in err
    data = json.loads(out)
    expected = plan_goodput("OPT-350", {"GH-96": 4}, (1, 2), 8, 32, batch_multiple=8)
    assert data["goodput"]["global_batch"] == expected.global_batch
    assert data["goodput"]["goodput"] == pytest.approx(expected.goodput)
    assert data["gbs"] == expected.global_batch
    assert data["goodput"]["noise_scale"] == pytest.approx(16.0)
    code, out, _ = run_cli(capsys, *argv, "--batch-multiple", "8")
    assert code == 0 and f"global batch {expected.global_batch} of 4" in out


def test_elastic_mode_text_json_and_plot(capsys, tmp_path):
    argv = ["plan", "--model", "OPT-350", "--gpus", "GH-96:4..9", "--elastic"]
    argv += ["--max-global-batch", "32", "--batch-multiple", "16"]
    code, out, err = run_cli(capsys, *argv, "--json", "--plot", tmp_path / "e.png")
    assert code == 0
    data = json.loads(out)
    assert [r["gpus"] for r in data["rows"]] == [4, 8]
    assert all(r["common_valid"] and r["common_fits_memory"] for r in data["rows"])
    assert (tmp_path / "e.png").read_bytes().startswith(b"\x89PNG")
    assert f"plot written to {tmp_path / 'e.png'}" in err
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and f"common batch {data['common_batch']}" in out


def test_elastic_plot_failure_exits_non_zero(capsys, tmp_path):
    argv = ["plan", "--model", "OPT-350", "--gpus", "GH-96:4..9", "--elastic"]
    argv += ["--max-global-batch", "32", "--batch-multiple", "16"]
    target = tmp_path / "no-such-folder" / "e.png"
    code, out, err = run_cli(capsys, *argv, "--plot", target)
    assert code == 1 and "no plot written" in err
    assert "common batch" in out  # the plan is still printed
    assert not target.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--global-batch"),
        (["--goodput-grad", "1"], "SQR,VAR"),
        (["--goodput-grad", "1,2"], "--init-batch"),
        (["--goodput-grad", "1,2", "--init-batch", "4"], "--max-global-batch"),
        (["--elastic", "--global-batch", "8"], "TYPE:LOW..HIGH"),
        (["--global-batch", "8", "--plot", "x.txt"], "ending in .png or .svg"),
        (
            ["--goodput-grad", "1,2", "--init-batch", "4"]
            + ["--max-global-batch", "16", "--plot", "x.png"],
            "not goodput mode",
        ),
        (["--goodput-grad", "1,2", "--export", "megatron"], "--export takes"),
    ],
)
def test_bad_input_exits_2(capsys, extra, message):
    code, out, err = run_cli(
        capsys, "plan", "--model", "OPT-350", "--gpus", "GH-96:4", *extra
    )
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1
