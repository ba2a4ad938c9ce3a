"""Exports checked against each target's documented syntax and rules.

None of the targets is installable here (they need PyTorch, CUDA or an old
jaxlib), so each test re-states the target's rules as its documentation and
source give them (versions in :mod:`pipedejavu.io.exports`) and checks
the export against those rules, not against our own exporter's code.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_alpa import to_alpa
from pipedejavu.io.export_deepspeed import to_deepspeed
from pipedejavu.io.export_megatron import to_megatron
from pipedejavu.io.export_rules import ExportRefused, gpu_types_by_rank
from pipedejavu.io.export_torchtitan import to_torchtitan
from pipedejavu.io.exports import export_plan
from pipedejavu.io.sailor_plan import load_plan3d, plan_from_sailor, plan_to_sailor


def _plan(bounds, tp=2, dp=2, mbs=2, gbs=64, gpn=4):
    return plan_from_stages(
        [(a, b, tp) for a, b in zip(bounds, bounds[1:], strict=False)],
        gpu_type="GH-96",
        dp=dp,
        mbs=mbs,
        gbs=gbs,
        model="OPT-350",
        gpus_per_node=gpn,
        zone="us-central1-a",
    )


PLANS = {
    "one stage": _plan((0, 26)),
    "even": _plan((0, 7, 13, 19, 26)),  # 6 transformer layers per stage
    "first and last": _plan((0, 5, 13, 21, 26)),  # 4, 8, 8, 4
    "two uneven": _plan((0, 9, 26)),  # 8, 16
    "irregular": _plan((0, 3, 13, 16, 26), tp=1, dp=4),  # 2, 10, 3, 9
}


# ------------------------------------------------------------- Megatron-LM
def _megatron_parser() -> argparse.ArgumentParser:
    """The options the export uses, with Megatron-LM's types
    (megatron/training/arguments.py, core 0.16.1)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    for name in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--micro-batch-size",
        "--global-batch-size",
        "--num-layers",
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
    ):
        parser.add_argument(name, type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    return parser


def _layout_stages(text: str) -> list[list[str]]:
    """Megatron's layout grammar: commas are cosmetic, ``(..)*n`` and ``x*n``
    repeat, ``|`` separates stages, E/L/t/m are the layer kinds."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    assert all(ch in "ELtm" for stage in stages for ch in stage)
    return stages


def _megatron_stage_layers(args: argparse.Namespace) -> list[int]:
    """Transformer layers per stage under Megatron's rules."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if args.pipeline_model_parallel_layout is not None:
        assert args.decoder_first_pipeline_num_layers is None
        stages = _layout_stages(args.pipeline_model_parallel_layout)
        assert len(stages) % pp == 0 and len(stages) == pp  # no virtual stages
        flat = [ch for stage in stages for ch in stage]
        assert flat[0] == "E" and flat[-1] == "L"
        assert flat.count("E") == 1 and flat.count("L") == 1
        assert flat.count("t") == layers
        return [stage.count("t") for stage in stages]
    first, last = (
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
    )
    if first is None and last is None:
        assert layers % pp == 0
        return [layers // pp] * pp
    middle_layers, middle_stages = layers, pp
    for value in (first, last):
        if value is not None:
            assert value > 0
            middle_layers -= value
            middle_stages -= 1
    assert bool(middle_layers) == bool(middle_stages)
    each = middle_layers // middle_stages if middle_stages else 0
    assert not middle_stages or middle_layers % middle_stages == 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


@pytest.mark.parametrize("name", PLANS)
def test_megatron_arguments(name):
    plan = PLANS[name]
    args = _megatron_parser().parse_args(to_megatron(plan))
    assert args.tensor_model_parallel_size == plan.stages[0].replicas[0].tp
    assert args.pipeline_model_parallel_size == plan.num_stages
    assert (args.micro_batch_size, args.global_batch_size) == (plan.mbs, plan.gbs)
    # Megatron derives DP from the world size; the global batch must divide.
    assert args.global_batch_size % (args.micro_batch_size * plan.dp) == 0
    expected = [
        sum(1 for layer in range(s.start, s.stop) if 0 < layer < 25)
        for s in plan.stages
    ]
    assert _megatron_stage_layers(args) == expected
    text = export_plan(plan, "megatron")
    assert f"launch {plan.num_gpus} processes" in text
    line = shlex.split(text.splitlines()[-1])
    assert line[0] == "pretrain_gpt.py"
    args = to_megatron(plan)
    assert any(line[i : i + len(args)] == args for i in range(len(line)))


def test_megatron_uses_the_simplest_arguments():
    assert "--pipeline-model-parallel-layout" not in to_megatron(
        PLANS["first and last"]
    )
    assert "--decoder-first-pipeline-num-layers" not in to_megatron(PLANS["even"])
    layout = to_megatron(PLANS["irregular"])
    assert layout[-2:] == ["--pipeline-model-parallel-layout", "Et*2|t*10|t*3|t*9L"]
    # The layout holds '|': the printed line is quoted for a shell (issue 27).
    line = export_plan(PLANS["irregular"], "megatron").splitlines()[-1]
    assert "--pipeline-model-parallel-layout 'Et*2|t*10|t*3|t*9L' " in line


# ------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("name", PLANS)
def test_deepspeed_partition(name):
    plan = PLANS[name]
    out = to_deepspeed(plan)
    parts = out["pipeline_module"]["parts"]
    layers = out["pipeline_module"]["layers"]
    assert len(parts) == plan.num_stages + 1 == out["pipeline_module"]["num_stages"] + 1
    assert parts[0] == 0 and parts[-1] == len(layers) == 26
    assert all(a < b for a, b in zip(parts, parts[1:], strict=False))
    for stage, a, b in zip(plan.stages, parts, parts[1:], strict=False):
        assert (a, b) == (stage.start, stage.stop)
    config = out["ds_config"]
    # DeepSpeed's batch rule (runtime/config.py): train = micro x gas x dp.
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"]
        * config["gradient_accumulation_steps"]
        * out["data_parallel_size"]
    )
    assert out["world_size"] == (
        out["data_parallel_size"] * out["model_parallel_size"] * plan.num_stages
    )


# ------------------------------------------------------------- torchtitan
#: The [parallelism] fields of torchtitan v0.2.2 (torchtitan/config/job_config.py).
TORCHTITAN_PARALLELISM = {
    "data_parallel_replicate_degree": int,
    "data_parallel_shard_degree": int,
    "tensor_parallel_degree": int,
    "pipeline_parallel_degree": int,
    "module_fqns_per_model_part": list,
    "pipeline_parallel_schedule": str,
    "pipeline_parallel_microbatch_size": int,
}
TORCHTITAN_TRAINING = {
    "local_batch_size": int,
    "global_batch_size": int,
    "dtype": str,
    "mixed_precision_param": str,
}
#: torchtitan's TP always shards the norms along the sequence.
SEQUENCE_PARALLEL = TrainingOptions(sequence_parallel=True)


TORCHTITAN_PLANS = {
    "ddp only": _plan((0, 26), tp=1, dp=4),
    "tp only": _plan((0, 26), tp=4, dp=1, gbs=8),
    "pp and tp": _plan((0, 1, 13, 26), tp=2, dp=1, gbs=8),
}


@pytest.mark.parametrize("name", TORCHTITAN_PLANS)
def test_torchtitan_toml(name):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    plan = TORCHTITAN_PLANS[name]
    text = to_torchtitan(plan, SEQUENCE_PARALLEL)
    assert text.startswith("# torchtitan v0.2.2 ")
    config = tomllib.loads(text)
    assert set(config) == {"training", "parallelism", "activation_checkpoint"}
    assert config["activation_checkpoint"] == {"mode": "none"}
    for section, fields in (
        ("parallelism", TORCHTITAN_PARALLELISM),
        ("training", TORCHTITAN_TRAINING),
    ):
        for key, value in config[section].items():
            assert isinstance(value, fields[key]), key
    par = config["parallelism"]
    world = (
        par["data_parallel_replicate_degree"]
        * par["data_parallel_shard_degree"]
        * par["tensor_parallel_degree"]
        * par["pipeline_parallel_degree"]
    )
    assert world == plan.num_gpus
    # DDP (replicas, no sharding) only when it is the only parallelism.
    if par["data_parallel_replicate_degree"] > 1:
        assert world == par["data_parallel_replicate_degree"]
    training = config["training"]
    assert training["global_batch_size"] == plan.gbs
    if par["pipeline_parallel_degree"] == 1:
        # One forward/backward of local_batch_size per accumulation step.
        assert "module_fqns_per_model_part" not in par
        assert training["local_batch_size"] == plan.mbs
        return
    assert par["pipeline_parallel_schedule"] == "1F1B"
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == par["pipeline_parallel_degree"]
    flat = [name for part in parts for name in part]
    assert flat == ["tok_embeddings"] + [f"layers.{i}" for i in range(24)] + [
        "norm",
        "output",
    ]
    assert training["local_batch_size"] == plan.gbs
    assert par["pipeline_parallel_microbatch_size"] == plan.mbs


@pytest.mark.parametrize("name", PLANS)
def test_torchtitan_refuses_ddp_beside_tp_or_pp(name):
    with pytest.raises(ExportRefused, match="only as FSDP/HSDP"):
        to_torchtitan(PLANS[name])
    with pytest.raises(ExportRefused, match=r"--export megatron, deepspeed, "):
        export_plan(PLANS[name], "torchtitan", gpus_per_node={"GH-96": 4})


# ------------------------------------------------------------------ Alpa
@pytest.mark.parametrize("name", PLANS)
def test_alpa_manual_stage_option(name):
    plan = PLANS[name]
    out = to_alpa(plan, gpus_per_host=4)
    assert out["target"].startswith("alpa b8078a9")
    option = out["manual_stage_option"]
    # Exactly ManualStageOption's fields; the micro-batches go beside it.
    assert set(option) == {
        "forward_stage_layer_ids",
        "submesh_physical_shapes",
        "submesh_logical_shapes",
        "submesh_autosharding_option_dicts",
    }
    assert out["num_micro_batches"] * plan.mbs * plan.dp == plan.gbs
    ids = option["forward_stage_layer_ids"]
    assert [i for stage in ids for i in stage] == list(range(26))
    assert all(len(option[f]) == len(ids) for f in option)
    assert out["alpa_init"] == {
        "num_nodes": plan.num_gpus // 4,
        "num_devices_per_node": 4,
    }
    for stage, physical, logical in zip(
        plan.stages,
        option["submesh_physical_shapes"],
        option["submesh_logical_shapes"],
        strict=True,
    ):
        devices = stage.dp * stage.replicas[0].tp
        assert physical[0] * physical[1] == logical[0] * logical[1] == devices
        assert physical[0] == 1 or physical[1] == 4  # whole hosts, Alpa's rule
        assert logical == [stage.dp, stage.replicas[0].tp]


# ----------------------------------------------------------------- Sailor
@pytest.mark.parametrize("name", PLANS)
def test_sailor_round_trip(name):
    plan = PLANS[name]
    text = export_plan(plan, "sailor", gpus_per_node={"GH-96": 4})
    back = plan_from_sailor(json.loads(text), model="OPT-350")
    assert [(s.start, s.stop, s.dp) for s in back.stages] == [
        (s.start, s.stop, s.dp) for s in plan.stages
    ]
    assert [[r.tp for r in s.replicas] for s in back.stages] == [
        [r.tp for r in s.replicas] for s in plan.stages
    ]
    assert (back.mbs, back.gbs) == (plan.mbs, plan.gbs)
    # The format has no node identities: everything but N survives, and a
    # plan read from a file is a fixed point.
    with pytest.raises(ProblemError, match="give gpus_per_node for GH-96"):
        plan_to_sailor(plan)
    exported = plan_to_sailor(plan, gpus_per_node={"GH-96": 4})
    again = plan_to_sailor(back)
    assert {k: v for k, v in exported.items() if k != "N"} == {
        k: v for k, v in again.items() if k != "N"
    }
    assert plan_from_sailor(again, model="OPT-350") == back
    # Without the node size a placed plan is refused; with it, every entry
    # names the node's GPUs, as Sailor's reader takes them (issue 27).
    assert {
        r[0][0][1] for st in exported["pipeline_list"][0]["tmp_per_stage"] for r in st
    } == {4}


def test_per_stage_tp_is_refused_by_single_degree_runtimes():
    plan = Plan3D(
        (
            Stage3D(0, 9, (Replica("GH-96", 4),)),
            Stage3D(9, 17, (Replica("GH-96", 2),)),
            Stage3D(17, 26, (Replica("GH-96", 2),)),
        ),
        mbs=1,
        gbs=8,
        model="OPT-350",
    )
    hosts = {"GH-96": 4}
    for target in ("megatron", "deepspeed", "megatron-deepspeed", "torchtitan"):
        with pytest.raises(
            ExportRefused, match="one tensor-parallel degree.*--export alpa, sailor"
        ):
            export_plan(plan, target, gpus_per_node=hosts)
    option = json.loads(export_plan(plan, "alpa", gpus_per_node=hosts))
    assert option["manual_stage_option"]["submesh_physical_shapes"] == [
        [1, 4],
        [1, 2],
        [1, 2],
    ]
    assert export_plan(plan, "sailor")
    # Issue 27: 6 GPUs are not whole hosts of 4, so Alpa cannot launch it.
    six = plan.replace(stages=plan.stages[:2])
    six = six.replace(stages=(six.stages[0], Stage3D(9, 26, six.stages[1].replicas)))
    with pytest.raises(ExportRefused, match="whole hosts of 4 GPUs"):
        export_plan(six, "alpa", gpus_per_node=hosts)
    with pytest.raises(ProblemError, match="export must be one of"):
        export_plan(plan, "jax")


# ------------------------------------------------------------------- CLI
def test_cli_plan_json_is_accepted_by_predict(capsys, tmp_path):
    code = main(
        [
            "plan",
            "--model",
            "OPT-350",
            "--gpus",
            "GH-96:16",
            "--global-batch",
            "64",
            "--json",
            "--export",
            "megatron",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and "planning OPT-350" not in err  # only slow runs say so
    data = json.loads(out)
    for key in (
        "iteration_time_s",
        "memory_per_stage_bytes",
        "lower_bound_s",
        "gap",
        "search_time_s",
        "model",
        "stages",
        "export",
    ):
        assert key in data
    path = tmp_path / "plan.json"
    path.write_text(out)
    assert load_plan3d(path)[0].model == "OPT-350"
    assert main(["predict", str(path), "--json"]) == 0
    predicted = json.loads(capsys.readouterr()[0])
    assert predicted["iteration_time_s"] == data["iteration_time_s"]


def test_cli_plan_text_and_errors(capsys):
    command = ["plan", "--model", "OPT-350", "--gpus", "RTX-2080:4"]
    command += ["--global-batch", "8", "--export", "torchtitan"]
    # The profiled plan (pp 2, tp 2) priced without sequence parallelism,
    # which torchtitan's TP always runs, is refused when asked for; by default
    # the search for torchtitan runs it (as with --sequence-parallel on).
    assert main([*command, "--sequence-parallel", "off"]) == 2
    assert "without sequence parallelism" in capsys.readouterr()[1]
    outs = []
    for extra in ([], ["--sequence-parallel", "on"]):
        code = main([*command, *extra])
        out, _ = capsys.readouterr()
        assert code == 0 and "tensor_parallel_degree = 2" in out
        assert "[parallelism]" in out and 'mode = "none"' in out
        assert "sequence parallel on" in out
        outs.append(out.split("--- torchtitan ---")[1])
    assert outs[0] == outs[1]  # the same export
    assert (
        main(["plan", "--model", "OPT-350", "--gpus", "GH96", "--global-batch", "8"])
        == 2
    )
    assert "TYPE:COUNT" in capsys.readouterr()[1]
    assert (
        main(
            [
                "plan",
                "--model",
                "GPT-Neo-2.7",
                "--gpus",
                "V100-16:2",
                "--global-batch",
                "8",
            ]
        )
        == 3
    )
    assert "no feasible plan" in capsys.readouterr()[1]


def test_plans_on_several_gpu_types_name_each_rank_block():
    """A plan whose stages run on two types: the rank order the three launchers
    share (TP fastest, then data, then pipeline stage) gives each block of
    global ranks its type; the Megatron arguments and the torchtitan TOML
    carry it as comments, DeepSpeed's JSON as ``gpu_types_by_rank``, Alpa
    refuses (its options name no GPU types), and one-type plans say nothing."""
    from pipedejavu.costmodel.megatron.tables import plan_from_mixed_stages

    tomllib = pytest.importorskip("tomllib")
    kinds = ["Titan-RTX", "Titan-RTX", "RTX-2080", "Titan-RTX"]
    plan = plan_from_mixed_stages(
        [
            (a, b, 2, gpu)
            for a, b, gpu in zip((0, 5, 12, 20), (5, 12, 20, 26), kinds, strict=True)
        ],
        dp=2,
        mbs=1,
        gbs=16,
        model="OPT-350",
        pool={"Titan-RTX": 16, "RTX-2080": 8},
        gpus_per_node={"Titan-RTX": 8, "RTX-2080": 8},
        zone="us-central1-a",
    )
    # Replica j of stage s is ranks (2s + j) x 2 .. + 1.
    expected = [
        {"ranks": [0, 7], "gpu_type": "Titan-RTX", "stages": [0, 1]},
        {"ranks": [8, 11], "gpu_type": "RTX-2080", "stages": [2, 2]},
        {"ranks": [12, 15], "gpu_type": "Titan-RTX", "stages": [3, 3]},
    ]
    assert gpu_types_by_rank(plan) == expected
    text = export_plan(plan, "megatron")
    assert "#   ranks 8-11: RTX-2080 (stage 2)" in text
    assert "#   ranks 0-7: Titan-RTX (stages 0-1)" in text
    args = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(args) == 1
    assert args[0].startswith("pretrain_gpt.py --tensor-model-parallel-size 2")
    assert to_deepspeed(plan)["gpu_types_by_rank"] == expected
    with pytest.raises(ExportRefused, match="only as FSDP/HSDP"):
        to_torchtitan(plan)  # dp 2 beside pipeline stages
    one_pipeline = plan.replace(
        stages=tuple(Stage3D(s.start, s.stop, s.replicas[:1]) for s in plan.stages)
    )
    toml = to_torchtitan(one_pipeline, SEQUENCE_PARALLEL)
    assert "#   ranks 4-5: RTX-2080 (stage 2)" in toml
    assert tomllib.loads(toml)["parallelism"]["pipeline_parallel_degree"] == 4
    with pytest.raises(ProblemError, match="cannot name GPU types"):
        to_alpa(plan, gpus_per_host=8)
    one_type = PLANS["even"]
    assert "ranks" not in export_plan(one_type, "megatron")
    assert "gpu_types_by_rank" not in to_deepspeed(one_type)
    assert "ranks" not in to_torchtitan(
        TORCHTITAN_PLANS["pp and tp"], SEQUENCE_PARALLEL
    )


def test_training_options_travel_with_the_export():
    """A plan priced in bf16 with recomputation exports Megatron-LM's flags for
    them (parsed back by our own Megatron argument reader), the DeepSpeed
    config its precision and ZeRO-1 for the distributed optimizer, and is
    refused where the file cannot say them."""
    import json as _json

    from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.io.export_rules import ExportRefused
    from pipedejavu.io.exports import export_plan
    from pipedejavu.io.megatron_args import spec_from_megatron_args

    plan = Plan3D(
        (
            Stage3D(0, 17, tuple(Replica("H100-SXM", 2) for _ in range(2))),
            Stage3D(17, 34, tuple(Replica("H100-SXM", 2) for _ in range(2))),
        ),
        mbs=1,
        gbs=64,
    )
    options = TrainingOptions(
        "bf16", recompute="full", distributed_optimizer=True, sequence_parallel=True
    )
    text = export_plan(plan, "megatron", options=options).splitlines()[-1]
    model = "--hidden-size 1024 --num-attention-heads 8 --seq-length 128 "
    model += "--max-position-embeddings 128 --vocab-size 1000 "
    run = spec_from_megatron_args(text + " " + model)
    assert run.precision == "bf16" and run.recompute_full
    assert run.use_distributed_optimizer and run.sequence_parallel
    assert (run.tp, run.pp, run.micro_batch, run.global_batch) == (2, 2, 1, 64)
    plain = TrainingOptions("bf16", distributed_optimizer=True)
    config = _json.loads(export_plan(plan, "deepspeed", options=plain))["ds_config"]
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"] == {"stage": 1}
    with pytest.raises(ExportRefused, match="recomputes activations"):
        export_plan(plan, "deepspeed", options=options)
    with pytest.raises(ExportRefused, match="carries no precision"):
        export_plan(plan, "sailor", options=plain)
    # Plain fp32 (the default) exports as before.
    assert export_plan(plan, "megatron", options=TrainingOptions()) == export_plan(
        plan, "megatron"
    )


def test_interleaved_schedule_exports_megatrons_virtual_stages():
    """An interleaved plan exports --num-layers-per-virtual-pipeline-stage,
    which our Megatron argument reader reads back as the same chunks; a plan
    Megatron cannot interleave so is refused."""
    from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.io.export_rules import ExportRefused
    from pipedejavu.io.exports import export_plan
    from pipedejavu.io.megatron_args import spec_from_megatron_args

    def plan_of(bounds):
        stages = tuple(
            Stage3D(a, b, (Replica("H100-SXM", 2),))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        )
        return Plan3D(stages, mbs=1, gbs=64)

    even = plan_of([0, 17, 34])  # 16 + 16 transformer layers
    model = "--hidden-size 1024 --num-attention-heads 8 --seq-length 128 "
    model += "--max-position-embeddings 128 --vocab-size 1000 "
    for chunks, per_chunk in ((2, 8), (4, 4), (16, 1)):
        options = TrainingOptions("bf16", virtual_stages=chunks)
        text = export_plan(even, "megatron", options=options).splitlines()[-1]
        assert f"--num-layers-per-virtual-pipeline-stage {per_chunk}" in text
        run = spec_from_megatron_args(text + " " + model)
        assert run.virtual_chunks == chunks and run.pp == 2
    with pytest.raises(ExportRefused, match="split into 3 chunks"):
        export_plan(even, "megatron", options=TrainingOptions(virtual_stages=3))
    with pytest.raises(ExportRefused, match="equally many"):
        export_plan(
            plan_of([0, 15, 34]), "megatron", options=TrainingOptions(virtual_stages=2)
        )
    for target in ("deepspeed", "megatron-deepspeed"):
        with pytest.raises(ExportRefused, match="interleaved"):
            export_plan(even, target, options=TrainingOptions(virtual_stages=2))
