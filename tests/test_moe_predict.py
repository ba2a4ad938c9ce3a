"""A mixture of experts priced end to end: the expert blocks' rows, the
all-to-alls where the EP group lies, the expert gradients reduced over expert
data parallelism, the model state sharded over it, and a Megatron launch
predicted (analytical source, predictor, launch report)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import decoder_spec, one_knob_choice

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.moe import MoeSpec
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.moe_layers import (
    ExpertLayers,
    alltoall_seconds,
)
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.options import param_state_bytes
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import MegatronRun
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.planning.megatron_launch import (
    plan_from_megatron_run,
    predict_megatron_run,
)

SHEET = load_gpu_sheet()
H100 = SHEET["H100-SXM"]
#: A small Qwen3-MoE-like model: 4 blocks, the first dense.
SPEC = decoder_spec(
    name="tiny-moe",
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=1024,
    vocab_size=4096,
    seq_length=1024,
    moe=MoeSpec(16, 2, 256, layers=(False, True, True, True)),
)


def _run(tp=1, pp=1, ep=8, etp=1, gbs=64, overlap=False, sp=False, **changes):
    run = MegatronRun(
        spec=SPEC,
        tp=tp,
        pp=pp,
        virtual_chunks=1,
        micro_batch=1,
        global_batch=gbs,
        sequence_parallel=sp,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        precision="bf16",
        params_dtype="bf16",
        use_distributed_optimizer=True,
        padded_vocab_size=SPEC.padded_vocab_size(tp),
        ep=ep,
        etp=etp,
        moe_options=MoeOptions(
            dispatcher="alltoall", grouped_gemm=True, overlap_dispatch=overlap
        ),
    )
    return dataclasses.replace(run, **changes)


def test_alltoall_inside_a_node_and_across_nodes():
    gb = 1e9
    # EP 8 of one node: NVLink
    assert alltoall_seconds(gb, 8, 1, H100) == pytest.approx(
        gb / H100.intra_node_bytes_per_s
    )
    # EP 16 over two nodes of 8: 7 of the 15 peers near, 8 far; the far
    # bytes over a GPU's share of the node's network are the slower part
    far = gb * 8 / 15 / (H100.inter_node_bytes_per_s / 8)
    near = gb * 7 / 15 / H100.intra_node_bytes_per_s
    assert alltoall_seconds(gb, 16, 1, H100) == pytest.approx(max(far, near))
    # expert TP 2 x EP 8 spans two nodes: 4 members a node
    far = gb * 4 / 7 / (H100.inter_node_bytes_per_s / 8)
    assert alltoall_seconds(gb, 8, 2, H100) == pytest.approx(far)
    assert alltoall_seconds(gb, 1, 1, H100) == 0.0
    assert alltoall_seconds(gb, 8, 1, H100, efficiency=0.5) == pytest.approx(
        2 * gb / H100.intra_node_bytes_per_s
    )


def _source(ep=8, etp=1, overlap=False, options=None):
    experts = ExpertLayers(ExpertPass(ep=ep, etp=etp, grouped_gemm=True), overlap)
    options = options or TrainingOptions(precision="bf16", distributed_optimizer=True)
    return AnalyticalSource(SPEC, SHEET, options, experts=experts)


def test_expert_blocks_have_their_own_rows_and_parameters():
    source = _source()
    info = source.model_info(SPEC.name)
    pairs = SPEC.layer_param_split(1, 8, 1, tied_copy=True)
    np.testing.assert_array_equal(info.params[1], [d + e for d, e in pairs])
    np.testing.assert_array_equal(info.expert_params[1], [e for _, e in pairs])
    assert info.expert_params[1][1] == 0  # the dense first block
    assert info.expert_axes == (8, 1)
    times = source.layer_times(SPEC.name, "H100-SXM", 1, 1)
    # three expert blocks alike, the dense one apart
    assert times.forward[2] == times.forward[3] == times.forward[4]
    assert times.forward[1] != times.forward[2]
    # spreading the experts over 16 GPUs (two nodes) sends the all-to-alls
    # over the network: slower blocks, the dense one unchanged
    wide = _source(ep=16).layer_times(SPEC.name, "H100-SXM", 1, 1)
    assert wide.forward[2] > times.forward[2]
    assert wide.forward[1] == times.forward[1]
    # the all-to-alls beside another micro-batch's compute cost less
    hidden = _source(overlap=True).layer_times(SPEC.name, "H100-SXM", 1, 1)
    total = hidden.forward[2] + hidden.backward[2]
    assert total < times.forward[2] + times.backward[2]


def test_tp_without_sequence_parallelism_is_not_offered_for_experts():
    # Megatron-Core's MoE layer needs sequence parallelism at TP > 1
    assert _source().tp_values("H100-SXM") == (1,)
    options = TrainingOptions(
        precision="bf16", distributed_optimizer=True, sequence_parallel=True
    )
    assert 2 in _source(options=options).tp_values("H100-SXM")


def test_expert_state_is_sharded_over_expert_data_parallelism():
    """16 GPUs, EP 8: the dense parameters' optimizer state is sharded over
    16 replicas, the experts' over 2 (expert DP); by hand from the counts."""
    run = _run(ep=8)
    plan = plan_from_megatron_run(run, "H100-SXM", 16, 8)
    assert (plan.layout.edp(0), plan.layout.stages[0].ep) == (2, 8)
    prediction = predict_plan(plan, _source())
    pairs = SPEC.layer_param_split(1, 8, 1, tied_copy=True)
    dense = sum(d for d, _ in pairs)  # untied: nothing held twice
    expert = sum(e for _, e in pairs)
    parts = param_state_bytes("bf16")
    state = parts.replicated * (dense + expert) + parts.shardable * (
        dense / 16 + expert / 2
    )
    bucket = prediction.model_state_bytes[0, 0] - state  # the largest bucket
    info = _source().model_info(SPEC.name)
    assert 0 < bucket <= info.gradient_bytes * (dense + expert)
    # EP over all 16 GPUs: no expert data parallelism, the experts' state
    # whole on each GPU but for half as many experts
    wide = predict_plan(
        plan_from_megatron_run(_run(ep=16), "H100-SXM", 16, 8), _source(ep=16)
    )
    pairs16 = SPEC.layer_param_split(1, 16, 1, tied_copy=True)
    expert16 = sum(e for _, e in pairs16)
    assert expert16 * 2 == expert
    state16 = parts.replicated * (dense + expert16) + parts.shardable * (
        dense / 16 + expert16
    )
    assert wide.model_state_bytes[0, 0] - state16 == pytest.approx(bucket, rel=1e-9)


