"""The date and machine a benchmark stamps its results (and its printout)
with, and the writing of its results file.

Shared by the scripts in this folder (``python benchmarks/X.py`` puts the
folder on ``sys.path``, so they ``import stamp``). The formats are the ones
the results files already hold, which ``tables.py`` quotes:

* ``now()``: ``2026-12-06T10:20:30+00:00`` (UTC, to the second);
* ``host()``: ``node (x86_64, 4 cores)``;
* ``cpu(python=True)``: ``x86_64, 4 cores, python 3.12.3``;
* ``header()``: ``# 2026-12-06 10:20 UTC, x86_64, 4 cores``, a printout's
  first line, which each script goes on with its own fields;
* ``opening(name, started)`` and ``opening_cpu(name)``: the fields a results
  file opens with (the benchmark's name, date, machine, load average), which
  each script goes on with its own;
* ``out_option(__doc__, default)``: the ``--out`` path of a script whose one
  option it is;
* ``write_json``, ``save`` (and say so) and ``write_opened`` (after
  ``opening``'s fields): the results file, JSON indented by one space;
* ``abs_summary(errors)``: the median and max of ``|errors|``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: The checkout this folder is in, and the folder of the results files.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def now() -> str:
    """The time in UTC, ISO 8601 to the second: a results file's ``date``."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def minute() -> str:
    """The time in UTC to the minute, ``2026-12-06 10:20 UTC``."""
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def host(unnamed: str = "", *, cores: bool = True) -> str:
    """``node (machine, N cores)``; ``unnamed`` stands for a host without a
    name, ``cores=False`` leaves the core count out."""
    node = platform.node() or unnamed
    if not cores:
        return f"{node} ({platform.machine()})"
    return f"{node} ({platform.machine()}, {os.cpu_count()} cores)"


def stamp(unnamed: str = "", *, cores: bool = True) -> dict[str, str]:
    """``{"date": now(), "machine": host(...)}``, the fields a results file
    opens (or closes) with."""
    return {"date": now(), "machine": host(unnamed, cores=cores)}


def cpu(*, python: bool = False) -> str:
    """``machine, N cores`` and, with ``python``, ``, python X.Y.Z``."""
    text = f"{platform.machine()}, {os.cpu_count()} cores"
    if python:
        text += f", python {platform.python_version()}"
    return text


def header(*, python: bool = False) -> str:
    """A printout's first line: ``# <minute()>, <cpu(python=python)>``."""
    return f"# {minute()}, {cpu(python=python)}"


def opening(benchmark: str, started: float) -> dict[str, Any]:
    """``benchmark``, :func:`stamp`'s fields, the load average and
    ``wall_s``, the seconds since ``started`` (a ``time.perf_counter()``)."""
    return {
        "benchmark": benchmark,
        **stamp(),
        "loadavg": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
    }


def opening_cpu(benchmark: str) -> dict[str, Any]:
    """``benchmark``, :func:`now`, the machine as ``cpu(python=True)`` and
    the load average (a list)."""
    return {
        "benchmark": benchmark,
        "date": now(),
        "machine": cpu(python=True),
        "loadavg": list(os.getloadavg()),
    }


def write_json(path: str, data: Any, *, end: str = "") -> None:
    """Write ``data`` to ``path`` as JSON indented by one space (then ``end``),
    making its folder first if it is missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.write(end)


def save(path: str, data: Any, *, end: str = "", note: str = "") -> None:
    """:func:`write_json`, then print ``wrote <path><note>``."""
    write_json(path, data, end=end)
    print(f"wrote {path}{note}")


def write_opened(path: str, benchmark: str, started: float, fields: dict) -> None:
    """Write :func:`opening`'s fields (``wall_s`` up to now), then ``fields``."""
    write_json(path, {**opening(benchmark, started), **fields})


def out_option(doc: str, default: str, argv: list[str] | None = None) -> str:
    """The ``--out`` path (``default`` unless given) of a script whose one
    option it is; ``--help`` describes the script by ``doc``'s first line."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=default)
    return parser.parse_args(argv).out


def abs_summary(errors: Any) -> dict[str, float]:
    """``{"median": ..., "max": ...}`` of ``|errors|`` (as floats)."""
    import numpy as np

    magnitude = np.abs(np.asarray(errors, dtype=float))
    return {"median": float(np.median(magnitude)), "max": float(magnitude.max())}
