"""Exports a user can launch (issue 43).

* every export builds the model's own transformer blocks (Sailor's
  ``LLAMA-3-8`` profile keeps the final norm and the LM head apart: 35
  profile layers, 32 blocks), and a plan of another model is refused;
* every export states the sequence length the plan was priced at, profiled
  models too;
* the Megatron-LM export is a whole ``pretrain_gpt.py`` command (our own
  Megatron argument reader reads the model and the plan back), or the user's
  ``--megatron-args`` command with the plan's flags in place of theirs;
* Megatron-DeepSpeed runs ZB-H1, full recomputation and flash attention, and
  refuses sequence parallelism with the reason;
* every plan report names the targets that launch the plan
  (:func:`~pipedejavu.io.exports.launchers`, the refusals' definition too) and,
  where none does, the best plan Megatron-LM launches.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import tomllib
from helpers import cli_help, run_cli

from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import EXPORTS, export_plan, launchers
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.model_config import list_model_presets, load_model_spec
from pipedejavu.planning.knob_space import KnobSpace

LLAMA = load_model_spec("LLAMA-3-8")  # 32 blocks, norm and head apart
#: The stages of the plan the reviewer exported (issue 43, item 4).
REVIEWED = [0, 3, 6, 9, 13, 18, 23, 28, 35]


def plan_of(bounds, *, tp=4, dp=1, mbs=1, gbs=256, model="LLAMA-3-8", gpn=4):
    return plan_from_stages(
        [(a, b, tp) for a, b in zip(bounds, bounds[1:], strict=False)],
        gpu_type="GH-96", dp=dp, mbs=mbs, gbs=gbs, model=model,
        gpus_per_node=gpn, zone="z",
    )  # fmt: skip


def command(text: str) -> list[str]:
    """The shell words of a Megatron-LM export's command line."""
    return shlex.split(text.splitlines()[-1])


def value(tokens: list[str], flag: str) -> str:
    assert tokens.count(flag) == 1, flag
    return tokens[tokens.index(flag) + 1]


# ------------------------------------------------------ the model's own blocks
def test_every_export_builds_the_models_own_blocks():
    plan = plan_of(REVIEWED)
    sp = TrainingOptions(sequence_parallel=True)  # (torchtitan's TP runs it)
    tokens = command(export_plan(plan, "megatron", spec=LLAMA))
    assert value(tokens, "--num-layers") == "32"
    layout = value(tokens, "--pipeline-model-parallel-layout")
    assert layout == "Et*2|t*3|t*3|t*4|t*5|t*5|t*5|t*5L"
    data = json.loads(export_plan(plan, "deepspeed", spec=LLAMA))["pipeline_module"]
    blocks = [f"transformer.{i}" for i in range(32)]
    assert data["layers"] == ["embedding", *blocks, "final_norm", "head"]
    assert data["parts"] == REVIEWED  # one entry per profile layer
    data = json.loads(export_plan(plan, "megatron-deepspeed", spec=LLAMA))
    assert value(data["arguments"], "--num-layers") == "32"
    module = data["pipeline_module"]
    ends = ["final_norm", "head"]
    assert module["layers_fp32"] == ["_to_float16", "embedding", *blocks, *ends]
    last = module["layers_fp32"][module["parts_fp32"][-2] :]
    assert last == [f"transformer.{i}" for i in range(27, 32)] + ends
    toml = export_plan(plan, "torchtitan", spec=LLAMA, options=sp)
    parts = tomllib.loads(toml)["parallelism"]["module_fqns_per_model_part"]
    names = [name for part in parts for name in part]
    assert names == ["tok_embeddings"] + [f"layers.{i}" for i in range(32)] + [
        "norm",
        "output",
    ]


def test_the_cli_export_of_the_reviewed_plan_has_32_blocks(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--model", "LLAMA-3-8", "--gpus", "GH-96:32",
        "--global-batch", 256, "--export", "megatron",
    )  # fmt: skip
    assert code == 0
    tokens = command(out)
    assert value(tokens, "--num-layers") == "32"
    layout = value(tokens, "--pipeline-model-parallel-layout")
    assert sum(part.count("t") for part in layout.split("|")) == 8  # one per stage
    counts = [
        int(part.split("t*")[1].rstrip("L")) if "t*" in part else part.count("t")
        for part in layout.split("|")
    ]
    assert sum(counts) == 32
    assert value(tokens, "--seq-length") == "8192"  # profiled at 8,192 (item 6)


