"""Every reader against the untrusted-input contract, fuzzed.

The contract (README, "Command line"): a truncated, corrupted, mistyped,
hugely-declared or deeply nested file gives :class:`ProblemError` in the API
and exit 2 with one stderr line naming the file on the command line; never
another exception, nothing in the file is executed, and memory stays bounded.

Readers: problem ``.npz`` (homogeneous and heterogeneous), Alpa stage-profile
``.npy`` and ``prof_database.pkl`` pickles (their byte-level fuzzing is in
``test_readers.py``; here through the command line), cluster JSON/TOML, and
plan JSON.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import sys
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format
import pytest
from helpers import fixture_fuzz, run_cli, write_one_device_members
from hypothesis import given
from hypothesis import strategies as st

from pipedejavu import (
    Cluster,
    HeteroPlan,
    HeteroProblem,
    Plan,
    PlanError,
    Problem,
    ProblemError,
    evaluate,
    load_plan,
    load_problem,
    solve,
)
from pipedejavu.core.npzfile import read_npz
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.planning.inputs import bundled_examples, load_example

FUZZ = fixture_fuzz(30)

# ------------------------------------------------------------------ fixtures
_SMALL = random_problem(5, (1, 4), num_microbatches=4, seed=0)


def _homogeneous_bytes(tmp: Path) -> bytes:
    return _SMALL.to_npz(tmp / "valid.npz").read_bytes()


def _hetero_problem() -> HeteroProblem:
    cluster = Cluster.from_json(
        {
            "devices_per_host": 4,
            "device_types": {"a": {"speed": 1.0}},
            "hosts": ["a"],
            "intra_host": {"a": {"latency_us": 1, "bandwidth_gbps": 100}},
        }
    )
    return HeteroProblem.from_problem(_SMALL, cluster, boundary_bytes=np.full(4, 1e6))


def _cluster_json() -> dict:
    return json.loads(
        (Path(__file__).resolve().parents[1] / "pipedejavu/data")
        .joinpath("cluster-a100-v100-4x8.json")
        .read_text()
    )


def _plan_json() -> dict:
    return {
        "method": "dp",
        "cost": 1.0,
        "num_microbatches": 4,
        "stages": [
            {
                "start": 0,
                "stop": 5,
                "submesh": [1, 4],
                "submesh_index": 2,
                "config_index": 0,
                "latency": 0.5,
            }
        ],
        "search_time_s": 0.0,
    }


def _mutate_bytes(data: bytes, draw) -> bytes:
    """Truncate and/or flip bytes (at least one change)."""
    data = bytearray(data)
    kind = draw(st.sampled_from(["cut", "flip", "both"]))
    if kind in ("flip", "both"):
        for _ in range(draw(st.integers(1, 4))):
            position = draw(st.integers(0, len(data) - 1))
            data[position] ^= draw(st.integers(1, 255))
    if kind in ("cut", "both"):
        data = data[: draw(st.integers(0, len(data) - 1))]
    return bytes(data)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["inf", "a100", "v100", "default", "a100-v100", "x-y"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _mutate_json(value, draw, depth: int = 0):
    """Replace, delete or retype one node of a JSON value."""
    if isinstance(value, dict) and value and draw(st.integers(0, 3)) and depth < 6:
        key = draw(st.sampled_from(sorted(value)))
        changed = dict(value)
        if draw(st.integers(0, 4)) == 0:
            del changed[key]
        else:
            changed[key] = _mutate_json(value[key], draw, depth + 1)
        return changed
    if isinstance(value, list) and value and draw(st.integers(0, 3)) and depth < 6:
        index = draw(st.integers(0, len(value) - 1))
        changed = list(value)
        changed[index] = _mutate_json(value[index], draw, depth + 1)
        return changed
    return draw(JSON_VALUES)


def _only_problem_errors(read, *args, **kwargs):
    """Run a reader; a ProblemError is the only failure allowed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return read(*args, **kwargs)
        except ProblemError as error:
            assert "\n" not in str(error)
            return None


def _cli(capsys, *argv) -> tuple[int, str]:
    code, _, err = run_cli(capsys, *argv)
    assert "Traceback" not in err
    return code, err


