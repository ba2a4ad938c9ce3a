"""Start-up: a command imports only what it runs (no JAX for the exact DP, no
SciPy optimizers for a command that fits nothing), the top-level parser lists
every command without importing them, and a command that runs JAX still gets
the persistent compilation cache. Times are measured by
``benchmarks/startup.py``, not here."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from pipedejavu.cli.data import data_path
from pipedejavu.cli.main import COMMAND_GROUPS, COMMANDS, _build_parser, _parser
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine.compile_cache import ENV_VAR, JAX_ENV_VARS

#: Runs the command line in a fresh process, then reports its exit code and
#: which heavy packages the run imported.
_RUN = """
import json, os, sys
from pipedejavu.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:  # --help
    code = stop.code
watched = ("numpy", "jax", "scipy.optimize", "matplotlib", "flax")
report = {"code": code, "loaded": [m for m in watched if m in sys.modules]}
if "jax" in sys.modules:
    import jax
    report["cache_dir"] = jax.config.jax_compilation_cache_dir
    report["min_time"] = jax.config.jax_persistent_cache_min_compile_time_secs
report["env"] = [os.environ.get(name) for name in JAX_VARS]
print(json.dumps(report), file=sys.stderr)
sys.exit(0)
"""


def _run(*argv: str, env: dict[str, str] | None = None) -> dict:
    child = subprocess.run(
        [sys.executable, "-c", _RUN.replace("JAX_VARS", repr(JAX_ENV_VARS)), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert child.returncode == 0, child.stderr
    return json.loads(child.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["solve", "gpt1.3b-6layers-B128"],  # a real Alpa profile, exact DP
        ["solve", "generated-gpt-32layers-2x8", "--json"],
        ["inspect", "generated-gpt-32layers-4x8"],
        ["compare", "generated-gpt-32layers-2x8", "--methods", "dp,greedy"],
    ],
)
def test_the_exact_dp_imports_neither_jax_nor_scipys_optimizers(argv):
    report = _run(*argv)
    assert report["code"] == 0
    assert report["loaded"] == ["numpy"]


@pytest.mark.parametrize(
    "argv", [["--help"], ["--version"], ["solve", "--help"], ["plan", "--help"]]
)
def test_help_imports_no_numpy_when_it_lists_commands(argv):
    report = _run(*argv)
    assert report["code"] == 0
    if argv[0].startswith("-"):  # the top level: names and one-line helps
        assert report["loaded"] == []
    else:  # a command's own arguments: its module, never JAX
        assert "jax" not in report["loaded"]


def test_plan_and_predict_fit_nothing_and_load_no_scipy_optimizer():
    plan = _run(
        "plan", "--model", "OPT-350", "--gpus", "H100:8", "--global-batch", "64"
    )
    assert plan["code"] == 0
    assert "scipy.optimize" not in plan["loaded"] and "jax" not in plan["loaded"]
    sailor = data_path("sailor/measured/gh200-opt350/plan_config_N16_D4.json")
    predict = _run("predict", str(sailor), "--model", "OPT-350")
    assert predict["code"] == 0
    assert "scipy.optimize" not in predict["loaded"] and "jax" not in predict["loaded"]


def test_the_top_level_lists_every_command_as_its_module_does():
    """COMMANDS' one-line helps are those the modules register: the parser of
    any one command's module (and of none) prints what the full one prints."""
    full = _build_parser()
    assert full.format_help() == _parser(()).format_help()
    for module in sorted({module for module, _ in COMMANDS.values()}):
        assert _parser({module}).format_help() == full.format_help(), module
    (commands,) = [
        a for a in full._actions if isinstance(a, argparse._SubParsersAction)
    ]
    assert list(commands.choices) == list(COMMANDS)


def test_the_top_level_help_groups_every_command_once():
    """``pipedejavu --help`` lists each command once, under its group, the
    groups in order, training plans first."""
    grouped = [name for _, names in COMMAND_GROUPS for name in names]
    assert sorted(grouped) == sorted(COMMANDS) and len(set(grouped)) == len(grouped)
    text = _parser(()).format_help()
    titles = [text.index(f"\n{title}:\n") for title, _ in COMMAND_GROUPS]
    assert titles == sorted(titles) and COMMAND_GROUPS[0][1][0] == "plan"
    for (title, names), start, end in zip(
        COMMAND_GROUPS, titles, [*titles[1:], len(text)], strict=True
    ):
        listed = re.findall(r"^  ([a-z][a-z-]*)  ", text[start:end], re.M)
        assert listed == list(names), title
    assert "Alpa's formulation; typed devices" not in text  # the old description


def test_a_command_running_jax_switches_the_cache_on(tmp_path):
    path = tmp_path / "gen.npz"
    random_problem(8, (1, 2), num_microbatches=4, seed=0).to_npz(path)
    folder = tmp_path / "cache"
    env = {**os.environ, ENV_VAR: str(folder), "JAX_PLATFORMS": "cpu"}
    for name in JAX_ENV_VARS:
        env.pop(name, None)
    argv = [str(path), "--method", "diff", "--restarts", "2", "--steps", "4"]
    report = _run("solve", *argv, env=env)
    assert report["code"] == 0 and "jax" in report["loaded"]
    assert report["cache_dir"] == str(folder) and report["min_time"] == 0.0
    assert any(folder.iterdir())  # the engine's functions were written
    assert report["env"] == [None, None]  # put back after the command
    # A cache the user configured wins; off stays off.
    theirs = tmp_path / "theirs"
    report = _run("solve", *argv, env={**env, JAX_ENV_VARS[0]: str(theirs)})
    assert report["cache_dir"] == str(theirs) and report["min_time"] == 1.0
    report = _run("solve", *argv, env={**env, ENV_VAR: "off"})
    assert report["cache_dir"] is None and report["code"] == 0
