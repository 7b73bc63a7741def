"""The scoped entry point: ``with kvcompress.compress(model, stack) as cache``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .adapters import hf
from .cache import Cache
from .stack import as_stack


@contextlib.contextmanager
def compress(model: Any, stack: Any = None, max_cache_len: int | None = None,
             max_batch_size: int | None = None) -> Iterator[Cache]:
    """Compress ``model``'s KV cache with ``stack`` inside the ``with`` block.

    Yields a fresh :class:`kvcompress.Cache`; pass it to ``model.generate(..., cache=cache)``
    or to direct forward calls (``model(ids, cache=cache)``).  The model reads the
    compressed storage through kvcompress' registered attention, and ``generate``'s own compiled
    decode step (a static cache on CUDA) is planned by the cache step by step, as
    :class:`kvcompress.GraphStep` plans its steps.  On exit the model's previous attention
    implementation and ``get_compiled_call`` are restored.  Nothing else is changed.

    Args:
        model: a transformers causal LM.
        stack: a :class:`kvcompress.Stack`, a YAML path, a mapping, or ``None`` (no compression).
        max_cache_len: capacity in tokens: a static, compileable cache (see :class:`kvcompress.Cache`).
        max_batch_size: with ``max_cache_len``, allocate for this many rows now.
    """
    stack = as_stack(stack)
    cache = Cache(stack, model, max_cache_len=max_cache_len, max_batch_size=max_batch_size)
    with hf.attach(model):
        yield cache
