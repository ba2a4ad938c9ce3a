"""A calibration refined on measured runs (``pipedejavu.planning.run_fit``,
``pipedejavu calibrate --runs``): runs priced with known constants pull the
fit to them, a constant no run depends on is kept and named, the refined
file prices a run as ``predict --calibration`` does, and what the runs
refined reads back from the file."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.calibration_file import (
    ClusterCalibration,
    GpuCalibration,
    load_calibration,
)
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.measured_runs import MeasuredRun, load_runs, price_run
from pipedejavu.planning.run_fit import fit_runs

BUNDLED = Path(__file__).resolve().parent.parent / "pipedejavu/data"
MODEL = str(BUNDLED / "models/sailor-opt-350.json")
GH200 = ("N2_D1", "N4_D2", "N8_D4", "N16_D8", "N32_D32")
START = {
    "tensor_efficiency": 0.8,
    "backward_tensor_efficiency": 0.9,
    "memory_efficiency": 0.7,
    "link_efficiency": 0.75,
    "collective_latency_s": 1e-4,
}


def _calibration(**changes: float) -> ClusterCalibration:
    constants = {**START, **changes}
    gpu = GpuCalibration("GH-96", constants, {}, ("OPT-350",), 0, {}, None)
    return ClusterCalibration({"GH-96": gpu}, (), load_sailor_data(None).network)


def _runs(truth: ClusterCalibration) -> list[MeasuredRun]:
    """GH200 plans, each "measured" as ``truth`` prices it."""
    runs = []
    for name in GH200:
        plan = BUNDLED / f"sailor/measured/gh200-opt350/plan_config_{name}.json"
        run = load_runs([BUNDLED / f"runs/gh200-opt350/{name}.json"])[0]
        seconds = price_run(run, truth).iteration_time_s
        runs.append(dataclasses.replace(run, name=str(plan), seconds=seconds))
    return runs


def test_runs_priced_with_known_constants_pull_the_fit_to_them():
    truth = _calibration(link_efficiency=1.5)
    runs = _runs(truth)
    fit = fit_runs(_calibration(), runs, fields=("link_efficiency",))
    found = fit.calibration.gpus["GH-96"].constants["link_efficiency"]
    start, true = math.log(START["link_efficiency"]), math.log(1.5)
    # the profiled value is the prior: the runs move the constant most of
    # the way, not past the truth
    assert abs(math.log(found) - true) < 0.2 * abs(start - true)
    assert START["link_efficiency"] < found <= 1.5
    before, after = np.abs(fit.errors("before")), np.abs(fit.errors("after"))
    assert before.max() > 0.02 and after.max() < before.max() / 4
    # left out, each run is still priced better than before the runs
    assert np.abs(fit.errors("left_out")).max() < before.max() / 2
    # every other constant is the profiles', untouched
    refined = fit.calibration.gpus["GH-96"].constants
    assert {k: v for k, v in refined.items() if k != "link_efficiency"} == {
        k: v for k, v in START.items() if k != "link_efficiency"
    }


def test_runs_that_agree_with_the_profiles_move_nothing():
    calibration = _calibration()
    fit = fit_runs(calibration, _runs(calibration), leave_one_out=False)
    assert np.abs(fit.errors("after")).max() < 1e-6
    for field, value in fit.calibration.gpus["GH-96"].constants.items():
        assert value == pytest.approx(START[field], rel=1e-4), field
    assert fit.left_out is None


def test_a_constant_no_run_depends_on_is_kept_and_named():
    """At efficiency 1, GH-96's backward GEMMs are not what bounds them (the
    roofline's memory side is): the runs cannot see it."""
    calibration = _calibration(backward_tensor_efficiency=1.0)
    fit = fit_runs(calibration, _runs(_calibration()), leave_one_out=False)
    kept = fit.kept.get("GH-96", {})
    moved = set(fit.fields["GH-96"])
    assert moved and moved.isdisjoint(kept)
    for why in kept.values():
        assert "no run depends on it" in why


def test_a_run_on_a_gpu_type_the_calibration_lacks_is_refused():
    calibration = _calibration()
    rtx = load_runs([BUNDLED / "runs/rtx-opt350/N2_D1.json"])
    with pytest.raises(ProblemError, match="the calibration holds GH-96, not"):
        fit_runs(calibration, rtx)
    with pytest.raises(ProblemError, match="no measured run"):
        fit_runs(calibration, [])


