"""Megatron-LM training options that change a plan's memory and time.

This module is vocabulary: it imports nothing else of ours. The rules that read
these options (bytes per parameter, activation bytes, recomputation time) are in
:mod:`pipedejavu.costmodel.megatron.options`; the interleaved schedule is
:mod:`pipedejavu.simulation.interleaved`.

Each field names the Megatron-LM argument it stands for:

* ``precision``: ``fp32`` (no flag), ``fp16`` (``--fp16``), ``bf16``
  (``--bf16``), ``fp8`` (``--bf16 --fp8-format ...``: Transformer Engine's FP8
  GEMMs on top of bf16 training).
* ``distributed_optimizer``: ``--use-distributed-optimizer`` (the fp32 master
  weights, main gradients and Adam's moments sharded over the data-parallel
  ranks, ZeRO-1 style).
* ``recompute``: ``--recompute-granularity`` (``selective``: the modules of
  ``recompute_modules``, ``--recompute-modules``, Megatron-Core's default the
  attention core; ``full``: whole transformer layers, with
  ``--recompute-method block``); ``recompute_num_layers``:
  ``--recompute-num-layers``.
* ``virtual_stages``: ``--num-layers-per-virtual-pipeline-stage`` expressed as
  model chunks per pipeline rank (1: the non-interleaved 1F1B schedule).
* ``sequence_parallel``: ``--sequence-parallel``.
* ``zero_bubble``: the ZB-H1 schedule of Qi et al. (ICLR'24): each backward
  split into an input-gradient pass and a weight-gradient pass, the latter
  deferred to fill the pipeline's bubble (PyTorch's
  ``ScheduleInterleavedZeroBubble`` with one stage per rank, torchtitan's
  ``InterleavedZeroBubble``; no Megatron-LM flag); with ``virtual_stages > 1``
  the same schedule over that many stages per rank; ``v_shape``: ZB-V, two
  stages per rank placed in a V (torchtitan's ``ZBVZeroBubble``).
* ``flash_attention``: ``--use-flash-attn`` (or Transformer Engine's fused
  attention), which never materializes the ``s x s`` attention scores.
* ``grad_reduce_in_bf16``: ``--grad-reduce-in-bf16`` (bf16 or fp8 training:
  the main gradients kept and reduced in bf16, not fp32).
* ``overlap_grad_reduce``: ``--overlap-grad-reduce`` (the gradients' data-parallel
  reduction runs beside the last micro-batch's backward pass);
  ``overlap_param_gather``: ``--overlap-param-gather`` (with the distributed
  optimizer, the updated parameters' all-gather runs beside the next forward
  pass).
* ``zero_stage``: what data parallelism shards over a shard group
  (:attr:`~pipedejavu.core.layout.ParallelLayout.shard_group`), as ZeRO's
  stages name it: 0 nothing; 1 the optimizer state (Megatron-LM's
  ``--use-distributed-optimizer``, DeepSpeed's ZeRO-1: the same as
  ``distributed_optimizer``); 2 the gradients too (DeepSpeed's ZeRO-2);
  3 the parameters too, gathered layer by layer for each pass (PyTorch's
  FSDP2 ``fully_shard`` as torchtitan applies it, DeepSpeed's ZeRO-3,
  Megatron-LM's ``--data-parallel-sharding-strategy optim_grads_params``);
  ``reshard_after_forward``: with stage 3, a layer's gathered parameters are
  freed after its forward and gathered again for its backward (FSDP2's
  default; ``False`` keeps them from the forward to the backward).
* ``tp_comm_overlap``: ``--tp-comm-overlap`` (Transformer Engine runs the
  tensor-parallel all-gathers and reduce-scatters of sequence parallelism
  beside the GEMMs they feed or follow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pipedejavu.core.files import json_fields

__all__ = [
    "DEFAULT_RECOMPUTE_MODULES",
    "MAX_RECOMPUTE_LAYERS",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_MODULES",
    "SELECTIVE_MODULES",
    "TORCHTITAN_OP",
    "TRAINING_PRECISIONS",
    "RecomputeGranularity",
    "TrainingOptions",
    "TrainingPrecision",
    "params_dtype",
]

TrainingPrecision = Literal["fp32", "fp16", "bf16", "fp8"]
#: The most blocks a recomputation count may name (more than any model has).
MAX_RECOMPUTE_LAYERS = 100_000
TRAINING_PRECISIONS: tuple[TrainingPrecision, ...] = ("fp32", "fp16", "bf16", "fp8")


def params_dtype(precision: str) -> str:
    """The weights' dtype Megatron-LM trains ``precision`` with (``fp32``,
    ``fp16`` or ``bf16``: fp8 GEMMs keep bf16 weights, ``--bf16``)."""
    return {"fp8": "bf16"}.get(precision, precision)


RecomputeGranularity = Literal["none", "selective", "full"]
RECOMPUTE_GRANULARITIES: tuple[RecomputeGranularity, ...] = (
    "none",
    "selective",
    "full",
)
#: Megatron-Core's selective recomputation modules (core_v0.16.1,
#: ``TransformerConfig.recompute_modules``), in this order once read.
RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
#: torchtitan's per-operation selective checkpointing
#: (``[activation_checkpoint] mode = "selective"``, ``selective_ac_option =
#: "op"``): every other matrix multiplication of a block and its element-wise
#: operations are rerun; attention's output and the other products are kept.
#: Not a Megatron-Core module: recomputed alone, and Megatron-LM runs no plan
#: with it.
TORCHTITAN_OP = "torchtitan_op"
#: Everything selective recomputation may name: Megatron-Core's modules, or
#: torchtitan's policy alone.
SELECTIVE_MODULES = (*RECOMPUTE_MODULES, TORCHTITAN_OP)
#: What selective recomputation reruns when no module is named.
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


def _check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_modules(options: TrainingOptions) -> None:
    """``recompute_modules``: known names (a JSON list is taken), kept once
    each in :data:`RECOMPUTE_MODULES`' order."""
    modules = options.recompute_modules
    if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
        unknown = sorted(set(modules) - set(SELECTIVE_MODULES))
        alone = TORCHTITAN_OP not in modules or len(set(modules)) == 1
        if modules and not unknown and alone:
            ordered = tuple(m for m in SELECTIVE_MODULES if m in modules)
            object.__setattr__(options, "recompute_modules", ordered)
            return
    raise ValueError(
        "recompute_modules must be a non-empty list of Megatron-Core's modules "
        f"({', '.join(RECOMPUTE_MODULES)}) or torchtitan's {TORCHTITAN_OP!r} "
        f"alone, got {modules!r}"[:300]
    )


