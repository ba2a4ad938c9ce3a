"""What GPUs cost: a price sheet of dollars (or any currency) per GPU-hour.

The file is JSON::

    {"currency": "USD",
     "per_gpu_hour": {"H100-SXM": 2.5, "A100-80": 1.3},
     "note": "what the prices are (optional)",
     "example": true}

``per_gpu_hour`` names GPU types as the GPU sheet does (its names or
aliases); ``example`` marks a sheet whose prices are illustrations, not
quotes (the bundled ``prices-example.json`` is one, and every report says
so). The prices are the user's: nothing here knows a market. A file is
untrusted: size-bounded, every key and value checked, one line naming the
file for anything wrong.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from pipedejavu.core.files import read_json
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.gpu_sheet import GpuSheet

__all__ = ["PriceSheet", "load_price_sheet"]

_MAX_BYTES = 1 << 16
_KEYS = {"currency", "per_gpu_hour", "note", "example"}
_MAX_TYPES = 256


@dataclasses.dataclass(frozen=True)
class PriceSheet:
    """Prices per GPU-hour by the GPU sheet's type names (module docstring)."""

    currency: str
    per_gpu_hour: Mapping[str, float]
    note: str = ""
    example: bool = False
    source: str = ""

    def price(self, gpu: str) -> float:
        """The price of one ``gpu`` (a GPU sheet name) for an hour.

        Raises:
            ProblemError: a type the sheet does not price.
        """
        if gpu not in self.per_gpu_hour:
            raise ProblemError(
                f"{self.source or 'the price sheet'} has no price for {gpu} "
                f"(it prices {', '.join(sorted(self.per_gpu_hour))})"
            )
        return self.per_gpu_hour[gpu]

    def cost(self, gpus: Mapping[str, int], seconds: float) -> float:
        """What ``gpus`` (``{type: count}``) cost for ``seconds``."""
        hourly = sum(self.price(g) * n for g, n in gpus.items())
        return hourly * seconds / 3600.0


def load_price_sheet(path: str | os.PathLike, sheet: GpuSheet) -> PriceSheet:
    """The price sheet in ``path``, its types named as ``sheet`` names them.

    Raises:
        ProblemError: one line naming the file: not JSON, too large, an
            unknown key, a type not on the GPU sheet (or twice), a price that
            is not a positive finite number.
    """
    name = os.fspath(path)
    data: Any = read_json(path, _MAX_BYTES, "price sheet")
    try:
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        unknown = sorted(str(k)[:40] for k in set(data) - _KEYS)
        if unknown:
            raise ValueError(f"unknown keys {unknown[:5]} (known: {sorted(_KEYS)})")
        currency = data.get("currency")
        if not isinstance(currency, str) or not 1 <= len(currency) <= 16:
            raise ValueError("currency must be a short name, e.g. USD")
        prices = data.get("per_gpu_hour")
        if not isinstance(prices, dict) or not 1 <= len(prices) <= _MAX_TYPES:
            raise ValueError(
                f"per_gpu_hour must map 1 to {_MAX_TYPES} GPU types to prices"
            )
        out: dict[str, float] = {}
        for gpu, value in prices.items():
            resolved = sheet.resolve_listed(gpu)
            if resolved in out:
                raise ValueError(f"{resolved} is priced twice")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"the price of {resolved} must be a number > 0")
            out[resolved] = float(value)
        note = data.get("note", "")
        if not isinstance(note, str) or len(note) > 2000:
            raise ValueError("note must be a string")
        example = data.get("example", False)
        if not isinstance(example, bool):
            raise ValueError("example must be true or false")
    except ValueError as error:
        raise ProblemError(f"{name}: {error}") from None
    return PriceSheet(currency, out, note, example, name)
