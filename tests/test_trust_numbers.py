"""Numbers a new user can trust (issue 43): MFU against HFU, memory headroom,
the training length of a config, the Python API against the command line,
plan files whose batch the launch would change, flags Megatron-LM rejects."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from pipedejavu.baselines.megatron_brute import brute_force_megatron
from pipedejavu.core.errors import InfeasibleProblemError, ProblemError
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.planning.any_model import plan_any_model
from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.knobs import plan_with_knobs
from pipedejavu.planning.plan_model import plan_model
from pipedejavu.planning.training import plan_training

QWEN_7B = ["--model", "Qwen2.5-7B", "--gpus", "A100-80:16", "--global-batch", "256"]
QWEN_7B += ["--seq-len", "4096", "--schedule", "1f1b"]


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
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
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", flags
    )
    assert code == 0, err
    line = next(x for x in out.splitlines() if "MFU" in x)
    assert "model FLOPs" in line and "HFU" in line and "recomputed" in line


# ------------------------------------------------------------ memory headroom
@pytest.mark.parametrize("pool, gbs", [({"RTX-2080": 4}, 8), ({"GH-96": 2}, 16)])
def test_headroom_plan_is_brute_forces_best_of_what_fits(pool, gbs):
    """With 20% of each GPU kept free, the search (and its proof) and the
    predictor agree with brute force over every plan priced on the same
    smaller GPUs; the plan uses at most 80% of each GPU."""
    headroom = MemoryHeadroom(fraction=0.2)
    data = SailorData().with_memory_headroom(headroom)
    result = plan_training("OPT-350", pool, gbs, memory_headroom=0.2)
    _, best = brute_force_megatron(data, "OPT-350", pool, gbs, C, score="predictor")
    _, optimum = brute_force_megatron(data, "OPT-350", pool, gbs, C)
    assert result.prediction.iteration_time_s == pytest.approx(best, rel=1e-9)
    assert result.optimum_s == pytest.approx(optimum, rel=1e-12)
    assert result.proven and result.lower_bound_s == pytest.approx(optimum)
    prediction = result.prediction
    capacity = prediction.memory_capacity
    assert (prediction.memory_bytes <= 0.8 * capacity).all()
    np.testing.assert_allclose(prediction.memory_limit_bytes, 0.8 * capacity)


def test_headroom_changes_a_tight_plan_and_zero_changes_nothing():
    pool, gbs = {"RTX-2080": 4}, 8
    plain = plan_training("OPT-350", pool, gbs)
    zero = plan_training("OPT-350", pool, gbs, memory_headroom="0GB")
    kept = plan_training("OPT-350", pool, gbs, memory_headroom="20%")
    assert zero.plan == plain.plan
    assert zero.prediction.iteration_time_s == plain.prediction.iteration_time_s
    # the plain plan fills 99% of an RTX 2080: it does not fit 80% of one
    assert plain.prediction.peak_memory_bytes > 0.8 * 8e9
    assert kept.plan != plain.plan
    assert kept.prediction.iteration_time_s > plain.prediction.iteration_time_s
    with pytest.raises(InfeasibleProblemError, match="40% of each GPU's memory kept"):
        plan_training("OPT-350", pool, gbs, memory_headroom=0.4)


def test_headroom_in_the_knob_search_and_its_proof():
    kwargs = {"space": KnobSpace(schedules=("1f1b", "zb-h1"))}
    plain = plan_with_knobs("Llama-3-8B", {"H100": 8}, 256, **kwargs)
    kept = plan_with_knobs(
        "Llama-3-8B", {"H100": 8}, 256, memory_headroom="12GB", **kwargs
    )
    assert kept.result.proven
    prediction = kept.result.prediction
    assert (prediction.memory_bytes <= prediction.memory_capacity - 12e9).all()
    assert (
        plain.result.prediction.peak_memory_bytes > prediction.memory_limit_bytes.min()
    )
    assert kept.result.prediction.iteration_time_s >= (
        plain.result.prediction.iteration_time_s
    )


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "abc", "110%", "1e9GB"])
def test_headroom_flag_refuses_bad_values(capsys, bad):
    code, out, err = run_cli(
        capsys, "plan", "--model", "OPT-350", "--gpus", "GH-96:4",
        "--global-batch", "16", "--memory-headroom", bad,
    )  # fmt: skip
    assert code == 2 and "--memory-headroom" in err and out == ""


def test_headroom_flag_in_the_report_and_the_json(capsys):
    argv = ["--model", "OPT-350", "--gpus", "RTX-2080:4", "--global-batch", "8"]
    code, out, err = run_cli(capsys, "plan", *argv, "--memory-headroom", "0.2")
    assert code == 0, err
    assert "less the --memory-headroom" in out and "usable (" in out
    data = plan_json(capsys, *argv, "--memory-headroom", "0.2")
    limits = data["memory_limit_per_stage_bytes"]
    capacity = data["memory_capacity_per_stage_bytes"]
    np.testing.assert_allclose(limits, [0.8 * c for c in capacity])


# ------------------------------------------------- a config's training length
QWEN_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}


def test_a_long_context_config_asks_for_the_training_length(capsys, tmp_path):
    """A config.json gives its context (131,072 tokens for Qwen2.5), not its
    training length: plan and predict ask for --seq-len instead of planning
    at 131,072 tokens; a short context is still planned at its length."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN_CONFIG))
    argv = ["--model", str(config), "--gpus", "A100-80:16", "--global-batch", "256"]
    code, out, err = run_cli(capsys, "plan", *argv, "--schedule", "1f1b")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--seq-len" in err and "131,072" in err
    data = plan_json(capsys, *argv, "--schedule", "1f1b", "--seq-len", "4096")
    assert data["seq_length"] == 4096
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**QWEN_CONFIG, "max_position_embeddings": 2048}))
    argv[1] = str(short)
    assert plan_json(capsys, *argv, "--schedule", "1f1b")["seq_length"] == 2048


