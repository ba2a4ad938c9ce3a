"""Mixtures of experts exported (issue 44, item 5): the Megatron-LM command
carries the model's experts, head width and query/key norms and the plan's
expert layout, and reads back through our Megatron-LM reader as the same
model and layout; every other target refuses a plan with experts in one
line saying why. (Megatron-LM's own argument code and rank generator check
the same exports outside CI: ``benchmarks/check_moe_exports.py``.)"""

from __future__ import annotations

import dataclasses
import random
import shlex

import pytest
from helpers import decoder_spec

from pipedejavu.core.layout import ParallelLayout, StageAxes
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io import exports
from pipedejavu.io.export_megatron import moe_layer_freq_text, pipeline_layout
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import EXPORTS, export_plan, launchers
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_layout import layout_stages
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.io.megatron_pattern import moe_layer_freq
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.megatron_launch import options_of_run, plan_from_megatron_run

#: A small model as MoE models are run (no biases, rotary positions).
BASE = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 64 "
    "--vocab-size 32000 --bf16 --disable-bias-linear --position-embedding-type rope "
    "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
)
#: Launches as Megatron-LM reads them: (extra flags, GPUs).
LAUNCHES = {
    "ep inside tp": (
        "--tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 2 --num-experts 8 "
        "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1",
        16,
    ),
    "first block dense, shared experts, gate, head width, norms": (
        "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 16 "
        "--moe-router-topk 4 --moe-ffn-hidden-size 256 "
        "--moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate "
        "--moe-layer-freq ([0]*1+[1]*7) --kv-channels 128 --qk-layernorm "
        "--group-query-attention --num-query-groups 2 "
        "--expert-model-parallel-size 8",
        16,
    ),
    "every second block, expert tp = tp": (
        "--tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 2 --num-experts 4 --moe-layer-freq 2 "
        "--expert-model-parallel-size 2",
        16,
    ),
    "interleaved pattern, top-1, replicas outermost": (
        "--tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --num-experts 4 "
        "--moe-router-topk 1 --moe-router-pre-softmax --moe-layer-freq ([0]+[1])*4 "
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1",
        8,
    ),
    "tp 1, experts over the replicas": (
        "--num-experts 8 --expert-model-parallel-size 8 "
        "--pipeline-model-parallel-size 2",
        16,
    ),
}
GPU, PER_NODE = "H100-SXM", 8


def launch(name: str):
    flags, gpus = LAUNCHES[name]
    run = spec_from_megatron_args(BASE + flags)
    return run, plan_from_megatron_run(run, GPU, gpus, PER_NODE)


def command(text: str) -> list[str]:
    return shlex.split(text.splitlines()[-1])


