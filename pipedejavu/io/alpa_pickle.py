"""A restricted unpickler for Alpa's profile files, which are untrusted input.

A pickle can name any importable callable and call it while loading (``os.system``
through ``__reduce__`` is the classic). :class:`_AlpaUnpickler` resolves only an
allow-list of names: the three Alpa classes (mapped to the plain stand-ins of
:mod:`pipedejavu.io.alpa_records`) and the few numpy/builtins globals that
Alpa's files actually use, as listed by ``pickletools`` on the real files (protocol 3):

* ``prof_database.pkl``: ``collections.defaultdict``, ``builtins.list`` (its
  default factory), ``numpy.core.multiarray.scalar`` and ``numpy.dtype``
  (float64 scalars).
* ``profile-results-*.npy`` (a 0-d object array):
  ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``,
  ``numpy.core.multiarray.scalar`` (float64 and int64 scalars).

Every other global raises :class:`UnsafePickleError` before anything is called.

The numpy names do not resolve to numpy itself: numpy's own unpickling trusts
its input (an object-array state whose list is shorter than its shape crashes
the interpreter; a dtype state can rewrite a dtype's flags). They resolve to
stand-ins that accept only what ``numpy`` itself writes for plain numeric and
object data, check sizes against the data, and only then call numpy. Before
unpickling, a ``pickletools`` pass checks the opcode stream (lengths within the
file, memo indices in order, at most :data:`MAX_PICKLE_OPCODES` opcodes and
no sets), so a few corrupt bytes cannot make the C unpickler allocate
gigabytes, and a file of one-byte opcodes (each an empty dict or list: 60-85
bytes of memory per byte of file) builds at most ~0.7 GB. Nothing in this
package calls ``pickle.load``.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import pickletools
from typing import Any

import numpy as np

from pipedejavu.core.files import read_bytes
from pipedejavu.core.npzfile import npy_header
from pipedejavu.core.problem import ProblemError
from pipedejavu.io import alpa_records as alpa_types

__all__ = [
    "MAX_ALPA_FILE_BYTES",
    "MAX_PICKLE_OPCODES",
    "UnsafePickleError",
    "load_alpa_npy",
    "load_alpa_pickle",
]

PathLike = str | os.PathLike


class UnsafePickleError(ProblemError):
    """A pickle names a global outside the allow-list; nothing was called."""


class _Refused(pickle.UnpicklingError):
    """Data that numpy would accept but that numpy never writes."""


# numpy type codes allowed in a pickled dtype: plain numbers, and object for the
# array that holds Alpa's dict.
_DTYPE_CODES = frozenset(
    ["f8", "f4", "f2", "i8", "i4", "i2", "i1", "u8", "u4", "u2", "u1", "b1", "O8"]
)


class _DtypeSpec(metaclass=alpa_types.SealedClass):
    """What ``numpy.dtype`` resolves to: a checked description, never a live dtype.

    The pickle calls ``dtype(code, False, True)`` and then ``BUILD``s it with a
    state tuple; the state must equal what numpy writes for that code.
    """

    __slots__ = ("dtype",)

    def __init__(self, code: Any, align: Any = False, copy: Any = True) -> None:
        if type(code) is not str or code not in _DTYPE_CODES or align is not False:
            raise _Refused(f"dtype {code!r} is not a plain numeric or object dtype")
        self.dtype = np.dtype(code)

    def __setstate__(self, state: Any) -> None:
        expected = self.dtype.__reduce__()[2]
        if type(state) is not tuple or state != expected:
            raise _Refused(f"unexpected state {state!r} for dtype {self.dtype}")


def _dtype_of(spec: Any) -> np.dtype:
    if not isinstance(spec, _DtypeSpec):
        raise _Refused(f"expected a pickled dtype, got {type(spec).__name__}")
    return spec.dtype


def _scalar(spec: Any, data: Any) -> np.generic:
    """``numpy.core.multiarray.scalar`` for numeric dtypes only."""
    dtype = _dtype_of(spec)
    if dtype.hasobject or type(data) is not bytes or len(data) != dtype.itemsize:
        raise _Refused(f"a {dtype} scalar needs {dtype.itemsize} bytes of data")
    return np.frombuffer(data, dtype=dtype)[0]


class _NdarrayToken:
    """What ``numpy.ndarray`` resolves to: usable only as ``_reconstruct``'s type."""

    __slots__ = ()


_NDARRAY = _NdarrayToken()


