"""``pipedejavu data [NAME]``: the data files shipped inside the package.

Without a name, every bundled file is listed, one name a line (its path under
``pipedejavu/data/``): Alpa's stage profiles and ``prof_database.pkl``, the
bundled cluster file, Sailor's GPU profiles, network tables, configs and
measured ``plan_config`` runs, the digits. With a name, the installed path of
that file is printed, so that a command can use a bundled file wherever the
package is installed::

    pipedejavu predict --model OPT-350 \
        "$(pipedejavu data sailor/measured/gh200-opt350/plan_config_N16_D4.json)"

An unknown name exits 2 with one line saying how to see the names.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
from pathlib import Path
from typing import Any

from pipedejavu.core.errors import ProblemError

__all__ = ["add_parser", "bundled_data_files", "data_path", "run"]


def _walk(folder: Any, prefix: str) -> list[str]:
    names = []
    for entry in folder.iterdir():
        if entry.name.startswith((".", "__")):  # caches, hidden files
            continue
        if entry.is_dir():
            names.extend(_walk(entry, f"{prefix}{entry.name}/"))
        elif entry.is_file():
            names.append(f"{prefix}{entry.name}")
    return names


def _root() -> Any:  # a Traversable
    return importlib.resources.files("pipedejavu").joinpath("data")


def bundled_data_files() -> list[str]:
    """Every bundled data file, by its path under ``pipedejavu/data/`` (sorted)."""
    return sorted(_walk(_root(), ""))


def data_path(name: str) -> Path:
    """The installed path of the bundled data file ``name`` (as listed by
    :func:`bundled_data_files`).

    Raises:
        ProblemError: ``name`` is not a bundled file (one line, with a close
            name when there is one).
    """
    names = bundled_data_files()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ProblemError(
            f"no bundled data file {name!r:.80}{hint}; `pipedejavu data` lists "
            f"the {len(names)} names"
        )
    return Path(str(_root().joinpath(*name.split("/"))))


def add_parser(commands: Any) -> None:
    """Register ``data`` on the command line's sub-parsers."""
    data = commands.add_parser(
        "data",
        help="list the bundled data files, or print the installed path of one",
        description="Without NAME: list the data files shipped in the package "
        "(one name a line). With NAME: print its installed path, e.g. "
        'pipedejavu predict "$(pipedejavu data sailor/measured/gh200-opt350/'
        'plan_config_N16_D4.json)" --model OPT-350',
    )
    data.add_argument(
        "name", nargs="?", help="a name that `pipedejavu data` lists (optional)"
    )


def run(args: argparse.Namespace) -> None:
    """Print the names, or the path of ``args.name``."""
    if args.name is None:
        print("\n".join(bundled_data_files()))
    else:
        print(data_path(args.name))
