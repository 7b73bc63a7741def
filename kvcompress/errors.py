"""Exceptions raised by kvcompress.

Every user-facing error names *where* the problem is (a YAML key path such as
``compressors[1].window.recent``, a file, an option, a plugin), *what is allowed* and
*what was given*, so that the message alone tells the user what to change.  Messages are
one line and never quote unbounded user data: values go through :func:`bounded`, free
text through :func:`shorten`.
"""

from __future__ import annotations

import reprlib
from typing import Any

#: Longest quoted value, key path and hint (characters) an error message carries.
MAX_VALUE_CHARS = 200
MAX_TEXT_CHARS = 400

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def shorten(text: Any, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` on one line, cut to at most ``limit`` characters (``...`` marks the cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bounded(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A ``repr`` of ``value`` whose work and length are bounded (nested and shared data is never expanded
    past a few levels and items: a YAML alias bomb costs no more than a short list)."""
    return shorten(_REPR.repr(value), limit)


class Phrase(str):
    """A description of what was given ("a character device"), shown unquoted where a value would be quoted."""

    def __repr__(self) -> str:
        return str(self)


class KVCompressError(Exception):
    """Base class of every error kvcompress raises on purpose."""


class ConfigError(KVCompressError, ValueError):
    """A stack or compressor configuration is invalid.

    Args:
        path: key path of the offending entry, e.g. ``compressors[1].window.recent``.
        allowed: human-readable description of the allowed values.
        got: the value that was given.
        hint: optional extra sentence telling the user what to do.
    """

    def __init__(self, path: str, allowed: str, got: Any = None, hint: str | None = None):
        self.path = path
        self.allowed = allowed
        self.got = got
        self.hint = hint
        msg = f"{shorten(path, MAX_VALUE_CHARS)}: expected {shorten(allowed)}, got {bounded(got)}"
        if hint:
            msg += f". {shorten(hint)}"
        super().__init__(msg)


class PluginError(KVCompressError):
    """A plugin could not be loaded, breaks the hook specification, or raised in a hook."""

    def __init__(self, message: str):
        super().__init__(shorten(message, 2 * MAX_TEXT_CHARS))


class UnsupportedModelError(KVCompressError):
    """The model's attention or cache layout cannot be compressed by kvcompress."""


class UnsupportedOperationError(KVCompressError, NotImplementedError):
    """A generation feature (beam search, cropping, ...) that a compressed cache cannot honour."""


class KVCompressWarning(UserWarning):
    """Something kvcompress skipped or could not check, said once (e.g. a plugin that failed to load)."""
