"""The expert layouts plan --model searches (dispatchers, the all-to-all
overlap) and what a plan file keeps of them: the overlap searched exactly
where Megatron-Core runs it (the rule the reader refuses launches by), the
plan's dispatcher and overlap in its file, its prediction and its export."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.moe import dispatch_overlap_needs
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.sailor_plan import load_plan_training
from pipedejavu.planning.expert_search import (
    layers_of,
    layout_search,
    moe_options_of,
)
from pipedejavu.planning.knob_space import SCHEDULES, KnobSpace
from pipedejavu.planning.plan_model import plan_model

TINY = str(Path(__file__).parent / "tiny_moe.json")
SMALL = KnobSpace(
    schedules=("1f1b", "interleaved"),
    recompute=("none", "full"),
    sequence_parallel=(False,),
    distributed_optimizer=(True,),
)


def _runs_in(found, pp: int, chunks: int, recompute: str) -> bool:
    """Whether the cut space searches plans of ``pp`` stages, ``chunks`` per
    rank, with ``recompute``."""
    space = found.space
    if recompute not in space.recompute:
        return False
    if chunks > 1:
        return pp > 1 and "interleaved" in space.schedules
    if "1f1b" not in space.schedules:
        return False
    return pp == 1 or not found.one_stage_1f1b


@pytest.mark.parametrize(
    "ep, dispatcher, precision, mtp",
    list(
        itertools.product(
            (1, 4),
            ("alltoall", "flex", "allgather"),
            ("bf16", "fp8", "fp32"),
            (0, 1, 2),
        )
    ),
)
def test_the_overlap_is_searched_exactly_where_megatron_runs_it(
    ep, dispatcher, precision, mtp
):
    """Every plan shape the cut space searches passes Megatron-Core's checks
    (dispatch_overlap_needs, which the reader refuses launches by), and every
    shape of the space that passes is searched: nothing unlaunchable, nothing
    lost."""
    layers = ExpertLayers(
        ExpertPass(ep=ep, etp=1, grouped_gemm=True, dispatcher=dispatcher),
        overlap_dispatch=True,
    )
    space = dataclasses.replace(SMALL, schedules=SCHEDULES)
    found = layout_search(layers, space, precision=precision, mtp_layers=mtp)
    params = {"fp8": "bf16"}.get(precision, precision)
    any_runs = False
    for pp, chunks, recompute in itertools.product((1, 2, 4), (1, 2), ("none", "full")):
        if pp == 1 and chunks > 1:
            continue
        runs = (
            dispatch_overlap_needs(
                ep=ep,
                dispatcher=dispatcher,
                pp=pp,
                chunks=chunks,
                full_recompute=recompute == "full",
                params_dtype=params,
                mtp_layers=mtp,
            )
            is None
        )
        any_runs |= runs
        searched = found is not None and _runs_in(found, pp, chunks, recompute)
        assert searched == runs, (pp, chunks, recompute)
    assert (found is None) == (not any_runs)
    if found is not None:  # no zero-bubble schedule: Megatron-LM has none
        assert set(found.space.schedules) <= {"1f1b", "interleaved"}


def test_without_the_overlap_only_the_rank_order_is_cut():
    layers = ExpertLayers(ExpertPass(ep=4, etp=1, dispatcher="flex"))
    found = layout_search(layers, SMALL, precision="bf16")
    assert found.space == SMALL.for_experts() and not found.one_stage_1f1b
    assert found.space.rank_orders == ("tp-dp-pp",)


def test_the_reader_refuses_by_the_same_rule():
    """A launch with the overlap at PP 2 without virtual stages: refused with
    the words of dispatch_overlap_needs."""
    from pipedejavu.io.megatron_args import spec_from_megatron_args

    args = (
        "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 16 "
        "--bf16 --vocab-size 4096 --num-experts 8 --moe-token-dispatcher-type alltoall "
        "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--overlap-moe-expert-parallel-comm"
    )
    needs = dispatch_overlap_needs(
        ep=2,
        dispatcher="alltoall",
        pp=2,
        chunks=1,
        full_recompute=False,
        params_dtype="bf16",
    )
    with pytest.raises(ProblemError) as error:
        spec_from_megatron_args(args)
    assert f"--overlap-moe-expert-parallel-comm needs {needs}" in str(error.value)


def test_the_options_of_a_layout_round_trip():
    for dispatcher, overlap in itertools.product(("alltoall", "flex"), (False, True)):
        layers = ExpertLayers(
            ExpertPass(ep=4, etp=1, grouped_gemm=True, dispatcher=dispatcher),
            overlap_dispatch=overlap,
        )
        options = moe_options_of(layers)
        assert (options.flex_backend == "deepep") == (dispatcher == "flex")
        assert (
            MoeOptions.from_json(json.loads(json.dumps(options.to_json()))) == options
        )
        assert layers_of(options, 4, 1) == layers


@pytest.mark.parametrize(
    "bad, words",
    [
        ([], "experts must be a JSON object"),
        ({"dispatcher": "x" * 10**6}, "dispatcher must be one of"),
        ({"surprise": 1}, "unknown keys"),
        ({"grouped_gemm": "yes"}, "grouped_gemm must be true or false"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"flex_backend": "mystery"}, "flex_backend must be one of"),
    ],
)
def test_a_bad_experts_object_is_one_line_naming_the_file(tmp_path, bad, words):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "pipedejavu.core.plan3d", "experts": bad}))
    with pytest.raises(ProblemError) as error:
        load_plan_training(path)
    text = str(error.value)
    assert text.startswith(str(path)) and words in text
    assert "\n" not in text and len(text) < 400


@pytest.fixture(scope="module")
def flex_plan(tmp_path_factory):
    """The best plan of the tiny MoE with the flex dispatcher and the overlap
    only, written as plan --json writes it."""
    found = plan_model(
        TINY,
        {"H100": 8},
        16,
        space=dataclasses.replace(SMALL, schedules=("1f1b",), recompute=("none",)),
        dispatchers=("flex",),
        dispatch_overlap=(True,),
    )
    path = tmp_path_factory.mktemp("flex") / "plan.json"
    path.write_text(json.dumps(found.to_json()))
    return found, path


def test_the_plan_file_keeps_the_experts_and_predict_reprices_it(flex_plan, capsys):
    found, path = flex_plan
    assert found.choice.data.experts.experts.dispatcher == "flex"
    assert found.choice.data.experts.overlap_dispatch
    assert load_plan_training(path).experts == moe_options_of(found.choice.data.experts)
    assert main(["predict", str(path), "--model", TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] == pytest.approx(
        found.result.prediction.iteration_time_s, rel=1e-9
    )


def test_a_plan_file_without_experts_is_priced_as_plans_were(
    flex_plan, capsys, tmp_path
):
    """A plan written before the file kept its experts: the alltoall
    dispatcher with grouped GEMMs, no overlap (what plan --model searched
    then), which prices the same plan slower here than flex with the
    overlap."""
    found, path = flex_plan
    data = json.loads(path.read_text())
    del data["experts"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["predict", str(old), "--model", TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] > found.result.prediction.iteration_time_s


def test_the_megatron_export_writes_the_plans_dispatcher_and_overlap(capsys):
    code = main(
        [
            "plan",
            "--model",
            TINY,
            "--gpus",
            "H100:8",
            "--global-batch",
            "16",
            "--schedule",
            "1f1b",
            "--recompute",
            "none",
            "--moe-dispatcher",
            "flex",
            "--moe-a2a-overlap",
            "on",
            "--export",
            "megatron",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "--moe-token-dispatcher-type flex" in out
    assert "--moe-flex-dispatcher-backend deepep" in out
    assert "--overlap-moe-expert-parallel-comm" in out
    # the comment above the command says what the launch must have
    assert "# flex dispatcher (deepep backend: the launch needs it installed)" in out
    assert "the all-to-alls overlapped with another micro-batch's compute" in out


@pytest.mark.parametrize(
    "flags", [["--moe-dispatcher", "flex"], ["--moe-a2a-overlap", "off"]]
)
def test_the_expert_flags_refuse_a_dense_model(capsys, flags):
    code = main(
        ["plan", "--model", "Llama-3-8B", "--gpus", "H100:8", "--global-batch", "16"]
        + flags
    )
    err = capsys.readouterr().err
    assert code == 2 and "only for a mixture of experts" in err


def _overlapped_launches():
    from pipedejavu.planning.moe_published import moe_launches

    return [x for x in moe_launches() if x[1].moe_options.overlap_dispatch]


@pytest.mark.parametrize("index", range(len(_overlapped_launches())))
def test_a_launch_with_the_overlap_is_planned_only_as_megatron_runs_it(index):
    """plan --megatron-args of each published launch with the overlap: the
    plan passes Megatron-Core's checks (before, a 1F1B pipeline without
    virtual stages was returned; then the proof re-priced an interleaved
    incumbent as a 1F1B pipeline where only one stage is allowed), and is no
    slower than the launch, which its space holds, proven."""
    from pipedejavu.io.gpu_sheet import load_gpu_sheet
    from pipedejavu.planning.launch_compare import compare_megatron_run
    from pipedejavu.planning.moe_published import GPU

    run, launch, _ = _overlapped_launches()[index]
    comparison = compare_megatron_run(launch, GPU, run.num_gpus, load_gpu_sheet())
    best = comparison.best
    assert (
        dispatch_overlap_needs(
            ep=launch.ep,
            dispatcher=launch.moe_options.dispatcher,
            pp=best.plan.num_stages,
            chunks=best.options.virtual_stages,
            full_recompute=best.options.recompute == "full",
            params_dtype="bf16",
        )
        is None
    )
    assert best.proven and comparison.speedup >= 1 - 1e-12


def test_expert_tp_degrees_join_the_branch_and_bound():
    """Asked for expert TP 1 and 2, plan --model searches both (every layout
    with each) and keeps the optimum of searching each layout alone."""
    from pipedejavu.planning.expert_search import expert_layouts
    from pipedejavu.planning.knobs import plan_with_knobs

    space = dataclasses.replace(SMALL, schedules=("1f1b",), recompute=("none",))
    kw = dict(space=space, dispatchers=("alltoall",), dispatch_overlap=(False,))
    found = plan_model(TINY, {"H100": 8}, 16, expert_tp=(1, 2), **kw)
    assert "(expert TP 1, 2)" in found.choice.notes[-1]
    spec = found.choice.spec
    layouts = expert_layouts(spec, 8, expert_tp=(1, 2))
    assert {x.experts.etp for x in layouts} == {1, 2}
    alone = [
        plan_with_knobs(TINY, {"H100": 8}, 16, space=space, experts=layers)
        for layers in layouts
    ]
    times = [p.result.prediction.iteration_time_s for p in alone]
    assert found.result.prediction.iteration_time_s == pytest.approx(min(times))
    assert found.result.proven == all(p.result.proven for p in alone)
    axes = found.result.plan.layout.stages[0]
    assert axes.expert_tp == found.choice.data.experts.experts.etp


@pytest.mark.parametrize("text", ["0", "2,2", "x", "1," * 70 + "1", "2000"])
def test_a_bad_expert_tp_list_is_one_line(capsys, text):
    code = main(
        ["plan", "--model", TINY, "--gpus", "H100:8", "--global-batch", "16"]
        + ["--moe-expert-tp", text]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--moe-expert-tp" in err and len(err.splitlines()) <= 3


def test_expert_tp_is_not_searched_for_experts_with_biases():
    """GPT-OSS's experts carry linear biases, which Megatron-Core runs only
    at expert TP 1 (the rule the reader refuses such launches by)."""
    from pipedejavu.core.moe import expert_tp_needs
    from pipedejavu.io.model_config import load_model_spec
    from pipedejavu.planning.expert_search import expert_layouts

    spec = load_model_spec("GPT-OSS-120B")
    assert spec.linear_bias and expert_tp_needs(etp=2, linear_bias=True)
    layouts = expert_layouts(spec, 64, expert_tp=(1, 2, 4))
    assert layouts and {x.experts.etp for x in layouts} == {1}


@pytest.mark.parametrize(
    "model, gpus, gbs, interleaved",
    [("Mixtral-8x7B", 16, 256, True), ("Qwen3-30B-A3B", 16, 256, False)],
)
def test_the_interleaved_step_first_finds_what_the_usual_order_finds(
    model, gpus, gbs, interleaved
):
    """``interleaved_first`` (what ``plan`` does for every expert layout):
    the interleaved searches run before the first full search, a plan they
    find settling the other choices by their proofs. Where an interleaved
    plan wins and where a one-chunk plan wins: the same plan, time, proof
    and bound as the usual order (Megatron-LM's schedules, EP 8, flex)."""
    from pipedejavu.io.model_config import load_model_spec
    from pipedejavu.planning.expert_search import expert_layouts
    from pipedejavu.planning.knob_space import MEGATRON_SCHEDULES
    from pipedejavu.planning.knobs import plan_with_knobs

    spec = load_model_spec(model, seq_length=4096)
    (layers,) = [
        x
        for x in expert_layouts(spec, gpus, dispatchers=("flex",), overlap=(False,))
        if x.experts.ep == 8
    ]
    space = KnobSpace(schedules=MEGATRON_SCHEDULES)
    search = layout_search(layers, space, precision="bf16")
    found = {
        first: plan_with_knobs(
            model,
            {"H100": gpus},
            gbs,
            space=search.space,
            precision="bf16",
            seq_length=4096,
            experts=layers,
            interleaved_first=first,
        ).result
        for first in (False, True)
    }
    usual, early = found[False], found[True]
    assert early.plan == usual.plan and early.options == usual.options
    usual_s = usual.prediction.iteration_time_s
    assert early.prediction.iteration_time_s == usual_s
    assert early.proven and usual.proven
    assert (usual.options.virtual_stages > 1) == interleaved


def test_a_measured_run_of_a_plan_file_prices_its_experts_as_predict(
    flex_plan, tmp_path
):
    """A run file naming the flex plan: priced (for calibration) with the
    plan's own dispatcher and overlap, as predict prices the file."""
    from pipedejavu.planning.measured_runs import load_run, price_run

    found, path = flex_plan
    run_file = tmp_path / "run.json"
    run_file.write_text(
        json.dumps(
            {
                "format": "pipedejavu-run/1",
                "plan": str(path),
                "model": TINY,
                "seconds_per_iteration": 1.0,
            }
        )
    )
    run = load_run(run_file)
    assert run.experts is not None and run.experts.dispatcher == "flex"
    assert price_run(run, None).iteration_time_s == pytest.approx(
        found.result.prediction.iteration_time_s, rel=1e-9
    )
