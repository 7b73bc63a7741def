"""The ``CacheCompressor`` hook specification: the plugin API of kvcompress.

This module *is* the reference documentation of the plugin API (``docs/hooks.md``
is generated from it, and a meta-test checks that every hook here is documented
there and exercised by a test).

Two kinds of hooks exist:

* **Registration hooks** (:class:`RegistrationSpec`) are implemented by plugin
  *modules* found through the ``kvcompress`` entry-point group.  Built-in
  compressors are registered through exactly the same group.
* **Compressor hooks** (:class:`CacheCompressor`) are implemented by compressor
  *objects*.  Each built stack owns a private :class:`pluggy.PluginManager` in
  which only that stack's compressors are registered, so a hook call never
  reaches a compressor of another stack.  Hook implementations are resolved
  once, when the cache is built, into plain bound-method lists: per-layer
  work at a lifecycle event (a block of tokens leaving the full-precision
  window, read planning) is a direct method call, not a pluggy dispatch.

Pipeline order
--------------
Every stack runs the same fixed pipeline over shared per-layer state::

    write full-precision K/V into the recent window (ring buffer)
      -> tokens leave the window in blocks of ``Layout.flush`` tokens:
         score -> evict -> prune | low-rank -> regroup -> quantize/store
      -> attention reads sinks + middle store + recent window (+ selection)

The YAML order of a stack must respect it (``evict`` before ``prune`` before
``regroup`` before ``quantize``); ``kvcompress.stack`` rejects stacks that do
not, and stacks with two compressors on one exclusive axis.

All tensors follow transformers' layout: ``[batch, kv_heads, tokens, head_dim]``
for keys and values, keys *after* RoPE.

Static caches (``max_cache_len``): a captured decode step
--------------------------------------------------------
A cache built with a capacity (``kvcompress.Cache(stack, model, max_cache_len=N)``) runs every
hook on :class:`kvcompress.static.StaticLayer` (``layer.static`` is True; it is False on the
dynamic :class:`~kvcompress.layer.CompressedLayer`) and its decode step must be capturable by
``torch.compile(fullgraph=True)`` / CUDA graphs.  A compressor opts in by declaring the class
attribute ``graph_safe = True``; a stack with a compressor that does not is built as a dynamic
cache and runs eagerly (the cache warns once, naming the compressor and its hooks).  A graph-safe
compressor follows these rules in a static layer:

* **Fixed shapes, no host reads.**  In an unplanned compiled decode step (a compiled forward a loop
  calls without ``Cache.plan_step``) the pipeline offers a block of exactly ``Layout.flush`` tokens every
  step; ``block.due`` (a 0-dim bool tensor) says whether it really leaves the window (its ``valid`` is
  already all False when it does not).  A step planned on the host (``kvcompress.GraphStep`` and
  ``generate`` inside ``kvcompress.compress`` call ``Cache.plan_step``) offers a block only in the steps
  where one leaves, with ``block.due`` a True tensor; hooks see the same
  fixed-shape block either way and must handle both.  Hooks must not read
  tensor values on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``), allocate
  buffers, or branch in Python on tensor values; side effects on stored state apply only where
  ``block.due`` holds (e.g. ``keep | ~block.due``).  Blocks of the prefill (and of multi-token
  chunks) run eagerly with ``block.due`` ``None`` and may have any size (a multiple of the flush).
* **Preallocated stores.**  ``kvcompress_quantize_store`` / ``kvcompress_middle_store`` return a
  store whose ``static`` attribute is True, sized for ``layer.store_capacity`` token slots
  (``Layout.middle`` plus one block), written in place at a device cursor, read through
  segments that span the whole capacity with a device-side ``valid`` mask; besides the
  :class:`~kvcompress.state.MiddleStore` methods it provides ``positions()`` (``[slots]`` or
  ``[batch, slots]`` logical positions) and ``reset()``.  :class:`kvcompress.static.StaticDenseStore`
  and :class:`kvcompress.static.StaticRing` are the building blocks.
* **Build time runs eagerly.**  When a static layer allocates (on its first call or, with
  ``max_batch_size``, when the cache is built) every hook runs once on an all-invalid block
  (``due`` False), eagerly: per-layer plans and buffers are built then, never inside the
  compiled step.  Under a prefill-time evictor (``Layout.prefill_ratio`` / ``prefill_middle``)
  the store is built, and this warm-up block run, at the first prefill (the prompt's length sizes
  it; later chunks of a chunked prefill shrink it through ``StaticRingStore.shrink``); after
  ``reset()`` a prompt that needs more slots rebuilds the store and clears ``layer.state``, so
  per-layer state is built again at the next warm-up block.
* **Evictors declare a bound** (``Layout.middle``) so the store is sized by it, and evict by
  masking stored tokens (``layer.middle.retain(keep)``) or freeing whole storage units; slots are
  reused by the store's cursor - or, with ``Layout.head_slots``, by the evictor itself, per kv head
  (``block.slots``; the store then keeps one trash unit for dropped columns).

Score-based evictors
--------------------
:class:`kvcompress.scoring.ScoreEvictor` is the base class of evictors written as one scoring function
(kvpress' ``ScorerPress``): it observes each step (:meth:`CacheCompressor.kvcompress_observe`), selects per
kv head at prefill (a per-head keep mask) and, under ``phase: decode | both``, replaces stored units per
head while decoding (``block.slots``).  The built-ins ``snapkv``, ``knorm`` and ``tova`` are examples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .registry import CompressorSpec
    from .state import KVBlock, LabelTopK, LayerInfo, Layout, MiddleStore, TokenSelection
    from .layer import CompressedLayer
    from .observe import Observation
    from .paged import MiddleCodec

PROJECT = "kvcompress"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RegistrationSpec:
    """Hooks implemented by plugin modules (entry points of group ``kvcompress``)."""

    @hookspec
    def kvcompress_register_compressors(self, register: Callable[[CompressorSpec], None]) -> None:
        """Register the compressors a plugin provides.

        Called once per plugin manager (``kvcompress.manager.get_plugin_manager``),
        never at import time.

        Args:
            register: call it once per compressor with a
                :class:`kvcompress.registry.CompressorSpec` (name, axis, config class,
                factory).  A name that two plugins register is used by neither (stacks naming it
                are refused with both sources); a plugin whose registration raises is skipped,
                named in one warning, and the other plugins keep working.

        Returns:
            Nothing; use ``register``.

        Example::

            @hookimpl
            def kvcompress_register_compressors(register):
                register(CompressorSpec(name="window", axis="evict",
                                        config=WindowConfig, factory=WindowCompressor))
        """


class CacheCompressor:
    """Hooks implemented by compressor objects of one stack.

    A compressor implements only the hooks of its axis (plus, optionally,
    :meth:`kvcompress_layer_layout` and :meth:`kvcompress_validate_stack`).
    Every hook receives the per-layer :class:`~kvcompress.layer.CompressedLayer`
    it acts on; compressors keep per-layer state in ``layer.state[<name>]``,
    never in module globals.
    """

    @hookspec
    def kvcompress_validate_stack(self, entries: list[tuple[str, object]], axes: list[str]) -> None:
        """Check rules that involve several compressors of one stack.

        Called once when a stack is loaded, before any model is touched.  An implementation may
        declare only the arguments it needs (``entries`` alone, say).

        Args:
            entries: ``(name, config)`` pairs in stack order.
            axes: each entry's axis (``"evict"``, ``"select"``, ...), in the same order.

        Raises:
            kvcompress.errors.ConfigError: naming the key path (``compressors[i].name.key``),
                the allowed values and the value given.
        """

    @hookspec
    def kvcompress_layer_layout(self, layer: LayerInfo) -> Layout | None:
        """Declare the region sizes this compressor needs on one layer.

        Called once per compressed layer when the cache is built.  The pipeline
        combines the answers of every compressor: ``sinks`` and ``recent`` take the
        maximum, ``flush`` the least common multiple, ``middle`` (an evictor's bound on
        the middle's tokens, which sizes a static cache's store) the minimum, and so do
        ``prefill_ratio`` / ``prefill_middle`` (a prefill-time evictor's bound on what a
        prompt leaves in the middle: a static cache sizes its store at its first prefill
        from it, so its bytes follow the kept fraction).

        Args:
            layer: static facts of the layer (index, kv heads, head_dim, model config).

        Returns:
            A :class:`~kvcompress.state.Layout` or ``None`` for no requirement.
        """

    @hookspec
    def kvcompress_observe(self, layer: CompressedLayer, obs: Observation) -> None:
        """Observation: see the queries (and, when asked, the attention mass) of the step a layer just read.

        Called once per compressed layer per forward call - prefill, multi-token chunks and decode steps,
        eager and compiled - after the step's attention is computed and *before* the step's tokens are
        committed, so the flush the commit may trigger (``kvcompress_score_tokens``,
        ``kvcompress_evict_tokens``, ...) runs after it.  Only compressors that implement this hook are
        called, and a layer whose stack has none builds no observation (nothing is computed).  The first
        prefill is observed too (its queries against the prompt's own keys).

        What ``obs`` holds (:class:`kvcompress.observe.Observation`): ``query`` ``[batch, q_heads, w,
        head_dim]`` - the last ``w`` positions of a multi-token step, where ``w`` is the largest
        ``Layout.observe`` of the stack (1 when none is set), or the decode step's query - and
        ``query_positions`` ``[w]``; the step's own ``keys`` / ``values`` ``[batch, kv_heads, q, head_dim]``
        (full precision, keys after RoPE), ``positions`` ``[q]`` and ``valid`` ``[batch, q]`` (or ``None``);
        the model's ``scaling``, ``softcap`` and ``sink_logits``; and, when a layout of the stack sets
        ``Layout.attention``, ``mass``: per region (``"sinks"``, ``"recent"``, ``"middle"``, ``"new"``) the
        attention probability each token received from the observed queries, summed over the query heads of
        its kv head and over the observed positions, ``[batch, kv_heads, slots]`` in the region's own slot
        coordinates.  In decode steps of the phases ``Layout.attention`` names (``True``: both; ``"decode"``) the
        read returns it from the scores its kernels computed (``exp(score - joint LSE)``, no second pass over the
        keys); elsewhere - prefills, and decode steps of a ``"prefill"`` layout - it is one exact reference pass
        beside the read, run on first access (see :mod:`kvcompress.observe`).
        ``obs.token_mass(positions)`` gives the mass of the tokens a flush of this step hands to the pipeline.

        In a static cache's decode step the hook runs inside the captured graph: the rules of the "Static
        caches" section apply (no host reads, fixed shapes).  Keep what a later stage of the same step needs
        in ``layer.state`` and drop it once used (a reference kept across steps keeps its tensors alive).

        Args:
            layer: the layer that was read.
            obs: the observation of this step.

        Returns:
            Nothing.
        """

    @hookspec
    def kvcompress_score_tokens(self, layer: CompressedLayer, block: KVBlock) -> None:
        """Score stage: compute per-token metadata from full-precision K/V.

        Called for every block of tokens leaving the full-precision recent window
        (at the end of prefill, then every ``Layout.flush`` tokens), before any
        eviction or quantization, so scores are always computed from exact values.
        Store results in ``block.meta[<key>]`` (tensors of shape ``[batch, tokens]``
        or ``[batch, kv_heads, tokens, ...]``); the later stages of the same flush read
        them.  Stores do not keep ``block.meta``: scores of stored tokens needed later go
        in the compressor's per-layer state (``layer.state``) or in a store that keeps
        them (the paged store keeps page scores).

        Args:
            layer: the layer the block belongs to.
            block: the tokens leaving the window, full precision.

        Returns:
            Nothing; write into ``block.meta``.
        """

    @hookspec
    def kvcompress_evict_tokens(self, layer: CompressedLayer, block: KVBlock) -> torch.Tensor | bool | None:
        """Evict stage (token-eviction axis): decide which tokens survive.

        Called after scoring for every block leaving the recent window.  The hook
        may also drop tokens that are already in the middle store through
        ``layer.middle`` (for example the oldest ones, to hold a token budget).

        A keep mask may decide per kv head (``[batch, kv_heads, tokens]``: SnapKV, per-head budgets): every kv
        head of a row must then keep the same *number* of tokens (uniform per-head budgets; otherwise the stack
        fails with a :class:`~kvcompress.errors.PluginError` naming the compressor), and the pipeline packs each
        head's survivors densely (:meth:`kvcompress.state.KVBlock.pack_heads`): the block becomes as many columns
        as the fullest row keeps (a static cache's decode step keeps the block's size), column ``j`` of head ``h``
        holding head ``h``'s ``j``-th kept token, ``block.valid`` row-level, the per-head positions in
        ``block.head_positions``.  The stages and stores downstream see an ordinary block.  An evictor whose
        layout sets ``Layout.head_valid`` (adaptive per-head budgets, AdaKV) may give the heads of a row different
        counts ``c[b, h]``: the packed block is as long as the longest head and carries
        ``block.head_valid`` ``[batch, kv_heads, tokens]`` (head ``h`` holds columns ``[0, c[b, h])``), which the
        middle store keeps and every read masks with (stores declare ``supports_head_valid``; the cache refuses
        to build over one that does not).  Most evictors of this
        kind subclass :class:`kvcompress.scoring.ScoreEvictor` and implement only a scoring function.

        An evictor whose layout sets ``Layout.head_slots`` (decoding under a budget) places blocks itself: it sets
        ``block.slots`` ``[batch, kv_heads, tokens]``, the target slot of each column per head in the middle store
        (``layer.middle.slot_count`` slots of ``slot_unit`` tokens, occupancy ``layer.middle.slot_valid()``; a
        target ``>= slot_count`` drops the column), replacing its lowest-scoring stored units one for one with
        incoming ones and filling free slots in the same order for every head, so every kv head of a row occupies
        the same slots and the memory stays flat.  The cache refuses to build when the store cannot honour slots
        (:class:`~kvcompress.state.MiddleStore`: dense stores, KIVI's preallocated store).

        Args:
            layer: the layer.
            block: the scored, full-precision block.

        Returns:
            ``None`` to keep every token, ``False`` to drop the whole block, a
            boolean tensor ``[batch, tokens]`` (True = keep), or a boolean tensor
            ``[batch, kv_heads, tokens]`` (per kv head; the same count per head of a row).
        """

    @hookspec
    def kvcompress_prune_channels(self, layer: CompressedLayer, block: KVBlock) -> KVBlock | None:
        """Prune stage (channel-pruning axis): remove key (or value) channels.

        Called on every surviving block.  Return a new block whose head groups
        carry fewer channels and a query map telling attention which query
        channels to use (the softmax scale stays ``1/sqrt(head_dim)``).

        Args:
            layer: the layer.
            block: the block after eviction.

        Returns:
            The transformed block, or ``None`` to leave it unchanged.
        """

    @hookspec
    def kvcompress_lowrank_transform(self, layer: CompressedLayer, block: KVBlock) -> KVBlock | None:
        """Low-rank stage: project keys (and optionally values) onto a basis.

        Called on every surviving block, in place of channel pruning (the two
        are exclusive on the same keys).  Return a block whose head groups store
        coordinates and whose query map projects the query into the same basis.
        Give a linear projection as a :class:`kvcompress.LinearQueryMap`
        (``LinearQueryMap.of(basis, dtype)``, made once per layer, not per block):
        the decode read kernels then project the query themselves; any other
        callable works too, applied by PyTorch before the read.

        Args:
            layer: the layer.
            block: the block after eviction.

        Returns:
            The transformed block, or ``None`` to leave it unchanged.
        """

    @hookspec
    def kvcompress_regroup_heads(self, layer: CompressedLayer, block: KVBlock) -> KVBlock | None:
        """Regroup stage: reorganise heads into dense groups of equal shape.

        Called after pruning / low-rank.  Heads that keep the same number of
        channels become one dense group; heads that keep nothing are dropped
        (no K and no V stored for them).

        Args:
            layer: the layer.
            block: the block after pruning / low-rank.

        Returns:
            The regrouped block, or ``None`` to leave it unchanged.
        """

    @hookspec(firstresult=True)
    def kvcompress_quantize_store(self, layer: CompressedLayer) -> MiddleStore | None:
        """Quantize stage: provide the store that encodes and holds the middle.

        Called once per layer when the cache is built (first non-``None`` result
        wins; at most one quantizer per stack).  The store's ``append(block)``
        encodes each surviving, transformed block, append-only; its
        ``segments()`` are what attention reads.  Without a quantizer the middle is
        kept in full precision by :class:`~kvcompress.state.DenseStore`.  Not called when an
        evictor builds the store (:meth:`kvcompress_middle_store`).

        Args:
            layer: the layer the store will serve.

        Returns:
            A :class:`~kvcompress.state.MiddleStore`, or ``None``.
        """

    @hookspec(firstresult=True)
    def kvcompress_middle_codec(self, layer: CompressedLayer) -> MiddleCodec | None:
        """Quantize stage: the quantizer's encoding of token blocks, for a store it does not own.

        Called once per layer when the cache is built, and only when an evictor of the
        stack builds the middle store itself (:meth:`kvcompress_middle_store`), e.g. a
        paged pool.  The quantizer then hands over its *encoding* instead of its own
        store; the evictor's store decides where the encoded payloads live.  A quantizer
        that implements :meth:`kvcompress_quantize_store` but not this hook cannot be
        stacked with such an evictor (the cache refuses to build, naming both).

        A codec provides (see :class:`kvcompress.paged.DenseCodec` for the full-precision one):

        * ``unit``: tokens per encoding unit (stores encode whole multiples of it; KIVI: ``G``);
        * ``names`` and ``encode(k, v, valid) -> {name: tensor [batch, heads, n, ...]}`` for
          ``k``/``v`` ``[batch, heads, T, d]`` (``T`` a multiple of ``unit``; masked slots must not
          change the encoding of the valid ones);
        * ``token_axis(name)``: whether dim 2 of that payload counts tokens (else units);
        * ``packed(payload, valid)``: a packed region (``attention_partial``, ``dequantize``) over
          payload tensors laid out like ``encode``'s output; a region whose ``attention_partial``
          takes ``softcap=`` (the model's logit soft-cap, Gemma 2) declares ``supports_softcap = True``,
          otherwise models with a soft-cap read it dequantized through the reference; a region that also
          returns its scores declares ``supports_scores = True`` and provides ``attention_scored(query, scale,
          softcap=None) -> (out, lse, scores [batch, heads, rows, tokens])`` (natural-log units, ``-inf`` on
          slots not attended), used by decode steps whose observers read the attention mass (otherwise such
          steps read it dequantized through the reference); optionally
          ``attention_partial_with_buffer(query, scale, k, v, valid, length, softcap=None)``: ``(out, lse)`` over the
          region and a full-precision buffer (a static layer's sinks + recent window, ``[batch, heads, T, d]``) in one
          launch, or ``None`` when it cannot (the two are then read apart and merged); a region whose method also
          takes ``out_dtype=`` (``out`` in that dtype instead of float32: the read's own output, no cast launch after
          it) declares ``buffer_out_dtype = True``;
        * optionally ``choose_quantizer(k, v) -> impl``: the encoder implementation, passed back as
          ``encode(..., impl=impl)``; a static store asks once, when it allocates;
        * ``report_key(name)``: the memory-report component of a payload.

        Args:
            layer: the layer the store will serve (``layer.info`` gives heads and head_dim).

        Returns:
            A codec object, or ``None`` (first non-``None`` result wins; at most one quantizer
            per stack).
        """

    @hookspec(firstresult=True)
    def kvcompress_middle_store(self, layer: CompressedLayer, codec: MiddleCodec | None) -> MiddleStore | None:
        """Evict stage: build the middle store when the evictor needs its own storage layout.

        Called once per layer when the cache is built (and again on ``reset``), before
        :meth:`kvcompress_quantize_store`, which is then not called.  An evictor whose
        decisions depend on how tokens are laid out (a paged pool with per-sequence block
        tables that frees whole pages) builds the store here; the stack's quantizer
        contributes only its encoding through :meth:`kvcompress_middle_codec`.

        Args:
            layer: the layer the store will serve (``layer.layout`` is already known).
            codec: the quantizer's codec, or ``None`` to keep the middle in full precision.

        Returns:
            A :class:`~kvcompress.state.MiddleStore` holding payloads encoded by ``codec``, or
            ``None`` to leave the store to the quantizer (or the dense default).
        """

    @hookspec(firstresult=True)
    def kvcompress_select_tokens(self, layer: CompressedLayer,
                                 query: torch.Tensor) -> torch.Tensor | TokenSelection | LabelTopK | None:
        """Read-time selection: choose which middle tokens attention reads this step.

        Called at read planning, once per layer per forward step, with the query
        ``[batch, q_heads, q_len, head_dim]`` (first non-``None`` result wins; at most one
        selector per stack).  Sinks, the recent window and the step's new tokens are always
        read; the selection covers only the middle store (``layer.middle``).

        Args:
            layer: the layer being read.
            query: the step's query, full precision.

        Returns:
            ``None`` to read every middle token, or either

            * a :class:`~kvcompress.state.TokenSelection`: int64 indices
              ``[batch, q_heads, q_len, k]`` of the middle-token columns each *query head* reads
              (every middle segment covers the same tokens), or ``[batch, kv_heads, q_len, k]``
              with ``group`` set: one selection shared by the query heads of each kv head.  Decode
              steps (``q_len == 1``) read exactly those tokens with a gather kernel
              (:func:`kvcompress.kernels.doublesparse.gather_partial_attention`), so no mask over
              the whole middle is built; or
            * a :class:`~kvcompress.state.LabelTopK`: the same selection described by how it is scored - the
              ``k`` tokens of largest ``query[channels] . label`` per query head (or per kv head with ``group``),
              from labels of the middle tokens the plugin keeps (a few key channels per token, in middle-store
              order, e.g. in ``layer.state``).  The core then runs the top-``k``: in a decode step over a
              full-precision middle, in the same kernel as the attention over the chosen tokens where that kernel
              is enabled (:func:`kvcompress.kernels.doublesparse.select_gather_attention`), else as the
              :class:`~kvcompress.state.TokenSelection` its ``resolve()`` gives; or
            * a boolean mask ``[batch, kv_heads, q_len, middle_tokens]`` (True = read), one per kv
              head, covering the middle segments one after the other.
        """
