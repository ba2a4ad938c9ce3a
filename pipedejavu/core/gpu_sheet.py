"""One GPU type's published specifications: what the analytical cost model reads.

This module is vocabulary: it imports nothing else of ours. The bundled sheet
(``pipedejavu/data/gpus.json``, each entry with its sources) and a user's own
file are read into :class:`GpuSheetEntry` values by the I/O layer.

Units: bytes, bytes per second, FLOP per second (dense, no sparsity).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

__all__ = [
    "EXPONENTIALS_PER_CLOCK",
    "MAX_GPUS_PER_NODE",
    "MAX_MULTIPROCESSORS",
    "PEAK_PRECISIONS",
    "PRECISIONS",
    "GpuSheetEntry",
    "PeakPrecision",
    "Precision",
]

#: The precisions the cost model prices an operation in.
Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")
#: The precisions a sheet entry may give a peak for: :data:`PRECISIONS` and
#: ``fp4`` (Blackwell's FP4 tensor cores, NVFP4/MXFP4), which the sheet records
#: but no operation is priced in yet.
PeakPrecision = Literal["fp32", "tf32", "fp16", "bf16", "fp8", "fp4"]
PEAK_PRECISIONS: tuple[PeakPrecision, ...] = (*PRECISIONS, "fp4")
#: Most GPUs of a node (one NVLink/NVSwitch domain): far above the largest
#: built (576), a bound on a user file's value, not a claim.
MAX_GPUS_PER_NODE = 4096
#: Exponentials (the special-function units' ``ex2``) one multiprocessor
#: issues per clock: 16 on every NVIDIA architecture since Maxwell (the CUDA
#: C++ Programming Guide's throughput table), taken as the same per compute
#: unit on AMD's CDNA (an assumption, not checked).
EXPONENTIALS_PER_CLOCK = 16
#: Most multiprocessors of one GPU: far above any built (304), a bound on a
#: user file's value.
MAX_MULTIPROCESSORS = 100_000


@dataclasses.dataclass(frozen=True)
class GpuSheetEntry:
    """A GPU type.

    Args:
        name: the name plans and ``--gpus`` use (``A100-80``, ``H100-SXM``, ...).
        memory_bytes: device memory.
        memory_bandwidth_bytes_per_s: device memory bandwidth (HBM/GDDR).
        peak_flops: ``(precision, FLOP/s)`` pairs of dense peak throughput
            (precisions of :data:`PEAK_PRECISIONS`); a precision the GPU lacks
            is absent (``fp8`` before Hopper/Ada, ``fp4`` before Blackwell).
        gpus_per_node: GPUs in the common node build.
        intra_node_bytes_per_s: one GPU's bandwidth to the others of its node
            (NVLink / Infinity Fabric, or PCIe where there is none), one
            direction.
        inter_node_bytes_per_s: one node's network bandwidth to other nodes
            (all its NICs together), one direction.
        sources: where the numbers come from (URLs or document titles).
        note: what the numbers assume, and where they are uncertain.
        multiprocessors: streaming multiprocessors (compute units on AMD);
            ``None``: unknown.
        clock_hz: the clock the tensor peaks are quoted at (with
            ``multiprocessors``, both or neither); ``None``: unknown.

    Raises:
        ValueError: a number is not positive and finite, ``gpus_per_node`` is not
            a positive integer, a precision is unknown or repeated, or no peak is
            given.
    """

    name: str
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    peak_flops: tuple[tuple[PeakPrecision, float], ...]
    gpus_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    sources: tuple[str, ...] = ()
    note: str = ""
    multiprocessors: int | None = None
    clock_hz: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        where = f"GPU {self.name}"
        for field in (
            "memory_bytes",
            "memory_bandwidth_bytes_per_s",
            "intra_node_bytes_per_s",
            "inter_node_bytes_per_s",
        ):
            _check_positive(getattr(self, field), f"{where}: {field}")
        count = self.gpus_per_node
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ValueError(
                f"{where}: gpus_per_node must be a positive integer, got {count!r}"
            )
        if count > MAX_GPUS_PER_NODE:
            raise ValueError(
                f"{where}: gpus_per_node must be at most {MAX_GPUS_PER_NODE}, "
                f"got {count}"
            )
        if not self.peak_flops:
            raise ValueError(f"{where}: peak_flops must name at least one precision")
        seen = set()
        for pair in self.peak_flops:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(
                    f"{where}: peak_flops must hold (precision, FLOP/s) pairs, "
                    f"got {pair!r}"
                )
            precision, value = pair
            if precision not in PEAK_PRECISIONS:
                raise ValueError(
                    f"{where}: unknown precision {precision!r} (known: "
                    f"{', '.join(PEAK_PRECISIONS)})"
                )
            if precision in seen:
                raise ValueError(f"{where}: precision {precision} given twice")
            seen.add(precision)
            _check_positive(value, f"{where}: peak {precision}")
        if not all(isinstance(source, str) for source in self.sources):
            raise ValueError(f"{where}: sources must be strings")
        if not isinstance(self.note, str):
            raise ValueError(f"{where}: note must be a string")
        if (self.multiprocessors is None) != (self.clock_hz is None):
            raise ValueError(
                f"{where}: give multiprocessors and clock_hz together, or neither"
            )
        if self.multiprocessors is not None:
            count = self.multiprocessors
            if (
                not isinstance(count, int)
                or isinstance(count, bool)
                or not 0 < count <= MAX_MULTIPROCESSORS
            ):
                raise ValueError(
                    f"{where}: multiprocessors must be an integer in 1.."
                    f"{MAX_MULTIPROCESSORS}, got {count!r}"
                )
            _check_positive(self.clock_hz, f"{where}: clock_hz")
            if self.clock_hz > 1e11:
                raise ValueError(
                    f"{where}: clock_hz must be at most 1e11, got {self.clock_hz!r}"
                )

    @property
    def precisions(self) -> tuple[PeakPrecision, ...]:
        """The precisions with a peak on the sheet."""
        return tuple(name for name, _ in self.peak_flops)

    @property
    def exponentials_per_s(self) -> float | None:
        """Exponentials per second at the tensor peaks' clock
        (:data:`EXPONENTIALS_PER_CLOCK` per multiprocessor); ``None`` where
        the sheet does not give the multiprocessors."""
        if self.multiprocessors is None or self.clock_hz is None:
            return None
        return EXPONENTIALS_PER_CLOCK * self.multiprocessors * self.clock_hz

    def has_memory_gb(self, size: int) -> bool:
        """Whether ``size`` is this GPU's memory in whole GB as names give it
        (``A100-80``, ``H100 80GB``): the capacity rounded to GiB (the sheet's
        convention, :file:`GPUS.md`) or to decimal GB (a file's own figure)."""
        return size in (
            round(self.memory_bytes / 2**30),
            round(self.memory_bytes / 1e9),
        )

    def peak(self, precision: PeakPrecision) -> float:
        """Dense peak FLOP/s at ``precision``; ``KeyError`` if the GPU lacks it."""
        for name, value in self.peak_flops:
            if name == precision:
                return value
        raise KeyError(f"{self.name} has no {precision} peak on the GPU sheet")


def _check_positive(value: object, where: str) -> None:
    # An int is finite: math.isfinite would overflow converting a huge one.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
        or value <= 0
    ):
        raise ValueError(f"{where} must be a positive finite number, got {value!r:.40}")
