"""JAX's persistent compilation cache: switched on by the CLI and by
``pipedejavu.enable_compilation_cache``, never by library calls; compiled
functions are reused across processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import python_last_line

from pipedejavu.search.engine.compile_cache import ENV_VAR, cache_folder


def test_folder_from_argument_environment_and_default(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cache_folder() == tmp_path / "xdg" / "pipedejavu" / "jax"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert cache_folder() == tmp_path / "env"
    assert cache_folder(tmp_path / "arg") == tmp_path / "arg"
    for off in ("off", "0", "", "false"):
        monkeypatch.setenv(ENV_VAR, off)
        assert cache_folder() is None


def _python(code: str, folder: Path | str | None, **env_extra: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if folder is not None:
        env[ENV_VAR] = str(folder)
    return python_last_line(code, env)


_CONFIG = """
import json, jax, pipedejavu
from pipedejavu.costmodel.stage.generate import random_problem
{setup}
before = jax.config.jax_compilation_cache_dir
returned = {call}
print(json.dumps([before, str(returned) if returned else None,
                  jax.config.jax_compilation_cache_dir,
                  jax.config.jax_persistent_cache_min_compile_time_secs]))
"""


def test_the_public_function_sets_the_folder_and_keeps_a_users(tmp_path):
    ours = str(tmp_path / "ours")
    before, returned, after, _ = json.loads(
        _python(
            _CONFIG.format(setup="", call="pipedejavu.enable_compilation_cache()"),
            ours,
        )
    )
    assert (before, returned, after) == (None, ours, ours)
    theirs = str(tmp_path / "theirs")
    setup = (
        f"jax.config.update('jax_compilation_cache_dir', {theirs!r})\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 7.0)"
    )
    values = json.loads(
        _python(
            _CONFIG.format(setup=setup, call="pipedejavu.enable_compilation_cache()"),
            ours,
        )
    )
    assert values == [theirs, theirs, theirs, 7.0]  # untouched
    off = json.loads(
        _python(
            _CONFIG.format(setup="", call="pipedejavu.enable_compilation_cache()"),
            "off",
        )
    )
    assert off[:3] == [None, None, None]


def test_solve_never_changes_the_global_configuration(tmp_path):
    call = (
        "pipedejavu.solve(random_problem(8, (1, 2), seed=0), method='diff', "
        "num_restarts=2, num_steps=4)"
    )
    before, _, after, _ = json.loads(
        _python(_CONFIG.format(setup="", call=call), tmp_path / "ours")
    )
    assert before is None and after is None
    assert not (tmp_path / "ours").exists()


def test_solve_leaves_the_cache_folder_as_configured():
    # In this process too (whatever earlier tests configured).
    import jax

    import pipedejavu
    from pipedejavu.costmodel.stage.generate import random_problem

    before = jax.config.jax_compilation_cache_dir
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    pipedejavu.solve(
        random_problem(8, (1, 2), seed=0), method="diff", num_restarts=2, num_steps=4
    )
    assert jax.config.jax_compilation_cache_dir == before
    assert jax.config.jax_persistent_cache_min_compile_time_secs == minimum


_RUN = """
import json, jax, pipedejavu
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine.driver import SearchConfig, search
pipedejavu.enable_compilation_cache()
problem = random_problem(10, (1, 4), num_microbatches=8, seed=2)
config = SearchConfig(num_restarts=4, num_steps=20, num_chunks=2, num_polished=1)
result = search(problem, config, key=jax.random.key(0))
print(json.dumps({"cost": result.plan.cost,
                  "stages": [s.to_json() for s in result.plan.stages]}))
"""

_CLI = """
import sys
from pipedejavu.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _entries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.mark.slow
def test_a_second_process_reuses_every_compiled_function(tmp_path):
    folder = tmp_path / "jax-cache"
    first = json.loads(_python(_RUN, folder))
    entries = _entries(folder)
    assert entries  # the engine's functions were written
    second = json.loads(_python(_RUN, folder))
    assert second == first
    # Every compilation of the second process was found: nothing was written.
    assert _entries(folder) == entries


@pytest.mark.slow
def test_the_command_line_switches_the_cache_on(tmp_path):
    from pipedejavu.costmodel.stage.generate import random_problem

    path = tmp_path / "gen.npz"
    random_problem(10, (1, 4), num_microbatches=8, seed=2).to_npz(path)
    folder = tmp_path / "cli-cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{ENV_VAR: str(folder)})
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [sys.executable, "-c", _CLI, "solve", str(path), "--method", "diff"]
    argv += ["--restarts", "4", "--steps", "20"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    entries = _entries(folder)
    assert entries
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    def plan(out: str) -> str:  # the printed plan, without the timing
        return re.sub(r"\(search [^)]*\)", "", out)

    assert second.returncode == 0 and plan(second.stdout) == plan(first.stdout)
    assert _entries(folder) == entries
    off = subprocess.run(
        argv, capture_output=True, text=True, env={**env, ENV_VAR: "off"}, timeout=300
    )
    assert off.returncode == 0 and _entries(folder) == entries
