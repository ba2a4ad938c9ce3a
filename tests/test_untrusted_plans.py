"""Untrusted plans and GPU sheets found wanting by a review: a stage whose
replicas are not a list, micro-batch sizes that overflowed the predictor, a
global batch too small for one micro-batch per replica, and GPU-sheet numbers
so small or large that the cost model divided by zero or overflowed. Each
fails with one line naming the file (a :class:`ProblemError`), exit 2 from
the CLI."""

from __future__ import annotations

import json

import pytest
from helpers import small_plan

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH
from pipedejavu.io.gpu_sheet import (
    FIELD_RANGES,
    PEAK_FLOPS_RANGE,
    bundled_gpu_sheet_path,
    load_gpu_sheet,
)
from pipedejavu.io.sailor_plan import load_plan3d


def _plan_json(**changes):
    """Our plan JSON of a small valid plan (2 stages, dp 2), top-level keys
    replaced by ``changes``."""
    return {**small_plan().to_json(), **changes}


def _sailor_json(**changes):
    """A Sailor plan_config of one pipeline (2 stages, dp 1)."""
    node = [[["GH-96", 4, "us-central1-a"]], 4]
    data = {
        "zone": "us-central1-a",
        "pipeline_list": [
            {
                "num_stages": 2,
                "layers_per_stage": [list(range(12)), list(range(12, 26))],
                "tmp_per_stage": [[node], [node]],
                "dp": [1, 1],
            }
        ],
        "mbs": 8,
        "gbs": 32,
        "N": 2,
    }
    return {**data, **changes}


def _write(tmp_path, data, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _refused(load, path, match):
    with pytest.raises(ProblemError, match=match) as caught:
        load(path)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message
    return message


# ------------------------------------------------------------ plan structure
@pytest.mark.parametrize("replicas", [5, None, "GH-96", {"gpu": "GH-96", "tp": 4}])
def test_replicas_that_are_not_a_list_are_refused(tmp_path, replicas):
    data = _plan_json()
    data["stages"][0]["replicas"] = replicas
    path = _write(tmp_path, data)
    _refused(load_plan3d, path, "stage 0: 'replicas' must be a list")


# ------------------------------------------------------------ integer bounds
@pytest.mark.parametrize(
    "mbs", [10**30, 1e308, 2**40, float(2**40), MAX_GLOBAL_BATCH + 1]
)
def test_huge_micro_batches_are_refused(tmp_path, mbs):
    path = _write(tmp_path, _plan_json(mbs=mbs))
    message = _refused(load_plan3d, path, rf"mbs must be in \[1, {MAX_GLOBAL_BATCH}\]")
    assert len(message) < 200


def test_huge_micro_batches_in_sailor_files_are_refused(tmp_path):
    path = _write(tmp_path, _sailor_json(mbs=10**30, gbs=64))
    _refused(load_plan3d, path, "mbs must be in")


@pytest.mark.parametrize(
    ("where", "value", "match"),
    [
        ("tp", 1e308, r"tp must be in \[1, 131072\], got 1e\+308"),
        ("node", 10**30, "node must be an integer in"),
        (
            "node",
            -(10**40),
            r"node must be an integer in \[0, 131072\).*got an integer around -1e40",
        ),
        ("gpus_on_node", 10**40, "gpus_on_node must be in"),
        ("stop", 10**30, "stage stop must be at most"),
    ],
)
def test_other_huge_integers_are_refused(tmp_path, where, value, match):
    data = _plan_json()
    if where == "stop":
        data["stages"][-1]["layers"][1] = value
    else:
        data["stages"][0]["replicas"][0][where] = value
    path = _write(tmp_path, data)
    _refused(load_plan3d, path, match)


# ------------------------------------------------ global batch vs. mbs x dp
@pytest.mark.parametrize(("mbs", "gbs"), [(128, 64), (2, 3), (64, 64)])
def test_a_global_batch_below_one_micro_batch_per_replica_is_refused(
    tmp_path, mbs, gbs
):
    path = _write(tmp_path, _plan_json(mbs=mbs, gbs=gbs))
    _refused(load_plan3d, path, rf"gbs {gbs} is smaller than mbs x dp = {mbs} x 2")


def test_a_sailor_global_batch_below_the_micro_batch_is_refused(tmp_path):
    path = _write(tmp_path, _sailor_json(mbs=8, gbs=4))
    _refused(
        lambda p: load_plan3d(p, model="OPT-350"),
        path,
        "not a usable Sailor plan_config: gbs 4 is smaller than mbs x dp = 8 x 1",
    )


@pytest.mark.parametrize(("gbs", "microbatches"), [(4, 1), (5, 2), (64, 16)])
def test_a_global_batch_not_a_multiple_keeps_sailors_ceil(tmp_path, gbs, microbatches):
    """Sailor's README: micro-batches per pipeline = ceil(gbs / (mbs x dp))."""
    plan, _ = load_plan3d(_write(tmp_path, _plan_json(mbs=2, gbs=gbs)))
    assert plan.num_microbatches == microbatches


# ---------------------------------------------------------------- GPU sheet
def _sheet(tmp_path, fields):
    return _write(tmp_path, {"gpus": {"H100-SXM": fields}}, "gpus.json")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"inter_node_bytes_per_s": 5e-324}, "inter_node_bytes_per_s must be in"),
        ({"intra_node_bytes_per_s": 5e-324}, "intra_node_bytes_per_s must be in"),
        ({"memory_bandwidth_bytes_per_s": 5e-324}, "memory_bandwidth_bytes_per_s"),
        ({"peak_flops": {"bf16": 5e-324}}, "peak_flops bf16 must be in"),
        ({"peak_flops": {"bf16": 1e308}}, "peak_flops bf16 must be in"),
        ({"memory_bytes": 1}, r"memory_bytes must be in \[1e\+08"),
        ({"memory_bytes": 1e308}, "memory_bytes must be in"),
        (
            {"inter_node_bytes_per_s": 10**400},
            "inter_node_bytes_per_s must be in .* got an integer around 1e400",
        ),
        ({"peak_flops": {"fp8": 10**400}}, "peak_flops fp8 must be in"),
        ({"multiprocessors": 132, "clock_hz": 1}, "clock_hz must be in"),
    ],
)
def test_implausible_gpu_sheet_numbers_are_refused(tmp_path, fields, match):
    path = _sheet(tmp_path, fields)
    message = _refused(load_gpu_sheet, path, match)
    assert "GPU H100-SXM" in message and len(message) < 300


