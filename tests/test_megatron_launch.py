"""Any model on any GPU: a Megatron-LM launch predicted from its flags."""

import json
import time

import numpy as np
import pytest
from helpers import fixture_fuzz
from hypothesis import given
from hypothesis import strategies as st

from pipedejavu.cli.main import main
from pipedejavu.core.layout import MAX_GPUS
from pipedejavu.core.plan3d import MAX_SEARCH_GPUS
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.exports import option_flags
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.io.sailor_plan import load_plan3d
from pipedejavu.planning.megatron_launch import (
    options_of_run,
    plan_from_megatron_run,
    predict_megatron_run,
)

# SC'21 Table 1's 39B run (Megatron-LM examples/sc21): 512 A100-80, TP 8, PP 2.
SC21_39B = (
    "--num-layers 48 --hidden-size 8192 --num-attention-heads 64 "
    "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200 "
    "--make-vocab-size-divisible-by 1 --micro-batch-size 2 "
    "--global-batch-size 1536 --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 2 --fp16 --checkpoint-activations"
)


def test_plan_follows_megatron_layout_and_rank_order():
    run = spec_from_megatron_args(SC21_39B)
    plan = plan_from_megatron_run(run, "A100-80", 512, 8)
    assert plan.num_stages == 2 and plan.dp == 32 and plan.mbs == 2
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 25), (25, 50)]
    # Rank tp_rank + 8 (dp_rank + 32 pp_rank), 8 GPUs a node: one replica a node,
    # stage 1 starts on node 32.
    assert [r.node for r in plan.stages[0].replicas[:3]] == [0, 1, 2]
    assert plan.stages[1].replicas[0].node == 32
    with pytest.raises(ProblemError, match="do not split into groups"):
        plan_from_megatron_run(run, "A100-80", 500, 8)


def test_sc21_run_is_priced_analytically_and_counts_megatron_flops():
    run = spec_from_megatron_args(SC21_39B)
    sheet = load_gpu_sheet()
    launch = predict_megatron_run(run, "A100-80", 512, sheet)
    assert launch.cost_source == "analytical"
    assert launch.prediction.fits_memory
    # SC'21 Eq. 3 with recomputation (hardware FLOPs, as SC'21 reports
    # TFLOP/s) and without (model FLOPs, MFU's), by hand.
    b, s, layers, h, v = 1536, 2048, 48, 8192, 51200
    flops = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    model = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    np.testing.assert_allclose(launch.hardware_flops, flops, rtol=1e-12)
    np.testing.assert_allclose(launch.model_flops_per_iteration, model, rtol=1e-12)
    seconds = launch.prediction.iteration_time_s
    np.testing.assert_allclose(
        launch.hardware_tflops_per_gpu, flops / seconds / 512 / 1e12, rtol=1e-12
    )
    np.testing.assert_allclose(
        launch.tflops_per_gpu, model / seconds / 512 / 1e12, rtol=1e-12
    )
    np.testing.assert_allclose(launch.mfu, launch.tflops_per_gpu / 312, rtol=1e-9)
    np.testing.assert_allclose(
        launch.hfu, launch.hardware_tflops_per_gpu / 312, rtol=1e-9
    )
    assert launch.mfu < launch.hfu


def test_recomputation_costs_time_and_saves_memory():
    spec = load_model_spec("Llama-3-8B")
    sheet = load_gpu_sheet()
    args = (
        "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
        "--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights "
        "--vocab-size 128256 --seq-length 8192 --micro-batch-size 1 "
        "--global-batch-size 64 --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --bf16"
    )
    plain = predict_megatron_run(spec_from_megatron_args(args), "H100", 16, sheet)
    full = predict_megatron_run(
        spec_from_megatron_args(
            args + " --recompute-granularity full "
            "--recompute-method uniform --recompute-num-layers 1"
        ),
        "H100",
        16,
        sheet,
    )
    assert full.prediction.iteration_time_s > plain.prediction.iteration_time_s
    assert (
        full.prediction.activation_bytes.max()
        < 0.5 * plain.prediction.activation_bytes.max()
    )
    # The spec from Megatron flags counts what the preset counts.
    assert spec_from_megatron_args(args).spec.num_params == pytest.approx(
        spec.num_params, rel=1e-3
    )


