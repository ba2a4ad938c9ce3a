"""The README's examples, as a new user meets them.

Every ```python block runs as written, in its own process, in an empty folder;
every ``pipedejavu ...`` line of the ```bash blocks parses with the real
command-line parser (running them all would take minutes).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipedejavu.cli.main import _build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", TEXT, re.S)


def _command_lines() -> list[str]:
    lines = []
    for block in BASH_BLOCKS:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].split(" > ")[0].strip()  # no comment, no >
            if line.startswith("pipedejavu ") and "[" not in line:
                lines.append(line)
    return lines


def test_the_readme_has_examples():
    assert len(PYTHON_BLOCKS) >= 3
    assert len(_command_lines()) >= 15


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs_as_written_in_an_empty_folder(tmp_path, index):
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[index]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("line", _command_lines())
def test_cli_line_parses(line):
    argv = shlex.split(line)[1:]
    if argv in (["--version"],):
        return
    args = _build_parser().parse_args(argv)
    assert args.command == argv[0]
