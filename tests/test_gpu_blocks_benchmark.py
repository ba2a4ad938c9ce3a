"""benchmarks/gpu_blocks.py without a GPU: its grid, predictions, time estimate,
device names and summary; the whole CPU smoke run where PyTorch is installed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import load_benchmark

from pipedejavu.io.gpu_sheet import load_gpu_sheet

gpu_blocks = load_benchmark("gpu_blocks")
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


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("gpu", ["H100-SXM", "H200"])
def test_default_grid_fits_the_budget_with_room(gpu, split):
    grid = gpu_blocks.default_grid()
    seconds = sum(
        gpu_blocks.estimate_seconds(
            gpu_blocks.predict(config, SHEET[gpu]),
            config,
            3,
            10,
            3,
            2.0,
            split=gpu_blocks.predict_split(config, SHEET[gpu]) if split else None,
        )
        for config in grid
    )
    assert 30 < seconds < 180


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200"])
def test_split_estimate_adds_less_than_a_second_step(gpu):
    for config in gpu_blocks.smoke_grid() + gpu_blocks.default_grid()[::7]:
        prediction = gpu_blocks.predict(config, SHEET[gpu])
        split = gpu_blocks.predict_split(config, SHEET[gpu])
        args = (prediction, config, 3, 10, 3, 2.0)
        plain = gpu_blocks.estimate_seconds(*args)
        with_split = gpu_blocks.estimate_seconds(*args, split=split)
        assert plain < with_split < 2 * plain


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("gpu", ["H100-SXM", "H200", "A100-80"])
def test_predicted_split_adds_up_to_the_backward(smoke, gpu):
    grid = gpu_blocks.smoke_grid() if smoke else gpu_blocks.default_grid()
    for config in grid:
        prediction = gpu_blocks.predict(config, SHEET[gpu])
        split = gpu_blocks.predict_split(config, SHEET[gpu])
        assert 0 < split["weight_gradient_share"] < 1
        assert 0 < split["input_backward_ms"] < split["backward_ms"]
        np.testing.assert_allclose(split["backward_ms"], prediction["backward_ms"])
        np.testing.assert_allclose(
            split["input_backward_ms"] + split["weight_gradient_ms"],
            prediction["backward_ms"],
            rtol=1e-12,
        )
        np.testing.assert_allclose(
            split["weight_gradient_share"],
            split["weight_gradient_ms"] / prediction["backward_ms"],
            rtol=1e-12,
        )
        # W is the weight-gradient operations of the backward, priced alone.
        names = [name for name, _ in split["weight_gradient_ops_ms"]]
        assert "grad_accumulate" in names
        assert all(n.endswith(".wgrad") or n == "grad_accumulate" for n in names)
        w_ops = sum(
            ms
            for name, ms in prediction["ops_ms"]["backward"]
            if gpu_blocks.is_weight_gradient(_Named(name))
        )
        np.testing.assert_allclose(split["weight_gradient_ms"], w_ops, rtol=1e-9)
        np.testing.assert_allclose(
            sum(ms for _, ms in split["weight_gradient_ops_ms"]), w_ops, rtol=1e-9
        )
        assert (
            0
            < split["weight_gradient_gemm_flops"]
            < (prediction["gemm_flops"]["backward"])
        )


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


class _Named:
    """An operation with a name only: what is_weight_gradient reads."""

    def __init__(self, name):
        self.name = name


def _split_prediction(backward_ms=10.0, weight_ms=4.0):
    return {
        "backward_ms": backward_ms,
        "input_backward_ms": backward_ms - weight_ms,
        "weight_gradient_ms": weight_ms,
        "weight_gradient_share": weight_ms / backward_ms,
    }


def test_split_record_by_hand():
    measured = {
        "input_backward_ms": {"median": 8.0, "min": 7.5},
        "flops": {
            "backward": {"aten.mm": 600, "aten.bmm": 40},
            "input_backward": {"aten.mm": 300, "aten.bmm": 40},
        },
    }
    record = gpu_blocks.split_record(_split_prediction(), 12.0, measured)
    meas, err = record["measured"], record["error"]
    np.testing.assert_allclose(meas["weight_gradient_ms"], 4.0)
    np.testing.assert_allclose(meas["weight_gradient_share"], 1 / 3)
    assert meas["skipped_flops"] == 300
    assert meas["input_backward_ms"] == {"median": 8.0, "min": 7.5}
    np.testing.assert_allclose(err["share_pp"], 100 * (0.4 - 1 / 3))
    np.testing.assert_allclose(err["weight_gradient"], 0.0, atol=1e-12)
    np.testing.assert_allclose(err["input_backward"], 6.0 / 8.0 - 1)
    assert "split" not in measured and "weight_gradient_ms" not in measured


def test_split_record_without_a_positive_measured_w():
    measured = {
        "input_backward_ms": {"median": 10.5, "min": 10.0},
        "flops": {"error": "RuntimeError: no counter"},
    }
    record = gpu_blocks.split_record(_split_prediction(), 10.0, measured)
    assert record["error"]["weight_gradient"] is None
    assert "skipped_flops" not in record["measured"]
    np.testing.assert_allclose(record["measured"]["weight_gradient_share"], -0.05)
    np.testing.assert_allclose(record["error"]["share_pp"], 45.0)


def test_split_summary_groups_and_percentage_points():
    def row(precision, flash, backward_ms, input_ms, style="gpt"):
        config = gpu_blocks.gpt_config(1024, 1024, 1, precision, flash)
        config = {**config.__dict__, "style": style}
        record = gpu_blocks.split_record(
            _split_prediction(),
            backward_ms,
            {"input_backward_ms": {"median": input_ms, "min": input_ms}},
        )
        return {"status": "ok", "config": config, "split": record}

    rows = [
        row("bf16", True, 10.0, 5.0),  # measured share 0.5: -10 pp
        row("bf16", True, 10.0, 7.0),  # 0.3: +10 pp
        row("bf16", True, 10.0, 6.5, style="llama"),  # 0.35: +5 pp
        row("fp32", False, 10.0, 10.5),  # measured W < 0: +45 pp, no W error
        {"status": "oom", "config": row("bf16", True, 1.0, 1.0)["config"]},
        {"status": "skipped", "config": row("bf16", True, 1.0, 1.0)["config"]},
    ]
    summary = gpu_blocks.summarize_split(rows)
    assert list(summary) == [
        "all",
        "bf16-flash",
        "fp32-unfused",
        "style:gpt",
        "style:llama",
    ]
    flash = summary["bf16-flash"]
    assert flash["count"] == 3 and flash["measured_w_nonpositive"] == 0
    np.testing.assert_allclose(flash["share_pp"]["median_abs"], 10.0)
    np.testing.assert_allclose(flash["share_pp"]["max_abs"], 10.0)
    np.testing.assert_allclose(flash["share_pp"]["median_signed"], 5.0)
    # W errors -0.2, +1/3, +1/7; B errors +0.2, -1/7, -1/13.
    np.testing.assert_allclose(flash["weight_gradient"]["median_abs"], 0.2)
    np.testing.assert_allclose(flash["weight_gradient"]["max_abs"], 1 / 3)
    np.testing.assert_allclose(flash["input_backward"]["median_abs"], 1 / 7)
    np.testing.assert_allclose(flash["input_backward"]["median_signed"], -1 / 13)
    fp32 = summary["fp32-unfused"]
    assert fp32["measured_w_nonpositive"] == 1
    assert fp32["weight_gradient"] == {
        "count": 0,
        "median_abs": None,
        "max_abs": None,
        "median_signed": None,
    }
    np.testing.assert_allclose(fp32["share_pp"]["max_abs"], 45.0)
    assert summary["all"]["count"] == 4
    assert summary["all"]["weight_gradient"]["count"] == 3
    np.testing.assert_allclose(summary["all"]["share_pp"]["max_abs"], 45.0)
    gpu_blocks.print_split_table(rows, summary)  # prints rows of every status


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


@pytest.mark.slow
def test_split_smoke_run_skips_exactly_the_linear_wgrads(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "split.json"
    assert gpu_blocks.main(["--smoke", "--split", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["status"] for row in result["rows"]] == ["ok"] * len(
        gpu_blocks.smoke_grid()
    )
    assert result["split_summary"]["all"]["count"] == len(result["rows"])
    assert result["settings"]["split"] and result["split_differences"]
    for row in result["rows"]:
        assert "split" not in row["measured"]
        config = gpu_blocks.BlockConfig(**row["config"])
        opts = gpu_blocks.PassOptions(config.mbs, 1, config.precision, False)
        linear_wgrad_flops = sum(
            op.flops
            for op in gpu_blocks.block_backward_ops(config.spec(), opts)
            if op.name.endswith(".wgrad")
            and op.name.split(".")[0] in ("qkv", "out_proj", "mlp_up", "mlp_down")
        )
        # Autograd skips the weight GEMMs, and only those, in B.
        assert row["split"]["measured"]["skipped_flops"] == linear_wgrad_flops
    assert "split summary:" in capsys.readouterr().out