def test_profiles_price_what_they_cover():
    """A bundled model: its profiled GPU types come from the profiles (the
    prediction equals the profile-only predictor's), others are analytical."""
    data = load_sailor_data()
    spec = load_model_spec("OPT-350")
    source = AnalyticalSource(
        spec,
        load_gpu_sheet(),
        TrainingOptions(),
        profiles=data,
        measured_links=data.network,
    )
    assert source.source_of("GH-96", 2, 1) == "profiles"
    assert source.source_of("H100-SXM", 2, 1) == "analytical"
    profiled = data.layer_times("OPT-350", "GH-96", 2, 1, smooth=True)
    ours = source.layer_times("OPT-350", "GH-96", 2, 1)
    np.testing.assert_array_equal(ours.forward, profiled.forward)
    info, theirs = source.model_info("OPT-350"), data.model_info("OPT-350")
    for tp in (1, 2, 4):
        np.testing.assert_array_equal(info.params[tp], theirs.params[tp])


def test_predict_cli_megatron_args(capsys):
    code = main(
        [
            "predict",
            "--megatron-args",
            SC21_39B + " --lr 1e-4",
            "--gpus",
            "A100-80:512",
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    for key in (
        "iteration_time_s",
        "peak_memory_bytes",
        "fits_memory",
        "model_flops_per_iteration",
        "tflops_per_gpu",
        "mfu",
    ):
        assert np.isfinite(out[key])
    assert out["cost_source"] == "analytical"
    assert "--lr 1e-4" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--megatron-args", SC21_39B], "needs --gpus"),
        (["--megatron-args", SC21_39B, "--gpus", "X900:8"], "not on the GPU sheet"),
        (
            ["--megatron-args", SC21_39B + " --bf16", "--gpus", "A100-80:512"],
            "exclusive",
        ),
        (["--megatron-args", SC21_39B, "--gpus", "A100-80:100"], "do not split"),
        (
            ["--megatron-args", "--num-layers 2 --vocab-size 8", "--gpus", "A100-80:8"],
            "--hidden-size",
        ),
        (["--gpus", "A100-80:8"], "go with --megatron-args"),
        ([], "give PLAN.json"),
    ],
)
def test_predict_cli_bad_launches(argv, message, capsys):
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_analytical_source_drives_the_plan_predictor():
    """A Sailor plan file priced without profiles: bf16 is faster than fp32
    and holds less."""
    spec = load_model_spec("OPT-350")
    path = (
        load_sailor_data().root
        / "measured"
        / "gh200-opt350"
        / "plan_config_N16_D4.json"
    )
    plan, _ = load_plan3d(str(path), model="OPT-350")
    sheet = load_gpu_sheet()
    fp32 = predict_plan(plan, AnalyticalSource(spec, sheet))
    bf16 = predict_plan(plan, AnalyticalSource(spec, sheet, TrainingOptions("bf16")))
    assert bf16.iteration_time_s < fp32.iteration_time_s
    assert bf16.peak_memory_bytes < fp32.peak_memory_bytes


def test_distributed_optimizer_shards_the_optimizer_state():
    """fp16: 20 B a parameter without it, 4 + 16 / dp with it (Megatron-LM's
    documented numbers); each replica steps 1 / dp of the parameters."""
    from pipedejavu.costmodel.megatron.rules import stage_params

    sheet = load_gpu_sheet()
    plain_run = spec_from_megatron_args(SC21_39B)
    sharded_run = spec_from_megatron_args(SC21_39B + " --use-distributed-optimizer")
    plain = predict_megatron_run(plain_run, "A100-80", 512, sheet)
    sharded = predict_megatron_run(sharded_run, "A100-80", 512, sheet)
    dp = plain.plan.dp
    source = AnalyticalSource(plain_run.spec, sheet, plain.options)
    info = source.model_info(plain_run.spec.name)
    for s, stage in enumerate(plain.plan.stages):
        held = stage_params(info, 8, stage.start, stage.stop)
        saved = (
            plain.prediction.model_state_bytes[s, 0]
            - (sharded.prediction.model_state_bytes[s, 0])
        )
        np.testing.assert_allclose(saved, 16 * held * (1 - 1 / dp), rtol=1e-9)
    np.testing.assert_allclose(
        sharded.prediction.optimizer_s, plain.prediction.optimizer_s / dp, rtol=1e-9
    )


