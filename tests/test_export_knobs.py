"""The training knobs travel with the exports, or the export says why not.

Megatron-LM (megatron-core 0.16.1 ``get_forward_backward_func``) and
DeepSpeed 0.19.8 (``TrainSchedule``) have no zero-bubble schedule.
"""

from __future__ import annotations

import pytest

from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import EXPORTS, export_plan

HOSTS = {"B-80": 8}
ZERO_BUBBLE = TrainingOptions(zero_bubble=True)


@pytest.mark.parametrize("target", EXPORTS)
def test_zero_bubble_is_refused_where_no_schedule_runs_it(target):
    plan = plan_from_stages(
        [(0, 5, 1), (5, 10, 1)], gpu_type="B-80", dp=1, mbs=1, gbs=8,
        model="m", gpus_per_node=8, zone="z",
    )  # fmt: skip
    with pytest.raises(ExportRefused) as refusal:
        export_plan(plan, target, gpus_per_node=HOSTS, options=ZERO_BUBBLE)
    message = str(refusal.value)
    assert "\n" not in message
    if target in ("megatron", "deepspeed", "megatron-deepspeed"):
        assert "no zero-bubble schedule" in message
    else:
        assert "schedule settings" in message
    assert message.endswith("no export target can launch it")
