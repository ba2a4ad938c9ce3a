"""The GPU sheet: published specifications per GPU type, and a user's additions.

The bundled sheet is ``pipedejavu/data/gpus.json`` (sources per entry; see
``pipedejavu/data/GPUS.md``). A user file has the same schema::

    {"gpus": {"NAME": {"memory_bytes": 8.6e10,
                       "memory_bandwidth_bytes_per_s": 2.0e12,
                       "peak_flops": {"fp32": 1.95e13, "bf16": 3.12e14},
                       "gpus_per_node": 8,
                       "intra_node_bytes_per_s": 3.0e11,
                       "inter_node_bytes_per_s": 2.0e11,
                       "multiprocessors": 108, "clock_hz": 1.41e9,
                       "sources": ["..."], "note": "..."}},
     "aliases": {"SHORT": "NAME"}}

``peak_flops`` names precisions of
:data:`~pipedejavu.core.gpu_sheet.PEAK_PRECISIONS` (``fp32``, ``tf32``,
``fp16``, ``bf16``, ``fp8``, ``fp4``). ``multiprocessors`` and ``clock_hz``
(the clock the tensor peaks are quoted at) are optional, both or neither:
they set the exponential units' rate, which prices a fused attention kernel's
softmax.

An entry for a new name needs every number; an entry for a name already on the
sheet overrides only the fields it gives (``peak_flops`` precision by precision).
Files are read with a size limit and validated (numbers in the plausible
ranges of :data:`FIELD_RANGES` and :data:`PEAK_FLOPS_RANGE`, known precisions);
every problem is one :class:`ProblemError` line naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json
from pipedejavu.core.gpu_sheet import PEAK_PRECISIONS, GpuSheetEntry
from pipedejavu.core.validation import describe

__all__ = [
    "FIELD_RANGES",
    "MAX_GPU_SHEET_BYTES",
    "PEAK_FLOPS_RANGE",
    "GpuSheet",
    "bundled_gpu_sheet_path",
    "load_gpu_sheet",
]

#: A GPU name with its memory appended: ``H100-80``, ``A100-40GB``.
_MEMORY_SUFFIX = re.compile(r"(?P<base>.+)-(?P<size>[1-9][0-9]{0,4})(?:GB)?", re.I)
#: The bundled sheet is about 20 kB; refuse files past 1 MiB.
MAX_GPU_SHEET_BYTES = 2**20
_NUMBER_FIELDS = (
    "memory_bytes",
    "memory_bandwidth_bytes_per_s",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
)
_ENTRY_FIELDS = (
    *_NUMBER_FIELDS,
    "peak_flops",
    "gpus_per_node",
    "sources",
    "note",
    "multiprocessors",
    "clock_hz",
)
_TOP_KEYS = ("gpus", "aliases", "description")
#: ``(lowest, highest, unit)`` of a sheet's numbers: far outside any GPU built
#: (the bundled entries lie 30x or more inside every bound: memory 11.8 GB to
#: 309 GB, memory bandwidth 0.3 to 8 TB/s, links 3.1 GB/s to 7.2 TB/s,
#: clocks 1.4 to 2.5 GHz), bounds on a file's values, not claims. Outside them
#: the cost model's arithmetic underflows to zero or overflows to infinity
#: (``5e-324`` bytes/s, ``1e308`` FLOP/s).
FIELD_RANGES: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (1e8, 1e13, "bytes"),
    "memory_bandwidth_bytes_per_s": (1e6, 1e15, "bytes/s"),
    "intra_node_bytes_per_s": (1e6, 1e15, "bytes/s"),
    "inter_node_bytes_per_s": (1e6, 1e15, "bytes/s"),
    "clock_hz": (1e7, 1e11, "Hz"),
}
#: ``(lowest, highest)`` dense peak FLOP/s of every precision (the bundled
#: peaks: 13.4 TFLOP/s to 15 PFLOP/s).
PEAK_FLOPS_RANGE = (1e9, 1e18)


class GpuSheet(Mapping[str, GpuSheetEntry]):
    """GPU types by name; ``sheet[alias]`` finds the entry an alias names.

    Iteration, ``len`` and ``keys()`` see the canonical names only.
    """

    def __init__(
        self, entries: Mapping[str, GpuSheetEntry], aliases: Mapping[str, str]
    ):
        self._entries = dict(entries)
        self.aliases: dict[str, str] = dict(aliases)

    def resolve(self, name: str) -> str:
        """The canonical name of ``name``: itself, the entry its alias names, a
        name of another case where unambiguous (``h100``, ``a100-80``), or
        either of those with the GPU's memory in GB appended (``H100-80``,
        ``H100-80GB``, ``V100-32GB``: the size must be the entry's).

        Raises:
            KeyError: none of those.
        """
        found = self._lookup(name)
        if found is None and isinstance(name, str):
            found = self._with_memory(name)
        if found is None:
            raise KeyError(
                f"GPU {name!r} is not on the GPU sheet (known: "
                f"{', '.join(self._entries)}; aliases: {', '.join(self.aliases)}; "
                "either with its memory in GB appended, e.g. H100-80GB)"
            )
        return found

    def resolve_listed(self, name: object) -> str:
        """:meth:`resolve` of a GPU type a file lists (any JSON key or value).

        Raises:
            ValueError: ``GPU type '<name>' is not on the GPU sheet`` (short,
                for the file's reader to prefix with the file's name).
        """
        try:
            return self.resolve(str(name))
        except KeyError:
            raise ValueError(
                f"GPU type {str(name)[:40]!r} is not on the GPU sheet"
            ) from None

    def _lookup(self, name: str) -> str | None:
        if name in self._entries:
            return name
        if name in self.aliases:
            return self.aliases[name]
        return self._folded().get(name.casefold()) if isinstance(name, str) else None

    def _with_memory(self, name: str) -> str | None:
        """``NAME-<size>`` or ``NAME-<size>GB`` where ``NAME`` (or the whole
        name less ``GB``) is on the sheet with ``size`` GB of memory."""
        match = _MEMORY_SUFFIX.fullmatch(name)
        if match is None:
            return None
        size = int(match["size"])
        for candidate in (f"{match['base']}-{match['size']}", match["base"]):
            found = self._lookup(candidate)
            if found is not None and self._entries[found].has_memory_gb(size):
                return found
        return None

    def _folded(self) -> dict[str, str]:
        """Canonical names by case-folded name or alias, where unambiguous."""
        by: dict[str, set[str]] = {}
        for key in (*self._entries, *self.aliases):
            target = self.aliases.get(key, key)
            by.setdefault(key.casefold(), set()).add(target)
        return {k: v.pop() for k, v in by.items() if len(v) == 1}

    def __getitem__(self, name: str) -> GpuSheetEntry:
        return self._entries[self.resolve(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.resolve(name)
        except KeyError:
            return False
        return True


def bundled_gpu_sheet_path() -> Path:
    """The sheet shipped inside the package."""
    return Path(str(importlib.resources.files("pipedejavu") / "data" / "gpus.json"))


def _entry_fields(raw: Any, source: str, name: str) -> dict[str, Any]:
    """The fields an entry of a file gives, checked for kind (not for range)."""
    where = f"{source}: GPU {name}"
    if not isinstance(raw, dict):
        raise ProblemError(f"{where} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_ENTRY_FIELDS))
    if unknown:
        raise ProblemError(
            f"{where}: unknown field {unknown[0]!r} (known: {', '.join(_ENTRY_FIELDS)})"
        )
    fields = dict(raw)
    if "peak_flops" in fields:
        peaks = fields["peak_flops"]
        if not isinstance(peaks, dict) or not peaks:
            raise ProblemError(
                f"{where}: peak_flops must map precisions "
                f"({', '.join(PEAK_PRECISIONS)}) to FLOP/s"
            )
        for precision in peaks:
            if precision not in PEAK_PRECISIONS:
                raise ProblemError(
                    f"{where}: unknown precision {precision!r} in peak_flops (known: "
                    f"{', '.join(PEAK_PRECISIONS)})"
                )
    if "sources" in fields:
        sources = fields["sources"]
        if not isinstance(sources, list) or not all(
            isinstance(s, str) for s in sources
        ):
            raise ProblemError(f"{where}: sources must be a list of strings")
    return fields


def _build(name: str, fields: Mapping[str, Any], source: str) -> GpuSheetEntry:
    where = f"{source}: GPU {name}"
    missing = [
        key
        for key in (*_NUMBER_FIELDS, "peak_flops", "gpus_per_node")
        if key not in fields
    ]
    if missing:
        raise ProblemError(f"{where}: missing field {missing[0]!r}")
    peaks = fields["peak_flops"]
    try:
        return GpuSheetEntry(
            name=name,
            memory_bytes=fields["memory_bytes"],
            memory_bandwidth_bytes_per_s=fields["memory_bandwidth_bytes_per_s"],
            peak_flops=tuple(
                (precision, peaks[precision])
                for precision in PEAK_PRECISIONS
                if precision in peaks
            ),
            gpus_per_node=fields["gpus_per_node"],
            intra_node_bytes_per_s=fields["intra_node_bytes_per_s"],
            inter_node_bytes_per_s=fields["inter_node_bytes_per_s"],
            sources=tuple(fields.get("sources", ())),
            note=fields.get("note", ""),
            multiprocessors=fields.get("multiprocessors"),
            clock_hz=fields.get("clock_hz"),
        )
    except ValueError as error:
        raise ProblemError(f"{source}: {error}") from None


def _check_ranges(entry: GpuSheetEntry, source: str) -> GpuSheetEntry:
    """``entry``, its numbers (already positive and finite) checked against
    :data:`FIELD_RANGES` and :data:`PEAK_FLOPS_RANGE`."""
    checks = [
        (field, getattr(entry, field), low, high, unit)
        for field, (low, high, unit) in FIELD_RANGES.items()
    ]
    low, high = PEAK_FLOPS_RANGE
    checks += [
        (f"peak_flops {precision}", value, low, high, "FLOP/s")
        for precision, value in entry.peak_flops
    ]
    for field, value, low, high, unit in checks:
        # ints compare exactly (no float conversion to overflow); None: absent
        if value is not None and not low <= value <= high:
            raise ProblemError(
                f"{source}: GPU {entry.name}: {field} must be in [{low:g}, "
                f"{high:g}] {unit}, got {describe(value)}"
            )
    return entry


def _entry_as_fields(entry: GpuSheetEntry) -> dict[str, Any]:
    fields = dataclasses.asdict(entry)
    fields.pop("name")
    fields["peak_flops"] = dict(entry.peak_flops)
    fields["sources"] = list(entry.sources)
    return fields


def _read_sheet(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    source = os.fspath(path)
    data = read_json(path, MAX_GPU_SHEET_BYTES, "GPU sheet")
    if not isinstance(data, dict):
        raise ProblemError(
            f"{source}: a GPU sheet must be a JSON object, got {type(data).__name__}"
        )
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ProblemError(
            f"{source}: unknown key {unknown[0]!r} (known: {', '.join(_TOP_KEYS)})"
        )
    gpus = data.get("gpus", {})
    aliases = data.get("aliases", {})
    if not isinstance(gpus, dict):
        raise ProblemError(f"{source}: 'gpus' must map GPU names to entries")
    if not isinstance(aliases, dict) or not all(
        isinstance(target, str) for target in aliases.values()
    ):
        raise ProblemError(f"{source}: 'aliases' must map names to GPU names")
    for name in gpus:
        if not name.strip():
            raise ProblemError(f"{source}: a GPU name is empty")
    return gpus, aliases


def load_gpu_sheet(user_file: str | os.PathLike | None = None) -> GpuSheet:
    """The bundled GPU sheet, merged with a user's file.

    Args:
        user_file: a JSON file of the same schema: new GPU types (every field)
            and overrides of bundled ones (only the fields given), and aliases.

    Returns:
        The sheet: ``sheet["A100-80"]``, ``sheet["H100"]`` (an alias).

    Raises:
        ProblemError: an unreadable, oversized or malformed file, a missing or
            unknown field, an unknown precision, a number outside its range
            (:data:`FIELD_RANGES`, :data:`PEAK_FLOPS_RANGE`), or an alias to a
            GPU not on the sheet; one line naming the file and the field.
    """
    sources = [bundled_gpu_sheet_path()]
    if user_file is not None:
        sources.append(Path(os.fspath(user_file)))
    entries: dict[str, GpuSheetEntry] = {}
    aliases: dict[str, str] = {}
    for path in sources:
        source = os.fspath(path)
        gpus, file_aliases = _read_sheet(path)
        for name, raw in gpus.items():
            fields = _entry_fields(raw, source, name)
            if name in entries:
                merged = _entry_as_fields(entries[name])
                merged["peak_flops"].update(fields.pop("peak_flops", {}))
                merged.update(fields)
                fields = merged
            entries[name] = _check_ranges(_build(name, fields, source), source)
            aliases.pop(name, None)
        for alias, target in file_aliases.items():
            if target not in entries:
                raise ProblemError(
                    f"{source}: alias {alias!r} names {target!r}, which is not on the "
                    f"GPU sheet"
                )
            if alias in entries:
                raise ProblemError(f"{source}: alias {alias!r} is already a GPU name")
            aliases[alias] = target
    return GpuSheet(entries, aliases)