def test_expert_gradients_are_reduced_over_expert_data_parallelism():
    # EP 16 of 16 GPUs: each expert on one GPU, nothing to reduce for them;
    # EP 8: two copies of each, reduced across the two nodes
    one = predict_plan(
        plan_from_megatron_run(_run(ep=16), "H100-SXM", 16, 8), _source(ep=16)
    )
    two = predict_plan(
        plan_from_megatron_run(_run(ep=8), "H100-SXM", 16, 8), _source(ep=8)
    )
    assert two.dp_allreduce_s[0] > one.dp_allreduce_s[0] > 0


def test_a_plan_whose_expert_layout_differs_from_its_costs_is_refused():
    plan = plan_from_megatron_run(_run(ep=8), "H100-SXM", 16, 8)
    with pytest.raises(ProblemError, match="costs are for ep 16"):
        predict_plan(plan, _source(ep=16))


def test_launch_prediction_of_a_mixture_of_experts():
    launch = predict_megatron_run(_run(ep=8, overlap=True), "H100", 16, SHEET)
    assert launch.prediction.fits_memory
    assert launch.experts_line == (
        "experts: EP 8 x expert TP 1, expert DP 2; alltoall dispatcher "
        "(all-to-alls beside compute); routing priced balanced (busiest expert x1)"
    )
    assert launch.to_json()["experts"]["edp"] == 2
    # the model FLOPs are Megatron's count for the experts a token visits
    assert launch.model_flops_per_iteration == SPEC.model_flops_per_iteration(64)


def test_planning_beside_a_moe_launch_keeps_its_expert_layout():
    """plan --megatron-args of a mixture of experts searches with the
    launch's experts (they were priced at EP 1 before) and finds a plan no
    slower than the launch."""
    from pipedejavu.planning.launch_compare import compare_megatron_run

    run = _run(ep=4, pp=1, gbs=32)
    found = compare_megatron_run(run, "H100", 8, SHEET, method="dp")
    assert found.knobs.choice.data.experts.experts.ep == 4
    assert {a.ep for a in found.knobs.result.plan.layout.stages} == {4}
    best = found.knobs.result.prediction.iteration_time_s
    assert best <= found.given.prediction.iteration_time_s * (1 + 1e-9)


