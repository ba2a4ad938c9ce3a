"""benchmarks/gpu_blocks.py without a GPU: its grid, predictions, time estimate,
device names and summary; the whole CPU smoke run where PyTorch is installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pipedejavu.io.gpu_sheet import load_gpu_sheet

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "gpu_blocks", ROOT / "benchmarks" / "gpu_blocks.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_blocks"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_blocks = _benchmark()
SHEET = load_gpu_sheet()


def test_grid_names_are_unique_and_every_group_is_there():
    grid = gpu_blocks.default_grid()
    names = [config.name for config in grid]
    assert len(set(names)) == len(names)
    groups = {(config.style, config.group) for config in grid}
    assert groups == {
        ("gpt", "bf16-flash"),
        ("gpt", "bf16-unfused"),
        ("gpt", "fp32-unfused"),
        ("llama", "bf16-flash"),
    }


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200"])
def test_default_grid_fits_the_budget_with_room(gpu):
    grid = gpu_blocks.default_grid()
    seconds = sum(
        gpu_blocks.estimate_seconds(
            gpu_blocks.predict(config, SHEET[gpu]), config, 3, 10, 3, 2.0
        )
        for config in grid
    )
    assert 30 < seconds < 180


@pytest.mark.parametrize("smoke", [False, True])
def test_predictions_are_the_layer_times_and_their_ops_add_up(smoke):
    grid = gpu_blocks.smoke_grid() if smoke else gpu_blocks.default_grid()
    for config in grid:
        prediction = gpu_blocks.predict(config, SHEET["H100-SXM"])
        for part in ("forward", "backward"):
            total = prediction[f"{part}_ms"]
            ops = sum(ms for _, ms in prediction["ops_ms"][part])
            assert total > 0
            np.testing.assert_allclose(ops, total, rtol=1e-9)
        assert prediction["activation_bytes"] < 40e9
        expected = "bf16" if config.precision == "bf16" else "fp32"
        assert prediction["constants"] == gpu_blocks.constants_for(expected)[0]


@pytest.mark.parametrize(
    ("device_name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH-96"),
        ("NVIDIA A100-SXM4-80GB", "A100-80"),
        ("NVIDIA A100 80GB PCIe", "A100-80"),
        ("NVIDIA A100-SXM4-40GB", "A100-40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("Tesla V100-SXM2-32GB", "V100-32"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA H100 NVL", None),
        ("Some Other GPU", None),
    ],
)
def test_device_names_map_to_sheet_entries(device_name, entry):
    assert gpu_blocks.sheet_name_for(device_name) == entry
    assert entry is None or entry in SHEET


def test_summary_groups_and_signs():
    def row(precision, flash, error):
        config = gpu_blocks.gpt_config(1024, 1024, 1, precision, flash)
        return {
            "status": "ok",
            "config": {**config.__dict__},
            "error": {"forward": error, "backward": error, "forward_backward": error},
        }

    rows = [row("bf16", True, 0.1), row("bf16", True, -0.3), row("fp32", False, 0.2)]
    rows.append({"status": "oom", "config": rows[0]["config"]})
    summary = gpu_blocks.summarize(rows)
    assert summary["all"]["count"] == 3
    np.testing.assert_allclose(summary["all"]["forward_backward"]["max_abs"], 0.3)
    np.testing.assert_allclose(summary["bf16-flash"]["forward"]["median_signed"], -0.1)
    np.testing.assert_allclose(summary["fp32-unfused"]["backward"]["median_abs"], 0.2)


@pytest.mark.slow
def test_smoke_run_writes_every_row(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "smoke.json"
    assert gpu_blocks.main(["--smoke", "--out", str(out), "--no-profile"]) == 0
    result = json.loads(out.read_text())
    assert result["date"] and result["machine"]
    assert [row["status"] for row in result["rows"]] == ["ok"] * len(
        gpu_blocks.smoke_grid()
    )
    assert "summary: |predicted / measured - 1|" in capsys.readouterr().out
