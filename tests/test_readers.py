"""Tests of costmodel's Alpa readers: restricted unpickling, tables, problems.

Expected numbers on the real profiles were derived independently by running
Alpa's own ``interpret_profile_result_training_2d`` and
``get_merged_stages_memory_stats`` (from github.com/alpa-projects/alpa, outside
this repository) on the same files with the incomplete records removed. The
hand-built cases were worked out on paper and checked against Alpa's function.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format
import pytest
from helpers import fixture_fuzz
from hypothesis import given
from hypothesis import strategies as st

from pipedejavu import costmodel
from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    ProblemError,
    evaluate,
    make_plan,
)
from pipedejavu.costmodel import (
    ModuleProfileResult,
    StageProfileResult,
    UnsafePickleError,
)

PROFILES = {
    "16-15-47": "profile-results-2023-04-25-16-15-47.npy",
    "16-59-36": "profile-results-2023-04-25-16-59-36.npy",
    "17-25-46": "profile-results-2023-04-25-17-25-46.npy",
}
INCOMPLETE = r"of \d+ stage-profile records are incomplete"


@functools.cache
def _records(path: Path) -> dict:
    """Each real profile is read once per session (the tests never mutate it)."""
    return costmodel.read_stage_profile(path)


def _tables(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with pytest.warns(UserWarning, match=INCOMPLETE):
        return costmodel.stage_profile_tables(_records(path))


# --- the real stage profiles -------------------------------------------------


@pytest.mark.parametrize(
    ("name", "num_layers", "num_records", "num_incomplete"),
    [("16-15-47", 6, 77, 60), ("16-59-36", 6, 77, 66), ("17-25-46", 12, 233, 227)],
)
def test_real_profile_counts(data_dir, name, num_layers, num_records, num_incomplete):
    records = costmodel.read_stage_profile(data_dir / PROFILES[name])
    assert len(records) == num_records
    assert sum(not r.fully_profiled for r in records.values()) == num_incomplete
    assert all(type(k) is tuple and all(type(x) is int for x in k) for k in records)
    message = (
        f"{num_incomplete} of {num_records} stage-profile records are incomplete "
        "(a module was not profiled); they count as unprofiled (inf)"
    )
    with pytest.warns(UserWarning) as caught:
        cost, limit = costmodel.stage_profile_tables(records)
    assert [str(w.message) for w in caught] == [message]
    assert cost.shape == limit.shape == (num_layers, num_layers, 3, 4)
    assert cost.dtype == np.float64 and limit.dtype == np.int64
    num_complete = num_records - num_incomplete
    assert int(np.isfinite(cost).sum()) == num_complete
    assert int((limit >= 0).sum() + (limit == -1).sum()) == cost.size
    # Unprofiled entries are (inf, -1), whatever the reason.
    assert np.all(limit[~np.isfinite(cost)] == -1)


# Every complete record: (key, compute_cost seconds, max_n_succ_stages), from
# Alpa's own functions run on the same files.
KNOWN_ENTRIES = {
    "16-15-47": [
        ((0, 2, 1, 2), 0.8223476054301708, -1),
        ((0, 3, 1, 0), 1.1141519510852227, -1),
        ((0, 3, 1, 1), 2.273802568587707, -1),
        ((0, 3, 1, 2), 1.1141519396811597, -1),
        ((0, 4, 1, 0), 1.371864513078652, -1),
        ((0, 4, 1, 1), 2.8185729339371757, -1),
        ((0, 4, 1, 2), 1.371864513078652, -1),
        ((0, 5, 1, 0), 1.6524261539925647, -1),
        ((0, 5, 1, 2), 1.6524261539925647, -1),
        ((1, 1, 0, 0), 0.503132963744745, -1),
        ((1, 1, 0, 1), 0.503132963744745, -1),
        ((1, 2, 0, 0), 1.0062659274894896, -1),
        ((1, 2, 0, 1), 1.0062659274894896, -1),
        ((1, 3, 0, 0), 1.5764488485316523, -1),
        ((1, 3, 0, 1), 1.5764488485316523, -1),
        ((2, 2, 0, 0), 0.503132963744745, -1),
        ((2, 2, 0, 1), 0.503132963744745, -1),
    ],
    "16-59-36": [
        ((0, 2, 0, 0), 0.41950444487763733, 0),
        ((0, 2, 0, 1), 0.41950444487763733, 0),
        ((0, 3, 1, 0), 0.30768494324836293, 0),
        ((0, 3, 1, 1), 0.6007035098942417, 1),
        ((0, 3, 1, 2), 0.3144335899626173, 0),
        ((0, 4, 1, 0), 0.3791745973515531, -1),
        ((0, 4, 1, 1), 0.7447260879754741, -1),
        ((0, 5, 2, 0), 0.23961370480046787, -1),
        ((0, 5, 2, 1), 0.4490263060848735, 3),
        ((0, 5, 2, 2), 0.4093621223570433, 7),
        ((0, 5, 2, 3), 0.2437361936777396, 0),
    ],
    "17-25-46": [
        ((0, 3, 1, 2), 0.5987275739690434, 0),
        ((0, 4, 1, 0), 0.7227395844102203, -1),
        ((0, 4, 1, 2), 0.7227395730061572, -1),
        ((0, 5, 1, 0), 0.8515958768109985, -1),
        ((0, 11, 2, 1), 1.7147417280938653, 0),
        ((0, 11, 2, 3), 0.8643731105874548, -1),
    ],
}


@pytest.mark.parametrize("name", sorted(KNOWN_ENTRIES))
def test_real_profile_known_entries(data_dir, name):
    cost, limit = _tables(data_dir / PROFILES[name])
    finite = {tuple(int(x) for x in key) for key in np.argwhere(np.isfinite(cost))}
    assert finite == {key for key, _, _ in KNOWN_ENTRIES[name]}
    for key, expected_cost, expected_limit in KNOWN_ENTRIES[name]:
        np.testing.assert_allclose(cost[key], expected_cost, rtol=1e-12, err_msg=key)
        assert limit[key] == expected_limit, key


def test_real_profile_every_complete_entry_of_16_15_47_is_memory_infeasible(
    data_dir,
):
    cost, limit = _tables(data_dir / PROFILES["16-15-47"])
    assert np.all(limit[np.isfinite(cost)] == -1)


def test_compute_cost_is_forward_plus_backward(data_dir):
    # The entry (0, 5, 2, 0) of the B=128 run: all 6 layers on the 1x4 submesh.
    records = _records(data_dir / PROFILES["16-59-36"])
    forward, backward = records[(0, 5, 2, 0)].module_profile_results
    np.testing.assert_allclose(forward.compute_cost, 0.050936338841562505, rtol=1e-12)
    np.testing.assert_allclose(backward.compute_cost, 0.18867736595890536, rtol=1e-12)
    cost, _ = _tables(data_dir / PROFILES["16-59-36"])
    assert cost[0, 5, 2, 0] == forward.compute_cost + backward.compute_cost


def test_real_memory_stats_of_one_record(data_dir):
    records = _records(data_dir / PROFILES["16-59-36"])
    stats = costmodel.stage_memory_stats([records[(0, 5, 2, 2)]])
    assert stats == (14957700710, 4384170170, 4260943880, 724783104, 7)
    # (14957700710 - 4384170170 - 4260943880) // 724783104 - 1 == 8 - 1
    assert stats.max_n_succ_stages == 7


@pytest.mark.parametrize(
    ("name", "num_layers", "num_microbatches"),
    [("16-15-47", 6, 32), ("16-59-36", 6, 128), ("17-25-46", 12, 32)],
)
def test_problem_from_real_profile(data_dir, name, num_layers, num_microbatches):
    with pytest.warns(UserWarning, match=INCOMPLETE):
        problem = costmodel.problem_from_stage_profile(
            data_dir / PROFILES[name],
            cluster_shape=(1, 4),
            num_microbatches=num_microbatches,
        )
    assert problem.num_layers == num_layers
    assert problem.num_configs == 4
    assert problem.submesh_shapes.tolist() == [[1, 1], [1, 2], [1, 4]]
    assert problem.cluster_shape == (1, 4)
    assert problem.num_microbatches == num_microbatches
    cost, limit = _tables(data_dir / PROFILES[name])
    np.testing.assert_array_equal(problem.compute_cost, cost)
    np.testing.assert_array_equal(problem.max_n_succ_stages, limit)


def test_problem_from_real_profile_single_stage_plan(data_dir):
    with pytest.warns(UserWarning, match=INCOMPLETE):
        problem = costmodel.problem_from_stage_profile(
            data_dir / PROFILES["16-59-36"], cluster_shape=(1, 4), num_microbatches=128
        )
    # The Plan uses half-open layer ranges: stop=6 reads compute_cost[0, 5, ...].
    plan = make_plan(problem, [(0, 6, 2, 3)], method="test")
    np.testing.assert_allclose(evaluate(problem, plan), 128 * 0.2437361936777396)


def test_problem_rejects_a_submesh_index_outside_the_choices(data_dir):
    with pytest.raises(ProblemError, match=r"submesh index 2.*only 2 choices"):
        costmodel.problem_from_stage_profile(
            data_dir / PROFILES["16-59-36"], cluster_shape=(1, 2), num_microbatches=8
        )


# --- the profiling database ----------------------------------------------------


def test_prof_database(data_dir):
    database = costmodel.read_prof_database(data_dir / "prof_database.pkl")
    assert list(database) == [
        ("default", (4, 8)),
        ("default", (2, 8)),
        ("default", (1, 8)),
        ("default", (1, 4)),
        ("default", (1, 2)),
        ("default", (1, 1)),
    ]
    assert database[("default", (4, 8))].available_memory_per_device == 14667979161
    for mesh in [(2, 8), (1, 8), (1, 4), (1, 2), (1, 1)]:
        assert database[("default", mesh)].available_memory_per_device == 14957700710
    groups = {(4, 8): 20, (2, 8): 16, (1, 8): 12, (1, 4): 8, (1, 2): 4, (1, 1): 2}
    for mesh, size in groups.items():
        result = database[("default", mesh)]
        assert isinstance(result, costmodel.MeshProfilingResult)
        for field in (
            "all_gather_cost_dict",
            "all_reduce_cost_dict",
            "reduce_scatter_cost_dict",
            "all_to_all_cost_dict",
        ):
            assert len(getattr(result, field)) == size, (mesh, field)
            assert type(getattr(result, field)) is dict
        assert len(result.dot_cost_dict) == 2
        assert result.conv_cost_dict == {} and result.op_cost_dict == {}
    timings = database[("default", (1, 4))].all_reduce_cost_dict[
        (((0, 1, 2, 3),), "f16")
    ]
    assert len(timings) == 33
    assert timings[0][0] == 0
    np.testing.assert_allclose(timings[0][1], 9.980122558772564e-05, rtol=1e-12)


# --- untrusted input -----------------------------------------------------------


def _payloads(marker: Path) -> dict[str, object]:
    """Objects whose unpickling would create ``marker``, by three routes."""

    class Shell:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class Exec:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    class Subprocess:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(marker)],))

    return {
        f"{os.system.__module__}.system": Shell(),
        "builtins.exec": Exec(),
        "subprocess.call": Subprocess(),
    }


def _dumps(payload: object, protocol: int) -> bytes:
    # fix_imports=False keeps Python 3 names (else protocol 2 writes
    # __builtin__.exec and commands.call, which are refused just the same).
    return pickle.dumps(payload, protocol=protocol, fix_imports=False)


def _npy_bytes(payload: object, protocol: int) -> bytes:
    """An object .npy whose pickled payload is ``payload`` (hand-made header)."""
    stream = io.BytesIO()
    npy_format.write_array_header_1_0(
        stream, {"descr": "|O", "fortran_order": False, "shape": ()}
    )
    return stream.getvalue() + _dumps(payload, protocol)


@pytest.mark.parametrize("protocol", [2, 3, 5])
@pytest.mark.parametrize("route", ["posix", "builtins", "subprocess"])
def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path, protocol, route):
    marker = tmp_path / "ran"
    name, payload = next(
        (name, payload)
        for name, payload in _payloads(marker).items()
        if name.startswith(route)
    )
    pkl = tmp_path / "evil.pkl"
    pkl.write_bytes(_dumps({("default", (1, 1)): payload}, protocol))
    with pytest.raises(UnsafePickleError, match=rf"refusing to load {name} from"):
        costmodel.read_prof_database(pkl)

    npy = tmp_path / "evil.npy"
    npy.write_bytes(_npy_bytes({(0, 0, 0, 0): payload}, protocol))
    with pytest.raises(UnsafePickleError, match=rf"refusing to load {name} from"):
        costmodel.read_stage_profile(npy)
    assert not marker.exists()


def test_malicious_object_array_saved_by_numpy_is_refused(tmp_path):
    marker = tmp_path / "ran"
    payload = _payloads(marker)["subprocess.call"]  # a realistic np.save
    path = tmp_path / "profile-results-evil.npy"
    np.save(path, np.array({(0, 0, 0, 0): payload}, dtype=object), allow_pickle=True)
    with pytest.raises(UnsafePickleError, match=r"subprocess\.call") as error:
        costmodel.read_stage_profile(path)
    assert isinstance(error.value, ProblemError)
    assert str(path) in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("alpa.foo", "Bar"),
        ("alpa.pipeline_parallel.stage_profiling", "StageConfig"),
        ("numpy", "load"),
        ("builtins", "eval"),
        ("os", "system"),
    ],
)
def test_unlisted_globals_are_refused(tmp_path, module, name):
    path = tmp_path / "other.pkl"
    path.write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")\x81.")
    with pytest.raises(UnsafePickleError, match=rf"refusing to load {module}.{name}"):
        costmodel.load_alpa_pickle(path)


def test_a_pickle_cannot_patch_the_stand_in_classes(tmp_path):
    # BUILD applied to the class object itself, setting __add__ = list.
    path = tmp_path / "patch.pkl"
    path.write_bytes(
        b"\x80\x02calpa.pipeline_parallel.stage_profiling\nModuleProfileResult\n"
        b"N}X\x07\x00\x00\x00__add__cbuiltins\nlist\ns\x86b."
    )
    with pytest.raises(ProblemError, match="not a readable Alpa pickle"):
        costmodel.load_alpa_pickle(path)
    assert ModuleProfileResult.__add__ is tuple.__add__


def _object_array_pickle(old: bytes = b"", new: bytes = b"") -> bytes:
    """numpy's own pickle of an object array [1, 2, 3], with one patch applied."""
    data = pickle.dumps(np.array([1, 2, 3], dtype=object), protocol=3)
    assert data.count(old) == 1 or not old
    return data.replace(old, new)