_SIZE_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--vocab-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
)


@fixture_fuzz(40)
@given(
    flag=st.sampled_from(_SIZE_FLAGS),
    value=st.one_of(
        st.integers(-5, 300), st.integers(-(10**15), 10**15), st.just(10**9)
    ),
)
def test_launch_numbers_are_bounded(capsys, flag, value):
    """Any number in any size flag of a small launch (the last three flags
    added to it): an answer or one line (exit 2), never a traceback, a hang or
    unbounded memory."""
    base = {
        "--num-layers": 4,
        "--hidden-size": 256,
        "--num-attention-heads": 4,
        "--ffn-hidden-size": 1024,
        "--seq-length": 128,
        "--vocab-size": 1000,
        "--micro-batch-size": 1,
        "--global-batch-size": 8,
        "--tensor-model-parallel-size": 1,
        "--pipeline-model-parallel-size": 1,
    }
    base[flag] = value
    argv = " ".join(f"{k} {v}" for k, v in base.items())
    argv += " --max-position-embeddings " + str(max(base["--seq-length"], 1))
    started = time.process_time()
    code = main(["predict", "--megatron-args", argv, "--gpus", "H100:8"])
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err
    if code:
        assert len(err.strip().splitlines()) == 1, err
    assert time.process_time() - started < 10.0


def test_predict_cli_prices_block_recomputation(capsys):
    # --checkpoint-activations recomputes every block; the block method with
    # 24 of each stage's 24 blocks is the same, with 1 it is faster and larger
    def predicted(extra):
        code = main(
            [
                "predict",
                "--megatron-args",
                SC21_39B.replace(" --checkpoint-activations", "") + extra,
                "--gpus",
                "A100-80:512",
                "--json",
            ]
        )
        assert code == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        flops.append(out["hardware_flops_per_iteration"])
        models.append(out["model_flops_per_iteration"])
        return out["iteration_time_s"], out["peak_memory_bytes"]

    flops: list[float] = []
    models: list[float] = []
    full = predicted(
        " --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1"
    )
    block = " --recompute-granularity full --recompute-method block"
    assert predicted(block + " --recompute-num-layers 24") == pytest.approx(full)
    time, memory = predicted(block + " --recompute-num-layers 1")
    none = predicted("")
    assert none[0] < time < full[0] and full[1] < memory < none[1]
    # hardware FLOPs count the reruns: all 48 blocks, all 2 x 24, 2 x 1, none;
    # the model FLOPs none of them
    assert flops[0] == flops[1] > flops[2] > flops[3]
    assert len(set(models)) == 1 and models[0] == flops[3]
    per_block = (flops[0] - flops[3]) / 48  # one block's forward, every sample
    assert flops[2] - flops[3] == pytest.approx(2 * per_block, rel=1e-12)


