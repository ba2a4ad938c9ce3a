"""The README's examples, as a new user meets them.

Every ```python block runs as written, in its own process, in an empty folder.
Every ``pipedejavu ...`` command of the ```bash blocks is split as the shell
splits it (quotes, comments, line continuations, ``&&``, pipes, redirections)
and parsed with the real command-line parser (running them all would take
minutes); pseudo-syntax such as ``[--json]`` is not shell and fails. Every file
a command reads must come from somewhere the reader can see: a bundled example
or cluster by name, a path in this repository, a bundled data file by
``"$(pipedejavu data NAME)"`` (the substituted command is checked too), or a
file an earlier line of the same block writes (a redirection, ``convert``'s
output, ``--out``).

tests/test_docs.py applies the same checks to the docs pages.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import run_python

from pipedejavu.cli.data import bundled_data_files
from pipedejavu.cli.main import _build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Arguments that name a file the command reads.
INPUT_DESTS = (
    "problem",
    "cluster_file",
    "plan",
    "torchtitan_config",
    "stage_profile",
    "steps",
    "perf",
    "config",
)
#: Arguments that name a file the command writes.
OUTPUT_DESTS = ("output", "out")
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "<<", "2>", "&>"}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _drop_heredocs(block: str) -> str:
    """A heredoc's body is data, not commands: keep only its first line."""
    out, lines = [], iter(block.splitlines())
    for line in lines:
        out.append(line)
        m = re.search(r"<<-?\s*'?\"?(\w+)", line)
        if m:
            for body in lines:
                if body.strip() == m.group(1):
                    break
    return "\n".join(out)


#: A command substitution ``$(...)`` (not nested).
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")


def _hold_substitutions(line: str, commands: list) -> tuple[str, list[str]]:
    """``line`` with each ``$(...)`` replaced by a placeholder word, and the
    substitutions; their commands are appended to ``commands``."""
    inner: list[str] = []

    def hold(match: re.Match) -> str:
        inner.append(match.group(0))
        commands.extend(shell_commands(match.group(1)))
        return f"@@SUBST{len(inner) - 1}@@"

    return SUBSTITUTION.sub(hold, line), inner


def _restore_substitutions(token: str, inner: list[str]) -> str:
    return re.sub(r"@@SUBST(\d+)@@", lambda m: inner[int(m.group(1))], token)


def shell_commands(block: str) -> list[tuple[list[str], list[str]]]:
    """``(argv, files written by redirection)`` for every simple command.

    A command substitution ``$(command)`` stays one argument, written as is
    (``"$(pipedejavu data NAME)"``), and its command comes first in the list,
    as the shell runs it first.
    """
    text = _drop_heredocs(block).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line, inner = _hold_substitutions(line, commands)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        written: list[str] = []
        tokens = [_restore_substitutions(token, inner) for token in lexer]
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token in SEPARATORS:
                if argv:
                    commands.append((argv, written))
                argv, written = [], []
            elif token in REDIRECTS and i + 1 < len(tokens):
                if token not in ("<", "<<"):
                    written.append(tokens[i + 1])
                i += 1
            else:
                argv.append(token)
            i += 1
        if argv:
            commands.append((argv, written))
    return commands


def cli_commands(text: str) -> list[tuple[list[str], set[str]]]:
    """``(pipedejavu's arguments, files the earlier lines of the block made)``."""
    found = []
    for block in bash_blocks(text):
        made: set[str] = set()
        for argv, written in shell_commands(block):
            if argv[0] == "pipedejavu":
                found.append((argv[1:], set(made)))
            made.update(written)
            made.update(a for a in argv[1:] if not a.startswith("-"))
    return found


def _looks_like_a_file(value: str) -> bool:
    return "/" in value or bool(re.search(r"\.\w+$", value)) or "$(" in value


def _bundled(value: str) -> bool:
    """``$(pipedejavu data NAME)`` of a bundled NAME: a file every install has."""
    match = re.fullmatch(r"\$\(\s*pipedejavu\s+data\s+(\S+)\s*\)", value)
    return bool(match) and match.group(1) in bundled_data_files()