# ------------------------------------------ one API with the CLI's defaults
def test_plan_model_gives_what_the_command_line_gives(capsys):
    argv = ["--model", "Llama-3-8B", "--gpus", "H100:8", "--global-batch", "256"]
    cli = plan_json(capsys, *argv, "--memory-headroom", "0.05")
    best = plan_model("Llama-3-8B", {"H100": 8}, 256, memory_headroom=0.05)
    assert best.result.to_json()["stages"] == cli["stages"]
    assert best.result.prediction.iteration_time_s == cli["iteration_time_s"]
    assert best.result.options.to_json() == cli["options"]
    assert best.result.proven and cli["proven_optimal"]
    # the knobs searched by default: every schedule (the profile-free model)
    assert set(best.space.schedules) == {
        "1f1b", "interleaved", "zb-h1", "interleaved-zb", "zbv"
    }  # fmt: skip
    # plan_any_model plans one choice of knobs; it is no faster than the search
    one, _ = plan_any_model("Llama-3-8B", {"H100": 8}, 256, memory_headroom=0.05)
    assert one.prediction.iteration_time_s >= cli["iteration_time_s"]


def test_plan_model_keeps_to_an_export_target():
    best = plan_model("Llama-3-8B", {"H100": 8}, 256, export="megatron")
    assert not best.result.options.zero_bubble
    assert set(best.space.schedules) <= {"1f1b", "interleaved"}
    with pytest.raises(ProblemError, match="export must be one of"):
        plan_model("Llama-3-8B", {"H100": 8}, 256, export="nemo")


def test_plan_training_names_the_function_for_any_model():
    with pytest.raises(ProblemError, match=r"pipedejavu\.plan_model"):
        plan_training("Llama-3-8B", {"H100": 8}, 256)


# ------------------------------------------- a plan file's batch, as it is
def test_predict_refuses_a_batch_the_launchers_would_change(capsys, tmp_path):
    """mbs 2 x dp 8 does not divide a global batch of 40: rounded up to 3
    micro-batches the plan would train 48 samples; predict refuses it, as
    --megatron-args refuses the same launch."""
    argv = ["--model", "OPT-350", "--gpus", "GH-96:8", "--global-batch", "48"]
    data = plan_json(capsys, *argv, "--schedule", "1f1b", "--rank-order", "tp-dp-pp")
    assert (data["mbs"], len(data["stages"][0]["replicas"])) == (2, 8)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**data, "gbs": 40}))
    code, out, err = run_cli(capsys, "predict", str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert str(path) in err and "not a multiple of micro-batch x DP = 2 x 8" in err
    assert "48 samples" in err
    path.write_text(json.dumps(data))
    code, out, err = run_cli(capsys, "predict", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["num_microbatches"] == 3


# ------------------------------------ flags Megatron-LM would refuse, refused
LAUNCH = (
    "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 "
    "--micro-batch-size 1 --global-batch-size 64 --bf16"
)


@pytest.mark.parametrize(
    "extra, missing",
    [
        (" --recompute-granularity full --recompute-num-layers 2", "method"),
        (" --recompute-granularity full --recompute-method uniform", "num-layers"),
    ],
)
def test_full_recomputation_needs_a_method_and_a_count(capsys, extra, missing):
    """Megatron Core's TransformerConfig raises on full recomputation without
    --recompute-method or --recompute-num-layers: so does predict."""
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", LAUNCH + extra
    )
    assert code == 2 and out == "" and f"--recompute-{missing}" in err


def test_recompute_counts_without_a_granularity_are_listed_as_ignored(capsys):
    extra = " --recompute-method block --recompute-num-layers 2"
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", LAUNCH + extra
    )
    assert code == 0, err
    assert "--recompute-num-layers 2 (no effect without" in err
    assert "--recompute-method block (no effect without" in err


