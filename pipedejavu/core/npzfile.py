"""Reading and writing problem archives (``.npz``) that may be untrusted.

``numpy.load`` trusts an archive's headers: a truncated or corrupted file raises
``zipfile.BadZipFile`` (or ``zlib.error``, ``EOFError``, ...), and a header that
declares shape ``(100000, 100000, 5, 2)`` makes it allocate 745 GiB before it
reads a byte. :func:`read_npz` reads the zip directory and every array header
first and refuses, with a :class:`~pipedejavu.core.errors.ProblemError` naming the
file, anything that is not plain numeric (or text) data whose declared size

* matches the bytes its zip entry holds (uncompressed size minus header),
* could come out of that entry (deflate expands at most about 1032:1; a stored
  entry not at all), and
* keeps the arrays read together under ``max_bytes`` (default
  :data:`MAX_NPZ_BYTES`), every element counted as at least 8 bytes: a problem
  widens its numbers to float64 or int64, so a bool or uint8 table must not
  slip 8 times its size past the limit.

Only then does it read the data, so memory stays bounded by the smaller of
``max_bytes`` and what the file can actually hold. Object arrays (pickles) are
refused, so nothing in the file is ever executed.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.lib.format as npy_format

from pipedejavu.core.errors import ProblemError

__all__ = ["MAX_NPZ_BYTES", "npy_header", "npz_output_path", "read_npz", "write_npz"]

#: Declared bytes of the arrays one :func:`read_npz` call may read (256 MiB),
#: every element counted as at least 8 bytes. A problem's two stage tables
#: ``[L, L, M, K]`` then hold up to 2**24 entries (e.g. L = 512, M = 16, K = 4;
#: Alpa's real profiles fill a few thousand). The checks' and solvers' copies
#: scale with the tables: ``solve`` on the largest single table (L = 5,792)
#: peaks at 3.2 GB, against 5.7 GB for an L = 8,000 file under the 4 GiB limit
#: this replaced.
MAX_NPZ_BYTES = 2**28

# Width of the numbers a problem stores (float64, int64): the least an element
# is counted against the limit.
_NUMBER_BYTES = 8

# deflate's largest expansion is 1032:1 (RFC 1951 blocks); a margin for headers.
_DEFLATE_RATIO = 1100
# numpy writes plain numbers and text; bool, signed/unsigned ints, floats, str.
_ALLOWED_KINDS = frozenset("biufU")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def npy_header(handle: IO[bytes]) -> tuple[tuple[int, int], tuple | None]:
    """The ``.npy`` format version at ``handle`` and the header after it,
    ``(shape, fortran_order, dtype)``, read by numpy's parsers (which never
    unpickle); ``None`` for a version other than 1.0 or 2.0, which the caller
    refuses."""
    version = npy_format.read_magic(handle)
    if version == (1, 0):
        return version, npy_format.read_array_header_1_0(handle)
    if version == (2, 0):
        return version, npy_format.read_array_header_2_0(handle)
    return version, None


def _read_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str, what: str, budget: int
) -> np.ndarray:
    key = info.filename[: -len(".npy")]
    if info.compress_type == zipfile.ZIP_STORED:
        limit = info.compress_size
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        limit = _DEFLATE_RATIO * info.compress_size + 1024
    else:
        raise ProblemError(
            f"{source}: array {key!r} uses zip compression method "
            f"{info.compress_type}; numpy writes only stored or deflated entries"
        )
    if info.file_size > limit:
        raise ProblemError(
            f"{source}: array {key!r} declares {info.file_size} bytes from "
            f"{info.compress_size} stored bytes (corrupt or a zip bomb)"
        )
    with archive.open(info) as handle:
        version, header = npy_header(handle)
        if header is None:
            raise ProblemError(
                f"{source}: array {key!r} uses .npy format version "
                f"{version[0]}.{version[1]}, expected 1.0 or 2.0"
            )
        shape, fortran, dtype = header
        if dtype.hasobject or dtype.kind not in _ALLOWED_KINDS or dtype.fields:
            raise ProblemError(
                f"{source}: array {key!r} has dtype {dtype}; {what} holds only "
                "numbers and text (object arrays would need pickle)"
            )
        if not all(type(n) is int and n >= 0 for n in shape):
            raise ProblemError(f"{source}: array {key!r} has a bad shape {shape!r}")
        count = math.prod(shape)
        num_bytes = count * dtype.itemsize
        header = handle.tell()
        # A declared size the entry does not hold is corruption, whatever the size.
        if num_bytes != info.file_size - header:
            raise ProblemError(
                f"{source}: array {key!r} declares shape {tuple(shape)} of {dtype} "
                f"({num_bytes} bytes, {_gib(num_bytes)}) but its entry holds "
                f"{info.file_size - header}"
            )
        counted = count * max(dtype.itemsize, _NUMBER_BYTES)
        if counted > budget:
            widened = (
                "" if counted == num_bytes else f" as {_NUMBER_BYTES}-byte numbers"
            )
            raise ProblemError(
                f"{source}: array {key!r} declares shape {tuple(shape)} of {dtype} "
                f"({_gib(counted)}{widened}), over the {_gib(budget)} left of the "
                "reading limit"
            )
        data = handle.read(num_bytes)
        if len(data) != num_bytes or handle.read(1):  # the extra read checks CRC
            raise ProblemError(f"{source}: array {key!r} is truncated")
    flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape))
    if fortran:
        return flat.reshape(tuple(reversed(shape))).transpose()
    return flat.reshape(shape)


def read_npz(
    path: str | os.PathLike[str],
    *,
    required: Iterable[str],
    optional: Iterable[str] = (),
    what: str = "a problem .npz",
    max_bytes: int = MAX_NPZ_BYTES,
) -> dict[str, np.ndarray]:
    """Read some arrays of a ``.npz`` without trusting it (module doc).

    Args:
        path: the archive.
        required: keys that must be present.
        optional: keys read when present; every other key is ignored unread.
        what: what the file should be, for messages ("a problem .npz").
        max_bytes: limit on the declared bytes of the arrays read, every
            element counted as at least 8 bytes.

    Returns:
        ``{key: array}`` for the required keys and the optional keys present;
        arrays are read-only.

    Raises:
        ProblemError: one line naming the file: missing, not a zip, truncated,
            corrupt (CRC), a missing key, a non-numeric array, or declared sizes
            that are inconsistent or over ``max_bytes``.
    """
    source = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "<stream>"
    required, optional = tuple(required), tuple(optional)
    try:
        with zipfile.ZipFile(path) as archive:
            members = {
                info.filename[: -len(".npy")]: info
                for info in archive.infolist()
                if info.filename.endswith(".npy")
            }
            missing = [key for key in required if key not in members]
            if missing:
                raise ProblemError(
                    f"{source} lacks the key(s) {', '.join(missing)} of {what}"
                )
            arrays = {}
            budget = max_bytes
            for key in required + tuple(k for k in optional if k in members):
                arrays[key] = _read_member(archive, members[key], source, what, budget)
                budget -= arrays[key].size * max(arrays[key].itemsize, _NUMBER_BYTES)
            return arrays
    except ProblemError:
        raise
    except FileNotFoundError:
        raise ProblemError(f"cannot read {source}: no such file") from None
    except IsADirectoryError:
        raise ProblemError(f"cannot read {source}: it is a directory") from None
    except PermissionError:
        raise ProblemError(f"cannot read {source}: permission denied") from None
    except Exception as error:  # untrusted input: report, never crash
        raise ProblemError(
            f"{source} is not a readable {what.removeprefix('a ')} (truncated or "
            f"corrupt): {_one_line(error)}"
        ) from None


def npz_output_path(path: str | os.PathLike[str]) -> Path:
    """The file ``numpy.savez`` writes for ``path`` (``.npz`` appended if missing),
    checked to be writable before any work is done.

    Raises:
        ProblemError: the folder does not exist, or the path is a folder.
    """
    out = Path(os.fspath(path))
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    folder = out.parent
    if not folder.is_dir():
        raise ProblemError(f"cannot write {out}: no folder {folder}")
    if out.is_dir():
        raise ProblemError(f"cannot write {out}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise ProblemError(f"cannot write {out}: the folder is not writable")
    return out


def write_npz(path: str | os.PathLike[str], arrays: Mapping[str, Any]) -> Path:
    """``numpy.savez`` to :func:`npz_output_path` of ``path``; returns that path.

    Raises:
        ProblemError: the file cannot be written.
    """
    out = npz_output_path(path)
    try:
        np.savez(out, **arrays)
    except OSError as error:
        raise ProblemError(f"cannot write {out}: {error.strerror or error}") from None
    return out
