"""Untrusted arrays and pickles cost bounded memory and fail with one line.

Alpa's stage profiles (indices that size the tables), Alpa's pickles (opcodes
that each build an object), problem ``.npz`` files (declared table sizes) and
the digits ``.npz`` of ``init-search --data``: every hostile file is built here,
small, and refused before anything of its declared size is allocated.
"""

from __future__ import annotations

import io
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format
import pytest
from helpers import run_cli, write_one_device_members

from pipedejavu import ProblemError
from pipedejavu.core.npzfile import MAX_NPZ_BYTES, read_npz
from pipedejavu.core.problem import PROBLEM_KEYS
from pipedejavu.costmodel.alpa import profiles
from pipedejavu.init_search.data import NUM_IMAGES, load_digits
from pipedejavu.io import alpa_pickle
from pipedejavu.io.alpa_records import StageProfileResult
from pipedejavu.planning.inputs import load_problem

_PROFILE = "profile-results-2023-04-25-16-59-36.npy"
# Its first key, (0, 5, 2, 0): MARK, BININT1 0, BININT1 5, BININT1 2, BININT1 0,
# TUPLE.
_FIRST_KEY = b"(K\x00K\x05K\x02K\x00t"


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code, _, err = run_cli(capsys, *argv)
    return code, err.strip().splitlines()


def _peak_bytes(call: Callable[[], object]) -> int:
    """Peak traced memory of ``call()``, which must raise ProblemError."""
    tracemalloc.start()
    try:
        with pytest.raises(ProblemError) as caught:
            call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _peak_bytes.message = str(caught.value)  # type: ignore[attr-defined]
    return peak


# ------------------------------------------------- stage-profile index bounds
@pytest.mark.parametrize("end", [10_000, 2**31 - 1])
def test_profile_keys_with_huge_indices_are_refused(tmp_path, data_dir, capsys, end):
    data = (data_dir / _PROFILE).read_bytes()
    assert data.count(_FIRST_KEY) == 1
    path = tmp_path / "huge_index.npy"  # one key ends at layer `end`, not 5
    path.write_bytes(
        data.replace(_FIRST_KEY, b"(K\x00J" + struct.pack("<i", end) + b"K\x02K\x00t")
    )
    with pytest.raises(ProblemError, match=r"huge_index\.npy: .* over the limit"):
        profiles.read_stage_profile(path)
    code, lines = _cli(capsys, "inspect", path, "--cluster", "1x8", "-B", "8")
    assert code == 2 and len(lines) == 1, lines
    assert "huge_index.npy" in lines[0] and f"{end + 1} x {end + 1}" in lines[0]


@pytest.mark.parametrize(
    "sizes",
    [{"num_layers": 2**20}, {"num_submeshes": 2**40}, {"num_configs": 2**62}],
)
def test_table_sizes_given_are_bounded_too(sizes):
    record = {(0, 1, 0, 1): StageProfileResult(2, [None, None])}
    with pytest.raises(ProblemError, match="over the limit"):
        profiles.stage_profile_tables(record, **sizes)


def test_table_limit_fits_a_problem_file_and_the_real_profiles(data_dir):
    # Both tables (8 bytes an entry) of the largest profile read back from a
    # problem file; the bundled profiles use far less.
    assert 2 * 8 * profiles.MAX_STAGE_TABLE_ENTRIES <= MAX_NPZ_BYTES // 2
    records = profiles.read_stage_profile(data_dir / _PROFILE)
    sizes = [max(key[axis] for key in records) + 1 for axis in (1, 2, 3)]
    assert sizes[0] ** 2 * sizes[1] * sizes[2] * 1000 < profiles.MAX_STAGE_TABLE_ENTRIES


# ----------------------------------------------------------- pickle budgets
def test_pickle_opcodes_are_counted_before_unpickling(tmp_path, monkeypatch):
    # One empty list per byte: ~85 bytes of memory for each byte of file.
    path = tmp_path / "wide.pkl"
    path.write_bytes(b"\x80\x03(" + b"]" * 200_000 + b"l.")
    monkeypatch.setattr(alpa_pickle, "MAX_PICKLE_OPCODES", 100_000)
    # read_bytes reserves its limit + 1 bytes (untouched pages) before reading.
    monkeypatch.setattr(alpa_pickle, "MAX_ALPA_FILE_BYTES", 2**20)
    peak = _peak_bytes(lambda: alpa_pickle.load_alpa_pickle(path))
    assert "wide.pkl" in _peak_bytes.message and "opcodes" in _peak_bytes.message
    assert peak < 5e6  # 200,000 lists would take 13 MB; none is built


