"""The engine's persistent compilation cache: folders, atomic entries, reuse
across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipedejavu.search.engine import compile_cache as _jax_cache
from pipedejavu.search.engine.compile_cache import _AtomicFileCache, cache_folder


def test_folder_from_argument_environment_and_default(monkeypatch, tmp_path):
    monkeypatch.delenv(_jax_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cache_folder() == tmp_path / "xdg" / "pipedejavu" / "jax"
    monkeypatch.setenv(_jax_cache.ENV_VAR, str(tmp_path / "env"))
    assert cache_folder() == tmp_path / "env"
    assert cache_folder(tmp_path / "arg") == tmp_path / "arg"
    assert cache_folder(False) is None
    for off in ("off", "0", "", "false"):
        monkeypatch.setenv(_jax_cache.ENV_VAR, off)
        assert cache_folder() is None


def test_entries_round_trip_and_damage_is_a_miss(tmp_path):
    cache = _AtomicFileCache(tmp_path / "cache")
    assert cache.get("k") is None  # no folder yet
    cache.put("k", b"executable bytes")
    assert cache.get("k") == b"executable bytes"
    path = tmp_path / "cache" / "k"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    assert cache.get("k") is None
    path.write_bytes(b"short")  # truncated
    assert cache.get("k") is None
    cache.put("k", b"again")  # a miss is compiled and written again
    assert cache.get("k") == b"again"


def test_concurrent_writers_never_expose_a_partial_entry(tmp_path):
    cache = _AtomicFileCache(tmp_path)
    values = [bytes([n]) * 200_000 for n in range(8)]
    seen: list[bytes | None] = []

    def write(value: bytes) -> None:
        for _ in range(5):
            cache.put("key", value)

    def read() -> None:
        for _ in range(200):
            seen.append(cache.get("key"))

    threads = [threading.Thread(target=write, args=(v,)) for v in values]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(value is None or value in values for value in seen)
    assert cache.get("key") in values
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # no temporary left


def test_unwritable_folder_only_costs_compilation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = _AtomicFileCache(blocker / "cache")
    cache.put("k", b"value")  # no exception
    assert cache.get("k") is None


_RUN = """
import json, jax
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.engine.driver import SearchConfig, search
problem = random_problem(10, (1, 4), num_microbatches=8, seed=2)
config = SearchConfig(num_restarts=4, num_steps=20, num_chunks=2, num_polished=1)
result = search(problem, config, key=jax.random.key(0))
print(json.dumps({"cost": result.plan.cost,
                  "stages": [s.to_json() for s in result.plan.stages]}))
"""


def _run_in_new_process(folder: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env[_jax_cache.ENV_VAR] = str(folder)
    out = subprocess.run(
        [sys.executable, "-c", _RUN],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_reuses_every_compiled_function(tmp_path):
    folder = tmp_path / "jax-cache"
    first = _run_in_new_process(folder)
    entries = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert entries  # the engine's functions were written
    second = _run_in_new_process(folder)
    assert second == first
    # Every compilation of the second process was found: nothing was written.
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == entries
