"""Pictures of a plan: the slowest pipeline's timeline and each stage's memory
(pipedejavu.planning.plan_pictures), read back from the figure drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.memory_terms import MEMORY_TERMS
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.plan_pictures import plan_figure
from tests.helpers import run_cli

pytest.importorskip("matplotlib")

#: (options, the pipeline stages, what a stage runs per micro-batch)
SCHEDULES = {
    "1f1b": (TrainingOptions(), 4, "FB"),
    "interleaved": (TrainingOptions(virtual_stages=2), 4, "FB"),
    "zero-bubble": (TrainingOptions(zero_bubble=True), 4, "FBW"),
    "zb-v": (
        TrainingOptions(zero_bubble=True, virtual_stages=2, v_shape=True),
        4,
        "FBW",
    ),
}


def _predicted(name: str, dp: int = 2):
    options, stages, _ = SCHEDULES[name]
    choice = choose_cost_source("Llama-3-8B", ["H100"], options=options)
    bounds = [0, 9, 17, 25, 34]  # 8 blocks a rank, the embedding, the head
    plan = plan_from_stages(
        [(bounds[k], bounds[k + 1], 2) for k in range(stages)],
        gpu_type=next(iter(choice.gpu_types.values())),
        dp=dp,
        mbs=1,
        gbs=8 * dp,
        model=choice.model,
        gpus_per_node=8,
        zone="us-central1-a",
    )
    prediction = predict_plan(plan, choice.data, virtual_stages=options.virtual_stages)
    return plan, prediction


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_timeline_is_the_slowest_pipeline_simulated(name):
    """Every stage runs each of its micro-batch-chunks' commands once, one
    after another, and the last ends when the prediction's pipeline does."""
    options, stages, kinds = SCHEDULES[name]
    plan, prediction = _predicted(name)
    bars = prediction.timeline()
    chunks = options.virtual_stages
    for s in range(stages):
        mine = [b for b in bars if b.stage == s and b.kind != "T"]
        for kind in kinds:
            done = sorted((b.chunk, b.microbatch) for b in mine if b.kind == kind)
            assert done == [(c, m) for c in range(chunks) for m in range(8)], kind
        assert {b.kind for b in mine} == set(kinds)
        for before, after in zip(mine, mine[1:], strict=False):
            assert after.start >= before.end - 1e-12  # one command at a time
    ends = max(b.end for b in bars)
    assert ends == pytest.approx(prediction.pipeline_s, rel=1e-9)
    assert np.all(prediction.stage_ready_s <= prediction.iteration_time_s)


def test_figure_draws_every_stage_bar_and_memory_term():
    plan, prediction = _predicted("interleaved")
    figure = plan_figure(plan, prediction)
    timeline, memory = figure.axes
    names = [f"stage {s}" for s in range(plan.num_stages)]
    for axes in (timeline, memory):
        assert [t.get_text() for t in axes.get_yticklabels()] == names
    drawn = {c.get_gid(): c for c in timeline.collections}
    for s in range(plan.num_stages):
        for chunk in range(2):
            for kind in "FB":
                assert len(drawn[f"{kind}:{s}:{chunk}"].get_paths()) == 8
        assert f"optimizer:{s}" in drawn and f"idle:{s}" in drawn
    labels = {t.get_text() for t in timeline.get_legend().get_texts()}
    assert {"forward", "backward", "optimizer step", "idle (bubble)"} <= labels
    tied = bool(prediction.tied_allreduce_s.max() > 0)  # Llama 3 unties them
    assert ("tied-embedding all-reduce" in labels) is tied
    # memory: each stage's bar is its largest GPU's memory, term by term
    widths: dict[int, float] = {}
    for patch in memory.patches:
        term = patch.get_gid().split(":")[1]
        assert term in MEMORY_TERMS
        row = round(patch.get_y() + patch.get_height() / 2)
        widths[row] = widths.get(row, 0.0) + patch.get_width()
    expected = prediction.memory_bytes.max(axis=1) / 1e9
    np.testing.assert_allclose([widths[s] for s in range(plan.num_stages)], expected)
    assert {c.get_gid() for c in memory.collections} == {"capacity"}
    legend = {t.get_text() for t in memory.get_legend().get_texts()}
    assert {"activations", "optimizer", "reserve", "GPU memory"} <= legend


def test_stage_terms_sum_to_each_stage_memory():
    plan, prediction = _predicted("zero-bubble")
    for s in range(plan.num_stages):
        terms = prediction.stage_terms(s)
        assert terms["stage"] == s
        assert sum(terms["terms"].values()) == pytest.approx(terms["total"])
        assert terms["total"] == prediction.memory_bytes[s].max()
    assert prediction.stage_terms(0)["terms"].keys() == set(MEMORY_TERMS)


def test_predict_and_plan_write_pictures(capsys, tmp_path):
    plan, _ = _predicted("1f1b")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    code, out, err = run_cli(capsys, "predict", path, "--plot", tmp_path / "p.png")
    assert code == 0 and "iteration" in out and "plot written" in err
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    argv = ["plan", "--model", "OPT-350", "--gpus", "GH-96:4", "--global-batch", "16"]
    code, out, err = run_cli(capsys, *argv, "--plot", tmp_path / "q.svg")
    assert code == 0 and "<svg" in (tmp_path / "q.svg").read_text()


@pytest.mark.parametrize("target", ["p.pdf", "p"])
def test_other_picture_files_are_refused_before_any_work(capsys, tmp_path, target):
    argv = ["plan", "--model", "OPT-350", "--gpus", "GH-96:4", "--global-batch", "16"]
    code, out, err = run_cli(capsys, *argv, "--plot", tmp_path / target)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert ".png or .svg" in err and not (tmp_path / target).exists()
    code, out, err = run_cli(capsys, "predict", "x.json", "--plot", target)
    assert code == 2 and ".png or .svg" in err


def test_unwritable_picture_exits_1_with_the_answer_printed(capsys, tmp_path):
    plan, _ = _predicted("1f1b")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    target = tmp_path / "no-such-folder" / "p.png"
    code, out, err = run_cli(capsys, "predict", path, "--plot", target)
    assert code == 1 and "iteration" in out and "no plot written" in err
