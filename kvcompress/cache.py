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
from .config import config_to_dict
from .env import check_environment
from .errors import ConfigError, PluginError, UnsupportedOperationError
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
    #: tensor-parallel ranks summed (``memory_report(all_ranks=True)``); 1: this process' own heads
    ranks: int = 1
    #: summed over ranks: the bytes of per-row bookkeeping (segments ending in ``" (rows)"``) that ranks other than
    #: the first hold as copies; the segments count it once, as one process holds it
    replicated_bytes: int = 0

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
        if self.ranks > 1:
            lines.append(f"summed over {self.ranks} tensor-parallel ranks: the whole model's KV heads, with the "
                         "per-row bookkeeping (segments marked (rows)) counted once; every rank holds its own copy "
                         f"of it, {self.replicated_bytes:,} bytes more in all "
                         f"({self.cache_bytes + self.replicated_bytes:,} bytes held by the ranks together)")
        if self.native_dtype != "float16" and self.cache_bytes:
            lines.append(f"the model runs in {self.native_dtype}: its dense cache would hold "
                         f"{self.dense_native_bytes:,} bytes, {self.dense_native_bytes / self.cache_bytes:.2f}x "
                         "what this cache holds")
        return "\n".join(lines)


#: Largest ``max_batch_size`` a static cache accepts (rows allocated at once).
MAX_BATCH_SIZE = 1 << 16


def _check_capacity(max_cache_len: Any, max_batch_size: Any, positions: int | None) -> None:
    for name, value, top in (("max_cache_len", max_cache_len, positions), ("max_batch_size", max_batch_size,
                                                                            MAX_BATCH_SIZE)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                                  or (top is not None and value > top)):
            limit = "" if top is None else f" <= {top}" + (" (the model's max_position_embeddings)"
                                                           if name == "max_cache_len" else "")
            raise ConfigError(name, f"a positive integer{limit} (or None)", value)
    if max_batch_size is not None and max_cache_len is None:
        raise ConfigError("max_batch_size", "None unless max_cache_len is given (it sizes a static cache)",
                          max_batch_size)


