"""A capacity sweep's results file: one CSV row per candidate pool, written
as each finishes, read back to resume an interrupted sweep, and a Parquet
copy at the end.

Each row holds the question's key (:func:`~pipedejavu.planning.capacity.
question_key`: a hash of what the
planning depends on: model, tokens, global batch, sequence length,
precision, GPU sheet, profiles; not the prices, deadline or budget, which
only choose among the plans), the pool, and its outcome (the GPUs the plan
rents, seconds per iteration, time to train, cost at the prices of the run
that wrote it, whether proven, the plan's shape, the reason there is none,
the search's seconds, the plan as JSON). A sweep given the same file skips
the pools its question already has rows for and prices them again with the
current prices. The file is untrusted when read back: bounded in size and
rows, every number checked, one line naming it for anything wrong.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipedejavu.core.problem import ProblemError

__all__ = [
    "COLUMNS",
    "append_row",
    "hashed_key",
    "number",
    "parse_pool",
    "plan_cell",
    "pool_key",
    "read_rows",
    "read_table",
    "write_parquet",
]

#: The results file's columns, in order.
COLUMNS = (
    "question",
    "model",
    "pool",
    "used",
    "iteration_s",
    "time_s",
    "cost",
    "currency",
    "proven",
    "shape",
    "reason",
    "search_s",
    "plan",
)
_MAX_BYTES = 1 << 30
_MAX_ROWS = 100_000
_MAX_FIELD = 1 << 26


def pool_key(pool: Mapping[str, int]) -> str:
    """``H100-SXM:8`` (types joined by commas, in the pool's order)."""
    return ",".join(f"{gpu}:{n}" for gpu, n in pool.items())


def parse_pool(text: str, where: str) -> dict[str, int]:
    """The pool :func:`pool_key` wrote (``where`` names it in errors)."""
    out = {}
    for item in text.split(","):
        gpu, _, count = item.rpartition(":")
        if not gpu or not count.isdigit() or not 1 <= int(count) <= 1 << 20:
            raise ProblemError(f"{where}: {text[:60]!r} is not a pool")
        out[gpu] = int(count)
    return out


def append_row(
    path: str | os.PathLike,
    row: Mapping[str, Any],
    columns: Sequence[str] = COLUMNS,
) -> None:
    """Add ``row`` (every one of ``columns``, default :data:`COLUMNS`) to
    ``path``, with the header if the file is new, flushed to disk (a sweep
    killed after it keeps it)."""
    new = not Path(path).exists() or Path(path).stat().st_size == 0
    with open(path, "a", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, columns)
        if new:
            writer.writeheader()
        writer.writerow(dict(row))
        handle.flush()
        os.fsync(handle.fileno())


def number(text: str, where: str) -> float:
    """A number >= 0 of the file (``inf`` where there is no plan)."""
    try:
        value = float(text)
    except ValueError:
        raise ProblemError(f"{where}: {text[:40]!r} is not a number") from None
    if math.isnan(value) or value < 0:
        raise ProblemError(f"{where}: {text[:40]!r} is not a number >= 0")
    return value


def plan_cell(row: Mapping[str, str], where: str) -> Any:
    """A row's ``plan`` read back from its JSON (``None``: the cell is
    empty, no plan).

    Raises:
        ProblemError: the cell is not JSON (``where`` names it).
    """
    try:
        return json.loads(row["plan"]) if row["plan"] else None
    except ValueError:
        raise ProblemError(f"{where}: its plan is not JSON") from None


def hashed_key(fields: Sequence[Any]) -> str:
    """A row's key: ``fields`` (what its plans depend on) as JSON, hashed
    (the first 16 hex digits of its SHA-256)."""
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def read_rows(path: str | os.PathLike, question: str) -> list[dict[str, str]]:
    """The rows of ``path`` for the question key ``question`` (``[]``: no
    file yet), their columns checked as text.

    Raises:
        ProblemError: one line naming the file: too large, not this format,
            too many rows.
    """
    rows = read_table(path, COLUMNS, "a capacity results file")
    return [row for row in rows if row["question"] == question]


def read_table(
    path: str | os.PathLike, columns: Sequence[str], what: str
) -> list[dict[str, str]]:
    """Every row of the CSV ``path`` written with ``columns`` (``[]``: no file
    yet), each with its ``line``, checked as text: at most 1 GiB and
    100,000 rows; ``what`` names the format in errors.

    Raises:
        ProblemError: one line naming the file: too large, not this format,
            too many rows.
    """
    file = Path(path)
    name = os.fspath(path)
    if not file.exists():
        return []
    if file.stat().st_size > _MAX_BYTES:
        raise ProblemError(f"{name}: larger than {_MAX_BYTES >> 20} MiB")
    csv.field_size_limit(_MAX_FIELD)
    rows = []
    try:
        with file.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if tuple(reader.fieldnames or ()) != tuple(columns):
                raise ProblemError(f"{name}: not {what} (columns {', '.join(columns)})")
            for line, row in enumerate(reader, 2):
                if line > _MAX_ROWS:
                    raise ProblemError(f"{name}: more than {_MAX_ROWS:,} rows")
                if None in row or None in row.values():
                    raise ProblemError(
                        f"{name}, line {line}: not {len(columns)} columns"
                    )
                rows.append({**row, "line": str(line)})
    except (csv.Error, UnicodeDecodeError) as error:
        raise ProblemError(f"{name}: unreadable ({str(error)[:80]})") from None
    return rows


def write_parquet(
    path: str | os.PathLike,
    columns: Sequence[str] = COLUMNS,
    floats: Sequence[str] = ("iteration_s", "time_s", "cost", "search_s"),
    integers: Sequence[str] = (),
) -> Path | None:
    """The CSV ``path`` (written with ``columns``) copied to Parquet beside it
    (``.parquet``): ``floats`` and ``integers`` as numbers, ``proven`` as a
    boolean, the rest as text; ``None`` where pyarrow is not installed."""
    try:
        import pyarrow.csv  # (optional, heavy: only for the Parquet copy)
        import pyarrow.parquet
    except ImportError:
        return None
    types = {c: pyarrow.string() for c in columns}
    types.update({c: pyarrow.float64() for c in floats})
    types.update({c: pyarrow.int64() for c in integers})
    types["proven"] = pyarrow.bool_()
    options = pyarrow.csv.ConvertOptions(
        column_types=types, strings_can_be_null=False, true_values=["1"],
        false_values=["0"],
    )  # fmt: skip
    read = pyarrow.csv.ReadOptions(block_size=_MAX_FIELD)
    table = pyarrow.csv.read_csv(
        os.fspath(path), read_options=read, convert_options=options
    )
    out = Path(path).with_suffix(".parquet")
    pyarrow.parquet.write_table(table, out)
    return out
