"""Every export runs as planned or is refused with a reason (issue 27).

On seeded random plans of the shapes the planner returns (uneven stages,
embedding-only and head-only stages, mixed GPU types, per-stage TP, every
TP/DP/PP mix, batches that are and are not whole micro-batches) and on plans
the planner returned, each target's rule is re-stated here from its source
(versions in the exporter modules), independently of the exporters:

* Megatron-LM: the shell line parsed by ``shlex``; layers per stage from the
  layout string or the first/last/even rules; ``RankGenerator``'s order
  ``tp-cp-ep-dp-pp``; the micro-batch calculator.
* DeepSpeed: ``PipelineModule`` builds ``layers[parts[s]:parts[s + 1]]`` on
  stage ``s``; topology axes ``pipe, data, model``; ``train_batch_size``.
  Megatron-DeepSpeed: the same over ``GPTModelPipe``'s specs, rebuilt here.
* torchtitan: ``ParallelDims`` (product, DDP only alone),
  ``pipeline_module_split`` by module names, the batch of ``train.py``,
  PyTorch's ``Schedule1F1B`` (no fewer micro-batches than stages); plain
  options: fp32 (``mixed_precision_param`` float32, else autocast runs bf16),
  ``[activation_checkpoint] mode = "none"`` (its default recomputes every
  second block) and TP 1 (its TP always shards the norms along the sequence).
  The training knobs: ``tests/test_export_knobs.py``.
* Alpa: ``ManualStageOption(**...)``, ``get_sliced_virtual_submeshes``'
  slicing of whole hosts, ``num_micro_batches``.
* Sailor: its reader's ``VMconfig(gpu_type, gpus_per_node, zone)``.

An export must build exactly the plan's stages, ranks and batch; a refusal
must be an :class:`ExportRefused` naming the reason and the targets that can.
Whether a target accepts is decided here too, so no plan is refused that the
target could launch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import numpy as np
import pytest
import tomllib

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.costmodel.megatron.tables import (
    plan_from_mixed_stages,
    plan_from_stages,
)
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import EXPORTS, export_plan

HOSTS = {"A-40": 4, "B-80": 8, "C-16": 2}
NUM_PLANS = 160


# ------------------------------------------------------------- random plans
def random_plan(seed: int) -> Plan3D:
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(1, 13))
    total = num_blocks + 2
    num_stages = 1 if rng.random() < 0.25 else int(rng.integers(2, min(total, 6) + 1))
    cuts = sorted(rng.choice(np.arange(1, total), num_stages - 1, replace=False))
    if num_stages > 2 and rng.random() < 0.3:  # embedding-only, head-only
        cuts = sorted({1, total - 1} | set(cuts[: num_stages - 3]))
    bounds = [0, *map(int, cuts), total]
    dp = int(rng.integers(1, 5))
    mbs = int(rng.choice([1, 2, 4]))
    steps = int(rng.integers(1, 9))
    gbs = mbs * dp * steps + (
        int(rng.integers(1, mbs * dp)) if mbs * dp > 1 and rng.random() < 0.15 else 0
    )
    kind = rng.random()
    edges = list(zip(bounds[:-1], bounds[1:], strict=True))
    if kind < 0.3:  # several GPU types, one TP degree
        tp = int(rng.choice([1, 2]))
        types = [str(rng.choice(list(HOSTS))) for _ in edges]
        pool = {gpu: 64 for gpu in HOSTS}
        return plan_from_mixed_stages(
            [(a, b, tp, gpu) for (a, b), gpu in zip(edges, types, strict=True)],
            dp=dp, mbs=mbs, gbs=gbs, model="m", pool=pool,
            gpus_per_node=HOSTS, zone="z",
        )  # fmt: skip
    gpu = str(rng.choice(list(HOSTS)))
    degrees = [t for t in (1, 2, 4, 8) if t <= HOSTS[gpu]]
    if kind < 0.55:  # a TP degree per stage
        tps = [int(rng.choice(degrees)) for _ in edges]
    else:
        tps = [int(rng.choice(degrees))] * len(edges)
    return plan_from_stages(
        [(a, b, t) for (a, b), t in zip(edges, tps, strict=True)],
        gpu_type=gpu, dp=dp, mbs=mbs, gbs=gbs, model="m",
        gpus_per_node=HOSTS[gpu], zone="z",
    )  # fmt: skip


PLANS = [random_plan(seed) for seed in range(NUM_PLANS)]


def test_the_random_plans_cover_every_shape():
    def has(test):
        return any(test(p) for p in PLANS)

    assert has(lambda p: p.stages[0].stop == 1 and p.num_stages > 1)
    assert has(lambda p: p.stages[-1].start == p.num_layers - 1 and p.num_stages > 1)
    assert has(lambda p: len(p.gpus_by_type()) > 1)
    assert has(lambda p: len({r.tp for s in p.stages for r in s.replicas}) > 1)
    assert has(lambda p: p.gbs % (p.mbs * p.dp) != 0)
    mixes = {
        (
            p.dp > 1,
            max(r.tp for s in p.stages for r in s.replicas) > 1,
            p.num_stages > 1,
        )
        for p in PLANS
    }
    assert len(mixes) == 8  # every TP/DP/PP mix


# --------------------------------------------------- what a plan is, in ranks
def tps(plan):
    return {r.tp for s in plan.stages for r in s.replicas}


def whole_batch(plan):
    return plan.gbs % (plan.mbs * plan.dp) == 0


def profile_layers(plan, stage):
    return list(range(plan.stages[stage].start, plan.stages[stage].stop))


def types_by_rank(text: str) -> dict[int, str]:
    """The ``#   ranks a-b: TYPE`` comment lines of an export."""
    out = {}
    for a, b, gpu in re.findall(r"#   ranks (\d+)-(\d+): (\S+) ", text):
        out.update(dict.fromkeys(range(int(a), int(b) + 1), gpu))
    return out


