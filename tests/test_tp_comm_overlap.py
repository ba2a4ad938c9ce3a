"""Megatron-LM's --tp-comm-overlap: each block's sequence-parallel all-gathers
and reduce-scatters run beside the GEMM they feed or follow, pipelined in TP
chunks; a collective costs what outlasts its GEMM, never less than one chunk.
Checked against that closed form, op by op, through the launch flags, the
exports and the knob search."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.edge_ops import (
    head_forward_ops,
)
from pipedejavu.costmodel.analytical.layers import (
    analytical_layer_times,
    weight_gradient_seconds,
)
from pipedejavu.costmodel.analytical.ops import (
    Collective,
    Gemm,
    PassOptions,
    block_backward_ops,
    block_forward_ops,
)
from pipedejavu.costmodel.analytical.roofline import (
    HALF_PRECISION_ANALYTICAL,
    pass_seconds,
)
from pipedejavu.io.exports import export_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.planning.knob_space import KnobSpace
from pipedejavu.planning.megatron_launch import predict_megatron_run

#: no per-kernel overhead, so that a pass is exactly the sum of its parts
C = dataclasses.replace(HALF_PRECISION_ANALYTICAL, kernel_overhead_s=0.0)
GPU = GpuSheetEntry("X", 80e9, 2e12, (("bf16", 300e12),), 8, 100e9, 50e9)
SPEC = TransformerSpec(
    "gpt", 4, 4096, 32, 32, 16384, 32768, 2048, max_position_embeddings=2048
)
LAUNCH = (
    "--num-layers 8 --hidden-size 4096 --num-attention-heads 32 "
    "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 32768 "
    "--micro-batch-size 1 --global-batch-size 64 --bf16 "
    "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2"
)


def _seconds(op):
    return pass_seconds([op], GPU, C)


@pytest.mark.parametrize("tokens", [256, 8192])  # collective longer / shorter
@pytest.mark.parametrize("chunks", [2, 8])
def test_a_collective_beside_a_gemm_costs_what_outlasts_it(tokens, chunks):
    gemm = Gemm("g", 1, tokens, 4096, 4096, 2, 2, "bf16")
    alone = Collective("all_gather.g", 64e6, 56e6)
    beside = alone._replace(beside="g", chunks=chunks)
    g, c = _seconds(gemm), _seconds(alone)
    expected = g + max(c - g, c / chunks)
    assert pass_seconds([gemm, beside], GPU, C) == pytest.approx(expected, rel=1e-12)
    assert pass_seconds([gemm, alone], GPU, C) == pytest.approx(g + c, rel=1e-12)
    # beside a GEMM the pass lacks (a zero-bubble W pass took it): exposed
    other = beside._replace(beside="elsewhere")
    assert pass_seconds([gemm, other], GPU, C) == pytest.approx(g + c, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 8])
def test_each_block_collective_runs_beside_its_gemm(tp):
    opts = PassOptions(1, tp, "bf16", sequence_parallel=True, tp_comm_overlap=True)
    plain = dataclasses.replace(opts, tp_comm_overlap=False)
    for build in (block_forward_ops, block_backward_ops):
        ops = build(SPEC, opts)
        gemms = {op.name: op for op in ops if isinstance(op, Gemm)}
        collectives = [op for op in ops if isinstance(op, Collective)]
        assert len(collectives) == 4
        assert all(c.beside in gemms and c.chunks == tp for c in collectives)
        # the same operations otherwise; each collective's saving as its rule
        assert [
            op._replace(beside="", chunks=1) if isinstance(op, Collective) else op
            for op in ops
        ] == build(SPEC, plain)
        saved = sum(
            _seconds(c._replace(beside="", chunks=1))
            - max(
                _seconds(c._replace(beside="", chunks=1)) - _seconds(gemms[c.beside]),
                _seconds(c._replace(beside="", chunks=1)) / tp,
            )
            for c in collectives
        )
        assert saved > 0
        assert pass_seconds(ops, GPU, C) == pytest.approx(
            pass_seconds(build(SPEC, plain), GPU, C) - saved, rel=1e-12
        )
    # the LM head is not a Transformer Engine layer: its collectives stay exposed
    head = head_forward_ops(SPEC, opts)
    assert all(not op.beside for op in head if isinstance(op, Collective))


def test_overlap_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="sequence_parallel"):
        PassOptions(1, 2, "bf16", tp_comm_overlap=True)
    with pytest.raises(ValueError, match="sequence_parallel"):
        TrainingOptions("bf16", tp_comm_overlap=True)


def test_layer_times_with_overlap_are_faster_and_split_into_b_and_w():
    args = (SPEC, GPU, 1, 4, "bf16")
    kw = dict(sequence_parallel=True, constants=C)
    forward, backward, _ = analytical_layer_times(*args, **kw)
    f_over, b_over, _ = analytical_layer_times(*args, tp_comm_overlap=True, **kw)
    assert (f_over[1:-1] < forward[1:-1]).all() and (
        b_over[1:-1] < backward[1:-1]
    ).all()
    # the embedding and the head keep their exposed collectives
    assert f_over[0] == forward[0] and f_over[-1] == forward[-1]
    # the weight-gradient pass holds no collective: unchanged by the overlap
    weight = weight_gradient_seconds(*args, **kw)
    assert (weight_gradient_seconds(*args, tp_comm_overlap=True, **kw) == weight).all()


def test_launch_flag_read_refused_and_priced():
    sheet = load_gpu_sheet()
    with pytest.raises(ProblemError, match="needs --sequence-parallel"):
        spec_from_megatron_args(LAUNCH + " --tp-comm-overlap")
    one = LAUNCH.replace(
        "--tensor-model-parallel-size 4", "--tensor-model-parallel-size 1"
    )
    with pytest.raises(ProblemError, match="turns off at TP 1"):
        spec_from_megatron_args(one + " --sequence-parallel --tp-comm-overlap")
    plain = spec_from_megatron_args(LAUNCH + " --sequence-parallel")
    overlap = spec_from_megatron_args(LAUNCH + " --sequence-parallel --tp-comm-overlap")
    assert overlap.tp_comm_overlap and not plain.tp_comm_overlap
    assert "--tp-comm-overlap" not in " ".join(overlap.ignored)
    fast = predict_megatron_run(overlap, "H100-SXM", 16, sheet)
    slow = predict_megatron_run(plain, "H100-SXM", 16, sheet)
    assert fast.options.tp_comm_overlap
    assert fast.prediction.iteration_time_s < slow.prediction.iteration_time_s
    # memory is the same: the overlap moves no tensor
    assert fast.prediction.peak_memory_bytes == slow.prediction.peak_memory_bytes


def test_megatron_export_writes_the_flag_except_at_tp1():
    sheet = load_gpu_sheet()
    run = spec_from_megatron_args(LAUNCH + " --sequence-parallel --tp-comm-overlap")
    launch = predict_megatron_run(run, "H100-SXM", 16, sheet)
    text = export_plan(launch.plan, "megatron", options=launch.options)
    assert "--tp-comm-overlap" in text and "--sequence-parallel" in text
    flags = text.splitlines()[-1]  # after the comment line
    model = "--hidden-size 4096 --num-attention-heads 32 --seq-length 2048 "
    model += "--max-position-embeddings 2048 --vocab-size 32768"
    back = spec_from_megatron_args(f"{flags} {model}")
    assert back.tp_comm_overlap and back.sequence_parallel
    one = LAUNCH.replace(
        "--tensor-model-parallel-size 4", "--tensor-model-parallel-size 1"
    )
    plan = predict_megatron_run(
        spec_from_megatron_args(one), "H100-SXM", 16, sheet
    ).plan
    text = export_plan(plan, "megatron", options=launch.options)
    assert "--tp-comm-overlap" not in text


def test_knob_search_keeps_overlap_only_with_sequence_parallelism():
    base = TrainingOptions("bf16", sequence_parallel=True, tp_comm_overlap=True)
    choices = KnobSpace().all_choices(base)
    assert any(c.tp_comm_overlap for c in choices)
    assert all(c.tp_comm_overlap == c.sequence_parallel for c in choices)


def test_plan_model_keeps_the_switch_and_refuses_contradictions(capsys):
    """``plan --model ... --tp-comm-overlap``: every plan searched with sequence
    parallelism keeps it (and it is exported); contradictory flags exit 2."""
    from pipedejavu.cli.main import main

    base = ["plan", "--model", "Qwen2.5-7B", "--gpus", "H100:16", "--global-batch",
            "64", "--schedule", "1f1b", "--recompute", "none",
            "--distributed-optimizer", "on", "--rank-order", "tp-dp-pp"]  # fmt: skip
    with_sp = [*base, "--sequence-parallel", "on"]
    assert main([*with_sp, "--tp-comm-overlap", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["options"]["tp_comm_overlap"] and kept["options"]["sequence_parallel"]
    assert main([*with_sp, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert not plain["options"]["tp_comm_overlap"]
    # Overlapping never costs more in the model: the optimum with it is no slower.
    assert kept["iteration_time_s"] <= plain["iteration_time_s"] * (1 + 1e-12)
    assert main([*with_sp, "--tp-comm-overlap", "--export", "megatron"]) == 0
    out = capsys.readouterr().out
    tp = int(out.split("--tensor-model-parallel-size ")[1].split()[0])
    assert ("--tp-comm-overlap" in out) == (tp > 1)
    for argv, reason in (
        ([*base, "--sequence-parallel", "off", "--tp-comm-overlap"],
         "--tp-comm-overlap needs --sequence-parallel"),
        ([*with_sp, "--tp-comm-overlap", "--export", "deepspeed"],
         "does not launch --tp-comm-overlap"),
        ([*base, "--overlap-param-gather", "--distributed-optimizer", "off"],
         "--overlap-param-gather needs --distributed-optimizer"),
        ([*base, "--grad-reduce-in-bf16", "--precision", "fp16"],
         "--grad-reduce-in-bf16"),
    ):  # fmt: skip
        assert main(argv) == 2
        assert reason in capsys.readouterr().err