def test_a_run_priced_by_its_own_profiles_is_refused():
    run = load_runs([BUNDLED / "runs/gh200-opt350/N4_D2.json"])[0]
    run = dataclasses.replace(run, model="OPT-350")  # the profiles price it
    with pytest.raises(ProblemError, match="priced from its own profiles"):
        price_run(run, _calibration())


def test_calibrate_with_runs_writes_what_predict_prices(tmp_path, capsys):
    """The CLI end to end: profiles, then three GH200 runs (run files of our
    own beside their plans), and ``predict`` of one plan with the file gives
    the refined prediction the report printed."""
    runs = []
    for name in GH200[:3]:
        plan = BUNDLED / f"sailor/measured/gh200-opt350/plan_config_{name}.json"
        body = {"format": "pipedejavu-run/1", "plan": str(plan), "model": MODEL}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(body))
        runs.append(str(path))
    out = tmp_path / "cal.json"
    code = main(
        [
            "calibrate",
            "--profiles",
            str(BUNDLED / "sailor"),
            "--models",
            "OPT-350",
            "--gpus",
            "GH-96",
            "--runs",
            *runs,
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = capsys.readouterr().out
    assert "runs (3)" in report and "leave-one-run-out" in report
    calibration = load_calibration(out, load_gpu_sheet())
    record = calibration.runs
    assert record["files"] == [Path(r).name for r in runs]
    assert record["fit_error"]["max"] <= record["error_before"]["max"]
    run = load_runs([runs[0]])[0]
    expected = price_run(run, calibration).iteration_time_s
    plan = BUNDLED / f"sailor/measured/gh200-opt350/plan_config_{GH200[0]}.json"
    assert main(
        [
            "predict",
            str(plan),
            "--model",
            MODEL,
            "--calibration",
            str(out),
            "--json",
        ]
    ) in (0, None)
    printed = json.loads(capsys.readouterr().out)
    assert printed["iteration_time_s"] == pytest.approx(expected, rel=1e-12)


def test_a_bad_runs_record_is_one_line(tmp_path):
    path = tmp_path / "cal.json"
    body = _calibration().to_json()
    body["runs"] = {"files": "x"}
    path.write_text(json.dumps(body))
    with pytest.raises(ProblemError) as error:
        load_calibration(path, load_gpu_sheet())
    assert str(error.value).startswith(str(path)) and "runs must be" in str(error.value)


def test_calibrate_refuses_a_bad_run_file_before_fitting(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pipedejavu-run/1", "plan": "nowhere.json"}))
    code = main(
        ["calibrate", "--profiles", str(BUNDLED / "sailor"), "--runs", str(bad)]
        + ["--out", str(tmp_path / "cal.json")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].count(str(bad)) >= 1
    assert not (tmp_path / "cal.json").exists()


def test_predict_takes_the_attention_kernel_a_run_used(capsys):
    """``--attention unfused`` prices a Sailor plan as its run file's
    ``training`` does (Megatron-DeepSpeed ran without flash attention)."""
    plan = BUNDLED / "sailor/measured/gh200-opt350/plan_config_N4_D2.json"
    times = {}
    for kernel in ("fused", "unfused"):
        code = main(
            ["predict", str(plan), "--model", MODEL, "--precision", "fp32"]
            + ["--attention", kernel, "--json"]
        )
        assert code in (0, None)
        times[kernel] = json.loads(capsys.readouterr().out)["iteration_time_s"]
    run = load_runs([BUNDLED / "runs/gh200-opt350/N4_D2.json"])[0]
    assert not run.options.flash_attention
    assert times["unfused"] == pytest.approx(
        price_run(run, None).iteration_time_s, rel=1e-12
    )
    assert times["unfused"] > times["fused"]
    code = main(["predict", str(plan), "--model", MODEL, "--attention", "unfused"])
    assert "unfused attention" in capsys.readouterr().out
    code = main(
        ["plan", "--model", MODEL, "--gpus", "GH-96:8", "--global-batch", "32"]
        + ["--attention", "unfused", "--export", "torchtitan"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "torchtitan runs its attention fused" in err