def value(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens else None


def normalized(layout: ParallelLayout) -> tuple:
    """A layout with each stage's expert TP named (``None`` is the TP)."""
    stages = tuple((s.tp, s.ep, s.expert_tp) for s in layout.stages)
    return stages, layout.dp, layout.cp, layout.order


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_megatron_export_reads_back_as_the_model_and_the_layout(name):
    run, plan = launch(name)
    moe = MoeOptions(dispatcher="alltoall", grouped_gemm=True)
    text = export_plan(
        plan, "megatron", spec=run.spec, options=options_of_run(run), moe=moe
    )
    back = spec_from_megatron_args(command(text))
    assert back.spec == run.spec  # moe, kv_channels, qk_layernorm among them
    assert normalized(back.layout(plan.num_gpus)) == normalized(plan.layout)
    assert back.moe_options == moe
    tokens = command(text)
    axes = plan.layout.stages[0]
    assert value(tokens, "--expert-model-parallel-size") == str(axes.ep)
    assert value(tokens, "--expert-tensor-parallel-size") == str(axes.expert_tp)
    assert value(tokens, "--num-experts") == str(run.spec.moe.num_experts)
    assert value(tokens, "--moe-token-dispatcher-type") == "alltoall"
    assert "--moe-grouped-gemm" in tokens
    assert "--moe-router-force-load-balancing" not in tokens
    assert ("--sequence-parallel" in tokens) == (run.tp > 1)
    assert "routing priced balanced" in text.splitlines()[1]


def test_the_flags_are_the_ones_megatron_documents():
    run, plan = launch("first block dense, shared experts, gate, head width, norms")
    tokens = command(
        export_plan(plan, "megatron", spec=run.spec, options=options_of_run(run))
    )
    assert value(tokens, "--moe-router-topk") == "4"
    assert value(tokens, "--moe-ffn-hidden-size") == "256"
    assert value(tokens, "--moe-shared-expert-intermediate-size") == "512"
    assert "--moe-shared-expert-gate" in tokens
    assert value(tokens, "--moe-layer-freq") == "([0]+[1]*7)"
    assert value(tokens, "--kv-channels") == "128"
    assert "--qk-layernorm" in tokens
    second, plan = launch("every second block, expert tp = tp")
    options = options_of_run(second)
    tokens = command(export_plan(plan, "megatron", spec=second.spec, options=options))
    assert value(tokens, "--moe-layer-freq") == "2"
    # the default expert TP (the TP) written out
    assert value(tokens, "--expert-tensor-parallel-size") == "2"


def test_the_options_the_plan_was_priced_with_travel():
    run, plan = launch("ep inside tp")
    moe = MoeOptions(
        dispatcher="flex",
        flex_backend="hybridep",
        grouped_gemm=False,
        force_load_balancing=True,
        capacity_factor=1.25,
    )
    text = export_plan(
        plan, "megatron", spec=run.spec, options=options_of_run(run), moe=moe
    )
    assert spec_from_megatron_args(command(text)).moe_options == moe
    assert "--moe-router-force-load-balancing routes evenly, as priced" in text
    assert "one GEMM per expert" in text


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (None, "1"),
        ((True,) * 6, "1"),
        ((True, False, False) * 2, "3"),
        ((True,) + (False,) * 5, "6"),
        ((False,) * 3 + (True,) * 58, "([0]*3+[1]*58)"),
        ((False, True) * 24, "([0]+[1])*24"),
        ((True, True, True, False) * 3, "([1]*3+[0])*3"),
        ((True, False, True, True), "([1]+[0]+[1]*2)"),
    ],
)
def test_moe_layer_freq_is_an_integer_when_periodic_from_block_0(pattern, text):
    assert moe_layer_freq_text(pattern) == text
    blocks = 6 if pattern is None else len(pattern)
    assert moe_layer_freq(text, blocks) == (pattern or (True,) * blocks)


def test_moe_layer_freq_reads_back_as_written_and_as_python_evaluates_it():
    rng = random.Random(44)
    for _ in range(300):
        blocks = rng.randint(1, 64)
        odds = rng.random()
        pattern = tuple(rng.random() < odds for _ in range(blocks))
        if not any(pattern):
            continue
        text = moe_layer_freq_text(pattern)
        assert moe_layer_freq(text, blocks) == pattern
        if "[" in text:  # (Megatron-LM evaluates the list expression)
            assert [bool(x) for x in eval(text)] == list(pattern)  # noqa: S307


def _dense(**changes) -> TransformerSpec:
    spec = decoder_spec(
        name="dense-qwen3-like",
        num_layers=4,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=1024,
        vocab_size=32000,
        seq_length=1024,
    )
    return dataclasses.replace(spec, **changes)


def _dense_plan(spec: TransformerSpec) -> Plan3D:
    run = spec_from_megatron_args(
        BASE.replace("--num-layers 8", f"--num-layers {spec.num_layers}")
    )
    return plan_from_megatron_run(dataclasses.replace(run, spec=spec), GPU, 8, 8)


def test_dense_heads_of_another_width_and_their_norms_are_exported():
    """A dense model whose heads are not h / a wide (Qwen3) with per-head
    query/key norms: the export wrote neither (Megatron-LM then builds h / a
    wide heads without norms)."""
    spec = _dense(kv_channels=128, qk_layernorm=True)
    text = export_plan(_dense_plan(spec), "megatron", spec=spec)
    back = spec_from_megatron_args(command(text)).spec
    assert (back.kv_channels, back.qk_layernorm) == (128, True)
    assert back.head_dim == 128 and back.moe is None
    assert "--num-experts" not in command(text)
    assert "experts:" not in text


