"""``--recompute-modules`` read as Megatron-LM reads it
(io.megatron_recompute): the modules a launch gives, refused in one line as
Megatron-LM refuses them (fuzzed), exported and read back, priced end to end;
the published MoE runs read with their modules (planning.moe_published)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.training_options import RECOMPUTE_MODULES
from pipedejavu.io.exports import export_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_command import split_command
from pipedejavu.planning.megatron_launch import options_of_run, predict_megatron_run
from pipedejavu.planning.moe_published import launch_of_moe_run
from pipedejavu.planning.published_runs import (
    bundled_moe_published_path,
    load_moe_published_runs,
)

SHEET = load_gpu_sheet()
GPU = "H100-SXM"

BASE = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--micro-batch-size 1 --global-batch-size 16 --vocab-size 32000 --bf16 "
    "--position-embedding-type rope --swiglu --disable-bias-linear "
)
MOE_ARGS = (
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 "
    "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
)


def test_launch_flags_give_the_modules():
    run = spec_from_megatron_args(
        BASE + MOE_ARGS + "--moe-grouped-gemm --recompute-granularity selective "
        "--recompute-modules moe_act layernorm moe_act"
    )
    assert run.recompute_modules == ("moe_act", "layernorm")
    assert options_of_run(run).selective_modules == ("moe_act", "layernorm")
    default = spec_from_megatron_args(BASE + "--recompute-activations")
    assert default.recompute_modules == ("core_attn",)
    layer = spec_from_megatron_args(BASE + MOE_ARGS + "--moe-layer-recompute")
    assert layer.recompute_granularity == "selective"
    assert layer.recompute_modules == ("core_attn", "moe")
    for granularity in ("", "--recompute-granularity full --recompute-method "):
        words = granularity + ("block --recompute-num-layers 1 " if granularity else "")
        unread = spec_from_megatron_args(BASE + words + "--recompute-modules mlp")
        assert any("--recompute-modules mlp" in w for w in unread.ignored)
        assert unread.recompute_modules == ("core_attn",)
    # fewer bytes kept, more time: the experts' activations rerun
    times = {}
    for modules in ("core_attn", "core_attn moe_act layernorm"):
        launch = spec_from_megatron_args(
            BASE + MOE_ARGS + "--moe-grouped-gemm --recompute-granularity selective "
            f"--recompute-modules {modules}"
        )
        prediction = predict_megatron_run(launch, GPU, 2, SHEET).prediction
        times[modules] = (prediction.iteration_time_s, prediction.peak_memory_bytes)
    (t_core, m_core), (t_moe, m_moe) = times.values()
    assert t_moe > t_core and m_moe < m_core


@pytest.mark.parametrize(
    "words, message",
    [
        ("--recompute-modules attn", "'attn' is not one of Megatron-Core's modules"),
        ("--recompute-modules moe_act", "moe_act needs --moe-grouped-gemm"),
        ("--recompute-modules mla_up_proj", "needs --multi-latent-attention"),
        (
            MOE_ARGS + "--moe-shared-expert-intermediate-size 256 "
            "--moe-shared-expert-overlap --recompute-modules shared_experts",
            "shared_experts cannot run with --moe-shared-expert-overlap",
        ),
        (
            "--fp8-format hybrid --recompute-modules layernorm",
            "layernorm with FP8 needs an --fp8-recipe other than delayed",
        ),
    ],
)
def test_megatron_refusals_are_one_line(words, message):
    with pytest.raises(ProblemError, match=message) as refused:
        spec_from_megatron_args(BASE + "--recompute-granularity selective " + words)
    assert "\n" not in str(refused.value)
    fine = "--fp8-recipe tensorwise " if "fp8" in words else "--moe-grouped-gemm "
    if "moe_act" in words or "layernorm" in words:  # what Megatron accepts
        spec_from_megatron_args(BASE + "--recompute-activations " + fine + words)
    with pytest.raises(ProblemError, match="contradicts --recompute-granularity full"):
        spec_from_megatron_args(
            BASE + MOE_ARGS + "--moe-layer-recompute --recompute-granularity full "
            "--recompute-method uniform --recompute-num-layers 1"
        )


WORDS = st.lists(
    st.sampled_from([*RECOMPUTE_MODULES, "attn", "", "moe_act,mlp", "-1"]),
    max_size=4,
)
FLAGS = st.lists(
    st.sampled_from(
        [
            "--recompute-granularity selective",
            "--recompute-granularity full",
            "--recompute-activations",
            "--recompute-method block",
            "--recompute-num-layers 1",
            "--moe-layer-recompute",
            "--moe-grouped-gemm",
            "--multi-latent-attention",
            "--moe-shared-expert-overlap",
            "--fp8-format hybrid",
            "--fp8-recipe tensorwise",
            MOE_ARGS,
        ]
    ),
    max_size=5,
)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(flags=FLAGS, words=WORDS, at_end=st.booleans())
def test_recompute_flags_give_a_run_or_one_line(flags, words, at_end):
    modules = "--recompute-modules " + " ".join(words)
    text = " ".join(flags)
    args = BASE + (f"{text} {modules}" if at_end else f"{modules} {text}")
    try:
        run = spec_from_megatron_args(args)
    except ProblemError as refused:
        assert "\n" not in str(refused)
        return
    assert set(run.recompute_modules) <= set(RECOMPUTE_MODULES)
    options = options_of_run(run)
    assert options.selective_modules == (
        run.recompute_modules if run.recompute_granularity == "selective" else ()
    )


def _published(run_id: str):
    path = bundled_moe_published_path()
    records = json.loads(path.read_text())["runs"]
    for run, record in zip(load_moe_published_runs(str(path)), records, strict=True):
        if run.run_id == run_id:
            return run, record
    raise AssertionError(run_id)


def test_published_runs_are_read_with_their_modules():
    run, record = _published("modelzoo_qwen3_235b_h100_cross_node_ep32_deepep")
    assert record["parallelism"]["recompute"].startswith("selective: layernorm")
    launch, notes = launch_of_moe_run(run, record)
    assert launch.recompute_granularity == "selective"
    assert launch.recompute_modules == ("moe_act", "layernorm")
    assert not any("recomput" in note for note in notes)
    listed = dict(record, parallelism=dict(record["parallelism"], recompute=None))
    listed["parallelism"]["recompute_granularity"] = "selective"
    listed["parallelism"]["recompute_modules"] = ["moe"]
    assert launch_of_moe_run(run, listed)[0].recompute_modules == ("moe",)
    listed["parallelism"]["recompute_modules"] = ["norm"]
    with pytest.raises(ProblemError, match="recompute module 'norm' not understood"):
        launch_of_moe_run(run, listed)
    # the router's CUDA graph with DeepEP: Megatron-Core keeps the pre-MLP norm
    run, record = _published("modelzoo_qwen3_235b_h100_run_h100_235b_sh_320tflops")
    launch, notes = launch_of_moe_run(run, record)
    assert launch.recompute_modules == ("moe_act",)
    assert any("layernorm not recomputed" in note for note in notes)


def test_modules_are_exported_and_read_back():
    """The Megatron-LM export writes the plan's modules in place of the
    user's, and the command reads back with them."""
    user = (
        BASE + MOE_ARGS + "--moe-grouped-gemm --recompute-granularity selective "
        "--recompute-modules layernorm --moe-layer-recompute"
    )
    run = spec_from_megatron_args(user)
    assert run.recompute_modules == ("layernorm", "moe")
    launch = predict_megatron_run(run, GPU, 2, SHEET)
    for modules in (("moe_act", "moe"), ("core_attn",)):
        options = dataclasses.replace(launch.options, recompute_modules=modules)
        text = export_plan(
            launch.plan, "megatron", spec=run.spec, options=options, megatron_args=user
        )
        words = split_command(text)
        assert "--moe-layer-recompute" not in words
        again = spec_from_megatron_args(words)
        assert again.recompute_granularity == "selective"
        assert options_of_run(again).recompute_modules == modules