def max_positions(config: Any) -> int | None:
    """The model's ``max_position_embeddings`` (None when it declares none)."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_layout(layout: Any, stack: Stack, positions: int | None) -> None:
    """Refuse region sizes no prompt of the model can fill (they would be preallocated for nothing)."""
    if positions is None:
        return
    for region in ("sinks", "recent", "flush"):
        value = getattr(layout, region)
        if value is not None and value > positions:
            found = [f"{e.path}.{name}" for e in stack.entries for name, v in config_to_dict(e.config).items()
                     if type(v) is int and v == value]
            raise ConfigError(found[0] if found else f"(stack layout).{region}",
                              f"at most the model's max_position_embeddings ({positions}) tokens", value,
                              hint=f"the stack keeps {value:,} {region} tokens per row and layer, more than the model "
                                   "ever sees; they would be allocated for nothing")


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
        check_environment()
        stack = as_stack(stack)
        hf.check_model_supported(model)
        config = hf.text_config(model)
        positions = max_positions(config)
        _check_capacity(max_cache_len, max_batch_size, positions)
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
        self.shard = hf.head_shard(model)  # tensor parallelism: this rank compresses its own KV heads
        if self.shard is not None:
            q_heads, kv_heads = self.shard.local_q_heads, self.shard.local_kv_heads
        layout = hf.layer_layout(config)
        layers = []
        rope = hf.rope_inv_freq(model)
        for i, (layer_type, kwargs) in enumerate(layout):
            if layer_type in hf.COMPRESSED_LAYER_TYPES:
                info = LayerInfo(i, len(layout), kv_heads, q_heads, head_dim, config, rope, self.shard)
                self.pipeline.check_budgets(info, [e.path for e in stack.entries])
                if max_cache_len is None:
                    core = CompressedLayer(info, self.pipeline)
                else:
                    core = StaticLayer(info, self.pipeline, max_cache_len)
                _check_layout(core.layout, stack, positions)  # nothing is allocated yet
                layers.append(hf.CompressedCacheLayer(core, model.config))
            else:
                layers.append(hf.native_layer(layer_type, kwargs, max_cache_len))
        if not any(isinstance(layer, hf.CompressedCacheLayer) for layer in layers):
            from .errors import UnsupportedModelError

            raise UnsupportedModelError("the model has no full-attention layer for kvcompress to compress")
        super().__init__(layers=layers)
        self._first = next(i for i, layer in enumerate(layers) if isinstance(layer, hf.CompressedCacheLayer))
        self._num_layers, self._compresses = len(layers), bool(stack.entries)
        self._expect: list[Any] = [kv_heads, head_dim, None]  # what keys must be (the dtype is learnt on the first call)
        if max_batch_size is not None:
            dtype, device = hf.model_dtype_device(model)
            devices = hf.layer_devices(model)  # a model placed over devices: each layer's cache on its layer's
            for core in self.compressed_layers:
                core.allocate(max_batch_size, kv_heads, head_dim, head_dim, dtype,
                              devices.get(core.info.index, device))

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any):
        """transformers' ``Cache.update``, after the checks that keep a misused cache from running silently
        wrong, made once per forward call, at its first compressed layer (every compressed layer has the same
        geometry): a cache whose stack raised is unusable; a cache serves the model it was built for (layer
        count, KV heads, head dim, dtype); the bare cache (without ``kvcompress.compress``) refuses a
        left-padded batch of a compressing stack."""
        if layer_idx == self._first:
            self._check_call(key_states, args, kwargs)
        elif not 0 <= layer_idx < self._num_layers:
            raise UnsupportedOperationError(self._other_model(f"layer {layer_idx}, but the cache has "
                                                              f"{self._num_layers} layers"))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_call(self, key_states: Any, args: tuple, kwargs: dict) -> None:
        if self.pipeline.failed is not None:
            raise PluginError(f"this kvcompress cache is unusable: its stack failed earlier ({self.pipeline.failed}); "
                              "build a new cache")
        shape, expect = key_states.shape, self._expect
        if key_states.dtype is expect[2] and len(shape) == 4 and shape[1] == expect[0] and shape[3] == expect[1]:
            return
        shape = tuple(shape)
        if len(shape) != 4 or shape[1] != expect[0] or shape[3] != expect[1]:
            raise UnsupportedOperationError(self._other_model(
                f"keys of shape {shape}, but the cache holds {expect[0]} KV heads x head_dim {expect[1]}"))
        stored = _stored_dtype(self.layers[self._first].core)
        if stored is not None and key_states.dtype != stored:
            raise UnsupportedOperationError(self._other_model(f"{key_states.dtype} keys, but the cache holds {stored}"))
        # the first call (or the first after reset): the dtype is learnt; a bare cache refuses left padding
        if self._compresses and not self.reads_compressed() and _rows_misaligned(args, kwargs):
            raise UnsupportedOperationError(
                "this batch is left-padded (rows have different positions): a kvcompress.Cache used without the "
                "context manager cannot mask padding in what it keeps; use `with kvcompress.compress(model, stack) "
                "as cache: model.generate(..., cache=cache)`")
        expect[2] = key_states.dtype

    def reset(self) -> None:
        super().reset()
        self._expect[2] = None  # the next call is a first call again

    def plan_step(self) -> Any:
        """Plan the coming single-token decode step on the host (a static cache; ``None`` for a dynamic one).

        Returns a hashable key of the device program the step runs: the compressed layers that flush a block in
        it and those that still fill their sink slots.  A compiled step branches on the plan (one compiled variant
        per key, a CUDA graph each under :class:`kvcompress.GraphStep`, which calls this before and
        :meth:`finish_step` after every call), so steps that flush nothing run no flush kernels, and the host
        counts stay exact without reading the device.  Unplanned compiled steps (``generate``'s own compiled
        forward) offer a block every step and let the device decide.  Raises if the cache is full.
        """
        if not self.is_static:
            return None
        layers = self.compressed_layers
        try:
            plans = [core.plan_decode() for core in layers]
        except BaseException:
            self.finish_step(False)
            raise
        return (tuple(i for i, (flush, _) in enumerate(plans) if flush),
                tuple(i for i, (_, sinks) in enumerate(plans) if sinks))

    @property
    def step_planned(self) -> bool:
        """Whether a step planned by :meth:`plan_step` waits for its :meth:`finish_step`."""
        return self.is_static and any(core.step_planned for core in self.compressed_layers)

    def finish_step(self, completed: bool = True) -> None:
        """End the step planned by :meth:`plan_step`; ``completed=False`` (the call raised) makes the host counts
        unknown (read once from the device at the next plan)."""
        if self.is_static:
            for core in self.compressed_layers:
                core.finish_decode(completed)

    @staticmethod
    def _other_model(what: str) -> str:
        return (f"the model calling this kvcompress cache passes {what}: a cache serves the one model (and dtype) "
                "it was built for; build one per model")

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

    def memory_report(self, all_ranks: bool = False) -> MemoryReport:
        """Bytes this cache holds, by region, against the dense fp16 cache of the same tokens.

        Under tensor parallelism a rank's cache holds its own KV heads only: the report is this rank's (its bytes
        against the dense size of its heads).  ``all_ranks=True`` sums every rank's report - the whole model's
        bytes against its whole dense size - and is a collective: every rank of the tensor-parallel group must call
        it.  Without tensor parallelism both are the same report."""
        from .distributed import sum_reports

        if all_ranks:
            return sum_reports(self.memory_report(), self.shard)
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
                    like = _stored(core)
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


def _stored(core: Any) -> Any:
    """A full-precision buffer of an initialized core layer (its dtype is the cache's)."""
    return core.k if isinstance(core, StaticLayer) else core.sinks.k


def _stored_dtype(core: Any) -> Any:
    return _stored(core).dtype if core.is_initialized else None


def _rows_misaligned(args: tuple, kwargs: dict) -> bool:
    """Whether the rows of a ``cache.update`` call sit at different positions (a left-padded batch), from what
    the attention module passes along: ``kwargs={"position_ids": ...}`` (transformers 5.24) or a cache-kwargs
    dict with per-row RoPE ``cos`` (5.17).  False when the call carries neither."""
    extra = kwargs.get("kwargs") or kwargs.get("cache_kwargs") or next((a for a in args if isinstance(a, dict)), {})
    rows = extra.get("position_ids") if isinstance(extra, dict) else None
    if rows is None and isinstance(extra, dict):
        rows = extra.get("cos")
    if not hasattr(rows, "dim") or rows.dim() < 2 or rows.shape[0] < 2:
        return False
    return bool((rows != rows[:1]).any())
