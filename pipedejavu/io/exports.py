"""Export a :class:`~pipedejavu.core.plan3d.Plan3D` to what people launch.

Each target has its own module, which states the version it was checked
against and the rules it honours (read from that version's source; no code
copied); every exported file names that version:

========================  =====================================================
``megatron``              :mod:`pipedejavu.io.export_megatron` (Megatron Core
                          0.20 arguments, one shell-quoted line)
``deepspeed``             :mod:`pipedejavu.io.export_deepspeed` (DeepSpeed
                          0.16.5 ``PipelineModule`` ``parts`` of the abstract
                          list ``[embedding, blocks, head]``)
``megatron-deepspeed``    :mod:`pipedejavu.io.export_deepspeed` (the same on
                          Megatron-DeepSpeed's ``GPTModelPipe`` layer list)
``torchtitan``            :mod:`pipedejavu.io.export_torchtitan` (v0.2.2 TOML)
``alpa``                  :mod:`pipedejavu.io.export_alpa` (b8078a9
                          ``ManualStageOption`` and micro-batches)
``sailor``                :func:`pipedejavu.io.sailor_plan.plan_to_sailor`
========================  =====================================================

An export either builds exactly the plan's stages, the ranks of each stage's
replicas (TP fastest, then data, then pipeline: :mod:`pipedejavu.io.export_rules`)
and its batch, or is refused with :class:`~pipedejavu.io.export_rules.ExportRefused`,
one line saying why and which targets can launch the plan instead. A plan on
several GPU types names the type of each block of global ranks (a comment in
the Megatron arguments and the torchtitan TOML, ``gpu_types_by_rank`` in the
DeepSpeed JSON); order the hosts so that those ranks land on them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pipedejavu.core.plan3d import Plan3D, check_nodes
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.export_alpa import to_alpa
from pipedejavu.io.export_deepspeed import to_deepspeed, to_megatron_deepspeed
from pipedejavu.io.export_megatron import megatron_text
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.export_torchtitan import to_torchtitan
from pipedejavu.io.sailor_plan import plan_to_sailor

__all__ = ["EXPORTS", "SAILOR_VERSION", "export_plan"]

EXPORTS = (
    "megatron",
    "deepspeed",
    "megatron-deepspeed",
    "torchtitan",
    "alpa",
    "sailor",
)
#: Sailor's plan reader the ``plan_config`` export was checked against.
SAILOR_VERSION = "Sailor cf2c8e3 (2025-08-14) plan_config"


def _build(plan: Plan3D, target: str, gpus_per_node: Mapping[str, int] | None) -> str:
    if target == "megatron":
        return megatron_text(plan)
    if target == "deepspeed":
        return json.dumps(to_deepspeed(plan), indent=1) + "\n"
    if target == "megatron-deepspeed":
        return json.dumps(to_megatron_deepspeed(plan), indent=1) + "\n"
    if target == "torchtitan":
        return to_torchtitan(plan)
    if target == "alpa":
        gpu = plan.stages[0].replicas[0].gpu_type
        per_host = (gpus_per_node or {}).get(gpu)
        return json.dumps(to_alpa(plan, gpus_per_host=per_host), indent=1) + "\n"
    if target == "sailor":
        data = {"target": SAILOR_VERSION}
        data.update(plan_to_sailor(plan, gpus_per_node=gpus_per_node))
        return json.dumps(data, indent=2) + "\n"
    raise ProblemError(f"export must be one of {', '.join(EXPORTS)}, got {target!r}")


def export_plan(
    plan: Plan3D, target: str, *, gpus_per_node: Mapping[str, int] | None = None
) -> str:
    """The export for ``target`` (:data:`EXPORTS`) as text.

    Args:
        plan: the plan.
        target: one of :data:`EXPORTS`.
        gpus_per_node: GPUs per node of each type; with it, no node of the plan
            may hold more GPUs than that
            (:func:`~pipedejavu.core.plan3d.check_nodes`). Alpa needs it (its
            mesh is whole hosts), and Sailor for a plan that places replicas on
            nodes.

    Raises:
        ExportRefused: the target cannot launch the plan as planned; one line
            with the reason and the targets that can.
        ProblemError: an unknown target, or nodes that hold too many GPUs.
    """
    if target not in EXPORTS:
        raise ProblemError(
            f"export must be one of {', '.join(EXPORTS)}, got {target!r}"
        )
    if gpus_per_node is not None:
        check_nodes(plan, lambda gpu: gpus_per_node[gpu])
    try:
        return _build(plan, target, gpus_per_node)
    except ExportRefused as refusal:
        able = []
        for other in EXPORTS:
            if other == target:
                continue
            try:
                _build(plan, other, gpus_per_node)
            except ProblemError:
                continue
            able.append(other)
        instead = (
            f"--export {', '.join(able)} can launch it"
            if able
            else "no export target can launch it"
        )
        raise ExportRefused(
            f"cannot export this plan to {target}: {refusal}; {instead}"
        ) from None