class _CheckedArray(np.ndarray):
    """An array whose pickled state is checked before numpy sees it."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) != 5:
            raise _Refused("an array state must be a 5-tuple")
        version, shape, spec, fortran, data = state
        dtype = _dtype_of(spec)
        if (
            type(version) is not int
            or version != 1
            or type(shape) is not tuple
            or not all(type(n) is int and n >= 0 for n in shape)
            or type(fortran) is not bool
        ):
            raise _Refused(f"malformed array state {state[:4]!r}")
        count = math.prod(shape)
        if dtype.hasobject:
            ok = type(data) is list and len(data) == count
        else:
            ok = type(data) is bytes and len(data) == count * dtype.itemsize
        if not ok:
            raise _Refused(f"array data does not match shape {shape} of {dtype}")
        super().__setstate__((1, shape, dtype, fortran, data))


def _reconstruct(subtype: Any, shape: Any, code: Any) -> _CheckedArray:
    """``numpy.core.multiarray._reconstruct`` as numpy writes it: an empty array."""
    if subtype is not _NDARRAY or shape != (0,) or code not in (b"b", "b"):
        raise _Refused("unexpected arguments to numpy's array constructor")
    return np.ndarray.__new__(_CheckedArray, (0,), np.int8)


_STAGE_PROFILING = "alpa.pipeline_parallel.stage_profiling"
_ALLOWED: dict[tuple[str, str], Any] = {
    ("alpa.mesh_profiling", "MeshProfilingResult"): alpa_types.MeshProfilingResult,
    (_STAGE_PROFILING, "StageProfileResult"): alpa_types.StageProfileResult,
    (_STAGE_PROFILING, "ModuleProfileResult"): alpa_types.ModuleProfileResult,
    # numpy 2 renamed numpy.core to numpy._core; files may name either.
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeSpec,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "list"): list,
}


class _AlpaUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names in ``_ALLOWED``."""

    def __init__(self, file: io.BytesIO, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refusing to load {module}.{name} from {self._source}: only Alpa "
                "profile classes and plain numpy/builtins data are allowed"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"refusing a persistent id in {self._source}: Alpa profiles have none"
        )


_MEMO_PUTS = frozenset(["PUT", "BINPUT", "LONG_BINPUT"])
# An empty set costs 216 bytes for one byte of file; Alpa's files hold no sets.
_SET_OPCODES = frozenset(["EMPTY_SET", "ADDITEMS", "FROZENSET"])

#: Most opcodes of one pickle. The bundled files hold one opcode per 3.7-4.8
#: bytes (809,491 in the largest, 3.5 MB), so real files up to ~30 MB stay
#: under it. Besides what its own bytes hold, an opcode builds at most one small
#: object (an empty dict, 64 bytes) and a reference, so a hostile stream of
#: one-byte opcodes builds at most ~0.7 GB (measured: 8.4 million empty dicts).
MAX_PICKLE_OPCODES = 2**23


def _opcode_table() -> list[tuple[str, int, str] | None]:
    """Per opcode byte: ``(name, argument length rule, argument name)``, from
    :mod:`pickletools`' descriptions (``None``: not an opcode). The rule is a
    byte count, or one of pickletools' negative codes: up to a newline, or a
    length of 1, 4 (signed or not) or 8 bytes before the data."""
    table: list[tuple[str, int, str] | None] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        table[ord(op.code)] = (
            (op.name, 0, "") if arg is None else (op.name, arg.n, arg.name)
        )
    return table


_OPCODES = _opcode_table()
#: Length prefixes (pickletools' codes) -> (bytes, signed).
_PREFIXES = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _prescan(data: bytes) -> None:
    """Walk the opcodes without building anything; raise on a malformed stream.

    Every opcode must be known and every argument must fit in the data (as
    :func:`pickletools.genops` checks, but without decoding the arguments,
    which the unpickler decodes anyway: this walk takes about half the time);
    memo indices must come in order (as every pickler writes them), since the
    C unpickler sizes its memo table by the largest index it sees. The opcodes
    are counted (:data:`MAX_PICKLE_OPCODES`) and sets refused, which bounds the
    memory the unpickler may build.
    """
    puts, position, end = 0, 0, len(data)
    for count in range(MAX_PICKLE_OPCODES + 1):
        if position >= end:
            raise _Refused("the pickle ends without a STOP opcode")
        if count == MAX_PICKLE_OPCODES:
            raise _Refused(
                f"more than {MAX_PICKLE_OPCODES} opcodes (at byte {position}); "
                "Alpa's profiles hold about one per 4 bytes"
            )
        entry = _OPCODES[data[position]]
        if entry is None:
            raise _Refused(f"unknown opcode {data[position]:#04x} at byte {position}")
        name, rule, arg_name = entry
        start = position + 1
        if rule >= 0:
            position = start + rule
        elif rule == pickletools.UP_TO_NEWLINE:  # one line, or two for GLOBAL
            lines = 2 if arg_name == "stringnl_noescape_pair" else 1
            position = start
            for _ in range(lines):
                newline = data.find(b"\n", position)
                if newline < 0:
                    raise _Refused(f"{name} at byte {start - 1} has no newline")
                position = newline + 1
        else:
            size, signed = _PREFIXES[rule]
            length = int.from_bytes(data[start : start + size], "little", signed=signed)
            if start + size > end or length < 0:
                raise _Refused(f"{name} at byte {start - 1}: bad length")
            position = start + size + length
        if position > end:
            raise _Refused(f"{name} at byte {start - 1} runs past the end")
        if name in _SET_OPCODES:
            raise _Refused(f"a set ({name}) at byte {start - 1}")
        if name in _MEMO_PUTS:
            text = data[start:position]
            index = int(text) if name == "PUT" else int.from_bytes(text, "little")
            if index != puts:
                raise _Refused(f"memo index {index} out of order at byte {start - 1}")
            puts += 1
        elif name == "MEMOIZE":
            puts += 1
        elif name == "FRAME":
            if int.from_bytes(data[start:position], "little") > end - position:
                raise _Refused(f"frame at byte {start - 1} overruns")
        elif name == "STOP":
            return


