"""The values the profile readers return: per-layer times, model sizes, link
fits and GPU specs (:mod:`pipedejavu.costmodel.megatron.sailor_data` reads them
from a Sailor-style folder; the analytical source builds them too)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.problem import ProblemError

__all__ = [
    "FIT_LOG2_MB_RANGE",
    "BandwidthFit",
    "GpuSpec",
    "LayerTimes",
    "ModelInfo",
    "with_memory_headroom",
]

#: Message sizes the link fits were measured on: 2**16 .. 2**30 bytes; the fits
#: are used for messages of 1 MB .. 2**30 bytes (``log2(bytes / 1e6)`` in [0, 10])
#: and held constant outside (bandwidth of the nearest end).
FIT_LOG2_MB_RANGE = (0.0, 10.0)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerTimes:
    """Per-layer times for one (GPU type, mbs, tp).

    Attributes:
        forward, backward: f64[L + 2] seconds per micro-batch on one GPU of the
            TP group (TP communication included).
        update: f64[L + 2] seconds of the optimizer step of the profiling model
            (the same value repeated; see
            :mod:`pipedejavu.costmodel.megatron.predictor`).
        weight_grad: f64[L + 2] the part of ``backward`` that computes and
            accumulates weight gradients (what a zero-bubble schedule defers),
            or ``None`` where the source does not split it (profiles).
        recompute: f64[L + 2] seconds a layer's backward adds when Megatron's
            ``block`` method reruns it (``rules.span_backward``); ``None``:
            ``backward`` holds every recomputation.
    """

    forward: NDArray[np.float64]
    backward: NDArray[np.float64]
    update: NDArray[np.float64]
    weight_grad: NDArray[np.float64] | None = None
    recompute: NDArray[np.float64] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ModelInfo:
    """Sizes per layer for one model, per TP degree, for one GPU of a TP group.

    Attributes:
        name: the model's profile name.
        params: ``{tp: f64[L + 2]}`` parameters (floats) held.
        act_output: ``{tp: f64[L + 2]}`` floats of the layer's output at mbs 1
            (what is sent to the next stage after it).
        act_mem: ``{tp: f64[L + 2]}`` floats allocated by the layer's forward at
            mbs 1 (kept until its backward).
        activation_bytes: bytes of one element of ``act_output`` and
            ``act_mem`` (4: Sailor's fp32 profiles; 2 in fp16/bf16 training).
        gradient_bytes: bytes of one gradient element in the data-parallel and
            tied-embedding all-reduces and their buckets (4 in fp32 and bf16
            training, whose gradients are reduced in fp32; 2 in fp16).
        state_bytes_per_param: model state bytes per parameter a GPU holds
            (weights, gradients, optimizer state: 16 in fp32 with Adam; see
            :func:`pipedejavu.costmodel.megatron.options.bytes_per_param`);
            with the distributed optimizer only the replicated part.
        sharded_state_bytes_per_param: the part of the model state the
            distributed optimizer shards over the data-parallel replicas (0
            without it).
        distributed_optimizer: each data-parallel replica steps only its
            shard of the optimizer state (Megatron-LM's
            ``--use-distributed-optimizer``).
        tied: ``{tp: floats}`` of the word embedding the first and last layer
            share, where known exactly (``None``: :meth:`tied_params` infers it).
        recompute_layers: ``--recompute-method block --recompute-num-layers``:
            the first this many blocks of each stage (model chunk) rerun
            (``None``: ``act_mem`` says what every layer keeps).
        recomputed_mem: ``{tp: f64[L + 2]}`` what a rerun layer keeps (its
            input); ``blocks``: the layers ``[first, stop)`` that are blocks.
        expert_params: ``{tp: f64[L + 2]}`` the part of ``params`` that is
            experts' (a mixture of experts: laid out over ``etp x ep`` GPUs,
            their gradients reduced and their optimizer state sharded over
            the expert data-parallel GPUs instead of the replicas); ``None``:
            none.
        expert_axes: ``(ep, etp)`` the expert parameters are counted for
            (``etp`` ``None``: ``tp``); a plan's layout must have them.
        zero_stage: what data parallelism shards
            (:attr:`~pipedejavu.core.training_options.TrainingOptions.
            zero_stage`; 1 is ``distributed_optimizer``); the sharded part is
            ``sharded_state_bytes_per_param``, over the layout's shard group.
        reshard_after_forward: with ``zero_stage`` 3, each layer's
            parameters are gathered again for its backward.
        weight_bytes: bytes of a weight as the passes read it (4 in fp32,
            2 in 16-bit training): what stage 3 gathers.
    """

    name: str
    params: Mapping[int, NDArray[np.float64]]
    act_output: Mapping[int, NDArray[np.float64]]
    act_mem: Mapping[int, NDArray[np.float64]]
    activation_bytes: float = 4.0
    gradient_bytes: float = 4.0
    state_bytes_per_param: float = 16.0
    sharded_state_bytes_per_param: float = 0.0
    distributed_optimizer: bool = False
    tied: Mapping[int, float] | None = None
    recompute_layers: int | None = None
    recomputed_mem: Mapping[int, NDArray[np.float64]] | None = None
    blocks: tuple[int, int] | None = None
    expert_params: Mapping[int, NDArray[np.float64]] | None = None
    expert_axes: tuple[int, int | None] = (1, None)
    zero_stage: int = 0
    reshard_after_forward: bool = True
    weight_bytes: float = 4.0

    def content_key(self) -> tuple:
        """A hashable key equal for two infos of equal content (every field;
        the arrays by their bytes): what memoises a rule of the sizes alone
        across the cost sources of a search."""
        out: list = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Mapping):
                value = tuple(
                    (k, (v.dtype.str, v.shape, v.tobytes()))
                    if isinstance(v, np.ndarray)
                    else (k, v)
                    for k, v in sorted(value.items())
                )
            out.append(value)
        return tuple(out)

    @property
    def num_layers(self) -> int:
        """``L + 2`` profile layers."""
        return len(next(iter(self.params.values())))

    @property
    def tp_values(self) -> tuple[int, ...]:
        return tuple(sorted(self.params))

    def check_tp(self, tp: int) -> None:
        if tp not in self.params:
            raise ProblemError(
                f"model {self.name} has no sizes for tp {tp} (llm_info has "
                f"{list(self.tp_values)})"
            )

    def dense_params(self, tp: int) -> NDArray[np.float64]:
        """``params`` less the experts': what the replicas all-reduce."""
        if self.expert_params is None:
            return self.params[tp]
        return self.params[tp] - self.expert_params[tp]

    def tied_params(self, tp: int) -> float:
        """Floats of the word embedding shared by the first and last layer (the
        smaller of the two layers' parameters: Megatron-DeepSpeed's GPT ties the
        LM head to the input embedding; the two layers differ only by the position
        embedding and the final norm)."""
        self.check_tp(tp)
        if self.tied is not None:
            return float(self.tied[tp])
        params = self.params[tp]
        return float(min(params[0], params[-1]))


