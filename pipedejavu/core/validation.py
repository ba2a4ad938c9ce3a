"""Validation shared by :class:`~pipedejavu.core.problem.Problem` and
:class:`~pipedejavu.core.hetero.HeteroProblem`: the stage tables, the submesh
shapes, counts, and the bounds that keep untrusted inputs small.

Both problems hold ``compute_cost[i, j, m, k(, t)]`` and a memory table of the
same shape; the helpers here check them once, the same way, with messages that
name the argument, what was expected and what arrived.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.errors import ProblemError

__all__ = [
    "CLUSTER_RANGES",
    "MAX_DEVICES",
    "MAX_MICROBATCHES",
    "UNLIMITED_SUCCEEDING_STAGES",
    "StageTableSizes",
    "as_count",
    "as_number",
    "cost_table",
    "describe",
    "freeze",
    "field_name",
    "in_range",
    "json_field",
    "json_float",
    "json_int",
    "json_list",
    "memory_limits",
    "memory_table",
    "positive_int",
    "submesh_table",
]

#: Value of ``max_n_succ_stages`` meaning "memory never limits this stage"
#: (Alpa's ``INFINITY_N_STAGES``).
UNLIMITED_SUCCEEDING_STAGES = 2**20

#: Largest cluster a problem may describe (devices); far above any real one,
#: small enough that per-device bookkeeping stays cheap on a corrupt file.
MAX_DEVICES = 2**20

#: Largest number of micro-batches (fits every integer type the solvers use).
MAX_MICROBATCHES = 2**31 - 1

#: The documented range ``(low, high, unit)`` of every number of a cluster
#: (:mod:`pipedejavu.core.cluster`), by key, in the key's own unit: wide enough
#: for any real hardware, narrow enough that no stage or transfer time
#: overflows. Bounds are inclusive; a bandwidth may also be ``"inf"`` (a free
#: link).
CLUSTER_RANGES: dict[str, tuple[float, float, str]] = {
    "speed": (1e-6, 1e6, "relative to the profiled device"),
    "memory_gb": (1e-6, 1e6, "gigabytes"),
    "memory_bytes": (1e3, 1e15, "bytes"),
    "latency_us": (0.0, 3.6e9, "microseconds"),
    "latency_s": (0.0, 3600.0, "seconds"),
    "bandwidth_gbps": (1e-9, 1e10, "gigabits per second"),
    "bandwidth_bytes_per_s": (1e-3, 1e18, "bytes per second"),
}


_P = TypeVar("_P", bound="StageTableSizes")


class StageTableSizes:
    """Sizes read off the stage table ``compute_cost[i, j, m, k(, t)]`` and the
    ``submesh_shapes`` of a (frozen dataclass) problem; one definition serves
    :class:`~pipedejavu.core.problem.Problem` and
    :class:`~pipedejavu.core.hetero.HeteroProblem`.
    """

    compute_cost: NDArray[np.float64]
    submesh_shapes: NDArray[np.int64]

    @property
    def num_layers(self) -> int:
        """L, the number of (clustered) layers."""
        return self.compute_cost.shape[0]

    @property
    def num_submeshes(self) -> int:
        """M, the number of submesh choices."""
        return self.compute_cost.shape[2]

    @property
    def num_configs(self) -> int:
        """K, the number of autosharding config slots per submesh."""
        return self.compute_cost.shape[3]

    @property
    def submesh_sizes(self) -> NDArray[np.int64]:
        """i64[M] devices in each submesh choice."""
        return self.submesh_shapes[:, 0] * self.submesh_shapes[:, 1]

    def replace(self: _P, **changes: Any) -> _P:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def describe(value: Any) -> str:
    """A short one-line description of a value for an error message: an array
    by its shape, an integer past 10**30 by its magnitude (its digits would
    fill the line, and ``repr`` refuses more than 4,300 of them)."""
    if isinstance(value, np.ndarray) and value.ndim:
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        sign = "-" if value < 0 else ""
        return f"an integer around {sign}1e{math.floor(math.log10(abs(value)))}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def as_count(
    value: Any, name: str, *, minimum: int = 1, maximum: int | None = None
) -> int:
    """An integer in ``[minimum, maximum]``; integral floats are accepted.

    Raises:
        ProblemError: naming ``name``, the range and the value given.
    """
    number = None
    if isinstance(value, (bool, np.bool_)):
        pass
    elif isinstance(value, int):
        number = value
    elif isinstance(value, (float, np.generic, np.ndarray)):
        array = np.asarray(value)
        if array.shape == () and np.issubdtype(array.dtype, np.integer):
            number = int(array)
        elif array.shape == () and np.issubdtype(array.dtype, np.floating):
            as_float = float(array)
            if math.isfinite(as_float) and as_float.is_integer():
                number = int(as_float)
    if number is None:
        raise ProblemError(f"{name} must be an integer, got {describe(value)}")
    if number < minimum:
        raise ProblemError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ProblemError(f"{name} must be <= {maximum}, got {number}")
    return number


def as_number(value: Any, name: str) -> float:
    """A number read from a file (``int`` or ``float``; not ``bool``, not
    text) as a float, NaN and infinity included (the caller refuses them).

    Raises:
        ProblemError: naming ``name`` and the value given (an integer too
            large for a float too).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProblemError(f"{name} must be a number, got {value!r:.60}")
    try:
        return float(value)
    except OverflowError:
        raise ProblemError(f"{name} is too large: {value!r:.60}") from None


