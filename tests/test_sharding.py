"""Sharded data parallelism (ZeRO-2/3, FSDP2, HSDP) and context parallelism's
key/value exchange: the vocabulary, the byte rules and the predictor."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import ParallelLayout
from pipedejavu.core.placement import sequence_shares
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.ops import (
    Collective,
    PassOptions,
    attention_core_backward_ops,
    attention_core_forward_ops,
)
from pipedejavu.costmodel.analytical.roofline import (
    HALF_PRECISION_ANALYTICAL,
    pass_seconds,
)
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.options import param_state_bytes
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sharding import fsdp_exposed
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.megatron_launch import options_of_run

SHEET = load_gpu_sheet()


# ------------------------------------------------------------ vocabulary


def _h100_plan(stages, *, dp: int, gbs: int, model: str = "Llama-3-8B"):
    """A plan of ``(start, stop, tp)`` stages on 8-GPU H100 nodes, mbs 1."""
    return plan_from_stages(
        list(stages),
        gpu_type="H100-SXM",
        dp=dp,
        mbs=1,
        gbs=gbs,
        model=model,
        gpus_per_node=8,
        zone="z",
    )


def test_zero_stage_and_distributed_optimizer_are_one_setting():
    assert TrainingOptions(distributed_optimizer=True).zero_stage == 1
    assert TrainingOptions(zero_stage=1) == TrainingOptions(distributed_optimizer=True)
    assert TrainingOptions(zero_stage=3).distributed_optimizer
    off = dataclasses.replace(
        TrainingOptions(zero_stage=1), distributed_optimizer=False, zero_stage=0
    )
    assert off == TrainingOptions()
    for bad in (4, -1, True, "3"):
        with pytest.raises(ValueError, match="zero_stage"):
            TrainingOptions(zero_stage=bad)
    with pytest.raises(ValueError, match="needs zero_stage=3"):
        TrainingOptions(zero_stage=2, reshard_after_forward=False)
    options = TrainingOptions("bf16", zero_stage=3, reshard_after_forward=False)
    assert TrainingOptions.from_json(options.to_json()) == options


def test_layout_shard_groups():
    layout = ParallelLayout.uniform(tp=2, dp=8, cp=2, dp_shard=4)
    assert (layout.shard_replicas, layout.shard_group, layout.dp_replicate) == (
        4,
        8,
        2,
    )
    assert ParallelLayout.uniform(dp=8, dp_shard=8).dp_shard is None  # all of dp
    assert ParallelLayout.uniform(dp=8).shard_group == 8
    with pytest.raises(ProblemError, match="does not divide"):
        ParallelLayout.uniform(dp=8, dp_shard=3)


def test_plan_files_keep_the_shard_groups():
    plan = _h100_plan([(0, 34, 1)], dp=8, gbs=8)
    plan = plan.replace(layout=dataclasses.replace(plan.layout, dp_shard=2))
    back = Plan3D.from_json(plan.to_json())
    assert back.layout.dp_shard == 2 and back.layout == plan.layout
    assert "dp_shard 2" in back.describe()


# ------------------------------------------------------------- byte rules
@pytest.mark.parametrize(
    ("precision", "stage", "expected"),
    [
        # Megatron-LM's table: 18 = 6 + 12/d in bf16, 16 = 8 + 8/d in fp32
        ("bf16", 1, (6, 12)),
        ("fp32", 1, (8, 8)),
        # ZeRO-2: only the weights replicated
        ("bf16", 2, (2, 16)),
        ("fp32", 2, (4, 12)),
        # ZeRO-3 / FSDP2: fp32 shards of weights, gradients and Adam, 16/d
        ("bf16", 3, (0, 16)),
        ("fp8", 3, (0, 16)),
        ("fp32", 3, (0, 16)),
    ],
)
def test_state_bytes_per_stage(precision, stage, expected):
    assert tuple(param_state_bytes(precision, zero_stage=stage)) == expected


def test_fsdp_exposed_hides_what_the_passes_outlast():
    # short collectives: only the first gather / last reduce-scatter (1/units)
    f, b = fsdp_exposed(1.0, 2.0, 10.0, 20.0, 4, reshard=True)
    assert (f, b) == (0.25, 0.75)  # backward: reduce 2 + gather again 1
    f, b = fsdp_exposed(1.0, 2.0, 10.0, 20.0, 4, reshard=False)
    assert b == 0.5
    # long collectives: what outlasts the pass
    f, b = fsdp_exposed(10.0, 20.0, 4.0, 6.0, 4, reshard=True)
    assert (f, b) == (6.0, 24.0)


# --------------------------------------------------------------- predictor
def _predict(options, dp=8, dp_shard=None, stages=((0, 34, 1),)):
    spec = load_model_spec("llama-3-8b")
    source = AnalyticalSource(spec, SHEET, options)
    plan = _h100_plan(list(stages), dp=dp, gbs=dp * 2, model=spec.name)
    if dp_shard is not None:
        plan = plan.replace(layout=dataclasses.replace(plan.layout, dp_shard=dp_shard))
    return plan, source, predict_plan(plan, source)


def test_zero3_shards_the_state_and_pays_per_micro_batch():
    bf16 = TrainingOptions("bf16", recompute="full")
    plan, source, one = _predict(dataclasses.replace(bf16, zero_stage=1))
    _, _, three = _predict(dataclasses.replace(bf16, zero_stage=3))
    _, _, hsdp = _predict(dataclasses.replace(bf16, zero_stage=3), dp_shard=4)
    info = source.model_info(plan.model)
    held = info.params[1].sum()  # untied: every parameter once
    # the same activations and gathered buffers: the shards differ by 16 B
    # per parameter over 4 GPUs against 8
    assert hsdp.peak_memory_bytes - three.peak_memory_bytes == pytest.approx(
        16 * held * (1 / 4 - 1 / 8), rel=1e-9
    )
    assert three.peak_memory_bytes < one.peak_memory_bytes
    # ZeRO-3 gathers before every pass: never faster per micro-batch
    assert (three.stage_forward_s >= one.stage_forward_s).all()
    assert (three.stage_backward_s > one.stage_backward_s).all()
    # HSDP all-reduces the shards across its 2 groups at the end; FSDP not
    assert three.dp_allreduce_s.max() == 0.0 < hsdp.dp_allreduce_s.max()


def test_zero3_refuses_schedules_it_is_not_priced_with():
    options = TrainingOptions("bf16", zero_stage=3)
    plan, source, _ = _predict(options, dp=4, stages=((0, 18, 1), (18, 34, 1)))
    with pytest.raises(ProblemError, match="1F1B schedule only"):
        predict_plan(plan, source, virtual_stages=2)


# ----------------------------------------------------- context parallelism
def _core(cp: int, seq: int):
    spec = dataclasses.replace(load_model_spec("llama-3-8b"), seq_length=seq)
    opts = PassOptions(1, 1, "bf16", context_parallel=cp)
    return attention_core_forward_ops(spec, opts), attention_core_backward_ops(
        spec, opts
    )


def test_context_parallel_exchange_bytes():
    forward, backward = _core(4, 2048)
    (exchange,) = [op for op in forward if isinstance(op, Collective)]
    # a GPU's keys and values: 2048 tokens x 8 groups x (128 + 128) x 2 B
    share = 2048 * 8 * 256 * 2
    assert exchange.link_bytes == 3 * share and exchange.chunks == 4
    assert exchange.beside == "flash_attention"
    (back,) = [op for op in backward if isinstance(op, Collective)]
    assert back.link_bytes == 2 * exchange.link_bytes
    assert back.beside == "flash_attention.backward"
    assert not [op for op in _core(1, 2048)[0] if isinstance(op, Collective)]


def test_context_parallel_exchange_hidden_by_long_attention():
    gpu = SHEET["H100-SXM"]
    for seq, hidden in ((32768, True), (256, False)):
        ops, _ = _core(8, seq)
        without = [op for op in ops if not isinstance(op, Collective)]
        (exchange,) = [op for op in ops if isinstance(op, Collective)]
        c = HALF_PRECISION_ANALYTICAL
        link = (
            exchange.link_bytes / (gpu.intra_node_bytes_per_s * c.link_efficiency)
            + c.collective_latency_s
        )
        extra = pass_seconds(ops, gpu, c) - pass_seconds(without, gpu, c)
        if hidden:  # only one step of the ring is paid
            assert extra == pytest.approx(link / 8, rel=1e-9)
        else:  # a short kernel hides less than the ring takes
            assert link / 8 < extra <= link


def test_memory_terms_sum_to_the_peak():
    bf16 = TrainingOptions("bf16", recompute="full")
    for stage in (1, 2, 3):
        plan, source, predicted = _predict(dataclasses.replace(bf16, zero_stage=stage))
        memory = predicted.memory_terms
        terms = memory["terms"]
        assert sum(terms.values()) == pytest.approx(predicted.peak_memory_bytes)
        assert min(terms.values()) >= 0
        held = source.model_info(plan.model).params[1].sum()
        # bf16: 2 B weights replicated until ZeRO-3 (then 4 B fp32 shards)
        weights = 4 * held / 8 if stage == 3 else 2 * held
        assert terms["parameters"] == pytest.approx(weights)
        gradients = 4 * held / (8 if stage >= 2 else 1)
        assert terms["gradients"] == pytest.approx(gradients)


# ------------------------------------------------ context-parallel plans
def test_sequence_shares_fold_context_into_replicas():
    plan = _h100_plan([(0, 34, 2)], dp=4, gbs=8)
    plan = plan.replace(layout=ParallelLayout.uniform(tp=2, dp=4, cp=4, dp_shard=2))
    assert plan.num_gpus == 32
    shares = sequence_shares(plan, 8)
    # 16 replicas of TP 2 on consecutive ranks: 4 per node of 8 GPUs
    assert shares.dp == 16 and shares.gbs == 32 and shares.layout.cp == 1
    assert [r.node for r in shares.stages[0].replicas] == [k // 4 for k in range(16)]
    assert shares.layout.shard_replicas == 8  # dp_shard 2 x cp 4
    assert sequence_shares(shares, 8) is shares


def test_a_context_parallel_plan_needs_costs_of_its_shares():
    spec = load_model_spec("llama-3-8b")
    options = TrainingOptions("bf16", recompute="full")
    plan = _h100_plan([(0, 34, 1)], dp=4, gbs=4, model=spec.name)
    plan = plan.replace(layout=ParallelLayout.uniform(dp=4, cp=2))
    whole = AnalyticalSource(spec, SHEET, options)
    with pytest.raises(ProblemError, match="costs are for 1"):
        predict_plan(plan, whole)
    share = dataclasses.replace(spec, seq_length=spec.seq_length // 2)
    source = AnalyticalSource(share, SHEET, options, context_parallel=2)
    predicted = predict_plan(plan, source)
    folded = predict_plan(
        sequence_shares(plan, 8),
        source.__class__(share, SHEET, options, context_parallel=1),
    )
    # the exchange of keys and values is what the folded plan without the
    # whole sequence's keys lacks: the shares' own plan is slower
    assert predicted.iteration_time_s > folded.iteration_time_s
    assert predicted.memory_bytes.shape == (1, 8)


# ------------------------------------------------ Megatron-LM's FSDP flags
LLAMA_FLAGS = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
    "--swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 "
    "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 64 "
    "--bf16 --vocab-size 128256 "
)


@pytest.mark.parametrize(
    ("flags", "stage"),
    [
        ("", 0),
        ("--use-distributed-optimizer", 1),
        ("--use-torch-fsdp2", 3),
        ("--use-megatron-fsdp", 0),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", 1),
        ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", 2),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy "
            "optim_grads_params --use-distributed-optimizer",
            3,
        ),
    ],
)
def test_megatron_fsdp_flags_read_as_zero_stages(flags, stage):
    run = spec_from_megatron_args(LLAMA_FLAGS + flags)
    assert run.zero_stage == stage
    assert options_of_run(run).zero_stage == stage
    assert not any("fsdp" in word for word in run.ignored)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--use-torch-fsdp2 --pipeline-model-parallel-size 2", "pipeline parallel"),
        ("--use-torch-fsdp2 --use-distributed-optimizer", "distributed optimizer"),
        ("--use-torch-fsdp2 --use-megatron-fsdp", "two FSDPs"),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
            "--pipeline-model-parallel-size 2",
            "not priced yet",
        ),
    ],
)
def test_megatron_fsdp_refusals(flags, message):
    with pytest.raises(ProblemError, match=message):
        spec_from_megatron_args(LLAMA_FLAGS + flags)


def test_sharding_strategy_alone_is_listed_as_ignored():
    run = spec_from_megatron_args(
        LLAMA_FLAGS + "--data-parallel-sharding-strategy optim_grads"
    )
    assert run.zero_stage == 0
    assert any("--use-megatron-fsdp only" in word for word in run.ignored)


_ANY = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
)


@settings(max_examples=200, deadline=None)
@given(dp_shard=_ANY, zero=_ANY, reshard=_ANY)
def test_plan_files_sharding_fields_read_or_one_line(dp_shard, zero, reshard):
    """Any dp_shard in a plan file's layout and any ZeRO stage or resharding
    in its options: read when valid, else one error line (never a traceback)."""
    plan = _h100_plan([(0, 34, 1)], dp=8, gbs=8)
    data = plan.to_json()
    data["layout"]["dp_shard"] = dp_shard
    try:
        read = Plan3D.from_json(data)
    except ProblemError as error:
        assert "\n" not in str(error)
    else:
        assert read.layout.shard_replicas in (1, 2, 4, 8)
    fields = {"zero_stage": zero, "reshard_after_forward": reshard}
    try:
        options = TrainingOptions.from_json(fields)
    except ValueError as error:
        assert "\n" not in str(error)
    else:
        assert options.zero_stage in (0, 1, 2, 3)