def _assert_bad_input_line(code: int, err: str, path: Path) -> None:
    """Exit 2 names the file in one line; 0 and 3 are answers to valid input."""
    assert code in (0, 2, 3), err
    if code == 2:
        lines = [line for line in err.splitlines() if not line.startswith("warning")]
        assert len(lines) == 1, err
        assert path.name in lines[0], err


# --------------------------------------------------------------- problem .npz
@FUZZ
@given(data=st.data())
def test_mutated_problem_npz_gives_problem_error(tmp_path, data):
    valid = _homogeneous_bytes(tmp_path)
    path = tmp_path / "mutated.npz"
    path.write_bytes(_mutate_bytes(valid, data.draw))
    for read in (Problem.from_npz, load_problem):
        _only_problem_errors(read, path)


@FUZZ
@given(data=st.data())
def test_mutated_hetero_npz_gives_problem_error(tmp_path, data):
    valid = _hetero_problem().to_npz(tmp_path / "valid.npz").read_bytes()
    path = tmp_path / "mutated.npz"
    path.write_bytes(_mutate_bytes(valid, data.draw))
    for read in (HeteroProblem.from_npz, load_problem):
        _only_problem_errors(read, path)


_ARRAY_KINDS = st.sampled_from(
    ["float", "int", "bool", "text", "complex", "object", "empty", "scalar"]
)


def _odd_array(kind: str, draw):
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=5)))
    if kind == "float":
        return np.full(shape, draw(st.floats(allow_nan=True, allow_infinity=True)))
    if kind == "int":
        return np.full(shape, draw(st.integers(-(2**62), 2**62)), dtype=np.int64)
    if kind == "bool":
        return np.zeros(shape, dtype=bool)
    if kind == "text":
        return np.full(shape, draw(st.text(max_size=5)))
    if kind == "complex":
        return np.zeros(shape, dtype=complex)
    if kind == "object":
        return np.array([{"a": 1}, None], dtype=object)
    if kind == "empty":
        return np.zeros((0,) + shape)
    return np.asarray(draw(st.integers(-5, 10**12)))


@FUZZ
@given(data=st.data())
def test_problem_npz_with_wrong_types_gives_problem_error(tmp_path, data):
    arrays = {
        "compute_cost": _SMALL.compute_cost,
        "max_n_succ_stages": _SMALL.max_n_succ_stages,
        "submesh_shapes": _SMALL.submesh_shapes,
        "cluster_shape": np.array([1, 4]),
        "num_microbatches": np.array(4),
    }
    if data.draw(st.booleans()):
        arrays["cluster_json"] = np.asarray(
            json.dumps(data.draw(JSON_VALUES)) if data.draw(st.booleans()) else "["
        )
    for key in ("boundary_bytes", "activation_bytes"):
        if data.draw(st.booleans()):
            arrays[key] = np.full(4, 1e6)
    for key in data.draw(st.lists(st.sampled_from(sorted(arrays)), max_size=3)):
        if data.draw(st.integers(0, 5)) == 0:
            arrays.pop(key, None)
        else:
            arrays[key] = _odd_array(data.draw(_ARRAY_KINDS), data.draw)
    path = tmp_path / "typed.npz"
    np.savez(path, **arrays)
    for read in (Problem.from_npz, HeteroProblem.from_npz, load_problem):
        _only_problem_errors(read, path)
    cluster = {**_cluster_json(), "hosts": ["a100"], "devices_per_host": 4}
    _only_problem_errors(load_problem, path, cluster=Cluster.from_json(cluster))


