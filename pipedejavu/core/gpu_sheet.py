"""One GPU type's published specifications: what the analytical cost model reads.

This module is vocabulary: it imports nothing else of ours. The bundled sheet
(``pipedejavu/data/gpus.json``, each entry with its sources) and a user's own
file are read into :class:`GpuSheetEntry` values by the I/O layer.

Units: bytes, bytes per second, FLOP per second (dense, no sparsity).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["PRECISIONS", "GpuSheetEntry", "Precision"]

Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class GpuSheetEntry:
    """A GPU type.

    Args:
        name: the name plans and ``--gpus`` use (``A100-80``, ``H100-SXM``, ...).
        memory_bytes: device memory.
        memory_bandwidth_bytes_per_s: device memory bandwidth (HBM/GDDR).
        peak_flops: ``(precision, FLOP/s)`` pairs of dense peak throughput; a
            precision the GPU lacks is absent (``fp8`` before Hopper/Ada).
        gpus_per_node: GPUs in the common node build.
        intra_node_bytes_per_s: one GPU's bandwidth to the others of its node
            (NVLink / Infinity Fabric, or PCIe where there is none), one
            direction.
        inter_node_bytes_per_s: one node's network bandwidth to other nodes
            (all its NICs together), one direction.
        sources: where the numbers come from (URLs or document titles).
    """

    name: str
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    peak_flops: tuple[tuple[Precision, float], ...]
    gpus_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    sources: tuple[str, ...] = ()

    def peak(self, precision: Precision) -> float:
        """Dense peak FLOP/s at ``precision``; ``KeyError`` if the GPU lacks it."""
        for name, value in self.peak_flops:
            if name == precision:
                return value
        raise KeyError(f"{self.name} has no {precision} peak on the GPU sheet")
