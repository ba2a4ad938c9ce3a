"""Memory a plan leaves free on every GPU.

This module is vocabulary: it imports nothing else of ours. A plan at 99% of
a GPU's nominal memory runs out of memory on a cluster whose allocator
fragments, whose CUDA context or NCCL buffers are larger than the predictor's
reserve, or whose GPUs report less memory than their datasheet.
:class:`MemoryHeadroom` is what a user keeps free: a fraction of each GPU's
memory, a number of gigabytes, or both. The cost sources apply it where they
say how much memory a GPU type has (``gpu_spec``), so the predictor, the
planning tables and the proof's bounds all read the one usable capacity
(:meth:`MemoryHeadroom.usable_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

__all__ = ["MAX_HEADROOM_GB", "MemoryHeadroom", "kept_free"]

#: The most gigabytes a headroom may name (more than any GPU has).
MAX_HEADROOM_GB = 10_000.0
_GB = 1e9
_NUMBER = r"\s*(\d+(?:\.\d*)?|\.\d+)\s*"


@dataclasses.dataclass(frozen=True)
class MemoryHeadroom:
    """Device memory every GPU of a plan keeps free.

    Attributes:
        fraction: the share of each GPU's memory kept free, in ``[0, 1)``.
        gigabytes: gigabytes (``1e9`` bytes) kept free on every GPU, besides
            ``fraction``, in ``[0, MAX_HEADROOM_GB]``.
    """

    fraction: float = 0.0
    gigabytes: float = 0.0

    def __post_init__(self) -> None:
        for name, high in (("fraction", 1.0), ("gigabytes", MAX_HEADROOM_GB)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0 or value > high:
                raise ValueError(f"{name} must lie in [0, {high:g}], got {value!r}")
        if self.fraction >= 1.0:
            raise ValueError(f"fraction must be below 1, got {self.fraction!r}")

    @classmethod
    def parse(cls, text: str) -> MemoryHeadroom:
        """``"0.1"`` or ``"10%"`` (a fraction), ``"8GB"``, ``"8 GB"`` or
        ``"8G"`` (gigabytes).

        Raises:
            ValueError: anything else, or a value out of range.
        """
        shown = text if len(text) <= 40 else f"{text[:40]}..."
        percent = re.fullmatch(_NUMBER + "%\\s*", text)
        gigabytes = re.fullmatch(_NUMBER + "(?:GB|G)\\s*", text, re.IGNORECASE)
        fraction = re.fullmatch(_NUMBER, text)
        if percent:
            return cls(fraction=float(percent.group(1)) / 100)
        if gigabytes:
            return cls(gigabytes=float(gigabytes.group(1)))
        if fraction:
            value = float(fraction.group(1))
            if value >= 1:
                raise ValueError(
                    f"a fraction of each GPU's memory must be below 1, got "
                    f"{shown!r} (for gigabytes write {value:g}GB)"
                )
            return cls(fraction=value)
        raise ValueError(
            f"expected a fraction (0.1), a percentage (10%) or gigabytes (8GB), "
            f"got {shown!r}"
        )

    @classmethod
    def of(cls, value: MemoryHeadroom | float | str | None) -> MemoryHeadroom | None:
        """``value`` as a headroom: ``None`` stays ``None``, a number is a
        fraction, a string is :meth:`parse`'d.

        Raises:
            ValueError: a value :meth:`parse` or the fields refuse.
        """
        if value is None or isinstance(value, MemoryHeadroom):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"memory_headroom must be a fraction, a string such as '8GB' or a "
                f"MemoryHeadroom, got {value!r}"
            )
        return cls(fraction=float(value))

    @property
    def is_zero(self) -> bool:
        """Nothing is kept free."""
        return self.fraction == 0 and self.gigabytes == 0

    def usable_bytes(self, capacity_bytes: float) -> float:
        """The memory a plan may use on a GPU of ``capacity_bytes``."""
        return capacity_bytes * (1.0 - self.fraction) - self.gigabytes * _GB

    def describe(self) -> str:
        """``10% of each GPU's memory``, ``8 GB a GPU`` or both."""
        parts = []
        if self.fraction:
            parts.append(f"{100 * self.fraction:g}% of each GPU's memory")
        if self.gigabytes:
            parts.append(f"{self.gigabytes:g} GB a GPU")
        return " and ".join(parts) or "none"

    def to_json(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "gigabytes": self.gigabytes}


def kept_free(headroom: MemoryHeadroom | None) -> str:
    """`` (with 10% of each GPU's memory kept free)`` for a message saying
    that nothing fits; empty without a headroom."""
    if headroom is None or headroom.is_zero:
        return ""
    return f" (with {headroom.describe()} kept free)"
