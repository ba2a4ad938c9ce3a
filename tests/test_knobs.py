"""The knob search (:mod:`pipedejavu.planning.knobs`): recomputation, sequence
parallelism and the distributed optimizer searched with the plan, against brute
force over every plan of every choice, and the rule that settles the choices
without the distributed optimizer."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.planning.any_model import choose_cost_source, plan_any_model
from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.knobs import plan_with_knobs
from pipedejavu.search.megatron.interleaved import (
    candidate_plan,
    interleaved_candidates,
)

BASE = {
    "name": "tiny-knobs",
    "num_layers": 8,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 32,
    "ffn_hidden_size": 16384,
    "vocab_size": 32000,
    "seq_length": 2048,
    "norm": "layernorm",
    "position": "learned",
    "max_position_embeddings": 2048,
    "tied_embeddings": True,
    "linear_bias": True,
}

# (model fields, pool, gbs, options): each makes the search take another path.
SETTINGS = {
    # a later choice (selective recomputation) beats the first one searched
    "selective-wins": ({}, {"L4": 8}, 16, TrainingOptions("bf16")),
    # no plan without recomputation fits: the first feasible choice is full
    "only-full-fits": (
        {"num_layers": 16, "seq_length": 8192, "max_position_embeddings": 8192},
        {"L4": 4},
        8,
        TrainingOptions("bf16"),
    ),
    # unfused attention (the s x s scores stored): none fits without
    # recomputation, selective is enough
    "unfused-fp16": (
        {"num_layers": 16, "seq_length": 4096, "max_position_embeddings": 4096},
        {"L4": 4},
        8,
        TrainingOptions("bf16", flash_attention=False),
    ),
}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("knob-models")
    out = {}
    for name, (fields, *_rest) in SETTINGS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps({**BASE, **fields, "name": name}))
        out[name] = str(path)
    return out


@functools.cache
def _brute_force(path: str, pool: tuple, gbs: int, options: TrainingOptions):
    """Least predicted time of a plan that fits, over every plan of one choice:
    ``(1F1B, interleaved)``. Checks each interleaved plan's bound on the way."""
    choice = choose_cost_source(path, dict(pool), options=options)
    best = math.inf
    for plan, _ in enumerate_plans(
        choice.data, choice.model, choice.pool(dict(pool)), gbs, C
    ):
        prediction = predict_plan(plan, choice.data, constants=C)
        if prediction.fits_memory:
            best = min(best, prediction.iteration_time_s)
    interleaved = math.inf
    for item in interleaved_candidates(
        choice.data, choice.model, choice.pool(dict(pool)), gbs, C
    ):
        plan = candidate_plan(choice.data, choice.model, gbs, item)
        prediction = predict_plan(
            plan, choice.data, constants=C, virtual_stages=item.chunks
        )
        assert item.bound <= prediction.iteration_time_s * (1 + 1e-12)
        if prediction.fits_memory:
            interleaved = min(interleaved, prediction.iteration_time_s)
    return best, interleaved


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_knob_plan_is_the_brute_force_optimum_over_every_choice(model_files, name):
    _, pool, gbs, options = SETTINGS[name]
    result = plan_with_knobs(model_files[name], pool, gbs, options=options)
    space = KnobSpace()
    per_choice = {}
    for o in space.all_choices(options):
        both = _brute_force(model_files[name], tuple(pool.items()), gbs, o)
        key = (o.recompute, o.sequence_parallel, o.distributed_optimizer)
        per_choice[(*key, "1f1b")], per_choice[(*key, "interleaved")] = both
    best = min(per_choice.values())
    assert result.result.proven
    assert result.result.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert result.result.predicted_lower_bound_s <= best * (1 + 1e-12)
    # the reported knobs reach that optimum (knobs a plan cannot use are
    # reported off: they price the same)
    won = result.result.options
    schedule = "interleaved" if won.virtual_stages > 1 else "1f1b"
    key = (won.recompute, won.sequence_parallel, won.distributed_optimizer, schedule)
    assert per_choice[key] == pytest.approx(best, rel=1e-12)
    # and the 1F1B space alone, searched on its own
    alone = plan_with_knobs(
        model_files[name],
        pool,
        gbs,
        options=options,
        space=KnobSpace(schedules=("1f1b",)),
    )
    ones = [v for k, v in per_choice.items() if k[-1] == "1f1b"]
    assert alone.result.prediction.iteration_time_s == pytest.approx(
        min(ones), rel=1e-12
    )
    # every choice is accounted for, each way it was settled is proven
    assert len(result.outcomes) == 2 * len(space.all_choices(options)) - len(
        space.dominated(options)
    )
    assert all(o.proven for o in result.outcomes)


