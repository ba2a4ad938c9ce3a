"""The import rules of the package, checked on its source (docs/architecture.md).

Every ``import`` of a project module counts, at module level, inside functions and
under ``TYPE_CHECKING`` alike: imports flow down the layers, no two modules import
each other (directly or around a cycle), and no ``_private`` name crosses a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pipedejavu"

#: Layers, bottom first: a module may import its own package and lower layers.
LAYERS = {
    "core": 0,
    "io": 1,
    "simulation": 1,
    "costmodel": 2,
    "search": 3,
    "baselines": 4,
    "planning": 5,
    "init_search": 5,
    "cli": 6,
    "": 7,  # pipedejavu/__init__.py: the public API
}
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 12


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import of a
    project module in ``module``'s source."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                (a.name, None, node.lineno) for a in node.names if a.name in MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    found.append((f"{base}.{alias.name}", None, node.lineno))
                elif base in MODULES:
                    found.append((base, alias.name, node.lineno))
        # A package's lazily loaded names: ``_LAZY = {"name": "submodule"}``.
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for value in node.value.values:
                found.append((f"{package}.{value.value}", None, node.lineno))
    return [(target, name, line) for target, name, line in found if target != module]


GRAPH = {module: _imports(module) for module in MODULES}
#: Third-party packages heavy enough to load only when a call needs them (and
#: their submodules): JAX and the rest take a second or more to import,
#: ``scipy.optimize`` 0.3-0.5 s, which a command that fits nothing should not pay.
HEAVY = {"jax", "jaxlib", "flax", "optax", "matplotlib", "scipy.optimize"}


def _is_heavy(name: str) -> bool:
    return any(name == heavy or name.startswith(f"{heavy}.") for heavy in HEAVY)


def _top_level_lines(module: str) -> set[int]:
    """Lines of the imports that run when ``module`` is imported."""
    tree = ast.parse(MODULES[module].read_text())
    return {n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}


def _heavy_modules() -> set[str]:
    """Project modules whose import loads a heavy package (directly or below)."""
    direct = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(_is_heavy(name) for name in names):
                direct.add(module)
    heavy, changed = set(direct), True
    while changed:
        changed = False
        for module in MODULES:
            if module in heavy:
                continue
            lines = _top_level_lines(module)
            if any(t in heavy for t, _, line in GRAPH[module] if line in lines):
                heavy.add(module)
                changed = True
    return heavy


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""
    return top, LAYERS[top]


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    return components


def test_the_checker_sees_every_kind_of_import():
    # If the parser missed function-level or relative imports, the rules below
    # would pass vacuously.
    assert len(MODULES) > 80
    edges = {(m, t) for m, imports in GRAPH.items() for t, _, _ in imports}
    assert ("pipedejavu.planning.solve", "pipedejavu.search.engine.driver") in edges
    assert ("pipedejavu.costmodel", "pipedejavu.costmodel.goodput.function") in edges
    assert sum(len(imports) for imports in GRAPH.values()) > 300


def test_no_import_cycles():
    assert _cycles() == []


def test_imports_flow_down_the_layers():
    wrong = []
    for module, imports in GRAPH.items():
        top, rank = _layer(module)
        for target, _, line in imports:
            target_top, target_rank = _layer(target)
            if target_rank > rank or (target_rank == rank and target_top != top):
                wrong.append(f"{module}:{line} imports {target}")
    assert wrong == []


#: The one function that imports modules of ours that are not heavy: the
#: command line's dispatcher imports a command's module when that command runs
#: (so a command pays for no other command's imports); only ``pipedejavu.cli``
#: modules, and only there.
COMMAND_LOADER = ("pipedejavu.cli.main", "command_module", "pipedejavu.cli.")


def _function_lines(module: str, name: str) -> range:
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return range(node.lineno, node.end_lineno + 1)
    return range(0)


def test_function_level_imports_only_defer_heavy_modules():
    # An import inside a function is there to keep JAX, matplotlib or SciPy's
    # optimizers out of `import pipedejavu` and of the commands that do not use
    # them; never to dodge a cycle (the cycle test counts it).
    heavy = _heavy_modules()
    assert "pipedejavu.search.engine.driver" in heavy
    assert "pipedejavu.costmodel.analytical.kernels" in heavy  # scipy.optimize
    assert "pipedejavu.core.problem" not in heavy
    loader_module, loader, commands = COMMAND_LOADER
    loader_lines = _function_lines(loader_module, loader)
    assert len(loader_lines) > 1
    needless = []
    for module, imports in GRAPH.items():
        if (
            module.rpartition(".")[2] == "__init__"
            or MODULES[module].name == "__init__.py"
        ):
            continue  # a package's _LAZY names
        lines = _top_level_lines(module)
        for target, _, line in imports:
            if line in lines or target in heavy:
                continue
            if module == loader_module and line in loader_lines:
                if target.startswith(commands):
                    continue
            needless.append(f"{module}:{line} imports {target} in a function")
    assert needless == []


def test_no_private_name_crosses_a_module():
    wrong = [
        f"{module}:{line} imports {name} from {target}"
        for module, imports in GRAPH.items()
        for target, name, line in imports
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    private_modules = [m for m in MODULES if m.rpartition(".")[2].startswith("_")]
    assert wrong == [] and private_modules == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    assert len(MODULES[module].read_text().splitlines()) <= MAX_LINES


def test_the_top_level_holds_few_modules():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_vocabulary_imports_nothing_else_of_ours():
    core = [m for m in MODULES if m.startswith("pipedejavu.core")]
    assert core
    outside = [
        (m, t)
        for m in core
        for t, _, _ in GRAPH[m]
        if not t.startswith("pipedejavu.core")
    ]
    assert outside == []


def test_the_library_never_touches_jax_private_modules():
    users = [m for m, p in MODULES.items() if "jax._src" in p.read_text()]
    assert users == []


def test_re_exports_only_in_init_files():
    # `from x import name as name` marks a re-export; a module that is not a
    # package's __init__ imports what it uses, and callers import from the
    # module that defines a name.
    wrong = []
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                wrong += [
                    f"{module}:{node.lineno} re-exports {alias.name}"
                    for alias in node.names
                    if alias.asname == alias.name
                ]
    assert wrong == []
