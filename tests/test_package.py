"""The installed package: one top-level name, public functions that stay functions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import run_python

import pipedejavu as pdj

_RUN = (
    "import pipedejavu as pdj\n"
    "plan = pdj.solve(pdj.load_example('gpt1.3b-6layers-B128'))\n"
    "print(len(plan.stages))\n"
)


@pytest.mark.parametrize("name", ["search", "baselines", "costmodel"])
def test_user_module_of_a_part_name_does_not_shadow_the_package(tmp_path, name):
    # A user's own search.py (or baselines.py, costmodel.py) in the working folder
    # must not replace the planner's engines: they live inside `pipedejavu`.
    (tmp_path / f"{name}.py").write_text("x = 1\n")
    (tmp_path / "run.py").write_text(_RUN)
    child = run_python("run.py", cwd=tmp_path, timeout=120)
    assert child.stdout.strip() == "1"


def test_package_claims_one_top_level_name():
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["pipedejavu", "pipedejavu.*"], include
    # What setuptools finds from that: every package folder, nothing outside.
    from setuptools import find_packages

    packages = find_packages(str(root), include=include)
    assert {name.split(".")[0] for name in packages} == {"pipedejavu"}, packages
    on_disk = {
        ".".join(init.parent.relative_to(root).parts)
        for init in (root / "pipedejavu").rglob("__init__.py")
    }
    assert on_disk <= set(packages), on_disk - set(packages)


def test_public_functions_stay_functions_after_their_modules_load():
    problem = pdj.load_example("generated-gpt-32layers-2x8")
    plan = pdj.solve(problem)
    pdj.simulate_plan(problem, plan=plan)
    pdj.compare(problem, ["dp", "greedy"], repeats=1, warmup=0)
    for name in ("solve", "compare", "simulate", "simulate_plan", "load_example"):
        assert callable(getattr(pdj, name)), name
        assert not isinstance(getattr(pdj, name), type(sys)), name
    assert callable(pdj.compare) and callable(pdj.simulate)


def test_dir_lists_the_public_names():
    names = dir(pdj)
    for name in pdj.__all__:
        assert name in names, name
    assert {"solve", "compare", "load_example", "simulate"} <= set(names)


def test_no_public_name_is_also_a_submodule():
    """A function and a submodule sharing a name flip between the two as
    modules load; every package keeps them apart."""
    import importlib
    import pkgutil

    for package_name in (
        "pipedejavu",
        "pipedejavu.search",
        "pipedejavu.costmodel",
        "pipedejavu.baselines",
    ):
        package = importlib.import_module(package_name)
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        clash = set(getattr(package, "__all__", ())) & submodules
        assert not clash, (package_name, sorted(clash))


@pytest.mark.parametrize(
    "package", ["pipedejavu", "pipedejavu.costmodel", "pipedejavu.search"]
)
def test_every_lazily_loaded_name_resolves(package):
    import importlib

    module = importlib.import_module(package)
    missing = [name for name in module._LAZY if not hasattr(module, name)]
    assert missing == []


_FRESH_IMPORT = """
import importlib, json, sys
import pipedejavu as pdj
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("numpy", "scipy", "jax") or m.startswith("pipedejavu.")
)
same = all(
    getattr(pdj, name)
    is getattr(importlib.import_module("pipedejavu." + pdj._LAZY[name]), name)
    for name in pdj.__all__
)
try:
    pdj.no_such_name
    missing = "found"
except AttributeError as error:
    missing = str(error)
print(json.dumps([loaded, same, pdj.__all__, sorted(set(pdj.__all__) - set(dir(pdj))),
                  missing]))
"""


def test_import_pipedejavu_loads_no_solver_and_every_public_name_resolves():
    """`import pipedejavu` (the parent of every command) imports no numpy, SciPy,
    JAX or other module of ours; each public name loads its module on first use
    and is the object that module defines."""
    import json

    child = run_python("-c", _FRESH_IMPORT, timeout=120)
    loaded, same, public, not_in_dir, missing = json.loads(child.stdout)
    assert loaded == ["pipedejavu.core", "pipedejavu.core.version"]
    assert same and not_in_dir == []
    assert {"solve", "Problem", "enable_compilation_cache"} <= set(public)
    assert missing == "module 'pipedejavu' has no attribute 'no_such_name'"


def test_example_names_lists_every_name_load_example_takes():
    import pipedejavu as pdj

    names = pdj.example_names()
    assert len(names) == 6 and len(set(names)) == 6
    assert {e.name for e in pdj.bundled_examples()} < set(names)
    for name in names:
        assert name in (pdj.load_example.__doc__ or "")
