"""Names a package loads from its submodules on first use (PEP 562), so that
importing the package (or one of its light modules) does not import the heavy
ones: JAX, the solvers."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: each of ``names``
    (``{name: submodule}``, the submodule relative to ``package``) imported
    from its submodule when first read; any other name an
    :class:`AttributeError` worded as Python's."""

    def __getattr__(name: str) -> object:
        if name in names:
            return getattr(importlib.import_module(f".{names[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
