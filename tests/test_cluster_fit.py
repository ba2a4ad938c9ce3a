"""Calibration to the cluster (``pipedejavu calibrate``, ``predict
--calibration``): the fit recovers constants that priced the profiles, a
calibration file reads back as written and every bad one is one line naming
it, and predict prices with the calibrated constants only the GPU types the
file holds."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.calibrate import QK_LAYER_SCALING
from pipedejavu.costmodel.analytical.calibration_file import (
    CALIBRATED_FIELDS,
    load_calibration,
)
from pipedejavu.costmodel.analytical.cluster_fit import PROFILED_TRAINING, fit_cluster
from pipedejavu.costmodel.analytical.roofline import FITTED_ANALYTICAL
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec

BUNDLED = Path(__file__).resolve().parent.parent / "pipedejavu/data/sailor"
TRUE = {
    "tensor_efficiency": 0.55,
    "backward_tensor_efficiency": 0.45,
    "memory_efficiency": 0.62,
    "kernel_overhead_s": 7e-6,
    "link_efficiency": 0.7,
    "collective_latency_s": 3e-5,
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """The bundled data with OPT-350's GH-96 profile replaced by what the
    analytical model prices with :data:`TRUE` (every TP, the TP collectives
    over the data's measured GH-96 link)."""
    root = tmp_path_factory.mktemp("cluster") / "sailor"
    shutil.copytree(BUNDLED, root)
    path = root / "profiles/OPT-350/GH-96/profile.json"
    profile = json.loads(path.read_text())
    spec, sheet = load_model_spec("OPT-350"), load_gpu_sheet()
    constants = dataclasses.replace(FITTED_ANALYTICAL, **TRUE)
    links = load_sailor_data(root).network
    for mbs, by_tp in profile.items():
        source = AnalyticalSource(
            spec,
            sheet,
            PROFILED_TRAINING,
            constants=constants,
            mbs_values=(int(mbs),),
            query_key_layer_scaling="OPT-350" in QK_LAYER_SCALING,
            measured_links=links,
        )
        for tp, entries in by_tp.items():
            times = source.layer_times(spec.name, "GH-96", int(mbs), int(tp))
            for layer, entry in entries.items():
                i = int(layer)
                entry[0], entry[1] = float(times.forward[i]), float(times.backward[i])
    path.write_text(json.dumps(profile))
    return root


def test_the_fit_recovers_the_constants_that_priced_the_profiles(synthetic):
    found = fit_cluster(
        load_sailor_data(synthetic),
        load_gpu_sheet(),
        models=["OPT-350"],
        gpus=["GH-96", "A100-80"],
    )
    assert set(found.gpus) == {"GH-96", "A100-80"}
    gh = found.gpus["GH-96"]
    assert set(gh.constants) == set(TRUE) and not gh.kept
    for field, value in TRUE.items():
        assert gh.constants[field] == pytest.approx(value, rel=1e-4), field
    assert gh.fit_error["max"] < 1e-6 and gh.leave_one_out["max"] < 1e-5
    # the other GPU types keep their real profiles: their fit is not exact
    assert found.gpus["A100-80"].fit_error["max"] > 0.01


def test_a_constant_no_pass_depends_on_is_kept_with_the_reason():
    """Turing has no TF32: fp32 GEMMs never reach the tensor cores, so the
    RTX-2080 profiles cannot say their efficiency."""
    found = fit_cluster(load_sailor_data(None), load_gpu_sheet(), models=["OPT-350"])
    rtx = found.gpus["RTX-2080"]
    assert {"tensor_efficiency", "backward_tensor_efficiency"} <= set(rtx.kept)
    assert "no profiled pass depends on it" in rtx.kept["tensor_efficiency"]
    assert "memory_efficiency" in rtx.constants


@pytest.fixture(scope="module")
def cal_file(synthetic, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "cal.json"
    code = main(
        ["calibrate", "--profiles", str(synthetic), "--models", "OPT-350"]
        + ["--gpus", "GH-96", "--out", str(out)]
    )
    assert code == 0
    return out


def test_the_file_reads_back_as_written(cal_file):
    found = load_calibration(cal_file, load_gpu_sheet())
    again = json.loads(cal_file.read_text())
    assert found.to_json() == again
    fields = found.fields_for(["GH-96"])["GH-96"]
    assert fields == pytest.approx(TRUE, rel=1e-4)
    with pytest.raises(ProblemError, match="not H100"):
        found.fields_for(["H100"])


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: "not json", "invalid JSON"),
        (lambda d: {**d, "format": "other"}, "not a calibration file"),
        (lambda d: {**d, "extra": 1}, "unknown keys"),
        (lambda d: {**d, "gpus": {}}, "gpus must be"),
        (lambda d: {**d, "gpus": {"NoSuchGPU": d["gpus"]["GH-96"]}}, "not on the GPU"),
        (
            lambda d: _gh(d, constants={"tensor_efficiency": 3.0}),
            "tensor_efficiency must be in",
        ),
        (lambda d: _gh(d, constants={"gemm_exponent": 2.0}), "not a calibrated"),
        (lambda d: _gh(d, constants={"memory_efficiency": "x"}), "must be a number"),
        (lambda d: _gh(d, samples=-1), "whole number"),
        (lambda d: _gh(d, leave_one_out={"median": 1}), "median and max"),
        (lambda d: {**d, "links": {"het": {}}}, "links must hold"),
        (lambda d: {**d, "links": {**d["links"], "het": []}}, "expected a JSON object"),
    ],
)
def test_a_bad_calibration_file_is_one_line_naming_it(
    cal_file, tmp_path, capsys, edit, words
):
    data = json.loads(cal_file.read_text())
    bad = tmp_path / "bad.json"
    edited = edit(data)
    bad.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ProblemError, match=words) as caught:
        load_calibration(bad, load_gpu_sheet())
    assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
    plan = _plan(tmp_path, capsys)
    code = main(["predict", str(plan), "--calibration", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and len(err.strip().splitlines()) == 1


def _gh(data: dict, **fields) -> dict:
    gh = {**data["gpus"]["GH-96"], **fields}
    return {**data, "gpus": {"GH-96": gh}}


def _plan(tmp_path: Path, capsys, gpu: str = "GH-96", *more: str) -> Path:
    """A plan of Llama-3-8B (priced analytically) on 8 ``gpu``, as ``plan
    --json`` writes it (``more``: further flags)."""
    capsys.readouterr()
    code = main(
        ["plan", "--model", "Llama-3-8B", "--gpus", f"{gpu}:8"]
        + ["--global-batch", "8", "--seq-len", "2048", "--precision", "fp32"]
        + ["--schedule", "1f1b", "--recompute", "none", "--sequence-parallel", "off"]
        + ["--json", *more]
    )
    assert code == 0
    out = tmp_path / f"plan-{gpu}-{len(more)}.json"
    out.write_text(capsys.readouterr().out)
    return out


def test_predict_prices_with_the_calibrated_constants(cal_file, tmp_path, capsys):
    plan = _plan(tmp_path, capsys)
    times = {}
    for given in ([], ["--calibration", str(cal_file)]):
        assert main(["predict", str(plan), "--json", *given]) == 0
        out = json.loads(capsys.readouterr().out)
        times[bool(given)] = out["iteration_time_s"]
        calibrated = any("calibrated to the cluster" in n for n in out["notes"])
        assert calibrated == bool(given)
    # TRUE's efficiencies are below the project's: slower
    assert times[True] > times[False] * 1.05


def test_a_calibration_of_other_gpus_is_refused(cal_file, tmp_path, capsys):
    plan = _plan(tmp_path, capsys, "H100")
    code = main(["predict", str(plan), "--calibration", str(cal_file)])
    err = capsys.readouterr().err
    assert code == 2 and "not H100" in err and len(err.strip().splitlines()) == 1


def test_a_launch_description_takes_no_calibration(cal_file, capsys):
    code = main(
        ["predict", "--megatron-args", "--num-layers 2", "--gpus", "H100:8"]
        + ["--calibration", str(cal_file)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--calibration prices plan files and models" in err


def test_the_calibrated_fields_are_the_fit_fields_bounds():
    """(One definition of each bound: the fit's, and the roofline's largest
    link efficiency.)"""
    from pipedejavu.costmodel.analytical.calibrate import FIT_FIELDS
    from pipedejavu.costmodel.analytical.roofline import MAX_LINK_EFFICIENCY

    shared = [f for f in CALIBRATED_FIELDS if f in FIT_FIELDS]
    assert set(CALIBRATED_FIELDS) - set(shared) == {"link_efficiency"}
    assert all(CALIBRATED_FIELDS[f] == FIT_FIELDS[f] for f in shared)
    assert CALIBRATED_FIELDS["link_efficiency"][1] == MAX_LINK_EFFICIENCY
    assert np.all([lo < hi for lo, hi in CALIBRATED_FIELDS.values()])


def test_plan_searches_with_the_calibration_predict_prices_it_with(
    cal_file, tmp_path, capsys
):
    """``plan --calibration``: its plan's time is what ``predict
    --calibration`` says of the plan file (one pricing), and differs from
    the uncalibrated search's; with --export torchtitan (its own kernel
    constants) or --megatron-args, refused in one line."""
    planned = _plan(tmp_path, capsys, "GH-96", "--calibration", str(cal_file))
    found = json.loads(planned.read_text())
    given = ["--json", "--calibration", str(cal_file)]
    assert main(["predict", str(planned), *given]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_time_s"] == pytest.approx(
        found["iteration_time_s"], rel=1e-9
    )
    plain = json.loads(_plan(tmp_path, capsys).read_text())
    assert plain["iteration_time_s"] < 0.95 * again["iteration_time_s"]
    for flags in (
        ["--export", "torchtitan"],
        ["--megatron-args", "--num-layers 2"],
    ):
        code = main(
            ["plan", "--gpus", "GH-96:8", "--global-batch", "8"]
            + (["--model", "Llama-3-8B"] if flags[0] == "--export" else [])
            + ["--calibration", str(cal_file), *flags]
        )
        err = capsys.readouterr().err
        assert code == 2 and "--calibration" in err, flags
        assert len(err.strip().splitlines()) == 1


def test_the_profiles_links_travel_in_the_file(cal_file, tmp_path, capsys):
    """The calibration keeps the profiles' measured link fits: read back
    they price as the profiles' own tables do, and a calibrated prediction
    says it uses them."""
    found = load_calibration(cal_file, load_gpu_sheet())
    bundled = load_sailor_data(None).network
    assert found.links is not None
    assert found.links.tables() == json.loads(json.dumps(bundled.tables()))
    for n in (1, 2, 4):
        mine = found.links.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", n)
        theirs = bundled.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", n)
        assert mine == theirs
    plan = _plan(tmp_path, capsys)
    assert main(["predict", str(plan), "--json", "--calibration", str(cal_file)]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("its measured links" in note for note in notes)