def test_flex_dispatch_crosses_to_each_node_once():
    """DeepEP's dispatch on 4 nodes of 8 (EP 32): a token crosses to each
    other node holding one of its 8 experts once; by hand."""
    from pipedejavu.costmodel.analytical.moe_layers import flex_seconds
    from pipedejavu.costmodel.analytical.ops import PassOptions

    spec = dataclasses.replace(
        SPEC, moe=MoeSpec(128, 8, 256, layers=(False, True, True, True))
    )
    opts = PassOptions(mbs=1, tp=1, precision="bf16")
    experts = ExpertPass(ep=32, etp=1, dispatcher="flex")
    tokens, row = 1024, 512 * 2
    node_miss = np.prod([(96 - i) / (128 - i) for i in range(8)])
    rank_miss = np.prod([(124 - i) / (128 - i) for i in range(8)])
    far = tokens * row * 3 * (1 - node_miss) / (H100.inter_node_bytes_per_s / 8)
    near = tokens * row * 4 * 7 * (1 - rank_miss) / H100.intra_node_bytes_per_s
    assert flex_seconds(spec, opts, experts, H100) == pytest.approx(max(far, near))
    # inside one node: the all-to-all of the bytes each GPU sends
    inside = ExpertPass(ep=8, etp=1, dispatcher="flex")
    from pipedejavu.costmodel.analytical.moe_tokens import dispatch_bytes

    assert flex_seconds(spec, opts, inside, H100) == pytest.approx(
        dispatch_bytes(spec, opts, inside) / H100.intra_node_bytes_per_s
    )


def test_the_published_moe_runs_are_launched_as_their_recipes_say():
    from pipedejavu.planning.moe_published import launch_of_moe_run, moe_launches
    from pipedejavu.planning.published_runs import (
        bundled_moe_published_path,
        load_moe_published_runs,
    )

    launches = moe_launches()
    assert len(launches) == 13
    for run, launch, tokens in launches:
        layout = launch.layout(run.num_gpus)
        assert (layout.stages[0].tp, layout.pp, layout.dp) == (run.tp, run.pp, run.dp)
        assert (layout.stages[0].ep, layout.stages[0].expert_tp) == (run.ep, run.etp)
        assert layout.edp(0) * run.ep * run.etp == run.tp * run.dp
        assert tokens > 0
        if run.spec.num_layers == 94 and run.pp > 1:  # embedding and loss counted
            assert sum(launch.stage_layers) == 94
            assert launch.stage_layers[0] == launch.stage_layers[1] - 1
        # the ModelZoo launcher adds --tp-comm-overlap in BF16 (all its runs
        # have TP > 1 with SP); Megatron-Bridge's records name none
        zoo = run.run_id.startswith("modelzoo_")
        assert launch.tp_comm_overlap == zoo
    notes = {
        run.run_id: launch_of_moe_run(run, record)[1]
        for run, record in zip(
            load_moe_published_runs(str(bundled_moe_published_path())),
            json.loads(bundled_moe_published_path().read_text())["runs"],
            strict=True,
        )
    }
    graphed = [
        key for key, said in notes.items() if any("CUDA graphs" in n for n in said)
    ]
    assert graphed == ["modelzoo_qwen3_235b_h100_run_h100_235b_sh_320tflops"]


def test_published_moe_predictions_match_the_recorded_benchmark():
    """The bundled constants are the fit on all thirteen runs
    (benchmarks/moe_published.py); their predictions are the recorded ones."""
    import json
    from pathlib import Path

    from pipedejavu.costmodel.analytical.roofline import HALF_PRECISION_ANALYTICAL
    from pipedejavu.planning.moe_published import MOE_FIELDS, predict_moe_published

    path = Path(__file__).parents[1] / "benchmarks" / "results" / "moe_published.json"
    recorded = json.loads(path.read_text())
    assert {
        name: getattr(HALF_PRECISION_ANALYTICAL, name) for name in MOE_FIELDS
    } == pytest.approx(recorded["constants"], rel=1e-12)
    predictions = predict_moe_published()
    assert [p.run.run_id for p in predictions] == [r["id"] for r in recorded["runs"]]
    for prediction, run in zip(predictions, recorded["runs"], strict=True):
        assert prediction.refused is None
        assert prediction.predicted_tokens_per_s_per_gpu == pytest.approx(
            run["predicted_tokens_per_s_per_gpu"], rel=1e-9
        )