def _npz_with_header(path: Path, shape, *, declared_size=None, deflate=False):
    """A problem .npz whose compute_cost header declares ``shape`` (f8) but holds
    16 bytes of data; the zip directory states ``declared_size`` bytes for it."""
    header = io.BytesIO()
    npy_format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": tuple(shape)}
    )
    member = header.getvalue() + b"\x00" * 16
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        archive.writestr("compute_cost.npy", member)
        write_one_device_members(archive, 4)
    if declared_size is not None:  # patch the central directory's size field
        data = bytearray(path.read_bytes())
        central = data.find(b"PK\x01\x02")  # compute_cost's entry comes first
        data[central + 24 : central + 28] = declared_size.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("shape", "declared_size", "deflate", "message"),
    [
        ((100_000, 100_000, 5, 2), None, False, "745 GiB"),
        ((2_000, 2_000, 5, 2), None, False, "but its entry holds"),
        ((2_000, 2_000, 5, 2), 320_000_128, False, "stored bytes"),
        ((2_000, 2_000, 5, 2), 320_000_128, True, "stored bytes"),
    ],
)
def test_huge_declared_arrays_are_refused_before_allocating(
    tmp_path, capsys, shape, declared_size, deflate, message
):
    path = _npz_with_header(
        tmp_path / "huge.npz", shape, declared_size=declared_size, deflate=deflate
    )
    tracemalloc.start()
    try:
        with pytest.raises(ProblemError, match=message):
            load_problem(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6  # 320 MB or 745 GiB declared; nothing of it allocated
    code, err = _cli(capsys, "solve", path)
    assert code == 2 and message in err and "huge.npz" in err


def test_read_npz_limit_counts_every_array(tmp_path):
    path = _SMALL.to_npz(tmp_path / "p.npz")
    keys = ("compute_cost", "max_n_succ_stages")
    assert set(read_npz(path, required=keys)) == set(keys)
    limit = _SMALL.compute_cost.nbytes + 8  # room for one table, not two
    with pytest.raises(ProblemError, match="reading limit"):
        read_npz(path, required=keys, max_bytes=limit)


def test_object_arrays_in_npz_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.npz"
    np.savez(
        path,
        compute_cost=np.array([Exploit()], dtype=object),
        submesh_shapes=np.array([[1, 1]]),
        cluster_shape=np.array([1, 1]),
        num_microbatches=np.array(4),
    )
    with pytest.raises(ProblemError, match="object arrays"):
        load_problem(path)
    code, err = _cli(capsys, "inspect", path)
    assert code == 2 and "evil.npz" in err
    assert not marker.exists()


# ------------------------------------------------------------ cluster files
@FUZZ
@given(data=st.data())
def test_mutated_cluster_json_gives_problem_error(tmp_path, data):
    value = _mutate_json(_cluster_json(), data.draw)
    _only_problem_errors(Cluster.from_json, value)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(value))
    _only_problem_errors(Cluster.from_file, path)


@FUZZ
@given(data=st.data())
def test_cluster_file_bytes_give_problem_error(tmp_path, data):
    suffix = data.draw(st.sampled_from([".json", ".toml"]))
    if suffix == ".toml" and sys.version_info < (3, 11):
        suffix = ".json"
    valid = json.dumps(_cluster_json()).encode()
    if suffix == ".toml":
        valid = (
            b'devices_per_host = 8\nhosts = ["a", "a"]\n[device_types.a]\nspeed = 1\n'
        )
    raw = (
        _mutate_bytes(valid, data.draw)
        if data.draw(st.booleans())
        else (data.draw(st.binary(max_size=200)))
    )
    path = tmp_path / f"cluster{suffix}"
    path.write_bytes(raw)
    _only_problem_errors(Cluster.from_file, path)


#: Every number of a cluster file: ``(section, entry, key)`` (``None`` entry: a
#: top-level key), with the key of the same quantity in the other unit.
_CLUSTER_NUMBERS = [
    (("device_types", "a100", "speed"), None),
    (("device_types", "v100", "memory_gb"), "memory_bytes"),
    (("device_types", "a100", "memory_bytes"), "memory_gb"),
    (("intra_host", "v100", "latency_us"), "latency_s"),
    (("inter_host", "default", "latency_s"), "latency_us"),
    (("intra_host", "a100", "bandwidth_gbps"), "bandwidth_bytes_per_s"),
    (("inter_host", "a100-v100", "bandwidth_bytes_per_s"), "bandwidth_gbps"),
    (("devices_per_host", None, None), None),
]
_NUMBERS = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(10**400), 10**400)
    | st.sampled_from([0, -0.0, 1e-320, 5e-324, 10**12, 2**20, 2**20 + 1])
    | st.sampled_from(["inf", "-inf", "nan", "1e3", "Infinity"])
)