def test_object_array_pickles_are_checked_before_numpy_sees_them(tmp_path):
    path = tmp_path / "array.pkl"
    path.write_bytes(_object_array_pickle())
    np.testing.assert_array_equal(costmodel.load_alpa_pickle(path), [1, 2, 3])
    # Shape (5,) with 3 items: numpy's own unpickler reads past the list and
    # crashes the interpreter, so run it in a child process.
    path.write_bytes(_object_array_pickle(b"K\x03\x85", b"K\x05\x85"))
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nimport pipedejavu\nfrom pipedejavu import costmodel\n"
            "try:\n    costmodel.load_alpa_pickle(sys.argv[1])\n"
            "except pipedejavu.ProblemError as e:\n    print('refused:', e)\n",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert "refused:" in child.stdout and "does not match shape (5,)" in child.stdout
    # A dtype state that clears the object flags (63 -> 0) is refused too.
    path.write_bytes(_object_array_pickle(b"K?t", b"K\x00t"))
    with pytest.raises(ProblemError, match="unexpected state"):
        costmodel.load_alpa_pickle(path)


def test_numpy_names_are_not_general_constructors(tmp_path):
    path = tmp_path / "direct.pkl"
    # numpy.ndarray((2**40,)) called directly by REDUCE: not callable here.
    path.write_bytes(
        b"\x80\x03cnumpy\nndarray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85\x85R."
    )
    with pytest.raises(ProblemError, match="not a readable Alpa pickle"):
        costmodel.load_alpa_pickle(path)


