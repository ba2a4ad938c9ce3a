"""Layer pricing shared by the cost sources of a search.

A search builds one :class:`~pipedejavu.costmodel.analytical.source.
AnalyticalSource` per choice (recomputation, sequence parallelism, schedule,
optimizer, a mixture of experts' expert layout), and each prices its layers:
mostly the same pieces again (the dense rows do not depend on the expert
layout; no piece depends on the schedule or the optimizer). The pricing
functions are pure, so :class:`PriceCache` memoises them exactly: a call is
keyed by the function and every argument (arrays by dtype, shape and bytes;
other values by type and value, dataclasses such as the model, the GPU sheet
entry and the constants by equality), and a repeated call returns the first
call's result. The functions return numbers, arrays and tuples of them; the
arrays are stored as read-only copies (a caller that needs to change one
copies it). Errors are not stored (the call raises again).

:data:`SHARED_PRICES`, a bounded least-recently-used cache, is what every
source uses unless given its own.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np

__all__ = ["DEFAULT_MAXSIZE", "SHARED_PRICES", "PriceCache"]

T = TypeVar("T")

#: Entries :data:`SHARED_PRICES` keeps (a few KiB each: a search over a
#: mixture of experts' layouts on hundreds of GPUs needs some thousands).
DEFAULT_MAXSIZE = 8192


@dataclasses.dataclass
class PriceCache:
    """An exact memo of pure pricing functions, least recently used first out.

    Args:
        maxsize: entries kept (0: none, every call runs).

    Attributes:
        hits, misses: calls answered from the cache, and calls that ran.
    """

    maxsize: int = DEFAULT_MAXSIZE
    hits: int = 0
    misses: int = 0
    _store: OrderedDict[Hashable, Any] = dataclasses.field(
        default_factory=OrderedDict, repr=False
    )
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False
    )

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Forget every entry and the counts."""
        with self._lock:
            self._store.clear()
            self.hits = self.misses = 0

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, from the cache where the same call ran
        before (arrays in the result read-only)."""
        key = (fn, _key(args), _key(kwargs))
        with self._lock:
            if key in self._store:
                self.hits += 1
                self._store.move_to_end(key)
                return self._store[key]
            self.misses += 1
        value = _frozen(fn(*args, **kwargs))
        with self._lock:
            if self.maxsize > 0:
                self._store[key] = value
                self._store.move_to_end(key)
                while len(self._store) > self.maxsize:
                    self._store.popitem(last=False)
        return value


def _key(value: Any) -> Hashable:
    """A hashable key equal only for arguments equal in type and value."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    hash(value)  # (an unhashable argument is a caller's error: TypeError)
    return (type(value), value)


def _frozen(value: T) -> T:
    """``value`` with each array in it a read-only copy (tuples rebuilt);
    lists, dicts and sets are refused (a caller could change them)."""
    if isinstance(value, np.ndarray):
        out = value.copy()
        out.setflags(write=False)
        return out
    if type(value) is tuple:
        return tuple(_frozen(v) for v in value)  # type: ignore[return-value]
    if isinstance(value, (list, dict, set)):
        raise TypeError(f"a cached result must not be mutable: {type(value)}")
    return value


#: The cache the analytical sources share (module doc).
SHARED_PRICES = PriceCache()
