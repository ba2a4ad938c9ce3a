"""The stage records' shared device count and JSON form (core.stage_record),
and the analytical layers' empty-pass pricing (pass_seconds_or_zero)."""

from __future__ import annotations

import json

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.hetero import HeteroStage
from pipedejavu.core.problem import Stage
from pipedejavu.costmodel.analytical.layers import pass_seconds_or_zero
from pipedejavu.costmodel.analytical.ops import MemoryOp
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    pass_seconds,
)


def test_stage_json_lists_every_field_in_order():
    stage = Stage(1, 3, (2, 4), 5, 0, 0.25)
    assert stage.num_devices == 8
    assert json.dumps(stage.to_json()) == (
        '{"start": 1, "stop": 3, "submesh": [2, 4], "submesh_index": 5, '
        '"config_index": 0, "latency": 0.25}'
    )


def test_hetero_stage_json_lists_every_field_in_order():
    hosts = (0, 2)
    stage = HeteroStage(0, 2, (2, 8), 1, 3, 1, hosts, 0, 1.5)
    assert stage.num_devices == 16
    out = stage.to_json()
    assert json.dumps(out) == (
        '{"start": 0, "stop": 2, "submesh": [2, 8], "submesh_index": 1, '
        '"config_index": 3, "device_type": 1, "hosts": [0, 2], '
        '"first_device": 0, "latency": 1.5}'
    )
    assert type(out["hosts"]) is list


def test_pass_seconds_or_zero():
    gpu = GpuSheetEntry("X", 1e9, 1e12, (("fp32", 1e13),), 1, 1e11, 1e10)
    assert pass_seconds_or_zero([], gpu, FITTED_ANALYTICAL) == 0.0
    ops = [MemoryOp("copy", 1e9)]
    assert pass_seconds_or_zero(ops, gpu, FITTED_ANALYTICAL) == pass_seconds(
        ops, gpu, FITTED_ANALYTICAL
    )