@dataclasses.dataclass(frozen=True)
class BandwidthFit:
    """A fitted link: ``bandwidth = a x^2 + b x + c`` GB/s, ``x = log2(bytes/1e6)``.

    Args:
        coeffs: ``(a, b, c)``.
        max_bytes_per_s: the measured maximum; the fit is capped at it.

    ``x`` is clamped to :data:`FIT_LOG2_MB_RANGE` (the fits are positive there).
    """

    coeffs: tuple[float, float, float]
    max_bytes_per_s: float

    def bandwidth(self, message_bytes: float) -> float:
        """Bytes per second for messages of ``message_bytes``."""
        low, high = FIT_LOG2_MB_RANGE
        x = math.log2(max(message_bytes, 1.0) / 1e6)
        x = min(max(x, low), high)
        a, b, c = self.coeffs
        fitted = (a * x * x + b * x + c) * 1e9
        return max(min(fitted, self.max_bytes_per_s), 1e-3 * self.max_bytes_per_s)

    def bandwidths(self, message_bytes: NDArray[np.float64]) -> NDArray[np.float64]:
        """:meth:`bandwidth` of each entry (vectorized)."""
        low, high = FIT_LOG2_MB_RANGE
        x = np.log2(np.maximum(message_bytes, 1.0) / 1e6)
        x = np.clip(x, low, high)
        a, b, c = self.coeffs
        fitted = (a * x * x + b * x + c) * 1e9
        return np.maximum(
            np.minimum(fitted, self.max_bytes_per_s), 1e-3 * self.max_bytes_per_s
        )

    def time(self, total_bytes: float, message_bytes: float | None = None) -> float:
        """Seconds to move ``total_bytes`` in messages of ``message_bytes``."""
        if total_bytes <= 0:
            return 0.0
        size = total_bytes if message_bytes is None else message_bytes
        return total_bytes / self.bandwidth(size)


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A GPU type: ``gpus_per_node`` and the device memory plans may use.

    Attributes:
        name: the type's name.
        gpus_per_node: GPUs a node holds.
        memory_bytes: the memory a plan may use on one GPU (its capacity less
            the user's headroom: :meth:`with_headroom`); every memory rule
            reads this.
        capacity_bytes: the GPU's memory before any headroom (``None``: the
            same as ``memory_bytes``).
    """

    name: str
    gpus_per_node: int
    memory_bytes: float
    capacity_bytes: float | None = None

    @property
    def capacity(self) -> float:
        """The GPU's memory before any headroom."""
        return self.memory_bytes if self.capacity_bytes is None else self.capacity_bytes

    def with_headroom(self, headroom: MemoryHeadroom | None) -> GpuSpec:
        """This GPU type with ``headroom`` kept free of its capacity."""
        if headroom is None or headroom.is_zero:
            return self
        capacity = self.capacity
        return dataclasses.replace(
            self,
            memory_bytes=headroom.usable_bytes(capacity),
            capacity_bytes=capacity,
        )


def with_memory_headroom(source: Any, headroom: MemoryHeadroom | None) -> Any:
    """A shallow copy of a cost source (a ``SailorData`` or an
    ``AnalyticalSource``) whose ``gpu_spec`` keeps ``headroom`` free on every
    GPU; what it has read or priced is shared."""
    out = copy.copy(source)
    out.memory_headroom = headroom
    return out