def check_ranks(plan, world, coords, named_types):
    """``coords(rank) -> (stage, replica)`` must cover each replica's TP group
    and, with several types, the named type of every rank must be its GPU's."""
    tp = next(iter(tps(plan)))
    assert world == plan.num_gpus
    seen = {}
    for rank in range(world):
        stage, replica = coords(rank)
        seen[(stage, replica)] = seen.get((stage, replica), 0) + 1
        if len(plan.gpus_by_type()) > 1:
            expected = plan.stages[stage].replicas[replica].gpu_type
            assert named_types[rank] == expected, rank
    assert seen == {(s, j): tp for s in range(plan.num_stages) for j in range(plan.dp)}


# ---------------------------------------------------------------- Megatron-LM
def megatron_layers(opts: dict, pp: int) -> list[list[str]]:
    """Layer kinds per stage under Megatron's rules ('E', 't', 'L')."""
    layers = int(opts["--num-layers"])
    if "--pipeline-model-parallel-layout" in opts:
        text = opts["--pipeline-model-parallel-layout"]
        text = re.sub(r"([ELt])\*(\d+)", lambda m: m[1] * int(m[2]), text)
        stages = [list(part) for part in text.split("|")]
        assert len(stages) == pp and sum(s.count("t") for s in stages) == layers
        return stages
    first = opts.get("--decoder-first-pipeline-num-layers")
    last = opts.get("--decoder-last-pipeline-num-layers")
    counts = [None] * pp
    if first is not None:
        counts[0] = int(first)
    if last is not None:
        counts[-1] = int(last)
    rest = [i for i in range(pp) if counts[i] is None]
    left = layers - sum(c for c in counts if c is not None)
    if rest:
        assert left % len(rest) == 0  # Megatron's even split of the rest
        for i in rest:
            counts[i] = left // len(rest)
    else:
        assert left == 0
    stages = [["t"] * c for c in counts]
    stages[0].insert(0, "E")
    stages[-1].append("L")
    return stages


def megatron_options(tokens: list[str]) -> dict[str, str | bool]:
    """``{flag: value}`` of an argument list (``True`` for a switch)."""
    opts, index = {}, 0
    while index < len(tokens):
        flag = tokens[index]
        assert flag.startswith("--") and flag not in opts, flag
        if index + 1 < len(tokens) and not tokens[index + 1].startswith("--"):
            opts[flag], index = tokens[index + 1], index + 2
        else:
            opts[flag], index = True, index + 1
    return opts