def check_cli_command(argv: list[str], made: set[str]) -> None:
    if argv in (["--version"], ["--help"]):
        return
    args = _build_parser().parse_args(argv)
    assert args.command == argv[0]
    if args.command == "data" and args.name is not None:
        assert args.name in bundled_data_files(), (
            f"pipedejavu {' '.join(argv)}: {args.name!r} is not a bundled data "
            "file (`pipedejavu data` lists them)"
        )
    for dest in INPUT_DESTS:
        value = getattr(args, dest, None)
        if not isinstance(value, str) or not _looks_like_a_file(value):
            continue  # a bundled example or cluster by name
        assert value in made or (ROOT / value).exists() or _bundled(value), (
            f"pipedejavu {' '.join(argv)}: where does {value!r} come from? Name a "
            "bundled example, a repository path, or write it earlier in the block"
        )


def run_python_block(code: str, cwd: Path) -> None:
    result = run_python("-c", code, cwd=cwd, timeout=600)
    assert "Traceback" not in result.stderr


TEXT = README.read_text()
PYTHON_BLOCKS = python_blocks(TEXT)
COMMANDS = cli_commands(TEXT)


def test_the_readme_has_examples():
    assert len(PYTHON_BLOCKS) >= 3
    assert len(COMMANDS) >= 8


def test_the_readme_is_a_front_door():
    assert len(TEXT.splitlines()) <= 250
    for command in ('pip install ".[test]"', "pipedejavu demo", "python -m pytest -q"):
        assert command in TEXT


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs_as_written_in_an_empty_folder(tmp_path, index):
    run_python_block(PYTHON_BLOCKS[index], tmp_path)


@pytest.mark.parametrize(
    "argv,made", COMMANDS, ids=[" ".join(a)[:60] for a, _ in COMMANDS]
)
def test_cli_line_parses(argv, made):
    check_cli_command(argv, made)


def test_the_shell_splitting():
    """Quotes, comments, chains and redirections are split as bash would."""
    block = (
        "pipedejavu plan --gpus 'GH-96:16' --json > 'my plan.json'  # a comment [x]\n"
        "pipedejavu predict 'my plan.json' && pipedejavu solve x.npz | head\n"
        "cat > steps.csv <<CSV\n1,2\n[not a command]\nCSV\n"
        "pipedejavu compare gpt1.3b-6layers-B128 \\\n    --methods dp,greedy\n"
    )
    assert shell_commands(block) == [
        (["pipedejavu", "plan", "--gpus", "GH-96:16", "--json"], ["my plan.json"]),
        (["pipedejavu", "predict", "my plan.json"], []),
        (["pipedejavu", "solve", "x.npz"], []),
        (["head"], []),
        (["cat"], ["steps.csv"]),
        (
            ["pipedejavu", "compare", "gpt1.3b-6layers-B128", "--methods", "dp,greedy"],
            [],
        ),
    ]
    commands = cli_commands(f"```bash\n{block}```")
    check_cli_command(*commands[1])  # written by the line before
    with pytest.raises(AssertionError, match="where does 'x.npz' come from"):
        check_cli_command(*commands[2])
    with pytest.raises(SystemExit):  # pseudo-syntax is not shell: it fails
        check_cli_command(
            ["compare", "gpt1.3b-6layers-B128", "[--json", "|", "--csv]"], set()
        )


def test_command_substitution_of_a_bundled_data_file():
    name = "sailor/measured/gh200-opt350/plan_config_N16_D4.json"
    block = (
        f'pipedejavu predict "$(pipedejavu data {name})" --model OPT-350  # x\n'
        "pipedejavu predict $(pipedejavu data nothing.json) | head\n"
    )
    assert shell_commands(block) == [
        (["pipedejavu", "data", name], []),
        (
            [
                "pipedejavu",
                "predict",
                f"$(pipedejavu data {name})",
                "--model",
                "OPT-350",
            ],
            [],
        ),
        (["pipedejavu", "data", "nothing.json"], []),
        (["pipedejavu", "predict", "$(pipedejavu data nothing.json)"], []),
        (["head"], []),
    ]
    commands = cli_commands(f"```bash\n{block}```")
    check_cli_command(*commands[0])
    check_cli_command(*commands[1])  # the substituted path is a bundled file
    with pytest.raises(AssertionError, match="'nothing.json' is not a bundled"):
        check_cli_command(*commands[2])
    with pytest.raises(AssertionError, match="where does"):
        check_cli_command(*commands[3])