@FUZZ
@given(data=st.data())
def test_cluster_numbers_in_range_or_one_line_naming_the_key(tmp_path, data):
    """Every numeric field, any number: a cluster whose numbers are all in the
    documented ranges, or one ProblemError line naming the file and the key."""
    from pipedejavu.core.validation import CLUSTER_RANGES, MAX_DEVICES

    value = _cluster_json()
    changed = []
    for _ in range(data.draw(st.integers(1, 3))):
        (section, entry, key), twin = data.draw(st.sampled_from(_CLUSTER_NUMBERS))
        number = data.draw(_NUMBERS)
        if entry is None:
            value[section] = number
            changed.append(section)
            continue
        value[section][entry].pop(twin, None)
        value[section][entry][key] = number
        changed.append(key)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(value))
    try:
        cluster = Cluster.from_file(path)
    except ProblemError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(f"{path}: ")
        assert any(key in message for key in changed), message
        return
    assert 1 <= cluster.num_devices <= MAX_DEVICES
    speeds = [t.speed for t in cluster.device_types]
    low, high, _ = CLUSTER_RANGES["speed"]
    assert all(low <= s <= high for s in speeds)
    low, high, _ = CLUSTER_RANGES["memory_bytes"]
    memories = [t.memory_bytes for t in cluster.device_types if t.memory_bytes]
    assert all(low <= m <= high for m in memories)
    links = [*cluster.intra_host, *(x for row in cluster.inter_host for x in row)]
    for link in links:
        assert 0 <= link.latency_s <= CLUSTER_RANGES["latency_s"][1]
        assert link.bandwidth == math.inf or 1e-3 <= link.bandwidth <= 1e18
        assert math.isfinite(link.time(1e12))


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_deeply_nested_and_binary_cluster_files(tmp_path, capsys, suffix):
    if suffix == ".toml" and sys.version_info < (3, 11):
        pytest.skip("TOML needs Python >= 3.11")
    problem = _SMALL.to_npz(tmp_path / "p.npz")
    deep = tmp_path / f"deep{suffix}"
    nested = "[" * 100_000 + "]" * 100_000
    deep.write_text(nested if suffix == ".json" else f"a = {nested}\n")
    binary = tmp_path / f"binary{suffix}"
    binary.write_bytes(bytes(range(256)) * 4)
    for path, message in ((deep, "nested too deeply"), (binary, "not UTF-8")):
        with pytest.raises(ProblemError, match=message):
            Cluster.from_file(path)
        code, err = _cli(capsys, "solve", problem, "--cluster-file", path)
        assert code == 2 and message in err and path.name in err
        assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------- plan JSON
@FUZZ
@given(data=st.data())
def test_mutated_plan_json_gives_problem_error(tmp_path, data):
    value = _mutate_json(_plan_json(), data.draw)
    for read in (Plan.from_json, HeteroPlan.from_json):
        _only_problem_errors(read, value)
    path = tmp_path / "plan.json"
    raw = json.dumps(value).encode()
    if data.draw(st.booleans()):
        raw = _mutate_bytes(raw, data.draw)
    path.write_bytes(raw)
    plan = _only_problem_errors(load_plan, path)
    if isinstance(plan, Plan):  # a plan that parses is checked, not trusted
        try:
            assert math.isfinite(evaluate(_SMALL, plan))
        except PlanError:
            pass


def test_plan_json_round_trips_and_names_bad_fields(tmp_path):
    solved = solve(load_example("generated-gpt-32layers-2x8"))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(solved.to_json()))
    again = load_plan(path)
    assert again.stages == solved.stages and again.cost == solved.cost
    bad = solved.to_json()
    bad["stages"][1]["stop"] = "seven"
    path.write_text(json.dumps(bad))
    with pytest.raises(ProblemError, match=r"plan.json: stages\[1\].stop"):
        load_plan(path)
    bad["stages"][1]["stop"] = 1e400  # JSON's Infinity
    path.write_text(json.dumps(bad))
    with pytest.raises(ProblemError, match="stop must be an integer"):
        load_plan(path)