def test_out_of_order_memo_index_is_refused_before_unpickling(tmp_path):
    # LONG_BINPUT 2**31 - 1 would make the C unpickler size its memo to 2**32.
    path = tmp_path / "memo.pkl"
    path.write_bytes(b"\x80\x03]r\xff\xff\xff\x7f.")
    with pytest.raises(ProblemError, match="memo index 2147483647 out of order"):
        costmodel.load_alpa_pickle(path)


def test_truncated_pickle(tmp_path, data_dir):
    data = (data_dir / "prof_database.pkl").read_bytes()
    path = tmp_path / "half.pkl"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProblemError, match=r"half\.pkl is not a readable Alpa pickle"):
        costmodel.read_prof_database(path)


def test_truncated_npy(tmp_path, data_dir):
    data = (data_dir / PROFILES["16-59-36"]).read_bytes()
    path = tmp_path / "half.npy"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProblemError, match=r"half\.npy is not a readable Alpa pickle"):
        costmodel.read_stage_profile(path)


@pytest.mark.parametrize("reader", ["read_prof_database", "read_stage_profile"])
def test_empty_missing_and_text_files(tmp_path, reader):
    read = getattr(costmodel, reader)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ProblemError, match=r"empty\.bin is empty"):
        read(empty)
    with pytest.raises(ProblemError, match=r"cannot read .*missing\.bin"):
        read(tmp_path / "missing.bin")
    text = tmp_path / "notes.txt"
    text.write_text("hello: this is text, not a pickle\n")
    with pytest.raises(ProblemError, match=r"notes\.txt is not a"):
        read(text)


