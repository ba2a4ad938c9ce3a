"""``pipedejavu predict`` as a user meets it: outputs, JSON, exit codes."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli

from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import bundled_sailor_dir
from pipedejavu.io.sailor_plan import load_plan3d

MEASURED = bundled_sailor_dir() / "measured"
GH = MEASURED / "gh200-opt350" / "plan_config_N16_D4.json"


def test_predict_text_and_json(capsys):
    code, out, err = run_cli(capsys, "predict", GH, "--model", "OPT-350")
    assert code == 0 and err == ""
    assert "iteration time:" in out and "stage 3 (layers 19-25" in out
    code, out, err = run_cli(capsys, "predict", GH, "--model", "OPT-350", "--json")
    data = json.loads(out)
    plan, _ = load_plan3d(GH, model="OPT-350")
    expected = predict_plan(plan)
    assert data["iteration_time_s"] == pytest.approx(expected.iteration_time_s)
    assert data["peak_memory_bytes"] == pytest.approx(expected.peak_memory_bytes)
    assert data["fits_memory"] is True
    assert len(data["memory_per_stage_bytes"]) == 4


def test_predict_our_format_and_profiles_dir(capsys, tmp_path):
    plan, _ = load_plan3d(GH, model="OPT-350")
    ours = tmp_path / "plan.json"
    ours.write_text(json.dumps(plan.to_json()))
    copy = tmp_path / "data"
    shutil.copytree(bundled_sailor_dir(), copy)
    code, out, _ = run_cli(capsys, "predict", ours, "--profiles", copy, "--json")
    assert code == 0
    direct = json.loads(
        run_cli(capsys, "predict", GH, "--model", "OPT-350", "--json")[1]
    )
    assert json.loads(out)["iteration_time_s"] == direct["iteration_time_s"]


def _sailor(tmp_path, **changes):
    data = json.loads(GH.read_text())
    data.update(changes)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        ([GH], "names no model; give --model"),
        ([GH, "--model", "GPT-Neo-2.7"], "has 34 profile layers"),
        ([GH, "--model", "OPT-350", "--profiles", "/nonexistent"], "does not exist"),
        (["missing.json", "--model", "OPT-350"], "cannot read plan file missing.json"),
    ],
)
def test_bad_input_exits_2(capsys, argv, message):
    code, out, err = run_cli(capsys, "predict", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_missing_profile_entry_exits_2(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "predict", _sailor(tmp_path, mbs=3), "--model", "OPT-350"
    )
    assert code == 2 and "no entry for mbs 3, tp 4" in err


def test_over_memory_still_predicted(capsys, tmp_path):
    path = _sailor(tmp_path, mbs=128, gbs=4096)
    code, out, err = run_cli(capsys, "predict", path, "--model", "OPT-350", "--json")
    assert code == 0
    assert json.loads(out)["fits_memory"] is False
    assert "warning: the plan exceeds device memory" in err


def test_plan_mixed_types_json_round_trip(capsys, tmp_path):
    """``plan --mixed-types --json``: a plan on two GPU types, proven under the
    predictor, that ``predict`` prices the same from the JSON as it is."""
    argv = ["plan", "--model", "OPT-350", "--gpus", "Titan-RTX:4", "--gpus"]
    argv += ["RTX-2080:4", "--global-batch", "32", "--mixed-types", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    data = json.loads(out)
    assert data["proven_optimal"] is True and data["predicted_gap"] == 0.0
    assert set(data["gpus_used"]) == {"Titan-RTX", "RTX-2080"}
    assert data["objective_s"] is None  # no one-type table prices a mixed plan
    assert data["mixed_types_searched"] is True
    path = tmp_path / "plan.json"
    path.write_text(out)
    code, out, _ = run_cli(capsys, "predict", path, "--json")
    assert code == 0
    assert json.loads(out)["iteration_time_s"] == pytest.approx(
        data["iteration_time_s"], rel=1e-12
    )
    code, out, _ = run_cli(capsys, *argv[:-1])  # the text report says it
    assert "proven optimal under the predictor" in out
    assert "of this plan: n/a (GPU types mixed)" in out
    assert "Titan-RTX, tp" in out and "RTX-2080, tp" in out  # each stage's type
    code, _, err = run_cli(capsys, *argv, "--per-stage-tp")
    assert code == 2 and "cannot be combined" in err
    one_type = [item for item in argv[:-1] if item != "--mixed-types"]
    code, out, _ = run_cli(capsys, *one_type)  # says what it did not search
    assert code == 0 and "one GPU type per plan; --mixed-types also" in out


def test_plan_mixed_types_searches_every_schedule_of_the_knobs(capsys):
    """``--mixed-types`` on a model priced analytically: the knob search (every
    schedule) runs, plans mixing the types with 1F1B in the default order; it
    crashed when the DP probes of step 1 turned the proof off."""
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:8", "--gpus"]
    argv += ["A100-80:8", "--global-batch", "64"]
    code, out, err = run_cli(capsys, *argv, "--mixed-types", "--json")
    assert code == 0, err
    mixed = json.loads(out)
    assert mixed["proven_optimal"] and len(mixed["knobs"]["choices"]) > 1
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    single = json.loads(out)
    # a superset of the plans: never slower; here a plan on both types wins
    assert mixed["iteration_time_s"] <= single["iteration_time_s"]
    assert set(mixed["gpus_used"]) == {"H100-SXM", "A100-80"}
    assert mixed["rank_order"] is None
    code, out, err = run_cli(capsys, *argv, "--mixed-types")
    assert code == 0, err
    assert "rank order n/a" in out and "None" not in out


def test_plan_json_reports_the_utilization_its_launch_has(capsys):
    """``plan --json`` gives the best plan's model FLOPs, TFLOP/s per GPU and
    MFU; the launch its Megatron-LM export writes, predicted from the flags,
    gives the same numbers (and the same time: the export carries the
    sequence length and the precision it was priced with)."""
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16"]
    argv += ["--global-batch", "64", "--export", "megatron", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    plan = json.loads(out)
    exported = plan["export"]["text"].splitlines()[-1]
    assert f"--seq-length {plan['seq_length']}" in exported
    code, out, err = run_cli(  # the whole command: the model's flags are in it
        capsys, "predict", "--gpus", "H100:16", "--json", "--megatron-args",
        exported,
    )  # fmt: skip
    assert code == 0, err
    launch = json.loads(out)
    for key in ("iteration_time_s", "model_flops_per_iteration", "tflops_per_gpu"):
        assert plan[key] == pytest.approx(launch[key], rel=1e-12), key
    assert plan["mfu"] == pytest.approx(launch["mfu"], rel=1e-12)
    assert plan["mfu"] == pytest.approx(
        plan["tflops_per_gpu"] * 1e12 / 989.4e12, rel=1e-3
    )  # (H100 SXM's dense bf16 peak)


def test_plan_notes_the_knobs_a_tp1_plan_drops(capsys):
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16"]
    argv += ["--global-batch", "64", "--sequence-parallel", "on", "--tp-comm-overlap"]
    code, out, err = run_cli(capsys, *argv, "--json", "--export", "megatron")
    assert code == 0, err
    data = json.loads(out)
    tps = {r["tp"] for s in data["stages"] for r in s["replicas"]}
    assert tps == {1} and "--sequence-parallel" not in data["export"]["text"]
    assert any("runs at TP 1, where they do nothing" in n for n in data["notes"])
    # the pipeline search alone: here a TP 2 plan wins
    code, out, err = run_cli(capsys, *argv, "--json", "--sharded", "off")
    data = json.loads(out)
    assert {r["tp"] for s in data["stages"] for r in s["replicas"]} == {2}
    assert not any("TP 1" in n for n in data.get("notes", []))
