"""The command line as a user meets it: outputs, JSON, exit codes, messages."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import numpy.lib.format as npy_format
import pytest
from helpers import forbid_call, run_cli, run_python

from pipedejavu import Plan, Problem, ProblemError, evaluate
from pipedejavu.cli.main import main
from pipedejavu.planning.inputs import bundled_examples

EXAMPLES = {example.name: example for example in bundled_examples()}
B128 = EXAMPLES["gpt1.3b-6layers-B128"]
B32_INFEASIBLE = EXAMPLES["gpt1.3b-6layers-B32"]


def _solve_args(example):
    return ["--cluster", "1x4", "--num-microbatches", example.num_microbatches]


def test_solve_json_is_exactly_the_plan(capsys):
    code, out, err = run_cli(capsys, "solve", B128.path, *_solve_args(B128), "--json")
    assert code == 0
    data = json.loads(out)  # nothing but the JSON on stdout
    assert set(data) == {
        "method",
        "cost",
        "num_microbatches",
        "stages",
        "search_time_s",
    }
    assert set(data["stages"][0]) == {
        "start",
        "stop",
        "submesh",
        "submesh_index",
        "config_index",
        "latency",
    }
    with pytest.warns(UserWarning, match="66 of 77 stage-profile records"):
        problem = B128.load()
    assert data["cost"] == evaluate(problem, Plan.from_json(data))
    assert data["stages"][0]["submesh"] == [1, 4]


def test_solve_table(capsys):
    code, out, _ = run_cli(capsys, "solve", B128.path, *_solve_args(B128))
    assert code == 0
    assert "stage" in out and "latency" in out and "31.198233" in out


def test_incomplete_records_warn_once_on_stderr(capsys):
    code, _, err = run_cli(capsys, "solve", B128.path, *_solve_args(B128), "--json")
    assert code == 0
    assert err.count("warning:") == 1
    assert "66 of 77" in err


def test_infeasible_profile_exits_3_with_reason(capsys):
    code, out, err = run_cli(
        capsys, "solve", B32_INFEASIBLE.path, *_solve_args(B32_INFEASIBLE)
    )
    assert code == 3
    assert out == ""
    assert "no feasible plan" in err and "memory" in err


def test_alpa_compatible_flag(capsys):
    code, out, _ = run_cli(
        capsys, "solve", B128.path, *_solve_args(B128), "--alpa-compatible", "--json"
    )
    assert code == 0
    assert json.loads(out)["method"] == "dp-alpa"


def test_convert_then_solve_gives_the_same_plan(capsys, tmp_path):
    target = tmp_path / "gpt.npz"
    code, out, _ = run_cli(capsys, "convert", B128.path, target, *_solve_args(B128))
    assert code == 0 and target.exists()
    _, direct, _ = run_cli(capsys, "solve", B128.path, *_solve_args(B128), "--json")
    code, converted, _ = run_cli(capsys, "solve", target, "--json")
    assert code == 0
    first, second = json.loads(direct), json.loads(converted)
    assert first["stages"] == second["stages"] and first["cost"] == second["cost"]


def test_inspect(capsys):
    code, out, _ = run_cli(
        capsys, "inspect", B32_INFEASIBLE.path, *_solve_args(B32_INFEASIBLE)
    )
    assert code == 0
    assert "finite (profiled): 17" in out
    assert "memory-feasible:   0" in out
    assert "feasible plan: no" in out


def test_alpa_profile_needs_the_run_settings(capsys):
    code, out, err = run_cli(capsys, "solve", B128.path)
    assert code == 2 and out == ""
    assert "--cluster" in err and "--num-microbatches" in err
    assert "Traceback" not in err


def _write_problem(path, **changes):
    cost = np.array([[[[1.0]], [[2.0]]], [[[np.inf]], [[1.5]]]])  # L=2, M=1, K=1
    arrays = dict(
        compute_cost=cost,
        max_n_succ_stages=np.full(cost.shape, 10),
        submesh_shapes=np.array([[1, 1]]),
        cluster_shape=np.array([1, 2]),
        num_microbatches=np.array(4),
    )
    arrays.update(changes)
    np.savez(path, **arrays)
    return path


def test_npz_problem_solves(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys, "solve", _write_problem(tmp_path / "p.npz"), "--json"
    )
    assert code == 0
    assert json.loads(out)["cost"] == pytest.approx(2.5 + 3 * 1.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compute_cost": np.full((2, 2, 1, 1), np.nan)}, "NaN"),
        ({"compute_cost": np.ones((2, 3, 1, 1))}, "shape"),
        ({"max_n_succ_stages": np.ones((3, 3, 1, 1))}, "max_n_succ_stages"),
        ({"num_microbatches": np.array(0)}, "num_microbatches must be >= 1"),
        (
            {"submesh_shapes": np.array([[1, 2]]), "cluster_shape": np.array([1, 3])},
            "no combination of the submesh sizes",
        ),
        ({"submesh_shapes": np.array([[2, 1]])}, "does not fit"),
    ],
)
def test_bad_problems_exit_2_naming_the_problem(capsys, tmp_path, changes, message):
    path = _write_problem(tmp_path / "bad.npz", **changes)
    code, out, err = run_cli(capsys, "solve", path)
    assert code == 2 and out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_microbatches_flag(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "solve", _write_problem(tmp_path / "p.npz"), "-B", "0"
    )
    assert code == 2 and "--num-microbatches must be >= 1" in err
    assert len(err.strip().splitlines()) == 1


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _npy_with_payload(payload: bytes) -> bytes:
    header = io.BytesIO()
    npy_format.write_array_header_1_0(
        header, {"descr": "|O", "fortran_order": False, "shape": ()}
    )
    return b"\x93NUMPY\x01\x00" + header.getvalue()[8:] + payload


@pytest.mark.parametrize("wrap", ["npy", "pkl"])
def test_code_running_pickle_is_refused(capsys, tmp_path, wrap):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({(0, 0, 0, 0): _Exploit(marker)}, protocol=4)
    path = tmp_path / f"evil.{wrap}"
    path.write_bytes(_npy_with_payload(payload) if wrap == "npy" else payload)
    code, out, err = run_cli(capsys, "solve", path, "--cluster", "1x4", "-B", "8")
    assert code == 2 and out == ""
    assert not marker.exists()
    if wrap == "npy":
        assert "system" in err  # names the refused global
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content",
    [b"", b"hello, I am text\n", b"\x80\x04\x95", None],
    ids=["empty", "text", "truncated-pickle", "truncated-npy"],
)
def test_garbage_files_exit_2(capsys, tmp_path, content):
    if content is None:
        content = B128.path.read_bytes()[:4000]
    path = tmp_path / "garbage.npy"
    path.write_bytes(content)
    code, out, err = run_cli(capsys, "solve", path, "--cluster", "1x4", "-B", "8")
    assert code == 2 and out == ""
    assert str(path) in err or "garbage" in err
    assert len(err.strip().splitlines()) == 1


def test_missing_file_and_bad_cluster(capsys, tmp_path):
    code, _, err = run_cli(capsys, "solve", tmp_path / "nope.npz")
    assert code == 2 and "nope.npz" in err
    code, _, err = run_cli(capsys, "solve", B128.path, "--cluster", "4", "-B", "8")
    assert code == 2 and "HOSTSxDEVICES_PER_HOST" in err


def test_unknown_method(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "solve", _write_problem(tmp_path / "p.npz"), "--method", "magic"
    )
    assert code == 2 and "unknown method" in err


def test_console_script_runs_the_demo():
    result = run_python("-m", "pipedejavu.cli.main", "demo", timeout=600)
    assert result.stdout.count("== ") == 5
    assert "Alpa's way" in result.stdout  # the heterogeneous example
    assert "no feasible plan" in result.stdout  # the 6-layer B=32 profile
    assert "same plan" in result.stdout
    assert "Traceback" not in result.stderr


def test_problem_file_round_trip(tmp_path):
    problem = Problem.from_npz(_write_problem(tmp_path / "p.npz"))
    problem.to_npz(tmp_path / "q.npz")
    again = Problem.from_npz(tmp_path / "q.npz")
    np.testing.assert_array_equal(again.compute_cost, problem.compute_cost)
    np.testing.assert_array_equal(again.max_n_succ_stages, problem.max_n_succ_stages)
    assert again.cluster_shape == problem.cluster_shape
    assert again.num_microbatches == problem.num_microbatches


def test_brute_force_refuses_big_problems(capsys, tmp_path):
    from pipedejavu.costmodel.stage.generate import random_problem

    path = tmp_path / "big.npz"
    random_problem(24, (2, 8), seed=1).to_npz(path)
    code, _, err = run_cli(capsys, "solve", path, "--method", "brute_force")
    assert code == 2 and "too large for brute force" in err


def test_diff_method_from_the_command_line(capsys, tmp_path):
    from pipedejavu.costmodel.stage.generate import random_problem

    path = tmp_path / "gen.npz"
    problem = random_problem(12, (1, 4), num_microbatches=8, seed=3)
    problem.to_npz(path)
    code, out, _ = run_cli(
        capsys, "solve", path, "--method", "diff", "--restarts", "8", "--steps", "40"
    )
    assert code == 0 and "lower bound" in out
    code, out, _ = run_cli(
        capsys,
        "solve",
        path,
        "--method",
        "diff",
        "--steps",
        "40",
        "--restarts",
        "8",
        "--json",
    )
    data = json.loads(out)
    assert data["method"] == "diff"
    assert data["cost"] == evaluate(problem, Plan.from_json(data))
    assert 0 < data["lower_bound"] <= data["cost"]  # the certificate is kept
    assert data["gap"] == pytest.approx(data["cost"] / data["lower_bound"] - 1)
    code, _, err = run_cli(capsys, "solve", path, "--restarts", "8")
    assert code == 2 and "--method diff" in err
    code, _, err = run_cli(capsys, "solve", path, "--method", "diff", "--steps", "0")
    assert code == 2 and "--steps must be >= 1" in err


# --- issue 10: what a new user hit ------------------------------------------------
def _cluster_file(tmp_path, hosts=("a100", "v100"), memory=True):
    types = {"a100": {"speed": 1.0}, "v100": {"speed": 0.5}}
    if memory:
        types["a100"]["memory_gb"], types["v100"]["memory_gb"] = 40, 16
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "devices_per_host": 8,
                "device_types": types,
                "hosts": list(hosts),
                "intra_host": {"default": {"latency_us": 5, "bandwidth_gbps": 2400}},
                "inter_host": {"default": {"latency_us": 20, "bandwidth_gbps": 25}},
            }
        )
    )
    return path


def _generated_npz(tmp_path, layers=8):
    from pipedejavu.costmodel.stage.generate import random_problem

    return random_problem(layers, (2, 8), num_microbatches=8, seed=0).to_npz(
        tmp_path / "gen.npz"
    )


def test_heterogeneous_convert_and_inspect(capsys, tmp_path):
    gen, cluster = _generated_npz(tmp_path), _cluster_file(tmp_path, memory=False)
    code, out, err = run_cli(
        capsys, "convert", gen, tmp_path / "het", "--cluster-file", cluster
    )
    assert code == 0, err
    assert f"wrote {tmp_path / 'het.npz'}:" in out  # the file numpy wrote
    assert "1x8 a100 (speed 1) + 1x8 v100 (speed 0.5)" in out
    for argv in (["het.npz"], ["gen.npz", "--cluster-file", str(cluster)]):
        code, out, err = run_cli(capsys, "inspect", tmp_path / argv[0], *argv[1:])
        assert code == 0, err
        assert "device types T = 2" in out and "type v100 (1 hosts, speed 0.5" in out
        assert "link between hosts a100-v100: latency 20 us, bandwidth 25 Gb/s" in out
    code, out, err = run_cli(capsys, "solve", tmp_path / "het.npz", "--method", "alpa")
    assert code == 0 and "inter-host hop" in out


def test_convert_names_the_file_it_wrote(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys, "convert", "generated-gpt-32layers-2x8", tmp_path / "out"
    )
    assert code == 0 and (tmp_path / "out.npz").exists()
    assert out.startswith(f"wrote {tmp_path / 'out.npz'}:")
    code, _, err = run_cli(
        capsys, "convert", "generated-gpt-32layers-2x8", tmp_path / "no" / "out.npz"
    )
    assert code == 2 and "no folder" in err


def test_options_that_cannot_apply_are_refused(capsys, tmp_path):
    gen, cluster = _generated_npz(tmp_path), _cluster_file(tmp_path, memory=False)
    for argv, message in (
        (
            ["solve", gen, "--cluster-file", cluster, "--alpa-compatible"],
            "with typed devices use --method alpa",
        ),
        (
            ["solve", "gpt1.3b-6layers-B128", "--cluster", "2x8"],
            "fixed to a 1x4 cluster",
        ),
        (["solve", gen, "--cluster", "1x4"], "a problem for a 2x8 cluster"),
        (["solve", gen, "--submesh-space", "all"], "--submesh-space"),
        (
            ["solve", "generated-gpt-32layers-2x8", "--submesh-space", "all"],
            "--submesh-space does not apply",
        ),
        (["solve", gen, "-B", "99999999999999999999"], "<= 2147483647"),
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "", argv
        assert message in err, (argv, err)
        lines = [x for x in err.splitlines() if not x.startswith("warning")]
        assert len(lines) == 1, err
    with pytest.raises(ProblemError, match="for a HeteroProblem use method 'alpa'"):
        from pipedejavu import load_problem, solve

        typed = load_problem(gen, cluster=cluster)
        solve(typed, "dp", alpa_compatible=True)


def test_costmodel_predict_refuses_a_heterogeneous_file_clearly(capsys, tmp_path):
    gen, cluster = _generated_npz(tmp_path), _cluster_file(tmp_path, memory=False)
    run_cli(capsys, "convert", gen, tmp_path / "het.npz", "--cluster-file", cluster)
    code, _, err = run_cli(capsys, "costmodel", "predict", tmp_path / "het.npz")
    assert code == 2 and "het.npz is a heterogeneous problem" in err
    assert "compute_cost must have shape" not in err


def test_version_and_help_show_defaults(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    out, _ = capsys.readouterr()
    assert stop.value.code == 0 and out.strip() == "pipedejavu 0.1.0"
    for argv, expected in (
        (["solve", "--help"], ["(default: dp)", "(default: 0)"]),
        (["compare", "--help"], ["(default: 3)", "(default: 1)"]),
        (
            ["profile", "--help"],
            ["micro-batches B stored in the problem", "(default: 8)"],
        ),
        (["costmodel", "report", "--help"], ["(default: 5)"]),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        flat = " ".join(capsys.readouterr()[0].split())
        for text in expected:
            assert text in flat, (argv, text)


def test_profile_checks_the_output_path_before_profiling(capsys, tmp_path, monkeypatch):
    from pipedejavu.costmodel.profiling import layer_problem

    forbid_call(
        monkeypatch,
        layer_problem,
        "profile_to_problem",
        "profiled before checking --out",
    )
    code, _, err = run_cli(
        capsys, "profile", "--model", "gpt-micro", "--out", tmp_path / "no" / "x.npz"
    )
    assert code == 2 and "no folder" in err


def test_solve_takes_a_path(tmp_path):
    from pipedejavu import solve

    gen = _generated_npz(tmp_path)
    assert solve(gen).cost == solve(Problem.from_npz(gen)).cost
    assert solve("generated-gpt-32layers-2x8").method == "dp"
    with pytest.raises(ProblemError, match="must be a Problem"):
        solve(42)


def _every_parser(parser=None, path=()):
    """``(argv prefix, parser)`` of every command and sub-command."""
    import argparse

    from pipedejavu.cli.main import _build_parser

    parser = parser or _build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_parser(sub, (*path, name))


def test_every_commands_help_shows_every_default(capsys):
    """init-search, plan, goodput optimize... too, not only main.py's own."""
    import argparse

    checked = 0
    for path, parser in _every_parser():
        with pytest.raises(SystemExit) as stop:
            main([*path, "--help"])
        assert stop.value.code == 0
        flat = " ".join(capsys.readouterr()[0].split())
        for action in parser._actions:
            default = action.default
            if (
                not action.option_strings
                or action.help == argparse.SUPPRESS
                or any(default is x for x in (None, False, argparse.SUPPRESS))
            ):
                continue
            shown = f"(default: {default})"
            assert shown in flat or (
                "%(default)" in (action.help or "") and str(default) in flat
            ), (path, action.option_strings, shown)
            checked += 1
    assert checked >= 30


