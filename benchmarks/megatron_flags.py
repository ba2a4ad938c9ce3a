"""The command-line flags Megatron-LM's ``pretrain_gpt.py`` accepts, read from
its source without importing it (Megatron needs torch and a GPU stack).

The parser is ``megatron.training.arguments.parse_args``: every ``_add_*``
function that ``add_megatron_arguments`` calls, plus the
``extra_args_provider`` that ``pretrain_gpt.py`` hands over. The script parses
those modules with :mod:`ast` and reads

* every ``*.add_argument(...)`` call: its option strings, whether the option
  takes a value (``action`` ``store_true``/``store_false``/``store_const``/
  ``count``/``help``/``version``: none; ``nargs='?'``: optional; ``nargs``
  ``'*'``, ``'+'`` or a number above 1: several), and its literal
  ``choices``; ``argparse.BooleanOptionalAction`` adds ``--no-<name>``;
* every ``ArgumentGroupFactory(Config, exclude=...).build_group(...)``: the
  flags Megatron derives from a dataclass's fields, by the factory's rules
  (``--field-name``; a ``bool`` field that defaults to anything but ``False``
  becomes ``--no-field-name``/``--disable-field-name``; ``list[X]`` takes
  several values; ``Literal`` and ``Enum`` types give choices, an Enum's
  member names; a field's ``metadata["argparse_meta"]`` overrides);
* functions those call with the parser or a group, followed into their modules.

An ``add_argument`` under an ``if`` (or an ``extra_args_provider`` chosen by
one) is kept, with the condition's source text. Anything that cannot be read
statically is listed on stderr and makes the exit status 1.

Usage (the source: a checkout, or a bare git directory with ``--ref``; give
``--ref`` several times to merge versions)::

    python benchmarks/megatron_flags.py MEGATRON_LM_GIT_DIR \\
        --ref core_v0.16.1 --ref core_v0.19.0 \\
        --output pipedejavu/data/megatron/flags.json

The JSON has one entry a flag, merged over the versions: ``value``
(``"none"``, ``"one"``, ``"optional"`` or ``"many"``, with ``nargs`` for the
last), ``choices`` (the values any version accepts; null: any value),
``condition`` (the source text of the ``if`` it is added under, if any),
``versions`` (the refs that have it), and ``by_version`` where the versions
differ. Only these facts about Megatron-LM's interface are written; none of
its code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ARGUMENTS_MODULE = "megatron.training.arguments"
OLD_ARGUMENTS_MODULE = "megatron.arguments"
ENTRY_FUNCTION = "add_megatron_arguments"
SCRIPT = "pretrain_gpt.py"
FACTORY = "ArgumentGroupFactory"
#: argparse actions that take no value.
NO_VALUE_ACTIONS = {
    "store_true",
    "store_false",
    "store_const",
    "append_const",
    "count",
    "help",
    "version",
}
#: argparse adds ``-h``/``--help`` itself (``add_help=True``).
ARGPARSE_FLAGS = {"-h": "none", "--help": "none"}


class Source:
    """Files of one Megatron-LM version: a work tree, or ``ref`` of a git
    directory (bare or not)."""

    def __init__(self, path: Path, ref: str | None) -> None:
        self.path = path
        self.ref = ref
        self.commit = self._git("rev-parse", f"{ref or 'HEAD'}^{{commit}}")
        if ref is not None and self.commit is None:
            raise SystemExit(f"{path}: no git ref {ref!r}")

    def _git(self, *args: str) -> str | None:
        done = subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, text=True
        )
        return done.stdout.strip() if done.returncode == 0 else None

    def read(self, relative: str) -> str | None:
        if self.ref is None:
            file = self.path / relative
            return file.read_text() if file.is_file() else None
        return self._git("show", f"{self.ref}:{relative}")


@dataclasses.dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    is_package: bool

    def imports(self, scope: ast.AST) -> dict[str, tuple[str, str | None]]:
        """Names bound by imports anywhere in ``scope``: ``name -> (module,
        attribute or None)``."""
        bound = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0],
                        None,
                    )
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = self.name.split(".")
                    if not self.is_package:
                        package = package[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                for alias in node.names:
                    bound[alias.asname or alias.name] = (base, alias.name)
        return bound

    def top_level(self, name: str) -> ast.AST | None:
        """The module-level def, class or assigned value named ``name``."""
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return node.value
        return None


@dataclasses.dataclass
class Flag:
    value: str  # "none", "one", "optional" or "many"
    choices: list[Any] | None
    nargs: Any = None
    condition: str | None = None
    where: str = ""


class Extractor:
    """The flags of one version's ``pretrain_gpt.py`` parser."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.modules: dict[str, Module | None] = {}
        self.flags: dict[str, Flag] = {}
        self.problems: list[str] = []
        self.visited: set[tuple[str, str]] = set()
        self.abbrev: Any = None

    # -- modules and names ---------------------------------------------------
    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            self.modules[name] = None
            base = name.replace(".", "/")
            for path, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self.source.read(path)
                if text is not None:
                    tree = ast.parse(text, path)
                    self.modules[name] = Module(name, path, tree, package)
                    break
        return self.modules[name]

    def resolve(
        self, module: Module, name: str, scope: ast.AST | None = None, depth: int = 0
    ) -> tuple[Module, ast.AST] | None:
        """Where ``name``, as seen in ``scope`` of ``module``, is defined."""
        if depth > 8:
            return None
        local = module.imports(scope) if scope is not None else {}
        if name in local:
            return self._follow(*local[name], depth)
        found = module.top_level(name)
        if found is not None:
            return module, found
        imported = module.imports(module.tree)
        if name in imported:
            return self._follow(*imported[name], depth)
        return None

    def _follow(
        self, module_name: str, attribute: str | None, depth: int
    ) -> tuple[Module, ast.AST] | None:
        if attribute is None:
            return None
        submodule = self.module(f"{module_name}.{attribute}")
        if submodule is not None:
            return None  # a module, not a definition
        module = self.module(module_name)
        if module is None:
            return None
        return self.resolve(module, attribute, None, depth + 1)

    def where(self, module: Module, node: ast.AST) -> str:
        return f"{module.path}:{getattr(node, 'lineno', '?')}"

    def problem(self, module: Module, node: ast.AST, what: str) -> None:
        self.problems.append(f"{self.where(module, node)}: {what}")

    # -- the parser ----------------------------------------------------------
    def run(self) -> None:
        # (Megatron-LM before 2024, as the SC'21 scripts ran it: megatron.arguments,
        # whose parse_args calls the _add_* functions itself)
        arguments = self.module(ARGUMENTS_MODULE) or self.module(OLD_ARGUMENTS_MODULE)
        if arguments is None:
            raise SystemExit(f"{ARGUMENTS_MODULE} not found in {self.source.path}")
        parse_args = arguments.top_level("parse_args")
        abbrev = self.abbrev = self.allow_abbrev(parse_args)
        if abbrev is not False:
            self.problems.append(
                f"{arguments.path}: parse_args's ArgumentParser has allow_abbrev="
                f"{abbrev!r}: prefixes of the flags are accepted too"
            )
        entry = arguments.top_level(ENTRY_FUNCTION) or parse_args
        if not isinstance(entry, ast.FunctionDef):
            raise SystemExit(f"{ENTRY_FUNCTION} not found in {arguments.path}")
        self.function(arguments, entry, ())
        self.extra_args_provider()
        for name, value in ARGPARSE_FLAGS.items():
            self.add(name, Flag(value, None, where="argparse (add_help)"))

    def allow_abbrev(self, parse_args: ast.AST | None) -> Any:
        for node in ast.walk(parse_args or ast.Module(body=[], type_ignores=[])):
            if isinstance(node, ast.Call) and _name(node.func).endswith(
                "ArgumentParser"
            ):
                for keyword in node.keywords:
                    if keyword.arg == "allow_abbrev":
                        return _literal(keyword.value, "?")
                return True  # argparse's default
        return None

    def extra_args_provider(self) -> None:
        """The ``extra_args_provider=`` that ``pretrain_gpt.py`` passes."""
        text = self.source.read(SCRIPT)
        if text is None:
            self.problems.append(f"{SCRIPT} not found")
            return
        script = Module("pretrain_gpt", SCRIPT, ast.parse(text, SCRIPT), False)
        for node in ast.walk(script.tree):
            if not isinstance(node, ast.keyword) or node.arg != "extra_args_provider":
                continue
            value, conditions = node.value, ()
            if isinstance(value, ast.IfExp):
                conditions = (ast.unparse(value.test),)
                if not _is_none(value.orelse):
                    self.problem(script, value, "extra_args_provider else-branch")
                value = value.body
            if _is_none(value):
                continue
            if not isinstance(value, ast.Name):
                self.problem(script, value, f"provider {ast.unparse(value)}")
                continue
            found = self.resolve(script, value.id)
            if found is None or not isinstance(found[1], ast.FunctionDef):
                self.problem(script, value, f"cannot find provider {value.id}")
                continue
            self.function(*found, conditions)

    def function(
        self, module: Module, function: ast.FunctionDef, conditions: tuple[str, ...]
    ) -> None:
        key = (module.name, function.name)
        if key in self.visited:
            return
        self.visited.add(key)
        context = _Context(module, function)
        self.body(context, function.body, conditions)

    def body(
        self, context: _Context, statements: list[ast.stmt], conditions: tuple
    ) -> None:
        for statement in statements:
            if isinstance(statement, ast.If):
                test = ast.unparse(statement.test)
                self.body(context, statement.body, (*conditions, test))
                self.body(context, statement.orelse, (*conditions, f"not ({test})"))
            elif isinstance(statement, ast.Try):
                self.body(context, statement.body, conditions)
                for handler in statement.handlers:
                    self.body(context, handler.body, (*conditions, "except"))
                self.body(context, statement.orelse, conditions)
                self.body(context, statement.finalbody, conditions)
            elif isinstance(statement, (ast.For, ast.While, ast.With)):
                if _calls(statement, "add_argument"):
                    self.problem(
                        context.module, statement, "add_argument inside a loop/with"
                    )
                self.body(context, statement.body, conditions)
            elif isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
                if _calls(statement, "add_argument"):
                    self.problem(
                        context.module, statement, "add_argument in a nested def"
                    )
            else:
                context.note_assignment(statement)
                for node in ast.walk(statement):
                    if isinstance(node, ast.Call):
                        self.call(context, node, conditions)

    def call(self, context: _Context, call: ast.Call, conditions: tuple) -> None:
        module = context.module
        condition = " and ".join(conditions) or None
        if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            self.add_argument(module, call, condition)
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "build_group":
            factory = call.func.value
            if isinstance(factory, ast.Name):
                factory = context.assigned.get(factory.id, factory)
            self.factory(context, factory, condition)
        elif isinstance(call.func, ast.Name) and any(
            isinstance(a, ast.Name) and a.id in context.parsers for a in call.args
        ):
            if call.func.id in {"super", "getattr", "setattr", "isinstance"}:
                return
            if call.func.id in {a.arg for a in context.function.args.args}:
                return  # a callback passed in (old parse_args' extra_args_provider)
            found = context.resolve(self, call.func.id)
            if found is None or not isinstance(found[1], ast.FunctionDef):
                self.problem(module, call, f"cannot follow {ast.unparse(call)}")
                return
            self.function(*found, conditions)
        elif isinstance(call.func, ast.Attribute) and any(
            isinstance(a, ast.Name) and a.id in context.parsers for a in call.args
        ):
            self.problem(module, call, f"cannot follow {ast.unparse(call)}")

    # -- add_argument --------------------------------------------------------
    def add_argument(self, module: Module, call: ast.Call, condition: str | None):
        names = []
        for argument in call.args:
            name = _literal(argument)
            if not isinstance(name, str):
                self.problem(module, call, f"option name {ast.unparse(argument)}")
                return
            names.append(name)
        keywords = {k.arg: k.value for k in call.keywords}
        if None in keywords:
            self.problem(module, call, "**kwargs in add_argument")
        action = keywords.get("action")
        action_name = None
        if action is not None:
            action_name = _literal(action)
            if not isinstance(action_name, str):
                action_name = _name(action)
        nargs = _literal(keywords.get("nargs"), _UNKNOWN)
        if "nargs" not in keywords:
            nargs = None
        elif nargs is _UNKNOWN:
            self.problem(module, call, f"nargs {ast.unparse(keywords['nargs'])}")
            return
        choices = None
        if "choices" in keywords:
            choices = self.choices(module, keywords["choices"])
        self.record(module, call, names, action_name, nargs, choices, condition)

    def record(self, module, node, names, action, nargs, choices, condition):
        optional = [n for n in names if n.startswith("-")]
        if not optional:
            self.problem(module, node, f"positional argument {names}")
            return
        value = _value_kind(action, nargs)
        if value is None:
            self.problem(module, node, f"unknown action/nargs {action!r}/{nargs!r}")
            value = "one"
        where = self.where(module, node)
        flag = Flag(
            value, choices, nargs if value == "many" else None, condition, where
        )
        for name in optional:
            self.add(name, flag)
        if action is not None and action.endswith("BooleanOptionalAction"):
            for name in optional:
                if name.startswith("--"):
                    self.add(f"--no-{name[2:]}", flag)

    def add(self, name: str, flag: Flag) -> None:
        if name in self.flags:
            first = self.flags[name].where
            self.problems.append(f"{flag.where}: {name} defined twice (at {first})")
        self.flags[name] = flag

    def choices(self, module: Module, node: ast.expr) -> list[Any] | None:
        value = _literal(node)
        if isinstance(value, (list, tuple, set)):
            return sorted(value, key=str) if isinstance(value, set) else list(value)
        if isinstance(node, ast.Call) and _name(node.func) == "list" and node.args:
            node = node.args[0]  # list(SomeEnum)
        if _is_name_comprehension(node):  # [x.name for x in SomeEnum]
            found = self.resolve(module, node.generators[0].iter.id)
            members = None if found is None else _enum_members(found[1], False)
            if members is not None:
                return members
        if isinstance(node, ast.Name):
            found = self.resolve(module, node.id)
            if found is not None:
                members = _enum_members(found[1])
                if members is not None:
                    return members
                value = _literal(found[1])
                if isinstance(value, (list, tuple)):
                    return list(value)
        self.problem(module, node, f"choices {ast.unparse(node)} not read")
        return None

    # -- ArgumentGroupFactory --------------------------------------------------
    def factory(self, context: _Context, node: ast.expr, condition: str | None):
        module = context.module
        if not (isinstance(node, ast.Call) and _name(node.func) == FACTORY):
            self.problem(module, node, f"build_group on {ast.unparse(node)}")
            return
        if not node.args or not isinstance(node.args[0], ast.Name):
            self.problem(module, node, "factory without a config class")
            return
        exclude = []
        for keyword in node.keywords:
            if keyword.arg == "exclude":
                value = keyword.value
                if isinstance(value, ast.Name):
                    value = context.assigned.get(value.id, value)
                exclude = _literal(value)
                if not isinstance(exclude, list):
                    self.problem(module, node, "factory exclude not read")
                    exclude = []
        found = context.resolve(self, node.args[0].id)
        if found is None or not isinstance(found[1], ast.ClassDef):
            self.problem(module, node, f"cannot find {node.args[0].id}")
            return
        fields = self.dataclass_fields(*found)
        if not fields:
            self.problem(module, node, f"no dataclass fields in {node.args[0].id}")
        for field_module, field in fields:
            if field.name in exclude or not field.init:
                continue
            self.factory_field(field_module, field, condition)

    def dataclass_fields(self, module: Module, cls: ast.ClassDef) -> list:
        """``(module, _Field)`` of a dataclass, base classes' fields first, as
        :func:`dataclasses.fields` orders them."""
        fields: dict[str, tuple[Module, _Field]] = {}
        for base in reversed(cls.bases):
            if isinstance(base, ast.Name):
                found = self.resolve(module, base.id)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    for item in self.dataclass_fields(*found):
                        fields[item[1].name] = item
        decorators = [
            d.func if isinstance(d, ast.Call) else d for d in cls.decorator_list
        ]
        if not any(_name(d).endswith("dataclass") for d in decorators):
            return list(fields.values())  # a plain base class has no fields
        for statement in cls.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(
                statement.target, ast.Name
            ):
                annotation = ast.unparse(statement.annotation)
                if annotation.startswith(("ClassVar", "typing.ClassVar", "InitVar")):
                    continue
                if annotation in {"KW_ONLY", "dataclasses.KW_ONLY"}:
                    continue
                field = _Field.read(statement)
                fields[field.name] = (module, field)  # an override keeps its place
        return list(fields.values())

    def factory_field(self, module: Module, field: _Field, condition: str | None):
        names = ["--" + field.name.replace("_", "-")]
        action = nargs = choices = None
        kind = self.annotation_kind(module, field.annotation)
        meta = field.meta
        if kind is None and meta is None:
            self.problem(module, field.node, f"type of {field.name} not read")
            return
        if kind is not None:
            type_name, nargs, choices = kind
            if type_name == "bool":
                if field.default is _UNKNOWN:
                    self.problem(module, field.node, f"default of {field.name}")
                action = "store_true" if field.default == False else "store_false"  # noqa: E712  (the factory's own test)
                if action == "store_false":
                    names = [
                        "--no-" + field.name.replace("_", "-"),
                        "--disable-" + field.name.replace("_", "-"),
                    ]
        if meta is not None:
            if "arg_names" in meta:
                names = list(meta["arg_names"])
            action = meta.get("action", action)
            nargs = meta.get("nargs", nargs)
            if "choices" in meta:
                choices = meta["choices"]
                if isinstance(choices, ast.AST):
                    choices = self.choices(module, choices)
            for key in ("arg_names", "action", "nargs"):
                if isinstance(meta.get(key), ast.AST):
                    self.problem(module, field.node, f"argparse_meta {key} not read")
                    return
        self.record(module, field.node, names, action, nargs, choices, condition)

    def stdlib_enum(self, module: Module, dotted: str) -> list[str] | None:
        """Member names of a standard-library Enum (``signal.Signals``), as
        this Python has it; None for anything else."""
        head, _, rest = dotted.partition(".")
        imported = module.imports(module.tree).get(head)
        if imported is None:
            return None
        origin, attribute = imported
        path = [attribute] if attribute else []
        path += rest.split(".") if rest else []
        if origin.split(".")[0] not in sys.stdlib_module_names:
            return None
        value: Any = importlib.import_module(origin)
        for part in path:
            value = getattr(value, part, None)
        if isinstance(value, type) and issubclass(value, enum.Enum):
            return list(value.__members__)
        return None

    def annotation_kind(self, module: Module, node: ast.expr) -> tuple | None:
        """``(type name, nargs, choices)`` as the factory's ``_extract_type``
        reads the annotation; None where it raises TypeInferenceError."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return None  # a string annotation: the factory cannot use it
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            if _is_none(node.right):
                return self.annotation_kind(module, node.left)
            return None
        if isinstance(node, ast.Subscript):
            origin = _name(node.value).rpartition(".")[2]
            items = (
                node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            )
            if origin == "Optional":
                return self.annotation_kind(module, items[0])
            if origin == "Union":
                if len(items) > 1 and _is_none(items[1]):
                    return self.annotation_kind(module, items[0])
                return None
            if origin in {"list", "List"} and len(items) == 1:
                inner = self.annotation_kind(module, items[0])
                return None if inner is None else (inner[0], "+", inner[2])
            if origin == "Literal":
                values = [_literal(item, _UNKNOWN) for item in items]
                if _UNKNOWN in values:
                    return None
                return (type(values[0]).__name__, None, values)
            return None
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _name(node)
            if isinstance(node, ast.Name):
                found = self.resolve(module, node.id)
                if found is not None:
                    members = _enum_members(found[1])
                    if members is not None:
                        return ("enum", None, members)
            members = self.stdlib_enum(module, name)
            if members is not None:
                return ("enum", None, members)
            return (name, None, None)
        return None


@dataclasses.dataclass
class _Context:
    """A function being read: its module, its imports, the names that hold a
    parser or argument group, and its simple local assignments."""

    module: Module
    function: ast.FunctionDef
    parsers: set[str] = dataclasses.field(default_factory=set)
    assigned: dict[str, ast.expr] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parsers = {a.arg for a in self.function.args.args}

    def note_assignment(self, statement: ast.stmt) -> None:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Name):
                self.assigned[target.id] = statement.value
                if isinstance(statement.value, ast.Call) and _name(
                    statement.value.func
                ).rpartition(".")[2] in {
                    "add_argument_group",
                    "add_mutually_exclusive_group",
                    "build_group",
                    "extra_args_provider",
                    "ArgumentParser",  # (old Megatron-LM: parse_args builds it)
                }:
                    self.parsers.add(target.id)

    def resolve(self, extractor: Extractor, name: str):
        return extractor.resolve(self.module, name, self.function)


_UNKNOWN = object()


@dataclasses.dataclass
class _Field:
    name: str
    annotation: ast.expr
    default: Any
    init: bool
    meta: dict[str, Any] | None
    node: ast.AST

    @classmethod
    def read(cls, statement: ast.AnnAssign) -> _Field:
        name = statement.target.id
        value = statement.value
        default, init, meta = _UNKNOWN, True, None
        if value is None:
            default = _UNKNOWN
        elif isinstance(value, ast.Call) and _name(value.func).endswith("field"):
            for keyword in value.keywords:
                if keyword.arg == "default":
                    default = _literal(keyword.value, _UNKNOWN)
                elif keyword.arg == "init":
                    init = _literal(keyword.value, True)
                elif keyword.arg == "metadata":
                    meta = _argparse_meta(keyword.value)
        else:
            default = _literal(value, _UNKNOWN)
        return cls(name, statement.annotation, default, init, meta, statement)


def _argparse_meta(node: ast.expr) -> dict[str, Any] | None:
    if not isinstance(node, ast.Dict):
        return None
    for key, value in zip(node.keys, node.values, strict=True):
        if _literal(key) == "argparse_meta" and isinstance(value, ast.Dict):
            meta = {}
            for k, v in zip(value.keys, value.values, strict=True):
                literal = _literal(v, _UNKNOWN)
                if literal is _UNKNOWN and _name(v):
                    literal = _name(v)  # argparse.BooleanOptionalAction, str
                meta[_literal(k)] = v if literal is _UNKNOWN else literal
            return meta
    return None


def _enum_members(node: ast.AST, aliases: bool = True) -> list[str] | None:
    """Member names of an Enum class definition (``aliases``: with the names
    ``Enum[name]`` accepts for an earlier member's value); None if not an
    Enum."""
    if not isinstance(node, ast.ClassDef):
        return None
    if not any(_name(b).rpartition(".")[2].endswith("Enum") for b in node.bases):
        return None
    names, values = [], []
    for statement in node.body:
        if not isinstance(statement, ast.Assign):
            continue
        value = _literal(statement.value, _UNKNOWN)
        for target in statement.targets:
            if not isinstance(target, ast.Name) or target.id.startswith("_"):
                continue
            if aliases or value is _UNKNOWN or value not in values:
                names.append(target.id)
            values.append(value)
    return names


def _is_name_comprehension(node: ast.AST) -> bool:
    """``[x.name for x in Name]``."""
    return (
        isinstance(node, ast.ListComp)
        and len(node.generators) == 1
        and not node.generators[0].ifs
        and isinstance(node.generators[0].iter, ast.Name)
        and isinstance(node.generators[0].target, ast.Name)
        and isinstance(node.elt, ast.Attribute)
        and node.elt.attr == "name"
        and _name(node.elt.value) == node.generators[0].target.id
    )


def _value_kind(action: str | None, nargs: Any) -> str | None:
    if action is not None:
        short = action.rpartition(".")[2]
        if short in NO_VALUE_ACTIONS or short == "BooleanOptionalAction":
            return "none"
        if short not in {"store", "append", "extend"}:
            return None
    if nargs is None or nargs == 1:
        return "one"
    if nargs == "?":
        return "optional"
    if nargs in {"*", "+"} or (isinstance(nargs, int) and nargs > 1):
        return "many"
    if nargs == 0:
        return "none"
    return None


def _literal(node: ast.AST | None, default: Any = None) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return default


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _calls(node: ast.AST, attribute: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attribute
        for n in ast.walk(node)
    )


def merge(versions: list[tuple[str, Extractor]]) -> dict[str, Any]:
    """One entry per flag over all versions: the value kind and condition of
    the newest (last) version that has the flag, the choices any version
    accepts, and ``by_version`` where the versions differ."""
    merged: dict[str, dict[str, Any]] = {}
    for label, extractor in versions:
        for name, flag in extractor.flags.items():
            entry = merged.setdefault(name, {"versions": {}})
            entry["versions"][label] = {
                "value": flag.value,
                "choices": flag.choices,
                "nargs": flag.nargs,
                "condition": flag.condition,
            }
    flags = {}
    for name, entry in sorted(merged.items()):
        seen = entry["versions"]
        newest = list(seen.values())[-1]
        flag: dict[str, Any] = {"value": newest["value"]}
        if newest["nargs"] is not None:
            flag["nargs"] = newest["nargs"]
        choices = None
        if all(version["choices"] is not None for version in seen.values()):
            choices = []
            for version in reversed(list(seen.values())):
                choices += [c for c in version["choices"] if c not in choices]
        flag["choices"] = choices
        if newest["condition"] is not None:
            flag["condition"] = newest["condition"]
        flag["versions"] = list(seen)
        if any(version != newest for version in seen.values()):
            flag["by_version"] = {
                label: {k: v for k, v in version.items() if v is not None}
                for label, version in seen.items()
            }
        flags[name] = flag
    return flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="Megatron-LM checkout or git dir")
    parser.add_argument(
        "--ref",
        action="append",
        help="git ref to read (repeat to merge versions, oldest first); "
        "default: the work tree",
    )
    parser.add_argument("--output", type=Path, help="JSON file to write (else stdout)")
    args = parser.parse_args(argv)
    versions = []
    abbrev = set()
    status = 0
    for ref in args.ref or [None]:
        source = Source(args.source, ref)
        extractor = Extractor(source)
        extractor.run()
        label = ref or "work tree"
        print(
            f"{label} ({source.commit}): {len(extractor.flags)} flags", file=sys.stderr
        )
        for problem in extractor.problems:
            print(f"  {label}: {problem}", file=sys.stderr)
            status = 1
        versions.append((label, source, extractor))
        abbrev.add(extractor.abbrev)
    refs = [label for label, _, _ in versions]
    document = {
        "source": "NVIDIA/Megatron-LM",
        "script": SCRIPT,
        "ref": refs,
        "commit": {label: source.commit for label, source, _ in versions},
        "licence": "BSD-3-Clause",
        "generated_by": "benchmarks/megatron_flags.py",
        "allow_abbrev": abbrev.pop() if len(abbrev) == 1 else sorted(abbrev),
        "flags": merge([(label, extractor) for label, _, extractor in versions]),
    }
    # one line a flag: small, and a new version's changes read as a diff
    flags = document.pop("flags")
    head = json.dumps(document, indent=1)[:-2]
    lines = [
        f"  {json.dumps(name)}: {json.dumps(flag)}" for name, flag in flags.items()
    ]
    text = head + ',\n "flags": {\n' + ",\n".join(lines) + "\n }\n}\n"
    assert json.loads(text)["flags"] == flags
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    print(f"{len(flags)} flags over {refs}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
