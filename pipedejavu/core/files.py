"""Bounded reading of untrusted files: every failure is one :class:`ProblemError`
line that names the file.

Every reader of the package (cluster files, plans, Alpa's pickles and ``.npy``
profiles, Sailor's JSON, step-time CSVs) reads at most ``limit`` bytes, so a
huge or endless file costs bounded memory, refuses devices (``/dev/zero``, a
terminal's ``/dev/stdin``, which would wait for input) and, where the caller
bounds the wait (``fifo_wait_s``: the model file), a FIFO nothing writes to,
drops a leading UTF-8 byte-order mark, and decodes and
parses with the failures of :mod:`json` (invalid text, nesting too deep,
numbers too long) turned into that one line. What the package writes as JSON
goes through :func:`json_text`, strict JSON that every parser reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import stat
from collections.abc import Mapping
from typing import Any

from pipedejavu.core.errors import ProblemError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: no TOML parser in the library
    tomllib = None

__all__ = [
    "parse_toml",
    "json_fields",
    "json_text",
    "parse_json",
    "read_bytes",
    "read_json",
    "read_text",
]


def read_bytes(
    path: str | os.PathLike,
    limit: int,
    what: str = "file",
    *,
    fifo_wait_s: float | None = None,
) -> bytes:
    """The bytes of ``path``, refused past ``limit`` bytes without reading more.

    Args:
        path: the file.
        limit: the most bytes accepted.
        what: how the message names the file (e.g. ``"cluster file"``).
        fifo_wait_s: for a FIFO (a named pipe), the longest wait for its first
            byte or its end; ``None``: as long as it takes (a FIFO nothing
            writes to then waits forever, as ``cat`` does). Process
            substitution (``<(cat config.json)``) writes at once.

    Raises:
        ProblemError: unreadable, a device (a terminal would wait for input,
            ``/dev/zero`` never ends), larger than ``limit``, or a FIFO silent
            for ``fifo_wait_s``.
    """
    try:
        with _open(path, fifo_wait_s is not None) as handle:
            status = os.fstat(handle.fileno())
            mode = status.st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise ProblemError(f"{what} {os.fspath(path)} is a device, not a file")
            if fifo_wait_s is not None and stat.S_ISFIFO(mode):
                _wait_for_writer(handle, fifo_wait_s, f"{what} {os.fspath(path)}")
            if stat.S_ISREG(mode) and status.st_size > limit:
                raise ProblemError(
                    f"{what} {os.fspath(path)} is larger than {limit} bytes"
                )
            # a regular file reads what it holds, not a buffer of the limit
            # (one byte more shows it grew: the rest then as from a pipe); a
            # pipe reads in pieces up to the limit
            data = handle.read(status.st_size + 1) if stat.S_ISREG(mode) else b""
            if not stat.S_ISREG(mode) or len(data) > status.st_size:
                data += _read_upto(handle, limit - len(data))
    except OSError as error:
        raise ProblemError(
            f"cannot read {what} {os.fspath(path)}: {error.strerror or error}"
        ) from None
    if len(data) > limit:
        raise ProblemError(f"{what} {os.fspath(path)} is larger than {limit} bytes")
    return data


def _open(path: str | os.PathLike, nonblocking: bool) -> Any:
    """``path`` opened for reading; ``nonblocking``: without waiting for a
    FIFO's writer (blocking again once open, for the reads)."""
    flag = getattr(os, "O_NONBLOCK", 0)  # absent on Windows, which has no FIFOs
    if not nonblocking or not flag:
        return open(path, "rb")
    return os.fdopen(os.open(path, os.O_RDONLY | flag), "rb")


