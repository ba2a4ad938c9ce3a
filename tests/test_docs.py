"""The docs pages: their examples run, their commands parse, their numbers are current.

* every ```python block of docs/*.md runs as written in an empty folder;
* every ``pipedejavu ...`` command parses and names inputs a reader can find
  (the checks of tests/test_readme.py);
* every generated table and quoted number equals what ``benchmarks/tables.py``
  writes from ``benchmarks/results`` (so a stale page fails);
* every number quoted in prose is registered and equals its results file.
"""

from __future__ import annotations

import re

import pytest
from helpers import load_benchmark
from test_readme import (
    ROOT,
    bash_blocks,
    check_cli_command,
    cli_commands,
    python_blocks,
    run_python_block,
)

DOCS = sorted((ROOT / "docs").glob("*.md"))


tables = load_benchmark("tables")
BLOCKS = [
    (p.name, i, b) for p in DOCS for i, b in enumerate(python_blocks(p.read_text()))
]
COMMANDS = [(p.name, a, m) for p in DOCS for a, m in cli_commands(p.read_text())]


def test_the_docs_have_pages_and_examples():
    names = {p.name for p in DOCS}
    for page in (
        "exact-dp.md",
        "engine.md",
        "hetero.md",
        "costmodels.md",
        "megatron.md",
        "batch.md",
        "init-search.md",
        "cli.md",
        "benchmarks.md",
        "architecture.md",
        "api.md",
        "changelog.md",
    ):
        assert page in names
    assert len(BLOCKS) >= 5 and len(COMMANDS) >= 20
    assert sum(len(bash_blocks(p.read_text())) for p in DOCS) >= 8


@pytest.mark.parametrize(
    "page,index,code", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS]
)
def test_python_block_runs(tmp_path, page, index, code):
    run_python_block(code, tmp_path)


@pytest.mark.parametrize(
    "page,argv,made", COMMANDS, ids=[f"{p}: {' '.join(a)[:50]}" for p, a, _ in COMMANDS]
)
def test_cli_line_parses(page, argv, made):
    check_cli_command(argv, made)


@pytest.mark.parametrize("page", tables.pages(), ids=lambda p: p.name)
def test_generated_tables_are_current(page):
    text = page.read_text()
    assert tables.render(text) == text, (
        f"{page.name} is stale: run `python benchmarks/tables.py`"
    )


def test_every_table_is_used_and_names_its_source():
    text = "".join(p.read_text() for p in tables.pages())
    for name in tables.TABLES:
        assert f"<!-- results:{name} -->" in text, name
        assert (
            "*Source: `benchmarks/results/" in tables.TABLES[name]()
            or name == "headline"
        )


def test_quoted_numbers_match_their_results_files():
    """Each quoted number is registered (file, JSON path, format) and equals it."""
    seen = set()
    for page in tables.pages():
        for name, quoted in re.findall(
            r"<!-- value:([a-z0-9_]+) -->(.*?)<!-- /value -->", page.read_text(), re.S
        ):
            assert name in tables.VALUES, f"{page.name}: {name} is not registered"
            value = tables.VALUES[name]
            data = tables.load(value.file)
            for key in value.path:
                data = data[key]
            assert quoted == value.fmt(data), f"{page.name}: {name} says {quoted!r}"
            seen.add(name)
    assert seen == set(tables.VALUES), "registered but never quoted"


def test_results_without_date_or_machine_are_refused(tmp_path, monkeypatch):
    (tmp_path / "bare.json").write_text('{"rows": []}')
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="no date or machine"):
        tables.meta("bare.json")


def test_a_stale_page_is_caught():
    page = "<!-- results:mbs_choice -->\n| old |\n<!-- /results:mbs_choice -->"
    assert tables.render(page) != page
    assert "mbs_choice.json" in tables.render(page)
