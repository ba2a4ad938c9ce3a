"""JAX's persistent compilation cache for the engine, safe under concurrency.

A new process pays XLA compilation for every jitted function it runs (seconds
per function on a small CPU). JAX can keep compiled executables on disk; this
module turns that on for the engine:

* **Where**: ``$PIPEDEJAVU_CACHE_DIR`` if set, else ``pipedejavu/jax`` under
  the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux,
  ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows); a ``cache_dir``
  argument overrides both. ``PIPEDEJAVU_CACHE_DIR=off`` (or ``cache_dir=False``)
  leaves JAX untouched. If the program already set JAX's own
  ``jax_compilation_cache_dir``, that setting is kept and used.
* **Safe to delete**: every entry is one file named by JAX's key (which covers
  the JAX version, backend, compile options and program); a missing or
  unreadable entry is a miss and is compiled (and written) again.
* **Safe under concurrent processes**: an entry is written to a temporary file
  in the same folder and renamed into place (atomic on POSIX and Windows), and
  carries a checksum that is verified on reading, so a reader never sees half
  an entry and a damaged one is a miss, never an error.

The cache is process-wide (JAX has one); only the engine's compilations are
written regardless of how long they took (``min_compile_time_secs = 0`` inside
:func:`compiling`), other code keeps JAX's defaults.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cache_folder", "compiling", "enable"]

ENV_VAR = "PIPEDEJAVU_CACHE_DIR"
_DIGEST = 16  # bytes of blake2b checksum in front of each entry
_lock = threading.Lock()
_enabled: list[Path | None] = []  # the folder once enable() has run


def cache_folder(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """The folder the cache would use (None: disabled).

    Args:
        cache_dir: a folder, ``False`` to disable, or ``None`` for the
            environment variable / the default under the user's cache folder.
    """
    if cache_dir is False:
        return None
    if cache_dir is None or cache_dir is True:
        value = os.environ.get(ENV_VAR)
        if value is not None:
            if value.strip().lower() in ("", "0", "off", "false", "none"):
                return None
            return Path(value).expanduser()
        if sys.platform == "win32":
            base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData")
        elif sys.platform == "darwin":
            base = Path.home() / "Library" / "Caches"
        else:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return base / "pipedejavu" / "jax"
    return Path(cache_dir).expanduser()


class _AtomicFileCache:
    """JAX's cache interface over one folder: atomic writes, checked reads."""

    def __init__(self, path: Path):
        self._path = path  # JAX logs ``_path``

    def get(self, key: str) -> bytes | None:
        try:
            data = (self._path / key).read_bytes()
        except OSError:
            return None
        digest, value = data[:_DIGEST], data[_DIGEST:]
        if hashlib.blake2b(value, digest_size=_DIGEST).digest() != digest:
            return None  # damaged or foreign: recompile (and overwrite)
        return value

    def put(self, key: str, value: bytes) -> None:
        try:
            self._path.mkdir(parents=True, exist_ok=True)
            digest = hashlib.blake2b(value, digest_size=_DIGEST).digest()
            handle, temporary = tempfile.mkstemp(dir=self._path, prefix=".tmp-")
            try:
                with os.fdopen(handle, "wb") as file:
                    file.write(digest + value)
                os.replace(temporary, self._path / key)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError:
            pass  # a read-only or full disk only costs the next compilation


def enable(cache_dir: str | os.PathLike | bool | None = None) -> Path | None:
    """Turn the persistent cache on for this process (once; later calls with
    another folder are ignored). Returns the folder in use, or None."""
    import jax

    with _lock:
        if _enabled:
            return _enabled[0]
        own = jax.config.jax_compilation_cache_dir
        if own:  # the program chose a cache: use it as it is
            _enabled.append(Path(own))
            return _enabled[0]
        folder = cache_folder(cache_dir)
        if folder is None:
            _enabled.append(None)
            return None
        try:
            from jax._src import compilation_cache
        except ImportError:  # pragma: no cover - JAX moved its internals
            compilation_cache = None
        jax.config.update("jax_compilation_cache_dir", str(folder))
        if compilation_cache is not None and hasattr(compilation_cache, "_cache"):
            with compilation_cache._cache_initialized_mutex:
                compilation_cache._cache = _AtomicFileCache(folder)
                compilation_cache._cache_initialized = True
                # Re-decide "is the cache used" (decided at the first compile).
                compilation_cache._cache_checked = False
                compilation_cache._cache_used = False
        _enabled.append(folder)
        return folder


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Within: every compilation is written to the cache, however short."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover
        yield
        return
    with config.persistent_cache_min_compile_time_secs(0.0):
        yield