#: Largest Alpa file read (bytes): 32 MiB, 9x the largest bundled one (the
#: bundled and reference files are 0.3-3.5 MB). With :data:`MAX_PICKLE_OPCODES`
#: it bounds what the unpickler builds.
MAX_ALPA_FILE_BYTES = 2**25


def _read_bytes(path: PathLike) -> bytes:
    data = read_bytes(path, MAX_ALPA_FILE_BYTES, "Alpa profile file")
    if not data:
        raise ProblemError(f"{path} is empty, not an Alpa profile file")
    return data


def _unpickle(data: bytes, source: str) -> Any:
    """Run the restricted unpickler; every failure becomes a ProblemError."""
    try:
        _prescan(data)
        return _AlpaUnpickler(io.BytesIO(data), source).load()
    except ProblemError:
        raise
    except Exception as error:  # untrusted input: report, never crash
        detail = str(error).splitlines()[0] if str(error) else ""
        raise ProblemError(
            f"{source} is not a readable Alpa pickle (truncated or corrupt): "
            f"{type(error).__name__}{': ' + detail if detail else ''}"
        ) from None


def load_alpa_pickle(path: PathLike) -> Any:
    """Load a pickle file such as Alpa's ``prof_database.pkl``, safely.

    Args:
        path: the ``.pkl`` file.

    Returns:
        The unpickled object, built only from allowed classes (for the profiling
        database: a ``dict`` of :class:`~costmodel.alpa_types.MeshProfilingResult`).

    Raises:
        UnsafePickleError: the pickle names a non-allowed global (nothing ran).
        ProblemError: the file is missing, empty, truncated or not a pickle.
    """
    return _unpickle(_read_bytes(path), str(path))


def load_alpa_npy(path: PathLike) -> np.ndarray:
    """Load an Alpa stage-profile ``.npy`` (a pickled 0-d object array), safely.

    The numpy header is parsed with ``numpy.lib.format`` (which never unpickles);
    the pickled payload goes through the restricted unpickler.

    Args:
        path: the ``profile-results-*.npy`` file.

    Returns:
        ``ndarray`` of shape ``()`` and dtype ``object``; ``.item()`` is the dict.

    Raises:
        UnsafePickleError: the payload names a non-allowed global (nothing ran).
        ProblemError: not a ``.npy`` file, not a 0-d object array, or a corrupt
            payload.
    """
    source = str(path)
    stream = io.BytesIO(_read_bytes(path))
    try:
        version, header = npy_header(stream)
        if header is None:
            raise ProblemError(
                f"{source} uses .npy format version {version[0]}.{version[1]}; "
                "Alpa stage profiles use 1.0 or 2.0"
            )
        shape, _, dtype = header
    except ProblemError:
        raise
    except Exception as error:  # untrusted input: report, never crash
        raise ProblemError(
            f"{source} is not a .npy file: {type(error).__name__}: {error}"
        ) from None
    if dtype != np.dtype(object) or shape != ():
        raise ProblemError(
            f"{source} holds a {dtype} array of shape {shape}, not an Alpa stage "
            "profile (a pickled dict in a 0-d object array)"
        )
    array = _unpickle(stream.read(), source)
    if (
        not isinstance(array, np.ndarray)
        or array.shape != ()
        or array.dtype != np.dtype(object)
    ):
        raise ProblemError(
            f"{source} has an object-array header but its payload is a "
            f"{type(array).__name__}, not a 0-d object array"
        )
    return array.view(np.ndarray)