def test_numeric_npy_is_not_a_stage_profile(tmp_path):
    path = tmp_path / "numbers.npy"
    np.save(path, np.arange(6.0).reshape(2, 3))
    with pytest.raises(ProblemError, match=r"float64 array of shape \(2, 3\), not an"):
        costmodel.read_stage_profile(path)


def test_npy_holding_something_else_is_refused(tmp_path):
    path = tmp_path / "list.npy"
    np.save(path, np.array(None, dtype=object), allow_pickle=True)
    with pytest.raises(ProblemError, match="must be a dict of stage-profile records"):
        costmodel.read_stage_profile(path)
    path.write_bytes(_npy_bytes([1, 2], protocol=3))
    with pytest.raises(ProblemError, match="payload is a list"):
        costmodel.read_stage_profile(path)


_FUZZ = fixture_fuzz(40)


@_FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_never_escape_as_other_errors(tmp_path, data):
    path = tmp_path / "random.bin"
    path.write_bytes(data)
    for read in (costmodel.read_prof_database, costmodel.read_stage_profile):
        try:
            read(path)
        except ProblemError:
            pass


@_FUZZ
@given(cut=st.integers(0, 20_000), flips=st.lists(st.integers(0, 20_000), max_size=4))
def test_corrupted_real_files_never_escape_as_other_errors(
    tmp_path, data_dir, cut, flips
):
    for name, read in (
        ("prof_database.pkl", costmodel.read_prof_database),
        (PROFILES["16-59-36"], costmodel.read_stage_profile),
    ):
        data = bytearray((data_dir / name).read_bytes())
        for position in flips:
            data[position] ^= 0x5A
        path = tmp_path / name
        path.write_bytes(bytes(data[: len(data) - cut]))
        try:
            result = read(path)
            if read is costmodel.read_stage_profile:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    costmodel.stage_profile_tables(result)
        except ProblemError:
            pass


