"""torchtitan exports of sharded data parallelism (issue 45, item 3): FSDP2
and HSDP (``zero_stage`` 3 over the layout's shard groups), with TP and
context parallelism, bf16 and fp8; and each refusal where torchtitan runs
something else than the plan. ``benchmarks/check_torchtitan.py`` runs
torchtitan's own code on these files (outside CI)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import tomllib

from pipedejavu.core.layout import ParallelLayout
from pipedejavu.core.training_options import TORCHTITAN_OP, TrainingOptions
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.export_torchtitan import to_torchtitan
from pipedejavu.io.exports import export_plan

ZERO3 = TrainingOptions("bf16", zero_stage=3, sequence_parallel=True)


def sharded_plan(*, pp=1, tp=1, dp=1, cp=1, dp_shard=None, mbs=1, steps=4, blocks=4):
    """``pp`` equal stages of ``blocks`` transformer layers each (profile
    layer 0 the embedding, the last the head), on one GPU type."""
    total = pp * blocks + 2
    bounds = [0] + [1 + s * blocks for s in range(1, pp)] + [total]
    plan = plan_from_stages(
        [(a, b, tp) for a, b in zip(bounds, bounds[1:], strict=False)],
        gpu_type="B-80", dp=dp, mbs=mbs, gbs=mbs * dp * steps, model="m",
        gpus_per_node=8, zone="z",
    )  # fmt: skip
    layout = ParallelLayout.uniform(tp=tp, pp=pp, dp=dp, cp=cp, dp_shard=dp_shard)
    return plan.replace(layout=layout)


def config(plan, options=ZERO3, seq_length=8192):
    return tomllib.loads(to_torchtitan(plan, options, seq_length))


def world(par: dict) -> int:
    """GPUs the degrees take (torchtitan's ``ParallelDims`` rule)."""
    return (
        par["data_parallel_replicate_degree"]
        * par["data_parallel_shard_degree"]
        * par.get("context_parallel_degree", 1)
        * par["tensor_parallel_degree"]
        * par["pipeline_parallel_degree"]
    )


# ------------------------------------------------------------------ written
def test_fsdp_shards_over_every_replica_in_bf16():
    plan = sharded_plan(dp=8, mbs=2, steps=3)
    got = config(plan)
    assert got["training"] == {
        "local_batch_size": 2,
        "global_batch_size": 48,  # 3 accumulation steps of 2 x 8
        "seq_len": 8192,
        "dtype": "float32",
        "mixed_precision_param": "bfloat16",
        "mixed_precision_reduce": "float32",
    }
    assert got["parallelism"] == {
        "data_parallel_replicate_degree": 1,
        "data_parallel_shard_degree": 8,
        "fsdp_reshard_after_forward": "always",
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
    }
    assert got["activation_checkpoint"] == {"mode": "none"}
    assert set(got) == {"training", "parallelism", "activation_checkpoint"}


def test_hsdp_replicates_shard_groups():
    got = config(sharded_plan(dp=8, dp_shard=2))["parallelism"]
    assert (
        got["data_parallel_replicate_degree"],
        got["data_parallel_shard_degree"],
    ) == (4, 2)


def test_context_parallelism_with_tp_and_hsdp():
    plan = sharded_plan(tp=2, dp=4, cp=4, dp_shard=2)
    got = config(plan, seq_length=131072)
    assert got["parallelism"] == {
        "data_parallel_replicate_degree": 2,
        "data_parallel_shard_degree": 2,
        "fsdp_reshard_after_forward": "always",
        "tensor_parallel_degree": 2,
        "context_parallel_degree": 4,
        "pipeline_parallel_degree": 1,
    }
    assert world(got["parallelism"]) == plan.num_gpus == 32
    # CP ranks share their replica's samples: the batch is over dp alone.
    assert got["training"]["local_batch_size"] == plan.mbs
    assert got["training"]["global_batch_size"] == plan.mbs * 4 * 4


def test_cp_alone_is_fsdp_over_the_context_parallel_gpus():
    got = config(sharded_plan(cp=8), seq_length=65536)["parallelism"]
    assert (
        got["data_parallel_replicate_degree"],
        got["data_parallel_shard_degree"],
        got["context_parallel_degree"],
    ) == (1, 1, 8)


def test_tp_with_fsdp_and_no_resharding_and_full_recomputation():
    options = dataclasses.replace(ZERO3, reshard_after_forward=False, recompute="full")
    got = config(sharded_plan(tp=4, dp=2), options)
    assert got["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert got["parallelism"]["tensor_parallel_degree"] == 4
    assert got["activation_checkpoint"] == {"mode": "full"}


def test_torchtitans_per_op_recomputation():
    """The policy the sharded search prices (``recompute_modules =
    ("torchtitan_op",)``) is torchtitan's op-level selective mode."""
    options = dataclasses.replace(
        ZERO3, recompute="selective", recompute_modules=(TORCHTITAN_OP,)
    )
    got = config(sharded_plan(tp=2, dp=4, cp=2), options)
    assert got["activation_checkpoint"] == {
        "mode": "selective",
        "selective_ac_option": "op",
    }
    # Megatron-Core's modules are another policy.
    with pytest.raises(ExportRefused, match="no selective recomputation of Megat"):
        to_torchtitan(
            sharded_plan(dp=4),
            dataclasses.replace(options, recompute_modules=("core_attn",)),
        )


def test_fp8_is_torchaos_tensorwise_float8_linears():
    options = dataclasses.replace(ZERO3, precision="fp8")
    got = config(sharded_plan(dp=4), options)
    assert got["model"] == {"converters": ["quantize.linear.float8"]}
    assert got["quantize"] == {"linear": {"float8": {"recipe_name": "tensorwise"}}}
    assert got["training"]["mixed_precision_param"] == "bfloat16"
    assert got["training"]["mixed_precision_reduce"] == "float32"


def test_fp32_fsdp_keeps_fp32_parameters():
    options = TrainingOptions(zero_stage=3)
    got = config(sharded_plan(dp=2), options)["training"]
    assert (got["mixed_precision_param"], got["mixed_precision_reduce"]) == (
        "float32",
        "float32",
    )


def test_ddp_alone_is_unchanged():
    """Unsharded replicas alone stay DDP in fp32, without FSDP's keys."""
    par = config(sharded_plan(dp=4), TrainingOptions())["parallelism"]
    assert par == {
        "data_parallel_replicate_degree": 4,
        "data_parallel_shard_degree": 1,
        "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
    }


def test_an_unknown_length_names_what_it_must_divide():
    text = to_torchtitan(sharded_plan(tp=2, dp=2, cp=2), ZERO3)
    assert "seq_len =" not in text
    assert "a multiple of tp x 2 cp = 8;" in text


@pytest.mark.parametrize(
    "tp, dp, cp, dp_shard",
    [
        (t, d, c, s)
        for t, d, c in itertools.product((1, 2, 8), (1, 2, 4, 8), (1, 2, 4))
        for s in (None, 1, 2)
        if d * c > 1 and (s is None or d % s == 0) and (s or d) * c > 1
    ],
)
def test_the_degrees_multiply_to_the_plans_gpus(tp, dp, cp, dp_shard):
    plan = sharded_plan(tp=tp, dp=dp, cp=cp, dp_shard=dp_shard)
    par = config(plan, seq_length=2 * tp * cp * 64)["parallelism"]
    assert world(par) == plan.num_gpus == tp * dp * cp
    layout = plan.layout
    assert par["data_parallel_shard_degree"] == layout.shard_replicas
    assert par["data_parallel_replicate_degree"] == layout.dp_replicate
    shard_group = par["data_parallel_shard_degree"] * par.get(
        "context_parallel_degree", 1
    )
    assert shard_group == layout.shard_group  # torchtitan's fsdp mesh


# ----------------------------------------------------------------- refused
REFUSED = [
    (
        "fsdp with pipeline stages",
        sharded_plan(pp=2, dp=4),
        ZERO3,
        8192,
        "pipeline stages run FSDP without gradient sync or resharding between "
        "micro-batches",
    ),
    (
        "cp without zero_stage 3",
        sharded_plan(cp=2),
        TrainingOptions(),
        8192,
        "always shards the model state over context-parallel GPUs",
    ),
    (
        "unsharded replicas beside TP",
        sharded_plan(tp=2, dp=2),
        TrainingOptions(sequence_parallel=True, zero_stage=1),
        8192,
        "only as FSDP/HSDP",
    ),
    (
        "ZeRO-2 over replicas alone",
        sharded_plan(dp=4),
        TrainingOptions(zero_stage=2),
        8192,
        "shards optimizer state only with FSDP",
    ),
    (
        "ZeRO-3 over single-GPU shard groups",
        sharded_plan(dp=4, dp_shard=1),
        TrainingOptions(zero_stage=3),
        8192,
        "in shard groups of 1 GPU(s)",
    ),
    (
        "a length CP cannot balance",
        sharded_plan(dp=2, cp=4),
        ZERO3,
        8196,
        "seq_len to be a multiple of tp x 2 cp = 8",
    ),
    (
        "an odd length (sequence parallelism's divisor is 2 even at cp 1)",
        sharded_plan(dp=2),
        ZERO3,
        2049,
        "multiple of tp x 2 cp = 2",
    ),
    (
        "cp without flash attention",
        sharded_plan(cp=2),
        dataclasses.replace(ZERO3, flash_attention=False),
        8192,
        "context parallelism runs SDPA's fused kernels only",
    ),
    (
        "bf16 gradient reduction",
        sharded_plan(dp=2),
        dataclasses.replace(ZERO3, grad_reduce_in_bf16=True),
        8192,
        "mixed_precision_reduce",
    ),
    (
        "fp16",
        sharded_plan(dp=2),
        dataclasses.replace(ZERO3, precision="fp16"),
        8192,
        "has no fp16 training",
    ),
    (
        "bf16 without FSDP",
        sharded_plan(dp=2),
        TrainingOptions("bf16"),
        8192,
        "for plans with zero_stage 3",
    ),
    (
        "per-op recomputation of float8 linears",
        sharded_plan(dp=2),
        dataclasses.replace(
            ZERO3,
            precision="fp8",
            recompute="selective",
            recompute_modules=(TORCHTITAN_OP,),
        ),
        8192,
        "run aten._scaled_mm, which the policy recomputes",
    ),
    (
        "fp8 without FSDP",
        sharded_plan(tp=2),
        TrainingOptions("fp8", sequence_parallel=True),
        8192,
        "float8 linears over FSDP's bf16 mixed precision",
    ),
]


@pytest.mark.parametrize(
    "plan, options, length, reason",
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_refusals_say_what_torchtitan_cannot_do(plan, options, length, reason):
    with pytest.raises(ExportRefused) as refused:
        export_plan(plan, "torchtitan", options=options, seq_length=length)
    message = str(refused.value)
    assert message.startswith("cannot export this plan to torchtitan: torchtitan")
    assert reason in message and "\n" not in message


def test_zero_stage_3_at_one_replica_shards_nothing():
    """One replica without CP: a shard group of one GPU, the plain export
    (FSDP is off in torchtitan there, as nothing is sharded)."""
    plan = sharded_plan(tp=2, pp=2, steps=4)
    options = TrainingOptions(zero_stage=3, sequence_parallel=True)
    plain = TrainingOptions(sequence_parallel=True)
    assert to_torchtitan(plan, options) == to_torchtitan(plan, plain)


def test_the_rank_comment_counts_the_context_parallel_gpus():
    """Several GPU types: each replica's block is its ``tp x cp`` GPUs."""
    plan = sharded_plan(tp=2, dp=2, cp=2)
    stage = plan.stages[0]
    other = dataclasses.replace(stage.replicas[1], gpu_type="C-40")
    mixed = plan.replace(
        stages=(dataclasses.replace(stage, replicas=(stage.replicas[0], other)),)
    )
    text = to_torchtitan(mixed, ZERO3, 8192)
    assert "#   ranks 0-3: B-80 (stage 0)" in text
    assert "#   ranks 4-7: C-40 (stage 0)" in text
