"""Megatron-LM's two rank orders (``tp-dp-pp``, its default, and ``tp-pp-dp``,
``--use-tp-pp-dp-mapping``): the placement against Megatron's own example, the
proof's bounds in the ``tp-pp-dp`` order against every plan's prediction, and
its answer against brute force."""

from __future__ import annotations

import functools
import json

import pytest
from helpers import (
    fitting_plan_bounds,
    pin_path_constants,
    run_cli,
    stage_bound_tables,
)

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.core.plan3d import (
    RANK_ORDERS,
    canonical_nodes,
    check_nodes,
    rank_order_of,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import EXPORTS, LAUNCHED_RANK_ORDERS, export_plan
from pipedejavu.search.megatron.bounds import EITHER_ORDER
from pipedejavu.search.megatron.certify import certify_predicted
from pipedejavu.search.megatron.space import SearchScope
from pipedejavu.search.megatron.transfers import BoundCache

DATA = load_sailor_data()
# (model, pool, gbs, most stages): several nodes (4 and 8 GPUs per node)
SMALL = [
    ("OPT-350", (("V100-16", 8),), 16, 3),
    ("OPT-350", (("RTX-2080", 16),), 32, 3),
]


@pytest.fixture(autouse=True)
def _path_constants(monkeypatch):
    """The settings here were chosen under these 16-bit constants
    (:data:`helpers.PATH_TEST_HALF_PRECISION`)."""
    pin_path_constants(monkeypatch)


def test_placement_is_megatrons():
    # parallel_state's example: 16 GPUs, TP 2, PP 4 (so DP 2). tp-dp-pp: a
    # stage's two replicas on ranks 0-3, the next stage on 4-7, ...; tp-pp-dp:
    # a pipeline on ranks 0-7 (stage s at 2 s), the other on 8-15.
    default = canonical_nodes([2] * 4, 2, 4)
    assert default == [[0, 0], [1, 1], [2, 2], [3, 3]]
    other = canonical_nodes([2] * 4, 2, 4, "tp-pp-dp")
    assert other == [[0, 2], [0, 2], [1, 3], [1, 3]]
    with pytest.raises(ProblemError, match="rank order must be one of"):
        canonical_nodes([2], 2, 4, "pp-dp-tp")


def _a100_plan(stages, order: str):
    """OPT-350 in ``(start, stop, tp)`` stages on A100-40 nodes of 4 GPUs,
    dp 4, 16 micro-batches of 1, placed in ``order``."""
    return plan_from_stages(
        stages,
        gpu_type="A100-40",
        dp=4,
        mbs=1,
        gbs=16,
        model="OPT-350",
        gpus_per_node=4,
        zone="z",
        rank_order=order,
    )


@pytest.mark.parametrize("order", RANK_ORDERS)
def test_plans_know_their_order(order):
    plan = _a100_plan([(0, 10, 2), (10, 20, 2), (20, 26, 2)], order)
    check_nodes(plan, lambda gpu: 4)
    assert rank_order_of(plan, 4) == order


@functools.cache
def _every_plan(model, pool, gbs, stages, order):
    return [
        (plan, predict_plan(plan, DATA, constants=C))
        for plan, _ in enumerate_plans(
            DATA, model, dict(pool), gbs, C, max_stages=stages, rank_order=order
        )
    ]


@pytest.mark.parametrize(("model", "pool", "gbs", "stages"), SMALL)
def test_tp_pp_dp_bounds_are_below_every_prediction(model, pool, gbs, stages):
    _, bounds = stage_bound_tables(
        DATA, model, pool, gbs, uniform=True, max_stages=stages, rank_order="tp-pp-dp"
    )
    checked = tight = 0
    every = _every_plan(model, pool, gbs, stages, "tp-pp-dp")
    for _, largest, time_s in fitting_plan_bounds(bounds, every):
        checked += 1
        tight += largest >= 0.9 * time_s
    assert checked >= 100 and tight > checked / 4


def _proof_from_the_worst(model, pool, gbs, stages, order, **options):
    """The proof in ``order`` started from the slowest plan that fits, and
    the brute-force optimum of that order."""
    every = _every_plan(model, pool, gbs, stages, order)
    fits = [(p, r) for p, r in every if r.fits_memory]
    worst = max(fits, key=lambda item: item[1].iteration_time_s)[0]
    certificate = certify_predicted(
        DATA,
        model,
        dict(pool),
        gbs,
        C,
        worst,
        SearchScope(max_stages=stages),
        mixed_types=False,
        rank_order=order,
        **options,
    )
    return certificate, min(r.iteration_time_s for _, r in fits)


@pytest.mark.parametrize(("model", "pool", "gbs", "stages"), SMALL)
def test_tp_pp_dp_proof_is_the_brute_force_optimum(model, pool, gbs, stages):
    certificate, best = _proof_from_the_worst(model, pool, gbs, stages, "tp-pp-dp")
    assert certificate.proven
    assert certificate.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert rank_order_of(certificate.plan, 8 if "RTX" in pool[0][0] else 4) in (
        "tp-pp-dp",
        "tp-dp-pp",  # both orders place a plan alike (one stage, or one node)
    )
    # the orders differ on these settings
    default = min(
        r.iteration_time_s
        for _, r in _every_plan(model, pool, gbs, stages, "tp-dp-pp")
        if r.fits_memory
    )
    assert default != pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize(("model", "pool", "gbs", "stages"), SMALL)
def test_either_order_bounds_cover_both_orders(model, pool, gbs, stages):
    # The knob search's shared pre-bound: least over both orders' placements,
    # below every plan's prediction in either order, and it still bites.
    _, bounds = stage_bound_tables(
        DATA, model, pool, gbs, uniform=True, max_stages=stages, rank_order=EITHER_ORDER
    )
    checked = tight = 0
    for order in RANK_ORDERS:
        every = _every_plan(model, pool, gbs, stages, order)
        for _, largest, time_s in fitting_plan_bounds(bounds, every):
            checked += 1
            tight += largest >= 0.9 * time_s
    assert checked >= 200 and tight > checked / 4


@pytest.mark.parametrize(("model", "pool", "gbs", "stages"), SMALL)
def test_proofs_sharing_the_either_order_bound_agree_with_brute_force(
    model, pool, gbs, stages
):
    cache = BoundCache()
    for order in RANK_ORDERS:
        certificate, best = _proof_from_the_worst(
            model, pool, gbs, stages, order, cache=cache, either_order=True
        )
        assert certificate.proven
        assert certificate.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert cache.either  # the second order read the first one's bounds


def test_interleaved_search_in_each_order_is_the_brute_force_optimum():
    # Llama-3-8B on two L4 nodes: the orders place the interleaved plans
    # differently (their optima differ); in each, the search's plan is the
    # best of every candidate placed in that order.
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.planning.any_model import choose_cost_source
    from pipedejavu.search.megatron.interleaved import (
        interleaved_candidates,
        search_interleaved,
    )
    from pipedejavu.search.megatron.interleaved_floor import candidate_plan

    pool, gbs = {"L4": 16}, 32
    choice = choose_cost_source(
        "Llama-3-8B",
        pool,
        options=TrainingOptions("bf16", recompute="full"),
        seq_length=2048,
    )
    data, model, gpus = choice.data, choice.model, choice.pool(pool)
    best = {}
    for order in RANK_ORDERS:
        times = []
        for item in interleaved_candidates(data, model, gpus, gbs, C):
            plan = candidate_plan(data, model, gbs, item, order)
            assert rank_order_of(plan) in (order, RANK_ORDERS[0])
            found = predict_plan(plan, data, constants=C, virtual_stages=item.chunks)
            if found.fits_memory:
                times.append(found.iteration_time_s)
        result = search_interleaved(data, model, gpus, gbs, C, rank_order=order)
        assert result.proven and rank_order_of(result.plan) in (order, RANK_ORDERS[0])
        assert result.prediction.iteration_time_s == pytest.approx(
            min(times), rel=1e-12
        )
        best[order] = min(times)
    assert best[RANK_ORDERS[0]] != pytest.approx(best[RANK_ORDERS[1]], rel=1e-3)


def test_mixed_types_stay_in_the_default_order():
    plan = _every_plan("OPT-350", (("A100-40", 8),), 16, 3, "tp-dp-pp")[0][0]
    with pytest.raises(ProblemError, match="one GPU type"):
        certify_predicted(
            DATA,
            "OPT-350",
            {"A100-40": 4, "V100-16": 4},
            16,
            C,
            plan,
            rank_order="tp-pp-dp",
        )


def test_knob_search_places_by_rank_order_and_exports_it(capsys):
    """The issue's case (GPT-Neo-2.7 on 64 GH-96, gbs 1024, its profiles):
    with tp-pp-dp searched, a plan whose pipelines sit inside nodes is faster
    than the best in the default order and is proven; the Megatron-LM export
    says so, and --rank-order tp-dp-pp keeps the default."""
    argv = ["plan", "--model", "GPT-Neo-2.7", "--gpus", "GH-96:64"]
    argv += ["--global-batch", 1024, "--json"]
    code, out, err = run_cli(capsys, *argv, "--export", "megatron")
    assert code == 0, err
    both = json.loads(out)
    assert both["rank_order"] == "tp-pp-dp" and both["proven_optimal"]
    assert "--use-tp-pp-dp-mapping" in both["export"]["text"]
    code, out, err = run_cli(capsys, *argv, "--rank-order", "tp-dp-pp")
    assert code == 0, err
    default = json.loads(out)
    assert default["rank_order"] == "tp-dp-pp"
    assert both["iteration_time_s"] < default["iteration_time_s"]


def _two_stages(order: str):
    return _a100_plan([(0, 13, 1), (13, 26, 1)], order)


def test_exports_of_a_tp_pp_dp_plan():
    plan = _two_stages("tp-pp-dp")
    hosts = {"A100-40": 4}
    for target in EXPORTS:
        if RANK_ORDERS[1] in LAUNCHED_RANK_ORDERS[target]:
            text = export_plan(plan, target, gpus_per_node=hosts)
            assert "--use-tp-pp-dp-mapping" in text
            continue
        with pytest.raises(ExportRefused, match="tp-pp-dp") as refusal:
            export_plan(plan, target, gpus_per_node=hosts)
        assert "\n" not in str(refusal.value)
    # the default order writes no flag; without the hosts' size the plan's
    # fullest node gives it
    default = export_plan(_two_stages("tp-dp-pp"), "megatron")
    assert "--use-tp-pp-dp-mapping" not in default
    assert "--use-tp-pp-dp-mapping" in export_plan(plan, "megatron")


def test_megatron_args_with_the_tp_pp_dp_mapping_price_that_order(capsys):
    """``--use-tp-pp-dp-mapping`` in a launch: the plan is laid out pipeline
    by pipeline, as Megatron-LM does and as ``plan --export megatron`` writes
    such a plan (it was listed as ignored and priced in the default order)."""
    from pipedejavu.io.gpu_sheet import load_gpu_sheet
    from pipedejavu.io.megatron_args import spec_from_megatron_args as parse
    from pipedejavu.planning.megatron_launch import predict_megatron_run

    flags = (
        "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 "
        "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
        "--global-batch-size 64 --bf16 --pipeline-model-parallel-size 4 "
        "--vocab-size 32000 --use-distributed-optimizer"
    )
    sheet = load_gpu_sheet()
    default = parse(flags)
    mapped = parse(flags + " --use-tp-pp-dp-mapping")
    assert default.rank_order == "tp-dp-pp" and mapped.rank_order == "tp-pp-dp"
    assert not any("mapping" in word for word in mapped.ignored)
    launches = [
        predict_megatron_run(r, "H100-SXM", 32, sheet) for r in (default, mapped)
    ]
    assert [rank_order_of(x.plan, 8) for x in launches] == ["tp-dp-pp", "tp-pp-dp"]
    # the pipelines inside nodes, the all-reduce across: not the same time
    assert (
        launches[0].prediction.iteration_time_s
        != launches[1].prediction.iteration_time_s
    )
    code, out, err = run_cli(
        capsys, "predict", "--gpus", "H100-SXM:32", "--json", "--megatron-args",
        flags + " --use-tp-pp-dp-mapping",
    )  # fmt: skip
    assert code == 0, err
    assert (
        json.loads(out)["iteration_time_s"] == launches[1].prediction.iteration_time_s
    )
    with pytest.raises(ProblemError, match="context-parallel-size 2 and"):
        parse(flags + " --use-tp-pp-dp-mapping --context-parallel-size 2")
    # One stage: both orders are one layout, and Megatron Core (0.11 on)
    # takes the flag with context parallelism (it was refused at any PP).
    one_stage = flags.replace("--pipeline-model-parallel-size 4", "")
    one_stage += " --context-parallel-size 2"
    times = [
        predict_megatron_run(parse(f), "H100-SXM", 32, sheet).prediction
        for f in (one_stage, one_stage + " --use-tp-pp-dp-mapping")
    ]
    assert times[0].iteration_time_s == times[1].iteration_time_s