def test_plans_with_experts_refused_by_megatron_with_the_reason():
    run, plan = launch("ep inside tp")
    spec, options = run.spec, options_of_run(run)
    # per-stage expert layouts: Megatron takes one EP and one expert TP
    layout = ParallelLayout((StageAxes(2, 4, 1), StageAxes(2, 2, 1)), dp=4)
    uneven = dataclasses.replace(plan, layout=layout)
    with pytest.raises(ExportRefused, match="one expert-parallel and one expert"):
        export_plan(uneven, "megatron", spec=spec, options=options)
    # MoE at TP 2 priced without sequence parallelism: MoELayer.forward raises
    no_sp = dataclasses.replace(options, sequence_parallel=False)
    with pytest.raises(ExportRefused, match="only with --sequence-parallel"):
        export_plan(plan, "megatron", spec=spec, options=no_sp)
    with pytest.raises(ExportRefused, match="only with --sequence-parallel"):
        export_plan(plan, "megatron", spec=spec)
    # no model description: the experts' flags are not known
    with pytest.raises(ExportRefused, match="cannot write its --num-experts"):
        export_plan(plan, "megatron", options=options)
    # OLMoE's norms over whole projections have no Megatron-LM flag
    olmoe = dataclasses.replace(spec, qk_layernorm="projection")
    with pytest.raises(ExportRefused, match="whole query and key projections"):
        export_plan(plan, "megatron", spec=olmoe, options=options)


def test_what_megatron_refuses_of_the_experts_is_refused():
    """Biased experts split over expert TP (TransformerConfig: bias only at
    ETP 1): refused through the reader's own rule."""
    run, plan = launch("every second block, expert tp = tp")  # etp 2
    biased = dataclasses.replace(run.spec, linear_bias=True)
    with pytest.raises(ExportRefused, match="read back .* is refused.*--expert-tensor"):
        export_plan(plan, "megatron", spec=biased, options=options_of_run(run))


def test_deepseek_v3_is_exported_with_its_latent_attention_and_mtp():
    """Multi-latent attention and multi-token prediction (refused as not
    priced before): Megatron-LM's flags, read back as the model."""
    spec = load_model_spec("DeepSeek-V3")
    run, _ = launch("tp 1, experts over the replicas")
    plan = plan_from_megatron_run(
        dataclasses.replace(run, spec=spec, pp=1, stage_layers=(), ep=8), GPU, 8, 8
    )
    text = export_plan(plan, "megatron", spec=spec)
    tokens = command(text)
    assert "--multi-latent-attention" in tokens and "--qk-layernorm" in tokens
    flags = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
             "--qk-pos-emb-head-dim", "--v-head-dim", "--mtp-num-layers")  # fmt: skip
    assert [value(tokens, f) for f in flags] == ["1536", "512", "128", "64", "128", "1"]
    assert value(tokens, "--normalization") == "RMSNorm"
    assert value(tokens, "--position-embedding-type") == "rope"
    assert "--rope-type" not in tokens  # MLATransformerConfig's YaRN, as priced
    assert "YaRN" in text and "--rotary-scaling-factor" in text
    assert "multi-token-prediction layer(s) on the last pipeline stage" in text
    back = spec_from_megatron_args(tokens)
    fields = {f.name for f in dataclasses.fields(spec)}
    fields -= {"name", "split_head_layer", "max_position_embeddings"}
    assert {f: getattr(back.spec, f) for f in fields} == {
        f: getattr(spec, f) for f in fields
    }
    assert normalized(back.layout(8)) == normalized(plan.layout)


#: DeepSeek-V3's shape, small: latent attention and its norms, shared
#: experts, the first two blocks dense.
LATENT = (
    "--multi-latent-attention --q-lora-rank 96 --kv-lora-rank 64 "
    "--qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm "
    "--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 64 "
    "--moe-shared-expert-intermediate-size 64 --moe-layer-freq ([0]*2+[1]*6) "
)
LATENT_LAUNCHES = {
    "MTP 1, uneven first/last stages": (
        LATENT + "--mtp-num-layers 1 --tensor-model-parallel-size 2 "
        "--sequence-parallel --pipeline-model-parallel-size 4 "
        "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1 "
        "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1",
        32,
    ),
    "no query latent, MTP 2, even stages": (
        LATENT.replace("--q-lora-rank 96 ", "") + "--mtp-num-layers 2 "
        "--pipeline-model-parallel-size 2 --expert-model-parallel-size 8",
        16,
    ),
    "MTP 1, interleaved": (
        LATENT + "--mtp-num-layers 1 --tensor-model-parallel-size 2 "
        "--sequence-parallel --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 2 --expert-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1",
        8,
    ),
    "dense MLA with MTP": (
        LATENT.split("--num-experts")[0] + "--mtp-num-layers 1 "
        "--tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 2",
        8,
    ),
}


