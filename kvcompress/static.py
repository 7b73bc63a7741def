"""Static-capacity layer state: a decode step that CUDA graphs and ``torch.compile`` can capture.

Built when a cache is given a capacity (``kvcompress.Cache(stack, model, max_cache_len=N)``), as
transformers' ``StaticCache`` is.  Every buffer is allocated once, at capacity, and written in
place; every per-step counter lives in a device tensor.  The host knows only whether a call is a
single-token decode step or a multi-token prefill / chunk:

* **decode step** (``q_len == 1``) - branch-free and shape-static: the new token goes into its
  ring slot, attention reads the full-precision region (sinks + ring, one buffer) and the middle
  store's static segments with device-side validity masks, then a block of ``Layout.flush``
  tokens is *offered* to the stack's pipeline every step.  Whether it really leaves the window
  (``block.due``, a 0-dim bool tensor) is computed on the device; stores write the block into
  slots that hold no live token and advance their device cursors by it, so a step that flushes
  and a step that does not run the same kernels.  Nothing reads a tensor value on the host,
  allocates, concatenates stored segments or reads the environment.  A *planned* step
  (:meth:`StaticLayer.plan_decode`, which :class:`kvcompress.GraphStep` calls through
  :meth:`kvcompress.Cache.plan_step`) knows from the host counts whether it flushes: the compiled
  step then has two variants, and the 31 of 32 KIVI steps that flush nothing run no flush kernels.
* **prefill / chunk** (``q_len > 1``) - eager, with host-side counts (one device-to-host read of
  the layer's counters per call): the step's tokens are read as their own segment, then every
  block that leaves the window is flushed at once (``block.due`` is ``None``: real).

Layout of one layer (``S`` sinks, window ``R = Layout.recent``, flush ``F = Layout.flush``):

* ``k``, ``v`` ``[batch, kv_heads, S + C, head_dim]``: slots ``[0, S)`` hold each row's first
  ``S`` real tokens (attention sinks); slots ``S + (p % C)`` the recent token at logical position
  ``p`` (a ring of ``C = R + F`` slots; ``C`` = the capacity when nothing is ever flushed);
* ``valid`` ``[batch, S + C]``: slot holds a live token of that row (attention reads exactly these);
* ``ring_pos`` ``[C]``: logical position in each ring slot (shared by all rows: left padding
  keeps rows aligned); ``sink_count`` ``[batch]``; ``seen``, ``flushed`` (0-dim int64):
  tokens seen, and tokens that have left the ring (the leading columns that hold no ring token in any row -
  left padding, then the sinks - count as flushed without entering it, as the dynamic cache drops them).

The middle store (``Layout.middle`` bounds it under an evictor; otherwise it can hold the whole
capacity) comes from the stack's hooks, as for dynamic caches; :class:`StaticDenseStore` is the
full-precision one.  Under a prefill-time evictor (``Layout.prefill_ratio`` / ``prefill_middle``: a
prompt leaves at most that in the middle) the store is built at the first prefill, once the prompt's
length ``P`` is known, for what the prompt keeps plus the ``capacity - P`` tokens that can follow it
(:func:`middle_capacity`): a SnapKV cache at 25% holds about a quarter of the prompt, not the capacity.
After :meth:`StaticLayer.reset` a prompt that needs a larger store rebuilds it (a compiled step then
recompiles once for the new buffers); a smaller one keeps the store.  A prompt prefilled in chunks is sized by
its first chunk (the rest is not known yet), and each later chunk, before any decode step, shrinks the store to
the longer prompt's bound (:meth:`StaticRingStore.shrink`: the stored tokens keep their slots; a store without
``shrink``, or an evictor with per-head slots, keeps the first chunk's size).  This module never imports
transformers (the adapter owns the transformers layer class and the attention function).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .errors import UnsupportedOperationError
from .layer import add_store_bytes, apply_selection, decoded_for_prompt, dense_read
from .state import ROWS, HeadGroup, KVBlock, LayerInfo, Layout, MiddleStore, Segment, new_token_validity


def storage_bytes(*tensors: "torch.Tensor | None") -> int:
    """Bytes of the storages behind ``tensors``, each storage once (an expanded or sliced view costs what it
    holds, not its shape)."""
    seen: set = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _device_only() -> bool:
    """The step must not read device values on the host: it is being traced, or captured as a CUDA graph."""
    return _compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def mark_static(*tensors: torch.Tensor | None) -> None:
    """Tag preallocated buffers as fixed addresses for CUDA graphs (skipped while tracing)."""
    if _compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_static_address(t)


def mark_held_static(root: Any) -> None:
    """:func:`mark_static` on every tensor reachable from ``root`` (a static layer: its buffers, stores, per-layer
    compressor state, the compressors of its pipeline and their calibration tensors) through attributes, slots,
    lists, tuples and dicts; models (``torch.nn.Module``) are not walked.

    A compiled step (``mode="reduce-overhead"``) takes every tensor it reads as a graph input, and cudagraph trees
    copy each input not marked static into the graphs' pool before every replay: a host-side copy per constant index
    tensor, offset table and basis, per layer and step.  Marking them once, eagerly (after allocation and after each
    prefill), makes the replay take them in place."""
    if _compiling():
        return
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            if not hasattr(obj, "_dynamo_static_input_type"):
                torch._dynamo.mark_static_address(obj)
            continue
        if depth > 10 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif isinstance(obj, torch.nn.Module) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        else:
            items = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    items.append(getattr(obj, name, None))
        stack.extend((item, depth + 1) for item in items)


def remap_rows(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(t)`` for a preallocated ``[batch, ...]`` buffer of a static cache (``map_batch``).

    A reorder keeps the row count: the rows are written back in place and the buffer keeps its address (a captured
    decode step stays valid; beam search).  A repeat or a selection changes it: the result is a new buffer, marked
    static (``batch_repeat_interleave`` after the prefill; the next compiled step records with the new buffers).
    Returns the tensor to keep.
    """
    new = fn(t)
    if new.shape == t.shape:
        return t.copy_(new)
    new = new.contiguous()
    mark_static(new)
    return new


