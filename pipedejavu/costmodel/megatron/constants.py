"""The Megatron-style predictor's constants: fixed physical ones, and the free
ones :func:`pipedejavu.costmodel.megatron.fit.fit_constants` fits on measured runs
(``tests/test_megatron_fit.py`` reproduces :data:`FITTED_CONSTANTS` from the data).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "BUCKET_ELEMENTS",
    "BYTES_PER_PARAM",
    "DEFAULT_CONSTANTS",
    "FITTED_CONSTANTS",
    "FLOAT_BYTES",
    "NCCL_BUFFER_BYTES",
    "PredictorConstants",
]

#: fp32 weights + gradients + Adam's first and second moments.
BYTES_PER_PARAM = 16
#: DeepSpeed's ``MEMORY_OPT_ALLREDUCE_SIZE``: elements per gradient bucket.
BUCKET_ELEMENTS = 500_000_000
FLOAT_BYTES = 4


#: NCCL's default ``NCCL_BUFFSIZE`` (4 MiB): a point-to-point message per GPU up
#: to this size is buffered (the sender does not wait for the receiver).
NCCL_BUFFER_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class PredictorConstants:
    """The predictor's constants; the first three are fitted, each a physical
    quantity (see :mod:`pipedejavu.costmodel.megatron.fit`).

    Args:
        op_overhead_s: seconds a pipeline instruction (one stage's forward or
            backward of a micro-batch) takes beyond its layers' profiled times:
            the framework's work between and around the layers, which a per-layer
            profile does not see.
        reserve_bytes: ``(gpu_type, bytes)`` pairs: device memory in use beyond
            what the model accounts for (CUDA context, NCCL buffers, libraries).
        default_reserve_bytes: the reserve of a GPU type not listed.
        activation_overhead: extra device memory per byte of stashed activations
            (the temporaries of the running micro-batch and the caching
            allocator's rounding and fragmentation), a fraction.
        buffered_message_bytes: a point-to-point message of at most this many
            bytes per GPU does not block its sender (not fitted: NCCL's default
            buffer, :data:`NCCL_BUFFER_BYTES`).
        smooth_profiles: use
            :func:`~pipedejavu.costmodel.megatron.sailor_data.smooth_profile`
            (layer times affine in mbs) instead of the raw entries.
    """

    op_overhead_s: float = 0.0
    reserve_bytes: tuple[tuple[str, float], ...] = ()
    default_reserve_bytes: float = 0.0
    activation_overhead: float = 0.0
    buffered_message_bytes: float = NCCL_BUFFER_BYTES
    smooth_profiles: bool = True

    def __post_init__(self) -> None:
        pairs = tuple((str(k), float(v)) for k, v in self.reserve_bytes)
        for name, value in pairs:
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"reserve_bytes of {name} must be finite and >= 0, got {value}"
                )
        object.__setattr__(self, "reserve_bytes", pairs)
        for name in (
            "op_overhead_s",
            "default_reserve_bytes",
            "activation_overhead",
            "buffered_message_bytes",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    def reserve(self, gpu_type: str) -> float:
        """Reserve bytes of a GPU type."""
        return dict(self.reserve_bytes).get(gpu_type, self.default_reserve_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "op_overhead_s": self.op_overhead_s,
            "reserve_bytes": dict(self.reserve_bytes),
            "default_reserve_bytes": self.default_reserve_bytes,
            "activation_overhead": self.activation_overhead,
            "buffered_message_bytes": self.buffered_message_bytes,
            "smooth_profiles": self.smooth_profiles,
        }


DEFAULT_CONSTANTS = PredictorConstants()

#: The constants :func:`fit_constants` returns on the bundled runs.
FITTED_CONSTANTS = PredictorConstants(
    op_overhead_s=2.0272e-3,
    reserve_bytes=(("GH-96", 4.4321e9),),
    default_reserve_bytes=4.4321e9,
    activation_overhead=0.11981,
)
