"""``kvcompress.Cache``: a transformers ``Cache`` whose full-attention layers are compressed.

Built from a stack and a model: full-attention layers become
:class:`~kvcompress.layer.CompressedLayer`; every other layer type (sliding
window, chunked, linear attention) keeps transformers' own class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .adapters import hf
from .layer import CompressedLayer
from .stack import Stack, as_stack
from .state import LayerInfo


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


class Cache(hf.CacheBase):
    """A compressed KV cache for ``model`` following ``stack``.

    Use it through ``with kvcompress.compress(model, stack) as cache:`` (compressed
    reads, per-row masks), or pass it directly: ``model.generate(..., cache=Cache(stack, model))``
    (transformers' attention reads a transient full-precision copy; unpadded batches).
    """

    def __init__(self, stack: "Stack | str | Any", model: Any):
        stack = as_stack(stack)
        hf.check_model_supported(model)
        config = hf.text_config(model)
        self.stack = stack
        self.pipeline = stack.build()
        self._model_config = model.config
        q_heads, kv_heads, head_dim = hf.head_counts(config)
        layout = hf.layer_layout(config)
        layers = []
        for i, (layer_type, kwargs) in enumerate(layout):
            if layer_type in hf.COMPRESSED_LAYER_TYPES:
                info = LayerInfo(i, len(layout), kv_heads, q_heads, head_dim, config)
                layers.append(CompressedLayer(self, info))
            else:
                layers.append(hf.native_layer(layer_type, kwargs))
        if not any(isinstance(layer, CompressedLayer) for layer in layers):
            from .errors import UnsupportedModelError

            raise UnsupportedModelError("the model has no full-attention layer for kvcompress to compress")
        super().__init__(layers=layers)

    def reads_compressed(self) -> bool:
        """Whether the model currently reads this cache through kvcompress attention."""
        return hf.uses_kvcompress_attention(self._model_config)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def memory_report(self) -> MemoryReport:
        segments: dict[str, int] = {}
        dense = 0
        batch = 0
        elem, dtype = 2, "float16"
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                for name, n in layer.memory().items():
                    segments[name] = segments.get(name, 0) + n
                if layer.is_initialized:
                    batch = layer.batch_size
                    elem = layer.sinks.k.element_size()
                    dtype = str(layer.sinks.k.dtype).replace("torch.", "")
                    dense += batch * layer.seen * layer.info.num_kv_heads * layer.info.head_dim * 2 * 2
            elif getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False):
                n = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
                segments["native layers"] = segments.get("native layers", 0) + n
                dense += sum(t.numel() * 2 for t in (layer.keys, layer.values))
        report = MemoryReport(segments, dense, self.get_seq_length(self._first_compressed()), batch)
        report.dense_native_bytes = dense * elem // 2
        report.native_dtype = dtype
        return report

    def _first_compressed(self) -> int:
        return next(i for i, layer in enumerate(self.layers) if isinstance(layer, CompressedLayer))

    def __repr__(self) -> str:
        return f"kvcompress.Cache(stack={self.stack.label!r}, layers={len(self.layers)})"