def middle_capacity(layout: Layout, capacity: int, prompt: int | None = None) -> int:
    """Tokens the middle store must hold: all that can leave the window, bounded by ``Layout.middle`` and, once
    the first prompt's length ``prompt`` is known, by what it leaves (``Layout.prefill_ratio`` /
    ``prefill_middle``) plus the ``capacity - prompt`` tokens that can follow it."""
    if layout.recent is None:
        return 0
    most = max(capacity - layout.recent, 0)
    if layout.middle is not None:
        most = min(most, layout.middle)
    if prompt is not None and sized_by_prompt(layout):
        p = min(max(prompt, 0), capacity)
        kept = p
        if layout.prefill_ratio is not None:
            kept = min(kept, math.ceil(layout.prefill_ratio * p))
        if layout.prefill_middle is not None:
            kept = min(kept, layout.prefill_middle)
        most = min(most, kept + capacity - p)
    return most


def sized_by_prompt(layout: Layout) -> bool:
    """Whether a static middle is sized at the first prefill (a prefill-time evictor bounds what a prompt leaves)."""
    return layout.prefill_ratio is not None or layout.prefill_middle is not None


class StaticLayer:
    """Static-capacity state of one compressed layer (see the module docstring).

    Compressor hooks receive this object as ``layer`` (as they receive a
    :class:`~kvcompress.layer.CompressedLayer` in a dynamic cache): ``layer.static`` is True,
    ``layer.info``, ``layer.layout``, ``layer.state`` and ``layer.middle`` are the same, and blocks
    carry a device-side ``due`` flag in decode steps.
    """

    static = True

    def __init__(self, info: LayerInfo, pipeline: Any, capacity: int):
        self.info = info
        self.pipeline = pipeline
        self.layout: Layout = pipeline.layout(info)
        self.capacity = capacity
        self.state: dict[str, Any] = {}
        self.sink_slots = self.layout.sinks or 0
        self.flush_size = self.layout.flush or 1
        recent = self.layout.recent
        self.flushes = recent is not None and recent + self.flush_size <= capacity
        self.ring_slots = recent + self.flush_size if self.flushes else capacity
        #: token slots a static middle store needs: the middle's bound plus one block in flight, a multiple
        #: of the flush (so every store and a selector's label cache wrap at the same slot)
        self.store_capacity = self._store_slots(None)
        #: whether the middle store waits for the first prompt to be sized (``Layout.prefill_ratio``, module docs)
        self.sized_by_prompt = self.flushes and sized_by_prompt(self.layout)
        self._size_due = self.sized_by_prompt
        #: tokens the prefill chunks of the first prompt committed since the store was sized (while a later chunk
        #: equals ``seen``, no decode step ran and the store may still shrink); -1: it never shrinks
        self._prompt_tokens = -1
        self.middle: MiddleStore | None = (pipeline.make_store(self) if self.flushes and not self.sized_by_prompt
                                           else None)
        self.is_initialized = False
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._host: tuple[int, int] | None = (0, 0)  # (seen, flushed) while known on the host
        #: the coming decode step as the host planned it (:meth:`plan_decode`): ``(flush, take_sinks)``, or ``None``
        #: (unplanned: a compiled step offers a block every step and the device decides)
        self._planned: tuple[bool, bool] | None = None
        self._lead_open = True  # no ring token stored yet: leading padding / sink columns are skipped
        self._sinks_full = self.sink_slots == 0

    # -- allocation ------------------------------------------------------------------------
    def _store_slots(self, prompt: int | None) -> int:
        if not self.flushes:
            return 0
        f = self.flush_size
        return (-(-middle_capacity(self.layout, self.capacity, prompt) // f) + 1) * f

    def _size_middle(self, prompt: int) -> None:
        """The first call after the cache was built or reset, under a prefill-time evictor: build the middle store
        for a prompt of ``prompt`` tokens (eagerly: a prefill).  A store already large enough is kept (its buffers
        keep their addresses); a larger one replaces it, and the compressors' per-layer state is rebuilt with it."""
        self._size_due = False
        self._prompt_tokens = -1 if self.layout.head_slots else 0  # (per-head slots: the evictor's state is sized too)
        slots = self._store_slots(prompt)
        if self.middle is not None and slots <= self.store_capacity:
            return
        if self.middle is not None and _compiling():
            raise UnsupportedOperationError(
                f"this static cache's middle store was sized for a longer first prompt ({self.store_capacity} slots); "
                f"a {prompt}-token one needs {slots}: run the prefill eagerly (as transformers' generate does) so the "
                "store can be rebuilt")
        self.store_capacity = slots
        self.state.clear()
        self.middle = self.pipeline.make_store(self)
        if self.is_initialized:
            self._flush_decode(warmup=True)
            mark_held_static(self)

    def _shrink_middle(self, prompt: int) -> None:
        """A later chunk of the first prompt (prefill-only eviction, no per-head slots): the store was sized for a
        prompt as long as the chunks so far; a longer prompt leaves fewer slots after it, so the store shrinks to
        the longer prompt's bound when that saves a quarter or more (its stored tokens stay where they are)."""
        slots = self._store_slots(prompt)
        shrink = getattr(self.middle, "shrink", None)
        if shrink is None or slots * 4 > self.store_capacity * 3:
            return
        if shrink(slots):
            self.store_capacity = slots
            mark_held_static(self)

    def allocate(self, batch: int, kv_heads: int, head_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Allocate every buffer at capacity and run the pipeline once on an empty block (eagerly),
        so stores allocate and compressors build their per-layer plans before any compiled step."""
        s, c = self.sink_slots, self.ring_slots
        self.k = torch.zeros(batch, kv_heads, s + c, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, kv_heads, s + c, v_dim, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, s + c, dtype=torch.bool, device=device)
        # positions of ring slots are read only by flushes (a cache that never flushes keeps one slot)
        self.ring_pos = torch.zeros(c if self.flushes else 1, dtype=torch.long, device=device)
        self.sink_pos = torch.zeros(batch, s, dtype=torch.long, device=device)
        self.sink_count = torch.zeros(batch, dtype=torch.long, device=device)
        self.seen = torch.zeros((), dtype=torch.long, device=device)
        self.flushed = torch.zeros((), dtype=torch.long, device=device)
        self._offsets = torch.arange(self.flush_size, device=device)
        self._sink_index = torch.arange(s, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self._zero_pos = torch.zeros((), dtype=torch.long, device=device).expand(s + c)  # regions precede queries
        self.kernels = choose_kernels(device, head_dim, v_dim, dtype)
        mark_static(self.k, self.v, self.valid, self.ring_pos, self.sink_pos, self.sink_count, self.seen,
                    self.flushed)
        self.is_initialized = True
        if self.middle is not None:
            self._flush_decode(warmup=True)
        mark_held_static(self)

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    def held_tokens(self) -> torch.Tensor:
        """``[batch]`` int64: tokens each row holds in full precision outside the middle store (sinks + recent
        window); during a flush the block has already left the window.  A device tensor (graph-safe)."""
        return self.valid.sum(dim=1)

    # -- host-side counters (eager paths only) -----------------------------------------------
    def host_counts(self) -> tuple[int, int]:
        """``(seen, flushed)`` on the host; one device read after compiled steps made them unknown."""
        if self._host is None:
            self._host = (int(self.seen), int(self.flushed))
        return self._host

    # -- host-planned decode steps -------------------------------------------------------------
    def plan_decode(self) -> tuple[bool, bool]:
        """Plan the coming single-token decode step on the host, before a compiled or captured call runs it.

        Returns ``(flush, take_sinks)``: whether a block leaves the window in this step, and whether the step
        still moves tokens into the sink slots.  The compiled step branches on the plan (one compiled variant
        per distinct plan: a step that does not flush runs no flush kernels at all, instead of offering a block
        that the device finds not due), and the host counts advance to what they are after the step, so a
        graph replay that runs no Python keeps them exact.  Every planned call must be followed by
        :meth:`finish_decode`.  Raises if the cache is full (what an unplanned compiled step cannot check).
        """
        if self._planned is not None:
            raise UnsupportedOperationError(
                "a decode step was planned twice without running it: call finish_decode() after each planned step")
        seen, flushed = self.host_counts()  # one device read only after unplanned compiled steps
        self._check_room(seen)
        seen += 1
        flush = self.middle is not None and seen - flushed >= self.layout.recent + self.flush_size
        self._planned = (flush, not self._sinks_full)
        self._host = (seen, flushed + self.flush_size if flush else flushed)
        return self._planned

    def _check_room(self, seen: int) -> None:
        """A decode step's token must fit: refused when ``seen`` tokens already fill the capacity (host counts: an
        unplanned compiled step cannot check this, it must fit)."""
        if seen >= self.capacity:
            raise UnsupportedOperationError(
                f"the static cache holds at most max_cache_len={self.capacity} tokens and is full; build it with a "
                "larger max_cache_len (a compiled step that GraphStep does not plan cannot check this: it must fit)")

    @property
    def step_planned(self) -> bool:
        """Whether :meth:`plan_decode` planned a step that :meth:`finish_decode` has not ended."""
        return self._planned is not None

    def finish_decode(self, completed: bool) -> None:
        """End a planned step: ``completed`` False (the call raised) forgets the host counts (the next plan
        reads them from the device once)."""
        if self._planned is not None and not completed:
            self._host = None
        self._planned = None

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens seen, as a device tensor (read by compiled code without a host sync)."""
        return self.seen if self.is_initialized else 0

    # -- the step ---------------------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, compressed: bool):
        """Take the step's new tokens; they wait in :attr:`pending` for :meth:`attend`."""
        if not compressed:
            raise UnsupportedOperationError(
                "a kvcompress cache with max_cache_len is read by kvcompress' attention only: use it as "
                "`with kvcompress.compress(model, stack, max_cache_len=N) as cache:`")
        if not self.is_initialized:
            self.allocate(key.shape[0], key.shape[1], key.shape[-1], value.shape[-1], key.dtype, key.device)
        if key.shape[0] != self.batch_size:
            raise UnsupportedOperationError(
                f"this static cache was built for batch size {self.batch_size}, the model was called with "
                f"{key.shape[0]} rows; build a new cache for this batch size")
        if self._size_due:
            self._size_middle(key.shape[2])
        self.pending = (key, value)
        return key, value

    def get_mask_sizes(self, query_length: int, compressed: bool) -> tuple[int, int]:
        return self.capacity, 0  # masks in logical coordinates: column j is position j

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedOperationError(
            "a compressed kvcompress cache cannot be cropped (assisted/speculative decoding): evicted or "
            "quantized tokens cannot be restored; use plain generation")

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
               dense_attention: Callable[..., torch.Tensor], softcap: float | None = None,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` over this layer's storage and the stashed new tokens, then commit.

        ``attention_mask``: boolean ``[batch, 1, q_len, capacity]`` in logical coordinates (column
        ``j`` is position ``j``), or ``None`` when no row is padded.  Returns
        ``[batch, q_len, q_heads, head_dim]`` (transformers' attention output layout).  ``softcap`` / ``sink_logits``:
        the model's attention variants, as for :meth:`kvcompress.layer.CompressedLayer.attend`.
        """
        k, v = self.pending
        self.pending = None
        variant = (softcap, sink_logits)
        if k.shape[2] == 1:
            return self._decode(query, k, v, attention_mask, scaling, dense_attention, variant)
        return self._prefill(query, k, v, attention_mask, scaling, dense_attention, variant)

    # decode: branch-free ------------------------------------------------------------------
    def _decode(self, query, k, v, attention_mask, scaling, dense_attention, variant=(None, None)):
        pos = self.seen.view(1)
        valid_new = new_token_validity(attention_mask, pos, 1)
        if valid_new is None:
            valid_new = torch.ones(k.shape[0], 1, dtype=torch.bool, device=k.device)
        valid_new = valid_new.expand(k.shape[0], 1)
        compiling = _device_only()
        planned = self._planned  # (a compiled step branches on it: one variant per plan)
        if not compiling and planned is None:
            host = self.host_counts()  # (seen, flushed); one device read only after unplanned compiled steps
            self._check_room(host[0])
        token_valid = valid_new
        # every step skips the sink scan once the host knows each row's sinks are full: the planned ones by their
        # plan, the others by the flag an eager prefill set (it only turns true there and false at a reset, so an
        # unplanned compiled step guards on it: the steps after a prompt that filled the sinks, nearly all, compile
        # without the scan; a shorter prompt's steps keep it and let the device decide)
        if planned[1] if planned is not None else not self._sinks_full:
            valid_new = self._take_sinks(k, v, valid_new, pos)
        slot = self.sink_slots + pos.remainder(self.ring_slots)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.valid.index_copy_(1, slot, valid_new)
        if self.flushes:
            self.ring_pos.index_copy_(0, slot - self.sink_slots, pos)
        self.seen.add_(1)
        masses = None
        if self.pipeline.observes and self.layout.attention_at("decode"):  # the mass comes from the read's scores
            out, middle, masses = self._read(query, scaling, dense_attention, None, variant, scored=True)
        else:
            out, middle = self._read(query, scaling, dense_attention, None, variant)
        if self.pipeline.observes:
            new = Segment(k, v, token_valid, self.seen.view(1) - 1)  # (pos is a view of the advanced counter)
            self._observe(query, new, scaling, variant, middle, None, decode_slot=slot - self.sink_slots,
                          read_masses=masses)
        if planned is not None:  # the host counts were advanced by the plan
            if planned[0]:
                self._flush_decode(due=self._true)
            return out
        if compiling:  # unplanned: a block is offered every step, the device decides whether it is due
            self._host = None
            if self.middle is not None:
                self._flush_decode()
            return out
        # eager: the host counts say whether a block leaves the window; a step with nothing to flush
        # skips the pipeline (a compiled step runs it with due = False: the same result)
        seen, flushed = host[0] + 1, host[1]
        self._host = (seen, flushed)
        if self.middle is not None and seen - flushed >= self.layout.recent + self.flush_size:
            self._flush_decode(due=self._true)
            self._host = (seen, flushed + self.flush_size)
        return out

    def _flush_decode(self, warmup: bool = False, due: torch.Tensor | None = None) -> None:
        """Offer the ``F`` oldest ring tokens to the pipeline; they leave only when ``due`` (computed on the
        device unless given)."""
        recent, f, s = self.layout.recent, self.flush_size, self.sink_slots
        if warmup:
            due = torch.zeros((), dtype=torch.bool, device=self.seen.device)
        elif due is None:
            due = (self.seen - self.flushed) >= recent + f
        ring = (self.flushed + self._offsets).remainder(self.ring_slots)
        slots = ring + s
        block = KVBlock(self.k.index_select(2, slots), self.v.index_select(2, slots),
                        self.valid.index_select(1, slots) & due, self.ring_pos.index_select(0, ring), due=due)
        # the block's tokens leave the window before the hooks run (an evictor counts what the row
        # still holds: sinks + window + middle)
        self.valid.index_copy_(1, slots, self.valid.index_select(1, slots) & ~due)
        self.flushed.add_(due.long() * f)
        self.pipeline.flush(self, block)

    # prefill / chunks: host counts ---------------------------------------------------------
    def _prefill(self, query, k, v, attention_mask, scaling, dense_attention, variant=(None, None)):
        if self._planned is not None:
            raise UnsupportedOperationError(
                f"a single-token decode step was planned (plan_step), but the model was called with {k.shape[2]} "
                "tokens; plan only decode steps (kvcompress.GraphStep does this for the calls it runs)")
        if _compiling():
            raise UnsupportedOperationError(
                "a static kvcompress cache compiles single-token decode steps; run the prefill (and "
                "multi-token chunks) eagerly: call the uncompiled model for them, as transformers' generate does")
        seen, flushed = self.host_counts()
        q = k.shape[2]
        if self._prompt_tokens == seen > 0 and seen + q <= self.capacity:  # a later chunk of the first prompt
            self._shrink_middle(seen + q)
        if seen + q > self.capacity:
            raise UnsupportedOperationError(
                f"the static cache holds at most max_cache_len={self.capacity} tokens; {seen} are cached and "
                f"{q} more were given. Build the cache with a larger max_cache_len")
        pos = torch.arange(seen, seen + q, device=k.device)
        valid_new = new_token_validity(attention_mask, seen, q)
        new = Segment(k, v, valid_new, pos)
        middle: list[Segment] = []
        if seen == 0:  # nothing stored yet: the backend's own attention over the step's tokens
            mask = None if attention_mask is None else attention_mask[..., :q]
            out = dense_attention(query, k, v, mask, scaling)
        else:
            out, middle = self._read(query, scaling, dense_attention, new, variant)
        if self.pipeline.observes:
            self._observe(query, new, scaling, variant, middle, new)
        if valid_new is None:
            valid_new = torch.ones(k.shape[0], q, dtype=torch.bool, device=k.device)
        self._commit_host(k, v, valid_new.expand(k.shape[0], q), pos, seen, flushed)
        if self._prompt_tokens == seen:
            self._prompt_tokens = seen + q  # still the prompt: no decode step since the store was sized
        mark_held_static(self)  # what the prefill built (per-layer plans, index tensors): taken in place by a graph
        return out

    def _commit_host(self, k, v, valid, pos, seen, flushed) -> None:
        q, s, c, f = k.shape[2], self.sink_slots, self.ring_slots, self.flush_size
        valid = self._take_sinks(k, v, valid, pos)
        # Leading columns that hold no ring token in any row (left padding, then the sinks) never enter the ring:
        # they count as flushed, so the window and the flush blocks start at the first real token after the
        # sinks, as in the dynamic cache (which drops such columns) - the same blocks reach the compressors.
        lead = 0
        if self._lead_open and self.flushes:
            live = valid.any(0)
            lead = int(live.int().argmax()) if bool(live.any()) else q  # eager: host reads, until a token lands
            self._lead_open = lead == q
        flushed += lead
        total = seen + q - flushed
        recent = self.layout.recent
        m = ((total - recent) // f) * f if self.flushes and total >= recent + f else 0
        m_old = min(m, max(0, seen - flushed))
        m_new = m - m_old
        a = flushed + m_old - seen if m_new else 0  # the block's first column in this chunk
        block = None
        if m:
            parts = []
            if m_old:
                ring = torch.arange(flushed, flushed + m_old, device=k.device).remainder(c)
                slots = ring + s
                parts.append(KVBlock(self.k.index_select(2, slots), self.v.index_select(2, slots),
                                     self.valid.index_select(1, slots), self.ring_pos.index_select(0, ring)))
                self.valid.index_fill_(1, slots, False)
            if m_new:
                parts.append(KVBlock(k[:, :, a:a + m_new], v[:, :, a:a + m_new], valid[:, a:a + m_new],
                                     pos[a:a + m_new]))
            block = parts[0] if len(parts) == 1 else KVBlock(
                torch.cat([p.k for p in parts], 2), torch.cat([p.v for p in parts], 2),
                torch.cat([p.valid for p in parts], 1), torch.cat([p.positions for p in parts]))
        first = max(lead, a + m_new)  # columns before it were skipped or flushed
        if first < q:  # into the ring first: the hooks see what the row keeps in the window
            ring = pos[first:].remainder(c)
            slots = ring + s
            self.k.index_copy_(2, slots, k[:, :, first:])
            self.v.index_copy_(2, slots, v[:, :, first:])
            self.valid.index_copy_(1, slots, valid[:, first:])
            if self.flushes:
                self.ring_pos.index_copy_(0, ring, pos[first:])
        self.seen.add_(q)
        self.flushed.add_(lead + m)
        self._host = (seen + q, flushed + m)
        self._sinks_full = s == 0 or bool((self.sink_count == s).all())  # eager prefill: one host read
        if block is not None:
            self.pipeline.flush(self, block)

    # sinks: branch-free for any q -----------------------------------------------------------
    def _take_sinks(self, k, v, valid, pos) -> torch.Tensor:
        """Move each row's first ``S`` real tokens into the sink slots; returns ``valid`` without them."""
        s = self.sink_slots
        if s == 0:
            return valid
        rank = self.sink_count.unsqueeze(1) + valid.long().cumsum(1) - 1  # [b, q]
        is_sink = valid & (rank < s)
        match = is_sink.unsqueeze(1) & (rank.unsqueeze(1) == self._sink_index.view(1, s, 1))  # [b, S, q]
        has = match.any(-1)  # [b, S]
        src = match.long().argmax(-1)  # [b, S]
        b, h = k.shape[0], k.shape[1]
        idx = src.view(b, 1, s, 1)
        new_k = k.gather(2, idx.expand(b, h, s, k.shape[-1]))
        new_v = v.gather(2, idx.expand(b, h, s, v.shape[-1]))
        keep = has.view(b, 1, s, 1)
        self.k[:, :, :s].copy_(torch.where(keep, new_k, self.k[:, :, :s]))
        self.v[:, :, :s].copy_(torch.where(keep, new_v, self.v[:, :, :s]))
        self.valid[:, :s].copy_(self.valid[:, :s] | has)
        self.sink_pos.copy_(torch.where(has, pos.gather(0, src.flatten()).view(b, s), self.sink_pos))
        self.sink_count.add_(is_sink.long().sum(1))
        return valid & ~is_sink

    # reads ----------------------------------------------------------------------------------
    def _read(self, query, scaling, dense_attention, new: Segment | None, variant=(None, None),
              scored: bool = False):
        """``(attention output, the middle segments read)``; with ``scored`` (a decode step) also the attention mass
        of every token read, from the read's own scores: ``[buffer mass, *middle masses]`` (see
        :func:`kvcompress.kernels.attention.attend_segments`)."""
        middle = self.middle.segments() if self.middle is not None else []
        if middle:
            selection = self.pipeline.select(self, query)
            if selection is not None:
                middle = apply_selection(middle, selection)
        if not scored and not middle and new is None and self.kernels["lanes_partial"] == "reference":
            # one dense region, no fused kernel: the backend's own attention behind the mask
            mask = self.valid.view(self.valid.shape[0], 1, 1, self.valid.shape[1])
            return dense_attention(query, self.k, self.v, mask, scaling), middle
        # the sinks + ring buffer; without a middle the ring never wraps, so slots past sinks + seen were
        # never written and a fused kernel reads only the written prefix (not the whole capacity); every reader
        # bounds a length by the buffer's slots itself (no clamp op per read)
        length = None if middle else (self.seen if self.sink_slots == 0 else self.seen + self.sink_slots)
        segs = [Segment(self.k, self.v, self.valid, self._zero_pos, length=length)] + middle
        # a decode step's query follows every stored token: no position masks anything (None: no op per read)
        q_pos = new.positions if new is not None else None
        if new is not None:
            segs.append(new)
            # a prefill chunk over dense regions, or regions decoded to dense once: the backend's attention
            if (dense := decoded_for_prompt(query, segs)) is not None:
                return dense_read(query, dense, q_pos, scaling, dense_attention), middle
        from kvcompress.kernels.attention import attend_segments

        out = attend_segments(query, segs, q_pos, scaling, fused=False, impls=self.kernels, softcap=variant[0],
                              sink_logits=variant[1], scored=scored)
        if scored:
            return out[0].transpose(1, 2), middle, out[1]
        return out.transpose(1, 2), middle

    def _observe(self, query, new: Segment, scaling, variant, middle: list[Segment], read_new: Segment | None,
                 decode_slot: torch.Tensor | None = None, read_masses: list[torch.Tensor] | None = None) -> None:
        """Build this step's :class:`~kvcompress.observe.Observation` and hand it to the observers (before the
        commit).  ``read_new``: the step's tokens when read as their own segment (prefill); a decode step reads
        its token from ring slot ``decode_slot`` instead.  ``read_masses``: a decode step's attention mass as its read
        computed it (:meth:`_read` with ``scored``); without it (a prefill) the mass is one reference pass over the
        observed queries.  Branch-free with fixed shapes in a decode step."""
        from .observe import Observation, attention_mass, observe_window

        q = new.k.shape[2]
        w = observe_window(self.layout, q)
        query_w, pos_w = query[:, :, q - w:], new.positions[q - w:]
        obs = Observation(query_w, pos_w, new.k, new.v, new.positions, new.valid, scaling, variant[0], variant[1])
        s, c = self.sink_slots, self.ring_slots
        ring_pos = self.ring_pos if self.flushes else torch.arange(c, device=new.positions.device)
        # copies: the commit writes these buffers before a flush reads the observation
        obs.slot_positions = {"sinks": self.sink_pos.clone(), "recent": ring_pos.clone(), "new": new.positions}
        if self.layout.attention:
            buffer = Segment(self.k, self.v, self.valid, self._zero_pos)
            segs = [buffer] + middle + ([read_new] if read_new is not None else [])

            def mass() -> dict[str, torch.Tensor]:
                if read_masses is not None:  # a decode step: what the read's kernels scored
                    parts = read_masses
                else:  # a prefill: one reference pass over the observed queries
                    parts = attention_mass(query_w, segs, pos_w, scaling, new.k.shape[1], variant[0], variant[1])
                lanes = parts[1:1 + len(middle)]
                if len({m.shape[-1] for m in lanes}) > 1:
                    raise ValueError(f"middle segments over different token columns: {[m.shape[-1] for m in lanes]}")
                b, h = new.k.shape[0], new.k.shape[1]
                out = {"sinks": parts[0][..., :s], "recent": parts[0][..., s:],
                       "middle": sum(lanes[1:], lanes[0]) if lanes else parts[0].new_zeros(b, h, 0)}
                if read_new is not None:
                    out["new"] = parts[-1]
                else:  # the decode step's token was read from its ring slot
                    out["new"] = out["recent"].index_select(-1, decode_slot)
                    width = out["recent"].shape[-1]
                    hit = torch.arange(width, device=decode_slot.device).view(-1, 1) == decode_slot.view(1, -1)
                    # masked_fill, not index_fill: torch 2.11's functionalization turns an out-of-place index_fill of a
                    # view into a copy_ into a fresh tensor, which AOT autograd then refuses (Inductor, CUDA)
                    out["recent"] = out["recent"].masked_fill(hit.any(-1), 0.0)
                return out

            obs._mass_fn = mass
        self.pipeline.observe(self, obs)
        obs.seal()

    # -- batch operations ---------------------------------------------------------------------
    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reorder rows in place (beam search; buffer addresses kept), or repeat / select rows (new buffers: see
        :func:`remap_rows`)."""
        if not self.is_initialized:
            return
        self.k, self.v, self.valid, self.sink_pos, self.sink_count = (
            remap_rows(t, fn) for t in (self.k, self.v, self.valid, self.sink_pos, self.sink_count))
        if self.middle is not None:
            self.middle.map_batch(fn)
        for value in self.state.values():
            if hasattr(value, "map_batch"):
                value.map_batch(fn)

    def reset(self) -> None:
        """Forget every token; buffers keep their addresses (a compiled step stays valid)."""
        self.pending = None
        if not self.is_initialized:
            return
        for t in (self.k, self.v, self.valid, self.ring_pos, self.sink_pos, self.sink_count, self.seen,
                  self.flushed):
            t.zero_()
        self._host = (0, 0)
        self._planned = None
        self._lead_open = True
        self._sinks_full = self.sink_slots == 0
        self._size_due = self.sized_by_prompt  # the next prompt may need a larger middle
        self._prompt_tokens = -1
        if self.middle is not None:
            self.middle.reset()
        for value in self.state.values():
            if hasattr(value, "reset"):
                value.reset()

    # -- accounting ---------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"sinks + recent": 0}
        rows = storage_bytes(self.valid, self.ring_pos, self.sink_pos, self.sink_count, self.seen, self.flushed,
                             self._offsets, self._sink_index, self._true, self._zero_pos)
        return add_store_bytes({"sinks + recent": storage_bytes(self.k, self.v), "sinks + recent" + ROWS: rows},
                               self.middle, self.state)

    def tokens_seen(self) -> int:
        return self.host_counts()[0] if self.is_initialized else 0


def choose_kernels(device: torch.device, head_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, str]:
    """Implementations of the read ops a static layer runs, decided once when it allocates
    (:func:`kvcompress.kernels.ops.choose`: the PyTorch reference on the CPU, fused kernels on CUDA)."""
    from kvcompress.kernels import ops

    return {"lanes_partial": ops.choose("lanes_partial", device, head_dim=head_dim, v_dim=v_dim, dtype=dtype),
            "gather_partial": ops.choose("gather_partial", device, head_dim=head_dim, v_dim=v_dim, dtype=dtype,
                                         query_dtype=dtype),
            "merge_partials": ops.choose("merge_partials", device, v_dim=v_dim)}


# ----------------------------------------------------------------------------- stores


class StaticRing:
    """Slot bookkeeping of a static middle store: ``capacity`` token slots used as a ring.

    Blocks are written at the device cursor (slots that hold no live token: a store is sized so
    that its owner's live tokens plus one block always fit) and the cursor advances by the block's
    size when the block is ``due``; a block that is not due is written as invalid slots.
    """

    def __init__(self, capacity: int, unit: int = 1):
        self.unit = unit
        self.capacity = -(-max(capacity, unit) // unit) * unit
        self.trash = 0  # slot mode (StaticRingStore.use_slots): one more unit, never valid, for dropped columns
        self.valid: torch.Tensor | None = None  # [batch, columns]
        self.pos: torch.Tensor | None = None  # [columns] logical positions
        self.cursor: torch.Tensor | None = None  # 0-dim int64, tokens written

    @property
    def columns(self) -> int:
        """Token columns of every buffer: the capacity, plus the trash unit in slot mode."""
        return self.capacity + self.trash

    def allocate(self, batch: int, device: torch.device) -> None:
        self.valid = torch.zeros(batch, self.columns, dtype=torch.bool, device=device)
        self.pos = torch.zeros(self.columns, dtype=torch.long, device=device)
        self.cursor = torch.zeros((), dtype=torch.long, device=device)
        self._offsets = torch.arange(self.capacity, device=device)
        self._real = torch.arange(self.columns, device=device) < self.capacity  # not the trash
        # middle tokens precede every query: their positions never mask anything
        self.zero_pos = torch.zeros((), dtype=torch.long, device=device).expand(self.columns)
        mark_static(self.valid, self.pos, self.cursor)

    def nbytes(self) -> int:
        """Bytes of the slot bookkeeping (validity, positions, cursor and the constant index tensors)."""
        if self.valid is None:
            return 0
        return storage_bytes(self.valid, self.pos, self.cursor, self._offsets, self._real, self.zero_pos)

    def route(self, block: KVBlock) -> torch.Tensor:
        """Slot mode: the block's target token columns ``[batch, heads, tokens]`` (``block.slots``), a unit whose
        target is out of range or that holds no valid token of its row (a block that is not due) sent to the
        trash unit.  Branch-free."""
        valid = block.valid if block.due is None else block.valid & block.due
        slots = block.slots
        b, h, n = slots.shape
        u = self.unit
        first = slots.view(b, h, n // u, u)[..., 0]
        ok = (first >= 0) & (first < self.capacity) & valid.view(b, 1, n // u, u).any(-1)
        trash = self.capacity + torch.arange(n, device=slots.device).remainder(u)
        return torch.where(ok.repeat_interleave(u, dim=-1), slots, trash)

    def write_slots(self, target: torch.Tensor, block: KVBlock) -> None:
        """Slot mode: row-level occupancy and positions of the columns head 0 writes (every head of a row fills
        the same slots); the trash stays invalid.  Branch-free."""
        valid = block.valid if block.due is None else block.valid & block.due
        head0 = target[:, 0]
        hit = torch.zeros_like(self.valid).scatter_(1, head0, torch.ones_like(valid))
        occupied = torch.zeros_like(self.valid).scatter_(1, head0, valid)
        self.valid.copy_(torch.where(hit, occupied, self.valid) & self._real)
        self.pos.scatter_(0, head0[0], block.positions)  # bounds only: middle tokens precede every query

    def fit(self, block: KVBlock) -> KVBlock:
        """Host-side (prefill) block: drop leading unit-aligned columns no row keeps if it is too large."""
        n = block.num_tokens
        if n <= self.capacity - self.unit or block.due is not None:
            return block
        alive = block.valid.any(dim=0)
        first = int(alive.long().argmax()) if bool(alive.any()) else n
        first = min((first // self.unit) * self.unit, n - self.unit)  # blocks are unit multiples; keep one unit
        block = block.select(torch.arange(first, n, device=block.valid.device))
        if block.num_tokens > self.capacity:
            raise UnsupportedOperationError(
                f"a static middle store of {self.capacity} tokens received {block.num_tokens} live tokens: the "
                "stack keeps more tokens than its evictor declared (Layout.middle)")
        return block

    def slots(self, n: int) -> torch.Tensor:
        return (self.cursor + self._offsets[:n]).remainder(self.capacity)

    def advance(self, n: int, due: torch.Tensor | None) -> None:
        self.cursor.add_(n if due is None else due.long() * n)

    def write_meta(self, slots: torch.Tensor, block: KVBlock) -> None:
        valid = block.valid if block.due is None else block.valid & block.due
        self.valid.index_copy_(1, slots, valid)
        self.pos.index_copy_(0, slots, block.positions)

    def reset(self) -> None:
        if self.valid is not None:
            self.valid.zero_()
            self.pos.zero_()
            self.cursor.zero_()


class StaticRingStore(MiddleStore):
    """Base of the static middle stores: a :class:`StaticRing` of token slots and one dict of payload tensors
    per head-group lane (``[batch, heads, slots or units, ...]``), evicted by masking (``retain``)."""

    static = True
    supports_slots = True

    def __init__(self, capacity: int, unit: int = 1):
        self.ring = StaticRing(capacity, unit)
        self.lanes: list[tuple[HeadGroup, dict[str, torch.Tensor]]] | None = None
        self.slotted = False

    @property
    def num_tokens(self) -> int:
        return self.ring.columns

    def use_slots(self) -> None:
        """Per-head slot placement (see :class:`~kvcompress.state.MiddleStore`): buffers get one trash unit."""
        if self.lanes is not None:
            raise RuntimeError("use_slots() must be called before the store allocates")
        self.slotted = True
        self.ring.trash = self.ring.unit

    @property
    def slot_unit(self) -> int:  # type: ignore[override]
        return self.ring.unit

    @property
    def slot_count(self) -> int:
        return self.ring.capacity

    def slot_valid(self) -> torch.Tensor | None:
        return None if self.ring.valid is None else self.ring.valid[:, : self.ring.capacity]

    def limit(self, max_tokens: int) -> None:  # the capacity was fixed when the cache was built
        return None

    def valid_mask(self) -> torch.Tensor | None:
        return self.ring.valid

    def positions(self) -> torch.Tensor | None:
        return self.ring.pos

    def retain(self, keep: torch.Tensor) -> None:
        self.ring.valid.copy_(self.ring.valid & keep)

    def drop_oldest(self, n: int) -> None:
        raise UnsupportedOperationError("a static store evicts through retain(keep), not drop_oldest")

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.lanes is None:
            return
        self.ring.valid = remap_rows(self.ring.valid, fn)
        for _, bufs in self.lanes:
            for name, t in bufs.items():
                bufs[name] = remap_rows(t, fn)

    def reset(self) -> None:
        self.ring.reset()

    def _meta_bytes(self) -> int:
        return self.ring.nbytes()

    def shrink(self, capacity: int) -> bool:
        """Keep only the first ``capacity`` slots (eagerly, between prefill chunks, before any decode step: every
        stored token lies in slots ``[0, cursor)`` and the ring has not wrapped).  Every payload buffer is
        ``[batch, heads, columns or columns / unit, ...]``: its leading part is copied into a smaller buffer and
        the old one freed.  Returns False (nothing changed) when ``capacity`` is not smaller or the stored tokens
        would not fit with one block in flight."""
        old = self.ring
        new = StaticRing(capacity, old.unit)
        new.trash = old.trash
        if new.capacity >= old.capacity:
            return False
        if old.valid is None:  # nothing allocated yet
            self.ring = new
            return True
        buffers = [t for _, bufs in self.lanes or [] for t in bufs.values()]
        if any(t.shape[2] not in (old.columns, old.columns // old.unit) for t in buffers):
            return False  # a buffer laid out otherwise: left as it is
        if int(old.cursor) + old.unit > new.capacity:  # one device read (eager prefill)
            return False
        new.allocate(old.valid.shape[0], old.valid.device)
        keep = new.capacity
        new.valid[:, :keep].copy_(old.valid[:, :keep])
        new.pos[:keep].copy_(old.pos[:keep])
        new.cursor.copy_(old.cursor)
        for _, bufs in self.lanes or []:
            for name, t in bufs.items():
                per_token = t.shape[2] == old.columns  # else one entry per unit of tokens (e.g. KIVI's key scales)
                shape = list(t.shape)
                shape[2] = new.columns if per_token else new.columns // new.unit
                n = keep if per_token else keep // new.unit
                small = t.new_zeros(shape)
                small[:, :, :n].copy_(t[:, :, :n])
                mark_static(small)
                bufs[name] = small
        self.ring = new
        return True

    def index_tensors(self) -> list[torch.Tensor]:
        """The lanes' head / channel index tensors (a pruner's per-layer choice, which its state may share)."""
        return [t for group, _ in self.lanes or [] for t in (group.heads, group.channels) if isinstance(t, torch.Tensor)]


class StaticDenseStore(StaticRingStore):
    """Full-precision static middle: one lane ``[batch, heads, capacity, dk]`` per head group.

    The static counterpart of :class:`~kvcompress.state.DenseStore` (same lanes, same segments),
    read in place with a device-side validity mask.  With a per-head validity (:meth:`use_head_valid`, adaptive
    per-head budgets) each lane also keeps ``hvalid`` ``[batch, heads, columns]`` (the ring's row-level ``valid``
    is then the union over the heads) and its segment reads it.

    Per-head lengths are not known when a static store is built (capacities are decided once, no host read on the
    decode path), so every head's columns are sized at the capacity one head can reach: under the adaptive schedule
    (``Layout.prefill_ratio``: the budget of all the row's kv heads, up to the prompt) that is more than the uniform
    schedule's (a ratio of the prompt), plus the per-head validity (one bool per row, head and column).  Splitting
    the lanes per head (as the dynamic :class:`~kvcompress.state.DenseStore` does, where lengths follow the counts)
    would need the counts when the store is built.
    """

    supports_head_valid = True
    per_head = False

    def use_head_valid(self) -> None:
        if self.lanes is not None:
            raise RuntimeError("use_head_valid() must be called before the store allocates")
        self.per_head = True

    def head_valid_mask(self) -> torch.Tensor | None:
        if not self.per_head or self.lanes is None:
            return None
        if len(self.lanes) == 1 and self.lanes[0][0].heads is None:
            return self.lanes[0][1]["hvalid"]
        heads = max(bufs["k"].shape[1] if g.heads is None else int(g.heads.max()) + 1 for g, bufs in self.lanes)
        out = self.ring.valid.unsqueeze(1).repeat(1, heads, 1)
        for group, bufs in self.lanes:
            if group.heads is None:
                out = bufs["hvalid"].clone()
            else:
                out[:, group.heads] = bufs["hvalid"]
        return out

    def retain(self, keep: torch.Tensor) -> None:
        super().retain(keep)
        for _, bufs in self.lanes or []:
            if "hvalid" in bufs:
                bufs["hvalid"].copy_(bufs["hvalid"] & keep.unsqueeze(1))

    def reset(self) -> None:
        super().reset()
        for _, bufs in self.lanes or []:
            if "hvalid" in bufs:
                bufs["hvalid"].zero_()

    def append(self, block: KVBlock) -> None:
        if block.slots is None:
            block = self.ring.fit(block)
        parts = block.parts()
        if self.lanes is None:
            self.ring.allocate(block.valid.shape[0], block.valid.device)
            self.lanes = []
            for part in parts:
                b, h = part.k.shape[0], part.k.shape[1]
                bufs = {"k": part.k.new_zeros(b, h, self.ring.columns, part.k.shape[-1]),
                        "v": part.v.new_zeros(b, h, self.ring.columns, part.v.shape[-1])}
                if self.per_head:
                    bufs["hvalid"] = torch.zeros(b, h, self.ring.columns, dtype=torch.bool, device=part.k.device)
                mark_static(*bufs.values())
                self.lanes.append((part.layout(), bufs))
        if block.slots is not None:  # slot mode: per-head targets chosen by the evictor
            target = self.ring.route(block)
            for (group, bufs), part in zip(self.lanes, parts):
                t = target if group.heads is None else target.index_select(1, group.heads)
                for name, src in (("k", part.k), ("v", part.v)):
                    bufs[name].scatter_(2, t.unsqueeze(-1).expand(*t.shape, src.shape[-1]), src)
            self.ring.write_slots(target, block)
            return
        n = block.num_tokens
        slots = self.ring.slots(n)
        valid = block.valid if block.due is None else block.valid & block.due
        for (group, bufs), part in zip(self.lanes, parts):
            bufs["k"].index_copy_(2, slots, part.k)
            bufs["v"].index_copy_(2, slots, part.v)
            if "hvalid" in bufs:
                if block.head_valid is None:
                    hv = valid.unsqueeze(1).expand(valid.shape[0], bufs["hvalid"].shape[1], n)
                else:
                    hv = block.head_valid if group.heads is None else block.head_valid.index_select(1, group.heads)
                    hv = hv & valid.unsqueeze(1)
                bufs["hvalid"].index_copy_(2, slots, hv)
        self.ring.write_meta(slots, block)
        self.ring.advance(n, block.due)

    def segments(self) -> list[Segment]:
        if self.lanes is None:
            return []
        return [group.attach(Segment(bufs["k"], bufs["v"], bufs.get("hvalid", self.ring.valid), self.ring.zero_pos))
                for group, bufs in self.lanes]

    def nbytes(self) -> dict[str, int]:
        n = sum(t.numel() * t.element_size() for _, bufs in self.lanes or [] for t in bufs.values())
        return {"middle": n, "middle" + ROWS: self._meta_bytes()}


__all__ = ["StaticDenseStore", "StaticLayer", "StaticRing", "StaticRingStore", "mark_held_static", "mark_static",
           "middle_capacity", "sized_by_prompt"]
