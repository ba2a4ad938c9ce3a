"""Rules every exporter shares: what a launcher needs of a plan, and the rank
order the launchers agree on.

An exporter either writes a file its target runs exactly as planned (the
stages, the ranks of every stage's replicas and the batch) or refuses the plan
with a :class:`ExportRefused` that says why. :mod:`pipedejavu.io.exports` adds
which other targets can launch the plan.

**Rank order.** Megatron-LM (``RankGenerator`` order ``tp-cp-ep-dp-pp``),
DeepSpeed (``PipeModelDataParallelTopology`` axes ``pipe, data, model``) and
torchtitan (mesh ``pp, dp_replicate, fsdp, cp, tp``) all put TP fastest, then
data parallelism, then the pipeline stage: replica ``j`` of stage ``s`` is
global ranks ``(s dp + j) m`` to ``(s dp + j + 1) m - 1``, ``m = tp cp``
(:meth:`~pipedejavu.core.layout.ParallelLayout.replica_ranks` of
:func:`launch_layout`).
"""

from __future__ import annotations

from typing import Any

from pipedejavu.core.layout import ParallelLayout
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec

__all__ = [
    "check_sharding",
    "megatron_parallel_args",
    "ExportRefused",
    "has_experts",
    "refuse_experts",
    "uniform_experts",
    "check_model_layers",
    "check_whole_batch",
    "head_layers",
    "num_blocks",
    "gpu_types_by_rank",
    "launch_layout",
    "transformer_layers",
    "type_comment",
    "uniform_tp",
]


class ExportRefused(ProblemError):
    """The target cannot launch the plan as planned; the message says why."""


def uniform_tp(plan: Plan3D, target: str) -> int:
    """The plan's one TP degree.

    Raises:
        ExportRefused: the stages (or replicas) use several degrees.
    """
    tps = {r.tp for s in plan.stages for r in s.replicas}
    if len(tps) != 1:
        raise ExportRefused(
            f"{target} runs one tensor-parallel degree for every stage; the plan "
            f"uses {sorted(tps)}"
        )
    return next(iter(tps))


def has_experts(plan: Plan3D, spec: TransformerSpec | None = None) -> bool:
    """Whether the plan lays out expert layers: a stage of its layout with
    ``ep > 1`` or an expert TP other than its TP, or a ``spec`` with
    experts."""
    if spec is not None and spec.moe is not None:
        return True
    return any(a.ep > 1 or a.expert_tp != a.tp for a in plan.layout.stages)


def refuse_experts(plan: Plan3D, spec: TransformerSpec | None, why: str) -> None:
    """The targets that run dense grouped-query-attention blocks only: refuse
    a plan with experts (:func:`has_experts`), and a model with multi-latent
    attention or multi-token-prediction layers (they would write another
    model's blocks; ``--export megatron`` writes them).

    Raises:
        ExportRefused: ``why``, with the plan's expert axes; or what of the
            model's attention and MTP the target would not write.
    """
    if has_experts(plan, spec):
        axes = sorted({(a.ep, a.expert_tp) for a in plan.layout.stages})
        shown = ", ".join(f"EP {ep} x expert TP {etp}" for ep, etp in axes)
        raise ExportRefused(f"{why} (the plan's experts: {shown})")
    if spec is None or (spec.mla is None and not spec.mtp_layers):
        return
    parts = ["multi-latent attention"] if spec.mla is not None else []
    parts += [f"{spec.mtp_layers} multi-token-prediction layers"] * bool(
        spec.mtp_layers
    )
    raise ExportRefused(
        f"this target writes grouped-query attention blocks and no multi-token "
        f"prediction: {spec.name}'s {' and '.join(parts)} would be launched as "
        "another model (--export megatron writes them)"
    )


def uniform_experts(plan: Plan3D, target: str) -> tuple[int, int]:
    """The plan's one ``(ep, expert TP)`` for every stage (the launchers take
    one ``--expert-model-parallel-size`` and one
    ``--expert-tensor-parallel-size``).

    Raises:
        ExportRefused: the stages use several.
    """
    axes = sorted({(a.ep, a.expert_tp) for a in plan.layout.stages})
    if len(axes) != 1:
        shown = ", ".join(f"EP {ep} x expert TP {etp}" for ep, etp in axes)
        raise ExportRefused(
            f"{target} runs one expert-parallel and one expert tensor-parallel "
            f"degree for every stage; the plan uses {shown}"
        )
    return axes[0]


def check_whole_batch(plan: Plan3D, target: str) -> None:
    """The launchers split the global batch into ``gbs / (mbs dp)`` whole
    micro-batches per pipeline (Megatron's micro-batch calculator, DeepSpeed's
    ``train_batch_size`` rule, torchtitan's gradient accumulation, Alpa's
    ``num_micro_batches``); a plan priced with a rounded-up count would run a
    different batch.

    Raises:
        ExportRefused: ``gbs`` is not a multiple of ``mbs x dp``.
    """
    if plan.gbs % (plan.mbs * plan.dp):
        raise ExportRefused(
            f"{target} needs the global batch {plan.gbs} to be a multiple of "
            f"micro-batch x data parallelism = {plan.mbs} x {plan.dp}"
        )
    if plan.num_layers < 3:
        raise ExportRefused(
            f"{target} needs an embedding, transformer layers and a head; the plan "
            f"covers {plan.num_layers} profile layers"
        )


