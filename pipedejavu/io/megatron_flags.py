"""The command-line flags Megatron-LM's ``pretrain_gpt.py`` accepts.

The bundled list ``pipedejavu/data/megatron/flags.json`` is derived from
Megatron-LM's source (github.com/NVIDIA/Megatron-LM, BSD-3-Clause) by
``benchmarks/megatron_flags.py``, for the versions it names (Megatron Core
0.16.1, which the exports are checked against, and the newest release when it
was written); ``pipedejavu/data/megatron/README.md`` says how to regenerate it.
Megatron-LM's parser has ``allow_abbrev=False``: a flag is accepted only
spelled in full.

:func:`megatron_flags` maps each option string (``--num-layers``) to a
:class:`FlagInfo`: whether it takes a value and which values it allows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json

__all__ = [
    "MAX_MEGATRON_FLAGS_BYTES",
    "VALUE_KINDS",
    "FlagInfo",
    "MegatronFlags",
    "bundled_megatron_flags_path",
    "load_megatron_flags",
    "megatron_flags",
]

#: The bundled list is about 100 kB; refuse files past 4 MiB.
MAX_MEGATRON_FLAGS_BYTES = 4 * 2**20
#: What follows a flag: nothing (``store_true``), one value, one value or
#: nothing (``nargs='?'``), or several (``nargs='*'``, ``'+'`` or a number).
VALUE_KINDS = ("none", "one", "optional", "many")
ValueKind = Literal["none", "one", "optional", "many"]


@dataclasses.dataclass(frozen=True)
class FlagInfo:
    """One option string of Megatron-LM's parser.

    Attributes:
        value: what follows the flag in the newest version that has it (one of
            :data:`VALUE_KINDS`).
        choices: the values the flag allows in any version (strings, or
            integers for an ``int`` option: ``--timing-log-level 0``); None:
            any value.
        versions: the Megatron-LM versions (git refs) that have the flag.
        value_by_version: ``value`` in each of ``versions`` (two flags changed:
            ``--lazy-mpu-init`` took a value in 0.16.1 and none since).
        nargs: argparse's ``nargs`` (``"*"``, ``"+"`` or a count) when
            ``value`` is ``"many"``; else None.
        condition: where Megatron-LM adds the flag only in some installs, the
            Python condition it tests (``has_nvidia_modelopt``, ``HAVE_KITCHEN``);
            None for a flag every install has.
    """

    value: ValueKind
    choices: tuple[str | int, ...] | None
    versions: tuple[str, ...]
    value_by_version: Mapping[str, ValueKind] = dataclasses.field(hash=False)
    nargs: str | int | None = None
    condition: str | None = None

    def allows(self, text: str) -> bool:
        """Whether Megatron-LM accepts ``text`` as this flag's value (its
        ``choices``; an integer choice matches as ``int(text)`` does)."""
        if self.choices is None:
            return True
        for choice in self.choices:
            if isinstance(choice, int):
                try:
                    if int(text) == choice:
                        return True
                except ValueError:
                    continue
            elif text == choice:
                return True
        return False


class MegatronFlags(Mapping[str, FlagInfo]):
    """Megatron-LM's option strings (``"--num-layers"``) to :class:`FlagInfo`.

    Attributes:
        refs: the Megatron-LM versions (git refs) the list covers, oldest first.
        commits: the commit of each ref.
        allow_abbrev: False: Megatron-LM refuses a prefix of a flag.
    """

    def __init__(
        self,
        flags: Mapping[str, FlagInfo],
        refs: tuple[str, ...],
        commits: Mapping[str, str],
        allow_abbrev: bool,
    ) -> None:
        self._flags = dict(flags)
        self.refs = refs
        self.commits = dict(commits)
        self.allow_abbrev = allow_abbrev

    def __getitem__(self, name: str) -> FlagInfo:
        return self._flags[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flags)

    def __len__(self) -> int:
        return len(self._flags)


def bundled_megatron_flags_path() -> Path:
    """Where the bundled list lies in the installed package."""
    files = importlib.resources.files("pipedejavu")
    return Path(str(files / "data" / "megatron" / "flags.json"))


@functools.cache
def megatron_flags() -> MegatronFlags:
    """The bundled list of Megatron-LM's flags (read once).

    Raises:
        ProblemError: the bundled file is missing or malformed.
    """
    return load_megatron_flags(bundled_megatron_flags_path())


def load_megatron_flags(path: str | os.PathLike) -> MegatronFlags:
    """Read and check a list written by ``benchmarks/megatron_flags.py``.

    Raises:
        ProblemError: one line naming the file and what is wrong.
    """
    document = read_json(path, MAX_MEGATRON_FLAGS_BYTES, "Megatron-LM flag list")

    def wrong(what: str) -> ProblemError:
        return ProblemError(
            f"Megatron-LM flag list {os.fspath(path)}: {what} (regenerate it with "
            "benchmarks/megatron_flags.py)"
        )

    if not isinstance(document, dict):
        raise wrong("expected a JSON object")
    refs = document.get("ref")
    if not _strings(refs) or not refs:
        raise wrong('"ref" must be a non-empty list of strings')
    commits = document.get("commit")
    if not isinstance(commits, dict) or set(commits) != set(refs):
        raise wrong('"commit" must give the commit of each ref')
    allow_abbrev = document.get("allow_abbrev")
    if not isinstance(allow_abbrev, bool):
        raise wrong('"allow_abbrev" must be true or false')
    entries = document.get("flags")
    if not isinstance(entries, dict) or not entries:
        raise wrong('"flags" must be a non-empty object')
    flags = {}
    for name, entry in entries.items():
        try:
            flags[name] = _flag(name, entry, refs)
        except ValueError as error:
            raise wrong(f"flag {name!r}: {error}") from None
    return MegatronFlags(flags, tuple(refs), commits, allow_abbrev)


def _flag(name: str, entry: Any, refs: list[str]) -> FlagInfo:
    """One entry of the list; ValueError says what is wrong."""
    if not name.startswith("-") or name.strip("-") == "":
        raise ValueError("not an option string")
    if not isinstance(entry, dict):
        raise ValueError("expected an object")
    value = entry.get("value")
    if value not in VALUE_KINDS:
        raise ValueError(f'"value" must be one of {", ".join(VALUE_KINDS)}')
    choices = entry.get("choices")
    if choices is not None and not (
        isinstance(choices, list)
        and choices
        and all(
            isinstance(c, str) or (isinstance(c, int) and not isinstance(c, bool))
            for c in choices
        )
    ):
        raise ValueError('"choices" must be null or a list of strings and integers')
    versions = entry.get("versions")
    if not _strings(versions) or not versions or not set(versions) <= set(refs):
        raise ValueError('"versions" must list some of the refs')
    nargs = entry.get("nargs")
    if (nargs is None) != (value != "many") or not (
        nargs is None or nargs in ("*", "+") or (type(nargs) is int and nargs > 1)
    ):
        raise ValueError('"nargs" must be "*", "+" or a count, for "many" only')
    condition = entry.get("condition")
    if condition is not None and not isinstance(condition, str):
        raise ValueError('"condition" must be a string')
    value_by_version = dict.fromkeys(versions, value)
    by_version = entry.get("by_version", {})
    if not isinstance(by_version, dict) or not set(by_version) <= set(versions):
        raise ValueError('"by_version" must be an object keyed by its versions')
    for ref, old in by_version.items():
        if not isinstance(old, dict) or old.get("value") not in VALUE_KINDS:
            raise ValueError(f'"by_version" of {ref} must give a "value"')
        value_by_version[ref] = old["value"]
    return FlagInfo(
        value=value,
        choices=None if choices is None else tuple(choices),
        versions=tuple(versions),
        value_by_version=types.MappingProxyType(value_by_version),
        nargs=nargs,
        condition=condition,
    )


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