def cost_table(compute_cost: Any, *, with_types: bool) -> NDArray[np.float64]:
    """``compute_cost`` as a fresh f64 array, validated.

    Args:
        compute_cost: ``[L, L, M, K]`` (or ``[L, L, M, K, T]`` ``with_types``)
            seconds; ``inf`` = unprofiled. Entries below the diagonal describe
            no stage and are set to ``inf``.

    Raises:
        ProblemError: wrong shape or dtype, an empty axis, NaN, or a negative.
    """
    axes = "(L, L, M, K, T)" if with_types else "(L, L, M, K)"
    cost = np.asarray(compute_cost)
    if cost.ndim != len(axes.split(",")) or cost.shape[0] != cost.shape[1]:
        raise ProblemError(
            f"compute_cost must have shape {axes}, got {tuple(cost.shape)}"
        )
    if not (
        np.issubdtype(cost.dtype, np.floating) or np.issubdtype(cost.dtype, np.integer)
    ):
        raise ProblemError(f"compute_cost must be numeric, got dtype {cost.dtype}")
    if 0 in cost.shape:
        raise ProblemError(
            f"compute_cost must have every size of {axes} >= 1, got {tuple(cost.shape)}"
        )
    cost = cost.astype(np.float64, copy=True)
    num_layers = cost.shape[0]
    cost[np.tril(np.ones((num_layers, num_layers), dtype=bool), k=-1)] = np.inf
    nan = np.isnan(cost)
    if nan.any():
        where = tuple(int(x) for x in np.argwhere(nan)[0])
        raise ProblemError(
            f"compute_cost has {int(nan.sum())} NaN entries (first at {where}); "
            "use inf for unprofiled entries"
        )
    negative = cost < 0
    if negative.any():
        where = tuple(int(x) for x in np.argwhere(negative)[0])
        raise ProblemError(
            f"compute_cost must be >= 0 seconds, got {cost[where]} at {where}"
        )
    return cost


def tail_table(
    stage_tail_cost: Any, cost: NDArray[np.float64]
) -> NDArray[np.float64] | None:
    """``stage_tail_cost`` as a fresh f64 array of ``cost``'s shape, or ``None``.

    The tail of a stage is paid once per iteration after the pipeline (e.g. its
    data-parallel gradient all-reduce and optimizer step); entries where ``cost``
    is ``inf`` describe no usable stage and are stored as 0.

    Raises:
        ProblemError: wrong shape or dtype, NaN, inf or a negative where the
            stage exists.
    """
    if stage_tail_cost is None:
        return None
    tail = np.asarray(stage_tail_cost)
    if tail.shape != cost.shape:
        raise ProblemError(
            f"stage_tail_cost must have the shape of compute_cost {cost.shape}, "
            f"got {tuple(tail.shape)}"
        )
    if tail.dtype.kind not in "iuf":
        raise ProblemError(f"stage_tail_cost must be numeric, got dtype {tail.dtype}")
    tail = np.where(np.isfinite(cost), tail.astype(np.float64), 0.0)
    bad = ~np.isfinite(tail) | (tail < 0)
    if bad.any():
        where = tuple(int(x) for x in np.argwhere(bad)[0])
        raise ProblemError(
            f"stage_tail_cost must be finite and >= 0 seconds where the stage "
            f"exists, got {tail[where]} at {where}"
        )
    return tail


def memory_limits(memory: NDArray[Any]) -> NDArray[np.int64]:
    """``max_n_succ_stages`` as i64 in ``[-1, UNLIMITED_SUCCEEDING_STAGES]``.

    Floats are accepted when they hold integers; ``+inf`` means unlimited and
    ``-inf`` never feasible.

    Raises:
        ProblemError: NaN, fractions, or a non-numeric dtype.
    """
    if np.issubdtype(memory.dtype, np.floating):
        finite = memory[np.isfinite(memory)]
        if np.isnan(memory).any() or (finite != np.round(finite)).any():
            raise ProblemError(
                "max_n_succ_stages must hold integers (or +inf for unlimited)"
            )
        memory = np.where(np.isposinf(memory), UNLIMITED_SUCCEEDING_STAGES, memory)
        memory = np.where(np.isneginf(memory), -1, memory)
    elif not np.issubdtype(memory.dtype, np.integer):
        raise ProblemError(
            f"max_n_succ_stages must be integer, got dtype {memory.dtype}"
        )
    return np.clip(memory, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)


