"""Per-layer cache state shared by every compressor of a stack.

A compressed layer holds three regions, all ``[batch, kv_heads, tokens, dim]``:

* **sinks** - the first ``Layout.sinks`` *real* tokens of each row (pad tokens
  never become sinks), full precision (:class:`SinkBuffer`);
* **middle** - tokens that left the recent window and survived eviction, in
  whatever representation the stack's store keeps them (:class:`MiddleStore`;
  :class:`DenseStore` keeps full precision);
* **recent** - the newest tokens, full precision, in a preallocated ring buffer
  (:class:`RingBuffer`; O(1) per appended token, no ``torch.cat`` of the cache).

Rows of a batch share logical positions (left padding keeps them aligned), so
ring and store slots carry one position per slot and a per-row ``valid`` flag.
Every buffer reports the bytes it really allocates (:meth:`nbytes`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import torch

# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Region sizes a compressor asks for on one layer (``None`` = no requirement).

    Attributes:
        sinks: full-precision attention sinks kept per row (first real tokens).
        recent: full-precision recent tokens kept between steps.
        flush: tokens leave the recent window in multiples of this many.
        middle: most tokens the middle store ever holds per row (an evictor's budget); static caches
            size their middle store by it (``None``: no bound, up to the cache's capacity).
        budget: most tokens a row holds in this layer, sinks, recent window and middle together (an
            evictor's token budget). The stack is refused when the full-precision regions the whole
            stack keeps (the largest ``sinks`` plus the largest ``recent``) leave no middle token under
            it (:meth:`kvcompress.pipeline.StackPipeline.check_budgets`).
        observe: query positions of a multi-token step an observation keeps (the last ``observe``;
            :class:`kvcompress.observe.Observation`); combined by maximum; ``None``: 1.
        attention: whether observations carry the attention mass each token received
            (:attr:`kvcompress.observe.Observation.mass`): ``True`` (prefill and decode steps), ``"prefill"`` or
            ``"decode"`` (the steps whose mass the compressor reads); combined by union.  In a decode step named
            here the read itself returns the mass from the scores its kernels computed; elsewhere an observation
            that carries the mass computes it on first access with one reference pass (prefills always, and a
            decode step the layout did not name).  :meth:`attention_at` answers per phase.
        head_slots: whether an evictor writes blocks to per-head store slots (:attr:`KVBlock.slots`): the
            middle store must support them (``supports_slots``; the cache refuses to build otherwise) and
            reserves a trash unit for dropped tokens; combined by "or".
        head_valid: whether the kv heads of a row may keep different numbers of tokens (an evictor with adaptive
            per-head budgets, AdaKV): the pipeline packs each head's survivors densely and the middle store keeps a
            per-(row, kv head) validity (``MiddleStore.supports_head_valid``; the cache refuses to build
            otherwise); its segments' ``valid`` is then ``[batch, heads, tokens]``; combined by "or".
        prefill_ratio: a prefill-time evictor's bound on what a prompt leaves in the middle: after the prompt's
            ``P`` tokens, any one kv head of a row holds at most ``ceil(prefill_ratio x P)`` middle tokens (a
            ``ratio`` of the prompt kept; tokens that arrive after the prompt come on top).  A static cache, which
            cannot grow, sizes its middle store at its first prefill from it (:func:`kvcompress.static.middle_capacity`:
            the bound plus the tokens the capacity leaves after the prompt), so held bytes follow the kept
            fraction instead of the capacity.  Combined by minimum (every evictor's keep mask applies).
        prefill_middle: the same bound as a token count (a prefill-time evictor with a token budget and no bound
            while decoding); combined by minimum.
    """

    sinks: int | None = None
    recent: int | None = None
    flush: int | None = None
    middle: int | None = None
    budget: int | None = None
    observe: int | None = None
    attention: bool | str | None = None
    head_slots: bool | None = None
    head_valid: bool | None = None
    prefill_ratio: float | None = None
    prefill_middle: int | None = None

    #: the values of :attr:`attention` that name one phase
    ATTENTION_PHASES = ("prefill", "decode")

    def attention_at(self, phase: str) -> bool:
        """Whether observations of ``phase`` (``"prefill"`` / ``"decode"``) steps need the attention mass."""
        return self.attention is True or self.attention == phase

    @staticmethod
    def combine(layouts: Iterable["Layout | None"]) -> "Layout":
        sinks = recent = middle = budget = observe = None
        attention = head_slots = head_valid = prefill_ratio = prefill_middle = None
        flush = 1
        for lay in layouts:
            if lay is None:
                continue
            if lay.sinks is not None:
                sinks = max(sinks or 0, lay.sinks)
            if lay.recent is not None:
                recent = max(recent or 0, lay.recent)
            if lay.flush is not None:
                flush = flush * lay.flush // math.gcd(flush, lay.flush)
            if lay.middle is not None:
                middle = lay.middle if middle is None else min(middle, lay.middle)
            if lay.budget is not None:
                budget = lay.budget if budget is None else min(budget, lay.budget)
            if lay.observe is not None:
                observe = max(observe or 0, lay.observe)
            if lay.attention:
                if lay.attention is not True and lay.attention not in Layout.ATTENTION_PHASES:
                    raise ValueError(f"Layout.attention must be True, False, None, 'prefill' or 'decode', got "
                                     f"{lay.attention!r}")
                attention = lay.attention if attention in (None, lay.attention) else True
            if lay.head_slots:
                head_slots = True
            if lay.head_valid:
                head_valid = True
            if lay.prefill_ratio is not None:
                prefill_ratio = lay.prefill_ratio if prefill_ratio is None else min(prefill_ratio, lay.prefill_ratio)
            if lay.prefill_middle is not None:
                prefill_middle = (lay.prefill_middle if prefill_middle is None
                                  else min(prefill_middle, lay.prefill_middle))
        return Layout(sinks=sinks or 0, recent=recent, flush=flush, middle=middle, budget=budget, observe=observe,
                      attention=attention, head_slots=head_slots, head_valid=head_valid, prefill_ratio=prefill_ratio,
                      prefill_middle=prefill_middle)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """Static facts about one attention layer, known before any token arrives.

    Attributes:
        rope_inv_freq: ``[rotary_dim / 2]`` float32 (CPU) inverse frequencies of the layer's rotary embedding
            (keys and queries are rotated by ``position * rope_inv_freq`` in the rotate-half convention of
            Llama-family models: channel ``i`` pairs with ``i + rotary_dim / 2``; channels past ``rotary_dim`` are
            not rotated), or ``None`` when the model has none kvcompress found.
        shard: under tensor parallelism, which of the model's KV heads this process holds
            (:class:`kvcompress.distributed.HeadShard`; ``num_kv_heads`` / ``num_q_heads`` are then this rank's
            counts), else ``None``.
    """

    index: int
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    model_config: Any = None
    rope_inv_freq: Any = None
    shard: Any = None


# ----------------------------------------------------------------------------- blocks and segments


