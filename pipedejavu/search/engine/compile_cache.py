"""JAX's persistent compilation cache, switched on only when asked.

A new process pays XLA compilation for every jitted function it runs (seconds
per function on a small CPU). JAX can keep compiled executables on disk. The
library never turns that on by itself: ``search()``, ``solve()`` and every other
library call leave JAX's global configuration as they found it. Two callers
switch it on:

* the command line (``pipedejavu ...``), around every command, through
  :func:`cache_when_jax_loads`: the cache is on for whatever JAX the command
  runs, and a command that runs no JAX (``solve`` with the exact DP,
  ``--help``) never imports JAX for it;
* a program that calls ``pipedejavu.enable_compilation_cache()`` itself (call it
  before the first JAX compilation of the process: JAX decides at its first
  compilation whether the cache is used).

**Where**: the ``path`` argument, else ``$PIPEDEJAVU_CACHE_DIR`` if set, else
``pipedejavu/jax`` under the user's cache folder (``$XDG_CACHE_HOME`` or
``~/.cache`` on Linux, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on
Windows). ``PIPEDEJAVU_CACHE_DIR=off`` (also ``0``, ``false``, ``none`` or empty)
leaves JAX untouched.

**A cache the user configured wins**: if ``jax_compilation_cache_dir`` is
already set (by ``jax.config.update``, ``JAX_COMPILATION_CACHE_DIR`` or a
command-line flag), nothing is changed and that folder is returned.

Only public JAX configuration is used (``jax.config.update`` of
``jax_compilation_cache_dir`` and ``jax_persistent_cache_min_compile_time_secs``,
or their environment variables, which JAX reads when it is imported);
entries are JAX's own files, named by JAX's key (JAX version, backend, compile
options and program), so the folder is safe to delete.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "JAX_ENV_VARS",
    "cache_folder",
    "cache_when_jax_loads",
    "enable_compilation_cache",
]

#: The environment variable naming the cache folder (or ``off``).
ENV_VAR = "PIPEDEJAVU_CACHE_DIR"

#: JAX's own environment variables for the folder and the minimum compile time
#: of an entry (read by JAX when it is imported).
JAX_ENV_VARS = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
)

_OFF = ("", "0", "off", "false", "none")


def cache_folder(path: str | os.PathLike | None = None) -> Path | None:
    """The folder :func:`enable_compilation_cache` would use (None: off).

    Args:
        path: a folder; ``None`` for ``$PIPEDEJAVU_CACHE_DIR`` or the default
            under the user's cache folder.
    """
    if path is not None:
        return Path(path).expanduser()
    value = os.environ.get(ENV_VAR)
    if value is not None:
        if value.strip().lower() in _OFF:
            return None
        return Path(value).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pipedejavu" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Switch JAX's persistent compilation cache on for this process.

    Sets ``jax_compilation_cache_dir`` to ``path`` (default: see
    :func:`cache_folder`) and ``jax_persistent_cache_min_compile_time_secs`` to
    0, so the many small functions of the engine are kept too. Does nothing
    when a cache folder is already configured, or when the folder resolves to
    off (``PIPEDEJAVU_CACHE_DIR=off``). Call it before the process's first JAX
    compilation.

    Returns:
        The folder in use (the one already configured, if any), or None when
        the cache stays off.
    """
    import jax

    own = jax.config.jax_compilation_cache_dir
    if own:  # the user chose a cache: keep it, and its settings, as they are
        return Path(own)
    folder = cache_folder(path)
    if folder is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


@contextlib.contextmanager
def cache_when_jax_loads(
    path: str | os.PathLike | None = None,
) -> Iterator[Path | None]:
    """Within the block, the compilation cache is on for any JAX the block
    runs, and JAX is not imported for it.

    With JAX already imported, this is :func:`enable_compilation_cache`.
    Otherwise the block runs with JAX's own environment variables
    (:data:`JAX_ENV_VARS`) set to what :func:`enable_compilation_cache` would
    configure, so a JAX imported in the block starts with the cache on, and
    the variables are put back as they were when the block ends. A folder in
    ``$JAX_COMPILATION_CACHE_DIR`` is the user's and wins; off as in
    :func:`cache_folder`. Processes the block starts inherit the variables.

    Yields:
        The folder a JAX imported in the block uses, or None when the cache
        stays off.
    """
    if "jax" in sys.modules:
        yield enable_compilation_cache(path)
        return
    own = os.environ.get(JAX_ENV_VARS[0])
    folder = Path(own) if own else cache_folder(path)
    if own or folder is None:
        yield folder
        return
    saved = {name: os.environ.get(name) for name in JAX_ENV_VARS}
    os.environ[JAX_ENV_VARS[0]] = str(folder)
    os.environ[JAX_ENV_VARS[1]] = "0"
    try:
        yield folder
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
