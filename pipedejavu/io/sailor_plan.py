"""Sailor's ``plan_config`` JSON <-> :class:`~pipedejavu.core.plan3d.Plan3D`.

The format (Sailor planner, github.com/eth-easl/sailor, as its runtime and its
validation runs use it)::

    {"zone": "us-central1-a", "mbs": 8, "gbs": 1024, "N": 8,
     "pipeline_list": [{
        "num_stages": 2,
        "layers_per_stage": [[0, 1, ..., 11], [12, ..., 25]],
        "tmp_per_stage": [[ [[["GH-96", 4, "us-central1-a"]], 4], ...], ...],
        "dp": [4, 4]}]}

``tmp_per_stage[s][j] = [[[gpu_type, gpus_per_node, zone]], tp]`` is
replica ``j`` of stage ``s``: a TP group of ``tp`` GPUs on one node of that type
with ``gpus_per_node`` GPUs (Sailor's reader, ``runtime_simulator.py``, makes it
a ``VMconfig(gpu_type, gpus_per_node, zone)``: the node's GPUs, not the ones
in use).
``layers_per_stage`` lists layer indices (consecutive). ``N`` is the number of
nodes. Measured fields of validation files (``real``, ``max_mem``,
``red_grads``) are never read here: a plan is an input, a measurement is not.

Supported: one pipeline (``pipeline_list`` of length 1; Sailor's several-pipeline
plans are not Megatron/DeepSpeed plans); equal ``dp`` for every stage; every TP
group on a single node. Anything else is a :class:`ProblemError` naming the
source.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from pipedejavu.core.files import json_text, read_json
from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    MAX_PLAN_FILE_BYTES,
    Plan3D,
    Replica,
    Stage3D,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.io.export_rules import refuse_experts
from pipedejavu.io.megatron_moe import MoeOptions

__all__ = [
    "NO_EXPERTS",
    "SAILOR_KEY",
    "PlanTraining",
    "load_plan3d",
    "load_plan_training",
    "plan_from_sailor",
    "plan_to_sailor",
    "write_sailor_plan",
]

SAILOR_KEY = "pipeline_list"
#: Why a plan with experts has no Sailor file.
NO_EXPERTS = (
    "Sailor's plan_config holds stages, TP and data parallelism of dense "
    "layers: it has no expert axes to carry the plan's experts"
)
_MAX_LAYERS = 1_000_000


def _fail(source: str, message: str) -> ProblemError:
    return ProblemError(f"{source}: not a usable Sailor plan_config: {message}")


def _replica(entry: Any, source: str, where: str) -> Replica:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise _fail(source, f"{where} must be [[[gpu, gpus, zone]], tp]")
    vms, tp = entry
    if not isinstance(vms, list) or not vms:
        raise _fail(source, f"{where}: the node list is empty")
    if len(vms) != 1:
        raise _fail(
            source,
            f"{where} spans {len(vms)} nodes; a tensor-parallel group across "
            "nodes is not supported",
        )
    vm = vms[0]
    if not (isinstance(vm, list) and len(vm) == 3):
        raise _fail(source, f"{where}: a node must be [gpu_type, gpus, zone]")
    gpu, gpus, zone = vm
    try:
        return Replica(gpu_type=gpu, tp=tp, zone=zone, gpus_on_node=gpus)
    except ProblemError as error:
        raise _fail(source, f"{where}: {error}") from None


def plan_from_sailor(
    data: Any, *, model: str | None = None, source: str = "plan_config"
) -> Plan3D:
    """Parse a ``plan_config`` object (already decoded JSON).

    Args:
        data: the decoded JSON object.
        model: the model's profile name to attach (the file names none).
        source: a name for error messages (the file path).

    Raises:
        ProblemError: naming ``source`` and the first problem found.
    """
    if not isinstance(data, dict) or not isinstance(data.get(SAILOR_KEY), list):
        raise _fail(source, f"expected an object with a {SAILOR_KEY!r} list")
    pipelines = data[SAILOR_KEY]
    if len(pipelines) != 1:
        raise _fail(
            source,
            f"{len(pipelines)} pipelines; only one pipeline (with data-parallel "
            "replicas) is a Megatron/DeepSpeed plan",
        )
    pipe = pipelines[0]
    if not isinstance(pipe, dict):
        raise _fail(source, "the pipeline entry is not an object")
    layers = pipe.get("layers_per_stage")
    groups = pipe.get("tmp_per_stage")
    dps = pipe.get("dp")
    if not all(isinstance(x, list) for x in (layers, groups, dps)):
        raise _fail(source, "needs lists layers_per_stage, tmp_per_stage and dp")
    num_stages = pipe.get("num_stages", len(layers))
    if not (len(layers) == len(groups) == len(dps) == num_stages):
        raise _fail(
            source,
            f"num_stages {num_stages}, {len(layers)} layer lists, {len(groups)} "
            f"replica lists and {len(dps)} dp entries must agree",
        )
    if sum(len(x) for x in layers if isinstance(x, list)) > _MAX_LAYERS:
        raise _fail(source, f"more than {_MAX_LAYERS} layer entries")
    stages = []
    for s, (ids, replicas, dp) in enumerate(zip(layers, groups, dps, strict=True)):
        if not (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise _fail(source, f"layers_per_stage[{s}] must be a non-empty int list")
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise _fail(source, f"layers_per_stage[{s}] is not consecutive: {ids}")
        if not isinstance(replicas, list) or len(replicas) != dp:
            raise _fail(
                source,
                f"stage {s}: dp is {dp!r} but tmp_per_stage lists "
                f"{len(replicas) if isinstance(replicas, list) else '?'} replicas",
            )
        built = tuple(
            _replica(entry, source, f"tmp_per_stage[{s}][{j}]")
            for j, entry in enumerate(replicas)
        )
        try:
            stages.append(Stage3D(ids[0], ids[-1] + 1, built))
        except ProblemError as error:
            raise _fail(source, f"stage {s}: {error}") from None
    try:
        return Plan3D(
            stages=tuple(stages), mbs=data.get("mbs"), gbs=data.get("gbs"), model=model
        )
    except ProblemError as error:
        raise _fail(source, str(error)) from None


def plan_to_sailor(
    plan: Plan3D,
    *,
    zone: str | None = None,
    gpus_per_node: Mapping[str, int] | None = None,
    spec: TransformerSpec | None = None,
) -> dict[str, Any]:
    """The ``plan_config`` object of a plan (no measured fields).

    ``N`` counts distinct nodes: replicas with ``node=None`` count one each.
    The middle field of a node entry is that node's GPUs, as Sailor's reader
    takes it (``VMconfig(gpu_type, gpus_per_node, zone)`` in its
    ``runtime_simulator.py``), not the GPUs a replica uses there: for a replica
    placed on a node (``node`` set) it is ``gpus_per_node[gpu_type]``, else the
    replica's ``gpus_on_node`` (what a Sailor file said), else ``tp`` (a node
    of its own, the size Sailor's planner gives a replica). (The format has no
    node identities: a file read back places every replica on a node of its
    own, so ``N`` of a plan that packs replicas does not survive the round
    trip; stages, replicas, TP, GPU types, mbs and gbs do.)

    Args:
        plan: the plan.
        zone: the file's zone (default: the first replica's).
        gpus_per_node: GPUs per node of each type the plan places on nodes.
        spec: the model (a mixture of experts is refused).

    Raises:
        ProblemError: a replica is placed on a node of a type that
            ``gpus_per_node`` does not give.
        ExportRefused: a plan with experts (:data:`NO_EXPERTS`).
    """
    refuse_experts(plan, spec, NO_EXPERTS)
    nodes: set[int] = set()
    anonymous = 0
    for stage in plan.stages:
        for replica in stage.replicas:
            if replica.node is None:
                anonymous += 1
            else:
                nodes.add(replica.node)

    def gpus(replica: Replica) -> int:
        if replica.node is None:
            return replica.gpus_on_node or replica.tp
        if gpus_per_node is not None and replica.gpu_type in gpus_per_node:
            return gpus_per_node[replica.gpu_type]
        if replica.gpus_on_node is not None:
            return replica.gpus_on_node
        raise ProblemError(
            f"Sailor's plan_config names each node's GPUs; give gpus_per_node for "
            f"{replica.gpu_type} (the plan places replicas on nodes)"
        )

    first_zone = zone or plan.stages[0].replicas[0].zone or DEFAULT_ZONE
    return {
        "zone": first_zone,
        SAILOR_KEY: [
            {
                "num_stages": plan.num_stages,
                "layers_per_stage": [
                    list(range(stage.start, stage.stop)) for stage in plan.stages
                ],
                "tmp_per_stage": [
                    [
                        [
                            [[r.gpu_type, gpus(r), r.zone]],
                            r.tp,
                        ]
                        for r in stage.replicas
                    ]
                    for stage in plan.stages
                ],
                "dp": [stage.dp for stage in plan.stages],
            }
        ],
        "mbs": plan.mbs,
        "gbs": plan.gbs,
        "N": len(nodes) + anonymous,
    }


def write_sailor_plan(
    plan: Plan3D,
    path: str | os.PathLike,
    *,
    gpus_per_node: Mapping[str, int] | None = None,
) -> None:
    """Write :func:`plan_to_sailor` of ``plan`` to ``path`` (indented JSON)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(
            json_text(plan_to_sailor(plan, gpus_per_node=gpus_per_node), indent=2)
        )
        handle.write("\n")