def test_the_bundled_sheet_lies_well_inside_the_ranges():
    """Every bundled number is at least 10x inside its bounds."""
    gpus = json.loads(bundled_gpu_sheet_path().read_text())["gpus"]
    for entry in gpus.values():
        for field, (low, high, _) in FIELD_RANGES.items():
            if field in entry:
                assert 10 * low <= entry[field] <= high / 10, field
        low, high = PEAK_FLOPS_RANGE
        for value in entry["peak_flops"].values():
            assert 10 * low <= value <= high / 10
    assert len(load_gpu_sheet()) == len(gpus)


@pytest.mark.parametrize("edge", [0, 1])
def test_numbers_at_the_bounds_are_accepted(tmp_path, edge):
    fields = {field: bounds[edge] for field, bounds in FIELD_RANGES.items()}
    fields["peak_flops"] = {"bf16": PEAK_FLOPS_RANGE[edge]}
    fields["multiprocessors"] = 132
    entry = load_gpu_sheet(_sheet(tmp_path, fields))["H100-SXM"]
    assert entry.peak("bf16") == PEAK_FLOPS_RANGE[edge]


# ---------------------------------------------------------------------- CLI
def test_the_cli_says_one_line_and_exits_2(tmp_path, capsys):
    from pipedejavu.cli.main import main

    data = _plan_json()
    data["stages"][0]["replicas"] = 5
    path = _write(tmp_path, data)
    code = main(["predict", str(path)])
    _, err = capsys.readouterr()
    assert code == 2
    assert str(path) in err and len(err.strip().splitlines()) == 1