def test_a_closed_stdout_pipe_stops_quietly_with_141():
    """``pipedejavu ... | head``: no "Broken pipe" error, no traceback."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pipedejavu.cli.main import main; sys.exit(main())",
            "inspect",
            "gpt1.3b-6layers-B128",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PIPEDEJAVU_CACHE_DIR": "off"},
    )
    process.stdout.close()  # the reader goes away before anything is written
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err
    assert "Exception ignored" not in err


def test_data_lists_bundled_files_and_prints_the_path_of_one(capsys):
    code, out, _ = run_cli(capsys, "data")
    names = out.split()
    assert code == 0
    for name in (
        "cluster-a100-v100-4x8.json",
        "prof_database.pkl",
        "sailor/measured/gh200-opt350/plan_config_N16_D4.json",
        "sailor/profiles/OPT-350/GH-96/profile.json",
    ):
        assert name in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".py")]
    code, out, _ = run_cli(capsys, "data", "sailor/profiles/OPT-350/GH-96/profile.json")
    path = out.strip()
    assert code == 0 and os.path.isfile(path) and out.count("\n") == 1
    assert path.endswith(
        os.path.join("data", "sailor", "profiles", "OPT-350", "GH-96", "profile.json")
    )


@pytest.mark.parametrize("name", ["nothing.json", "../core/cluster.py", "sailor", ""])
def test_data_refuses_an_unknown_name_in_one_line(capsys, name):
    code, out, err = run_cli(capsys, "data", name)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "`pipedejavu data` lists" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["solve", "gpt1.3b-6layers-B128", "--method", "diff", "--steps", "1000000"],
        ["solve", "gpt1.3b-6layers-B128", "--method", "diff", "--restarts", "10000"],
        ["compare", "gpt1.3b-6layers-B128", "--repeats", "1000000000000"],
        ["compare", "gpt1.3b-6layers-B128", "--warmup", "1000000000000"],
        ["costmodel", "predict", "gpt1.3b-6layers-B128", "--seeds", "10000"],
        ["costmodel", "predict", "gpt1.3b-6layers-B128", "--fraction", "nan"],
        ["costmodel", "predict", "gpt1.3b-6layers-B128", "--fraction", "-0.5"],
        ["costmodel", "predict", "gpt1.3b-6layers-B128", "--fraction", "inf"],
        ["costmodel", "report", "bundled", "--folds", "1000000000000"],
        ["profile", "--out", "x.npz", "--repeats", "1000000000000"],
        ["profile", "--out", "x.npz", "--warmup", "1000000000000"],
    ],
    ids=lambda argv: " ".join(argv[-2:]),
)
def test_counts_with_no_sane_use_are_refused_before_any_work(capsys, argv):
    """A huge count ran for hours (or, for --fraction, failed deep inside)."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert argv[-2] in err and "must be" in err
