"""The command line's parser class, argument types and the small checks and
error reports shared by every command.

:class:`Parser` makes usage errors exit 2 (bad input) and every command's
``--help`` show its defaults: ``add_subparsers`` makes the sub-parsers of the
parser's own class, so command groups registered by other modules get both.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.memory_headroom import MemoryHeadroom

__all__ = [
    "EXIT_BAD_INPUT",
    "NUMBER_LIST_OPTIONS",
    "HelpFormatter",
    "Parser",
    "add_json_option",
    "count",
    "fail",
    "float_in",
    "fraction",
    "given_flags",
    "headroom_type",
    "int_in",
    "join_number_lists",
    "require_matplotlib",
]

#: Options whose value is a comma-separated list of numbers that may start
#: with a minus sign ("--grad -1,2"), which argparse would read as an option.
NUMBER_LIST_OPTIONS = ("--goodput-grad", "--grad", "--atomic-bsz-range")
_NUMBER_LIST = re.compile(r"^-[\d.][\d.,eE+\-]*$")

EXIT_BAD_INPUT = 2


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, when it has one."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        default = action.default
        return bool(action.option_strings) and not any(
            default is x for x in (None, False, argparse.SUPPRESS)
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" not in text and self._shows_default(action):
            text = f"{text} (default: %(default)s)".lstrip()
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):  # no help text
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """The parser of every command: usage errors exit 2, help shows defaults.

    ``add_subparsers`` makes its parsers of the same class, so the command
    groups registered by other modules (``commands.add_parser(...)``) get the
    defaults-showing help too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # usage errors are bad input too
        self.exit(
            EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} -h)\n"
        )


def count(name: str, minimum: int = 1, maximum: int | None = None):
    """An argparse type: an integer in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer, got {text!r:.40}"
            ) from None
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(
                f"{name} must be >= {minimum}{upper}, got {text:.40}"
            )
        return value

    return parse


def fraction(name: str):
    """An argparse type: a number in ``(0, 1]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a number in (0, 1], got {text!r:.40}"
            ) from None
        if not 0 < value <= 1:  # nan fails too
            raise argparse.ArgumentTypeError(
                f"{name} must be in (0, 1], got {text:.40}"
            )
        return value

    return parse


def join_number_lists(argv: Sequence[str]) -> list[str]:
    """``--grad -1,2`` -> ``--grad=-1,2`` for :data:`NUMBER_LIST_OPTIONS`, so
    that a negative value reaches the option's range check (argparse would
    take ``-1,2`` for an option and say only "expected one argument")."""
    out: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if (
            token in NUMBER_LIST_OPTIONS
            and i + 1 < len(tokens)
            and _NUMBER_LIST.match(tokens[i + 1])
        ):
            out.append(f"{token}={tokens[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def int_in(name: str, low: int, high: int):
    """An argparse type: an integer in ``[low, high]`` (one-line error)."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 40 else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer in [{low}, {high}], got {text!r:.40}"
            )
        return value

    return parse


def headroom_type(text: str) -> MemoryHeadroom:
    """An argparse type: ``--memory-headroom`` (one-line error)."""
    try:
        return MemoryHeadroom.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--memory-headroom: {error}") from None


def float_in(option: str, low: float, high: float):
    """An argparse type: a number in ``(low, high]`` (one-line error)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low < value <= high:
            raise argparse.ArgumentTypeError(
                f"{option} must be a number in ({low:g}, {high:g}], got {text!r:.40}"
            )
        return value

    return parse


def add_json_option(parser: Any, help: str = "print JSON") -> None:
    """``--json`` (a switch) on ``parser`` or an argument group of it."""
    parser.add_argument("--json", action="store_true", help=help)


def fail(message: str) -> int:
    """Print ``pipedejavu: error: message`` on stderr; returns the exit code of
    bad input, :data:`EXIT_BAD_INPUT`."""
    print(f"pipedejavu: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def given_flags(values: Iterable[tuple[str, Any]]) -> list[str]:
    """The flags of ``(flag, value)`` pairs whose value was given (is truthy),
    in their order."""
    return [flag for flag, value in values if value]


def require_matplotlib() -> None:
    """Refuse ``--plot`` when matplotlib is not installed (checked without
    importing it, before any work).

    Raises:
        ProblemError: one line naming the package to install.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ProblemError("--plot needs matplotlib: pip install 'pipedejavu[plot]'")
