"""Test-session settings shared by every test module."""

import importlib.resources
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The engine keeps compiled code in the user's cache folder; the tests (and the
# command-line runs they start) use a folder of their own instead.
os.environ.setdefault(
    "PIPEDEJAVU_CACHE_DIR", tempfile.mkdtemp(prefix="pipedejavu-test-cache-")
)

# Like the command line, the test session keeps compiled code on disk (in the
# folder above), so tests and the processes they start share it.
import pipedejavu  # noqa: E402

pipedejavu.enable_compilation_cache()


@pytest.fixture(scope="session")
def data_dir() -> Iterator[Path]:
    """The bundled copies in pipedejavu/data (never ../shared)."""
    with importlib.resources.as_file(
        importlib.resources.files("pipedejavu") / "data"
    ) as path:
        yield Path(path)