def _check_zero(options: TrainingOptions) -> None:
    """``zero_stage`` in 0..3, one with ``distributed_optimizer`` (either
    sets the other), ``reshard_after_forward`` off only at stage 3, and no
    parameter all-gather after the step at stage 3 (the parameters stay
    sharded: they are gathered for each pass)."""
    stage = options.zero_stage
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage:
        object.__setattr__(options, "distributed_optimizer", True)
    elif options.distributed_optimizer:
        object.__setattr__(options, "zero_stage", 1)
    if not options.reshard_after_forward and stage != 3:
        raise ValueError(
            f"reshard_after_forward=False needs zero_stage=3, got zero_stage={stage}"
        )
    if stage == 3 and options.overlap_param_gather:
        raise ValueError(
            "overlap_param_gather applies to zero_stage 1 or 2 (at stage 3 the "
            "parameters stay sharded and are gathered for each pass)"
        )


def _check_counts(options: TrainingOptions, name: str) -> None:
    """A per-stage recomputation field: a non-empty tuple (a JSON list is
    taken) of ints >= 0 or ``None``, with ``recompute="full"`` and no
    uniform count."""
    values = getattr(options, name)
    if values is None:
        return
    if isinstance(values, list):
        values = tuple(values)
        object.__setattr__(options, name, values)
    if (
        not isinstance(values, tuple)
        or not values
        or any(
            v is not None
            and (
                isinstance(v, bool)
                or not isinstance(v, int)
                or not 0 <= v <= MAX_RECOMPUTE_LAYERS
            )
            for v in values
        )
    ):
        raise ValueError(
            f"{name} must be a non-empty list of counts (ints in [0, "
            f"{MAX_RECOMPUTE_LAYERS}], or None for every block), got {values!r}"
        )
    if name == "recompute_choices" and len(set(values)) != len(values):
        raise ValueError(f"recompute_choices must be distinct, got {values!r}")
    if options.recompute != "full" or options.recompute_num_layers is not None:
        raise ValueError(
            f"{name} applies to recompute='full' without recompute_num_layers, "
            f"got recompute={options.recompute!r}, recompute_num_layers="
            f"{options.recompute_num_layers!r}"
        )


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """How a model is trained, beyond its parallel layout.

    Args:
        precision: the training precision: ``"fp32"``, ``"fp16"``, ``"bf16"``
            (mixed precision with fp32 master weights) or ``"fp8"`` (bf16
            training with FP8 matrix multiplications).
        distributed_optimizer: shard the optimizer state over data-parallel ranks.
        recompute: activation recomputation: ``"none"``, ``"selective"`` (the
            modules of ``recompute_modules`` are recomputed in the backward
            pass) or ``"full"`` (whole layers: only their inputs are stashed).
        recompute_num_layers: with ``recompute="full"``, the layers of each model
            chunk that are recomputed, Megatron's ``block`` method (the first
            ``recompute_num_layers`` layers of the chunk are recomputed, the
            others keep their activations); ``None``: every layer. Must be
            ``None`` unless ``recompute == "full"``.
        virtual_stages: model chunks per pipeline rank (``v``; 1: no
            interleaving).
        sequence_parallel: split the layer norms' and dropouts' activations over
            the tensor-parallel ranks along the sequence.
        zero_bubble: the ZB-H1 schedule (backward split into input- and
            weight-gradient passes, the weight passes deferred), interleaved
            over ``virtual_stages`` chunks per rank when that is above 1.
        flash_attention: fused attention that never stores the ``s x s`` scores.
        attention_dropout: dropout on the attention probabilities (without
            flash attention its mask and output are stored and its kernel runs).
        v_shape: with ``zero_bubble`` and ``virtual_stages == 2``, ZB-V: the
            two chunks of rank ``r`` are virtual stages ``r`` and ``2 P - 1 -
            r`` (a V, PyTorch's ``ScheduleZBVZeroBubble``) instead of ``r``
            and ``P + r``.
        recompute_choices: with ``recompute="full"``, per-stage
            recomputation (AdaPipe-style; one chunk per rank): each pipeline
            stage reruns the first ``n`` of its blocks for the least ``n`` of
            these counts with which it fits its GPUs (``0``: none; ``None``:
            every block); the predictor picks them.
        recompute_stage_layers: with ``recompute="full"``, the count each
            stage reruns, in stage order (what the predictor picked, or given
            to price such a plan).
        grad_reduce_in_bf16: with bf16 or fp8 training, the main gradients
            are kept and reduced in bf16 (Megatron-LM's fp32 by default).
        overlap_grad_reduce: the data-parallel gradient reduction overlaps the
            last micro-batch's backward pass.
        overlap_param_gather: with ``distributed_optimizer`` and
            ``overlap_grad_reduce``, the parameters' all-gather overlaps the
            next iteration's forward pass.
        tp_comm_overlap: with ``sequence_parallel``, the tensor-parallel
            all-gathers and reduce-scatters of each block run beside the GEMMs
            they feed or follow (Megatron-LM's ``--tp-comm-overlap``, which
            needs ``--sequence-parallel``).
        zero_stage: ZeRO's stage (module docstring): 0 to 3; stage 1 is
            ``distributed_optimizer`` (either sets the other; a copy that
            turns the optimizer sharding off sets both to off), and every
            stage from 1 turns it on.
        reshard_after_forward: with ``zero_stage=3``, gather a layer's
            parameters again for its backward (``False``: keep them
            gathered from the forward; needs ``zero_stage=3``).
        recompute_modules: what ``recompute="selective"`` reruns, Megatron's
            ``--recompute-modules`` (some of :data:`RECOMPUTE_MODULES`, kept
            in that order; default the attention core); like Megatron-Core,
            read only with ``recompute="selective"``.

    Raises:
        ValueError: naming the field, what was expected and what arrived.

    Example:
        >>> TrainingOptions(precision="bf16", recompute="selective").precision
        'bf16'
    """

    precision: TrainingPrecision = "fp32"
    distributed_optimizer: bool = False
    recompute: RecomputeGranularity = "none"
    recompute_num_layers: int | None = None
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero_bubble: bool = False
    flash_attention: bool = True
    attention_dropout: bool = False
    v_shape: bool = False
    recompute_choices: tuple[int | None, ...] | None = None
    recompute_stage_layers: tuple[int | None, ...] | None = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    tp_comm_overlap: bool = False
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES
    zero_stage: int = 0
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.precision not in TRAINING_PRECISIONS:
            raise ValueError(
                f"precision must be one of {TRAINING_PRECISIONS}, "
                f"got {self.precision!r}"
            )
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute must be one of {RECOMPUTE_GRANULARITIES}, "
                f"got {self.recompute!r}"
            )
        for name in (
            "distributed_optimizer",
            "sequence_parallel",
            "zero_bubble",
            "flash_attention",
            "attention_dropout",
            "v_shape",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "grad_reduce_in_bf16",
            "tp_comm_overlap",
            "reshard_after_forward",
        ):
            _check_bool(getattr(self, name), name)
        _check_zero(self)
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError(
                "tp_comm_overlap needs sequence_parallel (Megatron-LM's "
                "--tp-comm-overlap needs --sequence-parallel)"
            )
        if self.grad_reduce_in_bf16 and self.precision not in ("bf16", "fp8"):
            raise ValueError(
                "grad_reduce_in_bf16 applies to bf16 or fp8 training, got "
                f"precision={self.precision!r}"
            )
        if self.overlap_param_gather and not (
            self.distributed_optimizer and self.overlap_grad_reduce
        ):
            raise ValueError(
                "overlap_param_gather needs distributed_optimizer and "
                "overlap_grad_reduce (Megatron-LM's --overlap-param-gather needs "
                "--use-distributed-optimizer and --overlap-grad-reduce)"
            )
        _check_modules(self)
        layers = self.recompute_num_layers
        if layers is not None:
            if isinstance(layers, bool) or not isinstance(layers, int):
                raise ValueError(
                    f"recompute_num_layers must be an int or None, got {layers!r}"
                )
            if not 1 <= layers <= MAX_RECOMPUTE_LAYERS:
                raise ValueError(
                    f"recompute_num_layers must be in [1, {MAX_RECOMPUTE_LAYERS}], "
                    f"got {layers}"
                )
            if self.recompute != "full":
                raise ValueError(
                    "recompute_num_layers applies to recompute='full' only, got "
                    f"recompute={self.recompute!r} with recompute_num_layers={layers}"
                )
        chunks = self.virtual_stages
        if isinstance(chunks, bool) or not isinstance(chunks, int):
            raise ValueError(f"virtual_stages must be an int, got {chunks!r}")
        if chunks < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {chunks}")
        for name in ("recompute_choices", "recompute_stage_layers"):
            _check_counts(self, name)
        if self.v_shape and not (self.zero_bubble and chunks == 2):
            raise ValueError(
                "v_shape (ZB-V) needs zero_bubble=True and virtual_stages=2, got "
                f"zero_bubble={self.zero_bubble}, virtual_stages={chunks}"
            )

    @property
    def per_stage_recompute(self) -> bool:
        """Counts of blocks rerun that may differ by stage
        (``recompute_choices`` or ``recompute_stage_layers``)."""
        return (
            self.recompute_choices is not None
            or self.recompute_stage_layers is not None
        )

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """The modules rerun: ``recompute_modules`` with ``recompute=
        "selective"``, none otherwise."""
        return self.recompute_modules if self.recompute == "selective" else ()

    @property
    def block_recompute(self) -> bool:
        """Full recomputation of only some blocks of a stage: Megatron's
        ``block`` method (``recompute_num_layers``) or per-stage counts (the
        costs then price each block with and without its rerun)."""
        return self.recompute == "full" and (
            self.recompute_num_layers is not None or self.per_stage_recompute
        )

    def to_json(self) -> dict[str, Any]:
        """Every field under its own name (exact round trip; files without
        ``recompute_modules`` read with the default); JSON types (the
        modules a list)."""
        out = dataclasses.asdict(self)
        out["recompute_modules"] = list(self.recompute_modules)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainingOptions:
        """Options from a JSON object; absent keys take their defaults.

        Raises:
            ValueError: not an object, an unknown key, or a bad value.
        """
        return cls(**json_fields(cls, data, "training options"))
