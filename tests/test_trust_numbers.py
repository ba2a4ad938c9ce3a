"""Numbers a new user can trust (issue 43): MFU against HFU, memory headroom,
the training length of a config, the Python API against the command line,
plan files whose batch the launch would change, flags Megatron-LM rejects."""

from __future__ import annotations

import json

import pytest

from pipedejavu.cli.main import main

QWEN_7B = ["--model", "Qwen2.5-7B", "--gpus", "A100-80:16", "--global-batch", "256"]
QWEN_7B += ["--seq-len", "4096", "--schedule", "1f1b"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_mfu_counts_model_flops_and_hfu_the_recomputed_ones(capsys):
    """Full recomputation makes the plan slower: its MFU (model FLOPs, the
    same work) falls; only the HFU counts the rerun forwards (issue 43: the
    slower plan showed the higher 'MFU')."""
    none = plan_json(capsys, *QWEN_7B, "--recompute", "none")
    full = plan_json(capsys, *QWEN_7B, "--recompute", "full")
    assert full["iteration_time_s"] > none["iteration_time_s"]
    model = none["model_flops_per_iteration"]
    assert full["model_flops_per_iteration"] == pytest.approx(model, rel=1e-12)
    assert full["mfu"] < none["mfu"]
    speed = none["iteration_time_s"] / full["iteration_time_s"]
    assert full["mfu"] == pytest.approx(none["mfu"] * speed, rel=1e-9)
    # without recomputation hardware and model FLOPs are one number
    assert none["hfu"] == pytest.approx(none["mfu"], rel=1e-12)
    assert full["hardware_flops_per_iteration"] > model
    assert full["hfu"] > full["mfu"]
    ratio = full["hardware_flops_per_iteration"] / model
    assert full["hfu"] == pytest.approx(full["mfu"] * ratio, rel=1e-9)


def test_predict_names_mfu_and_hfu(capsys):
    flags = (
        "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
        "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 "
        "--micro-batch-size 1 --global-batch-size 64 --bf16 "
        "--recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1"
    )
    code, out, err = run(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", flags
    )
    assert code == 0, err
    line = next(x for x in out.splitlines() if "MFU" in x)
    assert "model FLOPs" in line and "HFU" in line and "recomputed" in line
