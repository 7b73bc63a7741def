"""Exceptions raised by kvcompress.

Every user-facing error names *where* the problem is (a YAML key path such as
``compressors[1].window.recent``), *what is allowed* and *what was given*, so
that the message alone tells the user what to change.
"""

from __future__ import annotations

from typing import Any


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
        msg = f"{path}: expected {allowed}, got {got!r}"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class PluginError(KVCompressError):
    """A plugin could not be loaded or breaks the hook specification."""


class UnsupportedModelError(KVCompressError):
    """The model's attention or cache layout cannot be compressed by kvcompress."""


class UnsupportedOperationError(KVCompressError, NotImplementedError):
    """A generation feature (beam search, cropping, ...) that a compressed cache cannot honour."""