@dataclasses.dataclass
class HeadGroup:
    """Heads of a block that share one dense shape after pruning / regrouping.

    Attributes:
        heads: ``[h]`` kv-head indices (``None`` = every head, in order).
        k: ``[batch, h, tokens, kept]`` keys on the kept channels (or coordinates, for low-rank).
        v: ``[batch, h, tokens, v_dim]`` values.
        channels: ``[h, kept]`` key channels each head keeps (``None`` = all, unmapped).
        qmap: custom query map (e.g. a projection, best as a :class:`LinearQueryMap`, which the read kernels apply
            themselves); overrides ``channels`` when given.
        vmap: output map when ``v`` holds value coordinates (``[batch, h, n, v_dim] -> [..., head_dim]``).
        every_head: ``heads`` lists every kv head of the layer, in order (known on the host when the group is
            made): its segments are read as covering all heads (``Segment.heads`` ``None``), which spares the
            read a gather of the query's heads and a scatter of the partial back to all heads.
    """

    heads: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    channels: torch.Tensor | None = None
    qmap: Callable[[torch.Tensor], torch.Tensor] | None = None
    vmap: Callable[[torch.Tensor], torch.Tensor] | None = None
    every_head: bool = False

    def layout(self) -> "HeadGroup":
        """The static part (heads, channels, query and output maps) without token data."""
        return HeadGroup(self.heads, None, None, self.channels, self.qmap, self.vmap, self.every_head)

    def query_map(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self.qmap is not None or self.channels is None:
            return self.qmap
        h, kept = self.channels.shape
        index = self.channels.view(1, h, 1, 1, kept)

        def gather(q: torch.Tensor) -> torch.Tensor:  # [b, h, group, q_len, d] -> [..., kept]
            return q.gather(-1, index.expand(*q.shape[:-1], kept))

        return gather

    def attach(self, seg: "Segment") -> "Segment":
        """``seg`` read as this group (heads and query map set)."""
        if self.heads is None and self.channels is None and self.qmap is None and self.vmap is None:
            return seg
        channels = self.channels if self.qmap is None else None
        heads = None if self.every_head else self.heads
        return dataclasses.replace(seg, heads=heads, qmap=self.query_map(), channels=channels, vmap=self.vmap)


@dataclasses.dataclass(frozen=True, eq=False)
class LinearQueryMap:
    """A query map that is a linear projection per kv head: ``q -> q @ basis[h]`` (low-rank keys).

    A :class:`HeadGroup` whose keys are coordinates in a basis (``k U``) gives this as its ``qmap`` instead of a
    plain function.  It is still a query map (callable, the reference and every observer call it), and the read
    kernels that recognise it apply it themselves: the grouped lanes kernel multiplies the query by ``weight``
    inside its programs, so a decode read makes no projection, cast or concatenation launches of its own.

    Attributes:
        basis: ``[h, head_dim, r]`` float32, one matrix per head of the group, in the group's head order.
        weight: ``basis`` in the dtype of the stored coordinates, contiguous - what kernels multiply by (made once,
            with the map: :meth:`of`).
    """

    basis: torch.Tensor
    weight: torch.Tensor

    @classmethod
    def of(cls, basis: torch.Tensor, dtype: torch.dtype) -> "LinearQueryMap":
        """The map of ``basis`` (``[h, head_dim, r]``) for coordinates stored in ``dtype``."""
        basis = basis.float().contiguous()
        return cls(basis, basis if dtype == torch.float32 else basis.to(dtype).contiguous())

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        """``[batch, h, group, q_len, head_dim]`` -> ``[..., r]`` in ``q``'s dtype (the product in float32)."""
        out = torch.einsum("bhgqd,hdr->bhgqr", q.float(), self.basis)
        return out if out.dtype == q.dtype else out.to(q.dtype)


@dataclasses.dataclass
class KVBlock:
    """Tokens travelling through the pipeline (leaving the recent window).

    Attributes:
        k, v: ``[batch, kv_heads, tokens, head_dim]`` (full precision until a store encodes them).
        valid: ``[batch, tokens]`` bool, False for padding (and a row's own sinks).
        positions: ``[tokens]`` logical positions (shared by all rows).
        meta: per-token metadata written by the score stage.
        groups: after pruning / regrouping, the head groups that replace ``k`` and ``v``
            (which are then ``None``); an empty list means no head keeps anything.
        due: in a static cache's decode step, a 0-dim bool tensor: whether the block really leaves
            the window this step (``valid`` is already False everywhere when it does not).  Blocks
            have a fixed size there and a hook must not read tensor values on the host; a hook that
            changes stored state (evicting stored tokens, advancing a cursor) applies it only where
            ``due`` holds.  ``None``: the block is real (dynamic caches, prefill).
        head_positions: ``[batch, kv_heads, tokens]`` logical position of each head's token in each column, set
            when an evictor kept different tokens per head (a per-head keep mask, packed by the pipeline: column
            ``j`` of head ``h`` is head ``h``'s ``j``-th kept token); ``positions`` then only bounds them (column
            ``j``'s largest), which is all attention masks need (middle tokens precede every query).  ``None``:
            every head holds the token at ``positions``.
        slots: ``[batch, kv_heads, tokens]`` int64 target token slot of each column per head in a store that
            supports per-head slots (``MiddleStore.supports_slots``; set by an evictor whose layout declares
            ``head_slots``): the store writes column ``j`` of head ``h`` at slot ``slots[b, h, j]``; a target
            ``>= store.slot_count`` drops it (the trash).  ``None``: the store places the block itself.
        head_valid: ``[batch, kv_heads, tokens]`` bool, per-(row, kv head) validity, set when an evictor's per-head
            keep mask gave the heads of a row different numbers of tokens (adaptive per-head budgets,
            ``Layout.head_valid``): column ``j`` of head ``h`` holds a kept token iff ``head_valid[b, h, j]`` (after
            :meth:`pack_heads`, head ``h`` keeps columns ``[0, count[b, h])``); ``valid`` is then their union over the
            heads.  ``None``: every head of a row holds the columns ``valid`` says.
        valid_true: the ``valid`` tensor when the host knows every entry of it is True (the dynamic cache made it
            so: no padding, no sink in the block), else ``None``; :attr:`all_valid` reads it.  Bound to the tensor:
            a new ``valid`` (an evictor's keep mask applied) drops the knowledge.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid: torch.Tensor
    positions: torch.Tensor
    meta: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    groups: list[HeadGroup] | None = None
    due: torch.Tensor | None = None
    head_positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    head_valid: torch.Tensor | None = None
    valid_true: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def all_valid(self) -> bool:
        """Whether the host knows every entry of ``valid`` is True (no device read; False means "unknown")."""
        return self.valid_true is not None and self.valid_true is self.valid

    def parts(self) -> list[HeadGroup]:
        """The block as head groups (one group of every head when not regrouped)."""
        if self.groups is not None:
            return self.groups
        return [HeadGroup(None, self.k, self.v)]

    def select(self, index: torch.Tensor) -> "KVBlock":
        """Keep token columns ``index`` (1-D) for every row."""
        meta = {key: t.index_select(1 if t.dim() == 2 else 2, index) for key, t in self.meta.items()}
        groups = None if self.groups is None else [
            dataclasses.replace(g, k=g.k.index_select(2, index), v=g.v.index_select(2, index)) for g in self.groups]
        pick = (lambda t: None if t is None else t.index_select(2, index))
        return KVBlock(pick(self.k), pick(self.v), self.valid.index_select(1, index),
                       self.positions.index_select(0, index), meta, groups, self.due, pick(self.head_positions),
                       pick(self.slots), pick(self.head_valid))

    def pack_heads(self, keep: torch.Tensor, size: int | None = None, per_head: bool = False) -> "KVBlock":
        """Keep different tokens per kv head: ``keep`` ``[batch, kv_heads, tokens]``, the same number per head of a
        row (the caller checks) unless ``per_head``.  Column ``j`` of head ``h`` becomes head ``h``'s ``j``-th kept
        token (in token order); ``size`` columns (default: all, fixed shape, no host read), ``valid`` the row's
        first ``count`` columns; :attr:`head_positions` and :attr:`slots` follow their tokens; row-level ``meta``
        (``[batch, tokens]``) no longer describes a column and is dropped, per-head meta (``[batch, kv_heads,
        tokens, ...]``) is gathered.  ``per_head`` (adaptive per-head budgets): head ``h`` of row ``b`` may keep its
        own count ``c[b, h]``; :attr:`head_valid` is then ``[batch, kv_heads, size]`` (columns ``[0, c[b, h])``) and
        ``valid`` the longest head's columns.  Used by the pipeline before any head grouping (``groups`` is
        ``None``)."""
        b, h, n = keep.shape
        size = n if size is None else size
        idx = torch.arange(n, device=keep.device)
        if self.head_valid is not None:
            keep = keep & self.head_valid
        order = torch.where(keep, idx, idx + n).argsort(dim=-1)[..., :size]  # kept tokens first, in order
        cols = torch.arange(size, device=keep.device)
        head_valid = None
        if per_head:
            counts = keep.sum(-1)  # [b, h]
            head_valid = cols.view(1, 1, size) < counts.unsqueeze(-1)
            count = counts.amax(-1)
        else:
            count = keep[:, 0].sum(-1)  # [b]: every head of a row keeps as many
        valid = cols.view(1, size) < count.view(b, 1)

        def gather(t: torch.Tensor) -> torch.Tensor:
            index = order.view(b, h, size, *([1] * (t.dim() - 3))).expand(b, h, size, *t.shape[3:])
            return t.gather(2, index)

        head_pos = self.head_positions if self.head_positions is not None else self.positions.view(1, 1, n).expand(
            b, h, n)
        head_pos = head_pos.gather(2, order)
        meta = {key: gather(t) for key, t in self.meta.items() if t.dim() >= 3}
        return KVBlock(gather(self.k), gather(self.v), valid, head_pos.amax(dim=(0, 1)), meta, None, self.due,
                       head_pos, None if self.slots is None else self.slots.gather(2, order), head_valid)

    def compact(self) -> "KVBlock | None":
        """Drop token columns that are invalid in every row; ``None`` when nothing is left."""
        if self.all_valid:
            return self
        columns = self.valid.any(dim=0)
        if bool(columns.all()):
            return self
        if not bool(columns.any()):
            return None
        return self.select(columns.nonzero().flatten())


@dataclasses.dataclass
class TokenSelection:
    """A read-time selection of middle tokens per query head, as indices (read by a gather kernel).

    Attributes:
        index: int64 ``[batch, q_heads, q_len, k]``: for every query head and position, the ``k``
            middle-token columns it reads (columns of each middle segment, oldest first; every
            middle segment of a layer covers the same tokens).  No duplicates within a row.
            With ``group`` set, ``[batch, kv_heads, q_len, k]`` instead: one selection per kv head,
            shared by its ``group`` query heads (GQA), so each selected token is read once per group.
        group: query heads per kv head when the selection is shared per kv head, else ``None``.
    """

    index: torch.Tensor
    group: int | None = None

    def grouped(self, kv_heads: int) -> torch.Tensor:
        """``index`` as grouped query rows ``[batch, kv_heads, group * q_len, k]`` (row ``g * q_len + i``);
        a shared selection is a view that repeats each kv head's indices for its query rows (stride 0)."""
        b, h, q_len, k = self.index.shape
        if self.group is not None:
            rows = self.index.unsqueeze(2).expand(b, h, self.group, q_len, k)
            return rows.reshape(b, h, self.group * q_len, k)
        return self.index.reshape(b, kv_heads, (h // kv_heads) * q_len, k)

    def mask(self, tokens: int) -> torch.Tensor:
        """Boolean ``[batch, q_heads, q_len, tokens]`` (True = read)."""
        out = torch.zeros(*self.index.shape[:-1], tokens, dtype=torch.bool, device=self.index.device)
        out.scatter_(-1, self.index, True)
        if self.group is not None:
            b, h, q_len, _ = out.shape
            out = out.unsqueeze(2).expand(b, h, self.group, q_len, tokens).reshape(b, h * self.group, q_len, tokens)
        return out


@dataclasses.dataclass(eq=False)
class LabelTopK:
    """A read-time selection given by how it is scored, not by its indices: per query head (or per kv head with
    ``group``), the ``k`` middle tokens of largest *label score* ``query[channels] . label`` - a label being a few
    key channels of a token, stored apart (DoubleSparse, arXiv:2408.07092).  The core reads it one of two ways:

    * in one launch with the attention over the chosen tokens, where a kernel does both
      (:func:`kvcompress.kernels.doublesparse.select_gather_attention`: a decode step over one full-precision middle
      segment);
    * otherwise as the :class:`TokenSelection` :meth:`resolve` returns (the select kernel, then the gather).

    Both give the same tokens (the select kernels' exact top-``k``).

    Attributes:
        query: the decode query ``[batch, q_heads, head_dim]``.
        labels: :class:`kvcompress.kernels.doublesparse.Labels` of the middle tokens (``[batch, kv_heads, tokens,
            r]``, or packed 4 / 2-bit codes with a scale and zero per token), columns in middle-store order.
        channels: int64 ``[kv_heads, r]``: the key channels each kv head's labels hold.
        valid: bool ``[batch, tokens]`` (invalid tokens are never chosen), or ``None``.
        k: tokens chosen per selection.
        group: query heads per kv head when one selection per kv head is made from the sum of its query heads'
            scores (GQA), else ``None``.
        impl: the select op's implementation, when a static cache chose it at build
            (:func:`kvcompress.kernels.ops.choose`); ``None``: decided per call.
        one_kernel: whether the read may run the select and its gather in one kernel, when a static cache decided
            it at build (``ops.choose("select_gather", ...) == "triton"``); ``None``: decided per call.
    """

    query: torch.Tensor
    labels: Any
    channels: torch.Tensor
    valid: torch.Tensor | None
    k: int
    group: int | None = None
    impl: str | None = None
    one_kernel: bool | None = None
    _index: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def resolve(self) -> TokenSelection:
        """The selection as indices (computed once: the fused read records the indices it chose)."""
        if self._index is None:
            from kvcompress.kernels.doublesparse import select_topk

            self._index = select_topk(self.query, self.labels, self.channels, self.valid, self.k, impl=self.impl,
                                      group=self.group or 1)
        if self._index.dtype != torch.int64:
            self._index = self._index.long()
        return TokenSelection(self._index.unsqueeze(2), group=self.group)

    def record(self, index: torch.Tensor) -> None:
        """Keep the indices ``[batch, rows, k]`` a fused read chose (int32 or int64), for :meth:`resolve`."""
        self._index = index


def as_token_selection(select: Any) -> Any:
    """``Segment.select`` with a :class:`LabelTopK` resolved to its :class:`TokenSelection` (other values as
    they are): for readers that take indices or masks."""
    return select.resolve() if isinstance(select, LabelTopK) else select


@dataclasses.dataclass
class Segment:
    """A region attention reads.

    Scores of a query against this segment are ``qmap(q) @ k^T`` for the kv heads
    in ``heads`` (all heads when ``None``); the softmax scale is the model's.

    Attributes:
        k, v: ``[batch, len(heads) or kv_heads, tokens, dk / dv]``.
        valid: ``[batch, tokens]`` bool, or ``None`` when every slot is valid; or, in a middle store that keeps a
            per-head validity (``Layout.head_valid``: adaptive per-head budgets), ``[batch, len(heads) or kv_heads,
            tokens]`` (each head of the segment its own columns; :func:`head_mask` reads either form).
        positions: ``[batch, tokens]`` or ``[tokens]`` logical positions.
        heads: kv-head indices this segment covers, or ``None`` for all.
        qmap: maps the grouped query ``[batch, heads, group, q, head_dim]`` to ``dk`` dims.
        select: optional read-time selection: a boolean mask ``[batch, kv_heads, q_len, tokens]`` (True =
            read), a :class:`TokenSelection` (per query head indices) or a :class:`LabelTopK` (indices to be
            computed, possibly by the read itself; :func:`as_token_selection` gives its indices).
        packed: an encoded region (e.g. :class:`kvcompress.kernels.kivi.PackedKV`) read in place by
            attention; ``k`` and ``v`` are then ``None`` and the encoding's own ``valid`` is ``valid``.
            An encoded region must hold only tokens older than every query (the middle always does).
        channels: ``[len(heads), dk]`` key channels each head kept (set with the matching gather
            ``qmap`` by :meth:`HeadGroup.attach`), so kernels can gather the query themselves;
            ``None`` when the keys are not a channel subset.
        vmap: maps attention outputs over ``v`` (value coordinates, ``[batch, heads, n, v_dim]``) back to
            the head dimension; linear, so it applies equally to ``v`` or to the output (``None``: identity).
        length: optional 0-dim int device tensor: slots at or after it hold no valid token (a static
            buffer's written prefix). A bound kernels may use to skip work; ``valid`` stays authoritative.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid: torch.Tensor | None
    positions: torch.Tensor
    heads: torch.Tensor | None = None
    qmap: Callable[[torch.Tensor], torch.Tensor] | None = None
    select: "torch.Tensor | TokenSelection | LabelTopK | None" = None  # read-time selection
    packed: Any = None
    channels: torch.Tensor | None = None
    vmap: Callable[[torch.Tensor], torch.Tensor] | None = None
    length: torch.Tensor | None = None

    @property
    def is_dense(self) -> bool:
        return (self.heads is None and self.qmap is None and self.select is None and self.packed is None
                and self.vmap is None and (self.valid is None or self.valid.dim() == 2))

    @property
    def num_tokens(self) -> int:
        return self.packed.num_tokens if self.packed is not None else self.k.shape[-2]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision ``(k, v)`` of this segment (decoded, transient, when it is packed)."""
        if self.packed is not None:
            return self.packed.dequantize()
        return self.k, self.v


def head_mask(valid: torch.Tensor) -> torch.Tensor:
    """A segment's validity as ``[batch, heads or 1, tokens]``: per head (``[batch, heads, tokens]``, a store with
    per-head validity) or one row-level mask for every head (``[batch, tokens]``)."""
    return valid if valid.dim() == 3 else valid.unsqueeze(1)


def new_token_validity(attention_mask: torch.Tensor | None, first: int | torch.Tensor, q: int) -> torch.Tensor | None:
    """Per-row validity ``[batch, q]`` of the step's tokens at logical positions ``first .. first + q - 1``, read
    from a boolean mask in logical coordinates (``[batch, 1, q, kv]``); ``None`` without a mask.  ``first`` may be
    a device tensor (a static cache's decode step: no host read; columns are clamped to the mask)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        from .errors import UnsupportedOperationError

        raise UnsupportedOperationError("kvcompress attention expects boolean masks")
    rows = torch.arange(q, device=attention_mask.device)
    cols = first + rows
    if isinstance(cols, torch.Tensor):
        cols = cols.clamp(max=attention_mask.shape[-1] - 1)
    return attention_mask[:, 0, rows, cols]


# ----------------------------------------------------------------------------- buffers


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


#: Suffix of a memory-report region that holds per-row bookkeeping with no head dimension (validity masks,
#: positions, block tables, counters, head-pooled scores).  Under tensor parallelism every rank holds the same copy of
#: such a region, so :func:`kvcompress.distributed.sum_reports` counts it once (and reports the other ranks' copies
#: as ``replicated_bytes``), while per-head regions add up over the ranks.  A store or state object names its
#: bookkeeping this way (``nbytes()`` keys ending in it; state objects: an optional ``row_nbytes()``, the part of
#: their ``nbytes()`` that is per row).
ROWS = " (rows)"


class SinkBuffer:
    """First ``capacity`` real tokens of each row, full precision."""

    def __init__(self, capacity: int, like_k: torch.Tensor, like_v: torch.Tensor):
        b, h = like_k.shape[0], like_k.shape[1]
        self.capacity = capacity
        self.k = like_k.new_zeros(b, h, capacity, like_k.shape[-1])
        self.v = like_v.new_zeros(b, h, capacity, like_v.shape[-1])
        self.valid = torch.zeros(b, capacity, dtype=torch.bool, device=like_k.device)
        self.positions = torch.zeros(b, capacity, dtype=torch.long, device=like_k.device)
        self.count = [0] * b
        self.full = capacity == 0
        self._segment: Segment | None = None  # once every row is full the segment never changes: built once

    def take(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Move the first real tokens of each row into the sinks; return the updated ``valid``."""
        if self.full:
            return valid
        valid = valid.clone()
        for b in range(k.shape[0]):
            room = self.capacity - self.count[b]
            if room == 0:
                continue
            idx = valid[b].nonzero().flatten()[:room]
            n = idx.numel()
            if n == 0:
                continue
            dst = slice(self.count[b], self.count[b] + n)
            self.k[b, :, dst] = k[b].index_select(1, idx)
            self.v[b, :, dst] = v[b].index_select(1, idx)
            self.valid[b, dst] = True
            self.positions[b, dst] = positions.index_select(0, idx)
            self.count[b] += n
            valid[b, idx] = False
        self.full = all(c == self.capacity for c in self.count)
        return valid

    def segment(self) -> Segment | None:
        if self._segment is not None:
            return self._segment
        used = max(self.count) if self.count else 0
        if used == 0:
            return None
        valid = None if all(c == used for c in self.count) else self.valid[:, :used]
        seg = Segment(self.k[:, :, :used], self.v[:, :, :used], valid, self.positions[:, :used])
        if self.full:
            self._segment = seg
        return seg

    @property
    def num_tokens(self) -> int:
        return max(self.count) if self.count else 0

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k, self.v, self.valid, self.positions = fn(self.k), fn(self.v), fn(self.valid), fn(self.positions)
        self._segment = None
        idx = fn(torch.arange(len(self.count), device=self.k.device)).tolist()
        self.count = [self.count[i] for i in idx]
        self.full = all(c == self.capacity for c in self.count)

    def nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.valid, self.positions)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row, not per head (validity, positions)."""
        return _nbytes(self.valid, self.positions)


GROWTH_FRACTION = 8  # a growable buffer grows by 1/GROWTH_FRACTION of its capacity ...
GROWTH_MIN_TOKENS = 32  # ... and by at least this many tokens (one KIVI group, two 16-token pages)


def grown_capacity(current: int, needed: int, unit: int = 1, limit: int | None = None) -> int:
    """New capacity of a growable buffer of ``current`` slots (each ``unit`` tokens) that must hold ``needed``.

    Growth is geometric (by an eighth, so appends stay amortised O(1)) with a floor of
    :data:`GROWTH_MIN_TOKENS` tokens: a buffer holds at most about 12.5% (or 32 tokens) more than
    it uses, where doubling held up to 2x.  ``limit`` caps it (e.g. a token budget).  Before session 36 it was a
    quarter with a floor of 256 tokens, which nearly doubled a middle that prefill had cut to a few hundred tokens
    at the first decode step (SnapKV keeping 25% of a 1600-token prompt: 0.25x of the dense bytes after prefill,
    0.40x one step later); benchmarks/held_bytes.py measures it.
    """
    step = max(current // GROWTH_FRACTION, -(-GROWTH_MIN_TOKENS // unit), 1)
    cap = max(needed, current + step)
    return cap if limit is None else max(needed, min(cap, limit))


class RingBuffer:
    """Preallocated full-precision ring of the most recent tokens.

    ``capacity=None`` makes it an append-only buffer that grows geometrically
    (:func:`grown_capacity`; amortised O(1) per token) and never wraps.
    """

    def __init__(self, capacity: int | None, like_k: torch.Tensor, like_v: torch.Tensor, initial: int = 0,
                 free_valid: bool = True, heads_valid: bool = False):
        self.growable = capacity is None
        cap = max(initial, 16) if capacity is None else capacity
        b, h = like_k.shape[0], like_k.shape[1]
        self.k = like_k.new_zeros(b, h, cap, like_k.shape[-1])
        self.v = like_v.new_zeros(b, h, cap, like_v.shape[-1])
        # Only occupied slots' validity is ever read, so free slots may start True (``free_valid``); then, while no
        # False was ever written (``valid_all_true``), pushing tokens known to be valid writes no validity at all.
        # Stores that read every slot's validity (per-head slot mode) pass ``free_valid=False``.
        self.valid = (torch.ones if free_valid else torch.zeros)(b, cap, dtype=torch.bool, device=like_k.device)
        self.valid_all_true = free_valid
        self.positions = torch.zeros(cap, dtype=torch.long, device=like_k.device)
        # per-(row, head) validity (``heads_valid``: a middle store under adaptive per-head budgets); ``valid`` is
        # then the union over the heads, and segments read this one
        self.hvalid = torch.zeros(b, h, cap, dtype=torch.bool, device=like_k.device) if heads_valid else None
        self.start = 0
        self.size = 0
        self.all_valid = not heads_valid
        self.max_capacity: int | None = None  # growth cap for a growable buffer (e.g. a token budget)
        self._segment: tuple | None = None  # (key, buffers, segment) of the last segment() of views (see segment)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _slots(self, first: int, n: int) -> torch.Tensor | slice:
        cap = self.capacity
        lo = (self.start + first) % cap
        if lo + n <= cap:
            return slice(lo, lo + n)
        return (torch.arange(n, device=self.k.device) + lo) % cap

    def _grow(self, needed: int) -> None:
        new_cap = grown_capacity(self.capacity, needed, limit=self.max_capacity)
        order = self._slots(0, self.size)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.size] = old[:, :, order]
            setattr(self, name, new)
        valid = (self.valid.new_ones if self.valid_all_true else self.valid.new_zeros)(self.valid.shape[0], new_cap)
        valid[:, : self.size] = self.valid[:, order]
        positions = self.positions.new_zeros(new_cap)
        positions[: self.size] = self.positions[order]
        if self.hvalid is not None:
            hvalid = self.hvalid.new_zeros(*self.hvalid.shape[:2], new_cap)
            hvalid[:, :, : self.size] = self.hvalid[:, :, order]
            self.hvalid = hvalid
        self.valid, self.positions, self.start = valid, positions, 0
        self._segment = None  # (holds the old buffers)

    def push(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, positions: torch.Tensor,
             all_valid: bool = False, head_valid: torch.Tensor | None = None) -> None:
        """Append tokens.  ``all_valid=True`` (or ``valid=None``) says the caller knows every token is valid (e.g. it
        made ``valid`` with ``torch.ones``), which skips the device-to-host check (one sync per layer and decode step
        on a GPU) and, while the buffer never held an invalid entry, the write of the validity.  ``head_valid``
        ``[batch, heads, n]``: the tokens' per-head validity (a buffer built with ``heads_valid``; default: ``valid``
        for every head)."""
        n = k.shape[2]
        if n == 0:
            return
        if valid is None:
            all_valid = True
        if self.size + n > self.capacity:
            if not self.growable:
                raise RuntimeError(f"ring buffer overflow: {self.size} + {n} > {self.capacity}")
            self._grow(self.size + n)
        slots = self._slots(self.size, n)
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        if not (all_valid and self.valid_all_true):
            self.valid[:, slots] = True if valid is None else valid
        self.positions[slots] = positions
        if self.hvalid is not None:
            if head_valid is None:
                head_valid = True if valid is None else valid.unsqueeze(1)
            self.hvalid[:, :, slots] = head_valid
        self.size += n
        if self.all_valid and not all_valid and not bool(valid.all()):
            self.all_valid = False
        if not self.all_valid:  # (a check that passed above leaves every entry True)
            self.valid_all_true = False

    def ordered(self) -> torch.Tensor | slice:
        """Slot indices of the stored tokens, oldest first."""
        return self._slots(0, self.size)

    def discard_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest tokens without reading them (O(1))."""
        if n <= 0:
            return
        self.start = (self.start + n) % self.capacity
        self.size -= n

    def pop_oldest(self, n: int) -> KVBlock:
        slots = self._slots(0, n)
        if isinstance(slots, slice):  # copies (views would be overwritten by later pushes): one op per buffer
            slots = torch.arange(slots.start, slots.stop, device=self.k.device)
        block = KVBlock(self.k.index_select(2, slots), self.v.index_select(2, slots), self.valid.index_select(1, slots),
                        self.positions.index_select(0, slots))
        if self.all_valid:
            block.valid_true = block.valid
        self.start = (self.start + n) % self.capacity
        self.size -= n
        return block

    def segment(self) -> Segment | None:
        if self.size == 0:
            return None
        cap = self.capacity
        if self.start + self.size <= cap or self.size == cap:
            # views of the buffers: the same segment until the stored range or a buffer changes (a store's lanes
            # change once per flush and are read every step)
            key = (self.start, self.size, self.all_valid)
            buffers = (self.k, self.v, self.valid, self.positions)
            cached = self._segment
            if cached is not None and cached[0] == key and all(a is b for a, b in zip(cached[1], buffers)):
                return cached[2]
            rows = self.valid if self.hvalid is None else self.hvalid
            if self.size == cap:
                seg = Segment(self.k, self.v, None if self.all_valid else rows, self.positions)
            else:
                sl = slice(self.start, self.start + self.size)
                valid = None if self.all_valid else rows[..., sl]
                seg = Segment(self.k[:, :, sl], self.v[:, :, sl], valid, self.positions[sl])
            self._segment = (key, buffers, seg)
            return seg
        occupied = torch.zeros(cap, dtype=torch.bool, device=self.k.device)
        occupied[self._slots(0, self.size)] = True
        return Segment(self.k, self.v, (self.valid if self.hvalid is None else self.hvalid) & occupied, self.positions)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.k, self.v, self.valid = fn(self.k), fn(self.v), fn(self.valid)
        if self.hvalid is not None:
            self.hvalid = fn(self.hvalid)
        self._segment = None

    def nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.valid, self.positions, self.hvalid)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row, not per head (validity, positions; ``hvalid`` is per head)."""
        return _nbytes(self.valid, self.positions)


class MiddleStore:
    """Interface of the store that holds the middle region of one layer.

    Implementations: :class:`DenseStore` (full precision) and the stores that
    quantizing compressors return from ``kvcompress_quantize_store``.

    **Per-head slots** (optional; stores that declare ``supports_slots = True``: :class:`DenseStore`,
    :class:`kvcompress.static.StaticDenseStore`, KIVI's preallocated store).  When a layout of the stack sets
    ``Layout.head_slots``, the cache calls :meth:`use_slots` once, when it builds the store, and the evictor
    places every block itself: ``block.slots`` ``[batch, kv_heads, tokens]`` gives each column's target token
    slot per head, in ``[0, slot_count)``; a target ``>= slot_count`` (and any invalid column) is dropped.
    Slots hold tokens in units of ``slot_unit`` tokens (a quantization group): the ``slot_unit`` columns of
    one unit of the block go to one unit-aligned run of slots.  Every kv head of a row occupies the same slots
    (an evictor replaces, per head, stored tokens with incoming ones one for one, and fills free slots in the
    same order for every head), so :meth:`slot_valid` stays row-level; the segments' columns are the slots.
    """

    #: whether the store honours ``block.slots`` (per-head slot placement) after :meth:`use_slots`
    supports_slots = False
    #: tokens per slot unit (a unit is written, replaced and freed whole)
    slot_unit = 1
    #: whether the store keeps a per-(row, kv head) validity after :meth:`use_head_valid` (adaptive per-head budgets,
    #: ``Layout.head_valid``: :attr:`KVBlock.head_valid` honoured, segments with ``[batch, heads, tokens]`` validity)
    supports_head_valid = False

    def append(self, block: KVBlock) -> None:  # pragma: no cover - interface
        """Encode and append a block (append-only: stored tokens are never re-encoded)."""
        raise NotImplementedError

    def segments(self) -> list[Segment]:  # pragma: no cover - interface
        """Regions attention reads, in any order."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def limit(self, max_tokens: int) -> None:
        """Hint: the store will never hold more than ``max_tokens`` (lets it stop over-allocating).  In slot mode
        (:meth:`use_slots`) of a growable store: the number of slots, ``slot_count``."""

    def use_slots(self) -> None:
        """Switch to per-head slot placement (called once, when the cache builds the store; see the class
        docstring).  Stores that do not support it keep this default, which refuses."""
        from .errors import UnsupportedOperationError

        raise UnsupportedOperationError(f"{type(self).__name__} does not support per-head slots")

    def use_head_valid(self) -> None:
        """Keep a per-(row, kv head) validity (called once, when the cache builds the store, for a stack whose
        layout sets ``Layout.head_valid``).  Stores that do not support it keep this default, which refuses."""
        from .errors import UnsupportedOperationError

        raise UnsupportedOperationError(f"{type(self).__name__} does not keep a per-head validity")

    def head_valid_mask(self) -> torch.Tensor | None:
        """Per-(row, kv head) validity ``[batch, kv_heads, tokens]`` of the stored tokens (columns as
        :meth:`valid_mask`'s), or ``None`` when the store keeps none (every head holds what :meth:`valid_mask`
        says) or is empty."""
        return None

    @property
    def slot_count(self) -> int:
        """Token slots a slot-mode store addresses (targets at or past it are dropped)."""
        raise NotImplementedError

    def slot_valid(self) -> torch.Tensor | None:
        """Row-level occupancy ``[batch, slot_count]`` of the slots (``None`` before the first block)."""
        raise NotImplementedError

    def drop_oldest(self, n: int) -> None:  # pragma: no cover - interface
        """Evict the ``n`` oldest stored tokens (stores may require alignment)."""
        raise NotImplementedError

    def known_all_valid(self) -> bool:
        """Whether the host knows that every stored token is valid in every row (no padding, nothing evicted
        per row), so that :meth:`valid_mask` is all True; ``False`` means "unknown".  No device read."""
        return False

    def valid_mask(self) -> torch.Tensor | None:  # pragma: no cover - interface
        """Per-row validity ``[batch, tokens]`` of the stored tokens, oldest first (``None`` when empty)."""
        raise NotImplementedError

    def retain(self, keep: torch.Tensor) -> None:  # pragma: no cover - interface
        """Evict per row: ``keep`` is ``[batch, tokens]`` over :meth:`valid_mask`'s columns.

        Evicted tokens are never read again; a store frees their memory as soon as its
        storage unit (a token, a quantization group, a page) holds no kept token of any row.
        """
        raise NotImplementedError

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:  # pragma: no cover
        """Apply ``fn`` (index_select / repeat_interleave along dim 0) to every batch-major tensor."""
        raise NotImplementedError

    def nbytes(self) -> dict[str, int]:  # pragma: no cover - interface
        """Bytes allocated, by component (e.g. ``{"codes": ..., "scales": ...}``); components of per-row bookkeeping
        (no head dimension: validity, positions, block tables) end in :data:`ROWS`."""
        raise NotImplementedError


class DenseStore(MiddleStore):
    """Full-precision middle: append-only buffers with amortised growth, one lane per head group.

    An ungrouped block is stored in one lane covering every kv head; a block
    regrouped by a pruner (``block.groups``) gets one lane per group, each a dense
    ``[batch, heads_in_group, tokens, kept_channels]`` buffer read with the
    group's query map.

    **Per-head lanes** (:meth:`use_head_valid`: adaptive per-head budgets, where the heads of a row keep different
    counts ``c[b, h]``): the first block splits every head group into one lane per kv head (the group's channels of
    that head; a group with a custom query / output map, e.g. low-rank coordinates, stays one lane and keeps a
    per-(row, head) validity ``hvalid``), decided once, when the store takes its first block.  Each lane is a
    growable ``[batch, 1, tokens, dk]`` buffer as long as its own head's longest row (``max_b c[b, h]``, one host
    read of the block's per-head counts per appended block that carries ``block.head_valid``; decode blocks carry
    none and go to every lane alike), its row validity being that head's validity, so the head-columns held follow
    the kept tokens (with one row, exactly; with several rows each head is as long as its longest row) where one
    dense tensor would be as long as the longest head.  The lanes differ in length: they are read as separate
    segments (one launch of the grouped lanes kernel on CUDA, one partial each on the CPU).  A zero-width lane
    (``rows``: validity and positions only, no payload bytes) keeps the row-level union the store reports
    (:meth:`valid_mask`, :attr:`num_tokens`).  Column ``j`` of head ``h`` in :meth:`head_valid_mask` is head
    ``h``'s ``j``-th stored token; :meth:`retain` and :meth:`drop_oldest` apply to each head's own columns (its
    oldest first).  Bookkeeping per lane: a ``[batch, tokens]`` bool validity and ``[tokens]`` int64 positions.
    """

    supports_slots = True
    supports_head_valid = True
    #: under :meth:`use_head_valid`, one lane per kv head (True) or one masked lane per head group as long as its
    #: longest head (False: the layout before per-head lanes, which tests compare against)
    head_lanes = True

    def __init__(self) -> None:
        self.lanes: list[tuple[HeadGroup, RingBuffer]] | None = None
        self.max_tokens: int | None = None
        self.slotted = False  # per-head slot placement (use_slots): lanes of exactly slot_count slots
        self.per_head = False  # per-(row, head) validity (use_head_valid): each lane's buffer keeps its heads' own
        # per-head lanes (per_head, not slotted; see the class docstring): per lane, (index of the block part it
        # takes, head index within the part or None for a whole part, the lane's kv head or None)
        self.plan: list[tuple[int, int | None, int | None]] | None = None
        self.rows: RingBuffer | None = None  # per-head lanes: the row-level union (zero-width payload)
        self.kv_heads = 0  # per-head lanes: the layer's kv heads (known at the first block)
        self._attached: list = []  # per lane: (buffer segment, the segment read) of the last read, or None

    @property
    def buf(self) -> RingBuffer | None:
        """The first lane's buffer (the only one for ungrouped stacks); with per-head lanes the row-level union
        (:attr:`rows`: validity and positions of the longest head of each row, no payload)."""
        if self.rows is not None:
            return self.rows
        return self.lanes[0][1] if self.lanes else None

    def _buffers(self) -> list[RingBuffer]:
        """Every buffer the store holds (lanes, and the row-level union of per-head lanes)."""
        return [buf for _, buf in self.lanes or []] + ([self.rows] if self.rows is not None else [])

    def limit(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        for buf in self._buffers():
            buf.max_capacity = max_tokens

    def use_slots(self) -> None:
        self.slotted = True

    def use_head_valid(self) -> None:
        self.per_head = True

    def head_valid_mask(self) -> torch.Tensor | None:
        if not self.per_head or self.buf is None or self.buf.size == 0:
            return None
        if self.plan is not None:
            return self._head_lanes_mask()
        lanes = self.lanes
        if len(lanes) == 1 and lanes[0][0].heads is None:
            buf = lanes[0][1]
            return buf.hvalid[:, :, buf.ordered()]
        buf = self.buf
        heads = self._num_heads()
        out = buf.valid[:, buf.ordered()].unsqueeze(1).repeat(1, heads, 1)  # heads no lane holds: the union
        for group, lane in lanes:
            part = lane.hvalid[:, :, lane.ordered()]
            if group.heads is None:
                out = part.clone()
            else:
                out[:, group.heads] = part
        return out

    def _head_lanes_mask(self) -> torch.Tensor:
        """Per-head lanes: ``[batch, kv_heads, tokens]``, column ``j`` of head ``h`` its ``j``-th stored token
        (``tokens``: the row-level union's width); heads no lane holds (a pruner dropped them) get the union."""
        rows = self.rows
        width = rows.size
        out = rows.valid[:, rows.ordered()].unsqueeze(1).repeat(1, self.kv_heads, 1)
        for (group, lane), (_, _, head) in zip(self.lanes, self.plan):
            part = lane.valid[:, lane.ordered()] if lane.hvalid is None else lane.hvalid[:, :, lane.ordered()]
            if head is not None:
                out[:, head] = False
                out[:, head, : lane.size] = part
            elif group.heads is None:
                out = part.clone()
            else:
                out[:, group.heads] = part
        return out[..., :width]

    def _num_heads(self) -> int:
        n = 0
        for group, buf in self.lanes or []:
            n = max(n, buf.k.shape[1] if group.heads is None else int(group.heads.max()) + 1)
        return n

    @property
    def slot_count(self) -> int:
        if self.max_tokens is None:
            raise RuntimeError("a DenseStore in slot mode needs its slot count: call limit(n) before the first block")
        return self.max_tokens

    def slot_valid(self) -> torch.Tensor | None:
        buf = self.buf
        return None if buf is None else buf.valid[:, : self.slot_count]

    def append(self, block: KVBlock) -> None:
        parts = block.parts()
        if self.per_head and self.head_lanes and not self.slotted:
            self._append_heads(block, parts)
            return
        if self.lanes is None:
            self.lanes = []
            for part in parts:
                buf = RingBuffer(None, part.k, part.v, initial=self.slot_count if self.slotted else block.num_tokens,
                                 free_valid=not self.slotted, heads_valid=self.per_head)
                buf.max_capacity = self.max_tokens
                if self.slotted:  # every slot is a column of the segment, occupied or not
                    buf.size, buf.all_valid = self.slot_count, False
                self.lanes.append((part.layout(), buf))
        if self.slotted:
            self._write_slots(block, parts)
            return
        head_valid = block.head_valid if self.per_head else None
        for (group, buf), part in zip(self.lanes, parts):
            hv = None if head_valid is None or group.heads is None else head_valid.index_select(1, group.heads)
            buf.push(part.k, part.v, block.valid, block.positions, all_valid=block.all_valid,
                     head_valid=head_valid if group.heads is None else hv)

    def _build_head_lanes(self, block: KVBlock, parts: list[HeadGroup], need: list[int] | None) -> None:
        """Per-head lanes (once, at the first block): one lane per kv head of every part without a custom query /
        output map, one lane per part otherwise, and the row-level union (see the class docstring); each lane
        starts as long as the columns the first block gives it (``need``: per kv head; ``None``: all)."""
        n = block.num_tokens
        b, device = block.valid.shape[0], block.valid.device
        count = max([p.k.shape[1] if p.heads is None else int(p.heads.max()) + 1 for p in parts] + [1])
        self.kv_heads = block.head_valid.shape[1] if block.head_valid is not None else count
        index = torch.arange(self.kv_heads, device=device)  # the lanes' head indices: views of one tensor
        self.lanes, self.plan = [], []
        for i, part in enumerate(parts):
            if part.qmap is not None or part.vmap is not None:
                buf = RingBuffer(None, part.k, part.v, initial=n, heads_valid=True)
                buf.max_capacity = self.max_tokens
                self.lanes.append((part.layout(), buf))
                self.plan.append((i, None, None))
                continue
            heads = range(part.k.shape[1]) if part.heads is None else part.heads.tolist()
            for j, head in enumerate(heads):
                channels = None if part.channels is None else part.channels[j:j + 1]
                group = HeadGroup(index[head:head + 1], None, None, channels)
                first = n if need is None else need[head]
                buf = RingBuffer(None, part.k[:, j:j + 1], part.v[:, j:j + 1], initial=first)
                buf.max_capacity = self.max_tokens
                self.lanes.append((group, buf))
                self.plan.append((i, j, head))
        empty = block.valid.new_zeros(b, 1, 0, 0, dtype=parts[0].k.dtype if parts else torch.float32)
        self.rows = RingBuffer(None, empty, empty, initial=n)
        self.rows.max_capacity = self.max_tokens

    def _append_heads(self, block: KVBlock, parts: list[HeadGroup]) -> None:
        """Per-head lanes: head ``h``'s lane takes the block's first ``max_b c[b, h]`` columns (all of them when the
        block carries no per-head validity), the union lane every column."""
        n = block.num_tokens
        hv = block.head_valid
        need = None
        if hv is not None:
            hv = hv & block.valid.unsqueeze(1)
            cols = torch.arange(1, n + 1, device=hv.device)
            need = torch.where(hv.any(0), cols, 0).amax(-1).tolist()  # [kv_heads]: one host read per block
        if self.lanes is None:
            self._build_head_lanes(block, parts, need)
        for (group, buf), (i, j, head) in zip(self.lanes, self.plan):
            part = parts[i]
            if head is None:  # a whole part, per-(row, head) validity as in one-lane mode
                sub = None if hv is None or group.heads is None else hv.index_select(1, group.heads)
                buf.push(part.k, part.v, block.valid, block.positions, all_valid=block.all_valid,
                         head_valid=hv if group.heads is None else sub)
                continue
            m = n if need is None else need[head]
            if m == 0:
                continue
            valid = block.valid[:, :m] if hv is None else hv[:, head, :m]
            buf.push(part.k[:, j:j + 1, :m], part.v[:, j:j + 1, :m], valid, block.positions[:m],
                     all_valid=block.all_valid and hv is None)
        rows = self.rows
        payload = rows.k.new_zeros(block.valid.shape[0], 1, n, 0)
        rows.push(payload, payload, block.valid, block.positions, all_valid=block.all_valid)

    def _write_slots(self, block: KVBlock, parts: list[HeadGroup]) -> None:
        """Slot mode: column ``j`` of head ``h`` goes to slot ``block.slots[b, h, j]`` (eager: dropped columns are
        simply not written)."""
        if block.slots is None:
            raise RuntimeError("a DenseStore in slot mode received a block without slots (KVBlock.slots)")
        n = self.slot_count
        write = (block.slots < n) & block.valid.unsqueeze(1)  # [b, h, tokens]
        for (group, buf), part in zip(self.lanes, parts):
            heads = group.heads
            w = write if heads is None else write.index_select(1, heads)
            slots = block.slots if heads is None else block.slots.index_select(1, heads)
            b_i, h_i, j_i = w.nonzero(as_tuple=True)
            t_i = slots[b_i, h_i, j_i]
            buf.k[b_i, h_i, t_i] = part.k[b_i, h_i, j_i]
            buf.v[b_i, h_i, t_i] = part.v[b_i, h_i, j_i]
        rows, cols = write[:, 0].nonzero(as_tuple=True)  # row-level occupancy: every head fills the same slots
        for _, buf in self.lanes:
            buf.valid[rows, block.slots[rows, 0, cols]] = True
            buf.positions[block.slots[rows, 0, cols]] = block.positions[cols]  # bounds only (middle < queries)

    def segments(self) -> list[Segment]:
        out = []
        lanes = self.lanes or []
        if len(self._attached) != len(lanes):
            self._attached = [None] * len(lanes)
        for i, (group, buf) in enumerate(lanes):
            seg = buf.segment()
            if seg is None:
                continue
            cached = self._attached[i]
            if cached is None or cached[0] is not seg:  # the lane's buffer segment changed since the last read
                cached = self._attached[i] = (seg, group.attach(seg))
            out.append(cached[1])
        return out

    @property
    def num_tokens(self) -> int:
        return self.buf.size if self.buf is not None else 0

    def drop_oldest(self, n: int) -> None:
        for buf in self._buffers():
            if n > 0:
                buf.discard_oldest(min(n, buf.size))

    def known_all_valid(self) -> bool:
        return not self.slotted and self.plan is None and all(buf.all_valid for _, buf in self.lanes or [])

    def valid_mask(self) -> torch.Tensor | None:
        """Per-row validity ``[batch, tokens]`` of the stored tokens, oldest first."""
        buf = self.buf
        if buf is None or buf.size == 0:
            return None
        return buf.valid[:, buf.ordered()]

    def retain(self, keep: torch.Tensor) -> None:
        """Evict per row: ``keep`` is ``[batch, tokens]`` (oldest first); leading all-evicted columns are freed."""
        alive = keep.any(dim=0)
        first = int(alive.long().argmax()) if bool(alive.any()) else keep.shape[1]
        every = bool(keep.all())
        for buf in self._buffers():  # per-head lanes: a head's column j is its j-th stored token
            slots = buf.ordered()
            part = keep[:, : buf.size]
            buf.valid[:, slots] = buf.valid[:, slots] & part
            if buf.hvalid is not None:
                buf.hvalid[:, :, slots] = buf.hvalid[:, :, slots] & part.unsqueeze(1)
            if not every:
                buf.all_valid = buf.valid_all_true = False
            buf.discard_oldest(min(first, buf.size))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for buf in self._buffers():
            buf.map_batch(fn)

    def nbytes(self) -> dict[str, int]:
        # a lane of every head keeps the row's validity and positions (:data:`ROWS`); a lane of some heads (LeanK's
        # regrouped lanes) keeps its own copy, which belongs to its heads: a split over tensor-parallel ranks
        # groups the heads into other lanes, so those copies add up over the ranks like the heads' data
        rows = sum(buf.row_nbytes() for group, buf in self.lanes or [] if group.heads is None or group.every_head)
        if self.rows is not None:
            rows += self.rows.nbytes()
        return {"middle": sum(buf.nbytes() for buf in self._buffers()) - rows, "middle" + ROWS: rows}

    def index_tensors(self) -> list[torch.Tensor]:
        """The lanes' head / channel index tensors (a pruner's per-layer choice, which its state may share)."""
        return [t for group, _ in self.lanes or [] for t in (group.heads, group.channels) if isinstance(t, torch.Tensor)]
