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
* Activations: Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", MLSys 2023 (arXiv:2205.05198), Section 4 and Table 2.
* Interleaving: Narayanan et al., SC'21, and Megatron-LM's
  ``megatron/core/pipeline_parallel/schedules.py`` (warm-up counts) through
  :mod:`pipedejavu.simulation.interleaved`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pipedejavu.core.training_options import (
    RECOMPUTE_GRANULARITIES,
    TRAINING_PRECISIONS,
)
from pipedejavu.costmodel.megatron.constants import FLOAT_BYTES
from pipedejavu.simulation.interleaved import peak_in_flight_count

__all__ = [
    "ParamStateBytes",
    "activation_element_bytes",
    "boundary_message_bytes",
    "bytes_per_param",
    "grad_reduce_bytes_per_param",
    "interleaved_in_flight",
    "interleaving_memory_factor",
    "layer_activation_bytes",
    "layer_input_bytes",
    "optimizer_update_fraction",
    "param_gather_bytes_per_param",
    "param_state_bytes",
    "recompute_time",
    "recompute_working_bytes",
    "recomputed_layers",
    "stash_per_microbatch_bytes",
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


def param_state_bytes(precision: str) -> ParamStateBytes:
    """Megatron-LM's bytes per parameter at ``precision`` with Adam.

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

    Raises:
        ValueError: an unknown precision.
    """
    _check_precision(precision)
    if precision == "fp32":
        return ParamStateBytes(2 * FLOAT_BYTES, 2 * FLOAT_BYTES)
    if precision == "fp16":
        return ParamStateBytes(2 * HALF_BYTES, 4 * FLOAT_BYTES)
    return ParamStateBytes(HALF_BYTES + FLOAT_BYTES, 3 * FLOAT_BYTES)


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


def grad_reduce_bytes_per_param(precision: str) -> int:
    """Bytes per parameter the data-parallel gradient reduction moves: the
    gradient buffer's element (4 for fp32 and bf16/fp8, whose gradients are
    reduced in fp32; 2 for fp16). All-reduced without the distributed optimizer,
    reduce-scattered with it."""
    _check_precision(precision)
    return HALF_BYTES if precision == "fp16" else FLOAT_BYTES


def param_gather_bytes_per_param(precision: str, distributed_optimizer: bool) -> int:
    """Bytes per parameter the distributed optimizer all-gathers after its step
    (the updated weights at their training precision); 0 without it. A ring
    all-reduce is a reduce-scatter plus an all-gather, so with fp32 weights the
    data-parallel traffic is the all-reduce's."""
    _check_precision(precision)
    if not distributed_optimizer:
        return 0
    return FLOAT_BYTES if precision == "fp32" else HALF_BYTES


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


def layer_activation_bytes(
    seq_length: Number,
    micro_batch_size: Number,
    hidden_size: Number,
    num_heads: Number,
    tp: Number = 1,
    *,
    sequence_parallel: bool = False,
    attention_scores: bool = True,
    element_bytes: Number = HALF_BYTES,
) -> Number:
    """Bytes one transformer layer stores for one micro-batch's backward pass
    (Korthikanti et al., Section 4, Table 2).

    With 2-byte elements: ``s b h (10 + 24 / t + 5 a s / (h t))`` under tensor
    parallelism, ``s b h (34 / t + 5 a s / (h t))`` with sequence parallelism;
    ``attention_scores=False`` drops the ``5 a s / (h t)`` term (the softmax
    output, its dropout mask and dropout output): selective recomputation
    recomputes them, and flash attention never stores them in the first place.

    Per element kind, with ``e = element_bytes``: 4 ``s b h`` elements (the
    inputs of the two layer norms, of the QKV projection and of the MLP) and 2
    one-byte dropout masks are replicated over the tensor-parallel ranks unless
    sequence parallelism splits them; 12 ``s b h`` elements (Q, K, V, the output
    projection's input, the MLP's 4h GeLU input and output) are split by ``t``;
    the scores are ``2 a s^2 b`` elements and an ``a s^2 b`` mask, split by
    ``t``. So ``(4 e + 2) + 12 e / t`` per ``s b h``, and ``(2 e + 1) a s / h /
    t`` for the scores: ``10 + 24 / t`` and ``5 a s / (h t)`` at ``e = 2``.

    Args:
        seq_length, micro_batch_size, hidden_size, num_heads: ``s, b, h, a``.
        tp: the tensor parallel size ``t``.
        sequence_parallel: Megatron's sequence parallelism.
        attention_scores: the ``s x s`` attention tensors are stored.
        element_bytes: bytes per stored element
            (:func:`activation_element_bytes`).

    Example:
        >>> # GPT-3 175B, t = 8: 5 a s / h = 80 (the paper's number), so
        >>> # s b h (10 + 3 + 10) = 23 s b h bytes.
        >>> layer_activation_bytes(2048, 1, 12288, 96, 8) / (2048 * 12288)
        23.0
    """
    s, b, h = seq_length, micro_batch_size, hidden_size
    e = element_bytes
    replicated = 4 * e + 2
    split = 12 * e
    per_token = split / tp + (replicated / tp if sequence_parallel else replicated)
    scores = (2 * e + 1) * num_heads * s / (hidden_size * tp)
    return s * b * h * (per_token + (scores if attention_scores else 0.0))


def layer_input_bytes(
    seq_length: Number,
    micro_batch_size: Number,
    hidden_size: Number,
    tp: Number = 1,
    *,
    sequence_parallel: bool = False,
    element_bytes: Number = HALF_BYTES,
) -> Number:
    """Bytes of a layer's input, ``e s b h`` (split by ``t`` with sequence
    parallelism): all a fully recomputed layer stashes (Korthikanti et al.,
    ``2 s b h``), and what a pipeline boundary sends per micro-batch."""
    size = element_bytes * seq_length * micro_batch_size * hidden_size
    return size / tp if sequence_parallel else size


def boundary_message_bytes(
    seq_length: Number,
    micro_batch_size: Number,
    hidden_size: Number,
    tp: Number = 1,
    *,
    sequence_parallel: bool = False,
    element_bytes: Number = HALF_BYTES,
) -> Number:
    """Bytes per GPU a pipeline boundary moves per micro-batch (the activation,
    or its gradient): the hidden state ``[s, b, h]``, whose sequence Megatron
    splits by ``t`` in the point-to-point tensor with sequence parallelism."""
    return layer_input_bytes(
        seq_length,
        micro_batch_size,
        hidden_size,
        tp,
        sequence_parallel=sequence_parallel,
        element_bytes=element_bytes,
    )


def recomputed_layers(
    num_layers: Number, recompute: str, recompute_num_layers: int | None = None
) -> Number:
    """Layers of a model chunk that ``recompute="full"`` recomputes: Megatron's
    ``block`` method recomputes the chunk's first ``recompute_num_layers`` layers
    one at a time (``None``: all of them); 0 for the other granularities."""
    _check_recompute(recompute)
    if recompute != "full":
        return _plain(0 * np.asarray(num_layers))
    if recompute_num_layers is None:
        return num_layers
    return _plain(np.minimum(num_layers, recompute_num_layers))


def stash_per_microbatch_bytes(
    num_layers: Number,
    seq_length: Number,
    micro_batch_size: Number,
    hidden_size: Number,
    num_heads: Number,
    tp: Number = 1,
    *,
    recompute: str = "none",
    recompute_num_layers: int | None = None,
    sequence_parallel: bool = False,
    flash_attention: bool = True,
    element_bytes: Number = HALF_BYTES,
) -> Number:
    """Bytes the transformer layers of a model chunk hold for one in-flight
    micro-batch until its backward pass.

    ``none``: every layer's :func:`layer_activation_bytes` (with the scores
    unless ``flash_attention``). ``selective``: the same without the scores.
    ``full``: the :func:`recomputed_layers` hold their :func:`layer_input_bytes`
    only, the others everything. The embedding, the final norm and the loss are
    not included (the caller adds them).
    """
    _check_recompute(recompute)
    shape = (seq_length, micro_batch_size, hidden_size)
    full = layer_activation_bytes(
        *shape,
        num_heads,
        tp,
        sequence_parallel=sequence_parallel,
        attention_scores=recompute != "selective" and not flash_attention,
        element_bytes=element_bytes,
    )
    recomputed = recomputed_layers(num_layers, recompute, recompute_num_layers)
    inputs = layer_input_bytes(
        *shape, tp, sequence_parallel=sequence_parallel, element_bytes=element_bytes
    )
    return recomputed * inputs + (num_layers - recomputed) * full


def recompute_working_bytes(
    seq_length: Number,
    micro_batch_size: Number,
    hidden_size: Number,
    num_heads: Number,
    tp: Number = 1,
    *,
    recompute: str = "none",
    sequence_parallel: bool = False,
    flash_attention: bool = True,
    element_bytes: Number = HALF_BYTES,
) -> Number:
    """Bytes recomputation re-materializes at once during a backward pass, held
    once per GPU (not per in-flight micro-batch): ``full``: one layer's
    activations; ``selective``: one layer's attention scores (0 with flash
    attention, which has none); ``none``: 0."""
    _check_recompute(recompute)
    if recompute == "none" or (recompute == "selective" and flash_attention):
        return _plain(0.0 * np.asarray(seq_length))
    kwargs = {"sequence_parallel": sequence_parallel, "element_bytes": element_bytes}
    shape = (seq_length, micro_batch_size, hidden_size, num_heads, tp)
    with_scores = layer_activation_bytes(*shape, attention_scores=True, **kwargs)
    if recompute == "selective":
        return with_scores - layer_activation_bytes(
            *shape, attention_scores=False, **kwargs
        )
    return layer_activation_bytes(
        *shape, attention_scores=not flash_attention, **kwargs
    )


# -------------------------------------------------------------------- time
def recompute_time(
    recompute: str, recomputed_forward_s: Number, attention_core_forward_s: Number
) -> Number:
    """Seconds recomputation adds to a model chunk's backward per micro-batch.

    Args:
        recompute: ``"none"``, ``"selective"`` or ``"full"``.
        recomputed_forward_s: the forward seconds of the chunk's
            :func:`recomputed_layers` (``full`` runs them again before their
            backward).
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


# ------------------------------------------------------------ interleaving
def interleaved_in_flight(
    rank: int, num_ranks: int, num_chunks: int, num_microbatches: int
) -> int:
    """Micro-batch-chunks a pipeline rank holds at its peak under Megatron's
    (interleaved when ``num_chunks > 1``) 1F1B schedule: its warm-up forwards
    plus one, at most all ``V M`` (what :func:`~pipedejavu.simulation.
    interleaved.simulate_interleaved` reports). Each holds one chunk's
    :func:`stash_per_microbatch_bytes`."""
    return peak_in_flight_count(rank, num_ranks, num_chunks, num_microbatches)


def interleaving_memory_factor(num_ranks: Number, num_chunks: Number) -> Number:
    """Megatron-LM's activation memory penalty of interleaving on the first
    rank, ``1 + (P - 1) / (P V)``: its ``V P + P - 1`` micro-batch-chunks of
    ``1 / V`` of its layers each, over the ``P`` whole micro-batches of the
    non-interleaved schedule (``theoretical_memory_usage.py``)."""
    return 1.0 + (num_ranks - 1) / (num_ranks * num_chunks)
