"""Untrusted input files and output paths: refused in one line before anything is read or computed.

Used by stack files (YAML), calibration files (safetensors) and the command line's output options.
Input files must be regular files (a directory, a FIFO, ``/dev/zero`` or a socket is refused
without being opened: opening a FIFO blocks, reading ``/dev/zero`` never ends) of bounded size,
and are read with a bounded ``read`` (a file that grows while it is read is still cut at the cap).
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

from .errors import ConfigError, Phrase

ErrorFactory = Callable[[str, Any, "str | None"], Exception]


def mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str, what: str, max_bytes: int, error: ErrorFactory | None = None) -> int:
    """Size of ``path`` after checking that it exists, is a regular file and holds at most ``max_bytes``.

    ``what`` names the expected content ("YAML stack file"); ``error(allowed, got, hint)`` builds the
    exception (default: a :class:`ConfigError` whose key path is the file).
    """
    error = error or (lambda allowed, got, hint: ConfigError(path, allowed, got, hint=hint))
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"a readable {what}", path, exc.strerror or type(exc).__name__) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"a regular file ({what})", Phrase(_kind(st.st_mode)), None)
    if st.st_size > max_bytes:
        raise error(f"a {what} of at most {mib(max_bytes)}", Phrase(f"{st.st_size:,} bytes"),
                    "the size limit guards against files that would exhaust memory")
    return st.st_size


def read_bounded(path: str, what: str, max_bytes: int, error: ErrorFactory | None = None) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (checked before and while reading)."""
    error = error or (lambda allowed, got, hint: ConfigError(path, allowed, got, hint=hint))
    check_regular_file(path, what, max_bytes, error)
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"a readable {what}", path, exc.strerror or type(exc).__name__) from None
    if len(data) > max_bytes:
        raise error(f"a {what} of at most {mib(max_bytes)}", Phrase(f"more than {max_bytes:,} bytes"), None)
    return data


def check_output(option: str, path: str | None, suffix: str | None = None, make_parents: bool = False) -> None:
    """Refuse an output path that cannot be written, before any work starts (``None``: no output).

    ``make_parents``: the writer creates missing folders, so the nearest existing one must be writable.
    """
    if path is None:
        return
    if not path or path.endswith(os.sep):
        raise ConfigError(option, "a file path", path)
    if suffix and not path.endswith(suffix):
        raise ConfigError(option, f"a path ending in {suffix}", path)
    if os.path.isdir(path):
        raise ConfigError(option, "a file path", path, hint="it is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    while make_parents and not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        hint = f"{parent} is not a folder" if os.path.lexists(parent) else f"create {parent} first"
        raise ConfigError(option, "a path in an existing folder", path, hint=hint)
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(option, "a path you can write", path, hint="permission denied")