@pytest.mark.parametrize("name", list(LATENT_LAUNCHES))
def test_latent_attention_and_mtp_launches_read_back_as_planned(name):
    flags, gpus = LATENT_LAUNCHES[name]
    run = spec_from_megatron_args(BASE + flags)
    plan = plan_from_megatron_run(run, GPU, gpus, PER_NODE)
    text = export_plan(plan, "megatron", spec=run.spec, options=options_of_run(run))
    tokens = command(text)
    back = spec_from_megatron_args(tokens)
    assert back.spec == run.spec
    assert normalized(back.layout(gpus)) == normalized(plan.layout)
    assert (back.stage_layers, back.virtual_chunks) == (
        run.stage_layers,
        run.virtual_chunks,
    )
    assert ("--q-lora-rank" in tokens) == (run.spec.mla.q_lora_rank > 0)
    assert value(tokens, "--mtp-num-layers") == str(run.spec.mtp_layers)


def test_mtp_with_learned_positions_is_refused_with_megatrons_rule():
    """validate_args: MTP needs rotary or no position embedding. A model
    without experts is read back too, and refused as Megatron-LM would."""
    run = spec_from_megatron_args(BASE + LATENT_LAUNCHES["dense MLA with MTP"][0])
    learned = dataclasses.replace(
        run.spec, position="learned", max_position_embeddings=1024
    )
    plan = plan_from_megatron_run(dataclasses.replace(run, spec=learned), GPU, 8, 8)
    with pytest.raises(ExportRefused, match="--mtp-num-layers needs --position"):
        export_plan(plan, "megatron", spec=learned, options=options_of_run(run))


def test_the_layout_names_the_mtp_layers_on_the_last_stage():
    """Megatron's layout must hold --mtp-num-layers ``m``, after every
    transformer layer (validate_layer_layout)."""
    assert pipeline_layout([3, 3, 1, 1]) == "Et*3|t*3|t|tL"
    assert pipeline_layout([3, 3, 1, 1], mtp=1) == "Et*3|t*3|t|tmL"
    text = pipeline_layout([2, 3, 0, 2], mtp=2)
    assert text == "Et*2|t*3||t*2m*2L"
    assert layout_stages(text) == ["Ett", "ttt", "", "ttmmL"]


def test_a_split_only_a_layout_gives_is_exported_with_its_mtp_layer():
    """Stages of 3, 3, 1 and 1 blocks (no first/last-stage flags give them):
    the layout names the MTP layer beside the loss and reads back as the
    plan."""
    layout = "--pipeline-model-parallel-layout Et*3|t*3|t|tmL"
    run = spec_from_megatron_args(
        BASE + LATENT + "--mtp-num-layers 1 --pipeline-model-parallel-size 4 "
        f"{layout} --expert-model-parallel-size 2"
    )
    plan = plan_from_megatron_run(run, GPU, 8, PER_NODE)
    text = export_plan(plan, "megatron", spec=run.spec, options=options_of_run(run))
    tokens = command(text)
    assert value(tokens, "--pipeline-model-parallel-layout") == "Et*3|t*3|t|tmL"
    back = spec_from_megatron_args(tokens)
    assert back.spec == run.spec and back.stage_layers == (3, 3, 1, 1)