# ------------------------------------------------------- the command line
_READERS = ["npz", "hetero-npz", "npy", "pkl", "cluster", "plan"]


@FUZZ
@given(data=st.data())
def test_command_line_gives_one_line_naming_the_file(tmp_path, capsys, data):
    reader = data.draw(st.sampled_from(_READERS))
    problem_path = _SMALL.to_npz(tmp_path / "base.npz")
    if reader == "npz":
        valid = problem_path.read_bytes()
    elif reader == "hetero-npz":
        valid = _hetero_problem().to_npz(tmp_path / "h.npz").read_bytes()
    elif reader == "npy":
        valid = bundled_examples()[1].path.read_bytes()
    elif reader == "pkl":
        valid = pickle.dumps({("default", (1, 1)): [1.0, 2.0]}, protocol=4)
    elif reader == "plan":  # fixed bytes: no search time in it
        valid = json.dumps({**solve(_SMALL).to_json(), "search_time_s": 0}).encode()
    else:
        valid = json.dumps(_cluster_json()).encode()
    suffix = "json" if reader in ("cluster", "plan") else reader[-3:]
    path = tmp_path / f"fuzzed.{suffix}"
    path.write_bytes(_mutate_bytes(valid, data.draw))
    if reader in ("npz", "hetero-npz"):
        code, err = _cli(capsys, "convert", path, tmp_path / "out.npz")
    elif reader == "npy":
        code, err = _cli(capsys, "convert", path, tmp_path / "out", "--cluster", "1x4")
        assert code == 2  # -B is missing, or the file is bad: named either way
        code, err = _cli(
            capsys, "convert", path, tmp_path / "out", "--cluster", "1x4", "-B", "8"
        )
    elif reader == "pkl":
        code, err = _cli(capsys, "solve", path, "--cluster", "1x4", "-B", "8")
    elif reader == "plan":
        code, err = _cli(capsys, "evaluate", problem_path, path)
    else:
        big = random_problem(4, (4, 8), num_microbatches=4, seed=0)
        code, err = _cli(
            capsys, "inspect", big.to_npz(tmp_path / "big.npz"), "--cluster-file", path
        )
    _assert_bad_input_line(code, err, path)


@pytest.mark.parametrize(
    "command", ["solve", "inspect", "convert", "compare", "costmodel predict"]
)
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_every_command_refuses_a_damaged_npz(tmp_path, capsys, command, damage):
    data = bytearray(_homogeneous_bytes(tmp_path))
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path = tmp_path / "damaged.npz"
    path.write_bytes(bytes(data))
    extra = [tmp_path / "out.npz"] if command == "convert" else []
    code, err = _cli(capsys, *command.split(), path, *extra)
    assert code == 2 and "damaged.npz" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ProblemError, match="damaged.npz"):
        load_problem(path)


def test_evaluate_checks_a_plan_file(tmp_path, capsys):
    problem_path = _SMALL.to_npz(tmp_path / "p.npz")
    plan = solve(_SMALL)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    code, out, _ = run_cli(capsys, "evaluate", problem_path, path)
    assert code == 0 and f"{plan.cost:.6f} s per iteration" in out
    broken = plan.to_json()
    broken["stages"][0]["stop"] = 1  # no longer covers the layers
    path.write_text(json.dumps(broken))
    code, err = _cli(capsys, "evaluate", problem_path, path)
    assert code == 2 and "plan.json" in err and "rule" in err
    hetero = _hetero_problem()
    placed = solve(hetero)
    path.write_text(json.dumps(placed.to_json()))
    code, err = _cli(capsys, "evaluate", problem_path, path)
    assert code == 2 and "placed plan" in err


def test_alpa_files_are_read_up_to_a_size_limit(tmp_path, monkeypatch):
    from pipedejavu.costmodel import read_prof_database
    from pipedejavu.io import alpa_pickle as _unpickle

    path = tmp_path / "big.pkl"
    path.write_bytes(pickle.dumps(list(range(1000))))
    monkeypatch.setattr(_unpickle, "MAX_ALPA_FILE_BYTES", 100)
    with pytest.raises(ProblemError, match="big.pkl is larger than 100 bytes"):
        read_prof_database(path)
