"""A paged KV pool: fixed-size pages, per-sequence block tables and a free list.

The block layout serving engines use (vLLM's PagedAttention), as a
:class:`~kvcompress.state.MiddleStore` any evictor can build through
``kvcompress_middle_store``:

* **Pages.** A page holds ``page_size`` (P) token slots of *one* batch row, for every kv
  head of a head-group lane (one lane for all heads, or one per LeanK group: the blocks'
  ``parts()``).  Each lane keeps one tensor per payload, ``[capacity, heads, n, ...]``,
  where ``n`` counts the page's tokens (or its encoding units: KIVI key groups,
  ``codec.token_axis(name)``).  Shared by all lanes: per-slot ``valid`` ``[capacity, P]``
  and logical ``positions`` ``[capacity, P]``, and one ``score`` float per page.
* **Block tables.** Each row owns an ordered list of pages, oldest first.  Rows keep
  different tokens (per-row eviction) yet stay dense: a row's surviving tokens are packed
  into its own pages in position order.  Attention gets the table as an int32 tensor
  ``[rows, max_pages]`` with ``-1`` past a row's last page.
* **Free list.** Evicted pages go back to a free list and are handed out again (last
  freed, first reused) before the pool grows.  The pool grows by doubling, capped at the
  owner's bound (``rows * max_pages_per_row``), so under a token budget its memory is
  bounded no matter how long generation runs.

Payloads are encoded by a *codec* (:class:`DenseCodec` keeps full precision; a quantizer
hands its own through ``kvcompress_middle_codec``, e.g. KIVI's G-aligned groups).  Pages
are append-only: a page is encoded once, from the ``P`` tokens of one row, and never
re-encoded; eviction only masks slots or frees the whole page.

Read path: :meth:`PagedStore.segments` returns one :class:`~kvcompress.state.Segment` per
lane whose ``packed`` is a :class:`PagedView`.  Full-precision pages are read through the
block table in place (``kvcompress.kernels.paged``: the Triton paged decode kernel on
CUDA, a PyTorch gather on CPU); encoded pages are gathered through the table into a
transient packed region and read by the codec's own op (KIVI: its fused kernel on CUDA).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Protocol

import torch

from .state import ROWS, HeadGroup, KVBlock, MiddleStore, Segment, grown_capacity


class MiddleCodec(Protocol):
    """What a store needs from a quantizer's encoding (see ``kvcompress_middle_codec``)."""

    names: tuple[str, ...]

    @property
    def unit(self) -> int: ...

    def token_axis(self, name: str) -> bool: ...

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               fill: bool | None = None, impl: str = "reference") -> dict[str, torch.Tensor]: ...

    def choose_quantizer(self, k: torch.Tensor, v: torch.Tensor) -> str:
        """Optional: the encoder implementation (passed back as ``encode(..., impl=)``) for blocks shaped like
        ``k`` / ``v``; a static store asks once, when it allocates."""
        ...

    def packed(self, payload: dict[str, torch.Tensor], valid: torch.Tensor) -> Any: ...

    def report_key(self, name: str) -> str: ...


class DenseCodec:
    """The identity encoding: payloads ``k`` and ``v`` in the model's dtype (one token per unit)."""

    names = ("k", "v")
    unit = 1

    def token_axis(self, name: str) -> bool:
        return True

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               fill: bool | None = None, impl: str = "reference") -> dict[str, torch.Tensor]:
        return {"k": k, "v": v}

    def choose_quantizer(self, k: torch.Tensor, v: torch.Tensor) -> str:
        return "reference"

    def packed(self, payload: dict[str, torch.Tensor], valid: torch.Tensor) -> "DenseRegion":
        return DenseRegion(payload["k"], payload["v"], valid)

    def report_key(self, name: str) -> str:
        return "middle: pages"


@dataclasses.dataclass
class DenseRegion:
    """Full-precision keys/values ``[B, H, T, d]`` read like a packed region (reference path)."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor

    supports_softcap = True  # attention_partial takes the model's logit soft-cap

    @property
    def num_tokens(self) -> int:
        return self.valid.shape[-1]

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def attention_partial(self, query: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from kvcompress.kernels.attention.reference import partial_attention

        return partial_attention(query, self.k, self.v, self.valid[:, None, None, :], scale, softcap)


# ----------------------------------------------------------------------------- packing rows into pages


@dataclasses.dataclass
class RowPages:
    """How the valid tokens of a block ``[rows, T]`` pack into pages, row by row, in token order.

    Attributes:
        row: ``[N]`` batch row of each new page.
        token: ``[N, P]`` block column of each slot (clamped; meaningless where ``slot_valid`` is False).
        slot_valid: ``[N, P]`` whether the slot holds a token.
        pages_per_row: pages each row gets (host list).
        tokens_per_page: valid slots of each page (host list, page order).
    """

    row: torch.Tensor
    token: torch.Tensor
    slot_valid: torch.Tensor
    pages_per_row: list[int]
    tokens_per_page: list[int]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [rows, T, ...]`` -> ``[N, P, ...]``."""
        return x[self.row[:, None], self.token]