def test_predict_cli_takes_the_largest_clusters_plan_searches_no_more(capsys):
    """A launch on MAX_GPUS (131,072) GPUs is predicted; a search over more
    than MAX_SEARCH_GPUS (as many) is refused at once, as is a prediction
    over more than MAX_GPUS."""
    launch = (
        "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
        "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200 "
        "--micro-batch-size 1 --global-batch-size 4096 "
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --bf16"
    )
    big = MAX_GPUS
    assert (
        main(["predict", "--megatron-args", launch, "--gpus", f"H100:{big}", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["plan"].startswith("pp 4 ") and f"dp {big // 32}," in out["plan"]
    assert f":{big})" in out["plan"] and out["num_microbatches"] == 1
    assert 0 < out["mfu"] < 1
    more = f"H100:{MAX_SEARCH_GPUS + 32}"
    assert main(["plan", "--megatron-args", launch, "--gpus", more]) == 2
    assert f"[1, {MAX_SEARCH_GPUS}]" in capsys.readouterr().err
    too_many = f"H100:{MAX_GPUS + 32}"
    assert main(["predict", "--megatron-args", launch, "--gpus", too_many]) == 2
    assert f"[1, {MAX_GPUS}]" in capsys.readouterr().err


def test_fp8_is_exported_with_the_recipe_it_was_priced_with():
    """fp8 is priced with current (per-tensor) scaling's quantization: the
    export writes that recipe (Megatron-LM's default is delayed scaling), and
    the flags read back as the same options."""
    options = TrainingOptions("fp8")
    flags = option_flags(options)
    assert flags[:5] == [
        "--bf16",
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "tensorwise",
    ]
    base = SC21_39B.replace("--fp16", "")
    run = spec_from_megatron_args([*base.split(), *flags])
    assert run.precision == "fp8" and run.fp8_recipe == "tensorwise"
    assert options_of_run(run).precision == "fp8"


def test_overlap_flags_are_read_predicted_and_exported():
    """--overlap-grad-reduce/--overlap-param-gather reach the options (and
    back out through the Megatron export's flags); overlapped, a launch with
    data parallelism waits less for its gradients; Megatron-LM's own
    conditions are refused with one line."""
    base = SC21_39B.replace("--fp16", "--bf16") + " --use-distributed-optimizer"
    sheet = load_gpu_sheet()
    runs = {}
    for extra in (
        "",
        " --overlap-grad-reduce",
        " --overlap-grad-reduce --overlap-param-gather",
    ):
        run = spec_from_megatron_args(base + extra)
        options = options_of_run(run)
        again = options_of_run(
            spec_from_megatron_args([*base.split(), *option_flags(options)])
        )
        assert again == options
        runs[extra] = predict_megatron_run(run, "A100-80", 512, sheet).prediction
    times = [p.iteration_time_s for p in runs.values()]
    waits = [float(p.dp_allreduce_s.max()) for p in runs.values()]
    assert times[0] > times[1] > times[2] and waits[0] > waits[1] > waits[2] > 0
    for bad, message in (
        (" --overlap-param-gather", "needs --overlap-grad-reduce"),
        (" --overlap-grad-reduce --overlap-param-gather", "needs --use-distributed"),
    ):
        launch = (
            base.replace(" --use-distributed-optimizer", "")
            if "use-dist" in message
            else base
        )
        with pytest.raises(ProblemError, match=message):
            spec_from_megatron_args(launch + bad)


def test_bf16_gradient_buffers_halve_the_reduction_and_the_gradients():
    """--grad-reduce-in-bf16: Megatron-LM keeps and reduces the main gradients
    in bf16 (2 bytes a parameter, fp32's 4): the data-parallel reduction
    moves half the bytes, each GPU holds 2 bytes a parameter less, and the
    flag goes back out with the export's flags."""
    base = SC21_39B.replace("--fp16", "--bf16")
    sheet = load_gpu_sheet()
    plain = spec_from_megatron_args(base)
    halved = spec_from_megatron_args(base + " --grad-reduce-in-bf16")
    options = options_of_run(halved)
    assert options.grad_reduce_in_bf16 and "--grad-reduce-in-bf16" in option_flags(
        options
    )
    a = predict_megatron_run(plain, "A100-80", 512, sheet).prediction
    b = predict_megatron_run(halved, "A100-80", 512, sheet).prediction
    assert float(b.dp_allreduce_s.max()) < 0.6 * float(a.dp_allreduce_s.max())
    params = 39.1e9 / 16  # about a GPU's share: TP 8 x PP 2
    saved = a.peak_memory_bytes - b.peak_memory_bytes
    # and 2 bytes an element of the flattened all-reduce bucket (5e8 at most)
    assert 0.9 * 2 * params < saved < 1.1 * 2 * params + 2 * 5e8
    with pytest.raises(ProblemError, match="needs --bf16"):
        spec_from_megatron_args(SC21_39B + " --grad-reduce-in-bf16")


def test_an_export_that_does_not_launch_a_kept_flag_is_refused_first(capsys):
    """The gradient-sync flags the search keeps: DeepSpeed's pipeline engine
    launches none of them, so `plan --export deepspeed` refuses the launch
    before searching; Megatron-LM launches them."""
    launch = (
        SC21_39B.replace("--fp16", "--bf16")
        + " --use-distributed-optimizer --overlap-grad-reduce"
    )
    argv = ["plan", "--megatron-args", launch, "--gpus", "A100-80:512"]
    assert main([*argv, "--export", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not launch --overlap-grad-reduce" in err[0]