def memory_table(max_n_succ_stages: Any, shape: tuple[int, ...]) -> NDArray[np.int64]:
    """The memory rule of the table ``shape``; ``None`` = never limiting.

    Raises:
        ProblemError: a shape other than ``compute_cost``'s, or bad values.
    """
    if max_n_succ_stages is None:
        return np.full(shape, UNLIMITED_SUCCEEDING_STAGES, dtype=np.int64)
    memory = np.asarray(max_n_succ_stages)
    if memory.shape != shape:
        raise ProblemError(
            "max_n_succ_stages must have the shape of compute_cost "
            f"{tuple(shape)}, got {tuple(memory.shape)}"
        )
    return memory_limits(memory)


def submesh_table(submesh_shapes: Any, num_submeshes: int) -> NDArray[np.int64]:
    """``submesh_shapes`` as i64 ``[M, 2]`` of positive ``(hosts, devices)``.

    Raises:
        ProblemError: not integer, not ``(M, 2)``, or a size below 1.
    """
    shapes = np.asarray(submesh_shapes)
    if shapes.shape != (num_submeshes, 2) or not np.issubdtype(
        shapes.dtype, np.integer
    ):
        raise ProblemError(
            f"submesh_shapes must be integer with shape (M, 2) = "
            f"({num_submeshes}, 2), got {shapes.dtype} {tuple(shapes.shape)}"
        )
    bad = np.argwhere((shapes < 1) | (shapes > MAX_DEVICES))
    if bad.size:
        row = int(bad[0][0])
        raise ProblemError(
            f"submesh_shapes must hold sizes in [1, {MAX_DEVICES}], got "
            f"{tuple(int(x) for x in shapes[row])} for submesh {row}"
        )
    return shapes.astype(np.int64)


def freeze(owner: Any, **arrays: NDArray[Any]) -> None:
    """Set read-only ``arrays`` as fields of the frozen dataclass ``owner``."""
    for name, value in arrays.items():
        value.setflags(write=False)
        object.__setattr__(owner, name, value)


# ------------------------------------------------------------ plan JSON fields
def field_name(where: str, key: str) -> str:
    """How a message names field ``key`` of the JSON object at ``where``:
    ``plan.json: cost`` at the top of a file, ``plan.json: stages[0].latency``
    where ``where`` already names a place in it (``"FILE: PLACE"``)."""
    return f"{where}.{key}" if ": " in where else f"{where}: {key}"


def json_field(data: Any, key: str, where: str) -> Any:
    """``data[key]`` of a JSON object, or a :class:`ProblemError` saying why not."""
    if not isinstance(data, dict):
        raise ProblemError(f"{where} must be a JSON object, got {type(data).__name__}")
    if key not in data:
        raise ProblemError(f"{where} lacks the key {key!r}")
    return data[key]


def json_int(data: Any, key: str, where: str, *, minimum: int = 0) -> int:
    """An integer field ``>= minimum`` (integral floats accepted)."""
    value = json_field(data, key, where)
    return as_count(value, field_name(where, key), minimum=minimum)


def json_float(data: Any, key: str, where: str) -> float:
    """A finite number field (``int`` or ``float``; not ``bool``, not text,
    not NaN or infinity, which Python's JSON reader accepts)."""
    name = field_name(where, key)
    number = as_number(json_field(data, key, where), name)
    if not math.isfinite(number):
        raise ProblemError(f"{name} must be a finite number, got {number}")
    return number


def json_list(data: Any, key: str, where: str, *, length: int | None = None) -> list:
    """A list field, of ``length`` items when given."""
    value = json_field(data, key, where)
    if not isinstance(value, list) or (length is not None and len(value) != length):
        expected = "a list" if length is None else f"a list of {length} items"
        name = field_name(where, key)
        raise ProblemError(f"{name} must be {expected}, got {value!r:.60}")
    return value


def in_range(
    value: float, where: str, key: str, given: Any, *, allow_inf: bool = False
) -> float:
    """``value`` when it lies in ``CLUSTER_RANGES[key]`` (``inf`` too when
    ``allow_inf``).

    Raises:
        ProblemError: ``"<where> must be in [low, high] (unit), got <given>"``.
    """
    low, high, unit = CLUSTER_RANGES[key]
    if low <= value <= high or (allow_inf and value == math.inf):
        return value
    inf = ' or "inf"' if allow_inf else ""
    bounds = ", ".join(
        f"{x:g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
        for x in (low, high)
    )
    raise ProblemError(
        f"{where} must be in [{bounds}]{inf} ({unit}), got {describe(given)}"
    )


def positive_int(value: Any, name: str, most: int, unit: str = "") -> int:
    """``value`` as an int in ``[1, most]``; an integral float is accepted (JSON
    writers may give ``8.0``). Compared before any arithmetic, so that a huge
    number is refused here instead of overflowing later."""
    integral = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not integral or value < 1:
        raise ProblemError(f"{name} must be a positive integer, got {describe(value)}")
    if value > most:
        raise ProblemError(
            f"{name} must be in [1, {most}]{unit}, got {describe(value)}"
        )
    return int(value)
