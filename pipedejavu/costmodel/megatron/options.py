"""The memory and time rules of Megatron-LM's training options, each defined once.

:class:`~pipedejavu.core.training_options.TrainingOptions` names the options;
these functions price them. They take plain numbers (sequence length ``s``,
micro-batch size ``b``, hidden size ``h``, attention heads ``a``, tensor
parallel size ``t``, data parallel size ``d``), never our model classes, so they
apply to any transformer; every size may be a float or a numpy array (one value
per span or per plan), as in :mod:`pipedejavu.costmodel.megatron.rules`.

Sources:

* Bytes per parameter: Megatron-LM's ``docs/user-guide/features/
  dist_optimizer.md`` (the table "theoretical number of bytes per parameter",
  also used by ``megatron/training/theoretical_memory_usage.py``).
* Activation element sizes and recomputation time; the activation bytes
  themselves are counted per operation in
  :func:`pipedejavu.costmodel.analytical.layers.activation_bytes` (which
  reproduces Korthikanti et al., MLSys 2023, Table 2:
  ``tests/test_megatron_options.py``), the in-flight counts by the simulator
  (:mod:`pipedejavu.simulation.interleaved`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pipedejavu.core.training_options import (
    RECOMPUTE_GRANULARITIES,
    TRAINING_PRECISIONS,
)
from pipedejavu.costmodel.megatron.constants import FLOAT_BYTES

__all__ = [
    "ParamStateBytes",
    "activation_element_bytes",
    "bytes_per_param",
    "grad_reduce_bytes_per_param",
    "optimizer_update_fraction",
    "param_gather_bytes_per_param",
    "param_gather_share",
    "param_state_bytes",
    "recompute_time",
]

Number = Any  # a float, or an array of one value per span

HALF_BYTES = 2


def _plain(value: Number) -> Number:
    """A 0-d result as a Python float; arrays as they are."""
    return float(value) if np.ndim(value) == 0 else value


def _check_precision(precision: str) -> None:
    if precision not in TRAINING_PRECISIONS:
        raise ValueError(
            f"precision must be one of {TRAINING_PRECISIONS}, got {precision!r}"
        )


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_GRANULARITIES:
        raise ValueError(
            f"recompute must be one of {RECOMPUTE_GRANULARITIES}, got {recompute!r}"
        )


# -------------------------------------------------------------- parameters
class ParamStateBytes(NamedTuple):
    """Bytes per parameter of the model state, split by what the distributed
    optimizer shards.

    Attributes:
        replicated: on every data-parallel rank either way: the model weights
            and the gradient buffer the backward pass accumulates into.
        shardable: the optimizer's state: fp32 master weights (and, for fp16,
            their fp32 gradients) and Adam's two fp32 moments; divided by ``d``
            with the distributed optimizer.
    """

    replicated: int
    shardable: int


def param_state_bytes(
    precision: str, *, bf16_grads: bool = False, zero_stage: int = 0
) -> ParamStateBytes:
    """Megatron-LM's bytes per parameter at ``precision`` with Adam
    (``bf16_grads``: ``--grad-reduce-in-bf16``, bf16 or fp8 training only: the
    main gradients kept and reduced in bf16, 2 bytes where fp32 takes 4).

    As Megatron-LM documents them (``docs/user-guide/features/
    dist_optimizer.md``: 16, 18 and 20 bytes without, ``8 + 8/d``, ``6 + 12/d``
    and ``4 + 16/d`` with the distributed optimizer):

    * ``fp32``: 4 weights + 4 gradients replicated; 8 (Adam's moments) sharded.
      The sum is the fp32 predictor's
      :data:`~pipedejavu.costmodel.megatron.constants.BYTES_PER_PARAM`.
    * ``bf16``: 2 (bf16 weights) + 4 (fp32 main gradients: Megatron accumulates
      and all-reduces bf16 gradients in fp32) replicated; 4 (fp32 master
      weights) + 8 (Adam) sharded: 18.
    * ``fp16``: Megatron's defaults keep fp16 gradients (``--accumulate-
      allreduce-grads-in-fp32`` is off for fp16) and copy them to fp32 master
      gradients: 2 + 2 replicated; 4 master weights + 4 master gradients + 8
      Adam sharded: 20.
    * ``fp8``: as ``bf16``. Transformer Engine trains FP8 GEMMs on top of bf16
      weights; its transient FP8 weight copies and scaling factors are not
      counted (a few percent of the weights at most).

    ``zero_stage`` (:attr:`~pipedejavu.core.training_options.TrainingOptions.
    zero_stage`) moves more into the shardable part: at stage 2 the gradients
    (DeepSpeed's ZeRO-2: only the weights stay replicated); at stage 3
    everything, less the 16-bit copy of the weights, which is gathered layer
    by layer for each pass and never kept whole (PyTorch's FSDP2 with bf16
    parameters: fp32 sharded weights, fp32 gradients and Adam, 16 bytes;
    the gathered layers are :func:`~pipedejavu.costmodel.megatron.rules.
    fsdp_buffer_bytes`). Stages 0 and 1 are the split above (what is sharded
    is the caller's: ``distributed_optimizer``).

    Raises:
        ValueError: an unknown precision or stage.
    """
    _check_precision(precision)
    _check_bf16_grads(precision, bf16_grads)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    parts = _megatron_state(precision, bf16_grads)
    weights = FLOAT_BYTES if precision == "fp32" else HALF_BYTES
    if zero_stage == 2:
        return ParamStateBytes(weights, parts.replicated + parts.shardable - weights)
    if zero_stage == 3:
        kept = parts.replicated + parts.shardable
        return ParamStateBytes(0, kept - (0 if precision == "fp32" else weights))
    return parts


def _megatron_state(precision: str, bf16_grads: bool) -> ParamStateBytes:
    """Megatron-LM's split (:func:`param_state_bytes`, stages 0 and 1)."""
    if precision == "fp32":
        return ParamStateBytes(2 * FLOAT_BYTES, 2 * FLOAT_BYTES)
    if precision == "fp16":
        return ParamStateBytes(2 * HALF_BYTES, 4 * FLOAT_BYTES)
    grads = HALF_BYTES if bf16_grads else FLOAT_BYTES
    return ParamStateBytes(HALF_BYTES + grads, 3 * FLOAT_BYTES)


def _check_bf16_grads(precision: str, bf16_grads: bool) -> None:
    if bf16_grads and precision not in ("bf16", "fp8"):
        raise ValueError(
            f"bf16 gradients apply to bf16 or fp8 training, not {precision}"
        )


def bytes_per_param(
    precision: str, *, distributed_optimizer: bool = False, data_parallel: Number = 1
) -> Number:
    """Model state bytes per parameter a GPU holds:
    ``replicated + shardable / d`` with the distributed optimizer, their sum
    without (:func:`param_state_bytes`).

    Args:
        precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        distributed_optimizer: shard the optimizer state over the ``d`` ranks.
        data_parallel: ``d`` >= 1 (a number or an array).

    Example:
        >>> bytes_per_param("bf16", distributed_optimizer=True, data_parallel=4)
        9.0
    """
    state = param_state_bytes(precision)
    if not distributed_optimizer:
        return float(state.replicated + state.shardable)
    if np.any(np.less(data_parallel, 1)):
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    return _plain(state.replicated + state.shardable / np.asarray(data_parallel, float))


def grad_reduce_bytes_per_param(precision: str, *, bf16_grads: bool = False) -> int:
    """Bytes per parameter the data-parallel gradient reduction moves: the
    gradient buffer's element (4 for fp32 and bf16/fp8, whose gradients are
    reduced in fp32 unless ``bf16_grads``; 2 for fp16). All-reduced without the
    distributed optimizer, reduce-scattered with it."""
    _check_precision(precision)
    _check_bf16_grads(precision, bf16_grads)
    return HALF_BYTES if precision == "fp16" or bf16_grads else FLOAT_BYTES


def param_gather_bytes_per_param(precision: str, distributed_optimizer: bool) -> int:
    """Bytes per parameter the distributed optimizer all-gathers after its step
    (the updated weights at their training precision); 0 without it. A ring
    all-reduce is a reduce-scatter plus an all-gather, so with fp32 weights the
    data-parallel traffic is the all-reduce's."""
    _check_precision(precision)
    if not distributed_optimizer:
        return 0
    return FLOAT_BYTES if precision == "fp32" else HALF_BYTES


def param_gather_share(precision: str, *, bf16_grads: bool = False) -> float:
    """The distributed optimizer's all-gather over its reduce-scatter, in
    bytes per parameter (:func:`param_gather_bytes_per_param` over
    :func:`grad_reduce_bytes_per_param`): 1 in fp32 and fp16, 1/2 in bf16 and
    fp8 (bf16 weights gathered, fp32 gradients reduced; 1 with
    ``bf16_grads``)."""
    gathered = param_gather_bytes_per_param(precision, True)
    return gathered / grad_reduce_bytes_per_param(precision, bf16_grads=bf16_grads)


def optimizer_update_fraction(
    distributed_optimizer: bool, data_parallel: Number = 1
) -> Number:
    """The share of a stage's parameters a GPU's Adam step updates: ``1 / d``
    with the distributed optimizer (each rank steps its shard), 1 without.
    Multiplies :func:`~pipedejavu.costmodel.megatron.rules.optimizer_time`."""
    if not distributed_optimizer:
        return 1.0
    return _plain(1.0 / np.asarray(data_parallel, float))


# ------------------------------------------------------------- activations
def activation_element_bytes(precision: str) -> int:
    """Bytes of one stored activation element: 4 in fp32 training, 2 in fp16 and
    bf16. ``fp8`` counts as bf16: Transformer Engine keeps the activations the
    backward pass reads in bf16 (some GEMM inputs are also cached in FP8, which
    this ignores)."""
    _check_precision(precision)
    return FLOAT_BYTES if precision == "fp32" else HALF_BYTES


# -------------------------------------------------------------------- time
def recompute_time(
    recompute: str, recomputed_forward_s: Number, attention_core_forward_s: Number
) -> Number:
    """Seconds recomputation adds to a model chunk's backward per micro-batch.

    Args:
        recompute: ``"none"``, ``"selective"`` or ``"full"``.
        recomputed_forward_s: the forward seconds of the chunk's recomputed
            layers (``full`` runs them again before their backward: every
            block, or with Megatron's ``block`` method
            :func:`~pipedejavu.costmodel.megatron.rules.recomputed_layers`).
        attention_core_forward_s: the forward seconds of the chunk's attention
            cores (``QK^T``, softmax, dropout, ``x V``), which ``selective``
            runs again.
    """
    _check_recompute(recompute)
    if recompute == "full":
        return recomputed_forward_s
    if recompute == "selective":
        return attention_core_forward_s
    return _plain(0.0 * np.asarray(recomputed_forward_s))