def test_the_opcode_budget_leaves_room_for_real_files(data_dir):
    largest = max(
        (data_dir / name).stat().st_size
        for name in (
            "prof_database.pkl",
            _PROFILE,
            "profile-results-2023-04-25-17-25-46.npy",
        )
    )
    # Real files hold one opcode per 3.7-4.8 bytes; the limits allow 9x the
    # largest bundled file.
    assert 8 * largest < alpa_pickle.MAX_ALPA_FILE_BYTES <= 64 * 2**20
    assert alpa_pickle.MAX_ALPA_FILE_BYTES // 4 <= alpa_pickle.MAX_PICKLE_OPCODES


def test_pickles_larger_than_real_files_are_refused_unread(tmp_path):
    path = tmp_path / "big.pkl"
    with open(path, "wb") as handle:  # sparse: fast to write
        handle.truncate(64 * 2**20)
    with pytest.raises(ProblemError, match=r"big\.pkl is larger than"):
        profiles.read_prof_database(path)


@pytest.mark.parametrize(
    "stream", [b"\x80\x04\x8f.", b"\x80\x04(\x91.", b"\x80\x04\x8f(K\x01\x90."]
)
def test_sets_are_refused(tmp_path, stream):
    path = tmp_path / "set.pkl"  # 216 bytes of memory for each byte of file
    path.write_bytes(stream)
    with pytest.raises(ProblemError, match=r"set\.pkl .*a set \("):
        alpa_pickle.load_alpa_pickle(path)


def test_an_empty_database_is_refused(tmp_path, capsys):
    path = tmp_path / "empty_db.pkl"
    path.write_bytes(b"\x80\x03}.")
    with pytest.raises(ProblemError, match=r"empty_db\.pkl is an empty"):
        profiles.read_prof_database(path)
    code, lines = _cli(capsys, "costmodel", "report", path)
    assert code == 2 and len(lines) == 1 and "empty_db.pkl" in lines[0], lines


# ------------------------------------------------------ problem .npz sizes
def _deflated_problem(path: Path, shape: tuple[int, ...], dtype: str) -> Path:
    """A problem .npz whose compute_cost of ``shape`` (all zero bytes) deflates
    to a few hundred KB."""
    header = io.BytesIO()
    npy_format.write_array_header_1_0(
        header, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    num_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    chunk = bytes(1 << 22)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("compute_cost.npy", "w", force_zip64=True) as member:
            member.write(header.getvalue())
            for start in range(0, num_bytes, len(chunk)):
                member.write(chunk[: num_bytes - start])
        write_one_device_members(archive, 8)
    return path


@pytest.mark.parametrize(
    ("shape", "dtype", "message"),
    [
        ((5800, 5800, 1, 1), "<f8", r"\(0.251 GiB\), over the 0.25 GiB"),
        ((6000, 6000, 1, 1), "|u1", r"0.268 GiB as 8-byte numbers"),
    ],
)
def test_problem_files_are_bounded_by_their_table_size(
    tmp_path, capsys, shape, dtype, message
):
    path = _deflated_problem(tmp_path / "bomb.npz", shape, dtype)
    assert path.stat().st_size < 2e6
    with pytest.raises(ProblemError, match=message):
        read_npz(path, required=PROBLEM_KEYS)
    peak = _peak_bytes(lambda: load_problem(path))
    assert "bomb.npz" in _peak_bytes.message
    assert peak < 20e6  # 269 MB (or 36 MB, 288 MB as float64) declared
    code, lines = _cli(capsys, "solve", path)
    assert code == 2 and len(lines) == 1 and "bomb.npz" in lines[0], lines


def test_a_problem_reads_within_its_counted_size(tmp_path):
    num_layers = 256
    path = tmp_path / "ok.npz"
    np.savez(
        path,
        compute_cost=np.ones((num_layers, num_layers, 2, 2)),
        submesh_shapes=np.array([[1, 1], [1, 2]]),
        cluster_shape=np.array([1, 2]),
        num_microbatches=np.array(8),
    )
    assert read_npz(path, required=PROBLEM_KEYS, max_bytes=2**21 + 64)
    assert load_problem(path).num_layers == num_layers


# ------------------------------------------------- init-search --data files
def _digits(path: Path, *, compress: bool = False) -> Path:
    rng = np.random.default_rng(0)
    save = np.savez_compressed if compress else np.savez
    save(
        path,
        images=rng.integers(0, 17, (NUM_IMAGES, 8, 8), dtype=np.uint8),
        labels=rng.integers(0, 10, NUM_IMAGES, dtype=np.uint8),
    )
    return path


def _with_images_header(path: Path, shape: tuple[int, ...]) -> Path:
    """A digits .npz whose images header declares ``shape`` over 100 bytes."""
    header = io.BytesIO()
    npy_format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": shape}
    )
    labels = io.BytesIO()
    np.save(labels, np.zeros(NUM_IMAGES, np.uint8))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("images.npy", header.getvalue() + bytes(100))
        archive.writestr("labels.npy", labels.getvalue())
    return path


