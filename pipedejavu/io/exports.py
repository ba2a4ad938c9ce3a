"""Export a :class:`~pipedejavu.core.plan3d.Plan3D` to what people launch.

Each exporter states the version it targets and the rules it honours (read from
that version's documentation and source; no code copied):

* **Megatron-LM** (Megatron Core 0.20, ``megatron/training/arguments.py``):
  ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--micro-batch-size``, ``--global-batch-size``, ``--num-layers`` (transformer
  layers). An even split needs nothing more; uneven first/last stages with equal
  middle stages use ``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers`` (the middle layers must divide evenly
  among the middle stages); any other split uses
  ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` transformer layer,
  ``L`` loss, stages split by ``|``, ``t*n`` repeats). Data parallelism is the
  world size over ``TP x PP``: launch ``TP x PP x DP`` processes.
* **DeepSpeed** (0.16.5, ``deepspeed/runtime/pipe/module.py`` and
  ``runtime/config.py``): ``PipelineModule`` keeps the stage boundaries in
  ``parts`` (stage ``s`` holds ``layers[parts[s]:parts[s + 1]]``); its built-in
  ``partition_method`` values (``parameters``, ``uniform``, ``type:...``) cannot
  express an arbitrary split, so the export gives ``parts`` for the layer list
  ``[embedding, transformer layers..., head]`` (our profile's layers) to set in a
  ``_partition_layers`` override, plus the engine config, whose batch rule is
  ``train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x data-parallel size``.
* **torchtitan** (v0.2.2, ``torchtitan/config/job_config.py``, TOML job files):
  a ``[parallelism]`` section (``data_parallel_replicate_degree``,
  ``data_parallel_shard_degree = 1``: replicas, no FSDP sharding, as ZeRO is off
  in the predicted run; ``tensor_parallel_degree``, ``pipeline_parallel_degree``,
  ``pipeline_parallel_schedule = "1F1B"``, ``pipeline_parallel_microbatch_size``,
  ``module_fqns_per_model_part`` with torchtitan's decoder module names
  ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``) and the batch sizes
  of ``[training]``.
* **Alpa** (1.0.0.dev0, ``alpa/pipeline_parallel/stage_construction.py``):
  ``ManualStageOption(forward_stage_layer_ids, submesh_physical_shapes,
  submesh_logical_shapes, submesh_autosharding_option_dicts)``: a stage of
  ``dp x tp`` GPUs gets the physical shape ``(1, dp tp)`` inside one host or
  ``(dp tp / G, G)`` across hosts of ``G`` GPUs, the logical mesh ``(dp, tp)``,
  and ``{"force_batch_dim_to_mesh_dim": 0}`` (data parallel along the first
  mesh axis). The model must be clustered into the plan's ``L + 2`` layers.
* **Sailor** ``plan_config`` JSON: :func:`pipedejavu.io.sailor_plan.plan_to_sailor`
  (round trip with the reader).

Megatron-LM, DeepSpeed and torchtitan run one TP degree for every stage; a plan
with per-stage degrees is refused with a :class:`ProblemError`.

**Plans on several GPU types.** The three launch the same rank order: TP
fastest, then data parallelism, then the pipeline stage (Megatron Core's
default ``tp-cp-ep-dp-pp``; DeepSpeed's ``PipeModelDataParallelTopology`` axes
``pipe, data, model``; torchtitan's mesh ``pp, dp_replicate, dp_shard, cp,
tp``), so replica ``j`` of stage ``s`` is global ranks ``(s dp + j) tp`` to
``(s dp + j + 1) tp - 1``. When a plan's GPUs are of several types the export
says which rank blocks need which type (:func:`gpu_types_by_rank`): a comment in
the Megatron arguments and the torchtitan TOML, a ``gpu_types_by_rank`` entry in
the DeepSpeed JSON. Order the hosts so that those ranks land on them; a block
that does not fill whole hosts needs per-host process counts (DeepSpeed's
hostfile ``slots``). Alpa's ``ManualStageOption`` has no way to name GPU types,
so such a plan is refused for Alpa (the Sailor ``plan_config`` names the type of
every replica).
"""

from __future__ import annotations

import json
from typing import Any

from pipedejavu.core.plan3d import Plan3D, check_nodes
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.sailor_plan import plan_to_sailor

__all__ = [
    "EXPORTS",
    "export_plan",
    "gpu_types_by_rank",
    "to_alpa",
    "to_deepspeed",
    "to_megatron",
    "to_torchtitan",
]

