"""Every notebook executes headlessly, top to bottom, without an error, and the
docs site runs them at its build, so its pages show their outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def docs_notebook_options() -> dict[str, str]:
    """The mkdocs-jupyter options of mkdocs.yml, as written (no YAML reader in
    the test extra): the ``key: value`` lines indented under the plugin."""
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index("  - mkdocs-jupyter:") + 1
    options = {}
    for line in lines[start:]:
        if not line.startswith("      "):
            break
        key, _, value = line.strip().partition(":")
        options[key] = value.strip()
    return options


def test_there_are_notebooks():
    names = {path.name for path in NOTEBOOKS}
    assert {"compare_dp.ipynb", "costmodel.ipynb"} <= names


def test_the_docs_build_executes_the_notebooks():
    # Committed without outputs (below), the notebooks show outputs in the docs
    # only if the build runs them; an error must fail the build, and a cached
    # page would show the outputs of older code (its key is the notebook alone).
    options = docs_notebook_options()
    assert options.get("execute") == "true", options
    assert options.get("allow_errors") == "false", options
    assert options.get("cache") == "false", options


@pytest.mark.slow
def test_the_docs_page_of_a_notebook_has_its_outputs():
    convert = pytest.importorskip("mkdocs_jupyter.convert")  # the docs extra
    options = docs_notebook_options()
    path = ROOT / "notebooks" / "plan_megatron.ipynb"  # the quickest to run
    page = convert.nb2html(
        str(path),
        execute=options.get("execute") == "true",
        allow_errors=options.get("allow_errors") != "false",
    )
    notebook = nbformat.read(path, as_version=4)
    code_cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    # every code cell of this notebook prints
    assert page.count('class="jp-OutputArea-child') == code_cells
    assert "predicted iteration time" in page
    assert "proven optimal under the predictor: True" in page


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError with the cell and traceback
    text = [
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    ]
    assert any(text), "the notebook printed nothing"
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors
