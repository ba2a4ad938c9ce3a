"""JAX's persistent compilation cache, switched on only when asked.

A new process pays XLA compilation for every jitted function it runs (seconds
per function on a small CPU). JAX can keep compiled executables on disk. The
library never turns that on by itself: ``search()``, ``solve()`` and every other
library call leave JAX's global configuration as they found it. Two callers
switch it on, both through :func:`enable_compilation_cache`:

* the command line (``pipedejavu ...``), at the start of every command;
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
``jax_compilation_cache_dir`` and ``jax_persistent_cache_min_compile_time_secs``);
entries are JAX's own files, named by JAX's key (JAX version, backend, compile
options and program), so the folder is safe to delete.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ENV_VAR", "cache_folder", "enable_compilation_cache"]

#: The environment variable naming the cache folder (or ``off``).
ENV_VAR = "PIPEDEJAVU_CACHE_DIR"

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
