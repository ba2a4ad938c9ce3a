"""3D plans: the vocabulary, our JSON, and Sailor's plan_config (every bundled file)."""

from __future__ import annotations

import json

import pytest

from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.sailor_data import bundled_sailor_dir
from pipedejavu.io.sailor_plan import (
    load_plan3d,
    plan_from_sailor,
    plan_to_sailor,
    write_sailor_plan,
)

PLAN_FILES = sorted((bundled_sailor_dir() / "measured").glob("*/plan_config_*.json"))
MEASURED_FIELDS = ("real", "max_mem", "red_grads")


def _plan(**changes):
    gh = Replica("GH-96", 4)
    fields = dict(
        stages=(Stage3D(0, 12, (gh, gh)), Stage3D(12, 26, (gh, gh))),
        mbs=2,
        gbs=64,
        model="OPT-350",
    )
    fields.update(changes)
    return Plan3D(**fields)


def test_sizes():
    plan = _plan()
    assert (plan.num_stages, plan.dp, plan.num_layers, plan.num_gpus) == (2, 2, 26, 16)
    assert plan.num_microbatches == 16  # ceil(64 / (2 * 2))
    assert _plan(gbs=65).num_microbatches == 17
    assert plan.gpus_by_type() == {"GH-96": 16}
    assert plan.describe().startswith("pp 2 [12+14], dp 2, tp 4, mbs 2, gbs 64")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: _plan(stages=(Stage3D(1, 26, (Replica("GH-96", 4),)),)), "starts at"),
        (
            lambda: _plan(
                stages=(
                    Stage3D(0, 12, (Replica("GH-96", 4),)),
                    Stage3D(12, 26, (Replica("GH-96", 4),) * 2),
                )
            ),
            "same number of data-parallel replicas",
        ),
        (lambda: Stage3D(3, 3, (Replica("GH-96", 4),)), "at least one layer"),
        (lambda: Replica("GH-96", 0), "tp must be a positive integer"),
        (lambda: Replica("", 1), "gpu_type"),
        (lambda: _plan(mbs=0), "mbs must be a positive integer"),
        (lambda: _plan(gbs=1.5), "gbs must be a positive integer"),
        (lambda: Stage3D(0, 2, ()), "at least one Replica"),
    ],
)
def test_validation(build, message):
    with pytest.raises(ProblemError, match=message):
        build()


def test_our_json_round_trip(tmp_path):
    plan = _plan(
        stages=(
            Stage3D(0, 5, (Replica("RTX-3090", 8, node=0), Replica("RTX-2080", 2))),
            Stage3D(5, 26, (Replica("Titan-RTX", 8, zone="z"), Replica("GH-96", 1))),
        )
    )
    data = plan.to_json()
    assert Plan3D.from_json(json.loads(json.dumps(data))) == plan
    data["iteration_time_s"] = 1.0  # extra keys (a planner's) are ignored
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    loaded, kind = load_plan3d(path)
    assert (loaded, kind) == (plan, "pipedejavu")
    with pytest.raises(ProblemError, match="is a plan for model 'OPT-350'"):
        load_plan3d(path, model="GPT-Neo-2.7")


@pytest.mark.parametrize("path", PLAN_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_bundled_plan_config_round_trips(path, tmp_path):
    original = json.loads(path.read_text())
    plan, kind = load_plan3d(path, model="OPT-350")
    assert kind == "sailor" and plan.model == "OPT-350"
    pipe = original["pipeline_list"][0]
    assert plan.num_stages == pipe["num_stages"]
    assert [list(range(s.start, s.stop)) for s in plan.stages] == pipe[
        "layers_per_stage"
    ]
    assert [s.dp for s in plan.stages] == pipe["dp"]
    assert (plan.mbs, plan.gbs) == (original["mbs"], original["gbs"])
    # Writing gives back the file minus its measured fields, key for key.
    expected = {k: v for k, v in original.items() if k not in MEASURED_FIELDS}
    assert plan_to_sailor(plan) == expected
    out = tmp_path / "back.json"
    write_sailor_plan(plan, out)
    assert load_plan3d(out, model="OPT-350")[0] == plan


def test_measured_fields_are_not_read():
    data = json.loads(PLAN_FILES[0].read_text())
    stripped = {k: v for k, v in data.items() if k not in MEASURED_FIELDS}
    garbage = dict(stripped, real="not a number", max_mem=None)
    assert plan_from_sailor(garbage) == plan_from_sailor(data)


def _sailor(**changes):
    data = json.loads(PLAN_FILES[0].read_text())
    data["pipeline_list"][0].update(changes)
    return data


@pytest.mark.parametrize(
    "data, message",
    [
        ({"pipeline_list": []}, "0 pipelines"),
        ({"mbs": 1}, "'pipeline_list' list"),
        (_sailor(layers_per_stage=[[0, 2, 3]]), "not consecutive"),
        (_sailor(dp=[3]), "dp is 3 but tmp_per_stage lists"),
        (_sailor(num_stages=2), "must agree"),
        (
            _sailor(tmp_per_stage=[[[[["GH-96", 4, "z"], ["GH-96", 4, "z"]], 8]] * 16]),
            "spans 2 nodes",
        ),
        (_sailor(tmp_per_stage=[[[[["GH-96", 4, "z"]], 0]] * 16]), "tp must be"),
    ],
)
def test_bad_plan_config(data, message):
    with pytest.raises(ProblemError, match=message):
        plan_from_sailor(data, source="x.json")


def test_unreadable_files(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ProblemError, match="cannot read"):
        load_plan3d(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ProblemError, match="invalid JSON"):
        load_plan3d(broken)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"stages": [{"layers": [0]}]}')
    with pytest.raises(ProblemError, match="wrong.json: not a valid 3D plan"):
        load_plan3d(wrong)