def test_a_plan_of_another_model_is_refused_by_every_export():
    plan = plan_of(REVIEWED)  # 35 layers
    neo = load_model_spec("GPT-Neo-2.7")  # 32 blocks, 34 profile layers
    for target in EXPORTS:
        with pytest.raises(ProblemError, match="covers 35 profile layers, but GPT-Neo"):
            export_plan(plan, target, spec=neo, gpus_per_node={"GH-96": 4})
    with pytest.raises(ProblemError, match="covers 35 profile layers"):
        launchers(plan, spec=neo)


def test_megatron_keeps_the_final_norm_with_the_head():
    """Megatron-LM builds the norm on the last stage with the LM head; the
    other launchers list them apart."""
    plan = plan_of([0, 17, 34, 35], tp=1)  # the head alone on the last stage
    with pytest.raises(ExportRefused, match="final norm with the LM head"):
        export_plan(plan, "megatron", spec=LLAMA)
    data = json.loads(export_plan(plan, "deepspeed", spec=LLAMA))["pipeline_module"]
    assert data["layers"][data["parts"][-2] :] == ["head"]
    toml = export_plan(plan, "torchtitan", spec=LLAMA)
    assert '["output"]' in toml and '"norm"]' in toml


# --------------------------------------------------------- the sequence length
def test_profiled_models_export_the_length_they_were_profiled_at(capsys):
    argv = ["plan", "--model", "LLAMA-3-8", "--gpus", "GH-96:32"]
    argv += ["--global-batch", 256, "--json", "--export", "deepspeed"]
    code, out, _ = run_cli(capsys, *argv)
    data = json.loads(out)
    assert code == 0 and data["seq_length"] == 8192
    assert json.loads(data["export"]["text"])["seq_length"] == 8192
    opt = ["plan", "--model", "OPT-350", "--gpus", "GH-96:16", "--global-batch", 64]
    code, out, _ = run_cli(capsys, *opt, "--json", "--export", "megatron-deepspeed")
    exported = json.loads(json.loads(out)["export"]["text"])
    assert value(exported["arguments"], "--seq-length") == "2048"