# ---------------------------------------------------------- searched, proven
@pytest.mark.parametrize(
    "ep, gpus, gbs, uniform",
    [(2, 4, 8, True), (4, 4, 8, True), (2, 4, 8, False), (4, 8, 16, True)],
)
def test_search_over_an_expert_layout_matches_brute_force(ep, gpus, gbs, uniform):
    """The search over one expert layout (only stages of whole expert blocks,
    plans laid out with it) reaches brute force's optimum of the same
    objective; the plan it returns carries the layout and is predicted by the
    same costs."""
    from pipedejavu.baselines.megatron_brute import brute_force_megatron
    from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
    from pipedejavu.search.megatron.planner import search_megatron
    from pipedejavu.search.megatron.settings import MegatronSearchConfig

    source = _source(ep=ep)
    config = MegatronSearchConfig(uniform_tp=uniform)
    pool = {"H100-SXM": gpus}
    result = search_megatron(source, SPEC.name, pool, gbs, FITTED_CONSTANTS, config)
    plan, value = brute_force_megatron(
        source, SPEC.name, pool, gbs, FITTED_CONSTANTS, uniform_tp=uniform
    )
    assert result.optimum_s == pytest.approx(value, rel=1e-12)
    for found in (result.plan, plan):
        assert {(a.ep, a.etp) for a in found.layout.stages} == {(ep, 1)}
        assert all(
            found.layout.edp(s) * ep == found.layout.stage_gpus(s)
            for s in range(found.layout.pp)
        )
    assert result.prediction.iteration_time_s > 0


def test_plan_model_searches_the_expert_layouts(monkeypatch):
    """plan --model of a mixture of experts: every EP degree dividing the
    experts, with each dispatcher and with and without the all-to-all overlap,
    searched; the fastest kept, its bound the least over all."""
    from pipedejavu.planning import plan_model as module
    from pipedejavu.planning.expert_search import expert_layouts, layout_search

    calls = []
    real = module.plan_with_knobs

    seconds = []

    def spy(*args, experts=None, incumbent=None, **kwargs):
        e = experts.experts
        calls.append(
            (e.ep, e.dispatcher, experts.overlap_dispatch, incumbent is not None)
        )
        found = real(*args, experts=experts, incumbent=incumbent, **kwargs)
        seconds.append(found.result.search_time_s)
        return found

    monkeypatch.setattr(module, "plan_with_knobs", spy)
    path = Path(__file__).parent / "tiny_moe.json"
    space = one_knob_choice()
    found = module.plan_model(str(path), {"H100": 8}, 16, space=space)
    # the divisors of 16 experts up to 8 GPUs, inside the node largest first;
    # at each EP > 1 flex before alltoall, without the overlap first; each
    # layout after the first against the best plan so far
    expected = [
        (ep, dispatcher, overlap, (ep, dispatcher, overlap) != (8, "flex", False))
        for ep in (8, 4, 2)
        for dispatcher in ("flex", "alltoall")
        for overlap in (False, True)
    ] + [(1, "alltoall", False, True)]
    assert calls == expected
    # the search's time is the whole branch and bound's
    assert found.result.search_time_s >= sum(seconds)
    best = found.choice.data.experts
    assert found.result.plan.layout.stages[0].ep == best.experts.ep
    assert (
        "expert layouts searched: EP 1, 2, 4, 8 (expert TP 1), the "
        in (found.choice.notes[-1])
    )
    assert (
        found.result.predicted_lower_bound_s <= found.result.prediction.iteration_time_s
    )
    # one branch and bound over the layouts: the optimum of searching each
    # layout on its own (its own knob space), proven whenever each of those is
    spec = module.choose_cost_source(str(path), {"H100": 8}).spec
    alone = []
    for layers in expert_layouts(
        spec, 8, dispatchers=("alltoall", "flex"), overlap=(False, True)
    ):
        cut = layout_search(layers, space, precision="bf16")
        assert cut is not None
        alone.append(
            real(
                str(path),
                {"H100": 8},
                16,
                space=cut.space,
                experts=layers,
                one_stage_1f1b=cut.one_stage_1f1b,
            )
        )
    times = [p.result.prediction.iteration_time_s for p in alone]
    assert found.result.prediction.iteration_time_s == pytest.approx(
        min(times), rel=1e-12
    )
    assert all(p.result.proven for p in alone) and found.result.proven
    # the overlapped layouts ran 1F1B without pipeline stages (Megatron-Core
    # overlaps pipelines only when they are interleaved)
    for plan, layers in zip(
        alone,
        expert_layouts(
            spec, 8, dispatchers=("alltoall", "flex"), overlap=(False, True)
        ),
        strict=True,
    ):
        if layers.overlap_dispatch:
            assert plan.result.plan.num_stages == 1