def test_each_path_is_taken(model_files):
    """The settings above exercise what they say (else they test less)."""
    how = {}
    for name, (_, pool, gbs, options) in SETTINGS.items():
        outcomes = plan_with_knobs(
            model_files[name], pool, gbs, options=options
        ).outcomes
        how[name] = [
            (o.how, o.options.recompute, math.isfinite(o.best_s)) for o in outcomes
        ]
    assert ("proof", "selective", True) in how["selective-wins"]
    assert ("infeasible", "none", False) in how["only-full-fits"]
    assert ("searched", "full", True) in how["only-full-fits"]
    assert ("interleaved", "full", True) in how["only-full-fits"]  # and wins
    assert ("infeasible", "none", False) in how["unfused-fp16"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_distributed_optimizer_never_costs_time_or_memory(model_files, name):
    """The rule that settles the choices without it: on every plan (and every
    recompute mode), predicted time and every stage's memory with the
    distributed optimizer are at most those without, and lower somewhere."""
    _, pool, gbs, options = SETTINGS[name]
    lower = 0
    for recompute in ("none", "full"):
        on = choose_cost_source(
            model_files[name],
            pool,
            options=dataclasses.replace(
                options, recompute=recompute, distributed_optimizer=True
            ),
        )
        off = choose_cost_source(
            model_files[name],
            pool,
            options=dataclasses.replace(
                options, recompute=recompute, distributed_optimizer=False
            ),
        )
        for plan, _ in enumerate_plans(on.data, on.model, on.pool(pool), gbs, C):
            a = predict_plan(plan, on.data, constants=C)
            b = predict_plan(plan, off.data, constants=C)
            assert a.iteration_time_s <= b.iteration_time_s * (1 + 1e-12)
            assert (a.stage_memory_bytes <= b.stage_memory_bytes * (1 + 1e-12)).all()
            lower += a.iteration_time_s < b.iteration_time_s
    assert lower > 0


def test_sequence_parallel_at_tp_1_prices_the_same(model_files):
    """Why a plan with TP 1 everywhere reports sequence parallelism off."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    on = choose_cost_source(
        model_files["selective-wins"],
        pool,
        options=dataclasses.replace(options, sequence_parallel=True),
    )
    off = choose_cost_source(model_files["selective-wins"], pool, options=options)
    checked = 0
    for plan, _ in enumerate_plans(on.data, on.model, on.pool(pool), gbs, C):
        if any(r.tp != 1 for s in plan.stages for r in s.replicas):
            continue
        a = predict_plan(plan, on.data, constants=C)
        b = predict_plan(plan, off.data, constants=C)
        assert a.iteration_time_s == b.iteration_time_s
        assert (a.stage_memory_bytes == b.stage_memory_bytes).all()
        checked += 1
    assert checked > 10


def test_a_fixed_space_is_plan_any_model(model_files):
    """One choice: the same plan and time as planning with those options."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    options = dataclasses.replace(
        options, recompute="selective", distributed_optimizer=True
    )
    knobs = plan_with_knobs(
        model_files["selective-wins"],
        pool,
        gbs,
        options=options,
        space=KnobSpace.fixed(options),
    )
    plain, _ = plan_any_model(model_files["selective-wins"], pool, gbs, options=options)
    assert knobs.result.plan == plain.plan
    assert knobs.result.prediction.iteration_time_s == plain.prediction.iteration_time_s
    assert [o.how for o in knobs.outcomes] == ["searched"]