def _wait_for_writer(handle: Any, wait_s: float, name: str) -> None:
    """Wait at most ``wait_s`` for a FIFO's first byte or end, then block as
    usual: a FIFO nothing writes to is refused instead of waited on forever."""
    if hasattr(select, "poll"):
        poll = select.poll()
        poll.register(handle.fileno(), select.POLLIN | select.POLLHUP)
        ready = poll.poll(max(wait_s, 0.0) * 1000)
        if not ready:
            raise ProblemError(
                f"{name} is a FIFO nothing wrote to in {wait_s:g} s; give a file "
                "(or a command's output, as <(cat FILE) does)"
            )
    os.set_blocking(handle.fileno(), True)


def _read_upto(handle: Any, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a stream, read in pieces of 1 MiB."""
    pieces, total = [], 0
    while total <= limit:
        piece = handle.read(min(2**20, limit + 1 - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)


def read_text(
    path: str | os.PathLike,
    limit: int,
    what: str = "file",
    *,
    fifo_wait_s: float | None = None,
) -> str:
    """:func:`read_bytes` decoded as UTF-8, without a leading byte-order mark
    (Windows editors write one; JSON's RFC 8259 lets a reader ignore it).

    Raises:
        ProblemError: as :func:`read_bytes`, or not UTF-8 text.
    """
    raw = read_bytes(path, limit, what, fifo_wait_s=fifo_wait_s)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ProblemError(
            f"{what} {os.fspath(path)} is not UTF-8 text (a binary file?)"
        ) from None


def parse_json(text: str, source: str) -> Any:
    """``json.loads`` whose every failure is a one-line :class:`ProblemError`.

    Raises:
        ProblemError: invalid JSON, nesting too deep, or a number too long.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ProblemError(f"{source}: invalid JSON: {error}") from None
    except RecursionError:
        raise ProblemError(f"{source}: JSON nested too deeply") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise ProblemError(f"{source}: invalid JSON: {error}") from None


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML ``text`` (from ``source``, named in the messages) as a dict.

    Raises:
        ProblemError: one line naming ``source``: no TOML parser (Python
            3.10), invalid TOML, nesting too deep, an integer longer than
            Python converts (``ValueError`` from the parser).
    """
    if tomllib is None:
        raise ProblemError(
            f"{source}: reading TOML needs Python 3.11 or later (the standard "
            "library's tomllib)"
        )
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ProblemError(f"{source}: TOML nested too deeply") from None
    except ValueError as error:  # TOMLDecodeError, or a too long integer
        reason = " ".join(str(error).split())[:200]
        raise ProblemError(f"{source}: not a valid TOML file: {reason}") from None


def read_json(
    path: str | os.PathLike,
    limit: int,
    what: str = "file",
    *,
    fifo_wait_s: float | None = None,
) -> Any:
    """The parsed JSON of ``path`` (:func:`read_text` then :func:`parse_json`).

    Raises:
        ProblemError: one line naming the file.
    """
    text = read_text(path, limit, what, fifo_wait_s=fifo_wait_s)
    return parse_json(text, os.fspath(path))


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    return value


def json_text(value: Any, **options: Any) -> str:
    """``json.dumps`` of ``value`` as strict JSON: a float that is not finite
    (NaN, infinity: a bound never reached, a time not measured) is written
    ``null``, since JSON has no such numbers and strict parsers (JavaScript's,
    ``jq``) refuse Python's ``NaN`` and ``Infinity``. ``options`` go to
    :func:`json.dumps` (``indent``, ``sort_keys``).

    Example:
        >>> json_text({"best_s": float("inf"), "gap": [0.5, float("nan")]})
        '{"best_s": null, "gap": [0.5, null]}'
    """
    return json.dumps(_strict(value), allow_nan=False, **options)


def json_fields(cls: type, data: Any, what: str) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` a JSON object gives (absent ones
    take their defaults), for ``cls(**fields)`` to check their values.

    Raises:
        ValueError: not an object, or an unknown key (one line, ``what``
            first; at most 5 keys named, 40 characters each).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(str(key)[:40] for key in set(data) - known)[:5]
    if unknown:
        raise ValueError(
            f"{what}: unknown keys {unknown}, expected some of {sorted(known)}"
        )
    return dict(data)