def check_megatron(plan, text, hosts):
    line = text.splitlines()[-1]
    assert text.startswith("# Megatron-LM (Megatron Core 0.16.1)")
    # A POSIX shell's words: '|', ';', '&' unquoted would end the command.
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    assert not any(set(t) <= set("|&;()<>") for t in tokens), line
    assert tokens[0] == "pretrain_gpt.py"
    opts = megatron_options(tokens[1:])
    tp = int(opts["--tensor-model-parallel-size"])
    pp = int(opts["--pipeline-model-parallel-size"])
    mbs, gbs = int(opts["--micro-batch-size"]), int(opts["--global-batch-size"])
    world = int(re.search(r"launch (\d+) processes", text)[1])
    dp = world // (tp * pp)
    assert world == tp * pp * dp
    # The micro-batch calculator: gbs = mbs x dp x micro-batches, exactly.
    assert gbs % (mbs * dp) == 0 and (mbs, gbs // (mbs * dp)) == (
        plan.mbs,
        plan.num_microbatches,
    )
    last = plan.num_layers - 1
    kinds = [
        ["E" if x == 0 else "L" if x == last else "t" for x in profile_layers(plan, s)]
        for s in range(plan.num_stages)
    ]
    assert megatron_layers(opts, pp) == kinds
    # RankGenerator, order tp-cp-ep-dp-pp (cp = ep = 1): tp fastest.
    check_ranks(
        plan, world, lambda r: (r // (tp * dp), (r // tp) % dp), types_by_rank(text)
    )


# ------------------------------------------------------------------ DeepSpeed
def check_parts(plan, pipe, names, to_profile):
    """``PipelineModule``: stage ``s`` builds ``layers[parts[s]:parts[s+1]]``."""
    layers, parts = pipe[names[0]], pipe[names[1]]
    assert len(parts) == pipe["num_stages"] + 1 == plan.num_stages + 1
    assert parts[0] == 0 and parts[-1] == len(layers)
    for s in range(plan.num_stages):
        built = layers[parts[s] : parts[s + 1]]
        assert sorted({to_profile(name) for name in built}) == profile_layers(plan, s)


def check_engine(plan, out, text):
    config, tp, dp = (
        out["ds_config"],
        out["model_parallel_size"],
        out["data_parallel_size"],
    )
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"]
        * config["gradient_accumulation_steps"]
        * dp
    )
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (
        plan.gbs,
        plan.mbs,
    )
    # PipeModelDataParallelTopology: axes pipe, data, model (model fastest).
    named = {}
    for block in out.get("gpu_types_by_rank", []):
        named.update(
            dict.fromkeys(
                range(block["ranks"][0], block["ranks"][1] + 1), block["gpu_type"]
            )
        )
    world = out["world_size"]
    assert world == plan.num_stages * dp * tp
    check_ranks(plan, world, lambda r: (r // (tp * dp), (r // tp) % dp), named)


def check_deepspeed(plan, text, hosts):
    out = json.loads(text)
    assert out["target"] == "DeepSpeed 0.19.8 PipelineModule"
    last = plan.num_layers - 1
    to_profile = {"embedding": 0, "head": last} | {
        f"transformer.{i}": i + 1 for i in range(last - 1)
    }
    check_parts(plan, out["pipeline_module"], ("layers", "parts"), to_profile.get)
    assert (
        "embedding, transformer layers, head" in out["pipeline_module"]["parts_index"]
    )
    check_engine(plan, out, text)


def check_megatron_deepspeed(plan, text, hosts):
    out = json.loads(text)
    assert out["target"].startswith("Megatron-DeepSpeed f4157bea")
    blocks = plan.num_layers - 2
    # GPTModelPipe's specs for a dense model (megatron/model/gpt_model.py).
    specs = ["cast", "embed"] + [f"block{i}" for i in range(blocks)] + ["norm", "head"]
    profile = [0, 0] + list(range(1, blocks + 1)) + [blocks + 1] * 2
    pipe = out["pipeline_module"]
    for names, half in (
        (("layers", "parts"), True),
        (("layers_fp32", "parts_fp32"), False),
    ):
        ours = specs + (["cast back"] if half else [])
        where = profile + ([blocks + 1] if half else [])
        assert len(pipe[names[0]]) == len(ours)
        index = {name: i for i, name in enumerate(pipe[names[0]])}
        check_parts(plan, pipe, names, lambda n, w=where, i=index: w[i[n]])
    tokens = out["arguments"]
    opts = dict(zip(tokens[:10:2], tokens[1:10:2], strict=True))
    assert int(opts["--num-layers"]) == blocks
    assert int(opts["--pipeline-model-parallel-size"]) == plan.num_stages
    assert (int(opts["--micro-batch-size"]), int(opts["--global-batch-size"])) == (
        plan.mbs,
        plan.gbs,
    )
    check_engine(plan, out, text)


# ----------------------------------------------------------------- torchtitan
def check_torchtitan(plan, text, hosts):
    assert text.startswith("# torchtitan v0.2.2 ")
    config = tomllib.loads(text)
    par, training = config["parallelism"], config["training"]
    # Plain fp32 without recomputation, each named (the defaults are not).
    assert (training["dtype"], training["mixed_precision_param"]) == (
        "float32",
        "float32",
    )
    assert config["activation_checkpoint"] == {"mode": "none"}
    rep, shard = (
        par["data_parallel_replicate_degree"],
        par["data_parallel_shard_degree"],
    )
    tp, pp = par["tensor_parallel_degree"], par["pipeline_parallel_degree"]
    world = rep * shard * tp * pp  # ParallelDims' product, cp = 1
    assert shard == 1  # no sharding: the plan prices plain replicas
    if rep > 1:
        assert world == rep  # parallelize_llama: DDP only alone
    batch_degree = rep * shard
    accumulation, rest = divmod(
        training["global_batch_size"], training["local_batch_size"] * batch_degree
    )
    assert rest == 0 and accumulation > 0
    if pp == 1:  # one forward/backward of local_batch_size per step
        micro, count = training["local_batch_size"], accumulation
    else:
        micro = par["pipeline_parallel_microbatch_size"]
        per_step, rest = divmod(training["local_batch_size"], micro)
        assert rest == 0
        count = accumulation * per_step
        assert par["pipeline_parallel_schedule"] == "1F1B"  # one stage per rank
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == pp
        last = plan.num_layers - 1
        for s, names in enumerate(parts):
            kept = set()
            for name in names:
                if name == "tok_embeddings":
                    kept.add(0)
                elif name in ("norm", "output"):
                    assert {"norm", "output"} <= set(names)
                    kept.add(last)
                else:
                    kept.add(int(name.removeprefix("layers.")) + 1)
            assert sorted(kept) == profile_layers(plan, s)
    assert (micro, count) == (plan.mbs, plan.num_microbatches)
    # Mesh pp, dp_replicate, fsdp, cp, tp: tp fastest.
    check_ranks(
        plan, world, lambda r: (r // (tp * rep), (r // tp) % rep), types_by_rank(text)
    )


# ----------------------------------------------------------------------- Alpa
@dataclasses.dataclass
class ManualStageOption:  # alpa/pipeline_parallel/stage_construction.py
    forward_stage_layer_ids: list
    submesh_physical_shapes: list
    submesh_logical_shapes: list
    submesh_autosharding_option_dicts: list


def alpa_slices(shapes, num_hosts, per_host):
    """Device ids ``(host, device)`` of each submesh, laid as Alpa slices the
    virtual mesh; ``None`` where Alpa's assertions fail."""
    free = [list(range(per_host)) for _ in range(num_hosts)]
    host = 0
    out = [None] * len(shapes)
    sizes = [a * b for a, b in shapes]
    for i in reversed(np.argsort(sizes, kind="stable")):
        rows, cols = shapes[i]
        if cols == per_host:
            if len(free[host]) != per_host or host + rows > num_hosts:
                return None
            out[i] = [(h, d) for h in range(host, host + rows) for d in free[h]]
            for h in range(host, host + rows):
                free[h] = []
            host += rows
        else:
            if rows != 1 or cols > len(free[host]):
                return None
            out[i] = [(host, d) for d in free[host][:cols]]
            free[host] = free[host][cols:]
            if not free[host]:
                host += 1
    return out if host == num_hosts and not any(free) else None


def alpa_shape(stage, per_host):
    tp, devices = stage.replicas[0].tp, stage.num_gpus
    if devices < per_host:
        return [1, devices]
    if devices % per_host == 0 and per_host % tp == 0:
        return [devices // per_host, per_host]
    return None


def alpa_accepts(plan, per_host):
    if len(plan.gpus_by_type()) > 1 or not whole_batch(plan):
        return False
    if plan.num_gpus % per_host or any(
        len({r.tp for r in s.replicas}) > 1 for s in plan.stages
    ):
        return False
    shapes = [alpa_shape(s, per_host) for s in plan.stages]
    return (
        None not in shapes
        and alpa_slices(shapes, plan.num_gpus // per_host, per_host) is not None
    )


def check_alpa(plan, text, hosts):
    out = json.loads(text)
    assert out["target"] == "alpa b8078a9 (1.0.0.dev0)"
    option = ManualStageOption(**out["manual_stage_option"])  # no TypeError
    init = out["alpa_init"]
    per_host = init["num_devices_per_node"]
    assert per_host == hosts[plan.stages[0].replicas[0].gpu_type]
    assert init["num_nodes"] * per_host == plan.num_gpus
    ids = option.forward_stage_layer_ids
    assert [x for stage in ids for x in stage] == list(range(out["layer_num"]))
    assert [list(s) for s in ids] == [
        profile_layers(plan, s) for s in range(plan.num_stages)
    ]
    slices = alpa_slices(option.submesh_physical_shapes, init["num_nodes"], per_host)
    assert slices is not None
    for stage, devices, logical, auto in zip(
        plan.stages, slices, option.submesh_logical_shapes,
        option.submesh_autosharding_option_dicts, strict=True,
    ):  # fmt: skip
        tp = stage.replicas[0].tp
        assert logical == [stage.dp, tp] and auto == {"force_batch_dim_to_mesh_dim": 0}
        for j in range(stage.dp):  # a TP group: a row of the logical mesh
            assert len({h for h, _ in devices[j * tp : (j + 1) * tp]}) == 1
    # PipeshardParallel splits the global batch into num_micro_batches parts,
    # each sharded over the data-parallel mesh axis.
    micro, rest = divmod(plan.gbs, out["num_micro_batches"])
    assert rest == 0 and micro == plan.mbs * plan.dp


# --------------------------------------------------------------------- Sailor
def check_sailor(plan, text, hosts):
    out = json.loads(text)
    assert out["target"].startswith("Sailor cf2c8e3")
    (pipe,) = out["pipeline_list"]
    assert (out["mbs"], out["gbs"]) == (plan.mbs, plan.gbs)
    assert pipe["num_stages"] == plan.num_stages
    assert pipe["dp"] == [s.dp for s in plan.stages]
    for s, (layers, replicas) in enumerate(
        zip(pipe["layers_per_stage"], pipe["tmp_per_stage"], strict=True)
    ):
        assert layers == profile_layers(plan, s)
        for replica, (vms, tp) in zip(plan.stages[s].replicas, replicas, strict=True):
            # Sailor's reader: VMconfig(gpu_type, gpus_per_node, zone).
            ((gpu_type, gpus_per_node, zone),) = vms
            assert (gpu_type, tp, zone) == (replica.gpu_type, replica.tp, replica.zone)
            node = hosts[gpu_type] if replica.node is not None else replica.tp
            assert gpus_per_node == node


# ------------------------------------------------------------------ the check
def accepts(plan, target, hosts):
    """Whether the target can launch the plan, by the rules above."""
    one_tp = len(tps(plan)) == 1
    if target in ("megatron", "deepspeed", "megatron-deepspeed"):
        return one_tp and whole_batch(plan)
    if target == "torchtitan":
        # TP always shards the norms along the sequence: not the plain plan.
        if max(tps(plan)) > 1:
            return False
        alone = plan.dp == 1 or plan.num_stages == 1
        # torch.distributed.pipelining.Schedule1F1B raises ValueError for
        # fewer micro-batches than stages.
        filled = plan.num_stages == 1 or (
            whole_batch(plan) and plan.num_microbatches >= plan.num_stages
        )
        return one_tp and whole_batch(plan) and alone and filled
    if target == "alpa":
        return alpa_accepts(plan, hosts[plan.stages[0].replicas[0].gpu_type])
    return True  # sailor: one pipeline, any plan


CHECKS = {
    "megatron": check_megatron,
    "deepspeed": check_deepspeed,
    "megatron-deepspeed": check_megatron_deepspeed,
    "torchtitan": check_torchtitan,
    "alpa": check_alpa,
    "sailor": check_sailor,
}


def check_export(plan, target, hosts):
    """Return ``"built"`` or ``"refused"``; fail on any silent difference."""
    expected = accepts(plan, target, hosts)
    try:
        text = export_plan(plan, target, gpus_per_node=hosts)
    except ExportRefused as refusal:
        message = str(refusal)
        assert not expected, f"{target} refused a plan it can launch: {message}"
        assert "\n" not in message
        assert message.startswith(f"cannot export this plan to {target}: ")
        able = [t for t in EXPORTS if t != target and accepts(plan, t, hosts)]
        if able:
            assert message.endswith(f"--export {', '.join(able)} can launch it")
        else:
            assert message.endswith("no export target can launch it")
        return "refused"
    assert expected, f"{target} exported a plan it cannot launch as planned"
    CHECKS[target](plan, text, hosts)
    return "built"


@pytest.mark.parametrize("target", EXPORTS)
def test_random_plans_build_as_planned_or_are_refused(target):
    outcomes = [check_export(plan, target, HOSTS) for plan in PLANS]
    # Both branches are exercised (sailor takes every plan).
    assert "built" in outcomes
    assert target == "sailor" or "refused" in outcomes


def test_torchtitan_refuses_fewer_micro_batches_than_stages():
    # benchmarks/check_exports.py: torchtitan's build_pipeline_schedule gave
    # PyTorch's Schedule1F1B 2 micro-batches for 3 stages, which it rejects.
    def plan(gbs):
        return plan_from_stages(
            [(0, 2, 1), (2, 4, 1), (4, 6, 1)], gpu_type="B-80", dp=1, mbs=1,
            gbs=gbs, model="m", gpus_per_node=8, zone="z",
        )  # fmt: skip

    with pytest.raises(ExportRefused, match="at least as many micro-batches"):
        export_plan(plan(2), "torchtitan")
    assert check_export(plan(2), "torchtitan", HOSTS) == "refused"
    assert check_export(plan(3), "torchtitan", HOSTS) == "built"
    assert "local_batch_size = 3" in export_plan(plan(3), "torchtitan")


# --------------------------------------------------- plans the planner returned
PLANNED = [
    ("OPT-350", {"V100-16": 6}, 16, {"uniform_tp": False, "allow_fewer_gpus": False}),
    ("OPT-350", {"GH-96": 16}, 64, {}),
    ("OPT-350", {"RTX-2080": 4}, 8, {}),
    ("GPT-Neo-2.7", {"GH-96": 64}, 1024, {}),
]


@pytest.mark.parametrize("setting", PLANNED, ids=lambda s: f"{s[0]}-{s[1]}-{s[2]}")
def test_planner_plans_build_as_planned_or_are_refused(setting):
    from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
    from pipedejavu.planning.training import plan_training

    model, pool, gbs, options = setting
    plan = plan_training(model, pool, gbs, **options).plan
    data = load_sailor_data()
    hosts = {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in pool}
    outcomes = {target: check_export(plan, target, hosts) for target in EXPORTS}
    if model == "OPT-350" and "V100-16" in pool:
        # The case: per-stage TP on 6 V100-16 (hosts of 4) gives Alpa
        # shapes [1, 4] and [1, 2], which do not fill whole hosts.
        assert outcomes["alpa"] == "refused"


def test_cli_refuses_an_export_the_target_cannot_launch(capsys, monkeypatch):
    import pipedejavu.cli.megatron as cli_megatron
    from pipedejavu.cli.main import main

    command = ["plan", "--model", "OPT-350", "--gpus", "GH-96:16"]
    # torchtitan: the search keeps data parallelism alone (its DDP) ...
    code = main([*command, "--global-batch", "64", "--export", "torchtitan"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tensor_parallel_degree = 1" in out and "pipeline_parallel_degree = 1" in out
    assert "data_parallel_replicate_degree = 16" in out
    assert "searched: data parallelism alone or none" in out
    # ... without that rule the best plan (TP 4 beside DP) is refused, one line
    import pipedejavu.planning.plan_model as plan_model

    monkeypatch.setattr(cli_megatron, "DATA_PARALLEL_ALONE", frozenset())
    monkeypatch.setattr(plan_model, "DATA_PARALLEL_ALONE", frozenset())
    code = main([*command, "--global-batch", "64", "--export", "torchtitan"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "FSDP/HSDP" in err
    # (searched with sequence parallelism, which torchtitan runs beside TP:
    # Megatron-LM launches it too)
    assert err.rstrip().endswith("--export megatron can launch it")
    assert main([*command, "--global-batch", "64", "--export", "megatron"]) == 0
    assert "--tensor-model-parallel-size 4" in capsys.readouterr()[0]