def test_plan_refuses_block_counts_without_full_recomputation(capsys):
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:8"]
    argv += ["--global-batch", "256", "--recompute", "none"]
    code, out, err = run_cli(capsys, *argv, "--recompute-num-layers", "2")
    assert code == 2 and out == "" and "--recompute-num-layers" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "extra, says",
    [
        (" --frobnicate 3", "unknown flag --frobnicate"),
        (" --num-lay 3", "did you mean --num-layers"),  # no prefixes (allow_abbrev)
        (" --tensor-model-paralel-size 8", "did you mean --tensor-model-parallel"),
        (" --use-checkpoint-args=yes", "--use-checkpoint-args takes no value"),
        (" --lr", "--lr needs a value"),
        (" --DDP-impl fast", "not one of Megatron-LM's choices"),
    ],
)
def test_flags_megatron_refuses_are_refused(capsys, extra, says):
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", LAUNCH + extra
    )
    assert code == 2 and out == "" and says in err
    assert len(err.strip().splitlines()) == 1


def test_flags_megatron_knows_are_listed_and_the_launcher_skipped(capsys):
    launch = (
        "torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py "
        + LAUNCH
        + " --lr 3e-4 --data-path 0.5 a 0.5 b --train-iters 10 --DDP-impl local"
    )
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100:8", "--megatron-args", launch, "--json"
    )
    assert code == 0, err
    ignored = err.split("ignored (no effect on the prediction): ")[1]
    assert ignored.startswith("torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py")
    for words in ("--lr 3e-4", "--data-path 0.5 a 0.5 b", "--train-iters 10"):
        assert words in ignored
    assert json.loads(out)["plan"].startswith("pp 1 ")


def test_torchtitan_plans_of_a_profiled_model_run_sequence_parallelism(capsys):
    """torchtitan shards the norms along the sequence whenever TP > 1: a
    profiled model (fp32, no SP) planned for it is searched with SP, priced
    analytically, and exported (it was refused after the search: TP 4 without
    SP)."""
    argv = ["--model", "LLAMA-3-8", "--gpus", "GH-96:32", "--global-batch", "256"]
    data = plan_json(capsys, *argv, "--export", "torchtitan")
    assert data["options"]["sequence_parallel"] is any(
        r["tp"] > 1 for s in data["stages"] for r in s["replicas"]
    )
    assert data["cost_source"] == "analytical"
    assert "seq_len = 8192" in data["export"]["text"]


@pytest.mark.parametrize(
    "argv, legend",
    [
        (
            QWEN_7B,
            "  layers: 0 the embedding, 1-28 the 28 transformer blocks, "
            "29 the final norm and LM head",
        ),
        (
            ["--model", "LLAMA-3-8", "--gpus", "GH-96:32", "--global-batch", "256"],
            "  layers: 0 the embedding, 1-32 the 32 transformer blocks, "
            "33 the final norm, 34 the LM head",
        ),
    ],
)
def test_the_report_says_what_its_layer_numbers_are(capsys, argv, legend):
    """A 28-block model's stages run over layers 0-29 and Sailor's 32-block
    LLAMA-3-8 over 0-34: the report says which are the blocks, and its
    stages cover exactly those numbers."""
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    lines = out.splitlines()
    stages = next(line for line in lines if line.startswith("  stages: "))
    assert lines[lines.index(stages) + 1] == legend
    last = int(legend.rsplit(", ", 1)[1].split()[0])
    assert stages.startswith("  stages: layers 0-")
    assert f"-{last} (" in stages.rsplit("layers ", 1)[1]


def test_a_pool_of_several_types_reads_with_commas_too(capsys):
    """``--gpus A100-80:8,H100:8`` is the pool of ``--gpus A100-80:8 --gpus
    H100:8`` (it was refused as one malformed item); a launch takes one type,
    and says so (a comma there raised a traceback)."""
    from pipedejavu.planning.training import parse_gpu_pool

    assert parse_gpu_pool(["A100-80:8,H100:8"]) == {"A100-80": 8, "H100": 8}
    assert parse_gpu_pool(["A100-80:8, H100:8", "V100:4"]) == parse_gpu_pool(
        ["A100-80:8", "H100:8", "V100:4"]
    )
    with pytest.raises(ProblemError, match="names H100 twice"):
        parse_gpu_pool(["H100:8,H100:8"])
    with pytest.raises(ProblemError, match="got ''"):
        parse_gpu_pool(["H100:8,"])
    argv = ["--model", "Qwen2.5-7B", "--global-batch", "128", "--seq-len", "4096"]
    together = plan_json(capsys, *argv, "--gpus", "A100-80:8,H100:8")
    apart = plan_json(capsys, *argv, "--gpus", "A100-80:8", "--gpus", "H100:8")
    assert together["stages"] == apart["stages"]
    launch = "pretrain_gpt.py --num-layers 4 --hidden-size 1024 "
    launch += "--num-attention-heads 16 --seq-length 2048 --max-position-embeddings "
    launch += "2048 --micro-batch-size 1 --global-batch-size 8 --bf16"
    for command in ("predict", "plan"):
        code, _, err = run_cli(
            capsys, command, "--megatron-args", launch, "--gpus", "A100-80:8,H100:8"
        )
        assert code == 2 and "takes one --gpus TYPE:COUNT, got 2 types" in err