EXPORTS = ("megatron", "deepspeed", "torchtitan", "alpa", "sailor")


def _uniform_tp(plan: Plan3D, target: str) -> int:
    tps = {r.tp for s in plan.stages for r in s.replicas}
    if len(tps) != 1:
        raise ProblemError(
            f"{target} runs one tensor-parallel degree for every stage; the plan "
            f"uses {sorted(tps)} (plan with uniform TP)"
        )
    return tps.pop()


def gpu_types_by_rank(plan: Plan3D) -> list[dict[str, Any]]:
    """Consecutive global-rank blocks of one GPU type (module docstring):
    ``{"ranks": [first, last], "gpu_type", "stages": [first, last]}``."""
    tp = _uniform_tp(plan, "the launch rank order")
    blocks: list[dict[str, Any]] = []
    for index, stage in enumerate(plan.stages):
        for j, replica in enumerate(stage.replicas):
            first = (index * plan.dp + j) * tp
            last = first + tp - 1
            if blocks and blocks[-1]["gpu_type"] == replica.gpu_type:
                blocks[-1]["ranks"][1] = last
                blocks[-1]["stages"][1] = index
            else:
                blocks.append(
                    {
                        "ranks": [first, last],
                        "gpu_type": replica.gpu_type,
                        "stages": [index, index],
                    }
                )
    return blocks


def _type_comment(plan: Plan3D) -> str:
    """Comment lines naming each rank block's GPU type (several types only)."""
    if len(plan.gpus_by_type()) < 2:
        return ""
    lines = ["# GPU types by global rank (TP fastest, then data, then pipeline):"]
    for block in gpu_types_by_rank(plan):
        (r0, r1), (s0, s1) = block["ranks"], block["stages"]
        stages = f"stage {s0}" if s0 == s1 else f"stages {s0}-{s1}"
        lines.append(f"#   ranks {r0}-{r1}: {block['gpu_type']} ({stages})")
    lines.append(
        "#   order the hosts so these ranks land on GPUs of that type (a block "
        "that does not fill whole hosts needs per-host process counts)"
    )
    return "\n".join(lines) + "\n"


def _transformer_layers(plan: Plan3D) -> list[int]:
    """Transformer layers per stage (profile layers 1..L; 0 and L + 1 are the
    embedding and the head)."""
    last = plan.num_layers - 1
    return [
        sum(1 for layer in range(s.start, s.stop) if 0 < layer < last)
        for s in plan.stages
    ]


def to_megatron(plan: Plan3D) -> list[str]:
    """Megatron-LM arguments (module docstring); one string per token."""
    tp = _uniform_tp(plan, "Megatron-LM")
    counts = _transformer_layers(plan)
    num_layers, stages = sum(counts), len(counts)
    args = [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(stages),
        "--micro-batch-size",
        str(plan.mbs),
        "--global-batch-size",
        str(plan.gbs),
        "--num-layers",
        str(num_layers),
    ]
    if stages == 1 or len(set(counts)) == 1:
        return args  # Megatron's even split
    middle = counts[1:-1]
    if min(counts) > 0 and len(set(middle)) <= 1:
        # Megatron divides what first/last leave evenly over the other stages.
        even = middle[0] if middle else None
        if counts[0] != even:
            args += ["--decoder-first-pipeline-num-layers", str(counts[0])]
        if middle and counts[-1] != even:
            args += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
        return args
    parts = []
    for index, count in enumerate(counts):
        text = "E" if index == 0 else ""
        text += f"t*{count}" if count > 1 else ("t" if count == 1 else "")
        text += "L" if index == stages - 1 else ""
        parts.append(text)
    return args + ["--pipeline-model-parallel-layout", "|".join(parts)]


def to_deepspeed(plan: Plan3D) -> dict[str, Any]:
    """DeepSpeed's partition and engine config (module docstring)."""
    _uniform_tp(plan, "DeepSpeed")
    out = {
        "target": "DeepSpeed 0.16.5 PipelineModule",
        "pipeline_module": {
            "num_stages": plan.num_stages,
            "layers": ["embedding"]
            + [f"transformer.{i}" for i in range(plan.num_layers - 2)]
            + ["head"],
            "parts": [s.start for s in plan.stages] + [plan.num_layers],
        },
        "ds_config": {
            "train_batch_size": plan.gbs,
            "train_micro_batch_size_per_gpu": plan.mbs,
            "gradient_accumulation_steps": plan.num_microbatches,
        },
        "world_size": plan.num_gpus,
        "model_parallel_size": plan.stages[0].replicas[0].tp,
        "data_parallel_size": plan.dp,
    }
    if len(plan.gpus_by_type()) > 1:
        out["gpu_types_by_rank"] = gpu_types_by_rank(plan)
    return out


