"""Alpa's manual stage options for a plan.

Checked against Alpa at commit b8078a9 (1.0.0.dev0;
``alpa/pipeline_parallel/stage_construction.py``: ``ManualStageOption``,
``get_sliced_virtual_submeshes``; ``alpa/api.py``: ``init``;
``alpa/parallel_method.py``: ``PipeshardParallel``; no code copied):

* The file holds three objects: ``alpa_init`` (``alpa.init(cluster="ray",
  num_nodes=..., num_devices_per_node=...)``), ``manual_stage_option``
  (exactly ``ManualStageOption``'s four keyword arguments) and, beside them,
  ``num_micro_batches`` for ``PipeshardParallel(num_micro_batches=...,
  stage_option=ManualStageOption(**manual_stage_option))``. The model must be
  clustered into the plan's ``L + 2`` layers (``layer_num``).
* A stage of ``dp`` replicas of ``tp`` GPUs gets the logical mesh
  ``(dp, tp)`` with ``{"force_batch_dim_to_mesh_dim": 0}`` (data parallel
  along the first axis) and the physical shape ``(1, dp tp)`` inside one host
  or ``(dp tp / G, G)`` on whole hosts of ``G`` GPUs.
* Alpa's mesh is whole hosts of ``G`` GPUs, all used: the plan's GPUs must
  fill ``num_nodes`` hosts exactly. The submeshes are laid largest first
  (ties: later stage first): one of ``G`` GPUs per row takes whole hosts and
  must start on a fresh host; a smaller one must fit in what is left of the
  current host (:func:`slice_hosts`). A plan whose shapes cannot be laid so
  is refused, as are a TP group that would cross hosts, replicas of one stage
  with different TP degrees and plans on several GPU types (Alpa's options
  name none). A plan with experts is refused (:data:`NO_EXPERTS`).
"""

from __future__ import annotations

from typing import Any

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    refuse_experts,
)

__all__ = ["ALPA_VERSION", "NO_EXPERTS", "slice_hosts", "to_alpa"]

ALPA_VERSION = "alpa b8078a9 (1.0.0.dev0)"
#: Why a plan with experts is refused.
NO_EXPERTS = (
    f"{ALPA_VERSION}'s ManualStageOption gives each stage a mesh and leaves "
    "the sharding inside it to Alpa's own search: it cannot be told the "
    "plan's expert layout (Megatron-Core's EP and expert TP)"
)


def slice_hosts(shapes: list[list[int]], num_hosts: int, per_host: int) -> str | None:
    """Lay physical submesh shapes on ``num_hosts`` hosts of ``per_host`` GPUs
    in Alpa's order (module docstring); ``None`` if they fit, else why not."""
    sizes = [rows * cols for rows, cols in shapes]
    if sum(sizes) != num_hosts * per_host:
        return f"the submeshes hold {sum(sizes)} GPUs, the mesh {num_hosts * per_host}"
    order = sorted(range(len(shapes)), key=lambda i: (sizes[i], i), reverse=True)
    host, device = 0, 0
    for index in order:
        rows, cols = shapes[index]
        if cols == per_host:
            if device != 0:
                return (
                    f"stage {index}'s {rows}x{cols} submesh needs whole hosts, but "
                    f"host {host} is partly taken"
                )
            host += rows
        elif rows != 1 or device + cols > per_host:
            return (
                f"stage {index}'s {rows}x{cols} submesh does not fit in the "
                f"{per_host - device} GPUs left on host {host}"
            )
        else:
            device += cols
            if device == per_host:
                host, device = host + 1, 0
    if host != num_hosts or device != 0:  # pragma: no cover - sizes add up
        return "the submeshes do not fill the hosts"
    return None


def to_alpa(
    plan: Plan3D,
    *,
    gpus_per_host: int | None,
    spec: TransformerSpec | None = None,
) -> dict[str, Any]:
    """Alpa's ``init``, ``ManualStageOption`` and micro-batch count
    (module docstring).

    Args:
        plan: the plan (one GPU type).
        gpus_per_host: GPUs per host of that type (``None``: refused, as the
            mesh cannot be laid out without it).
        spec: the model (a mixture of experts is refused).

    Raises:
        ExportRefused: naming what Alpa cannot launch.
    """
    target = ALPA_VERSION
    refuse_experts(plan, spec, NO_EXPERTS)
    if len(plan.gpus_by_type()) > 1:
        raise ExportRefused(
            f"{target}'s ManualStageOption cannot name GPU types; the plan uses "
            f"{', '.join(sorted(plan.gpus_by_type()))}"
        )
    check_whole_batch(plan, target)
    if gpus_per_host is None:
        raise ExportRefused(f"{target}'s mesh needs the GPUs per host (not given)")
    per_host = gpus_per_host
    if plan.num_gpus % per_host:
        raise ExportRefused(
            f"{target}'s mesh is whole hosts of {per_host} GPUs, all used; the plan "
            f"uses {plan.num_gpus} GPUs"
        )
    physical, logical = [], []
    for index, stage in enumerate(plan.stages):
        tps = {r.tp for r in stage.replicas}
        if len(tps) != 1:
            raise ExportRefused(
                f"{target} gives stage {index} one logical mesh (dp, tp); its "
                f"replicas use TP degrees {sorted(tps)}"
            )
        tp = tps.pop()
        devices = stage.dp * tp
        if devices < per_host:
            physical.append([1, devices])
        elif devices % per_host == 0 and per_host % tp == 0:
            physical.append([devices // per_host, per_host])
        else:
            raise ExportRefused(
                f"{target} cannot lay stage {index} ({stage.dp} x tp {tp} = "
                f"{devices} GPUs) on hosts of {per_host}: a submesh is part of one "
                "host or whole hosts, and a TP group stays in one host"
            )
        logical.append([stage.dp, tp])
    num_hosts = plan.num_gpus // per_host
    why = slice_hosts(physical, num_hosts, per_host)
    if why is not None:
        raise ExportRefused(
            f"{target} cannot slice its {num_hosts} x {per_host} mesh into the "
            f"plan's submeshes {physical}: {why}"
        )
    return {
        "target": target,
        "alpa_init": {"num_nodes": num_hosts, "num_devices_per_node": per_host},
        "layer_num": plan.num_layers,
        "num_micro_batches": plan.num_microbatches,
        "manual_stage_option": {
            "forward_stage_layer_ids": [
                list(range(s.start, s.stop)) for s in plan.stages
            ],
            "submesh_physical_shapes": physical,
            "submesh_logical_shapes": logical,
            "submesh_autosharding_option_dicts": [
                {"force_batch_dim_to_mesh_dim": 0} for _ in plan.stages
            ],
        },
    }
