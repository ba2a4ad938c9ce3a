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
from helpers import TINY_GPT as BASE
from helpers import largest_stage_bound, pin_path_constants, run_cli, stage_bound_tables

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.any_model import choose_cost_source, plan_any_model
from pipedejavu.planning.knob_space import SCHEDULES, KnobSpace, recompute_name
from pipedejavu.planning.knobs import plan_with_knobs
from pipedejavu.search.megatron.certify import (
    any_plan_fits,
    certify_predicted,
    least_work,
)
from pipedejavu.search.megatron.interleaved import interleaved_candidates
from pipedejavu.search.megatron.interleaved_floor import (
    candidate_fits,
    candidate_floor,
    candidate_plan,
)
from pipedejavu.search.megatron.transfers import BoundCache


@pytest.fixture(autouse=True)
def _path_constants(monkeypatch):
    """The settings below were chosen under these 16-bit constants
    (:data:`helpers.PATH_TEST_HALF_PRECISION`)."""
    pin_path_constants(monkeypatch)


# (model fields, pool, gbs, options): each makes the search take another path.
SETTINGS = {
    # a later choice (selective recomputation) beats the first one searched:
    # unfused attention (the s x s scores stored) on 11 GB GPUs, which the
    # plans without recomputation fill
    "selective-wins": (
        {},
        {"RTX-2080": 8},
        16,
        TrainingOptions("fp16", flash_attention=False),
    ),
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
def _brute_force(
    path: str, pool: tuple, gbs: int, options: TrainingOptions, dp_alone=False
):
    """Least predicted time of a plan that fits, over every plan of one choice:
    ``(1F1B, interleaved, ZB-H1, interleaved-zb, zbv)``. Checks each
    interleaved plan's bound on the way. ``dp_alone``: only the plans with
    data parallelism on one-GPU replicas alone, or none (torchtitan's DDP)."""
    choice = choose_cost_source(path, dict(pool), options=options)
    zero = choose_cost_source(
        path, dict(pool), options=dataclasses.replace(options, zero_bubble=True)
    )
    best = zb = math.inf
    for plan, _ in enumerate_plans(
        choice.data, choice.model, choice.pool(dict(pool)), gbs, C
    ):
        tp = plan.stages[0].replicas[0].tp
        if dp_alone and plan.dp > 1 and (plan.num_stages > 1 or tp > 1):
            continue
        prediction = predict_plan(plan, choice.data, constants=C)
        if prediction.fits_memory:
            best = min(best, prediction.iteration_time_s)
        prediction = predict_plan(plan, zero.data, constants=C)
        if prediction.fits_memory:
            zb = min(zb, prediction.iteration_time_s)
    shaped = dataclasses.replace(
        options, zero_bubble=True, virtual_stages=2, v_shape=True
    )
    zbv = choose_cost_source(path, dict(pool), options=shaped)
    interleaved = [math.inf] * 3  # interleaved 1F1B, interleaved-zb, zbv
    for k, source in enumerate((choice, zero, zbv)):
        for item in interleaved_candidates(
            source.data, source.model, source.pool(dict(pool)), gbs, C
        ):
            if dp_alone and item.dp > 1:  # two stages or more: dp 1 only
                continue
            plan = candidate_plan(source.data, source.model, gbs, item)
            prediction = predict_plan(
                plan, source.data, constants=C, virtual_stages=item.chunks
            )
            assert item.bound <= prediction.iteration_time_s * (1 + 1e-12)
            # the floor the search prices before predicting: memory and tails
            fits, tails = candidate_floor(
                source.data, source.model, C, plan, item.chunks
            )
            assert fits or not prediction.fits_memory
            # the same test on one pipeline, before the plan is placed
            assert candidate_fits(source.data, source.model, C, gbs, item) == fits
            if fits:
                parts = item.parts
                refined = max(
                    parts[0] + tails.min(), parts[1] + tails[0], parts[2] + tails[-1]
                )
                assert refined <= prediction.iteration_time_s * (1 + 1e-12)
            if prediction.fits_memory:
                interleaved[k] = min(interleaved[k], prediction.iteration_time_s)
    return best, interleaved[0], zb, interleaved[1], interleaved[2]


def test_data_parallelism_alone_is_the_brute_force_optimum_of_its_plans(
    model_files,
):
    """``dp_alone`` (what ``--export torchtitan`` searches: torchtitan's DDP
    runs beside no TP or PP) finds the least predicted time of the plans
    whose data parallelism is on one-GPU replicas alone, or absent, over
    every choice and schedule, proven; the unrestricted optimum here is not
    such a plan."""
    _, _, gbs, options = SETTINGS["selective-wins"]
    path, pool = model_files["selective-wins"], {"L4": 4}  # free: dp 2, tp 2
    result = plan_with_knobs(path, pool, gbs, options=options, dp_alone=True)
    plan = result.result.plan
    tp = plan.stages[0].replicas[0].tp
    assert plan.dp == 1 or (plan.num_stages == 1 and tp == 1)
    choices = KnobSpace().all_choices(options)
    best = min(
        min(_brute_force(path, tuple(pool.items()), gbs, o, True)) for o in choices
    )
    assert result.result.proven
    assert result.result.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    free = plan_with_knobs(path, pool, gbs, options=options).result
    assert free.plan.dp > 1 and free.prediction.iteration_time_s < best


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_knob_plan_is_the_brute_force_optimum_over_every_choice(model_files, name):
    _, pool, gbs, options = SETTINGS[name]
    result = plan_with_knobs(model_files[name], pool, gbs, options=options)
    space = KnobSpace()
    per_choice = {}
    for o in space.all_choices(options):
        every = _brute_force(model_files[name], tuple(pool.items()), gbs, o)
        key = (o.recompute, o.sequence_parallel, o.distributed_optimizer)
        for schedule, value in zip(SCHEDULES, every, strict=True):
            per_choice[(*key, schedule)] = value
    best = min(per_choice.values())
    assert result.result.proven
    assert result.result.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert result.result.predicted_lower_bound_s <= best * (1 + 1e-12)
    # the reported knobs reach that optimum (knobs a plan cannot use are
    # reported off: they price the same)
    won = result.result.options
    schedule = KnobSpace.fixed(won).schedules[0]
    key = (won.recompute, won.sequence_parallel, won.distributed_optimizer, schedule)
    assert per_choice[key] == pytest.approx(best, rel=1e-12)

    def alone_and_least(schedule):
        """The search of the ``schedule`` space alone, and the least
        brute-force time of its plans."""
        alone = plan_with_knobs(
            model_files[name],
            pool,
            gbs,
            options=options,
            space=KnobSpace(schedules=(schedule,)),
        )
        return alone, min(v for k, v in per_choice.items() if k[-1] == schedule)

    # and the 1F1B space alone, searched on its own
    alone, least = alone_and_least("1f1b")
    assert alone.result.prediction.iteration_time_s == pytest.approx(least, rel=1e-12)
    # and the ZB-H1 space alone (its first choice searched in full)
    zero, least = alone_and_least("zb-h1")
    assert zero.result.proven and zero.result.options.zero_bubble
    assert zero.result.prediction.iteration_time_s == pytest.approx(least, rel=1e-12)
    # and the interleaved zero-bubble and ZB-V spaces alone
    for schedule in ("interleaved-zb", "zbv"):
        alone, least = alone_and_least(schedule)
        assert alone.result.proven
        if math.isfinite(least):
            won = alone.result.options
            assert won.zero_bubble and won.virtual_stages > 1
            assert won.v_shape == (schedule == "zbv")
            assert alone.result.prediction.iteration_time_s == pytest.approx(
                least, rel=1e-12
            )
    # every choice is accounted for, each way it was settled is proven
    # (five schedules, each in both rank orders: one node here, where both
    # orders place every plan alike; a 1F1B or ZB-H1 choice with no plan that
    # fits has none in either order, and is listed once)
    settled = len(space.all_choices(options)) - len(space.dominated(options))
    none_fit = [o.options for o in result.outcomes if o.how == "infeasible"]
    expected = 10 * settled - len(none_fit) + len(space.dominated(options))
    assert len(result.outcomes) == expected
    assert all(o.proven for o in result.outcomes)
    for o in result.outcomes:
        if o.how != "interleaved":
            assert o.rank_order == "tp-dp-pp" or o.options not in none_fit
        if o.options in none_fit:  # the brute force agrees: nothing fits
            key = (o.options.recompute, o.options.sequence_parallel)
            schedule = "zb-h1" if o.options.zero_bubble else "1f1b"
            assert per_choice[(*key, True, schedule)] == math.inf


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


def test_chunked_options_go_to_the_knob_search(model_files):
    """plan_any_model plans one chunk per rank; options with chunks (here
    ZB-V) say where they are searched, and a fixed space there finds them."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    shaped = dataclasses.replace(
        options, zero_bubble=True, virtual_stages=2, v_shape=True
    )
    with pytest.raises(ProblemError, match="plan_with_knobs"):
        plan_any_model(model_files["selective-wins"], pool, gbs, options=shaped)
    found = plan_with_knobs(
        model_files["selective-wins"], pool, gbs, options=shaped,
        space=KnobSpace.fixed(shaped),
    )  # fmt: skip
    won = found.result.options
    assert found.result.proven and won.v_shape and won.virtual_stages == 2
    assert {o.how for o in found.outcomes} == {"interleaved"}


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
        space=KnobSpace.fixed(options, ("tp-dp-pp",)),
    )
    plain, _ = plan_any_model(model_files["selective-wins"], pool, gbs, options=options)
    assert knobs.result.plan == plain.plan
    assert knobs.result.prediction.iteration_time_s == plain.prediction.iteration_time_s
    assert [o.how for o in knobs.outcomes] == ["searched"]
    # with the other rank order: one proof more (one node: it places alike)
    both = plan_with_knobs(
        model_files["selective-wins"],
        pool,
        gbs,
        options=options,
        space=KnobSpace.fixed(options),
    )
    assert [(o.how, o.rank_order) for o in both.outcomes] == [
        ("searched", "tp-dp-pp"),
        ("proof", "tp-pp-dp"),
    ]
    assert both.result.plan == plain.plan


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
        {"recompute_layers": ()},
        {"recompute_layers": (0,)},
        {"recompute_layers": (2, 2)},
        {"recompute_layers": (True,)},
        {"recompute_layers": [1]},
    ],
)
def test_bad_spaces_are_refused(fields):
    with pytest.raises(ValueError):
        KnobSpace(**fields)


def _strict(text):
    """JSON as a strict parser (JavaScript's, ``jq``) reads it: no NaN or
    Infinity."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_cli_searches_the_knobs_and_restricts_them(capsys, model_files):
    path = model_files["selective-wins"]
    argv = ["--model", path, "--gpus", "L4:8", "--global-batch", 16, "--json"]
    argv += ["--sharded", "off"]  # the pipeline search's knobs
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    # the first choice has no cutoff yet (an infinite one, written null)
    full = _strict(out)
    assert full["knobs"]["choices"][0]["cutoff_s"] is None
    direct = plan_with_knobs(path, {"L4": 8}, 16)
    assert full["iteration_time_s"] == direct.result.prediction.iteration_time_s
    assert full["options"] == direct.result.options.to_json()
    # 6 choices for each of 5 schedules in each of 2 rank orders, 6 settled
    # by the distributed optimizer's rule
    assert len(full["knobs"]["choices"]) == 66 and full["proven_optimal"]
    # one choice of the other knobs, every schedule
    one = ("--recompute", "none", "--sequence-parallel", "off")
    one += ("--distributed-optimizer", "off")
    code, out, err = run_cli(capsys, "plan", *argv, *one)
    assert code == 0, err
    narrow = json.loads(out)
    # today's space (1F1B too): the same as planning with those options
    code, out, err = run_cli(capsys, "plan", *argv, *one, "--schedule", "1f1b")
    assert code == 0, err
    today = json.loads(out)
    plain, _ = plan_any_model(path, {"L4": 8}, 16, options=TrainingOptions("bf16"))
    assert today["iteration_time_s"] == plain.prediction.iteration_time_s
    # ZB-V beats it here (brute force: test_knob_plan_is_the_brute_force_...)
    assert narrow["iteration_time_s"] < today["iteration_time_s"]
    assert narrow["options"]["v_shape"]
    assert [(c["how"], c["rank_order"]) for c in narrow["knobs"]["choices"]] == [
        ("searched", "tp-dp-pp"),  # the schedule whose DP plan is faster
        ("interleaved", "tp-dp-pp"),
        ("interleaved", "tp-pp-dp"),
        ("interleaved", "tp-dp-pp"),  # interleaved-zb
        ("interleaved", "tp-pp-dp"),
        ("interleaved", "tp-dp-pp"),  # zbv
        ("interleaved", "tp-pp-dp"),
        ("zero-bubble", "tp-dp-pp"),
        ("zero-bubble", "tp-pp-dp"),
        ("proof", "tp-pp-dp"),
    ]
    # here 1F1B's (its planning DP finds a faster plan than ZB-H1's)
    assert not narrow["knobs"]["choices"][0]["options"]["zero_bubble"]
    assert narrow["iteration_time_s"] > full["iteration_time_s"]
    # one schedule
    for schedule in SCHEDULES:
        code, out, err = run_cli(capsys, "plan", *argv, "--schedule", schedule)
        assert code == 0, err
        choices = json.loads(out)["knobs"]["choices"]
        hows = {c["how"] for c in choices}
        interleaved = schedule.startswith("interleaved") or schedule == "zbv"
        assert ("interleaved" in hows) == interleaved
        assert ("proof" in hows) == (schedule == "1f1b")
        assert ("searched" in hows) == (not interleaved)
        zero = {c["options"]["zero_bubble"] for c in choices if c["how"] != "dominated"}
        assert zero == {schedule in ("zb-h1", "interleaved-zb", "zbv")}
    # an export target: the schedules it launches (Megatron-LM has no ZB-H1)
    code, out, err = run_cli(capsys, "plan", *argv, "--export", "megatron")
    assert code == 0, err
    exported = json.loads(out)
    assert exported["knobs"]["space"]["schedules"] == ["1f1b", "interleaved"]
    assert exported["export"]["target"] == "megatron"
    # DeepSpeed: 1F1B, no recomputation or sequence parallelism in its config
    code, out, err = run_cli(capsys, "plan", *argv, "--export", "deepspeed")
    assert code == 0, err
    space = json.loads(out)["knobs"]["space"]
    assert space["schedules"] == ["1f1b"] and space["recompute"] == ["none"]
    assert space["sequence_parallel"] == [False]
    assert space["distributed_optimizer"] == [True, False]
    # what the target does not launch at all is refused before the search
    for extra, message in (
        (["--export", "torchtitan"], "torchtitan trains bf16 only with FSDP"),
        (
            ["--export", "deepspeed", "--recompute", "full"],
            "deepspeed does not launch recompute full as planned",
        ),
        (
            ["--export", "megatron", "--schedule", "zbv"],
            "megatron does not launch schedules zbv as planned",
        ),
    ):
        code, out, err = run_cli(capsys, "plan", *argv, *extra)
        assert code == 2 and message in err and not out, (extra, err)
    # a list of modes
    code, out, err = run_cli(capsys, "plan", *argv, "--recompute", "selective,full")
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
        (
            ["--recompute", "none", "--recompute-per-stage"],
            "the knob flags: recompute_per_stage chooses counts of full",
        ),
    ],
)
def test_cli_refuses_bad_knobs(capsys, model_files, extra, message):
    argv = ["--model", model_files["selective-wins"], "--gpus", "L4:8"]
    code, _, err = run_cli(capsys, "plan", *argv, "--global-batch", 16, *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_profiled_model_keeps_its_profiled_knobs(capsys):
    argv = ["--model", "OPT-350", "--gpus", "GH-96:8", "--global-batch", 64]
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    assert json.loads(out)["cost_source"] == "profiles"
    code, _, err = run_cli(capsys, "plan", *argv, "--recompute", "auto")
    assert code == 2 and "profiles measured one training" in err


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_zero_bubble_stage_bounds_are_below_every_prediction(model_files, name):
    """The proof's per-stage bounds under ZB-H1 (no gradient chain, no
    blocking sends, no 1F1B warm-up or link bound) hold on every plan that
    fits, with uneven TP degrees too; and the table-free work bound."""
    _, pool, gbs, options = SETTINGS[name]
    checked = tight = 0
    for recompute in ("none", "full"):
        knobs = dataclasses.replace(options, zero_bubble=True, recompute=recompute)
        choice = choose_cost_source(model_files[name], pool, options=knobs)
        # uneven TP degrees where the space is small (66,168 plans otherwise)
        uniform = name == "selective-wins"
        found = _check_zero_bubble_bounds(choice, pool, gbs, uniform)
        checked, tight = checked + found[0], tight + found[1]
    assert checked >= 4 and tight > checked / 4  # plans, and bounds that bite


def _check_zero_bubble_bounds(choice, pool, gbs, uniform):
    data, model = choice.data, choice.model
    groups, bounds = stage_bound_tables(
        data, model, choice.pool(pool), gbs, uniform=uniform
    )
    work, checked, tight = {}, 0, 0
    for group in groups:
        for tp in group.tps:  # uniform TP: a group per degree
            work[(group.mbs, group.dp, tp)] = (
                least_work(data, model, C, group),
                group.steps,
            )
    for plan, _ in enumerate_plans(
        data, model, choice.pool(pool), gbs, C, uniform_tp=uniform
    ):
        prediction = predict_plan(plan, data, constants=C)
        if not prediction.fits_memory:
            continue
        first = plan.stages[0].replicas[0]
        largest = largest_stage_bound(bounds, plan)
        assert largest <= prediction.iteration_time_s * (1 + 1e-12)
        least, steps = work[(plan.mbs, plan.dp, first.tp)]
        gpus = sum(stage.replicas[0].tp for stage in plan.stages)
        assert steps * least / gpus <= prediction.iteration_time_s * (1 + 1e-12)
        checked += 1
        tight += largest >= 0.9 * prediction.iteration_time_s
    return checked, tight


def test_zero_bubble_needs_the_weight_gradient_split():
    """Profiles give no weight-gradient time: a plan priced by them is refused
    under ZB-H1, in one line; the knob search prices such a model analytically
    (and says so)."""
    data = load_sailor_data()
    plan, _ = next(iter(enumerate_plans(data, "OPT-350", {"RTX-2080": 4}, 8, C)))
    with pytest.raises(ProblemError, match="weight-gradient"):
        predict_plan(plan, data, constants=C, zero_bubble=True)
    result = plan_with_knobs(
        "OPT-350",
        {"RTX-2080": 4},
        8,
        space=KnobSpace.fixed(TrainingOptions(zero_bubble=True)),
    )
    assert result.choice.analytical and result.result.options.zero_bubble
    assert "analytical model" in result.choice.notes[0]


def test_shared_bound_tables_change_no_proof(model_files):
    """The knob search's proofs share their bound tables across choices: the
    certificates equal those of proofs with tables of their own."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    incumbent = plan_with_knobs(
        model_files["selective-wins"], pool, gbs, options=options
    ).result
    shared = BoundCache()
    for recompute in ("none", "selective", "full"):
        for order in RANK_ORDERS:
            knobs = dataclasses.replace(options, recompute=recompute)
            choice = choose_cost_source(
                model_files["selective-wins"], pool, options=knobs
            )
            runs = [
                certify_predicted(
                    choice.data,
                    choice.model,
                    choice.pool(pool),
                    gbs,
                    C,
                    incumbent.plan,
                    mixed_types=False,
                    cutoff_s=2 * incumbent.prediction.iteration_time_s,
                    rank_order=order,
                    cache=cache,
                )
                for cache in (shared, None)
            ]
            assert runs[0].plan == runs[1].plan
            assert runs[0].lower_bound_s == runs[1].lower_bound_s
            assert runs[0].plans_predicted == runs[1].plans_predicted
    assert shared.allreduce and shared.transfers


def test_the_quick_infeasibility_test_matches_the_search(model_files):
    # any_plan_fits (the proof's memory rule over every configuration) says
    # "none fits" exactly where the full search finds no plan, on both
    # schedules of the setting where only full recomputation fits.
    _, pool, gbs, options = SETTINGS["only-full-fits"]
    path = model_files["only-full-fits"]
    for recompute in ("none", "selective", "full"):
        for zero_bubble in (False, True):
            knobs = dataclasses.replace(
                options, recompute=recompute, zero_bubble=zero_bubble
            )
            choice = choose_cost_source(path, pool, options=knobs)
            fits = any_plan_fits(choice.data, choice.model, choice.pool(pool), gbs, C)
            assert fits == (recompute == "full")
            try:
                plan_any_model(path, pool, gbs, options=knobs)
            except InfeasibleProblemError:
                assert not fits
            else:
                assert fits


def _check_proven_optima(path, pool, gbs, options, best, zb):
    """``plan_any_model`` under ``options`` proves the brute-force optimum:
    ``best`` under 1F1B, ``zb`` under ZB-H1 (no plan where it is infinite)."""
    for zero_bubble, expected in ((False, best), (True, zb)):
        knobs = dataclasses.replace(options, zero_bubble=zero_bubble)
        if not math.isfinite(expected):
            with pytest.raises(InfeasibleProblemError):
                plan_any_model(path, pool, gbs, options=knobs)
            continue
        found, _ = plan_any_model(path, pool, gbs, options=knobs)
        assert found.proven
        assert found.prediction.iteration_time_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "layers"),
    [("selective-wins", 1), ("selective-wins", 2), ("only-full-fits", 4)],
)
def test_block_recomputation_is_searched_and_proven(model_files, name, layers):
    """A fixed ``recompute_num_layers`` (Megatron's block method) is searched
    and proven like the other options: the stage bounds lie below every plan's
    prediction, and the proven plan is the brute-force optimum (1F1B and
    ZB-H1; where memory is tight, recomputing 4 of a stage's blocks fits
    under 1F1B, never under ZB-H1)."""
    _, pool, gbs, options = SETTINGS[name]
    block = dataclasses.replace(options, recompute="full", recompute_num_layers=layers)
    best, _, zb, *_ = _brute_force(model_files[name], tuple(pool.items()), gbs, block)
    assert math.isfinite(best)
    choice = choose_cost_source(model_files[name], pool, options=block)
    _, bounds = stage_bound_tables(
        choice.data, choice.model, tuple(choice.pool(pool).items()), gbs,
        uniform=True,
    )  # fmt: skip
    checked = 0
    for plan, _ in enumerate_plans(
        choice.data, choice.model, choice.pool(pool), gbs, C
    ):
        prediction = predict_plan(plan, choice.data, constants=C)
        if prediction.fits_memory:
            bound = largest_stage_bound(bounds, plan)
            assert bound <= prediction.iteration_time_s * (1 + 1e-12)
            checked += 1
    assert checked  # one plan fits where memory is tight, more elsewhere
    _check_proven_optima(model_files[name], pool, gbs, block, best, zb)


def test_the_blocks_recomputed_are_a_knob(model_files):
    """``recompute_layers``: each block count of full recomputation is a
    choice (fewer blocks first); the knob search's plan is the brute-force
    optimum over every choice, 1F1B and ZB-H1 (a partial count wins here:
    it fits plans that recompute less than full)."""
    name = "selective-wins"
    _, pool, gbs, _ = SETTINGS[name]
    options = TrainingOptions("fp16")  # flash attention: selective saves little
    space = KnobSpace(
        recompute=("none", "full"),
        sequence_parallel=(False,),
        distributed_optimizer=(True,),
        schedules=("1f1b", "zb-h1"),
        recompute_layers=(2, None, 1),
    )
    choices = space.all_choices(options)
    layers = [c.recompute_num_layers for c in choices if c.recompute == "full"]
    assert layers == [1, 2, None]
    best = {}
    for choice in choices:
        one, _, zb, *_ = _brute_force(
            model_files[name], tuple(pool.items()), gbs, choice
        )
        best[choice.recompute_num_layers, choice.recompute] = min(one, zb)
    result = plan_with_knobs(model_files[name], pool, gbs, options=options, space=space)
    assert result.result.proven
    found = result.result.prediction.iteration_time_s
    assert found == pytest.approx(min(best.values()), rel=1e-12)
    won = result.result.options
    assert won.recompute == "full" and won.recompute_num_layers in (1, 2)
    assert best[won.recompute_num_layers, "full"] == pytest.approx(found, rel=1e-12)
    assert "first" in recompute_name(won)


def test_cli_searches_the_blocks_recomputed(capsys, model_files):
    path = model_files["selective-wins"]
    argv = ["--model", path, "--gpus", "L4:8", "--global-batch", 16, "--json"]
    argv += ["--recompute", "full", "--schedule", "1f1b", "--rank-order", "tp-dp-pp"]
    code, out, err = run_cli(capsys, "plan", *argv, "--recompute-num-layers", "all,2")
    assert code == 0, err
    found = json.loads(out)
    assert found["knobs"]["space"]["recompute_layers"] == [None, 2]
    assert found["options"]["recompute_num_layers"] == 2  # fits more, wins
    code, out, err = run_cli(capsys, "plan", *argv, "--recompute-num-layers", "2,x")
    assert code == 2 and "--recompute-num-layers takes" in err


def test_overlapped_gradient_sync_is_searched_and_proven(model_files):
    """Megatron-LM's --overlap-grad-reduce/--overlap-param-gather: the stage
    bounds (which take the overlapped passes as long as any) stay below every
    plan's prediction, the interleaved candidates' floors too (checked by the
    brute force), and the proven plan is the brute-force optimum (1F1B and
    ZB-H1); overlapping never costs time and saves some here."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    plain = dataclasses.replace(options, distributed_optimizer=True)
    overlap = dataclasses.replace(
        plain, overlap_grad_reduce=True, overlap_param_gather=True
    )
    path, items = model_files["selective-wins"], tuple(pool.items())
    best, inter, zb, *_ = _brute_force(path, items, gbs, overlap)
    before, inter_before, zb_before, *_ = _brute_force(path, items, gbs, plain)
    assert best <= before and zb <= zb_before and inter <= inter_before
    choice = choose_cost_source(path, pool, options=overlap)
    _, bounds = stage_bound_tables(choice.data, choice.model, items, gbs, uniform=True)
    checked = saved = 0
    unlapped = choose_cost_source(path, pool, options=plain)
    for plan, _ in enumerate_plans(
        choice.data, choice.model, choice.pool(pool), gbs, C
    ):
        prediction = predict_plan(plan, choice.data, constants=C)
        without = predict_plan(plan, unlapped.data, constants=C)
        assert prediction.iteration_time_s <= without.iteration_time_s
        saved += prediction.iteration_time_s < without.iteration_time_s
        if prediction.fits_memory:
            bound = largest_stage_bound(bounds, plan)
            assert bound <= prediction.iteration_time_s * (1 + 1e-12)
            checked += 1
    assert checked and saved
    assert math.isfinite(best) and math.isfinite(zb)
    _check_proven_optima(path, pool, gbs, overlap, best, zb)


def test_overlapped_reduction_searches_both_optimizer_choices():
    """With the gradient reduction overlapped the distributed optimizer's rule
    does not settle the choices without it (its all-gather may then wait
    longer than the hidden all-reduce): they are searched, without the
    all-gather overlap they cannot have."""
    space = KnobSpace()
    assert set(space.distributed_optimizer) == {True, False}
    base = TrainingOptions(
        "bf16",
        distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    off = [c for c in space.all_choices(base) if not c.distributed_optimizer]
    assert off and not any(c.overlap_param_gather for c in off)
    assert all(c.overlap_param_gather for c in space.all_choices(base) if c not in off)
    assert space.dominated(base) == []
    plain = dataclasses.replace(
        base, overlap_grad_reduce=False, overlap_param_gather=False
    )
    assert space.dominated(plain)


def test_tp_comm_overlap_is_searched_and_proven(model_files):
    """Megatron-LM's --tp-comm-overlap (with sequence parallelism): the proven
    plan is the brute-force optimum over every plan of that choice (1F1B and
    ZB-H1, the interleaved floors checked on the way), and the overlap never
    costs time."""
    _, pool, gbs, options = SETTINGS["selective-wins"]
    plain = dataclasses.replace(options, sequence_parallel=True)
    overlap = dataclasses.replace(plain, tp_comm_overlap=True)
    path, items = model_files["selective-wins"], tuple(pool.items())
    best, inter, zb, *_ = _brute_force(path, items, gbs, overlap)
    before, inter_before, zb_before, *_ = _brute_force(path, items, gbs, plain)
    assert best <= before and zb <= zb_before and inter <= inter_before
    assert math.isfinite(best) and math.isfinite(zb)
    _check_proven_optima(path, pool, gbs, overlap, best, zb)


def test_a_target_without_sequence_parallelism_refuses_it_before_the_search():
    """DeepSpeed launches no sequence parallelism: asking for it refuses the
    export before the search (it was searched, then its TP > 1 plan refused);
    torchtitan always shards along the sequence with TP, so a space without it
    still launches its TP 1 plans."""
    with pytest.raises(ValueError, match="does not launch sequence parallel on"):
        KnobSpace(sequence_parallel=(True,)).for_target("megatron-deepspeed")
    assert KnobSpace(sequence_parallel=(False,)).for_target(
        "torchtitan"
    ).sequence_parallel == (False,)
    both = KnobSpace().for_target("deepspeed")
    assert both.sequence_parallel == (False,)
