"""DeepSpeed ``PipelineModule`` partitions and engine configs for a plan.

Checked against DeepSpeed 0.16.5 (``deepspeed/runtime/pipe/module.py``,
``runtime/pipe/topology.py``, ``runtime/config.py``; no code copied):

* ``PipelineModule`` keeps the stage boundaries in ``parts``: stage ``s``
  builds ``layers[parts[s]:parts[s + 1]]`` of the layer list it was given.
  Its ``partition_method`` values (``parameters``, ``uniform``,
  ``type:...``) cannot express an arbitrary split, so the export gives
  ``parts`` to set in a ``_partition_layers`` override
  (``self.parts = parts``, then ``self._set_bounds(start=parts[stage],
  stop=parts[stage + 1])``).
* ``parts`` index one particular layer list, named in the file
  (``"layers"``):

  - ``deepspeed``: the abstract list ``[embedding, transformer.0 ...
    transformer.(L-1), head]``, one entry per profile layer. A model written
    as exactly these ``L + 2`` entries gets the plan's stages.
  - ``megatron-deepspeed``: Megatron-DeepSpeed's ``GPTModelPipe``
    (``megatron/model/gpt_model.py`` at commit f4157bea, 2024-12-24; dense
    model, no MoE): ``[_to_float16, embedding, L transformer layers, final
    norm, head (the tied embedding unless untied), float16_to_fp32]``; the last
    entry exists only with ``--fp16``/``--bf16``, so ``parts`` is given for
    both. Our profile layer ``0`` is the cast and the embedding, layer
    ``L + 1`` the norm, the head and the cast back. (Commits before 53db2b14,
    July 2023, also had two transposes around the transformer layers; they are
    not covered.)

* The engine config's batch rule: ``train_batch_size =
  train_micro_batch_size_per_gpu x gradient_accumulation_steps x
  data-parallel size``, exactly.
* The topology ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes
  ``pipe, data, model``): the shared rank order of
  :mod:`pipedejavu.io.export_rules`. One TP degree for every stage.
* The schedule: the pipeline engine (``runtime/pipe/engine.py``) runs
  ``TrainSchedule``, 1F1B with whole backward passes (read in DeepSpeed
  0.19.8, whose ``DualPipeVSchedule`` also keeps the weight gradient inside
  ``BackwardPass``): interleaved and zero-bubble plans are refused
  (:mod:`pipedejavu.io.exports`).
"""

from __future__ import annotations

from typing import Any

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.io.export_megatron import to_megatron
from pipedejavu.io.export_rules import (
    check_whole_batch,
    gpu_types_by_rank,
    uniform_tp,
)

__all__ = [
    "DEEPSPEED_VERSION",
    "MEGATRON_DEEPSPEED_VERSION",
    "megatron_deepspeed_layers",
    "to_deepspeed",
    "to_megatron_deepspeed",
]

DEEPSPEED_VERSION = "DeepSpeed 0.16.5 PipelineModule"
MEGATRON_DEEPSPEED_VERSION = (
    "Megatron-DeepSpeed f4157bea (2024-12-24) GPTModelPipe on DeepSpeed 0.16.5"
)


def _engine(plan: Plan3D, target: str) -> dict[str, Any]:
    tp = uniform_tp(plan, target)
    check_whole_batch(plan, target)
    out: dict[str, Any] = {
        "ds_config": {
            "train_batch_size": plan.gbs,
            "train_micro_batch_size_per_gpu": plan.mbs,
            "gradient_accumulation_steps": plan.num_microbatches,
        },
        "world_size": plan.num_gpus,
        "model_parallel_size": tp,
        "data_parallel_size": plan.dp,
    }
    if len(plan.gpus_by_type()) > 1:
        out["gpu_types_by_rank"] = gpu_types_by_rank(plan)
    return out


def to_deepspeed(plan: Plan3D) -> dict[str, Any]:
    """DeepSpeed's partition of the abstract layer list and the engine config
    (module docstring).

    Raises:
        ExportRefused: per-stage TP, or a batch that is not whole micro-batches.
    """
    engine = _engine(plan, "DeepSpeed")
    layers = (
        ["embedding"]
        + [f"transformer.{i}" for i in range(plan.num_layers - 2)]
        + ["head"]
    )
    return {
        "target": DEEPSPEED_VERSION,
        "pipeline_module": {
            "num_stages": plan.num_stages,
            "parts_index": "the 'layers' list: embedding, transformer layers, head "
            "(one entry per profile layer); for Megatron-DeepSpeed's GPTModelPipe "
            "use --export megatron-deepspeed",
            "layers": layers,
            "parts": [s.start for s in plan.stages] + [plan.num_layers],
        },
        **engine,
    }


def megatron_deepspeed_layers(num_layers: int, *, half: bool = True) -> list[str]:
    """``GPTModelPipe``'s layer list for ``num_layers`` transformer layers
    (module docstring); ``half``: with ``--fp16`` or ``--bf16``."""
    return (
        ["_to_float16", "embedding"]
        + [f"transformer.{i}" for i in range(num_layers)]
        + ["final_norm", "head"]
        + (["float16_to_fp32"] if half else [])
    )


def _gpt_model_pipe_index(layer: int, num_layers: int) -> int:
    """First ``GPTModelPipe`` entry of profile layer ``layer`` (``0``: the cast
    and the embedding; ``1..L``: a transformer layer; ``L + 1``: the norm)."""
    return 0 if layer == 0 else layer + 1


def to_megatron_deepspeed(plan: Plan3D) -> dict[str, Any]:
    """Megatron-DeepSpeed's arguments, ``GPTModelPipe`` partition and engine
    config (module docstring).

    Raises:
        ExportRefused: per-stage TP, or a batch that is not whole micro-batches.
    """
    engine = _engine(plan, "Megatron-DeepSpeed")
    num_layers = plan.num_layers - 2
    starts = [_gpt_model_pipe_index(s.start, num_layers) for s in plan.stages]
    half = megatron_deepspeed_layers(num_layers, half=True)
    full = megatron_deepspeed_layers(num_layers, half=False)
    # Megatron-DeepSpeed takes the plain Megatron arguments; its pipeline split
    # comes from GPTModelPipe's partition, not from Megatron's layer options.
    args = to_megatron(plan)[:10]
    return {
        "target": MEGATRON_DEEPSPEED_VERSION,
        "arguments": args + ["--deepspeed", "--deepspeed_config", "ds_config.json"],
        "pipeline_module": {
            "num_stages": plan.num_stages,
            "parts_index": "GPTModelPipe's specs (dense model, no MoE): the "
            "'layers' list with --fp16/--bf16, 'layers_fp32' without",
            "layers": half,
            "parts": starts + [len(half)],
            "layers_fp32": full,
            "parts_fp32": starts + [len(full)],
        },
        **engine,
    }