def test_a_read_back_of_another_split_is_refused(monkeypatch):
    """The read-back compares the layers per stage too: a command whose
    first/last-stage flags were lost is refused."""
    flags, gpus = LATENT_LAUNCHES["MTP 1, uneven first/last stages"]
    run = spec_from_megatron_args(BASE + flags)
    plan = plan_from_megatron_run(run, GPU, gpus, PER_NODE)
    real = exports.to_megatron

    def lossy(plan, spec=None, chunks=1):
        args = real(plan, spec, chunks)
        at = args.index("--decoder-first-pipeline-num-layers")
        return args[:at] + args[at + 4 :]  # (the last-stage flag follows)

    monkeypatch.setattr(exports, "to_megatron", lossy)
    with pytest.raises(
        ExportRefused, match=r"split .* \[2, 2, 2, 2\] .* \[1, 3, 3, 1\]"
    ):
        export_plan(plan, "megatron", spec=run.spec, options=options_of_run(run))


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("deepspeed", "DeepSpeed runs mixtures of experts as DeepSpeed's experts"),
        ("megatron-deepspeed", "Megatron-DeepSpeed's --num-experts runs DeepSpeed"),
        ("torchtitan", "fold expert parallelism out of FSDP and TP only"),
        ("alpa", "cannot be told the plan's expert layout"),
        ("sailor", "no expert axes"),
    ],
)
def test_every_other_target_refuses_experts_with_the_reason(target, why):
    run, plan = launch("tp 1, experts over the replicas")
    with pytest.raises(ExportRefused, match=why) as refused:
        export_plan(plan, target, spec=run.spec, gpus_per_node={GPU: PER_NODE})
    assert "EP 8 x expert TP 1" in str(refused.value)
    assert "--export megatron can launch it" in str(refused.value)
    # a mixture of experts without expert parallelism, and an expert layout
    # without the model: refused alike
    flat = dataclasses.replace(
        plan, layout=dataclasses.replace(plan.layout, stages=(StageAxes(1),) * 2)
    )
    with pytest.raises(ExportRefused, match=why):
        export_plan(flat, target, spec=run.spec, gpus_per_node={GPU: PER_NODE})
    with pytest.raises(ExportRefused, match=why):
        export_plan(plan, target, gpus_per_node={GPU: PER_NODE})


@pytest.mark.parametrize(
    "target", ["deepspeed", "megatron-deepspeed", "torchtitan", "alpa", "sailor"]
)
def test_every_other_target_refuses_latent_attention_and_mtp_without_experts(
    target,
):
    """A dense model with multi-latent attention and MTP: the other targets
    would write grouped-query blocks and no MTP, another model."""
    flags, gpus = LATENT_LAUNCHES["dense MLA with MTP"]
    run = spec_from_megatron_args(BASE + flags)
    assert run.spec.moe is None and run.spec.mla is not None
    plan = plan_from_megatron_run(run, GPU, gpus, PER_NODE)
    with pytest.raises(
        ExportRefused,
        match="multi-latent attention and 1 multi-token-prediction layers would "
        "be launched as another model",
    ):
        export_plan(plan, target, spec=run.spec, gpus_per_node={GPU: PER_NODE})
    mtp_only = dataclasses.replace(run.spec, mla=None)
    with pytest.raises(ExportRefused, match="'s 1 multi-token-prediction layers"):
        export_plan(plan, target, spec=mtp_only, gpus_per_node={GPU: PER_NODE})


def test_launchers_name_megatron_alone_for_experts():
    run, plan = launch("tp 1, experts over the replicas")
    able = launchers(plan, spec=run.spec, options=options_of_run(run),
                     gpus_per_node={GPU: PER_NODE})  # fmt: skip
    assert [t for t in EXPORTS if able[t] is None] == ["megatron"]


def test_the_users_command_gets_the_plans_expert_layout():
    run, plan = launch("ep inside tp")
    user = BASE + LAUNCHES["ep inside tp"][0].replace(
        "--expert-model-parallel-size 4", "--expert-model-parallel-size 2"
    )
    text = export_plan(plan, "megatron", spec=run.spec, options=options_of_run(run),
                       megatron_args=user)  # fmt: skip
    tokens = command(text)
    assert tokens.count("--expert-model-parallel-size") == 1
    assert value(tokens, "--expert-model-parallel-size") == "4"
    back = spec_from_megatron_args(tokens)
    assert normalized(back.layout(plan.num_gpus)) == normalized(plan.layout)


def test_moe_spec_with_one_expert_per_token_takes_the_pre_softmax_router():
    run, plan = launch("interleaved pattern, top-1, replicas outermost")
    tokens = command(export_plan(plan, "megatron", spec=run.spec,
                                 options=options_of_run(run)))  # fmt: skip
    assert "--moe-router-pre-softmax" in tokens
    assert "--use-tp-pp-dp-mapping" in tokens
    assert run.spec.moe.topk == 1
    assert run.spec.moe.layers == (False, True) * 4
