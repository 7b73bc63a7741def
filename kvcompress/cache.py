"""``kvcompress.Cache``: a transformers ``Cache`` whose full-attention layers are compressed.

Built from a stack and a model: full-attention layers hold core state -
:class:`~kvcompress.layer.CompressedLayer` (dynamic: grows as tokens arrive), or, given a capacity
(``max_cache_len``), :class:`~kvcompress.static.StaticLayer` (preallocated, device-side counters,
a graph-capturable decode step) - inside the adapter's transformers cache layer; every other layer
type (sliding window, chunked, linear attention) keeps transformers' own class (its static class
when the cache has a capacity).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from .adapters import hf
from .errors import ConfigError
from .layer import CompressedLayer
from .stack import Stack, as_stack
from .state import LayerInfo
from .static import StaticLayer


@dataclasses.dataclass
class MemoryReport:
    """Bytes held by a cache, by region, against the fp16 dense cache of the same tokens."""

    segments: dict[str, int]
    dense_fp16_bytes: int
    tokens: int
    batch: int
    dense_native_bytes: int = 0
    native_dtype: str = "float16"

    @property
    def cache_bytes(self) -> int:
        return sum(self.segments.values())

    @property
    def ratio(self) -> float:
        return self.dense_fp16_bytes / self.cache_bytes if self.cache_bytes else float("inf")

    def table(self) -> str:
        rows = [("segment", "bytes", "MiB")]
        for name, n in sorted(self.segments.items()):
            rows.append((name, f"{n:,}", f"{n / 2**20:.2f}"))
        rows.append(("total held", f"{self.cache_bytes:,}", f"{self.cache_bytes / 2**20:.2f}"))
        rows.append(("dense fp16 equivalent", f"{self.dense_fp16_bytes:,}", f"{self.dense_fp16_bytes / 2**20:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"compression ratio (dense fp16 / held): {self.ratio:.2f}x  "
                     f"({self.tokens} tokens x {self.batch} rows)")
        if self.native_dtype != "float16" and self.cache_bytes:
            lines.append(f"the model runs in {self.native_dtype}: its dense cache would hold "
                         f"{self.dense_native_bytes:,} bytes, {self.dense_native_bytes / self.cache_bytes:.2f}x "
                         "what this cache holds")
        return "\n".join(lines)


def _check_capacity(max_cache_len: Any, max_batch_size: Any) -> None:
    for name, value in (("max_cache_len", max_cache_len), ("max_batch_size", max_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(name, "a positive integer (or None)", value)
    if max_batch_size is not None and max_cache_len is None:
        raise ConfigError("max_batch_size", "None unless max_cache_len is given (it sizes a static cache)",
                          max_batch_size)


class Cache(hf.CacheBase):
    """A compressed KV cache for ``model`` following ``stack``.

    Use it through ``with kvcompress.compress(model, stack) as cache:`` (compressed
    reads, per-row masks), or pass it directly: ``model.generate(..., cache=Cache(stack, model))``
    (transformers' attention reads a transient full-precision copy; unpadded batches).

    Args:
        stack: a :class:`kvcompress.Stack`, a YAML path, a mapping, or ``None`` (no compression).
        model: the transformers causal LM the cache serves.
        max_cache_len: capacity in tokens (prompt + generated), as transformers' ``StaticCache``.  Given,
            every buffer is preallocated and the decode step is graph-capturable: the cache reports
            ``is_compileable = True`` (so ``generate`` on CUDA compiles its decode step) and works
            under ``torch.compile(model.forward, fullgraph=True)`` - read through kvcompress' attention
            (``kvcompress.compress``).  ``None``: the dynamic, eager cache.
        max_batch_size: with ``max_cache_len``, allocate now for this many rows (else on the first call).
    """

    def __init__(self, stack: "Stack | str | Any", model: Any, max_cache_len: int | None = None,
                 max_batch_size: int | None = None):
        _check_capacity(max_cache_len, max_batch_size)
        stack = as_stack(stack)
        hf.check_model_supported(model)
        config = hf.text_config(model)
        self.stack = stack
        self.pipeline = stack.build()
        self._model_config = model.config
        if max_cache_len is not None:
            unsafe = self.pipeline.not_graph_safe()
            if unsafe:
                names = "; ".join(f"{name!r} (hooks: {', '.join(hooks) or 'none'})" for name, hooks in unsafe)
                warnings.warn(
                    f"kvcompress: compressor {names} does not declare graph_safe = True, so this cache cannot "
                    "run a captured decode step: it is built as a dynamic cache and runs eagerly "
                    "(is_compileable = False; max_cache_len is ignored)", stacklevel=2)
                max_cache_len = max_batch_size = None
        self.capacity = max_cache_len  # (transformers 5.17's Cache has a read-only max_cache_len)
        q_heads, kv_heads, head_dim = hf.head_counts(config)
        layout = hf.layer_layout(config)
        layers = []
        for i, (layer_type, kwargs) in enumerate(layout):
            if layer_type in hf.COMPRESSED_LAYER_TYPES:
                info = LayerInfo(i, len(layout), kv_heads, q_heads, head_dim, config)
                if max_cache_len is None:
                    core = CompressedLayer(info, self.pipeline)
                else:
                    core = StaticLayer(info, self.pipeline, max_cache_len)
                layers.append(hf.CompressedCacheLayer(core, model.config))
            else:
                layers.append(hf.native_layer(layer_type, kwargs, max_cache_len))
        if not any(isinstance(layer, hf.CompressedCacheLayer) for layer in layers):
            from .errors import UnsupportedModelError

            raise UnsupportedModelError("the model has no full-attention layer for kvcompress to compress")
        super().__init__(layers=layers)
        if max_batch_size is not None:
            dtype, device = hf.model_dtype_device(model)
            for core in self.compressed_layers:
                core.allocate(max_batch_size, kv_heads, head_dim, head_dim, dtype, device)

    def reads_compressed(self) -> bool:
        """Whether the model currently reads this cache through kvcompress attention."""
        return hf.uses_kvcompress_attention(self._model_config)

    @property
    def is_static(self) -> bool:
        """Whether this cache has a capacity (preallocated, graph-capturable decode)."""
        return self.capacity is not None

    @property
    def compressed_layers(self) -> list[Any]:
        """The core state of every compressed layer (what compressor hooks receive as ``layer``)."""
        return [layer.core for layer in self.layers if isinstance(layer, hf.CompressedCacheLayer)]

    def memory_report(self) -> MemoryReport:
        segments: dict[str, int] = {}
        dense = 0
        batch = 0
        elem, dtype = 2, "float16"
        for layer in self.layers:
            if isinstance(layer, hf.CompressedCacheLayer):
                core = layer.core
                for name, n in core.memory().items():
                    segments[name] = segments.get(name, 0) + n
                if core.is_initialized:
                    batch = core.batch_size
                    like = core.k if isinstance(core, StaticLayer) else core.sinks.k
                    elem = like.element_size()
                    dtype = str(like.dtype).replace("torch.", "")
                    dense += batch * core.tokens_seen() * core.info.num_kv_heads * core.info.head_dim * 2 * 2
            elif getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False):
                n = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
                segments["native layers"] = segments.get("native layers", 0) + n
                dense += sum(t.numel() * 2 for t in (layer.keys, layer.values))
        first = self.compressed_layers[0]
        report = MemoryReport(segments, dense, first.tokens_seen() if first.is_initialized else 0, batch)
        report.dense_native_bytes = dense * elem // 2
        report.native_dtype = dtype
        return report

    def __repr__(self) -> str:
        return f"kvcompress.Cache(stack={self.stack.label!r}, layers={len(self.layers)})"
