"""Base class for compressor objects (optional convenience for plugin authors).

A compressor is any object implementing hooks of
:class:`kvcompress.hookspecs.CacheCompressor` with ``@kvcompress.hookimpl``.
Subclassing :class:`Compressor` only stores the validated config and the name.
"""

from __future__ import annotations

from typing import Any


class Compressor:
    """Holds the validated config of one stack entry; subclasses implement hooks."""

    #: YAML name (set by subclasses).
    name: str = ""

    def __init__(self, config: Any):
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
