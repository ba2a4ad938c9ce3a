"""Context parallelism in a Megatron-LM launch: each of CP GPUs trains on
1/CP of every sequence and attends to the whole sequence's keys and values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.placement import sequence_shares
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.ops import (
    Gemm,
    PassOptions,
    block_backward_ops,
    block_forward_ops,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.megatron_launch import predict_megatron_run

LLAMA = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --vocab-size 128256 --seq-length 8192 "
    "--micro-batch-size 1 --global-batch-size 128 --bf16 --use-distributed-optimizer "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
)


def _flops(ops) -> float:
    return sum(op.flops for op in ops if isinstance(op, Gemm))


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("ops", [block_forward_ops, block_backward_ops])
def test_a_share_computes_one_cp_th_of_the_block(cp, ops):
    """The GEMM FLOPs of a GPU's share (s / CP tokens whose queries meet all s
    keys) are exactly 1 / CP of the whole sequence's: the linear layers scale
    with the tokens, the causal attention with s^2."""
    spec = load_model_spec("Llama-3-8B")
    share = dataclasses.replace(spec, seq_length=spec.seq_length // cp)
    whole = _flops(ops(spec, PassOptions(1, 2)))
    part = _flops(ops(share, PassOptions(1, 2, context_parallel=cp)))
    assert part * cp == pytest.approx(whole, rel=1e-12)
    # without the whole sequence's keys the attention would be cp x too cheap
    alone = _flops(ops(share, PassOptions(1, 2)))
    assert alone * cp < whole


def test_context_parallel_launch_is_priced_on_sequence_shares():
    sheet = load_gpu_sheet()
    plain = predict_megatron_run(spec_from_megatron_args(LLAMA), "H100", 32, sheet)
    run = spec_from_megatron_args(LLAMA + " --context-parallel-size 2")
    assert run.context_parallel == 2
    shared = predict_megatron_run(run, "H100", 64, sheet)
    # the same model FLOPs (the whole sequences), on twice the GPUs
    assert shared.model_flops_per_iteration == plain.model_flops_per_iteration
    assert shared.num_gpus == 64 and shared.context_parallel == 2
    assert shared.plan.dp == plain.plan.dp and shared.plan.layout.cp == 2
    assert shared.plan.gbs == plain.plan.gbs == 128
    # priced as sequence shares: twice the replicas, each on half of a sample
    shares = sequence_shares(shared.plan, 8)
    assert shares.dp == 2 * plain.plan.dp and shares.gbs == 2 * 128
    assert shares.num_microbatches == plain.plan.num_microbatches
    # half the tokens a GPU: faster, and fewer activations held
    assert shared.prediction.iteration_time_s < plain.prediction.iteration_time_s
    assert shared.prediction.peak_memory_bytes < plain.prediction.peak_memory_bytes
    assert shared.to_json()["context_parallel"] == 2


@pytest.mark.parametrize(
    ("extra", "gpus", "message"),
    [
        (" --context-parallel-size 3", 48, "divisible by 2 x --context-parallel"),
        (
            " --context-parallel-size 2 --attention-backend unfused",
            64,
            "fused attention",
        ),
        (" --context-parallel-size 2", 36, "TP x CP x PP"),
    ],
)
def test_context_parallel_refusals(extra, gpus, message, capsys):
    argv = ["predict", "--megatron-args", LLAMA + extra, "--gpus", f"H100:{gpus}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_plan_refuses_context_parallel_and_predict_reports_it(capsys):
    launch = LLAMA + " --context-parallel-size 2"
    assert main(["plan", "--megatron-args", launch, "--gpus", "H100:64"]) == 2
    assert "context parallelism" in capsys.readouterr().err
    assert main(["predict", "--megatron-args", launch, "--gpus", "H100:64"]) == 0
    assert "context parallelism 2" in capsys.readouterr().out
    assert (
        main(["predict", "--megatron-args", launch, "--gpus", "H100:64", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["context_parallel"] == 2
    with pytest.raises(ProblemError, match="divisible"):
        spec_from_megatron_args(
            LLAMA.replace("8192", "8190") + " --context-parallel-size 2"
        )