# ------------------------------------------------- the whole Megatron command
@pytest.mark.parametrize("name", list_model_presets())
def test_the_megatron_command_carries_the_model(name):
    """Our Megatron-LM reader reads the exported command back as the model
    and the plan (the vocabulary from ``--vocab-size`` or GPT-2's BPE
    files)."""
    spec = load_model_spec(name)
    if spec.position == "alibi":
        pytest.skip("no Megatron-LM flag for ALiBi")
    layers = spec.num_profile_layers
    plan = plan_of([0, layers // 2, layers], tp=1, dp=2, mbs=1, gbs=16, model=name)
    options = TrainingOptions("bf16", recompute="full", distributed_optimizer=True)
    text = export_plan(plan, "megatron", spec=spec, options=options)
    assert "replace the <...> placeholders" in text
    tokens = command(text)
    assert tokens[0] == "pretrain_gpt.py"
    assert value(tokens, "--data-path") == "<DATA_PATH>"
    run_ = spec_from_megatron_args(tokens)
    fields = {f.name for f in dataclasses.fields(spec)}
    fields -= {"name", "split_head_layer", "max_position_embeddings"}
    assert {f: getattr(run_.spec, f) for f in fields} == {
        f: getattr(spec, f) for f in fields
    }
    assert (run_.tp, run_.pp, run_.micro_batch, run_.global_batch) == (1, 2, 1, 16)
    assert run_.precision == "bf16" and run_.recompute_full
    assert run_.use_distributed_optimizer


def test_a_plan_without_a_model_says_what_is_missing():
    text = export_plan(plan_of([0, 13, 26], model="mine"), "megatron")
    assert "the model's shape is not known here (no description of mine)" in text
    assert "--seq-length, --max-position-embeddings" in text
    assert "--hidden-size" not in command(text)


LAUNCH = (
    "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 32 "
    "--hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 50304 --micro-batch-size 1 "
    "--global-batch-size 256 --tensor-model-parallel-size=8 "
    "--pipeline-model-parallel-size 1 --recompute-activations --bf16 "
    "--data-path /data/corpus --lr 3e-4 --train-iters 1000"
)


def test_megatron_args_export_is_the_users_command_with_the_plans_flags(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--gpus", "H100:64", "--megatron-args", LAUNCH,
        "--export", "megatron", "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    text = data["export"]["text"]
    assert "your --megatron-args command with the plan's" in text
    tokens = command(text)
    assert tokens[:4] == ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"]
    assert value(tokens, "--data-path") == "/data/corpus"
    assert value(tokens, "--lr") == "3e-4"
    assert not any(t.startswith("--tensor-model-parallel-size=") for t in tokens)
    assert "--recompute-activations" not in tokens  # the plan's own, if any
    back = spec_from_megatron_args(tokens)
    assert back.spec == spec_from_megatron_args(LAUNCH).spec
    assert (back.tp, back.pp, back.micro_batch) == (
        data["stages"][0]["replicas"][0]["tp"],
        len(data["stages"]),
        data["mbs"],
    )
    assert data["launchers"]["launched_by"][0] == "megatron"


def test_megatron_args_export_drops_the_users_context_parallelism():
    """The plan runs no context parallelism: Megatron-LM's data parallelism is
    the world over TP x CP x PP, so a --context-parallel-size kept from the
    user's command would run other replicas than the plan's (Megatron Core
    0.16.1's validate_args refuses this plan's 32 GPUs with CP 2:
    benchmarks/check_exports.py)."""
    plan = plan_of(REVIEWED)  # TP 4, 8 stages: 32 GPUs
    cp = " --context-parallel-size 2 --hierarchical-context-parallel-sizes 2 1"
    tokens = command(export_plan(plan, "megatron", megatron_args=LAUNCH + cp))
    assert tokens == command(export_plan(plan, "megatron", megatron_args=LAUNCH))
    assert value(tokens, "--tensor-model-parallel-size") == "4"


# ------------------------------------------------------ Megatron-DeepSpeed
def megatron_deepspeed_args(plan, options):
    return json.loads(export_plan(plan, "megatron-deepspeed", options=options))[
        "arguments"
    ]


def test_megatron_deepspeed_runs_full_recomputation_and_flash_attention():
    plan = plan_of([0, 9, 18, 26], tp=1, model="m")  # 8 + 9 + 7 blocks
    full = TrainingOptions("bf16", recompute="full")
    args = megatron_deepspeed_args(plan, full)
    assert args[args.index("--checkpoint-activations") :][:4] == [
        "--checkpoint-activations",
        "--checkpoint-num-layers",
        "1",
        "--deepspeed-activation-checkpointing",
    ]
    assert "--use-flash-attn-v2" in args
    covering = dataclasses.replace(full, recompute_num_layers=9)  # every block
    assert megatron_deepspeed_args(plan, covering) == args
    with pytest.raises(ExportRefused, match="not the first 8 of each stage"):
        megatron_deepspeed_args(plan, dataclasses.replace(full, recompute_num_layers=8))
    with pytest.raises(ExportRefused, match="selective"):
        megatron_deepspeed_args(plan, TrainingOptions(recompute="selective"))
    unfused = TrainingOptions(flash_attention=False)
    args = megatron_deepspeed_args(plan, unfused)
    assert "--use-flash-attn-v2" not in args
    assert value(args, "--attention-dropout") == "0"


def test_megatron_deepspeed_says_to_set_parts_on_gpt_model_pipe_itself():
    """DeepSpeed's ``_is_checkpointable`` knows ``GPTModelPipe`` by its class
    name: ``parts`` given in a subclass of another name make it checkpoint the
    embedding, the norm and the head too (Megatron-DeepSpeed's own code,
    ``benchmarks/check_megatron_deepspeed.py``), so the export says where
    they go."""
    plan = plan_of([0, 9, 18, 26], tp=1, model="m")
    full = TrainingOptions("bf16", recompute="full")
    module = json.loads(export_plan(plan, "megatron-deepspeed", options=full))[
        "pipeline_module"
    ]
    how = module["parts_how"]
    assert "GPTModelPipe._partition_layers" in how
    assert "_is_checkpointable" in how and "class name" in how
    assert "self._set_bounds(start=parts[stage], stop=parts[stage + 1])" in how


def test_megatron_deepspeed_refuses_sequence_parallelism_with_tp():
    sp = TrainingOptions("bf16", sequence_parallel=True)
    with pytest.raises(ExportRefused, match="all-reduce the norms' gradients"):
        megatron_deepspeed_args(plan_of([0, 13, 26], tp=2, model="m"), sp)
    assert megatron_deepspeed_args(plan_of([0, 13, 26], tp=1, model="m"), sp)


def test_the_megatron_deepspeed_search_space():
    space = KnobSpace(recompute_layers=(2, None)).for_target("megatron-deepspeed")
    assert space.schedules == ("1f1b", "zb-h1")
    assert space.recompute == ("none", "full")
    assert space.sequence_parallel == (False,)
    assert space.recompute_layers == (None,)
    with pytest.raises(ValueError, match="every block of a stage or none"):
        KnobSpace(recompute_layers=(2,)).for_target("megatron-deepspeed")


# ------------------------------------------------------------- who launches it
@pytest.mark.parametrize(
    "options",
    [
        TrainingOptions(),
        TrainingOptions("bf16", zero_bubble=True, distributed_optimizer=True),
        TrainingOptions("bf16", virtual_stages=2, sequence_parallel=True),
        TrainingOptions("fp8", recompute="selective"),
    ],
)
def test_launchers_is_what_the_exports_do(options):
    hosts = {"GH-96": 4}
    for plan in (plan_of([0, 13, 26], tp=2, model="m"), plan_of([0, 26], tp=1)):
        if plan.num_layers == 35:  # (a one-stage LLAMA-3-8 plan)
            plan = plan_of([0, 35], tp=1, gbs=8)
        spec = LLAMA if plan.num_layers == 35 else None
        found = launchers(plan, gpus_per_node=hosts, options=options, spec=spec)
        assert list(found) == list(EXPORTS)
        for target, why in found.items():
            try:
                export_plan(
                    plan, target, gpus_per_node=hosts, options=options, spec=spec
                )
            except ExportRefused as refusal:
                assert why is not None and why in str(refusal)
                able = [t for t, w in found.items() if w is None]
                instead = ", ".join(able) + " can launch it" if able else "no export"
                assert instead in str(refusal)
            else:
                assert why is None


def test_the_report_names_the_targets_that_launch_the_plan(capsys):
    # the pipeline search (the sharded space's FSDP plans: test_sharded_search)
    argv = ["plan", "--model", "Llama-3-8B", "--gpus", "H100:8", "--sharded", "off"]
    argv += ["--global-batch"]
    code, out, _ = run_cli(capsys, *argv, 256)
    assert code == 0
    assert "GPUs H100:8 (H100-SXM)" in out.splitlines()[0]
    assert "pipeline (ZB-H1 zero bubble)" in out
    assert "launched as planned by: megatron-deepspeed (--export TARGET" in out
    code, out, _ = run_cli(capsys, *argv, 256, "--json")
    assert json.loads(out)["launchers"]["launched_by"] == ["megatron-deepspeed"]


def test_a_plan_no_target_launches_comes_with_one_megatron_launches(capsys):
    argv = ["plan", "--model", "Mistral-7B", "--gpus", "H100:32", "--sharded", "off"]
    argv += ["--global-batch"]
    code, out, _ = run_cli(capsys, *argv, 64, "--json")
    assert code == 0
    data = json.loads(out)
    launch = data["launchers"]
    assert launch["launched_by"] == [] and set(launch["refused"]) == set(EXPORTS)
    other = launch["best_launchable"]
    assert other["target"] == "megatron"
    # the same plan as a search for what Megatron-LM launches
    code, out, _ = run_cli(capsys, *argv, 64, "--json", "--export", "megatron")
    alone = json.loads(out)
    assert alone["launchers"]["launched_by"][0] == "megatron"
    time = alone["iteration_time_s"]
    assert other["iteration_time_s"] == pytest.approx(time, rel=1e-12)
    best = data["iteration_time_s"]
    assert other["slower_by"] == pytest.approx(time / best - 1, rel=1e-9)
    assert other["slower_by"] >= 0
    code, out, _ = run_cli(capsys, *argv, 64)
    assert "launched as planned by: no export target" in out
    assert f"best plan megatron launches: {other['plan']}" in out


def test_an_export_target_refuses_a_precision_with_the_reason(capsys):
    argv = ["plan", "--model", "Llama-3-70B", "--gpus", "H100:64"]
    argv += ["--global-batch", 1024, "--precision", "bf16", "--export", "torchtitan"]
    code, out, err = run_cli(capsys, *argv, "--sharded", "off")  # pipelines alone
    assert code == 2 and out == ""
    assert "only with FSDP" in err
    assert err.rstrip().endswith(
        "--export megatron, deepspeed, megatron-deepspeed run bf16"
    )


def test_the_help_says_which_target_runs_which_schedule(capsys):
    text = cli_help(capsys, "plan")
    which = "zb-h1 by megatron-deepspeed, torchtitan; interleaved-zb by torchtitan"
    assert text.count(which) == 2  # --schedule's and --export's
    assert "profiles); export targets: 1f1b by megatron, deepspeed," in text
