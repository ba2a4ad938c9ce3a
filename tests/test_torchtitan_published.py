"""torchtitan jobs predicted: the published runs' job files, the shipped
constants refitted, and what a job maps to."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import run_cli

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.placement import sequence_shares
from pipedejavu.costmodel.analytical.torchtitan_constants import (
    TORCHTITAN_ANALYTICAL,
    TORCHTITAN_FITTED,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.torchtitan_job import parse_torchtitan_job
from pipedejavu.planning.torchtitan_launch import (
    plan_from_torchtitan_job,
    predict_torchtitan_job,
)
from pipedejavu.planning.torchtitan_published import (
    fit_torchtitan_constants,
    load_torchtitan_runs,
    predict_runs,
)

SHEET = load_gpu_sheet()
RUNS = load_torchtitan_runs()


def test_the_runs_read_as_published():
    assert len(RUNS) == 7
    by_id = {run.run_id.split("_8gpu_")[1]: run for run in RUNS}
    job = by_id["fsdp2_cp4_seq128k"].job
    assert (job.seq_len, job.cp, job.dp_shard, job.float8, job.compile) == (
        131072,
        4,
        2,
        True,
        True,
    )
    assert job.activation_checkpoint == "full"
    assert by_id["fsdp"].job.selective_ac_option == "op"


def test_shipped_constants_are_the_fit():
    fitted = fit_torchtitan_constants(RUNS, SHEET)
    for name, value in TORCHTITAN_FITTED.items():
        assert getattr(fitted, name) == pytest.approx(value, abs=2e-4)
    assert (
        TORCHTITAN_ANALYTICAL.attention_efficiency
        == TORCHTITAN_FITTED["attention_efficiency"]
    )


def test_fitted_predictions_within_the_reported_band():
    # fitted on all seven: every run within 25% (docs/torchtitan.md reports
    # the leave-one-out errors, larger)
    for run, (tokens, _) in zip(
        RUNS, predict_runs(RUNS, TORCHTITAN_ANALYTICAL, SHEET), strict=True
    ):
        assert abs(tokens / run.tokens_per_s_per_gpu - 1) < 0.25, run.run_id


def _job(text: str):
    return parse_torchtitan_job(text, "job.toml")


V02 = """
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 2
seq_len = 8192
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
tensor_parallel_degree = 2
context_parallel_degree = 2
[activation_checkpoint]
mode = "full"
"""


def test_hsdp_tp_cp_job_layout_and_options():
    plan, options, degrees = plan_from_torchtitan_job(_job(V02), "H100-SXM", 32, 8)
    assert (degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp) == (
        2,
        4,
        2,
        2,
    )
    # the mesh: 8 replicas of TP 2 x CP 2, shard groups of 4, 2 of them
    layout = plan.layout
    assert (plan.dp, layout.cp, layout.dp_shard, layout.dp_replicate) == (8, 2, 4, 2)
    assert plan.num_gpus == 32 and plan.gbs == 2 * 8  # local x dp sequences
    # priced as sequence shares: 16 replicas of TP 2, shard groups of 4 x 2
    shares = sequence_shares(plan, 8)
    assert shares.dp == 16 and shares.layout.shard_replicas == 8
    assert shares.layout.cp == 1 and shares.gbs == 2 * plan.gbs
    assert options.zero_stage == 3 and options.sequence_parallel
    assert options.recompute == "full" and options.precision == "bf16"
    assert options.reshard_after_forward


def test_prediction_counts_whole_sequences():
    job = _job(V02)
    predicted = predict_torchtitan_job(job, "H100-SXM", 32, SHEET)
    seconds = predicted.launch.prediction.iteration_time_s
    assert predicted.tokens_per_s_per_gpu == pytest.approx(16 * 8192 / seconds / 32)
    assert "cp 2" in predicted.launch.plan.describe()
    assert any("compile" in note for note in predicted.notes)


def test_refusals_name_the_file():
    with pytest.raises(ProblemError, match="job.toml: .*memory_budget"):
        plan_from_torchtitan_job(
            _job(
                V02.replace('mode = "full"', 'mode = "memory_budget"').replace(
                    "[training]",
                    '[compile]\nenable = true\ncomponents = ["model"]\n[training]',
                )
            ),
            "H100-SXM",
            32,
            8,
        )
    with pytest.raises(ProblemError, match="not the 24 GPUs"):
        plan_from_torchtitan_job(
            _job(
                V02.replace(
                    "data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4"
                )
            ),
            "H100-SXM",
            24,
            8,
        )


def test_pipeline_split_counts_embedding_and_head():
    text = V02.replace("context_parallel_degree = 2", "pipeline_parallel_degree = 2")
    text = text.replace(
        "[parallelism]", "[parallelism]\npipeline_parallel_microbatch_size = 1"
    )
    plan, options, _ = plan_from_torchtitan_job(_job(text), "H100-SXM", 16, 8)
    # 32 blocks + embedding + head = 34 units over 2 stages: 16 and 16 blocks
    assert [s.num_layers for s in plan.stages] == [17, 17]
    assert not options.reshard_after_forward  # FSDP's default with PP
    assert dataclasses.replace(options, reshard_after_forward=True).zero_stage == 3


# ------------------------------------------------------------------- CLI
FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"


def test_cli_predicts_a_job_file(capsys):
    job = FIXTURES / "published_fsdp4_cp2.toml"
    code, out, err = run_cli(
        capsys, "predict", "--torchtitan-config", job, "--gpus", "H100-96GB-500W:8"
    )
    assert code == 0 and "dp_shard 4, cp 2" in out and "tokens/s per GPU" in out
    assert "the peak GPU (stage 0) in GB: parameters" in out
    assert "ignored (no effect on the prediction)" in err
    code, out, _ = run_cli(
        capsys,
        "predict",
        "--torchtitan-config",
        job,
        "--gpus",
        "H100-96GB-500W:8",
        "--json",
    )
    data = json.loads(out)
    terms = data["memory_terms"]["terms"]
    assert sum(terms.values()) == pytest.approx(data["peak_memory_bytes"])
    assert set(terms) == {
        "parameters",
        "gradients",
        "optimizer",
        "communication_buffers",
        "activations",
        "reserve",
    }
    run = next(r for r in RUNS if r.run_id.endswith("fsdp4_cp2_seq64k"))
    ((tokens, _),) = predict_runs([run], TORCHTITAN_ANALYTICAL, SHEET)
    assert data["tokens_per_s_per_gpu"] == pytest.approx(tokens)
    assert data["degrees"]["cp"] == 2 and data["options"]["zero_stage"] == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--gpus", "H100:16"), "not the 16 GPUs"),
        (("--gpus", "H100:8", "--model", "Llama-3-8B"), "give no PLAN.json, --model"),
        ((), "needs --gpus"),
    ],
)
def test_cli_refusals(capsys, extra, message):
    job = FIXTURES / "published_fsdp4_cp2.toml"  # dp_shard 4 x cp 2: 8 GPUs
    code, _, err = run_cli(capsys, "predict", "--torchtitan-config", job, *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) <= 2


def test_torchtitan_loss_holds_its_logits_copies():
    """torchtitan's loss keeps the bf16 logits and their fp32 copy beside the
    fp32 log-softmax at its peak: 6 more bytes per logit on the head."""
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.costmodel.analytical.roofline import HALF_PRECISION_ANALYTICAL
    from pipedejavu.costmodel.analytical.source import AnalyticalSource

    spec = RUNS[0].job.spec
    options = TrainingOptions("bf16")
    plain = AnalyticalSource(spec, SHEET, options, constants=HALF_PRECISION_ANALYTICAL)
    titan = AnalyticalSource(spec, SHEET, options, constants=TORCHTITAN_ANALYTICAL)
    a, b = (s.model_info(spec.name).act_mem[2] for s in (plain, titan))
    logits = spec.seq_length * spec.padded_vocab_size(2) / 2
    assert (b - a)[-1] * 2 == pytest.approx(6 * logits)  # bf16 elements of 2 B
    assert (b - a)[:-1].tolist() == [0.0] * (len(a) - 1)


def test_eager_blocks_move_their_unfused_elementwise_bytes():
    """An eager Llama block: two norms (+32 B an element forward, +68
    backward), the rotary embedding of 32 query and 8 key heads (+16 each
    way), SwiGLU (+4 / +6 an element of the MLP's width), counted by hand."""
    from pipedejavu.costmodel.analytical.ops import (
        MemoryOp,
        PassOptions,
        block_backward_ops,
        block_forward_ops,
    )

    spec = RUNS[0].job.spec  # Llama 3.1 8B at 8,192 tokens
    tokens, h, d, f = 8192, 4096, 128, 14336

    def extra(ops):
        return sum(op.bytes for op in ops if isinstance(op, MemoryOp)
                   and op.name.startswith("eager_elementwise"))  # fmt: skip

    eager = PassOptions(1, 1, "bf16", eager=True)
    forward = 2 * tokens * h * 32 + tokens * d * 40 * 16 + tokens * f * 4
    backward = 2 * tokens * h * 68 + tokens * d * 40 * 16 + tokens * f * 6
    assert extra(block_forward_ops(spec, eager)) == pytest.approx(forward)
    assert extra(block_backward_ops(spec, eager)) == pytest.approx(backward)
    assert extra(block_forward_ops(spec, PassOptions(1, 1, "bf16"))) == 0
    # the published eager run is slower than the compiled one, as measured
    eager_run, compiled_run = RUNS[0], RUNS[1]
    (slow, _), (fast, _) = predict_runs(
        [eager_run, compiled_run], TORCHTITAN_ANALYTICAL, SHEET
    )
    assert not eager_run.job.compile and compiled_run.job.compile
    assert 1.0 < fast / slow < 1.3


def test_tp_without_fsdp_trains_fp32_as_torchtitan_does():
    """torchtitan's maybe_enable_amp autocasts only DDP or one device: TP or PP
    without FSDP trains in fp32, whatever mixed_precision_param says."""
    text = V02.replace("data_parallel_replicate_degree = 2", "")
    text = text.replace(
        "data_parallel_shard_degree = -1", "data_parallel_shard_degree = 1"
    )
    text = text.replace("context_parallel_degree = 2", "")
    plan, options, degrees = plan_from_torchtitan_job(_job(text), "H100-SXM", 2, 8)
    assert (degrees.tp, degrees.fsdp) == (2, 1)
    assert options.precision == "fp32" and options.zero_stage == 0
