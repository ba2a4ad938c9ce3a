"""Per-stage recomputation (AdaPipe-style): each stage reruns the least count
of blocks that fits. Checked against every assignment of counts to a plan's
stages, the search and its proof against brute force over every plan, the
knob search, the exports' one-count rule and the CLI."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math

import pytest
from helpers import TINY_GPT, largest_stage_bound, stage_bound_tables

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.cli.main import main
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.stage_recompute import (
    stage_in_flight,
    stage_recompute_counts,
)
from pipedejavu.costmodel.megatron.tables import plan_from_stages, plan_tables
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import export_plan, uniform_recompute
from pipedejavu.planning.any_model import choose_cost_source, plan_any_model
from pipedejavu.planning.knob_space import KnobSpace, recompute_name
from pipedejavu.planning.knobs import plan_with_knobs

MODEL = {
    **TINY_GPT,
    "name": "tiny-stages",
    "seq_length": 8192,
    "max_position_embeddings": 8192,
}
POOL = {"L4": 4}
GBS = 8
CHOICES = (0, 1, None)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stage-recompute") / "tiny.json"
    path.write_text(json.dumps(MODEL))
    return str(path)


def _options(zero_bubble: bool, choices=CHOICES) -> TrainingOptions:
    return TrainingOptions(
        "bf16", recompute="full", recompute_choices=choices, zero_bubble=zero_bubble
    )


@functools.cache
def _every_plan(path: str, zero_bubble: bool):
    """``(choice, [(plan, auto prediction, best over every assignment)])``."""
    choice = choose_cost_source(path, POOL, options=_options(zero_bubble))
    rows = []
    for plan, _ in enumerate_plans(
        choice.data, choice.model, choice.pool(POOL), GBS, C, max_stages=3
    ):
        auto = predict_plan(plan, choice.data, constants=C)
        best = math.inf
        for counts in itertools.product(CHOICES, repeat=plan.num_stages):
            given = predict_plan(plan, choice.data, constants=C, stage_layers=counts)
            if given.fits_memory:
                best = min(best, given.iteration_time_s)
        rows.append((plan, auto, best))
    return choice, rows


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_the_least_fitting_counts_are_the_best_assignment(model_file, zero_bubble):
    choice, rows = _every_plan(model_file, zero_bubble)
    info = choice.data.model_info(choice.model)
    fit = mixed = 0
    for plan, auto, best in rows:
        counts = stage_recompute_counts(plan, choice.data, info, C, zero_bubble)
        assert auto.recompute_stage_layers == counts
        # the in-flight counts the rule assumes are the simulated peaks
        assert list(auto.peak_in_flight) == [
            stage_in_flight(s, plan.num_stages, plan.num_microbatches, zero_bubble)
            for s in range(plan.num_stages)
        ]
        if auto.fits_memory:
            fit += 1
            mixed += len(set(counts)) > 1
            assert auto.iteration_time_s == pytest.approx(best, rel=1e-12)
        else:
            assert best == math.inf
    assert fit >= 40 and mixed >= 30  # the setting exercises the rule


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_search_and_proof_match_brute_force(model_file, zero_bubble):
    choice, rows = _every_plan(model_file, zero_bubble)
    best = min(best for _, _, best in rows)
    found, _ = plan_any_model(model_file, POOL, GBS, options=_options(zero_bubble))
    assert found.proven
    assert found.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    counts = found.prediction.recompute_stage_layers
    assert found.options.recompute_stage_layers == counts
    # never slower than one count for every stage (each count of the set)
    for n in CHOICES:
        uniform = TrainingOptions(
            "bf16", recompute="full" if n != 0 else "none",
            recompute_num_layers=n or None, zero_bubble=zero_bubble,
        )  # fmt: skip
        try:
            plain, _ = plan_any_model(model_file, POOL, GBS, options=uniform)
        except ProblemError:
            continue
        assert found.prediction.iteration_time_s <= (
            plain.prediction.iteration_time_s * (1 + 1e-12)
        )
    # the proof's stage bounds lie below every plan's prediction
    _, bounds = stage_bound_tables(
        choice.data, choice.model, tuple(choice.pool(POOL).items()), GBS,
        uniform=True, max_stages=3,
    )  # fmt: skip
    for plan, auto, _ in rows:
        if auto.fits_memory:
            bound = largest_stage_bound(bounds, plan)
            assert bound <= auto.iteration_time_s * (1 + 1e-12)


def test_planning_tables_take_the_same_counts(model_file):
    # the tables offer each count as a configuration of the stage: the
    # cheapest that fits its stages after it is the predictor's count
    choice, rows = _every_plan(model_file, False)
    info = choice.data.model_info(choice.model)
    checked = 0
    for plan, auto, _ in rows:
        if plan.num_stages < 2 or not auto.fits_memory:
            continue
        tables, spans = plan_tables(choice.data, choice.model, C, plan)
        counts = stage_recompute_counts(plan, choice.data, info, C, False)
        for s, (a, b, m) in enumerate(spans):
            after = plan.num_stages - 1 - s
            fitting = [
                k
                for k in range(tables.compute_cost.shape[-1])
                if after <= tables.max_n_succ_stages[a, b, m, k]
            ]
            assert [0, 1, None][fitting[0]] == counts[s]
            checked += 1
    assert checked > 20


def test_the_knob_search_offers_it(model_file):
    space = KnobSpace(
        recompute=("none", "full"), sequence_parallel=(True,),
        distributed_optimizer=(True,), schedules=("1f1b", "zb-h1"),
        rank_orders=("tp-dp-pp",), recompute_layers=(1, None),
        recompute_per_stage=True,
    )  # fmt: skip
    result = plan_with_knobs(model_file, POOL, GBS, options=TrainingOptions("bf16"),
                             space=space)  # fmt: skip
    assert result.result.proven
    assert all(o.proven for o in result.outcomes)
    # the per-stage choice is searched beside the uniform ones
    per_stage = [o for o in result.outcomes if o.options.recompute_choices]
    assert len(per_stage) == 2  # 1F1B and ZB-H1
    assert per_stage[0].options.recompute_choices == (0, 1, None)
    # and no uniform choice of the space is faster than the answer
    for o in result.outcomes:
        if o.best_s == o.best_s:
            assert o.best_s >= result.result.iteration_time_s * (1 - 1e-12)
    won = result.result.options
    if won.recompute_choices is not None:
        assert won.recompute_stage_layers is not None
        assert "per stage:" in recompute_name(won)
    with pytest.raises(ValueError, match="add 'full'"):
        KnobSpace(recompute=("none",), recompute_per_stage=True)


def _plan(blocks):
    edges = [0]
    for b in blocks:
        edges.append(edges[-1] + b + (len(edges) == 1))
    edges[-1] += 1
    return plan_from_stages(
        [(a, b, 1) for a, b in zip(edges, edges[1:], strict=False)],
        gpu_type="B-80", dp=1, mbs=1, gbs=8, model="m", gpus_per_node=8, zone="z",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ((0, 0, 0), ("none", None)),
        ((None, 4, 9), ("full", None)),  # every block of every stage
        ((2, 2, 1), ("full", 2)),  # min(2, blocks): the block method
        ((3, 2, 1), None),  # no single count gives it
    ],
)
def test_exports_take_one_count_for_every_stage(counts, expected):
    plan = _plan([4, 4, 1])
    options = TrainingOptions(
        "fp32", recompute="full", recompute_choices=CHOICES,
        recompute_stage_layers=counts,
    )  # fmt: skip
    if expected is None:
        with pytest.raises(ExportRefused, match=r"rerun \[3, 2, 1\]"):
            uniform_recompute(plan, options, "megatron")
        with pytest.raises(ExportRefused, match="one count for every stage"):
            export_plan(plan, "megatron", options=options)
        return
    plain = uniform_recompute(plan, options, "megatron")
    assert (plain.recompute, plain.recompute_num_layers) == expected
    assert plain.recompute_choices is None and plain.recompute_stage_layers is None
    assert export_plan(plan, "megatron", options=options) == export_plan(
        plan, "megatron", options=plain
    )


def test_bad_per_stage_options_are_named():
    with pytest.raises(ValueError, match="applies to recompute='full'"):
        TrainingOptions(recompute_choices=(0, 1))
    with pytest.raises(ValueError, match="must be distinct"):
        TrainingOptions(recompute="full", recompute_choices=(1, 1))
    with pytest.raises(ValueError, match="non-empty list of counts"):
        TrainingOptions(recompute="full", recompute_stage_layers=(-1,))
    with pytest.raises(ValueError, match="without recompute_num_layers"):
        TrainingOptions(
            recompute="full", recompute_num_layers=2, recompute_choices=(0, 2)
        )
    options = _options(False)
    text = json.dumps(options.to_json())
    assert TrainingOptions.from_json(json.loads(text)) == options


def test_predictor_refuses_counts_it_cannot_price(model_file):
    choice = choose_cost_source(model_file, POOL, options=_options(False))
    plan = next(
        p for p, _ in enumerate_plans(
            choice.data, choice.model, choice.pool(POOL), GBS, C, max_stages=2
        ) if p.num_stages == 2
    )  # fmt: skip
    with pytest.raises(ProblemError, match="one count per stage"):
        predict_plan(plan, choice.data, stage_layers=(0,))
    plain = choose_cost_source(model_file, POOL, options=TrainingOptions("bf16"))
    with pytest.raises(ProblemError, match="per-stage recomputation"):
        predict_plan(plan, plain.data, stage_layers=(0, 0))
    with pytest.raises(ProblemError, match="one model chunk per rank"):
        predict_plan(plan, choice.data, virtual_stages=2)


def test_cli_searches_per_stage_counts(capsys, model_file):
    argv = ["plan", "--model", model_file, "--gpus", "L4:4", "--global-batch",
            "8", "--recompute", "full", "--recompute-per-stage", "--schedule",
            "1f1b", "--json"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["proven_optimal"]
    assert out["options"]["recompute_choices"] == [0, None]
    counts = out["options"]["recompute_stage_layers"]
    assert counts is not None and len(counts) == len(out["stages"])
    found, _ = plan_any_model(
        model_file, POOL, GBS,
        options=dataclasses.replace(_options(False, (0, None)), sequence_parallel=True,
                                    distributed_optimizer=True),
    )  # fmt: skip
    assert out["iteration_time_s"] <= found.prediction.iteration_time_s * (1 + 1e-12)