# --- tables on hand-built records ------------------------------------------------


def _module(cost, temp, inputs, outputs, donated=None, acc_in=(), acc_out=()):
    return ModuleProfileResult(
        compute_cost=cost,
        peak_memory=0,
        temp_buffer_size=temp,
        invar_names=tuple(name for name, _ in inputs),
        outvar_names=tuple(name for name, _ in outputs),
        invar_sizes=tuple(size for _, size in inputs),
        outvar_sizes=tuple(size for _, size in outputs),
        donated_invars=tuple(donated or [False] * len(inputs)),
        acc_grad_invars_indices=tuple(acc_in),
        acc_grad_outvars_indices=tuple(acc_out),
        available_memory=1000,
    )


def _single_stage(donate: bool = True) -> StageProfileResult:
    """Forward: w, x -> act, y. Backward: gacc (accumulator, donated), w, act, y
    -> gacc_new (accumulated), dx. Sizes in bytes; 1000 available, 50 initial."""
    forward = _module(0.25, 7, [("w", 100), ("x", 10)], [("act", 30), ("y", 5)])
    backward = _module(
        0.5,
        20,
        [("gacc", 100), ("w", 100), ("act", 30), ("y", 5)],
        [("gacc_new", 100), ("dx", 10)],
        donated=[donate, False, False, False],
        acc_in=(0,),
        acc_out=(0,),
    )
    return StageProfileResult(2, [forward, backward], 1000, ("w_opt",), (50,))