def _corrupt(path: Path, *, offset: int) -> Path:
    """Flip the bytes of the images entry's data ``offset`` bytes in."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("images.npy")
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length + offset
    data[start : start + 64] = bytes(255 - b for b in data[start : start + 64])
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: _corrupt(_digits(p), offset=1000), "Bad CRC-32"),
        (lambda p: _corrupt(_digits(p, compress=True), offset=200), "corrupt"),
        (lambda p: _with_images_header(p, (10**7, 10**7)), "but its entry holds"),
        (lambda p: _with_images_header(p, (10**30,)), "but its entry holds"),
    ],
    ids=["crc", "zlib", "shape-1e14", "shape-1e30"],
)
def test_bad_digits_files_fail_with_one_line(tmp_path, capsys, make, message):
    path = make(tmp_path / "digits.npz")
    peak = _peak_bytes(lambda: load_digits(path))
    assert "digits.npz" in _peak_bytes.message and message in _peak_bytes.message
    assert peak < 5e6
    code, lines = _cli(
        capsys,
        "init-search",
        "--data",
        path,
        "--epochs=10",
        "--demo-epochs=1",
        "--num-workers=2",
        "--keep=1",
    )
    assert code == 2 and len(lines) == 1 and "digits.npz" in lines[0], lines


def test_a_valid_digits_file_reads(tmp_path):
    dataset = load_digits(_digits(tmp_path / "digits.npz", compress=True))
    assert sum(len(part.labels) for part in dataset) == NUM_IMAGES


@pytest.mark.parametrize(
    "stream, says",
    [
        (b"\x80\x04K\x01", "without a STOP"),
        (b"\x80\x04\xff.", "unknown opcode 0xff"),
        (b"\x80\x04X\x10\x00\x00\x00ab.", "runs past the end"),
        (b"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00N.", "frame"),
        (b"\x80\x04N\x94N\x94Nr\x05\x00\x00\x00.", "memo index 5 out of order"),
        (b"\x80\x02Nq\x03.", "memo index 3 out of order"),
        (b"(Np7\n.", "memo index 7 out of order"),
        (b"cbuiltins\nlist", "has no newline"),
    ],
)
def test_the_opcode_walk_refuses_malformed_streams(tmp_path, stream, says):
    path = tmp_path / "bad.pkl"
    path.write_bytes(stream)
    with pytest.raises(ProblemError, match=r"bad\.pkl") as error:
        alpa_pickle.load_alpa_pickle(path)
    assert says in str(error.value)


def test_the_opcode_walk_lets_nothing_through_genops_would_stop(data_dir):
    """The walk skips decoding the arguments (the unpickler decodes them):
    on 400 corruptions of a real pickle, whatever it lets through that
    pickletools' full walk refuses, the unpickler refuses with one
    ProblemError."""
    import pickletools
    import random

    real = (data_dir / "prof_database.pkl").read_bytes()
    rng = random.Random(0)
    through = 0
    for _ in range(400):
        data = bytearray(real[: rng.randint(50, 4000)] + b".")
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            alpa_pickle._prescan(bytes(data))  # noqa: SLF001 - the walk itself
        except Exception:
            continue
        try:
            for _ in pickletools.genops(bytes(data)):
                pass
        except Exception:
            through += 1
            with pytest.raises(ProblemError):
                alpa_pickle._unpickle(bytes(data), "corrupt.pkl")  # noqa: SLF001
    assert through < 400