def check_model_layers(plan: Plan3D, spec: TransformerSpec | None) -> None:
    """The plan's profile layers must be the model's: the embedding, its
    ``L`` transformer blocks, then the final norm and the LM head (one layer,
    or two with ``split_head_layer``, as in Sailor's ``LLAMA-3-8`` profile).
    A launcher told another block count builds another model (Megatron-LM
    accepts any ``--num-layers``), so every export checks it.

    Raises:
        ProblemError: the plan covers another number of layers than ``spec``
            has (``None``: nothing to check against).
    """
    if spec is None or plan.num_layers == spec.num_profile_layers:
        return
    head = "final norm and LM head" + (
        " apart" if spec.split_head_layer else " as one layer"
    )
    raise ProblemError(
        f"the plan covers {plan.num_layers} profile layers, but {spec.name} has "
        f"{spec.num_profile_layers} (the embedding, {spec.num_layers} transformer "
        f"blocks, the {head}): a plan for another model?"
    )


def num_blocks(plan: Plan3D, spec: TransformerSpec | None = None) -> int:
    """The model's transformer blocks ``L``: profile layers ``1..L``
    (``spec`` ``None``: the convention of one embedding and one head layer,
    ``plan.num_layers - 2``).

    Raises:
        ProblemError: as :func:`check_model_layers`.
    """
    check_model_layers(plan, spec)
    return plan.num_layers - 2 if spec is None else spec.num_layers


def head_layers(plan: Plan3D, spec: TransformerSpec | None = None) -> int:
    """Profile layers after the blocks: 1 (the final norm with the LM head)
    or 2 (norm, then head: ``split_head_layer``)."""
    return plan.num_layers - 1 - num_blocks(plan, spec)


def transformer_layers(plan: Plan3D, spec: TransformerSpec | None = None) -> list[int]:
    """Transformer blocks per stage (profile layers ``1..L``, ``L`` from
    :func:`num_blocks`; ``0`` is the embedding, the layers after ``L`` the
    final norm and the LM head)."""
    blocks = num_blocks(plan, spec)
    return [
        sum(1 for layer in range(s.start, s.stop) if 0 < layer <= blocks)
        for s in plan.stages
    ]


def launch_layout(plan: Plan3D) -> ParallelLayout:
    """The plan's layout in the launchers' default order (module docstring).

    Raises:
        ProblemError: TP degrees that differ (the launchers run one).
    """
    tp = uniform_tp(plan, "the launch rank order")
    return ParallelLayout.uniform(
        tp=tp, pp=plan.num_stages, dp=plan.dp, cp=plan.layout.cp
    )


def gpu_types_by_rank(plan: Plan3D) -> list[dict[str, Any]]:
    """Consecutive global-rank blocks of one GPU type (module docstring):
    ``{"ranks": [first, last], "gpu_type", "stages": [first, last]}``."""
    layout = launch_layout(plan)
    blocks: list[dict[str, Any]] = []
    for index, stage in enumerate(plan.stages):
        firsts = layout.replica_ranks(index)
        for replica, first in zip(stage.replicas, firsts, strict=True):
            last = first + layout.model_size(index) - 1
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


def type_comment(plan: Plan3D) -> str:
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


def megatron_parallel_args(
    tp: int, stages: int, plan: Plan3D, num_layers: int
) -> list[str]:
    """Megatron's parallel and batch arguments of a plan (Megatron-LM's and
    Megatron-DeepSpeed's alike): TP, PP, the micro-batch and global batch,
    and the transformer layers."""
    return [
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


def check_sharding(plan: Plan3D, target: str, options: TrainingOptions | None) -> None:
    """Refuse sharded gradients or parameters (ZeRO-2/3) and context
    parallelism where the target's export does not write them (torchtitan's
    checks its own: :mod:`pipedejavu.io.export_torchtitan`)."""
    if target == "torchtitan":
        return
    stage = 0 if options is None else options.zero_stage
    if stage > 1:
        raise ExportRefused(
            f"{target}: the plan shards its "
            f"{'gradients' if stage == 2 else 'parameters and gradients'} "
            f"(ZeRO-{stage}); the export writes the optimizer's sharding at most "
            "(Megatron-LM's FSDP and DeepSpeed's ZeRO-2/3 are not written yet)"
        )
    if plan.layout.cp > 1 and target != "megatron":
        raise ExportRefused(
            f"{target}: the plan runs context parallelism {plan.layout.cp}, which "
            "its export does not write"
        )
