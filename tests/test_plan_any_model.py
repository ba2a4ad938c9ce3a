"""``pipedejavu plan`` and ``predict`` for any model on any GPU of the sheet
(issue 24): presets and config files priced analytically, the Sailor models
as before on their profiled GPUs, mixed elsewhere, and a user's Megatron-LM
launch beside the best plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.training import plan_training

#: A small Megatron-LM launch (8 layers, 2 stages of TP 2, 4 replicas).
LAUNCH = (
    "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 "
    "--micro-batch-size 1 --global-batch-size 64 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --bf16"
)


def plan_json(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("model", "gpus", "gbs"),
    [("Qwen2.5-7B", "H100:16", 64), ("Mistral-7B", "A100-80:32", 128)],
)
def test_plan_preset_is_priced_analytically(capsys, tmp_path, model, gpus, gbs):
    out = plan_json(capsys, "--model", model, "--gpus", gpus, "--global-batch", gbs)
    assert out["cost_source"] == "analytical"
    assert out["options"]["precision"] == "bf16"
    assert out["fits_memory"] is True
    assert out["predicted_lower_bound_s"] <= out["iteration_time_s"] * (1 + 1e-12)
    spec = load_model_spec(model)
    assert out["seq_length"] == spec.seq_length
    # Its time is the predictor's on the same source (the knobs it chose).
    options = TrainingOptions.from_json(out["options"])
    assert out["knobs"]["choices"][0]["how"] == "searched"
    source = AnalyticalSource(spec, load_gpu_sheet(), options)
    again = predict_plan(Plan3D.from_json(out), source)
    np.testing.assert_allclose(again.iteration_time_s, out["iteration_time_s"], 1e-9)
    # `predict` reads the plan as written (options and length recorded).
    path = write(tmp_path, "plan.json", out)
    code, text, err = run_cli(capsys, "predict", path, "--json")
    assert code == 0, err
    predicted = json.loads(text)
    assert predicted["cost_source"] == "analytical"
    np.testing.assert_allclose(
        predicted["iteration_time_s"], out["iteration_time_s"], rtol=1e-9
    )


def test_bf16_faster_than_fp32_for_the_same_plan(capsys, tmp_path):
    out = plan_json(
        capsys, "--model", "Qwen2.5-7B", "--gpus", "H100:8", "--global-batch", 32
    )
    path = write(tmp_path, "plan.json", out)
    times = {}
    for precision in ("fp32", "bf16", "fp8"):
        code, text, err = run_cli(capsys, "predict", path, "--precision", precision)
        assert code == 0, err
        assert f"costs: analytical ({precision}" in text
        line = next(x for x in text.splitlines() if x.startswith("iteration time"))
        times[precision] = float(line.split()[2])
    assert times["bf16"] < times["fp32"]
    assert times["fp8"] < times["bf16"]


def test_sailor_model_on_profiled_gpus_unchanged(capsys):
    out = plan_json(
        capsys, "--model", "OPT-350", "--gpus", "GH-96:8", "--global-batch", 64
    )
    assert out["cost_source"] == "profiles" and "notes" not in out
    assert out["options"] == TrainingOptions(flash_attention=False).to_json()
    direct = plan_training("OPT-350", {"GH-96": 8}, 64)
    assert out["iteration_time_s"] == direct.iteration_time_s
    assert Plan3D.from_json(out) == direct.plan


def test_sailor_model_elsewhere_is_mixed(capsys, tmp_path):
    """OPT-350 has a GH-96 profile but none on H100: the profiles price what
    they cover, the analytical model the rest."""
    choice = choose_cost_source("OPT-350", ["GH-96", "H100"])
    assert choice.analytical
    assert choice.options == TrainingOptions(flash_attention=False)
    assert choice.gpu_types == {"GH-96": "GH-96", "H100": "H100-SXM"}
    assert choice.data.source_of("GH-96", 2, 1) == "profiles"
    assert choice.data.source_of("H100-SXM", 2, 1) == "analytical"
    plan = {
        "model": "OPT-350",
        "mbs": 2,
        "gbs": 16,
        "stages": [
            {"layers": [0, 13], "replicas": [{"gpu": "GH-96", "tp": 1}]},
            {"layers": [13, 26], "replicas": [{"gpu": "H100", "tp": 1}]},
        ],
    }
    code, text, err = run_cli(
        capsys, "predict", write(tmp_path, "p.json", plan), "--json"
    )
    assert code == 0, err
    assert json.loads(text)["cost_source"] == "mixed"
    out = plan_json(
        capsys, "--model", "OPT-350", "--gpus", "H100:8", "--global-batch", 64
    )
    assert out["cost_source"] == "analytical" and out["fits_memory"]
    assert "no OPT-350 profile on H100-SXM" in out["notes"][0]


def test_precision_on_a_sailor_model_goes_analytical(capsys):
    argv = ["--model", "OPT-350", "--gpus", "GH-96:8", "--global-batch", 64]
    fp32 = plan_json(capsys, *argv)
    bf16 = plan_json(capsys, *argv, "--precision", "bf16")
    assert bf16["cost_source"] == "analytical"
    assert bf16["options"]["precision"] == "bf16"
    assert "measured fp32 training" in bf16["notes"][0]
    assert fp32["cost_source"] == "profiles"


def test_hugging_face_config(capsys, tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    path = write(tmp_path, "config.json", config)
    argv = ["--model", path, "--gpus", "L40S:8", "--global-batch", 32]
    out = plan_json(capsys, *argv, "--seq-len", 1024, "--recompute", "selective")
    assert out["seq_length"] == 1024 and out["options"]["recompute"] == "selective"
    assert out["cost_source"] == "analytical" and out["fits_memory"]
    assert out["stages"][-1]["layers"][1] == 8 + 2  # embedding, blocks, head
    code, text, _ = run_cli(capsys, "plan", *argv)
    assert code == 0 and "costs: analytical (bf16, recompute " in text
    assert "2048 tokens per sample" in text and "knobs: 1F1B, recompute" in text


def test_megatron_args_given_beside_best(capsys):
    argv = ["plan", "--megatron-args", LAUNCH, "--gpus", "A100-80:16"]
    code, text, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    out = json.loads(text)
    given, best = out["given_iteration_time_s"], out["iteration_time_s"]
    assert given >= best * (1 - 1e-12)
    np.testing.assert_allclose(out["speedup"], given / best, rtol=1e-12)
    assert out["given"]["plan"].startswith("pp 2 [5+5], dp 4, tp 2, mbs 1")
    assert out["options"]["precision"] == "bf16" and out["gbs"] == 64
    assert out["cost_source"] == "analytical" and out["proven_optimal"]
    assert "interleaved schedules" in out["search_space"]
    assert {c["how"] for c in out["knobs"]["choices"]} >= {"searched", "interleaved"}
    # the schedules Megatron-LM runs (no ZB-H1) unless asked
    assert out["knobs"]["space"]["schedules"] == ["1f1b", "interleaved"]
    assert not any(c["options"]["zero_bubble"] for c in out["knobs"]["choices"])
    code, text, err = run_cli(capsys, *argv, "--json", "--schedule", "zb-h1")
    assert code == 0, err
    assert json.loads(text)["options"]["zero_bubble"]
    code, text, _ = run_cli(capsys, *argv)
    assert code == 0 and "speed-up x" in text and "--- your launch ---" in text
    # the knobs restrict the search: today's space is never faster
    code, text, err = run_cli(
        capsys,
        *argv,
        "--json",
        "--recompute",
        "none",
        "--sequence-parallel",
        "off",
        "--distributed-optimizer",
        "off",
    )
    assert code == 0, err
    narrow = json.loads(text)
    assert narrow["iteration_time_s"] >= best * (1 - 1e-12)
    assert narrow["options"]["recompute"] == "none"


def test_megatron_args_interleaved_launch_is_compared(capsys):
    launch = LAUNCH.replace("--num-layers 8", "--num-layers 8") + (
        " --num-layers-per-virtual-pipeline-stage 2"
    )
    code, text, err = run_cli(
        capsys, "plan", "--megatron-args", launch, "--gpus", "A100-80:16"
    )
    assert code == 0, err
    assert "interleaved 1F1B, 2 chunks per stage" in text  # the launch's
    assert "knobs: " in text and "speed-up x" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "GPT-7", "--gpus", "H100:8"], "unknown model 'GPT-7'"),
        (["--model", "{bad_config}", "--gpus", "H100:8"], "missing key"),
        (["--model", "Qwen2.5-7B", "--gpus", "X900:8"], "not on the GPU sheet"),
        (
            ["--model", "Qwen2.5-7B", "--gpus", "H100:8", "--gpus", "H100-SXM:8"],
            "twice",
        ),
        (["--gpus", "H100:8"], "give --model"),
        (
            ["--model", "Qwen2.5-7B", "--megatron-args", LAUNCH, "--gpus", "H100:8"],
            "give no --model",
        ),
        (
            ["--megatron-args", LAUNCH, "--precision", "fp32", "--gpus", "H100:8"],
            "give no --precision",
        ),
        (
            ["--megatron-args", LAUNCH, "--gpus", "H100:8", "--gpus", "A100-80:8"],
            "one --gpus",
        ),
        (
            [
                "--megatron-args",
                LAUNCH.replace(
                    "2048 --num-attention-heads 16", "1920 --num-attention-heads 15"
                ),
                "--gpus",
                "H100:8",
            ],
            "must divide num_attention_heads",
        ),
        (
            ["--model", "OPT-350", "--gpus", "GH-96:4", "--goodput-grad", "1,2"]
            + ["--init-batch", "8", "--precision", "bf16"],
            "give no --precision",
        ),
    ],
)
def test_plan_bad_input_exits_2(capsys, tmp_path, argv, message):
    bad_config = write(tmp_path, "bad.json", {"model_type": "llama"})
    argv = [a.format(bad_config=bad_config) for a in argv]
    if "--goodput-grad" not in argv and "--megatron-args" not in argv:
        argv += ["--global-batch", "8"]
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_megatron_args_global_batch_contradiction(capsys):
    argv = ["plan", "--megatron-args", LAUNCH, "--gpus", "A100-80:16"]
    code, _, err = run_cli(capsys, *argv, "--global-batch", 32)
    assert code == 2 and "contradicts" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("plan", "extra", "message"),
    [
        ({"tp": 8, "layers": 30}, [], "must divide num_attention_heads (28)"),
        ({"tp": 1, "layers": 30}, ["--model", "Llama-3-8B"], "has 34"),
        ({"tp": 1, "layers": 30}, ["--model", "Nope-1B"], "unknown model"),
        ({"tp": 1, "layers": 30}, ["--gpu-sheet", "/nonexistent.json"], "nonexistent"),
    ],
)
def test_predict_bad_input_exits_2(capsys, tmp_path, plan, extra, message):
    data = {
        "model": "Qwen2.5-7B",
        "mbs": 1,
        "gbs": 8,
        "stages": [
            {
                "layers": [0, plan["layers"]],
                "replicas": [{"gpu": "H100", "tp": plan["tp"], "node": 0}],
            }
        ],
    }
    code, out, err = run_cli(capsys, "predict", write(tmp_path, "p.json", data), *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