def test_no_choice_fits_says_which_were_tried(model_files):
    _, _, gbs, options = SETTINGS["only-full-fits"]
    with pytest.raises(InfeasibleProblemError, match="recompute none|selective"):
        plan_with_knobs(
            model_files["only-full-fits"],
            {"L4": 4},
            gbs,
            options=options,
            space=KnobSpace(recompute=("none", "selective")),
        )


@pytest.mark.parametrize(
    "fields",
    [
        {"recompute": ()},
        {"recompute": ("none", "none")},
        {"recompute": ("some",)},
        {"sequence_parallel": (1,)},
        {"distributed_optimizer": [True]},
    ],
)
def test_bad_spaces_are_refused(fields):
    with pytest.raises(ValueError):
        KnobSpace(**fields)


def _cli(capsys, *argv):
    from pipedejavu.cli.main import main

    code = main(["plan", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_searches_the_knobs_and_restricts_them(capsys, model_files):
    path = model_files["selective-wins"]
    argv = ["--model", path, "--gpus", "L4:8", "--global-batch", 16, "--json"]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    full = json.loads(out)
    direct = plan_with_knobs(path, {"L4": 8}, 16)
    assert full["iteration_time_s"] == direct.result.prediction.iteration_time_s
    assert full["options"]["recompute"] == "selective"
    # 6 choices for each schedule, 6 settled by the distributed optimizer's rule
    assert len(full["knobs"]["choices"]) == 18 and full["proven_optimal"]
    # today's space: one choice, the same as planning with those options
    code, out, err = _cli(
        capsys,
        *argv,
        "--recompute",
        "none",
        "--sequence-parallel",
        "off",
        "--distributed-optimizer",
        "off",
    )
    assert code == 0, err
    narrow = json.loads(out)
    plain, _ = plan_any_model(path, {"L4": 8}, 16, options=TrainingOptions("bf16"))
    assert narrow["iteration_time_s"] == plain.prediction.iteration_time_s
    assert [c["how"] for c in narrow["knobs"]["choices"]] == [
        "searched",
        "interleaved",
    ]
    assert narrow["iteration_time_s"] > full["iteration_time_s"]
    # one schedule
    for schedule in ("1f1b", "interleaved"):
        code, out, err = _cli(capsys, *argv, "--schedule", schedule)
        assert code == 0, err
        hows = {c["how"] for c in json.loads(out)["knobs"]["choices"]}
        assert ("interleaved" in hows) == (schedule == "interleaved")
        assert ("searched" in hows or "proof" in hows) == (schedule == "1f1b")
    # a list of modes
    code, out, err = _cli(capsys, *argv, "--recompute", "selective,full")
    assert code == 0, err
    assert {c["options"]["recompute"] for c in json.loads(out)["knobs"]["choices"]} == {
        "selective",
        "full",
    }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--recompute", "some"], "--recompute takes auto or distinct values"),
        (["--recompute", "none,none"], "--recompute takes auto or distinct values"),
        (["--sequence-parallel", "yes"], "invalid choice"),
    ],
)
def test_cli_refuses_bad_knobs(capsys, model_files, extra, message):
    argv = ["--model", model_files["selective-wins"], "--gpus", "L4:8"]
    code, _, err = _cli(capsys, *argv, "--global-batch", 16, *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_profiled_model_keeps_its_profiled_knobs(capsys):
    argv = ["--model", "OPT-350", "--gpus", "GH-96:8", "--global-batch", 64]
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    assert json.loads(out)["cost_source"] == "profiles"
    code, _, err = _cli(capsys, *argv, "--recompute", "auto")
    assert code == 2 and "profiles measured one training" in err