def _read_json(path: str | os.PathLike) -> Any:
    return read_json(path, MAX_PLAN_FILE_BYTES, "plan file")


def load_plan3d(
    path: str | os.PathLike, *, model: str | None = None
) -> tuple[Plan3D, str]:
    """Read a plan file: our JSON, or Sailor's ``plan_config`` (``pipeline_list``).

    Measured fields of a Sailor file (``real``, ``max_mem``, ``red_grads``) are
    never read.

    Args:
        path: the JSON file.
        model: the model's profile name; required for a Sailor file (which does not
            name one), and when given for our JSON it must agree with the file.

    Returns:
        ``(plan, kind)`` with ``kind`` ``"pipedejavu"`` or ``"sailor"``.

    Raises:
        ProblemError: one line naming the file and the problem.
    """
    data = _read_json(path)
    if isinstance(data, dict) and SAILOR_KEY in data:
        return plan_from_sailor(data, model=model, source=str(path)), "sailor"
    plan = Plan3D.from_json(data, source=str(path))
    if model is not None:
        if plan.model is not None and plan.model != model:
            raise ProblemError(
                f"{path} is a plan for model {plan.model!r}, but --model says {model!r}"
            )
        plan = plan.replace(model=model)
    return plan, "pipedejavu"


class PlanTraining(NamedTuple):
    """What a plan file says about its training (:func:`load_plan_training`),
    each ``None`` when absent (a Sailor file, a dense model's plan for
    ``experts``, or a plan written before ``pipedejavu plan --json`` recorded
    it)."""

    options: TrainingOptions | None
    seq_length: int | None
    experts: MoeOptions | None  # the token dispatcher, grouped GEMMs, overlaps


def load_plan_training(path: str | os.PathLike) -> PlanTraining:
    """What a plan file says about its training (:class:`PlanTraining`): its
    ``options``, ``seq_length`` and ``experts`` objects.

    Raises:
        ProblemError: an unreadable file, or bad ``options`` / ``seq_length``
            / ``experts`` (one line naming the file).
    """
    data = _read_json(path)
    if not isinstance(data, dict) or SAILOR_KEY in data:
        return PlanTraining(None, None, None)
    options, seq_length = data.get("options"), data.get("seq_length")
    experts = data.get("experts")
    try:
        if options is not None:
            options = TrainingOptions.from_json(options)
        if experts is not None:
            experts = MoeOptions.from_json(experts)
    except (TypeError, ValueError) as error:
        raise ProblemError(f"{path}: {error}") from None
    if seq_length is not None and (
        isinstance(seq_length, bool)
        or not isinstance(seq_length, int)
        or not 1 <= seq_length <= 2**24
    ):
        raise ProblemError(
            f"{path}: seq_length must be an integer in [1, {2**24}], got "
            f"{seq_length!r:.40}"
        )
    return PlanTraining(options, seq_length, experts)