def pack_rows(valid: torch.Tensor, page_size: int) -> RowPages:
    """Pack each row's valid tokens (in column order) into pages of ``page_size`` slots."""
    rows, t = valid.shape
    dev = valid.device
    counts = valid.sum(dim=1)
    host_counts = counts.tolist()
    pages_per_row = [-(-c // page_size) for c in host_counts]
    n = sum(pages_per_row)
    if n == 0:
        empty = torch.zeros(0, page_size, dtype=torch.long, device=dev)
        return RowPages(torch.zeros(0, dtype=torch.long, device=dev), empty, empty.bool(), pages_per_row, [])
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid columns first, in order
    per_row = torch.tensor(pages_per_row, device=dev)
    row = torch.repeat_interleave(torch.arange(rows, device=dev), per_row)
    first = torch.cumsum(per_row, 0) - per_row
    page_in_row = torch.arange(n, device=dev) - first[row]
    rank = page_in_row[:, None] * page_size + torch.arange(page_size, device=dev)
    slot_valid = rank < counts[row][:, None]
    token = order[row[:, None], rank.clamp(max=max(t - 1, 0))]
    tokens_per_page = [min(page_size, c - j * page_size) for c, p in zip(host_counts, pages_per_row) for j in range(p)]
    return RowPages(row, token, slot_valid, pages_per_row, tokens_per_page)


def page_scores(token_scores: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """Mean score of each page's valid tokens: ``[N, P]`` -> ``[N]`` float32 (0 for an empty page)."""
    w = slot_valid.float()
    return (token_scores.float() * w).sum(1) / w.sum(1).clamp(min=1)


# ----------------------------------------------------------------------------- the store


class PagedView:
    """One lane of a paged pool as attention reads it (``Segment.packed``).

    ``valid`` ``[rows, max_pages * P]``: column ``j`` of row ``b`` is slot ``j % P`` of the row's
    ``j // P``-th page (oldest first).  Rows hold different tokens in the same column.
    """

    supports_softcap = True  # attention_partial takes the model's logit soft-cap (its codec's region must too)

    def __init__(self, store: "PagedStore", payload: dict[str, torch.Tensor], table: torch.Tensor,
                 valid: torch.Tensor):
        self.store = store
        self.payload = payload
        self.table = table
        self.valid = valid

    @property
    def num_tokens(self) -> int:
        return self.valid.shape[-1]

    @property
    def page_size(self) -> int:
        return self.store.page_size

    def gather(self, name: str) -> torch.Tensor:
        """Payload ``name`` gathered through the block table: ``[rows, heads, pages * n, ...]`` (transient)."""
        t = self.payload[name]
        g = t[self.table.clamp(min=0).long()]  # [rows, pages, heads, n, ...]
        g = g.transpose(1, 2)
        return g.reshape(g.shape[0], g.shape[1], g.shape[2] * g.shape[3], *g.shape[4:])

    def region(self) -> Any:
        """The lane as one packed (or dense) region of the codec, gathered through the table."""
        return self.store.codec.packed({n: self.gather(n) for n in self.store.codec.names}, self.valid)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[rows, heads, pages*P, dk]`` and values (reference read: a transient dense copy)."""
        return self.region().dequantize()

    def attention_partial(self, query: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``query [rows, heads, M, dk]`` over this lane (``softcap``: the model's logit soft-cap).

        Full-precision pages: the paged attention op reads pages through the block table in
        place (Triton kernel on CUDA).  Encoded pages: gathered into a transient packed region,
        then the codec's op (KIVI's fused kernel on CUDA).
        """
        if isinstance(self.store.codec, DenseCodec):
            from kvcompress.kernels.paged import paged_attention_partial

            return paged_attention_partial(query, self.payload["k"], self.payload["v"], self.store.valid, self.table,
                                           scale, softcap=softcap)
        region = self.region()
        if softcap is None:
            return region.attention_partial(query, scale)
        if not getattr(region, "supports_softcap", False):  # a third-party codec: read decoded, with the cap
            from kvcompress.kernels.attention.reference import partial_attention

            k, v = region.dequantize()
            return partial_attention(query, k, v, self.valid[:, None, None, :], scale, softcap)
        return region.attention_partial(query, scale, softcap=softcap)


class PagedStore(MiddleStore):
    """The middle region of one layer as a paged pool (see the module docstring).

    Args:
        page_size: tokens per page (P); a multiple of ``codec.unit``.
        codec: payload encoding (default :class:`DenseCodec`, full precision).
        score_key: ``block.meta`` key of per-token scores ``[rows, tokens]``; each page stores
            the mean over its tokens (``None``: scores 0).
        max_pages_per_row: the pool never grows beyond ``rows * max_pages_per_row`` pages by
            itself (``None``: unbounded; :meth:`limit` sets it from a token budget).  Allocating
            past it still succeeds (an owner that keeps more pages than it promised) and counts
            in ``stats["overflow"]``.
    """

    def __init__(self, page_size: int = 16, codec: MiddleCodec | None = None, score_key: str | None = None,
                 max_pages_per_row: int | None = None):
        self.codec = codec if codec is not None else DenseCodec()
        if page_size < 1 or page_size % self.codec.unit:
            raise ValueError(f"page size {page_size} is not a multiple of the codec's unit ({self.codec.unit} tokens)")
        self.page_size = page_size
        self.score_key = score_key
        self.max_pages_per_row = max_pages_per_row
        self.lanes: list[tuple[HeadGroup, dict[str, torch.Tensor]]] | None = None
        self.valid: torch.Tensor | None = None  # [capacity, P] bool
        self.positions: torch.Tensor | None = None  # [capacity, P] int32
        self.score: torch.Tensor | None = None  # [capacity] float32
        self.tokens: list[int] = []  # valid slots per physical page (host)
        self.free: list[int] = []  # free physical pages, reused last-freed-first
        self.fresh = 0  # physical pages ever handed out (the rest of the capacity is untouched)
        self.rows: list[list[int]] | None = None  # block tables (host): physical pages per row, oldest first
        self._table: torch.Tensor | None = None
        self._segments: list[Segment] | None = None
        self.stats = {"pages_written": 0, "reused": 0, "freed": 0, "grown": 0, "overflow": 0}

    # -- capacity -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    @property
    def live_pages(self) -> int:
        return sum(len(r) for r in self.rows or [])

    def bound(self) -> int | None:
        """Most pages the pool grows to by itself (``rows * max_pages_per_row``)."""
        if self.max_pages_per_row is None or self.rows is None:
            return None
        return len(self.rows) * self.max_pages_per_row

    def limit(self, max_tokens: int) -> None:
        """Token budget per row: pages per row are bounded by ``ceil(max_tokens / P) + 1``."""
        self.max_pages_per_row = -(-max_tokens // self.page_size) + 1

    def _tensors(self):
        """(owner dict or None, name) of every page-major tensor."""
        yield None, "valid"
        yield None, "positions"
        yield None, "score"
        for _, bufs in self.lanes or []:
            for name in bufs:
                yield bufs, name

    def _grow(self, needed: int) -> None:
        bound = self.bound()
        cap = grown_capacity(self.capacity, needed, unit=self.page_size, limit=bound)
        if bound is not None:
            if needed > bound:
                self.stats["overflow"] += 1
        for bufs, name in list(self._tensors()):
            old = getattr(self, name) if bufs is None else bufs[name]
            new = old.new_zeros(cap, *old.shape[1:])
            new[: old.shape[0]] = old
            if bufs is None:
                setattr(self, name, new)
            else:
                bufs[name] = new
        self.tokens += [0] * (cap - len(self.tokens))
        self.stats["grown"] += 1

    def _alloc(self, n: int) -> list[int]:
        out = []
        while self.free and len(out) < n:
            out.append(self.free.pop())
        self.stats["reused"] += len(out)
        rest = n - len(out)
        if rest:
            if self.fresh + rest > self.capacity:
                self._grow(self.fresh + rest)
            out += list(range(self.fresh, self.fresh + rest))
            self.fresh += rest
        return out

    def _release(self, pages: list[int]) -> None:
        if not pages:
            return
        idx = torch.tensor(pages, device=self.valid.device)
        self.valid[idx] = False
        self.score[idx] = 0
        for p in pages:
            self.tokens[p] = 0
        self.free.extend(pages)
        self.stats["freed"] += len(pages)
        self._dirty()

    def _dirty(self) -> None:
        self._table = None
        self._segments = None

    # -- MiddleStore ----------------------------------------------------------------------
    def append(self, block: KVBlock) -> None:
        """Pack each row's valid tokens into new pages of that row (encoded once, append-only)."""
        p = self.page_size
        packing = pack_rows(block.valid, p)
        if self.rows is None:
            self.rows = [[] for _ in range(block.valid.shape[0])]
        n = len(packing.tokens_per_page)
        if n == 0:
            return
        encoded = []
        for part in block.parts():
            k = packing.gather(part.k.transpose(1, 2)).transpose(1, 2)  # [N, heads, P, dk]
            v = packing.gather(part.v.transpose(1, 2)).transpose(1, 2)
            encoded.append((part, self.codec.encode(k.contiguous(), v.contiguous(), packing.slot_valid)))
        dev = packing.slot_valid.device
        if self.lanes is None:
            self.lanes = [(part.layout(), {name: t.new_zeros(0, *t.shape[1:]) for name, t in data.items()})
                          for part, data in encoded]
            self.valid = torch.zeros(0, p, dtype=torch.bool, device=dev)
            self.positions = torch.zeros(0, p, dtype=torch.int32, device=dev)
            self.score = torch.zeros(0, dtype=torch.float32, device=dev)
        phys = self._alloc(n)
        idx = torch.tensor(phys, device=dev)
        for (_, bufs), (_, data) in zip(self.lanes, encoded):
            for name, src in data.items():
                bufs[name].index_copy_(0, idx, src.to(bufs[name].dtype))
        self.valid.index_copy_(0, idx, packing.slot_valid)
        self.positions.index_copy_(0, idx, block.positions[packing.token].to(torch.int32))
        meta = block.meta.get(self.score_key) if self.score_key is not None else None
        if meta is not None:
            self.score.index_copy_(0, idx, page_scores(packing.gather(meta), packing.slot_valid))
        else:
            self.score.index_fill_(0, idx, 0.0)
        start = 0
        for b, count in enumerate(packing.pages_per_row):
            pages = phys[start:start + count]
            self.rows[b].extend(pages)
            for page, tok in zip(pages, packing.tokens_per_page[start:start + count]):
                self.tokens[page] = tok
            start += count
        self.stats["pages_written"] += n
        self._dirty()

    def table(self) -> torch.Tensor:
        """Block tables as ``[rows, max_pages]`` int32 (``-1`` past a row's last page)."""
        if self._table is None:
            width = max((len(r) for r in self.rows or []), default=0)
            rows = [r + [-1] * (width - len(r)) for r in self.rows or []]
            dev = self.valid.device if self.valid is not None else "cpu"
            self._table = torch.tensor(rows, dtype=torch.int32, device=dev).view(len(rows), width)
        return self._table

    def _view_valid(self, table: torch.Tensor) -> torch.Tensor:
        valid = self.valid[table.clamp(min=0).long()] & (table >= 0).unsqueeze(-1)
        return valid.view(table.shape[0], table.shape[1] * self.page_size)

    def segments(self) -> list[Segment]:
        if self._segments is None:
            table = self.table()
            if table.numel() == 0:
                self._segments = []
                return self._segments
            valid = self._view_valid(table)
            # Middle tokens precede every query: their positions never mask anything.
            positions = torch.zeros((), dtype=torch.long, device=valid.device).expand(valid.shape[1])
            out = []
            for group, bufs in self.lanes:
                view = PagedView(self, bufs, table, valid)
                seg = group.attach(Segment(None, None, valid, positions, packed=view))
                if seg.heads is None:  # name the heads: the view is not a KIVI PackedKV
                    heads = next(iter(bufs.values())).shape[1]
                    seg = dataclasses.replace(seg, heads=torch.arange(heads, device=valid.device))
                out.append(seg)
            self._segments = out
        return self._segments

    @property
    def num_tokens(self) -> int:
        """Columns of :meth:`valid_mask` (the longest block table times P)."""
        return max((len(r) for r in self.rows or []), default=0) * self.page_size

    def row_tokens(self) -> list[int]:
        """Valid tokens each row holds in the pool."""
        return [sum(self.tokens[p] for p in r) for r in self.rows or []]

    def page_score_table(self) -> torch.Tensor:
        """Stored page scores through the block tables: ``[rows, max_pages]`` float32 (``inf`` past the end)."""
        table = self.table()
        s = self.score[table.clamp(min=0).long()]
        return s.masked_fill(table < 0, float("inf"))

    def evict(self, victims: list[tuple[int, int]]) -> None:
        """Free whole pages: ``(row, index in the row's block table)`` pairs (indices before any removal)."""
        freed = []
        by_row: dict[int, set[int]] = {}
        for b, j in victims:
            by_row.setdefault(b, set()).add(j)
        for b, js in by_row.items():
            row = self.rows[b]
            freed += [row[j] for j in sorted(js)]
            self.rows[b] = [page for j, page in enumerate(row) if j not in js]
        self._release(freed)

    def drop_oldest(self, n: int) -> None:
        """Free the ``n // P`` oldest pages of every row (``n`` a multiple of P)."""
        if n % self.page_size:
            raise ValueError(f"a paged store evicts whole pages of {self.page_size} tokens; cannot drop {n}")
        k = n // self.page_size
        self.evict([(b, j) for b, r in enumerate(self.rows or []) for j in range(min(k, len(r)))])

    def valid_mask(self) -> torch.Tensor | None:
        """Per-row validity ``[rows, max_pages * P]``, each row's tokens oldest first.

        Columns follow each row's own block table: the same column of two rows may hold
        different positions (use :attr:`positions` through :meth:`table` to map them).
        """
        table = self.table() if self.rows else None
        if table is None or table.numel() == 0:
            return None
        return self._view_valid(table)

    def retain(self, keep: torch.Tensor) -> None:
        """Evict per row over :meth:`valid_mask`'s columns; a page with no kept slot is freed at once."""
        table = self.table()
        live = table >= 0
        phys = table[live].long()
        self.valid[phys] = self.valid[phys] & keep.view(table.shape[0], table.shape[1], self.page_size)[live]
        counts = self.valid[phys].sum(1).tolist()
        victims = []
        for (b, j), page, count in zip(live.nonzero().tolist(), phys.tolist(), counts):
            self.tokens[page] = count
            if count == 0:
                victims.append((b, j))
        self._dirty()
        self.evict(victims)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reorder / repeat / select rows (beam search, ``num_return_sequences``).

        A permutation only permutes the block tables.  Otherwise every new row gets its own
        copy of a page that another new row already uses (no page is shared, so eviction and
        ``retain`` stay per row); pages of dropped rows are freed.
        """
        if self.rows is None:
            return
        idx = fn(torch.arange(len(self.rows))).tolist()
        if sorted(idx) == list(range(len(self.rows))):
            self.rows = [self.rows[i] for i in idx]
            self._dirty()
            return
        claimed: set[int] = set()
        new_rows, copies = [], []
        for i in idx:
            row = []
            for page in self.rows[i]:
                if page in claimed:
                    copies.append((page, len(new_rows), len(row)))
                    row.append(-1)
                else:
                    claimed.add(page)
                    row.append(page)
            new_rows.append(row)
        dropped = [p for r in self.rows for p in r if p not in claimed]
        self.rows = new_rows
        self._release(dropped)
        if copies:
            dst = self._alloc(len(copies))
            src_t = torch.tensor([c[0] for c in copies], device=self.valid.device)
            dst_t = torch.tensor(dst, device=self.valid.device)
            for bufs, name in list(self._tensors()):
                t = getattr(self, name) if bufs is None else bufs[name]
                t.index_copy_(0, dst_t, t.index_select(0, src_t))
            for (src, b, j), page in zip(copies, dst):
                self.rows[b][j] = page
                self.tokens[page] = self.tokens[src]
        self._dirty()

    def nbytes(self) -> dict[str, int]:
        out = payload_nbytes(self.lanes, self.codec)
        size = (lambda t: 0 if t is None else t.numel() * t.element_size())
        # per-row bookkeeping (page scores are pooled over the heads: the same on every tensor-parallel rank)
        out["middle: page valid + positions" + ROWS] = size(self.valid) + size(self.positions)
        out["middle: page scores" + ROWS] = size(self.score)
        out["middle: block table" + ROWS] = size(self.table()) if self.rows else 0
        return out


def payload_nbytes(lanes: list | None, codec: Any) -> dict[str, int]:
    """Bytes of a paged pool's payload tensors, by memory-report component."""
    out: dict[str, int] = {}
    for _, bufs in lanes or []:
        for name, t in bufs.items():
            key = codec.report_key(name)
            if key != "middle: pages":
                key = key.replace("middle: ", "middle: pages, ")
            out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def pool_pages_for_budget(budget_tokens: int, page_size: int) -> int:
    """Pages one row can need under a budget of ``budget_tokens`` middle tokens (one partial page + a full set)."""
    return math.ceil(budget_tokens / page_size) + 1


# ----------------------------------------------------------------------------- the static store


class StaticPagedStore(MiddleStore):
    """A paged middle for a static cache: each row owns ``pages`` page slots, preallocated.

    Row ``b``'s page ``j`` is token slots ``[j*P, (j+1)*P)`` of the row's payload tensors
    ``[batch, heads, pages*P (or pages*P/unit), ...]``, so attention reads every row's pages in
    place as one region (no block table, no gather) with ``valid`` ``[batch, pages*P]``.  The
    per-row block table of :class:`PagedStore` becomes per-page state on the device: ``live``
    ``[batch, pages]``, the page ``score`` (mean token score), its ``age`` (write order, for "never the
    newest" and ties) and its ``tokens``.  Freeing a page clears its slots; :meth:`append` writes each
    new page into the row's first free page.  One extra page per row takes the writes of blocks that
    are not due (always invalid, never read as live).
    """

    static = True

    def __init__(self, page_size: int, pages: int, codec: MiddleCodec | None = None, score_key: str | None = None):
        self.codec = codec if codec is not None else DenseCodec()
        if page_size < 1 or page_size % self.codec.unit:
            raise ValueError(f"page size {page_size} is not a multiple of the codec's unit ({self.codec.unit} tokens)")
        self.page_size = page_size
        self.pages = pages  # usable pages per row; slot `pages` is the sink for blocks that are not due
        self.score_key = score_key
        self.lanes: list[tuple[HeadGroup, dict[str, torch.Tensor]]] | None = None
        self.valid: torch.Tensor | None = None  # [B, (pages + 1) * P]
        self.pos: torch.Tensor | None = None  # [B, (pages + 1) * P]
        self.live: torch.Tensor | None = None  # [B, pages + 1]
        self.score: torch.Tensor | None = None  # [B, pages + 1] float32
        self.age: torch.Tensor | None = None  # [B, pages + 1] int64
        self.clock: torch.Tensor | None = None  # 0-dim int64: pages written so far
        self.quantizers: list[str | None] | None = None  # per part: the codec's encoder, chosen at the first block

    # -- allocation -------------------------------------------------------------------------
    def _allocate(self, block: KVBlock, encoded: list[tuple[HeadGroup, dict[str, torch.Tensor]]]) -> None:
        from .static import mark_static

        b, dev = block.valid.shape[0], block.valid.device
        slots = (self.pages + 1) * self.page_size
        self.lanes = []
        for part, data in encoded:
            bufs = {}
            for name, t in data.items():
                shape = list(t.shape)
                shape[0] = b
                shape[2] = slots if self.codec.token_axis(name) else slots // self.codec.unit
                bufs[name] = t.new_zeros(shape)
                mark_static(bufs[name])
            self.lanes.append((part.layout(), bufs))
        self.valid = torch.zeros(b, slots, dtype=torch.bool, device=dev)
        self.pos = torch.zeros(b, slots, dtype=torch.long, device=dev)
        self.live = torch.zeros(b, self.pages + 1, dtype=torch.bool, device=dev)
        self.score = torch.zeros(b, self.pages + 1, dtype=torch.float32, device=dev)
        self.age = torch.zeros(b, self.pages + 1, dtype=torch.long, device=dev)
        self.clock = torch.zeros((), dtype=torch.long, device=dev)
        choose = getattr(self.codec, "choose_kernel", None)  # an encoded pool's read kernel, decided once
        self.kernels = [choose(bufs, slots) if choose is not None else None for _, bufs in self.lanes]
        mark_static(self.valid, self.pos, self.live, self.score, self.age, self.clock)

    # -- what the owner reads -----------------------------------------------------------------
    def page_tokens(self) -> torch.Tensor | None:
        """Valid slots of each page ``[batch, pages]`` (0 for free pages)."""
        if self.valid is None:
            return None
        return self.valid.view(self.valid.shape[0], self.pages + 1, self.page_size).sum(-1)[:, :self.pages]

    def row_tokens(self) -> torch.Tensor | None:
        """Valid tokens each row holds in the pool ``[batch]``."""
        return None if self.valid is None else self.valid.sum(1)

    def free_pages(self, mask: torch.Tensor) -> None:
        """Free the pages where ``mask [batch, pages]`` holds (their slots are never read again)."""
        m = torch.nn.functional.pad(mask, (0, 1))
        self.live.copy_(self.live & ~m)
        slots = m.repeat_interleave(self.page_size, dim=1)
        self.valid.copy_(self.valid & ~slots)
        self.score.masked_fill_(m, 0.0)

    # -- MiddleStore ----------------------------------------------------------------------------
    def append(self, block: KVBlock) -> None:
        """Write ``block`` as pages into each row's first free page.

        Host-side blocks (prefill: ``due is None``) pack each row's valid tokens densely into pages, in
        position order; decode blocks are ``F / P`` pages of ``P`` columns per row, written when due.
        """
        p, dev = self.page_size, block.valid.device
        b = block.valid.shape[0]
        if block.due is None:
            packing = pack_rows(block.valid, p)
            rows, tokens, slot_valid = packing.row, packing.token, packing.slot_valid
        else:
            n = block.num_tokens // p
            rows = torch.arange(b, device=dev).repeat_interleave(n)  # page r * n + j: row r, page j
            tokens = (torch.arange(n, device=dev).view(n, 1) * p + torch.arange(p, device=dev)).repeat(b, 1)
            slot_valid = block.valid.view(b * n, p) & block.due
        if rows.numel() == 0:  # nothing kept: allocate from a dummy page, write nothing
            if self.lanes is None:
                self._allocate(block, self._encode(block, torch.zeros(1, dtype=torch.long, device=dev),
                                                   torch.zeros(1, p, dtype=torch.long, device=dev)))
            return
        encoded = self._encode(block, rows, tokens)
        if self.lanes is None:
            self._allocate(block, encoded)
        meta = block.meta.get(self.score_key) if self.score_key is not None else None
        if meta is not None:
            scores = page_scores(meta[rows[:, None], tokens], slot_valid)
        else:
            scores = torch.zeros(rows.shape[0], device=dev)
        positions = block.positions[tokens]
        if block.due is None:  # host: every page at once, into each row's first free pages in order
            self._write_pages(rows, encoded, slot_valid, positions, scores)
        else:
            n = block.num_tokens // p
            for j in range(n):
                sel = torch.arange(b, device=dev) * n + j
                self._write_page(encoded, sel, slot_valid[sel], positions[sel], scores[sel])

    def _encode(self, block: KVBlock, rows: torch.Tensor, tokens: torch.Tensor):
        """Each part's pages encoded: ``(part, {name: [pages, heads, n, ...]})``."""
        out = []
        valid = block.valid[rows[:, None], tokens]
        parts = block.parts()
        if self.quantizers is None:  # chosen once; choose_quantizer is optional in third-party codecs
            choose = getattr(self.codec, "choose_quantizer", None)
            self.quantizers = [choose(part.k, part.v) if choose else None for part in parts]
        for part, impl in zip(parts, self.quantizers):
            k = part.k.transpose(1, 2)[rows[:, None], tokens].transpose(1, 2)  # [N, heads, P, dk]
            v = part.v.transpose(1, 2)[rows[:, None], tokens].transpose(1, 2)
            kw = {} if impl is None else {"impl": impl}
            out.append((part, self.codec.encode(k.contiguous(), v.contiguous(), valid, fill=True, **kw)))
        return out

    def _write_pages(self, rows, encoded, slot_valid, positions, scores) -> None:
        """Host blocks: write page ``i`` of ``encoded`` (row ``rows[i]``; a row's pages in order) into that row's
        first free pages, in one indexed write per buffer. Pages written together get consecutive ages, as one write
        after another would."""
        n, dev = rows.shape[0], rows.device
        free = ~self.live[:, :self.pages]
        counts = torch.bincount(rows, minlength=free.shape[0])
        if bool((counts > free.sum(1)).any()):
            raise RuntimeError("a static paged store ran out of pages: its owner keeps more than it declared")
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(n, device=dev) - first[rows]  # the page's place among its row's new pages
        order = torch.argsort((~free).to(torch.int8), dim=1, stable=True)  # each row's free pages first, in order
        target = order[rows, rank]
        for (_, bufs), (_, data) in zip(self.lanes, encoded):
            for name, src in data.items():
                buf = bufs[name]
                per = self.page_size if self.codec.token_axis(name) else self.page_size // self.codec.unit
                view = buf.view(buf.shape[0], buf.shape[1], self.pages + 1, per, *buf.shape[3:])
                view[rows, :, target] = src.to(buf.dtype)  # [N, heads, per, ...] (advanced indices first)
        p = self.page_size
        self.valid.view(-1, self.pages + 1, p)[rows, target] = slot_valid
        self.pos.view(-1, self.pages + 1, p)[rows, target] = positions.to(self.pos.dtype)
        self.live[rows, target] = True
        self.score[rows, target] = scores.float()
        self.age[rows, target] = self.clock + torch.arange(n, device=dev)
        self.clock.add_(n)

    def _write_page(self, encoded, sel, slot_valid, positions, scores) -> None:
        """Write page ``sel[i]`` of ``encoded`` into row ``i``'s first free page (decode blocks: every row at
        once, branch-free; a row whose page holds no token writes to the spare page)."""
        p, unit = self.page_size, self.codec.unit
        rows = torch.arange(self.live.shape[0], device=self.live.device)
        keep = slot_valid.any(1)  # rows whose page holds a token (False when the block is not due)
        free = ~self.live[:, :self.pages]
        spare = torch.full_like(rows, self.pages)
        target = torch.where(keep & free.any(1), free.long().argmax(1), spare)
        for (_, bufs), (_, data) in zip(self.lanes, encoded):
            for name, src in data.items():
                buf = bufs[name]
                n = p if self.codec.token_axis(name) else p // unit
                view = buf.view(buf.shape[0], buf.shape[1], self.pages + 1, n, *buf.shape[3:])
                page = src.index_select(0, sel).unsqueeze(2).to(buf.dtype)  # [rows, heads, 1, n, ...]
                index = target.view(-1, *([1] * (view.dim() - 1))).expand(page.shape)
                view.index_copy_(0, rows, view.index_select(0, rows).scatter(2, index, page))
        t = target.view(-1, 1, 1).expand(-1, 1, p)
        for buf, new in ((self.valid, slot_valid), (self.pos, positions.to(self.pos.dtype))):
            view = buf.view(buf.shape[0], self.pages + 1, p)
            view.index_copy_(0, rows, view.index_select(0, rows).scatter(1, t, new.unsqueeze(1)))
        tt = target.view(-1, 1)
        live = self.live.index_select(0, rows).scatter(1, tt, keep.view(-1, 1))
        live[:, self.pages] = False
        self.live.index_copy_(0, rows, live)
        self.score.index_copy_(0, rows, self.score.index_select(0, rows).scatter(1, tt, scores.view(-1, 1).float()))
        self.age.index_copy_(0, rows, self.age.index_select(0, rows).scatter(1, tt, self.clock.expand(rows.shape[0], 1)))
        self.clock.add_(1)

    def segments(self) -> list[Segment]:
        if self.lanes is None:
            return []
        zero = torch.zeros((), dtype=torch.long, device=self.valid.device).expand(self.valid.shape[1])
        out = []
        for (group, bufs), impl in zip(self.lanes, self.kernels):
            if isinstance(self.codec, DenseCodec):
                region = self.codec.packed(bufs, self.valid)
            else:
                region = self.codec.packed(bufs, self.valid, impl=impl)
            if isinstance(self.codec, DenseCodec):
                seg = Segment(region.k, region.v, self.valid, zero)
            else:
                seg = Segment(None, None, self.valid, zero, packed=region)
            out.append(group.attach(seg))
        return out

    @property
    def num_tokens(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def limit(self, max_tokens: int) -> None:
        return None

    def valid_mask(self) -> torch.Tensor | None:
        return self.valid

    def positions(self) -> torch.Tensor | None:
        return self.pos

    def retain(self, keep: torch.Tensor) -> None:
        self.valid.copy_(self.valid & keep)
        alive = self.valid.view(self.valid.shape[0], self.pages + 1, self.page_size).any(-1)
        self.live.copy_(self.live & alive)

    def drop_oldest(self, n: int) -> None:
        raise NotImplementedError("a static store evicts through free_pages / retain")

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.lanes is None:
            return
        from .static import remap_rows

        self.valid, self.pos, self.live, self.score, self.age = (
            remap_rows(t, fn) for t in (self.valid, self.pos, self.live, self.score, self.age))
        for _, bufs in self.lanes:
            for name, t in bufs.items():
                bufs[name] = remap_rows(t, fn)

    def reset(self) -> None:
        if self.valid is not None:
            for t in (self.valid, self.pos, self.live, self.score, self.age, self.clock):
                t.zero_()

    def nbytes(self) -> dict[str, int]:
        out = payload_nbytes(self.lanes, self.codec)
        size = (lambda t: 0 if t is None else t.numel() * t.element_size())
        out["middle: page valid + positions + state" + ROWS] = sum(
            size(t) for t in (self.valid, self.pos, self.live, self.score, self.age, self.clock))
        return out