def test_memory_stats_single_stage_by_hand():
    # Forward: live {w, x} + {act, y} = 145, + temp 7 -> peak 152; then x is dead,
    # leaving the stash {w, act, y} = 135. Backward: + gacc = 235; gacc_new takes
    # gacc's buffer (donated), + dx = 245, + temp 20 -> peak 265.
    # (1000 - 265 - 50) // 135 - 1 = 5 - 1 = 4.
    assert costmodel.stage_memory_stats([_single_stage()]) == (1000, 265, 50, 135, 4)
    # Without the donation gacc and gacc_new coexist: peak 365, (585 // 135) - 1.
    assert costmodel.stage_memory_stats([_single_stage(donate=False)]) == (
        1000,
        365,
        50,
        135,
        3,
    )


def _two_stages(accumulate_g1: bool = True) -> list[StageProfileResult]:
    f0 = _module(0.1, 5, [("x", 10), ("w0", 100)], [("h", 20), ("a0", 30)])
    b0 = _module(
        0.2,
        10,
        [("g0", 50), ("w0", 100), ("a0", 30), ("dh", 20)],
        [("g0n", 50), ("dx", 10)],
        donated=[True, False, False, False],
        acc_in=(0,),
        acc_out=(0,),
    )
    f1 = _module(0.1, 5, [("h", 20), ("w1", 100)], [("a1", 40), ("loss", 1)])
    b1 = _module(
        0.2,
        10,
        [("g1", 60), ("w1", 100), ("a1", 40), ("h", 20)],
        [("g1n", 60), ("dh", 20)],
        donated=[True, False, False, False],
        acc_in=(0,),
        acc_out=(0,) if accumulate_g1 else (),
    )
    return [
        StageProfileResult(2, [f0, b0], 1000, ("o0",), (7,)),
        StageProfileResult(2, [f1, b1], 900, ("o0", "o1"), (7, 11)),
    ]


def test_memory_stats_two_stages_by_hand():
    # Order F0, F1, B1, B0. Forward peak: {x, w0, w1, h, a0, a1, loss} = 301 + 5;
    # stash after the forward pass {w0, w1, h, a0, a1} = 290. Backward adds g0, g1
    # (400); B1: g1n replaces g1, + dh = 420, + 10; B0: g0n replaces g0, + dx =
    # 430, + 10 -> peak 440 (the accumulated g1n stays live). Initial o0 counted
    # once: 7 + 11 = 18; available min(1000, 900). (900 - 440 - 18) // 290 - 1 = 0.
    assert costmodel.stage_memory_stats(_two_stages()) == (900, 440, 18, 290, 0)
    # If g1n were not an accumulator it would be freed after B1: peak 430.
    assert costmodel.stage_memory_stats(_two_stages(False)).peak_memory == 430


