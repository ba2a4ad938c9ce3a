"""TrainingOptions: defaults, validation and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from pipedejavu.core.training_options import TrainingOptions


def test_defaults_are_the_plain_fp32_run():
    options = TrainingOptions()
    assert options.precision == "fp32"
    assert options.distributed_optimizer is False
    assert options.recompute == "none"
    assert options.recompute_num_layers is None
    assert options.virtual_stages == 1
    assert options.sequence_parallel is False
    assert options.flash_attention is True


@pytest.mark.parametrize(
    "options",
    [
        TrainingOptions(),
        TrainingOptions(precision="bf16", distributed_optimizer=True),
        TrainingOptions(precision="fp8", recompute="full", recompute_num_layers=3),
        TrainingOptions(
            precision="fp16",
            recompute="selective",
            virtual_stages=4,
            sequence_parallel=True,
            flash_attention=False,
        ),
        TrainingOptions("bf16", zero_bubble=True, virtual_stages=3),
        TrainingOptions("bf16", zero_bubble=True, virtual_stages=2, v_shape=True),
    ],
)
def test_json_round_trip(options):
    text = json.dumps(options.to_json())
    assert TrainingOptions.from_json(json.loads(text)) == options
    assert hash(TrainingOptions.from_json(json.loads(text))) == hash(options)


def test_from_json_fills_defaults():
    assert TrainingOptions.from_json({"precision": "bf16"}) == TrainingOptions(
        precision="bf16"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "int8"}, "precision must be one of"),
        ({"precision": "tf32"}, "precision must be one of"),
        ({"recompute": "partial"}, "recompute must be one of"),
        ({"distributed_optimizer": 1}, "distributed_optimizer must be a bool"),
        ({"sequence_parallel": "yes"}, "sequence_parallel must be a bool"),
        ({"flash_attention": None}, "flash_attention must be a bool"),
        ({"recompute": "full", "recompute_num_layers": 0}, r"in \[1, 100000\], got 0"),
        (
            {"recompute": "full", "recompute_num_layers": 10**30},
            r"in \[1, 100000\], got 1000000000000000000000000000000",
        ),
        (
            {"recompute": "full", "recompute_stage_layers": (10**30, 0)},
            r"ints in \[0, 100000\]",
        ),
        ({"recompute": "full", "recompute_choices": [0, 100001]}, r"ints in \[0,"),
        ({"recompute": "full", "recompute_num_layers": 2.0}, "an int or None"),
        ({"recompute": "full", "recompute_num_layers": True}, "an int or None"),
        ({"recompute_num_layers": 2}, "applies to recompute='full' only"),
        (
            {"recompute": "selective", "recompute_num_layers": 2},
            "applies to recompute='full' only",
        ),
        ({"virtual_stages": 0}, "virtual_stages must be >= 1, got 0"),
        ({"virtual_stages": 2.5}, "virtual_stages must be an int"),
        ({"v_shape": "yes"}, "v_shape must be a bool"),
        ({"v_shape": True}, "v_shape .ZB-V. needs zero_bubble=True"),
        (
            {"v_shape": True, "zero_bubble": True, "virtual_stages": 3},
            "virtual_stages=2, got zero_bubble=True, virtual_stages=3",
        ),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingOptions(**kwargs)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a JSON object, got list"),
        ({"precison": "bf16"}, r"unknown keys \['precison'\]"),
        ({"precision": "fp64"}, "precision must be one of"),
    ],
)
def test_from_json_rejects_bad_objects(data, message):
    with pytest.raises(ValueError, match=message):
        TrainingOptions.from_json(data)
