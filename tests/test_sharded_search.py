"""The sharded single-stage search (FSDP2/HSDP x TP x CP): every plan of its
space priced, the fastest that fits returned; checked against pricing the
space by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.errors import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning import sharded_search
from pipedejavu.planning.plan_model import plan_model
from pipedejavu.planning.sharded_search import search_sharded, sharded_candidates
from pipedejavu.planning.torchtitan_launch import sharded_plan

SHEET = load_gpu_sheet()
SPEC = dataclasses.replace(load_model_spec("llama-3-8b"), seq_length=32768)
OPTIONS = TrainingOptions("bf16")


def test_candidates_cover_the_space():
    full = [dataclasses.replace(OPTIONS, recompute="full")]
    got = sharded_candidates(SPEC, 16, 8, 8, recompute=full)
    # tp 1, 2, 4, 8; cp with 2 cp | 32768 and dp | 8 samples; every mbs and
    # dp_shard dividing what is left
    expected = set()
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8, 16):
            if 16 % (tp * cp):
                continue
            dp = 16 // (tp * cp)
            if 8 % dp:
                continue
            for mbs in range(1, 8 // dp + 1):
                for shard in range(1, dp + 1):
                    if (8 // dp) % mbs == 0 and dp % shard == 0:
                        expected.add((tp, cp, shard, mbs))
    assert {c[:4] for c in got} == expected and len(got) == len(expected)


def test_best_is_the_fastest_that_fits_by_hand():
    full = [dataclasses.replace(OPTIONS, recompute=r) for r in ("none", "full")]
    best = search_sharded(SPEC, "H100-SXM", 16, 8, SHEET, OPTIONS, recompute=full)
    times = []
    for tp, cp, shard, mbs, base in sharded_candidates(SPEC, 16, 8, 8, recompute=full):
        options = dataclasses.replace(base, zero_stage=3, sequence_parallel=tp > 1)
        share = dataclasses.replace(SPEC, seq_length=SPEC.seq_length // cp)
        source = AnalyticalSource(share, SHEET, options, context_parallel=cp)
        plan = sharded_plan(
            SPEC, "H100-SXM", [32], mbs, 8, 8, tp=tp, pp=1, dp=16 // (tp * cp),
            cp=cp, dp_shard=shard,
        )  # fmt: skip
        predicted = predict_plan(plan, source)
        if predicted.fits_memory:
            times.append(predicted.iteration_time_s)
    assert best.fit == len(times) and best.searched == 2 * len(
        sharded_candidates(SPEC, 16, 8, 8, recompute=full[:1])
    )
    assert best.prediction.iteration_time_s == pytest.approx(min(times), rel=1e-12)
    assert best.options.zero_stage == 3 and best.plan.layout.cp == best.cp
    assert best.proven


def test_nothing_fits_and_too_large(monkeypatch):
    huge = load_model_spec("llama-3.1-405b")
    with pytest.raises(InfeasibleProblemError, match="no sharded"):
        search_sharded(huge, "H100-SXM", 8, 8, SHEET, OPTIONS)
    monkeypatch.setattr(sharded_search, "MAX_SHARDED_PLANS", 10)
    with pytest.raises(ProblemError, match="more than 10 plans"):
        sharded_candidates(SPEC, 64, 8, 64, recompute=[OPTIONS])


def test_plan_model_keeps_the_faster_of_both_spaces():
    regular = plan_model(
        "Llama-3-8B", {"H100": 16}, 16, seq_length=32768, sharded=False
    )
    joined = plan_model("Llama-3-8B", {"H100": 16}, 16, seq_length=32768)
    alone = search_sharded(
        dataclasses.replace(SPEC, seq_length=32768),
        "H100-SXM",
        16,
        16,
        SHEET,
        regular.choice.options,
        recompute=[
            dataclasses.replace(regular.choice.options, recompute=r)
            for r in regular.space.recompute
        ],
    )
    best = min(regular.result.iteration_time_s, alone.prediction.iteration_time_s)
    assert joined.result.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert joined.result.proven and regular.result.proven
    assert joined.result.predicted_lower_bound_s == pytest.approx(best, rel=1e-12)
    if joined.result.method == "enumeration":  # the sharded plan won
        # its cost source prices it again as it was searched
        again = predict_plan(joined.result.plan, joined.choice.data)
        assert again.iteration_time_s == joined.result.iteration_time_s
        assert joined.result.options.zero_stage == 3
    assert any("sharded single-stage" in note for note in joined.choice.notes)


def test_sharded_refused_where_it_does_not_apply():
    with pytest.raises(ProblemError, match="several GPU types"):
        plan_model("Llama-3-8B", {"H100": 8, "A100-80": 8}, 16, sharded=True)
    with pytest.raises(ProblemError, match="--export megatron runs no FSDP"):
        plan_model("Llama-3-8B", {"H100": 8}, 16, sharded=True, export="megatron")


def test_plan_export_torchtitan_in_bf16_and_fp8_is_fsdp(capsys):
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16"]
    argv += ["--global-batch", "16", "--seq-len", "32768", "--export", "torchtitan"]
    for precision in ("bf16", "fp8"):
        assert main([*argv, "--precision", precision, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        text = data["export"]["text"]
        layout = data["layout"]
        assert data["options"]["zero_stage"] == 3 and data["proven_optimal"]
        shard = layout.get("dp_shard", layout["dp"])
        assert f"data_parallel_shard_degree = {shard}" in text
        assert f"data_parallel_replicate_degree = {layout['dp'] // shard}" in text
        if layout["cp"] > 1:
            assert f"context_parallel_degree = {layout['cp']}" in text
        # torchtitan splits each sequence over tp x 2 cp
        tp = data["stages"][0]["replicas"][0]["tp"]
        assert 32768 % (2 * tp * layout["cp"]) == 0
        if precision == "fp8":  # its per-op policy saves no fp8 product
            assert data["options"]["recompute_modules"] != ["torchtitan_op"] or (
                data["options"]["recompute"] != "selective"
            )
            assert "quantize.linear.float8" in text
    # the pipelines alone: bf16 is refused for torchtitan, with the reason
    assert main([*argv, "--precision", "bf16", "--sharded", "off"]) == 2
    assert "only with FSDP" in capsys.readouterr().err


def test_progress_of_a_long_sharded_search_is_reported(capsys):
    seen = []
    search_sharded(SPEC, "H100-SXM", 16, 8, SHEET, OPTIONS, progress_fn=seen.append)
    assert seen and seen[0]["phase"] == "sharded" and seen[0]["priced"] == 1
    # the command line's reporter prints it (every 0 s here)
    from pipedejavu.cli.progress import PlanProgress

    report = PlanProgress(every_s=0.0)
    report({**seen[0], "best_s": 1.5})
    report({**seen[0], "best_s": float("inf")})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("sharded: ") and " of " in lines[0]
    assert "best" in lines[0] and "best" not in lines[1]


def test_auto_keeps_to_the_pipelines_when_knobs_are_asked(capsys):
    """The sharded space fixes the schedule, SP and the optimizer's sharding
    itself: with a knob flag or a kept switch, auto searches pipelines only
    (as before it existed); --sharded on joins it, within the asked
    recomputation."""
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16", "--global-batch"]
    argv += ["16", "--seq-len", "32768", "--json"]
    for extra in (["--recompute", "full"], ["--tp-comm-overlap"]):
        assert main([*argv, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["options"]["zero_stage"] <= 1
        assert not any("sharded" in n for n in data.get("notes", []))
    assert main([*argv, "--recompute", "full", "--sharded", "on"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("sharded single-stage" in n for n in data.get("notes", []))
    if data["options"]["zero_stage"] == 3:
        assert data["options"]["recompute"] == "full"


def test_the_exported_torchtitan_job_predicts_as_planned(capsys, tmp_path):
    """plan --export torchtitan prices what the exported file runs: the same
    time from predict --torchtitan-config of it (with its model named)."""
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16", "--global-batch"]
    argv += ["16", "--seq-len", "32768", "--export", "torchtitan", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n' + data["export"]["text"])
    assert (
        main(
            ["predict", "--torchtitan-config", str(job), "--gpus", "H100:16", "--json"]
        )
        == 0
    )
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["iteration_time_s"] == pytest.approx(
        data["iteration_time_s"], rel=1e-9
    )
    assert predicted["peak_memory_bytes"] == pytest.approx(
        data["peak_memory_bytes"], rel=1e-9
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--precision", "fp8", "--recompute", "selective", "--sharded", "on"],
            "per-op recomputation does not run with fp8",
        ),
        (["--precision", "fp8", "--recompute", "selective"], "fp8 only with FSDP"),
    ],
)
def test_torchtitan_fp8_refusals_say_why(capsys, extra, message):
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:16", "--global-batch"]
    argv += ["16", "--seq-len", "8192", "--export", "torchtitan", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_sharded_on_refused_for_experts(capsys):
    argv = ["plan", "--model", "Mixtral-8x7B", "--gpus", "H100:16", "--global-batch"]
    assert main([*argv, "16", "--seq-len", "4096", "--sharded", "on"]) == 2
    assert "not searched for a mixture of experts" in capsys.readouterr().err


def test_fp32_torchtitan_export_compares_both_spaces_under_one_predictor():
    found = plan_model(
        "Llama-3-8B", {"H100": 4}, 4, seq_length=2048, precision="fp32",
        export="torchtitan",
    )  # fmt: skip
    # the pipelines (DDP alone) and the sharded space priced alike: the
    # plan's cost source prices it again to the time it was chosen at
    again = predict_plan(found.result.plan, found.choice.data)
    assert again.iteration_time_s == found.result.iteration_time_s
    assert found.choice.data.constants.attention_efficiency == 1.0
    assert not found.choice.data.eager
    # and no sharded plan priced so is faster (priced with torchtitan's
    # constants instead, the sharded plans lost to a slower pipeline here)
    spec = dataclasses.replace(SPEC, seq_length=2048)
    modes = [
        dataclasses.replace(found.choice.options, recompute=r, zero_stage=0)
        for r in ("none", "full")
    ]
    alone = search_sharded(
        spec, "H100-SXM", 4, 4, SHEET, modes[0], recompute=modes,
        tp_splits_sequence=True,
    )  # fmt: skip
    assert found.result.iteration_time_s <= alone.prediction.iteration_time_s * (
        1 + 1e-12
    )
