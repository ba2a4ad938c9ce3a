"""The 3D-plan predictor: closed forms, its memory formula, monotonicity, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from pipedejavu.core.layout import ParallelLayout, StageAxes
from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import (
    BUCKET_ELEMENTS,
    FITTED_CONSTANTS,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData, bundled_sailor_dir

DATA = SailorData()
C = FITTED_CONSTANTS


def _plan(bounds=(0, 26), dp=1, tp=4, mbs=2, gbs=16, gpu="GH-96", model="OPT-350"):
    stages = tuple(
        Stage3D(a, b, tuple(Replica(gpu, tp) for _ in range(dp)))
        for a, b in zip(bounds, bounds[1:], strict=False)
    )
    return Plan3D(stages=stages, mbs=mbs, gbs=gbs, model=model)


def test_one_stage_closed_form():
    """One stage, one replica: ``B (f + b) + optimizer``, memory by hand."""
    plan = _plan(mbs=4, gbs=24)
    pred = predict_plan(plan, DATA, constants=C)
    times = DATA.layer_times("OPT-350", "GH-96", 4, 4, smooth=True)
    f = times.forward.sum() + C.op_overhead_s
    b = times.backward.sum() + C.op_overhead_s
    info = DATA.model_info("OPT-350")
    params = info.params[4].sum() - info.tied_params(4)  # one tied copy
    profiled = info.params[4][[0, 1, 2, 25]].sum() - info.tied_params(4)
    optimizer = times.update[0] * params / profiled
    assert pred.num_microbatches == 6
    assert pred.iteration_time_s == pytest.approx(6 * (f + b) + optimizer)
    assert pred.dp_allreduce_s.tolist() == [0.0] and pred.tied_allreduce_s.tolist() == [
        0.0
    ]
    stash = 4 * info.act_mem[4].sum() * 4  # mbs x act_mem floats x 4 bytes
    expected = (
        16 * params
        + 4 * params  # one bucket (< 5e8 elements), flattened
        + (1 + C.activation_overhead) * stash
        + C.reserve("GH-96")
    )
    assert pred.peak_memory_bytes == pytest.approx(expected)
    assert params < BUCKET_ELEMENTS and pred.fits_memory


def test_equal_stages_pipeline_term():
    """Four 1-layer-heavy stages with free links: the pipeline phase is the
    1F1B closed form ``(S + B - 1)(f + b)`` when stages are equal; here they are
    not, so it is at least ``B * max(f + b) + sum of the others``."""
    plan = _plan(bounds=(0, 7, 13, 19, 26), mbs=8, gbs=64)
    pred = predict_plan(plan, DATA, constants=C)
    per_stage = pred.stage_forward_s[:, 0] + pred.stage_backward_s[:, 0]
    transfers = pred.activation_transfer_s[:, 0] + pred.gradient_transfer_s[:, 0]
    lower = 8 * per_stage.max() + per_stage.sum() - per_stage.max()
    assert pred.pipeline_s >= lower - 1e-9
    # GH-96 at mbs 8, tp 4: 16 MiB per GPU, above NCCL's buffer: rendezvous.
    assert pred.pipeline_s <= (3 + 8) * (per_stage.max() + transfers.max()) + 1e-9
    assert pred.peak_in_flight.tolist() == [4, 3, 2, 1]
    assert (pred.tied_allreduce_s > 0).all()


@pytest.mark.parametrize("bounds", [(0, 26), (0, 12, 26), (0, 5, 12, 19, 26)])
def test_more_microbatches_never_faster(bounds):
    times = [
        predict_plan(_plan(bounds, dp=2, gbs=gbs), DATA, constants=C).iteration_time_s
        for gbs in (4, 8, 16, 64, 128)
    ]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize("bounds", [(0, 26), (0, 12, 26), (0, 5, 12, 19, 26)])
def test_larger_mbs_never_faster(bounds):
    """Same number of micro-batches, larger micro-batches: never less time."""
    times = [
        predict_plan(
            _plan(bounds, dp=2, mbs=mbs, gbs=mbs * 2 * 8), DATA, constants=C
        ).iteration_time_s
        for mbs in (1, 2, 4, 8, 16, 32)
    ]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))


@pytest.fixture(scope="module")
def slow_network(tmp_path_factory):
    """A copy of the data with every link three times slower."""
    root = tmp_path_factory.mktemp("slow") / "data"
    shutil.copytree(bundled_sailor_dir(), root)

    def scale(node):
        if isinstance(node, list) and len(node) == 2 and isinstance(node[0], list):
            return [[v / 3 for v in node[0]], node[1] / 3]
        if isinstance(node, dict):
            return {k: scale(v) for k, v in node.items()}
        return node

    for path in (root / "network").glob("*.json"):
        path.write_text(json.dumps(scale(json.loads(path.read_text()))))
    return SailorData(root)


@pytest.mark.parametrize(
    "plan",
    [
        _plan((0, 12, 26), dp=4, mbs=8, gbs=256),
        _plan((0, 5, 12, 19, 26), dp=2, mbs=1, gbs=64),
        _plan((0, 12, 26), dp=2, tp=8, mbs=2, gbs=64, gpu="Titan-RTX"),
    ],
    ids=["gh-2stages", "gh-4stages-buffered", "titan"],
)
def test_slower_links_never_faster(plan, slow_network):
    fast = predict_plan(plan, DATA, constants=C)
    slow = predict_plan(plan, slow_network, constants=C)
    assert slow.iteration_time_s > fast.iteration_time_s
    assert (slow.dp_allreduce_s >= fast.dp_allreduce_s).all()
    np.testing.assert_allclose(slow.memory_bytes, fast.memory_bytes)


def test_bigger_reserve_and_overhead_cost_memory_and_time():
    plan = _plan((0, 12, 26), dp=2, mbs=4, gbs=64)
    base = predict_plan(plan, DATA, constants=C)
    more = predict_plan(
        plan,
        DATA,
        constants=dataclasses.replace(
            C, op_overhead_s=2 * C.op_overhead_s, activation_overhead=0.5
        ),
    )
    assert more.iteration_time_s > base.iteration_time_s
    assert (more.memory_bytes > base.memory_bytes).all()


def test_memory_beyond_the_device_is_reported():
    plan = _plan((0, 26), mbs=64, gbs=64, tp=8, gpu="RTX-3090")
    pred = predict_plan(plan, DATA, constants=C)
    assert not pred.fits_memory
    assert pred.to_json()["fits_memory"] is False


@pytest.mark.parametrize(
    "plan, message",
    [
        (_plan((0, 20)), "covers layers 0..19 but model OPT-350 has 26"),
        (_plan(gpu="H100"), "unknown GPU type 'H100'"),
        (_plan(mbs=3, gbs=9), "no entry for mbs 3, tp 4"),
        (_plan(tp=8), "tp 8 exceeds the 4 GPUs of a GH-96 node"),
        (_plan(model="GPT-5"), "has no model 'GPT-5'"),
        (_plan(model=None), "names no model"),
        (
            Plan3D(
                (Stage3D(0, 26, (Replica("GH-96", 4), Replica("GH-96", 4))),),
                2,
                8,
                model="OPT-350",
                layout=ParallelLayout((StageAxes(4, ep=2),), 2),
            ),
            "stage 0 lays out experts \\(ep 2\\), but model OPT-350 has none",
        ),
        (
            _plan().replace(layout=ParallelLayout((4,), 1, cp=2)),
            r"the plan has context parallelism 2; the costs are for 1",
        ),
    ],
)
def test_bad_plans(plan, message):
    with pytest.raises(ProblemError, match=message):
        predict_plan(plan, DATA, constants=C)


def test_constants_validation():
    with pytest.raises(ValueError, match="op_overhead_s must be finite"):
        PredictorConstants(op_overhead_s=-1.0)
    with pytest.raises(ValueError, match="reserve_bytes of GH-96"):
        PredictorConstants(reserve_bytes=(("GH-96", float("nan")),))
    assert PredictorConstants().reserve("X") == 0.0
    assert C.reserve("RTX-3090") == C.default_reserve_bytes