def test_memory_stats_stash_and_unlimited():
    forward = _module(0.1, 0, [("w", 8)], [("loss", 1)])
    backward = _module(0.1, 0, [("w", 8)], [("g", 8)], acc_out=(0,))
    record = StageProfileResult(2, [forward, backward], 100, (), ())
    stats = costmodel.stage_memory_stats([record])
    assert stats.intermediate_size == 8  # w is still read by the backward pass
    assert stats.max_n_succ_stages == (100 - 16) // 8 - 1
    lone = _module(0.1, 0, [], [("a", 4)])
    empty = StageProfileResult(2, [lone, _module(0.1, 0, [], [])], 100, (), ())
    assert costmodel.stage_memory_stats([empty]).max_n_succ_stages == (
        UNLIMITED_SUCCEEDING_STAGES
    )


def test_tables_by_hand_with_an_incomplete_record():
    complete = _single_stage()
    half = StageProfileResult(2, [complete.module_profile_results[0], None], 1000)
    records = {(0, 1, 0, 1): complete, (1, 1, 1, 0): half, (0, 0, 0, 0): half}
    with pytest.warns(UserWarning) as caught:
        cost, limit = costmodel.stage_profile_tables(records)
    assert [str(w.message) for w in caught] == [
        "2 of 3 stage-profile records are incomplete (a module was not profiled); "
        "they count as unprofiled (inf)"
    ]
    assert cost.shape == (2, 2, 2, 2)
    assert cost[0, 1, 0, 1] == 0.75 and limit[0, 1, 0, 1] == 4
    assert int(np.isfinite(cost).sum()) == 1
    assert int((limit != -1).sum()) == 1
    cost, limit = costmodel.stage_profile_tables(
        {(0, 1, 0, 1): complete}, num_layers=3, num_submeshes=3, num_configs=2
    )
    assert cost.shape == (3, 3, 3, 2) and limit[0, 1, 0, 1] == 4


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"num_layers": 1}, "num_layers must be an integer >= 2"),
        ({"num_submeshes": 0}, "num_submeshes must be an integer >= 1"),
        ({"num_configs": 1}, "num_configs must be an integer >= 2"),
    ],
)
def test_tables_reject_sizes_below_the_keys(sizes, message):
    with pytest.raises(ProblemError, match=message):
        costmodel.stage_profile_tables({(0, 1, 0, 1): _single_stage()}, **sizes)


@pytest.mark.parametrize(
    "key", [(0, 1, 0), (1, 0, 0, 0), (0, 1, -1, 0), (0, 1.0, 0, 0), (True, 1, 0, 0)]
)
def test_tables_reject_bad_keys(key):
    with pytest.raises(ProblemError, match="stage-profile key"):
        costmodel.stage_profile_tables({key: _single_stage()})


def test_tables_reject_inconsistent_records():
    record = _single_stage()
    forward, backward = record.module_profile_results
    broken = StageProfileResult(
        2, [forward, backward._replace(acc_grad_outvars_indices=(5,))], 1000
    )
    with pytest.raises(ProblemError, match=r"\(0, 0, 0, 0\).*not in \[0, 2\)"):
        costmodel.stage_profile_tables({(0, 0, 0, 0): broken})
    nan_cost = StageProfileResult(2, [forward._replace(compute_cost=np.nan), backward])
    with pytest.raises(ProblemError, match="compute_cost must be finite"):
        costmodel.stage_profile_tables({(0, 0, 0, 0): nan_cost})
    with pytest.raises(ProblemError, match="is empty"):
        costmodel.stage_profile_tables({})
