"""The compressed cache layer: one per full-attention layer of the model.

Storage policy lives here; the *decisions* come from the stack's compressors
through :class:`~kvcompress.pipeline.StackPipeline`.  Two read paths exist:

* **compressed read** (inside ``kvcompress.compress(model, stack)``): ``update``
  stashes the new K/V and returns them unchanged; kvcompress' registered
  attention then calls :meth:`CompressedLayer.attend`, which reads sinks, the
  middle store, the recent ring and the new tokens directly and commits the new
  tokens afterwards.  Masks are built per row from logical positions, so left
  padding and sinks are exact.
* **materialized read** (a ``kvcompress.Cache`` passed to a model that uses
  another attention implementation): ``update`` returns a transient
  full-precision copy of what is kept plus the new tokens, sized for
  transformers' own masks.  Exact without padding; padded batches need the
  compressed-read path and raise a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .errors import UnsupportedOperationError
from .state import (ROWS, KVBlock, LabelTopK, LayerInfo, Layout, RingBuffer, Segment, SinkBuffer, TokenSelection,
                    new_token_validity)


def _cat_blocks(a: KVBlock | None, b: KVBlock | None) -> KVBlock:
    if a is None:
        return b
    if b is None:
        return a
    block = KVBlock(torch.cat([a.k, b.k], 2), torch.cat([a.v, b.v], 2), torch.cat([a.valid, b.valid], 1),
                    torch.cat([a.positions, b.positions], 0))
    if a.all_valid and b.all_valid:
        block.valid_true = block.valid
    return block


class CompressedLayer:
    """Sinks + compressed middle + full-precision recent ring for one attention layer (dynamic cache).

    Core state, free of transformers: :class:`kvcompress.adapters.hf.CompressedCacheLayer` is the
    transformers cache layer that wraps it.
    """

    static = False

    def __init__(self, info: LayerInfo, pipeline: Any):
        self.info = info
        self.pipeline = pipeline
        self.layout: Layout = self.pipeline.layout(info)
        self.state: dict[str, Any] = {}  # per-layer state of compressors, keyed by compressor name
        self.seen = 0
        self.sinks: SinkBuffer | None = None
        self.recent: RingBuffer | None = None
        self.middle = self.pipeline.make_store(self)
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.is_initialized = False

    # -- storage lifecycle (called by the adapter's cache layer) -------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.sinks = SinkBuffer(self.layout.sinks or 0, key_states, value_states)
        cap = None if self.layout.recent is None else self.layout.recent + self.layout.flush - 1
        self.recent = RingBuffer(cap, key_states, value_states, initial=key_states.shape[2])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, compressed: bool):
        """Take the step's new tokens.  ``compressed``: kvcompress attention reads this step (the tokens
        wait in :attr:`pending` for :meth:`attend`); else return a full-precision copy of what is kept
        plus the new tokens for another attention implementation."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seen_before = self.seen
        self.seen += key_states.shape[2]
        if compressed:
            self.pending = (key_states, value_states, seen_before)
            return key_states, value_states
        keys, values = self._materialize(key_states, value_states)
        self.commit(key_states, value_states, None, seen_before)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, compressed: bool) -> tuple[int, int]:
        if compressed:
            # Masks in logical coordinates: column j is logical position j.
            return self.seen + query_length, 0
        stored = self.stored_tokens()
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        if self.sinks is None:
            raise AttributeError("batch_size")
        return self.sinks.k.shape[0]

    def tokens_seen(self) -> int:
        return self.seen

    def reset(self) -> None:
        self.seen = 0
        self.sinks = self.recent = None
        self.state.clear()
        self.middle = self.pipeline.make_store(self)
        self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedOperationError(
            "a compressed kvcompress cache cannot be cropped (assisted/speculative decoding): evicted or "
            "quantized tokens cannot be restored; use plain generation"
        )

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self.sinks.map_batch(fn)
        self.recent.map_batch(fn)
        self.middle.map_batch(fn)
        for value in self.state.values():
            if hasattr(value, "map_batch"):
                value.map_batch(fn)

    # -- storage --------------------------------------------------------------------------
    def regions(self) -> tuple[list[Segment], list[Segment], list[Segment]]:
        """(sink segments, middle segments, recent segments) attention reads."""
        sink, rec = self.sinks.segment(), self.recent.segment()
        return ([sink] if sink is not None else []), self.middle.segments(), ([rec] if rec is not None else [])

    def stored_segments(self) -> list[Segment]:
        sinks, middle, recent = self.regions()
        return sinks + middle + recent

    def held_tokens(self) -> torch.Tensor:
        """``[batch]`` int64: tokens each row holds in full precision outside the middle store (sinks + recent
        window).  During a flush the block has already left the window: this is what the row keeps besides the
        middle and the block (what an evictor with a token budget counts)."""
        device = self.sinks.k.device
        held = torch.tensor(self.sinks.count, dtype=torch.long, device=device)
        ring = self.recent
        if ring.size:
            held = held + ring.valid[:, ring.ordered()].sum(dim=1)
        return held

    def stored_tokens(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sinks.num_tokens + self.middle.num_tokens + self.recent.size

    def commit(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, seen_before: int,
               pos: torch.Tensor | None = None) -> None:
        """Store new tokens after their attention: sinks, then the ring; flush what leaves it.  ``pos``: their
        logical positions (``seen_before ..``) when the caller already made them."""
        b, q = k.shape[0], k.shape[2]
        if pos is None:
            pos = torch.arange(seen_before, seen_before + q, device=k.device)
        if valid is not None or not self.sinks.full:
            # Sinks first; columns that are padding (or a sink) in every row are not stored in the ring.
            if valid is None:
                valid = torch.ones(b, q, dtype=torch.bool, device=k.device)
            valid = self.sinks.take(k, v, valid, pos)
            block = KVBlock(k, v, valid, pos).compact()
            if block is None:
                return
            k, v, valid, pos, q = block.k, block.v, block.valid, block.positions, block.num_tokens
        # else every token is valid and the sinks are full: ``valid`` stays None (made only for a flushed block)
        ring, window, flush = self.recent, self.layout.recent, self.layout.flush
        total = ring.size + q
        m = ((total - window) // flush) * flush if window is not None and total >= window + flush else 0
        if m == 0:
            ring.push(k, v, valid, pos)
            return
        m_old = min(m, ring.size)
        m_new = m - m_old
        old = ring.pop_oldest(m_old) if m_old else None
        new = None
        if m_new:
            new_valid = torch.ones(b, m_new, dtype=torch.bool, device=k.device) if valid is None else valid[:, :m_new]
            new = KVBlock(k[:, :, :m_new], v[:, :, :m_new], new_valid, pos[:m_new],
                          valid_true=new_valid if valid is None else None)
        ring.push(k[:, :, m_new:], v[:, :, m_new:], None if valid is None else valid[:, m_new:], pos[m_new:])
        self.pipeline.flush(self, _cat_blocks(old, new))

    # -- reads ----------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
               dense_attention: Callable[..., torch.Tensor], softcap: float | None = None,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` over this layer's storage plus the pending new tokens.

        ``softcap`` / ``sink_logits``: the model's attention variants (logit soft-cap, per-query-head sink logits;
        :func:`kvcompress.kernels.attention.segment_attention`); ``dense_attention`` applies them too.
        Returns ``[batch, q_len, q_heads, head_dim]`` (transformers' attention output layout).
        """
        k, v, seen_before = self.pending
        self.pending = None
        q = k.shape[2]
        valid_new = self._step_validity(attention_mask, seen_before, q)
        sinks, middle, recent = self.regions()
        segs = sinks + middle + recent
        q_pos = torch.arange(seen_before, seen_before + q, device=k.device)
        new = Segment(k, v, valid_new, q_pos)
        masses = None
        if not segs:
            out = dense_attention(query, k, v, attention_mask, scaling)
        else:
            selection = self.pipeline.select(self, query)
            if selection is not None:
                middle = apply_selection(middle, selection)
                segs = sinks + middle + recent
            if q == 1 and self.layout.attention_at("decode") and self.pipeline.observes:
                # a decode step observed with its attention mass: the read returns the mass from its own scores
                from kvcompress.kernels.attention import attend_segments

                out, masses = attend_segments(query, segs + [new], q_pos, scaling, softcap=softcap,
                                              sink_logits=sink_logits, scored=True)
                out = out.transpose(1, 2)
            elif (dense := decoded_for_prompt(query, segs)) is not None:  # dense, or a prompt chunk's decoded
                out = dense_read(query, dense + [new], q_pos, scaling, dense_attention)
            else:
                from kvcompress.kernels.attention import attend_segments

                out = attend_segments(query, segs + [new], q_pos, scaling, softcap=softcap,
                                      sink_logits=sink_logits).transpose(1, 2)
        if self.pipeline.observes:
            self._observe(query, new, scaling, softcap, sink_logits, sinks, middle, recent, masses)
        self.commit(k, v, valid_new, seen_before, q_pos)
        return out

    def _step_validity(self, attention_mask: torch.Tensor | None, seen_before: int, q: int) -> torch.Tensor | None:
        """The step's tokens' validity ``[batch, q]``, ``None`` when all are valid.  Every layer of one forward call
        gets the same mask object: the first layer reads it (one device sync when there is a mask), the others
        reuse its answer (kept on the cache's pipeline, which its layers share, until the next call)."""
        if attention_mask is None:
            return None
        memo = self.pipeline.step_validity
        if memo is not None and memo[0] is attention_mask and memo[1] == seen_before and memo[2] == q:
            return memo[3]
        valid = new_token_validity(attention_mask, seen_before, q)
        if valid is not None and bool(valid.all()):
            valid = None
        self.pipeline.step_validity = (attention_mask, seen_before, q, valid)
        return valid

    def _observe(self, query: torch.Tensor, new: Segment, scaling: float, softcap: float | None,
                 sink_logits: torch.Tensor | None, sinks: list[Segment], middle: list[Segment],
                 recent: list[Segment], read_masses: list[torch.Tensor] | None = None) -> None:
        """Build this step's :class:`~kvcompress.observe.Observation` from what attention read and hand it to the
        observers (before the commit).  ``read_masses``: a decode step's attention mass per segment read (sinks,
        middle, recent, new), as the read computed it from its own scores; without it (a prefill) the mass is one
        reference pass over the observed queries."""
        from .observe import Observation, attention_mass, observe_window

        q = new.k.shape[2]
        w = observe_window(self.layout, q)
        query_w, pos_w = query[:, :, q - w:], new.positions[q - w:]
        obs = Observation(query_w, pos_w, new.k, new.v, new.positions, new.valid, scaling, softcap, sink_logits)
        # copies: the commit writes these buffers before a flush reads the observation
        obs.slot_positions = {"sinks": self.sinks.positions.clone(), "recent": self.recent.positions.clone(),
                              "new": new.positions}
        if self.layout.attention:
            sink_cap, ring_cap, ring_start = self.sinks.capacity, self.recent.capacity, self.recent.start

            def mass() -> dict[str, torch.Tensor]:
                b, h = new.k.shape[0], new.k.shape[1]
                if read_masses is not None:  # a decode step: what the read scored
                    parts = read_masses
                else:
                    parts = attention_mass(query_w, sinks + middle + recent + [new], pos_w, scaling, h, softcap,
                                           sink_logits)
                zeros = (lambda n: parts[-1].new_zeros(b, h, n))
                out = {"sinks": zeros(sink_cap), "recent": zeros(ring_cap), "new": parts[-1]}
                if sinks:
                    out["sinks"][..., :parts[0].shape[-1]] = parts[0]
                lanes = parts[len(sinks):len(sinks) + len(middle)]
                widths = [m.shape[-1] for m in lanes]
                if len(set(widths)) > 1:
                    if not self.layout.head_valid:
                        raise ValueError(f"middle segments over different token columns: {widths}")
                    # per-head lanes (adaptive per-head budgets): column j of a head is its j-th stored token
                    lanes = [torch.nn.functional.pad(m, (0, max(widths) - m.shape[-1])) for m in lanes]
                out["middle"] = sum(lanes[1:], lanes[0]) if lanes else zeros(0)
                if recent:
                    m = parts[len(sinks) + len(middle)]
                    start = 0 if m.shape[-1] == ring_cap else ring_start
                    out["recent"][..., start:start + m.shape[-1]] = m
                return out

            obs._mass_fn = mass
        self.pipeline.observe(self, obs)
        obs.seal()

    def _materialize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        segs = self.stored_segments()
        if not segs:
            return k, v
        keys, values = [], []
        for s in segs:
            if not s.is_dense:
                raise UnsupportedOperationError(
                    "this stack stores compressed keys that only kvcompress attention can read: "
                    "use `with kvcompress.compress(model, stack) as cache:`"
                )
            if s.valid is not None:
                cols = s.valid.all(dim=0)
                if bool((s.valid != cols.unsqueeze(0)).any()):
                    raise UnsupportedOperationError(
                        "padded batches need kvcompress attention for per-row masks: use "
                        "`with kvcompress.compress(model, stack) as cache: model.generate(..., cache=cache)`"
                    )
                idx = cols.nonzero().flatten()
                keys.append(s.k.index_select(2, idx))
                values.append(s.v.index_select(2, idx))
            else:
                keys.append(s.k)
                values.append(s.v)
        return torch.cat(keys + [k], dim=2), torch.cat(values + [v], dim=2)

    # -- accounting -------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this layer allocates, by region."""
        if not self.is_initialized:
            return {"sinks": 0, "recent": 0, "middle": 0}
        out: dict[str, int] = {}
        for name, buf in (("sinks", self.sinks), ("recent", self.recent)):
            rows = buf.row_nbytes()
            out[name], out[name + ROWS] = buf.nbytes() - rows, rows
        return add_store_bytes(out, self.middle, self.state)


def apply_selection(middle: list[Segment], selection) -> list[Segment]:
    """Attach a read-time selection to the middle segments.

    A boolean mask ``[batch, kv_heads, q_len, middle tokens]`` covers the segments' tokens one
    after the other; a :class:`~kvcompress.state.TokenSelection` (or a :class:`~kvcompress.state.LabelTopK`, its
    indices still to be computed) indexes the token columns every middle segment shares (head-group lanes of one
    store cover the same tokens).
    """
    if isinstance(selection, (TokenSelection, LabelTopK)):
        counts = {s.num_tokens for s in middle}
        if len(counts) > 1:
            raise ValueError(f"a token selection needs middle segments over the same tokens, got {sorted(counts)}")
        return [dataclasses.replace(s, select=selection) for s in middle]
    total = sum(s.num_tokens for s in middle)
    if selection.shape[-1] != total:
        raise ValueError(f"selection covers {selection.shape[-1]} middle tokens, the middle holds {total}")
    out, start = [], 0
    for s in middle:
        out.append(dataclasses.replace(s, select=selection[..., start:start + s.num_tokens]))
        start += s.num_tokens
    return out

def decoded_for_prompt(query: torch.Tensor, segs: list[Segment]) -> list[Segment] | None:
    """The segments of a multi-token read (a prefill chunk) as dense ones for :func:`dense_read`, or ``None``.

    Every stored region is turned once into dense keys / values over the full head dimension, in the query's dtype:
    the chunk then reads every stored token with the backend's own attention (SDPA / flash) instead of the reference
    partial attention, which builds float32 scores of every query row against every stored token (85 of 91 s of a
    KIVI-2 prompt on the CPU, and 22-27 s against 8 s for 8 x 16k tokens on an H100; session 59,
    ``benchmarks/prefill_time.py``).  A packed region (KIVI codes, KIVI lanes, pages) is decoded; keys on a subset of
    channels (``Segment.channels``: LeanK) are scattered into zeros, which add nothing to a score; keys in a basis
    (a :class:`~kvcompress.state.LinearQueryMap` query map: low-rank keys) are mapped back, ``k U^T``, so that
    ``q (k U^T)^T = (q U) k^T``; values through the segment's value map (linear: the same on values as on outputs).
    Head groups are joined into one segment when together they cover every kv head once over the same tokens (one
    host read checks it, which a prompt chunk can afford).  Anything else - another query map, a read-time selection,
    heads left out, groups over different tokens - has no dense form: ``None``, and the read goes through
    :func:`kvcompress.kernels.attention.attend_segments`.  Dense segments come back as they are, for any query
    length; a single query (decode) with a stored region that is not dense gets ``None``: its kernels read it in
    place."""
    b, d = query.shape[0], query.shape[-1]
    h = next((s.k.shape[1] for s in segs if s.is_dense), None)
    out, groups = [], []
    for seg in segs:
        if seg.is_dense:
            out.append(seg)
            continue
        if query.shape[2] == 1 or seg.select is not None:
            return None
        full = _full_dim(seg, b, d, query.dtype)
        if full is None:
            return None
        if seg.heads is None and (seg.valid is None or seg.valid.dim() == 2):  # every head, one validity
            h = full.k.shape[1] if h is None else h
            if full.k.shape[1] != h:
                return None
            out.append(full)
        else:  # a head subset, or per-head validity: joined with the other groups below (padded if they differ)
            groups.append((seg.heads, full))
    if groups:
        if h is None or (joined := _joined(groups, h, query)) is None:
            return None
        out.append(joined)
    return out


def _full_dim(seg: Segment, b: int, d: int, dtype: torch.dtype) -> Segment | None:
    """``seg``'s keys / values as ``[batch, heads, tokens, head_dim]`` in ``dtype`` (its validity and positions
    kept), or ``None`` when its layout has no such form."""
    from .state import LinearQueryMap

    k, v = seg.keys_values()
    if k.dim() != 4 or k.shape[0] != b or k.shape[2] != seg.num_tokens or v.shape[:3] != k.shape[:3]:
        return None  # rows or heads laid out otherwise (e.g. pages of several rows)
    if isinstance(seg.qmap, LinearQueryMap):
        k = torch.einsum("bhtr,hdr->bhtd", k.float(), seg.qmap.basis)
    elif seg.channels is not None and k.shape[-1] == seg.channels.shape[-1] and k.shape[-1] != d:
        kept = seg.channels.shape[-1]
        full = k.new_zeros(b, k.shape[1], k.shape[2], d)
        full.scatter_(-1, seg.channels.view(1, -1, 1, kept).expand(b, -1, k.shape[2], kept), k)
        k = full
    elif seg.qmap is not None and seg.channels is None:
        return None  # a query map with no key-side form
    if seg.vmap is not None:
        v = seg.vmap(v)
    if k.shape[-1] != d or v.shape[-1] != d:
        return None
    return Segment(k.to(dtype), v.to(dtype), seg.valid, seg.positions)


def _joined(groups: list[tuple[torch.Tensor | None, Segment]], h: int, query: torch.Tensor) -> Segment | None:
    """Head groups (``(heads or None for all, full-dimension segment)``) as one segment over all ``h`` kv heads, or
    ``None`` unless they cover every head exactly once.  Over the same tokens (one validity - per-head validity that
    is the same for every head collapses to it - and one set of positions, checked with one host read) they join
    as they are; otherwise padded to one length with a per-head validity (:func:`_padded`)."""
    first = groups[0][1]
    n, dev = first.num_tokens, query.device
    heads = [torch.arange(s.k.shape[1], device=dev) if hs is None else hs for hs, s in groups]
    if sum(x.numel() for x in heads) != h or any(x.numel() != s.k.shape[1] for x, (_, s) in zip(heads, groups)):
        return None
    cover = torch.cat(heads).sort().values.eq(torch.arange(h, device=dev)).all()
    if any(s.num_tokens != n for _, s in groups) or any((s.valid is None) != (first.valid is None) for _, s in groups):
        return _padded(groups, heads, h, query) if bool(cover) else None
    no = torch.zeros((), dtype=torch.bool, device=dev)
    checks = [cover]
    rows = []  # each group's validity as [batch, tokens]
    for _, s in groups:
        if s.valid is not None and s.valid.dim() == 3:
            checks.append(s.valid.eq(s.valid[:, :1]).all())
            rows.append(s.valid[:, 0])
        else:
            rows.append(s.valid)
    for (_, s), valid in zip(groups[1:], rows[1:]):
        if s.positions is not first.positions:
            same = s.positions.shape == first.positions.shape
            checks.append(s.positions.eq(first.positions).all() if same else no)
        if valid is not None and valid is not rows[0]:
            checks.append(valid.eq(rows[0]).all() if valid.shape == rows[0].shape else no)
    ok = torch.stack([cover, torch.stack(checks).all()]).tolist()
    if not ok[0]:
        return None
    if not ok[1]:  # every head once, over different tokens or validities
        return _padded(groups, heads, h, query)
    b, d = query.shape[0], query.shape[-1]
    keys, values = query.new_empty(b, h, n, d), query.new_empty(b, h, n, d)
    for hs, (_, s) in zip(heads, groups):
        keys.index_copy_(1, hs, s.k)
        values.index_copy_(1, hs, s.v)
    return Segment(keys, values, rows[0], first.positions)


def _padded(groups: list[tuple[torch.Tensor | None, Segment]], heads: list[torch.Tensor], h: int,
            query: torch.Tensor) -> Segment:
    """Head groups that cover every kv head once but hold different tokens (AdaKV's lanes on a dynamic cache: each
    kv head its own survivors) as one segment over the longest group, each head's own tokens first and padding
    slots invalid: a per-head validity ``[batch, h, tokens]`` (:func:`dense_read` masks each head by its own).
    Positions are dropped: these are middle lanes, whose tokens all precede every query of the chunk (the stored
    middle only holds flushed tokens), so no position masks any of them."""
    b, d, dev = query.shape[0], query.shape[-1], query.device
    n = max(s.num_tokens for _, s in groups)
    keys, values = query.new_zeros(b, h, n, d), query.new_zeros(b, h, n, d)
    valid = torch.zeros(b, h, n, dtype=torch.bool, device=dev)
    for hs, (_, s) in zip(heads, groups):
        t, k = s.num_tokens, hs.numel()
        keys[:, hs, :t] = s.k
        values[:, hs, :t] = s.v
        if s.valid is None:
            valid[:, hs, :t] = True
        else:
            valid[:, hs, :t] = s.valid if s.valid.dim() == 3 else s.valid.unsqueeze(1).expand(b, k, t)
    return Segment(keys, values, valid, torch.zeros(n, dtype=torch.long, device=dev))


def dense_read(query, segs, q_pos, scaling, dense_attention):
    """Attention over dense segments by one ``dense_attention`` call over their concatenation (per-query masks
    from logical positions; none for a single query over fully valid segments).  A segment whose validity differs
    by kv head (``[batch, kv_heads, tokens]``: adaptive per-head budgets) gets one call per kv head with its query
    heads (``dense_attention(..., heads=slice)``), each behind that head's mask: one mask over every query head
    would be ``group`` times larger."""
    from kvcompress.kernels.attention.reference import segment_mask

    keys = torch.cat([s.k for s in segs], dim=2)
    values = torch.cat([s.v for s in segs], dim=2)
    mask = None
    b = query.shape[0]
    if any(s.valid is not None and s.valid.dim() == 3 for s in segs):
        h = keys.shape[1]
        g, q = query.shape[1] // h, query.shape[2]

        def visible(s: Segment) -> torch.Tensor:
            return segment_mask(s, q_pos).expand(b, 1, q, s.num_tokens)

        per_head = [s.valid is not None and s.valid.dim() == 3 for s in segs]
        shared = [None if ph else visible(s) for s, ph in zip(segs, per_head)]  # the same for every head: once
        outs = []
        for i in range(h):
            mask = torch.cat([visible(dataclasses.replace(s, valid=s.valid[:, i:i + 1])) if ph else m
                              for s, ph, m in zip(segs, per_head, shared)], dim=-1)
            heads = slice(i * g, (i + 1) * g)
            outs.append(dense_attention(query[:, heads], keys[:, i:i + 1], values[:, i:i + 1], mask, scaling,
                                        heads=heads))
        return torch.cat(outs, dim=2)  # [batch, q, query heads, head_dim], as one call returns it
    if query.shape[2] > 1:
        parts = [segment_mask(s, q_pos).expand(b, 1, q_pos.numel(), s.num_tokens) for s in segs]
        mask = torch.cat(parts, dim=-1)
    elif any(s.valid is not None for s in segs):
        # one query (decode): every stored token precedes it (its own is at its position), so only validity masks
        parts = [s.valid.expand(b, s.num_tokens) if s.valid is not None
                 else torch.ones(b, s.num_tokens, dtype=torch.bool, device=query.device) for s in segs]
        mask = torch.cat(parts, dim=-1).view(b, 1, 1, -1)
    return dense_attention(query, keys, values, mask, scaling)


def add_store_bytes(out: dict[str, int], middle: Any, state: dict[str, Any]) -> dict[str, int]:
    """``out`` plus the middle store's bytes (by component) and those of compressors' per-layer state."""
    if middle is not None:
        for key, n in middle.nbytes().items():
            out[key] = out.get(key, 0) + n
    seen: set = set()
    for key, value in state.items():
        if hasattr(value, "nbytes"):
            rows = value.row_nbytes() if hasattr(value, "row_nbytes") else None
            out[f"state:{key}"] = value.nbytes() - (rows or 0)
            if rows is not None:
                out[f"state:{key}{ROWS}"] = rows
        else:  # plain containers: the tensors in them (each storage once)
            n = _container_bytes(value, seen)
            if n:
                out[f"state:{key}"] = n
    index = _container_bytes(getattr(middle, "index_tensors", list)(), seen)  # not already in a compressor's state
    if index:
        out["middle"] = out.get("middle", 0) + index
    return out


def _container_bytes(value: Any, seen: set) -> int:
    if isinstance(value, torch.Tensor):
        key = (value.untyped_storage().data_ptr(), value.device)
        if key in seen:
            return 0
        seen.add(key)
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return sum(_container_bytes(v, seen) for v in value)
    return 0
