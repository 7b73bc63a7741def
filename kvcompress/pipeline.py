"""A built stack: compressor objects plus their hook implementations, resolved once.

Each :class:`StackPipeline` owns a private :class:`pluggy.PluginManager` holding
only the stack's compressors, checked against :class:`~kvcompress.hookspecs.CacheCompressor`
(misspelled hook names fail with ``check_pending``).  The implementations of each
hook are resolved once, in stack order, into plain callables: the per-layer
lifecycle events below call them directly, without a pluggy dispatch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pluggy
import torch

from .errors import ConfigError, KVCompressError, PluginError
from .hookspecs import PROJECT, CacheCompressor
from .state import DenseStore, KVBlock, LayerInfo, Layout, MiddleStore

_STAGES = (
    "kvcompress_validate_stack",
    "kvcompress_layer_layout",
    "kvcompress_observe",
    "kvcompress_score_tokens",
    "kvcompress_evict_tokens",
    "kvcompress_prune_channels",
    "kvcompress_lowrank_transform",
    "kvcompress_regroup_heads",
    "kvcompress_quantize_store",
    "kvcompress_middle_codec",
    "kvcompress_middle_store",
    "kvcompress_select_tokens",
)


def _bind(impl: pluggy.HookImpl, owner: int, name: str, stage: str, pipeline: "StackPipeline") -> Callable[..., Any]:
    """A plain callable for one hook implementation.  An exception it raises marks ``pipeline`` failed (the
    cache that runs it is unusable from then on); one that is not a :class:`KVCompressError` becomes one
    :class:`PluginError` naming the compressor and the hook (try/except costs nothing until something
    raises, and torch.compile traces through it)."""
    fn, names = impl.function, tuple(impl.argnames)

    def call(**kwargs: Any) -> Any:
        try:
            return fn(*[kwargs[n] for n in names])
        except Exception as exc:
            error = pipeline.failure(f"compressor {name} raised in hook {stage}", exc)
            if error is exc:
                raise
            raise error from exc

    call.__name__ = getattr(fn, "__qualname__", "hook")
    call.owner = owner  # the compressor's index in the stack
    return call


class StackPipeline:
    """Compressor objects of one stack and their resolved hook implementations."""

    def __init__(self, compressors: Sequence[tuple[str, Any]], sources: Sequence[str] | None = None):
        self.compressors = list(compressors)
        #: where each compressor comes from ("built-in", "<distribution> <version>"), named in hook errors
        self.sources = list(sources) if sources is not None else [""] * len(self.compressors)
        self.failed: Exception | None = None  # set when a hook raised: the caches running this stack are unusable
        #: (attention mask, first position, tokens, validity) of the current forward call, shared by the layers of
        #: the cache running this pipeline (:meth:`kvcompress.layer.CompressedLayer.attend`: one mask read per call)
        self.step_validity: tuple | None = None
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(CacheCompressor)
        order: dict[int, int] = {}
        for i, (name, obj) in enumerate(self.compressors):
            try:
                self.pm.register(obj, name=f"{i}:{name}")
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginError(f"compressor {name!r} breaks the hook specification: {exc}") from exc
            order[id(obj)] = i
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"unknown hook implemented by a compressor: {exc}") from exc
        self.stages: dict[str, list[Callable[..., Any]]] = {}
        for stage in _STAGES:
            impls = getattr(self.pm.hook, stage).get_hookimpls()
            impls = sorted(impls, key=lambda im: order[id(im.plugin)])
            self.stages[stage] = [_bind(im, order[id(im.plugin)], self._label(order[id(im.plugin)]), stage, self)
                                  for im in impls]
        self._transforms = (self.stages["kvcompress_prune_channels"] + self.stages["kvcompress_lowrank_transform"]
                            + self.stages["kvcompress_regroup_heads"])

    def failure(self, where: str, exc: Exception) -> Exception:
        """Mark the stack failed (the caches running it refuse further use); return what to raise: a
        :class:`KVCompressError` as it is, anything else as one :class:`PluginError` saying ``where``."""
        error = exc if isinstance(exc, KVCompressError) else PluginError(f"{where}: {type(exc).__name__}: {exc}")
        self.failed = error
        return error

    def _label(self, i: int) -> str:
        name, source = repr(self.compressors[i][0]), self.sources[i]
        return f"{name} ({source})" if source else name

    # -- build time ---------------------------------------------------------------------
    def layouts(self, info: LayerInfo) -> list[tuple[int, Layout]]:
        """``(compressor index, layout)`` of each compressor that declares one for this layer."""
        out = [(fn.owner, fn(layer=info)) for fn in self.stages["kvcompress_layer_layout"]]
        return [(i, lay) for i, lay in out if lay is not None]

    def check_budgets(self, info: LayerInfo, paths: Sequence[str]) -> None:
        """Refuse a stack whose full-precision regions swallow a token budget.

        Layouts combine by maximum (sinks, recent window), so a quantizer's window can be larger than an
        evictor's whole budget (``window {recent: 100}`` + ``kivi {residual: 128}``): the evictor would keep
        no middle token and the row would hold more than the budget. ``paths``: each compressor's key path
        in the stack (``compressors[1].kivi``), named in the error.
        """
        layouts = self.layouts(info)
        sinks = max([lay.sinks or 0 for _, lay in layouts], default=0)
        recent = max([lay.recent or 0 for _, lay in layouts], default=0)

        def who(field: str, value: int) -> str:
            for i, lay in layouts:
                if (getattr(lay, field) or 0) == value:
                    return paths[i] if 0 <= i < len(paths) else "the stack"
            return "the stack"

        for i, lay in layouts:
            if lay.budget is None or lay.budget > sinks + recent:
                continue
            path = paths[i] if 0 <= i < len(paths) else "the stack"
            raise ConfigError(
                path, f"a token budget above the full-precision regions the stack keeps per row ({sinks} sinks "
                f"from {who('sinks', sinks)} + a recent window of {recent} from {who('recent', recent)} = "
                f"{sinks + recent})", f"a budget of {lay.budget} tokens",
                hint="The budget would keep no middle token and the row would hold more than it; raise the "
                     "budget or shrink the other compressor's window")

    def validate_stack(self, entries: list[tuple[str, Any]], axes: list[str]) -> None:
        """Every compressor's ``kvcompress_validate_stack`` (cross-compressor rules, before any model)."""
        for fn in self.stages["kvcompress_validate_stack"]:
            fn(entries=entries, axes=axes)

    def layout(self, info: LayerInfo) -> Layout:
        return Layout.combine(fn(layer=info) for fn in self.stages["kvcompress_layer_layout"])

    def make_store(self, layer: Any) -> MiddleStore:
        """The layer's middle store (:meth:`_build_store`), switched to per-head slots when a layout of the stack
        asks for them (``Layout.head_slots``); a store that cannot honour them is refused here, when the cache is
        built, naming the compressors involved."""
        store = self._build_store(layer)
        if getattr(layer.layout, "head_valid", False):
            if not getattr(store, "supports_head_valid", False):
                raise self._store_refusal(
                    layer, store, "head_valid", "a middle store that keeps a per-head validity (adaptive per-head "
                    "budgets): full precision, dynamic or static cache",
                    "schedule 'adaptive' gives the kv heads of a row different numbers of tokens; use schedule "
                    "'uniform' with this store")
            store.use_head_valid()
        if not getattr(layer.layout, "head_slots", False):
            return store
        if not getattr(store, "supports_slots", False):
            raise self._store_refusal(
                layer, store, "head_slots", "a middle store with per-head slots: full precision (dynamic or static "
                "cache) or KIVI under a token budget (its preallocated store)",
                "this evictor replaces stored tokens per kv head while decoding (Layout.head_slots); use phase: "
                "prefill, or a store that supports per-head slots")
        store.use_slots()
        return store

    def _store_refusal(self, layer: Any, store: MiddleStore, flag: str, expected: str, hint: str) -> ConfigError:
        """The ConfigError for a store that cannot honour layout ``flag``, naming the compressors that set it."""
        who = [f"compressors[{i}].{self.compressors[i][0]}" for i, lay in self.layouts(layer.info)
               if getattr(lay, flag)]
        kind = "static" if getattr(layer, "static", False) else "dynamic"
        return ConfigError(", ".join(who), expected, f"{type(store).__name__} in a {kind} cache", hint=hint)

    def _build_store(self, layer: Any) -> MiddleStore:
        """An evictor's own store (holding the quantizer's codec), else the quantizer's store, else full
        precision."""
        builders = self.stages["kvcompress_middle_store"]
        if builders:
            codec = None
            for fn in self.stages["kvcompress_middle_codec"]:
                codec = fn(layer=layer)
                if codec is not None:
                    break
            if codec is None and self.stages["kvcompress_quantize_store"]:
                owners = ", ".join(fn.__name__ for fn in builders + self.stages["kvcompress_quantize_store"])
                raise PluginError(
                    f"an evictor builds the middle store but the stack's quantizer provides no codec "
                    f"(kvcompress_middle_codec); hooks involved: {owners}")
            for fn in builders:
                store = fn(layer=layer, codec=codec)
                if store is not None:
                    return store
        for fn in self.stages["kvcompress_quantize_store"]:
            store = fn(layer=layer)
            if store is not None:
                return store
        if getattr(layer, "static", False):
            from .static import StaticDenseStore

            return StaticDenseStore(layer.store_capacity)
        return DenseStore()

    # -- lifecycle events ---------------------------------------------------------------
    def flush(self, layer: Any, block: KVBlock) -> None:
        """Run score -> evict -> prune/low-rank -> regroup -> store on a block leaving the window.

        In a static cache (``layer.static``) blocks keep their size (no column is compacted away: the
        stores' slots and a selector's indices stay aligned, and shapes stay static).
        """
        for fn in self.stages["kvcompress_score_tokens"]:
            fn(layer=layer, block=block)
        for fn in self.stages["kvcompress_evict_tokens"]:
            keep = fn(layer=layer, block=block)
            if keep is False:
                return
            if keep is not None and keep is not True:
                if keep.dim() == 3:
                    block = self._pack_heads(layer, block, keep, fn)
                else:
                    block.valid = block.valid & keep
                    if block.head_valid is not None:
                        block.head_valid = block.head_valid & keep.unsqueeze(1)
        if not getattr(layer, "static", False):
            block = block.compact()
            if block is None:
                return
        for fn in self._transforms:
            out = fn(layer=layer, block=block)
            if out is not None:
                block = out
        try:
            layer.middle.append(block)
        except Exception as exc:  # a store a compressor built (plugin code, called directly)
            error = self.failure(f"the middle store {type(layer.middle).__name__} raised in append", exc)
            if error is exc:
                raise
            raise error from exc

    def _pack_heads(self, layer: Any, block: KVBlock, keep: torch.Tensor, fn: Callable[..., Any]) -> KVBlock:
        """A per-head keep mask ``[batch, kv_heads, tokens]``: each head's survivors packed densely
        (:meth:`KVBlock.pack_heads`).  Every kv head of a row must keep the same number of tokens (checked when
        the step may read the device: never inside a compiled or captured step), unless the layer's layout sets
        ``Layout.head_valid`` (adaptive per-head budgets: the block carries each head's count as
        :attr:`KVBlock.head_valid`, the longest head sizes it).  Dynamic caches keep as many
        columns as the fullest row; static caches keep the block's size in a decode step (a fixed shape) and a
        multiple of ``Layout.flush`` otherwise (stores encode whole units)."""
        from .static import _device_only

        b, h, n = block.valid.shape[0], layer.info.num_kv_heads, block.num_tokens
        if tuple(keep.shape) != (b, h, n) or keep.dtype != torch.bool:
            raise self.failure("", PluginError(
                f"compressor {self._label(fn.owner)} returned a keep mask of shape {tuple(keep.shape)} ({keep.dtype}) "
                f"from kvcompress_evict_tokens; expected bool [batch, tokens] = {(b, n)} or [batch, kv_heads, tokens] "
                f"= {(b, h, n)}"))
        keep = keep & block.valid.unsqueeze(1)
        per_head = bool(getattr(layer.layout, "head_valid", False))
        if per_head and block.head_valid is not None:
            keep = keep & block.head_valid
        if block.due is not None and getattr(layer, "static", False):
            # a static decode step: fixed shape, nothing read on the host
            return block.pack_heads(keep, per_head=per_head)
        counts = keep.sum(-1)  # [b, h]
        if not per_head and not _device_only() and bool((counts != counts[:, :1]).any()):
            raise self.failure("", PluginError(
                f"compressor {self._label(fn.owner)} returned a per-head keep mask whose kv heads keep different "
                f"numbers of tokens in one row (per row and head: {counts.tolist()}); every kv head of a row must "
                "keep the same number of tokens (uniform per-head budgets)"))
        size = int(counts.max()) if counts.numel() else 0
        if getattr(layer, "static", False):
            f = layer.layout.flush or 1
            size = min(n, max(1, -(-size // f)) * f)
        return block.pack_heads(keep, max(size, 1), per_head=per_head)

    def not_graph_safe(self) -> list[tuple[str, list[str]]]:
        """``(compressor name, hooks it implements)`` for each compressor that does not declare
        ``graph_safe = True`` (its hooks may read tensors on the host): such a stack cannot run in a
        static, compileable cache."""
        out = []
        for name, obj in self.compressors:
            if getattr(obj, "graph_safe", False) is True:
                continue
            hooks = sorted(h.name for h in self.pm.get_hookcallers(obj) or [])
            out.append((name, hooks))
        return out

    @property
    def observes(self) -> bool:
        """Whether a compressor of the stack implements ``kvcompress_observe`` (layers build observations)."""
        return bool(self.stages["kvcompress_observe"])

    def observe(self, layer: Any, obs: Any) -> None:
        """Hand one step's :class:`~kvcompress.observe.Observation` to every observer, in stack order."""
        for fn in self.stages["kvcompress_observe"]:
            fn(layer=layer, obs=obs)

    def select(self, layer: Any, query: torch.Tensor) -> torch.Tensor | None:
        for fn in self.stages["kvcompress_select_tokens"]:
            sel = fn(layer=layer, query=query)
            if sel is not None:
                return sel
        return None