def _fqns(plan: Plan3D) -> list[list[str]]:
    last = plan.num_layers - 1
    out = []
    for stage in plan.stages:
        names = []
        for layer in range(stage.start, stage.stop):
            if layer == 0:
                names.append("tok_embeddings")
            elif layer == last:
                names += ["norm", "output"]
            else:
                names.append(f"layers.{layer - 1}")
        out.append(names)
    return out


def to_torchtitan(plan: Plan3D) -> str:
    """A torchtitan v0.2.2 TOML fragment: ``[parallelism]`` and batch sizes."""
    tp = _uniform_tp(plan, "torchtitan")
    fqns = ",\n    ".join(json.dumps(part) for part in _fqns(plan))
    return (
        "# torchtitan v0.2.2 job config fragment (pipedejavu plan)\n"
        + _type_comment(plan)
        + "[training]\n"
        f"local_batch_size = {plan.gbs // plan.dp}\n"
        f"global_batch_size = {plan.gbs}\n"
        "\n[parallelism]\n"
        f"data_parallel_replicate_degree = {plan.dp}\n"
        "data_parallel_shard_degree = 1\n"
        f"tensor_parallel_degree = {tp}\n"
        f"pipeline_parallel_degree = {plan.num_stages}\n"
        'pipeline_parallel_schedule = "1F1B"\n'
        f"pipeline_parallel_microbatch_size = {plan.mbs}\n"
        f"module_fqns_per_model_part = [\n    {fqns},\n]\n"
    )


def to_alpa(plan: Plan3D, gpus_per_host: int | None = None) -> dict[str, Any]:
    """Alpa's ``ManualStageOption`` fields (module docstring)."""
    if len(plan.gpus_by_type()) > 1:
        raise ProblemError(
            "Alpa's ManualStageOption cannot name GPU types; this plan uses "
            f"{', '.join(plan.gpus_by_type())} (export it to Sailor's plan_config, "
            "Megatron-LM, DeepSpeed or torchtitan instead)"
        )
    physical, logical = [], []
    for stage in plan.stages:
        tp = max(r.tp for r in stage.replicas)
        devices = stage.dp * tp
        per_host = gpus_per_host or devices
        if devices <= per_host:
            physical.append([1, devices])
        elif devices % per_host == 0:
            physical.append([devices // per_host, per_host])
        else:
            raise ProblemError(
                f"Alpa needs whole hosts for a stage larger than a host: {devices} "
                f"GPUs on hosts of {per_host}"
            )
        logical.append([stage.dp, tp])
    return {
        "target": "alpa 1.0.0.dev0 ManualStageOption",
        "forward_stage_layer_ids": [list(range(s.start, s.stop)) for s in plan.stages],
        "submesh_physical_shapes": physical,
        "submesh_logical_shapes": logical,
        "submesh_autosharding_option_dicts": [
            {"force_batch_dim_to_mesh_dim": 0} for _ in plan.stages
        ],
        "num_micro_batches": plan.num_microbatches,
    }


def export_plan(plan: Plan3D, target: str, *, gpus_per_node: int | None = None) -> str:
    """The export for ``target`` (:data:`EXPORTS`) as text.

    With ``gpus_per_node`` (of a plan on one GPU type), no node of the plan may
    hold more GPUs than that (:func:`~pipedejavu.core.plan3d.check_nodes`).
    """
    if gpus_per_node is not None:
        check_nodes(plan, lambda _gpu: gpus_per_node)
    if target == "megatron":
        args = to_megatron(plan)
        world = plan.num_gpus
        return (
            f"# Megatron-LM (core 0.20): launch {world} processes "
            f"(TP x PP x DP = {world})\n" + _type_comment(plan) + " ".join(args) + "\n"
        )
    if target == "deepspeed":
        return json.dumps(to_deepspeed(plan), indent=1) + "\n"
    if target == "torchtitan":
        return to_torchtitan(plan)
    if target == "alpa":
        return json.dumps(to_alpa(plan, gpus_per_node), indent=1) + "\n"
    if target == "sailor":
        return json.dumps(plan_to_sailor(plan), indent=2) + "\n"
    raise ProblemError(f"export must be one of {', '.join(EXPORTS)}, got {target!r}")
