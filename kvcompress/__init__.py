"""kvcompress: composable, real KV-cache compression for Hugging Face causal LMs.

Public API::

    stack = kvcompress.load_stack("stack.yaml")
    with kvcompress.compress(model, stack) as cache:
        model.generate(**inputs, cache=cache)

Importing this package has no side effects: no plugin is loaded, nothing in
transformers is registered or patched until a stack or cache is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .compressor import Compressor
from .config import param
from .errors import ConfigError, KVCompressError, PluginError, UnsupportedModelError, UnsupportedOperationError
from .graphs import GraphStep
from .hookspecs import hookimpl
from .observe import Observation
from .registry import CompressorSpec
from .scoring import ScoreConfig, ScoreEvictor
from .state import (HeadGroup, KVBlock, LabelTopK, LayerInfo, Layout, LinearQueryMap, MiddleStore, Segment,
                    TokenSelection)
from .stack import Stack, load_stack, parse_stack

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from .cache import Cache


def __getattr__(name: str) -> Any:
    # transformers is imported lazily, on first use of the cache or the context manager.
    if name == "Cache":
        from .cache import Cache

        return Cache
    if name == "compress":
        from .api import compress

        return compress
    raise AttributeError(f"module 'kvcompress' has no attribute {name!r}")


__all__ = [
    "Cache", "Compressor", "CompressorSpec", "ConfigError", "GraphStep", "HeadGroup", "KVBlock", "KVCompressError",
    "LabelTopK", "LayerInfo", "Layout", "LinearQueryMap", "MiddleStore", "Observation", "PluginError", "ScoreConfig", "ScoreEvictor",
    "Segment", "Stack", "TokenSelection", "UnsupportedModelError",
    "UnsupportedOperationError", "compress", "hookimpl", "load_stack", "param", "parse_stack",
]
