"""PagedEviction: block-wise token eviction over a paged KV pool that really frees memory.

Chitty-Venkata, Ye, Raskar, Vishwanath, Emani et al. *PagedEviction: Structured Block-wise
KV Cache Pruning for Efficient Large Language Model Inference.* Findings of EACL 2026,
arXiv:2509.04377.

The middle of the cache lives in a paged pool (:class:`kvcompress.paged.PagedStore`):
pages of ``block`` (P) tokens, a block table per sequence, a free list.  The budget ``C``
counts every token a row holds in a layer: sinks + pages + the newest, partial block.

* **Score** (attention-free, from full-precision K/V when tokens leave the window, before
  any pruning or quantization): per token the mean over kv heads of ``score``, one decision
  per layer for all heads; a page stores the mean over its tokens (one float per page), so
  decisions never need another pass over the cache and stay valid when KIVI quantizes pages.
  The lowest score is evicted first, for every score function:

  - ``v_over_k`` (default, the paper): ``||V||_2 / ||K||_2``;
  - ``inverse_key_norm``: ``1 / ||K||_2``, so the *largest* key norms go first - what the
    authors' repository implements as its key-only baseline, and the direction of the L2-norm
    literature (Devoto et al. 2024: low-norm keys draw the most attention);
  - ``key_norm``: ``||K||_2`` exactly as the seed documents' pseudo-code states it ("the block
    with the lowest mean key L2 norm is evicted"), kept for comparison: it evicts the keys that
    literature deems most attended;
  - ``random``: a seeded uniform score (the random-block baseline).

* **Prefill** (the layer's first flush): token-granular eviction down to ``C`` before the
  prompt is paged, protecting the sinks and the newest block (the last P tokens, partly in the
  recent window); each row's survivors are packed densely into its own pages.
* **Decode**: tokens collect in the full-precision window until the newest block is full
  (``flush = P``).  At that boundary, if the row holds more than ``C`` tokens, exactly one whole
  page - the lowest-scoring - is evicted and returned to the free list; never the newest block,
  never the sinks (kept apart, default one block: the code protects page 0).  A flush of ``k``
  blocks at once (a multi-token chunk, or a stacked compressor's larger flush) is ``k``
  boundaries in sequence, with exactly the decisions of ``k`` single-block flushes.

Rows of a batch decide independently (own block tables).  Stacked with LeanK the pool keeps
one lane per head group; with KIVI it stores KIVI-encoded pages (``block`` must be a multiple
of KIVI's ``group``; the codec comes through ``kvcompress_middle_codec``).

Parameters: ``budget`` (C, 1024), ``block`` (P, 16), ``score`` ("v_over_k"), ``sinks``
(default one block), ``seed`` (for ``random``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from kvcompress import Compressor, CompressorSpec, Layout, hookimpl, param
from kvcompress.distributed import mean_over_heads
from kvcompress.errors import ConfigError, PluginError
from kvcompress.paged import PagedStore, StaticPagedStore, pack_rows, page_scores

SCORES = ("v_over_k", "key_norm", "inverse_key_norm", "random")
META = "paged_eviction:score"
_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class PagedEvictionConfig:
    budget: int = param(1024, "tokens a row may hold per layer (C): sinks + pages + the newest partial block",
                        min=1, max=1 << 24)
    block: int = param(16, "page size in tokens (P; a multiple of KIVI's group when stacked with KIVI)",
                       min=1, max=4096)
    score: str = param("v_over_k", "token score, lowest evicted first: 'v_over_k' (the paper), "
                       "'inverse_key_norm' (evicts large ||K||), 'key_norm' (the seeds' rule: evicts small ||K||), "
                       "'random' (baseline)", choices=SCORES)
    sinks: int | None = param(None, "first real tokens never evicted (default: one block)", type=int, min=0,
                              max=1 << 20, nullable=True)
    seed: int = param(0, "seed of the 'random' score", min=0, max=(1 << 31) - 1)

    @property
    def sink_tokens(self) -> int:
        return self.block if self.sinks is None else self.sinks

    def check(self, path: str) -> None:
        low = self.sink_tokens + 2 * self.block
        if self.budget < low:
            raise ConfigError(f"{path}.budget", f"at least sinks + 2 * block = {low}", self.budget,
                              hint="the budget must hold the sinks, the newest block and one evictable page")


def token_scores(config: PagedEvictionConfig, k: torch.Tensor, v: torch.Tensor, layer_index: int,
                 first_position: int | torch.Tensor, info=None) -> torch.Tensor:
    """Per-token score ``[batch, tokens]`` (float32, mean over kv heads) of full-precision ``k``/``v``.

    ``first_position``: the block's first logical position; a tensor of every token's position in a
    static cache, where the ``random`` score is a hash of (seed, layer, row, position) computed on the
    device instead of a host generator (the same baseline, other draws).  ``info`` (the layer's
    :class:`kvcompress.LayerInfo`): under tensor parallelism the mean runs over the model's KV heads, reduced
    over the ranks, so every rank evicts the pages one process would."""
    if config.score == "random":
        if isinstance(first_position, torch.Tensor):
            rows = torch.arange(k.shape[0], device=k.device).view(-1, 1)
            x = (first_position.view(1, -1) * 2654435761 + rows * 40503 + layer_index * 97 + config.seed) % 2147483647
            x = (x * 48271) % 2147483647
            return x.float() / 2147483647.0
        gen = torch.Generator().manual_seed(hash((config.seed, layer_index, first_position)) & ((1 << 62) - 1))
        return torch.rand(k.shape[0], k.shape[2], generator=gen).to(k.device)
    kn = k.float().norm(dim=-1)
    if config.score == "v_over_k":
        s = v.float().norm(dim=-1) / kn.clamp(min=_EPS)
    elif config.score == "inverse_key_norm":
        s = 1.0 / kn.clamp(min=_EPS)
    else:
        s = kn
    return mean_over_heads(s, info)


class PagedEvictionCompressor(Compressor):
    name = "paged_eviction"
    graph_safe = True

    # -- build time ---------------------------------------------------------------------
    @hookimpl
    def kvcompress_validate_stack(self, entries):
        cfg, index = None, 0
        for i, (name, c) in enumerate(entries):
            if c is self.config:
                cfg, index = c, i
        if cfg is None:
            return
        path = f"compressors[{index}].{self.name}"
        sinks, recent, flush = cfg.sink_tokens, 0, cfg.block
        for name, c in entries:
            if name == "kivi":
                if cfg.block % c.group:
                    raise ConfigError(f"{path}.block", f"a multiple of kivi's group ({c.group})", cfg.block,
                                      hint="KIVI encodes keys per channel over groups of G tokens; a page must hold "
                                           "whole groups")
                sinks, recent = max(sinks, c.sinks), max(recent, c.residual)
                flush = math.lcm(flush, c.group)
            elif name == "leank":
                sinks, recent = max(sinks, c.sinks), max(recent, c.local)
                flush = math.lcm(flush, c.flush)
        need = sinks + recent + flush + cfg.block
        if cfg.budget < need:
            raise ConfigError(f"{path}.budget", f"at least {need} for this stack", cfg.budget,
                              hint=f"the full-precision regions (sinks {sinks}, recent window up to {recent + flush - 1}"
                                   f") plus one evictable page must fit the budget")

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        # The newest, partial block waits in the full-precision window; full blocks become pages.
        return Layout(sinks=self.config.sink_tokens, recent=0, flush=self.config.block, budget=self.config.budget)

    @hookimpl
    def kvcompress_middle_store(self, layer, codec):
        cfg = self.config
        unit = getattr(codec, "unit", 1)
        if cfg.block % unit:
            raise ConfigError(f"{self.name}.block", f"a multiple of the quantizer's unit ({unit} tokens)", cfg.block)
        middle = max(cfg.budget - cfg.sink_tokens, cfg.block)
        if layer.static:
            return StaticPagedStore(cfg.block, math.ceil(middle / cfg.block) + 2, codec, score_key=META)
        return PagedStore(cfg.block, codec, score_key=META, max_pages_per_row=math.ceil(middle / cfg.block) + 1)

    # -- per flush ------------------------------------------------------------------------
    @hookimpl
    def kvcompress_score_tokens(self, layer, block):
        if layer.static:
            first = block.positions
        else:
            first = int(block.positions[0]) if block.num_tokens else 0
        block.meta[META] = token_scores(self.config, block.k, block.v, layer.info.index, first, layer.info)

    @hookimpl
    def kvcompress_evict_tokens(self, layer, block):
        if layer.static:
            return self._evict_static(layer, block)
        store = layer.middle
        if not isinstance(store, PagedStore):
            raise PluginError("paged_eviction needs its paged store as the layer's middle (another compressor "
                              "replaced it)")
        state = layer.state.setdefault(self.name, _LayerState())
        held = self._held(layer, block.valid.shape[0])
        if not state.prefilled:
            state.prefilled = True
            ring = layer.recent
            window = ring.valid[:, ring.ordered()].sum(dim=1).tolist() if ring.size else [0] * block.valid.shape[0]
            keep = self._prefill(layer, block, held, window)
        else:
            keep = self._boundaries(store, block, held, state)
        return None if keep is None or bool(keep.all()) else keep

    # -- static caches --------------------------------------------------------------------
    def _evict_static(self, layer, block) -> torch.Tensor | None:
        store = layer.middle
        if not isinstance(store, StaticPagedStore):
            raise PluginError("paged_eviction needs its paged store as the layer's middle (another compressor "
                              "replaced it)")
        # what each row holds outside the block: sinks + window (the layer's full-precision slots,
        # the block already left them) + pages
        held = layer.valid.sum(1)
        if store.valid is not None:
            held = held + store.row_tokens()
        if block.due is None and (store.live is None or not bool(store.live.any())):
            # the first flush (prefill): token-granular eviction down to the budget
            window = layer.valid[:, layer.sink_slots:].sum(1).tolist()
            return self._prefill(layer, block, held.tolist(), window)
        return self._boundaries_static(store, block, held)

    def _boundaries_static(self, store: "StaticPagedStore", block, held: torch.Tensor) -> torch.Tensor | None:
        """The block's pages arrive one boundary at a time (branch-free): while a row holds more than
        the budget, its lowest-scoring page other than the newest is freed (ties: the oldest)."""
        cfg, p = self.config, self.config.block
        b, n = block.valid.shape[0], block.num_tokens // p
        dev = block.valid.device
        inc_tok = block.valid.view(b, n, p).sum(-1)  # [b, n]
        inc_score = page_scores(block.meta[META].reshape(b * n, p), block.valid.reshape(b * n, p)).view(b, n)
        if store.valid is None:  # nothing stored yet (the warm-up block)
            return None
        m = store.pages
        live = torch.cat([store.live[:, :m], torch.zeros(b, n, dtype=torch.bool, device=dev)], 1)
        score = torch.cat([store.score[:, :m], inc_score], 1)
        tokens = torch.cat([store.page_tokens(), inc_tok], 1)
        age = torch.cat([store.age[:, :m], store.clock + 1 + torch.arange(n, device=dev).expand(b, n)], 1)
        if block.due is None:  # a prompt chunk (eager): the same boundaries replayed on host lists - a GPU pays
            # a launch for each of the loop's ~15 small ops per page below (8 x 2048-token chunks of 16-token pages:
            # 2 s of 8 on an H100, benchmarks/prefill_time.py)
            kept = _replay_boundaries(live.tolist(), score.tolist(), tokens.tolist(), age.tolist(), held.tolist(),
                                      inc_tok.tolist(), cfg.budget)
            live = torch.tensor(kept, dtype=torch.bool, device=dev)
        else:
            live = _boundaries_device(live, score, tokens, age, held, inc_tok, m, block.due, cfg.budget)
        store.free_pages(store.live[:, :m] & ~live[:, :m])
        dropped = (inc_tok > 0) & ~live[:, m:]  # incoming pages freed by a later boundary of this block
        return ~dropped.repeat_interleave(p, dim=1)

    # -- policy ---------------------------------------------------------------------------
    @staticmethod
    def _held(layer, rows: int) -> list[int]:
        """Tokens each row holds outside the incoming block: sinks + window + pages."""
        sinks = list(layer.sinks.count)
        ring = layer.recent
        if ring.size:
            window = ring.valid[:, ring.ordered()].sum(dim=1).tolist()
        else:
            window = [0] * rows
        pages = layer.middle.row_tokens() or [0] * rows
        return [s + w + p for s, w, p in zip(sinks, window, pages)]

    def _prefill(self, layer, block, held: list[int], window: list[int]) -> torch.Tensor | None:
        """Token-granular eviction down to the budget, protecting the newest block (``window``: tokens
        each row keeps in the full-precision window)."""
        cfg = self.config
        valid = block.valid
        counts = valid.sum(dim=1).tolist()
        room = [max(0, cfg.budget - h) for h in held]
        if all(n <= r for n, r in zip(counts, room)):
            return None
        dev = valid.device
        protect = torch.tensor([min(max(0, cfg.block - w), r) for w, r in zip(window, room)], device=dev)
        room_t = torch.tensor(room, device=dev)
        newest_rank = valid.flip(1).long().cumsum(1).flip(1)  # 1 = the row's newest valid token
        protected = valid & (newest_rank <= protect[:, None])
        candidates = valid & ~protected
        scores = block.meta[META].masked_fill(~candidates, float("-inf"))
        order = torch.argsort(scores, dim=1, descending=True, stable=True)  # ties: the older token first
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=dev).expand_as(order))
        chosen = candidates & (rank < (room_t - protect)[:, None])
        fits = torch.tensor([n <= r for n, r in zip(counts, room)], device=dev)
        return torch.where(fits[:, None], valid, protected | chosen)

    def _boundaries(self, store: PagedStore, block, held: list[int], state: "_LayerState") -> torch.Tensor | None:
        """One block boundary per incoming page: evict the lowest page but the newest while over budget."""
        cfg = self.config
        incoming = pack_rows(block.valid, cfg.block)
        if not incoming.tokens_per_page:
            return None
        new_scores = page_scores(incoming.gather(block.meta[META]), incoming.slot_valid).tolist()
        stored = store.page_score_table().tolist() if store.rows else [[] for _ in held]
        # each row's stored pages (block-table order, oldest first) then its incoming ones, replayed as the static
        # store's prompt chunks are: ragged rows, ages = the order
        live, score, tokens, incoming_tokens, firsts = [], [], [], [], []
        start = 0
        for b, n_new in enumerate(incoming.pages_per_row):
            row_pages = store.rows[b] if store.rows else []
            new_tok = incoming.tokens_per_page[start:start + n_new]
            live.append([True] * len(row_pages) + [False] * n_new)
            score.append(stored[b][:len(row_pages)] + new_scores[start:start + n_new])
            tokens.append([store.tokens[p] for p in row_pages] + new_tok)
            incoming_tokens.append(new_tok)
            firsts.append(start)
            start += n_new
        kept = _replay_boundaries(live, score, tokens, [list(range(len(r))) for r in live], held, incoming_tokens,
                                  cfg.budget)
        victims, dropped = [], []
        for b, row in enumerate(kept):
            m = len(row) - len(incoming_tokens[b])
            victims += [(b, j) for j in range(m) if not row[j]]
            dropped += [(b, firsts[b] + j) for j in range(len(row) - m) if not row[m + j]]
        state.evicted += len(victims) + len(dropped)
        state.boundaries += len(incoming.tokens_per_page)
        if victims:
            store.evict(victims)
        if not dropped:
            return None
        keep = block.valid.clone()
        for _, page in dropped:
            b = int(incoming.row[page])
            keep[b, incoming.token[page][incoming.slot_valid[page]]] = False
        return keep


class _LayerState:
    """Per-layer bookkeeping of the policy (counters are for tests and reports)."""

    def __init__(self) -> None:
        self.prefilled = False
        self.boundaries = 0
        self.evicted = 0

    def map_batch(self, fn) -> None:  # nothing batch-major
        return None


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="paged_eviction", axis="evict", config=PagedEvictionConfig, factory=PagedEvictionCompressor,
        summary="PagedEviction: evict whole pages of a paged pool by ||V||/||K|| (arXiv:2509.04377)",
    ))


def _boundaries_device(live, score, tokens, age, held, inc_tok, m: int, due, budget: int) -> torch.Tensor:
    """The boundaries of ``_boundaries_static`` as branch-free tensor ops (decode blocks, compiled steps):
    which of the ``m`` stored and ``n`` incoming pages each row keeps ``[b, m + n]``."""
    b, n = inc_tok.shape
    columns = torch.arange(m + n, device=live.device)
    total = held
    for j in range(n):
        newest = m + j
        live = live | ((columns == newest) & (inc_tok[:, j:j + 1] > 0))
        total = total + inc_tok[:, j]
        eligible = live & (columns != newest)
        over = (total > budget) & eligible.any(1) & due
        s = torch.where(eligible, score, torch.full_like(score, float("inf")))
        tie = eligible & (s == s.amin(1, keepdim=True))
        victim = torch.where(tie, age, torch.full_like(age, torch.iinfo(torch.long).max)).argmin(1)
        kill = (columns == victim.view(b, 1)) & over.view(b, 1)
        live = live & ~kill
        total = total - (tokens * kill).sum(1)
    return live


def _replay_boundaries(live: list, score: list, tokens: list, age: list, held: list, incoming: list,
                       budget: int) -> list:
    """Host form of :func:`_boundaries_device` for one block, row by row: the block's ``n`` pages (``incoming``: tokens
    of each) arrive one boundary at a time; while a row holds more than ``budget`` tokens, its live page of lowest
    ``(score, age)`` other than the newest is freed. ``live`` / ``score`` / ``tokens`` / ``age``: ``[b][m + n]`` over
    the ``m`` stored pages then the incoming ones. Returns which pages each row keeps, ``[b][m + n]``."""
    out = []
    for r, new in enumerate(incoming):
        m = len(live[r]) - len(new)
        kept = list(live[r])
        heap = [(score[r][c], age[r][c], c) for c in range(m) if kept[c]]  # the pages a boundary may free
        heapq.heapify(heap)
        total = held[r]
        for j, tok in enumerate(new):
            if j and kept[m + j - 1]:  # the previous newest page is no longer protected
                heapq.heappush(heap, (score[r][m + j - 1], age[r][m + j - 1], m + j - 1))
            kept[m + j] = tok > 0
            total += tok
            if total > budget and heap:
                _, _, victim = heapq.heappop(heap)
                kept[victim] = False
                total -= tokens[r][victim]
        out.append(kept)
    return out
