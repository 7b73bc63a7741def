"""Score-based eviction: write an evictor as one scoring function (kvcompress' ``ScorerPress``).

A subclass of :class:`ScoreEvictor` implements :meth:`ScoreEvictor.score` - ``[batch, kv_heads, tokens]``,
higher = keep - over what the hooks see (the block of tokens leaving the full-precision window, the layer,
and the step's :class:`~kvcompress.observe.Observation`: queries, keys and, with ``attention = True``, the
attention mass each token received) and names a budget in its config (:class:`ScoreConfig`).  The base class
declares the layout, keeps the observation of the step, selects per kv head and evicts:

* **prefill** (``phase: prefill`` or ``both``): when a multi-token step's tokens leave the window, each kv head
  keeps its top-scoring tokens, the same number per head of a row (uniform per-head budgets): ``budget`` tokens
  per row and layer (sinks + recent window + middle), or ``ratio`` of the row's prompt tokens, as kvpress'
  ``compression_ratio = 1 - ratio``.  The per-head keep mask goes back to the pipeline, which packs each head's
  survivors densely (:meth:`kvcompress.state.KVBlock.pack_heads`), so the stores downstream (pruners,
  quantizers, the dense or KIVI middle) hold exactly the kept tokens: the bytes follow the kept fraction.
* ``sinks`` (first real tokens of each row) and the ``recent`` window are never evicted (they are not in the
  blocks the evictor sees); ``window`` is the number of last prefill queries an observation keeps
  (``Layout.observe``).
* per-layer schedule: ``uniform``, or ``pyramid`` (PyramidKV, arXiv 2406.02069: the middle's budget falls
  linearly from ``(2 - 1/beta)`` times the mean at the first layer to ``1/beta`` times it at the last, beta = 20,
  the mean unchanged).
* per-head schedule ``adaptive`` (AdaKV, Feng et al., arXiv 2407.11550; ``phase: prefill`` only): the layer's
  budget of a row, ``kv_heads x`` the uniform per-head budget, is allocated across its kv heads by one top-k over
  every head's scores (flattened), after each head's top ``floor(alpha x`` the uniform budget``)`` tokens are
  reserved for it (AdaKV's ``alpha_safeguard``; kvpress' ``AdaKVPress`` uses 0.20).  Head ``h`` of row ``b`` then
  keeps its own count ``c[b, h]`` (same total as ``uniform``); the pipeline packs each head's survivors densely
  (``Layout.head_valid``: head ``h`` holds columns ``[0, c[b, h])`` of the packed block) and the middle store keeps
  that per-(row, head) validity, which every read path masks with.  **Bytes**: the dynamic full-precision store
  gives each kv head its own lane, as long as that head's longest row (``max_b c[b, h]``), so the head-columns held
  are the kept tokens (one row: exactly; several rows: each head as long as its longest row) plus a validity and
  positions per lane column (:class:`kvcompress.state.DenseStore`, "Per-head lanes"); the static store sizes every
  head for what one head may keep (the budget of all the row's kv heads) (:class:`kvcompress.static.StaticDenseStore`).
  The memory report counts what is allocated.  Stores that keep a per-head validity: the full-precision middle
  (dynamic and static caches, with or without a channel pruner's lanes); a quantizer's store (KIVI) is refused at
  validation.
* static caches: the layout declares what a prompt leaves in the middle (``Layout.prefill_ratio`` under ``ratio``,
  ``Layout.prefill_middle`` under a prefill-only ``budget``), so a static cache builds its middle store at the first
  prefill for that plus the tokens that can follow the prompt: its bytes follow the kept fraction.

* chunks (``chunk: N``, ChunkKV, Liu et al., arXiv 2502.00299; kvpress' ``ChunkKVPress`` wraps any scorer the same
  way): at prefill every token is ranked by the mean score of its chunk of N consecutive tokens (summed over the kv
  heads first with ``chunk_heads: shared``, ChunkKV's one ranking per layer; per head with ``each``), so each head keeps
  whole chunks (:func:`chunk_scores`, :meth:`ScoreEvictor.entry_scores`); a scorer may exempt tokens it always keeps
  (:meth:`ScoreEvictor.chunk_exempt`).  Decoding scores tokens one by one (``phase: decode`` refuses ``chunk``).

Everything runs in eager steps and inside a static cache's compiled decode step (``graph_safe = True``: fixed
shapes, no host reads there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from .compressor import Compressor
from .config import param
from .errors import ConfigError
from .hookspecs import hookimpl
from .state import KVBlock, LayerInfo, Layout

PHASES = ("prefill", "decode", "both")
SCHEDULES = ("uniform", "pyramid", "adaptive")
CHUNK_HEADS = ("shared", "each")
#: AdaKV's default floor (kvpress' ``AdaKVPress.alpha_safeguard``): each head keeps >= alpha x the uniform budget
ADAKV_ALPHA = 0.2
#: PyramidKV's beta (its default, as in kvpress' PyramidKVPress): the last layer keeps 1/beta of the mean budget
PYRAMID_BETA = 20


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    """The parameters every :class:`ScoreEvictor` takes (subclasses add their own fields after these)."""

    budget: int | None = param(None, "tokens a row keeps per layer: sinks + recent window + middle (give budget or "
                               "ratio)", type=int, min=1, max=1 << 24, nullable=True)
    ratio: float | None = param(None, "fraction of each row's prompt kept at prefill (kvpress: 1 - compression_ratio;"
                                " give budget or ratio)", type=float, min=0.0, max=1.0, nullable=True)
    sinks: int = param(4, "first real tokens of each row never evicted (attention sinks)", min=0, max=1 << 20)
    recent: int = param(64, "newest tokens kept in full precision, never evicted", min=0, max=1 << 24)
    window: int = param(64, "last prefill queries an observation keeps (the scorer's observation window)", min=1,
                        max=1 << 16)
    phase: str = param("prefill", "when to evict: 'prefill' (the prompt; decoding grows the cache), 'decode' (hold "
                       "the budget while decoding) or 'both'", choices=PHASES)
    schedule: str = param("uniform", "budgets: 'uniform', 'pyramid' (PyramidKV, per layer) or 'adaptive' (AdaKV, "
                          "per kv head; phase 'prefill')", choices=SCHEDULES)
    alpha: float = param(ADAKV_ALPHA, "schedule 'adaptive': each kv head keeps at least alpha x the uniform per-head "
                         "budget (AdaKV's alpha_safeguard)", type=float, min=0.0, max=1.0)
    chunk: int = param(1, "prefill: score and keep tokens in chunks of this many consecutive tokens (ChunkKV, arXiv "
                       "2502.00299; 1 = per token)", min=1, max=4096)
    chunk_heads: str = param("shared", "chunk > 1: 'shared' (ChunkKV: one chunk ranking per layer from the scores "
                             "summed over the kv heads) or 'each' (every kv head ranks chunks by its own scores)",
                             choices=CHUNK_HEADS)

    def check(self, path: str) -> None:
        if (self.budget is None) == (self.ratio is None):
            raise ConfigError(f"{path}.budget", "exactly one of budget (tokens per row and layer) or ratio (fraction of "
                              "the prompt kept)", {"budget": self.budget, "ratio": self.ratio})
        if self.ratio is not None and self.ratio <= 0.0:
            raise ConfigError(f"{path}.ratio", "a fraction in (0, 1]", self.ratio)
        if self.ratio is not None and self.phase == "decode":
            raise ConfigError(f"{path}.ratio", "null with phase 'decode' (decoding holds a token budget: set budget)",
                              self.ratio)
        if self.schedule == "adaptive" and self.phase != "prefill":
            raise ConfigError(f"{path}.schedule", "'uniform' or 'pyramid' with phase 'decode' or 'both' (adaptive "
                              "per-head budgets are built for the prefill: phase 'prefill')", self.schedule,
                              hint=f"phase is {self.phase!r}")
        if self.chunk > 1 and self.phase == "decode":
            raise ConfigError(f"{path}.chunk", "1 with phase 'decode' (chunks group the tokens of a prefill; decoding "
                              "scores tokens one by one)", self.chunk, hint="use phase 'both' to chunk the prompt")
        if self.budget is not None and self.budget <= self.sinks + self.recent:
            raise ConfigError(f"{path}.budget", f"more than sinks + recent = {self.sinks + self.recent} (the tokens "
                              "never evicted)", self.budget,
                              hint="the budget would leave no middle token to choose")


def chunk_scores(scores: torch.Tensor, valid: torch.Tensor, chunk: int, shared: bool) -> torch.Tensor:
    """ChunkKV's scores (Liu et al., arXiv 2502.00299): every token of a chunk of ``chunk`` consecutive columns gets
    the mean of its chunk's finite scores over the row's ``valid`` columns - summed over the kv heads when ``shared``
    (one ranking per layer, as ChunkKV and kvpress' ``ChunkKVPress``), per kv head otherwise.  Chunks start at each
    row's first valid column of the block (its first token after padding and sinks), so a left-padded row chunks as
    it would alone.  ``scores``: ``[batch, kv_heads, n]``; ``valid``: ``[batch, n]``.  A chunk with no finite score
    is ``-inf``.  Means are taken in float64: a chunk of equal scores (max pooling spreads a peak over several
    tokens) then means exactly that score whatever its size, so such ties stay exact and break by age, as they do
    per token.  Fixed shapes (``n // chunk + 1`` chunk slots per row), no host read."""
    b, h, n = scores.shape
    col = torch.arange(n, device=scores.device)
    first = torch.where(valid, col, n).amin(dim=1, keepdim=True).clamp(max=max(n - 1, 0))  # [b, 1]
    ids = torch.div((col - first).clamp(min=0), chunk, rounding_mode="floor")  # [b, n] in [0, n // chunk]
    slots = n // chunk + 1
    finite = torch.isfinite(scores) & valid.unsqueeze(1)
    val = torch.where(finite, scores, torch.zeros_like(scores)).double()
    if shared:
        val, finite = val.sum(dim=1, keepdim=True), finite.any(dim=1, keepdim=True)
    idx = ids.unsqueeze(1).expand(-1, val.shape[1], -1)
    total = val.new_zeros(b, val.shape[1], slots).scatter_add_(-1, idx, val)
    count = val.new_zeros(b, val.shape[1], slots).scatter_add_(-1, idx, finite.to(val.dtype))
    mean = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("-inf")))
    return mean.gather(-1, idx).to(scores.dtype).expand(b, h, n)


class ScoreState:
    """Per-layer state of a :class:`ScoreEvictor` (``layer.state[name]``): the step's observation until the flush
    uses it and, while decoding under a budget, the scores of the stored units aligned with the store's slots.

    Attributes:
        obs: the step's observation, dropped once the flush used it.
        entered: whether the first prefill block entered the middle (slot mode).
        scores: ``[batch, kv_heads, units + 1]`` float32: each head's score of the unit in each slot unit (the
            last column is the trash), or ``None`` before the layer's first use.
        target: ``[batch]`` int64: slot units a row's middle holds at most (the budget, or what the prefill kept
            under ``ratio``).
    """

    def __init__(self, static: bool = False) -> None:
        self.obs: Any = None
        self.entered = False
        self.static = static
        self.scores: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self._initial: torch.Tensor | None = None

    def allocate(self, batch: int, heads: int, units: int, target: int, device: torch.device) -> None:
        self.scores = torch.zeros(batch, heads, units + 1, dtype=torch.float32, device=device)
        self._initial = torch.full((batch,), target, dtype=torch.long, device=device)
        self.target = self._initial.clone()
        if self.static:
            from .static import mark_static

            mark_static(self.scores, self.target)

    def map_batch(self, fn) -> None:
        if self.scores is None:
            return
        if self.static:  # in place when the rows are only reordered: a compiled step keeps the addresses
            from .static import remap_rows

            self.scores, self.target = remap_rows(self.scores, fn), remap_rows(self.target, fn)
            self._initial = fn(self._initial)
        else:
            self.scores, self.target, self._initial = fn(self.scores), fn(self.target), fn(self._initial)

    def reset(self) -> None:
        self.obs, self.entered = None, False
        if self.scores is not None:
            self.scores.zero_()
            self.target.copy_(self._initial)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scores, self.target, self._initial) if t is not None)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row (the budget targets; the scores are per head)."""
        return sum(t.numel() * t.element_size() for t in (self.target, self._initial) if t is not None)


class ScoreEvictor(Compressor):
    """Base class of score-based evictors (see the module docstring).

    Subclasses set ``name``, optionally ``attention = True`` (observations then carry the attention mass,
    ``obs.mass`` / ``obs.token_mass``), and implement :meth:`score`.  Their config is a frozen dataclass that
    extends :class:`ScoreConfig`.
    """

    graph_safe = True
    #: whether observations must carry the attention mass (``Layout.attention``)
    attention: bool = False

    # -- what subclasses implement --------------------------------------------------------------------------
    def score(self, layer: Any, block: KVBlock, obs: Any) -> torch.Tensor:  # pragma: no cover - interface
        """Scores ``[batch, kv_heads, tokens]`` of the block's tokens (higher = keep), any float dtype.

        Args:
            layer: the layer (``layer.info``, ``layer.layout``, ``layer.middle``, ``layer.state``).
            block: the full-precision tokens leaving the recent window (``k``/``v`` ``[batch, kv_heads, tokens,
                head_dim]``, ``positions``, ``valid``); invalid columns are never kept, whatever their score.
            obs: the :class:`~kvcompress.observe.Observation` of the step that flushes the block.
        """
        raise NotImplementedError

    def chunk_exempt(self, layer: Any, block: KVBlock, obs: Any) -> torch.Tensor | None:
        """With ``chunk > 1``: ``[batch|1, kv_heads|1, tokens]`` bool, the tokens whose own score stands outside any
        chunk (e.g. tokens a scorer always keeps, scored above every other one), or ``None`` (the default)."""
        return None

    def entry_scores(self, layer: Any, block: KVBlock, obs: Any) -> torch.Tensor:
        """The scores a prefill block's per-head top-k ranks: :meth:`score`, then with ``chunk > 1`` each token's
        chunk's (:func:`chunk_scores` over the block's valid, non-exempt tokens; exempt tokens keep their own)."""
        scores = self.score(layer, block, obs)
        c = self.config
        if c.chunk <= 1:
            return scores
        exempt = self.chunk_exempt(layer, block, obs)
        valid = block.valid if exempt is None else block.valid & ~exempt.any(dim=1)  # exempt in any head: in none
        chunked = chunk_scores(scores.float(), valid, c.chunk, c.chunk_heads == "shared")
        return chunked if exempt is None else torch.where(exempt, scores.float(), chunked)

    def stored_scores(self, layer: Any, obs: Any) -> torch.Tensor | None:
        """While decoding under a budget: the current scores ``[batch, kv_heads, slot_count]`` of the tokens
        stored in each slot of the middle (``layer.middle``'s slots, e.g. ``obs.mass["middle"]``), or ``None`` to
        keep the score each token had when it entered (the default)."""
        return None

    def stored_tokens(self, layer: Any, block: KVBlock,
                      obs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a scorer whose scores depend on what the cache holds (expected attention, KeyDiff): while decoding
        under a budget (slot mode, after the prefill's entry), ``(keys, values, valid)`` of the middle's slots -
        ``[batch, kv_heads, slots, head_dim]`` full precision (a quantized middle decoded, transient) and ``[batch,
        slots]`` bool - when the middle is one lane of every head; else ``None`` (the entry block; pruned, low-rank
        or regrouped lanes: stored tokens then keep the score they entered with).  A scorer that uses it scores the
        stored tokens in :meth:`score` and hands them over through :meth:`stored_scores`."""
        state = layer.state.get(self.name)
        entry = block.due is None and obs.prefill and not (state is not None and state.entered)
        if not layer.layout.head_slots or entry or layer.middle.slot_valid() is None:
            return None
        segments = layer.middle.segments()
        if len(segments) != 1 or segments[0].heads is not None or segments[0].qmap is not None \
                or segments[0].vmap is not None:
            return None
        keys, values = segments[0].keys_values()
        occupied = layer.middle.slot_valid()
        pad = keys.shape[2] - occupied.shape[1]
        ok = torch.cat([occupied, occupied.new_zeros(occupied.shape[0], pad)], 1) if pad else occupied
        return keys, values, ok

    # -- budgets ----------------------------------------------------------------------------------------------
    def layer_factor(self, info: LayerInfo) -> float:
        """The per-layer budget schedule: the middle's budget on this layer over the mean (1 for ``uniform``)."""
        if self.config.schedule != "pyramid" or info.num_layers <= 1:
            return 1.0
        top, bottom = 2.0 - 1.0 / PYRAMID_BETA, 1.0 / PYRAMID_BETA
        return top - (top - bottom) * info.index / (info.num_layers - 1)

    def layer_budget(self, info: LayerInfo) -> int | None:
        """Tokens a row keeps on this layer (``budget`` under the schedule; at least one middle token), or ``None``
        in ``ratio`` mode."""
        c = self.config
        if c.budget is None:
            return None
        middle = c.budget - c.sinks - c.recent
        return c.sinks + c.recent + max(1, round(middle * self.layer_factor(info)))

    # -- hooks ------------------------------------------------------------------------------------------------
    @hookimpl
    def kvcompress_validate_stack(self, entries, axes):
        me = next((i for i, (_, cfg) in enumerate(entries) if cfg is self.config), None)
        if me is None:
            return
        for i, axis in enumerate(axes):
            if axis == "quantize" and self.config.schedule == "adaptive":
                raise ConfigError(f"compressors[{me}].{entries[me][0]}.schedule", "'uniform' or 'pyramid' in a stack "
                                  "with a quantizer (adaptive per-head budgets need a middle store that keeps a "
                                  "per-head validity: the full-precision one)", f"'adaptive' with {entries[i][0]} at "
                                  f"compressors[{i}]")
            if axis == "select":
                raise ConfigError(f"compressors[{me}].{entries[me][0]}", "a stack without a read-time selector (a "
                                  "selector keeps per-token state aligned with the middle's columns, which per-head "
                                  "eviction reorders per head)", f"{entries[i][0]} at compressors[{i}]")

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        c = self.config
        bounded = c.phase != "prefill" and c.budget is not None
        budget = self.layer_budget(layer) if bounded else None
        attention = ({"both": True}.get(c.phase, c.phase) if self.attention else None)  # the phases it reads mass in
        # what a prompt leaves in the middle (a static cache sizes its middle by it at the first prefill): the
        # ratio under the layer's schedule; AdaKV may give one kv head the budget of all of its row's heads
        heads = layer.num_kv_heads if c.schedule == "adaptive" else 1
        prefill_ratio = prefill_middle = None
        if c.ratio is not None:
            prefill_ratio = min(1.0, c.ratio * self.layer_factor(layer) * heads)
        elif c.phase == "prefill":
            prefill_middle = max(0, self.layer_budget(layer) - c.sinks - c.recent) * heads
        return Layout(sinks=c.sinks, recent=c.recent, flush=1, observe=c.window, attention=attention,
                      middle=None if budget is None else budget - c.sinks - c.recent, budget=budget,
                      head_slots=(c.phase != "prefill") or None, head_valid=(c.schedule == "adaptive") or None,
                      prefill_ratio=prefill_ratio, prefill_middle=prefill_middle)

    @hookimpl
    def kvcompress_observe(self, layer, obs):
        state = self._state(layer)
        if not obs.prefill and self.config.phase == "prefill":
            state.obs = None  # decoding appends: nothing to score
            return
        if self.attention:
            obs.mass  # computed now, from the layer as the step read it (before the commit changes it)
        state.obs = obs

    @hookimpl
    def kvcompress_evict_tokens(self, layer, block):
        state = self._state(layer)
        obs, state.obs = state.obs, None  # used once: a kept reference would hold the step's tensors
        slotted = bool(layer.layout.head_slots)
        if obs is None:  # a static cache's warm-up block (no step was observed): allocate while eager
            if slotted and layer.static and state.scores is None:
                self._allocate(layer, state, block.valid.shape[0], block.valid.device)
            return None
        if not slotted:  # phase prefill: the prompt's blocks are selected; decoding appends
            return self._entry_keep(layer, block, self.entry_scores(layer, block, obs)) if obs.prefill else None
        if state.scores is None:
            self._allocate(layer, state, block.valid.shape[0], block.valid.device)
        if block.due is None and obs.prefill and not state.entered:
            return self._enter(layer, block, obs, state)
        self._replace(layer, block, obs, state)
        return None

    # -- decoding under a budget: per-head slots --------------------------------------------------------------
    def _middle_tokens(self, layer) -> int:
        """Middle tokens a row may hold on this layer (budget mode), after the stack's full-precision regions."""
        lay = layer.layout
        return max(0, self.layer_budget(layer.info) - (lay.sinks or 0) - (lay.recent or 0))

    def _allocate(self, layer, state: ScoreState, batch: int, device) -> None:
        store = layer.middle
        unit = store.slot_unit
        if self.config.budget is not None:
            units = self._middle_tokens(layer) // unit
        else:
            units = 0  # ratio: set by the prefill (what it kept)
        if not layer.static:
            store.limit(max(units * unit, unit))  # the dynamic store's slots
        state.static = bool(layer.static)
        state.allocate(batch, layer.info.num_kv_heads, store.slot_count // unit, units, device)

    def _enter(self, layer, block: KVBlock, obs, state: ScoreState) -> torch.Tensor:
        """The first prefill block in slot mode: per-head top-k (budget or ratio, in whole slot units), each head's
        j-th kept token aimed at the row's j-th free slot (the pipeline packs the block; the slots follow)."""
        store = layer.middle
        unit = store.slot_unit
        scores = self._sanitize(self.entry_scores(layer, block, obs))
        budgeted = self.config.budget is not None
        keep = self._entry_keep(layer, block, scores, cap=state.target * unit if budgeted else None)
        b, h, n = keep.shape
        kept = keep[:, 0].sum(-1)  # [b]
        if not budgeted:  # ratio: the middle holds what the prefill kept, while decoding too
            target = (kept + unit - 1) // unit
            if not layer.static and store.slot_valid() is None:  # the dynamic store's slots: the fullest row
                store.limit(max(int(target.max()) * unit, unit))
                state.allocate(b, h, store.slot_count // unit, 0, scores.device)
            state.target.copy_(target)
        count = store.slot_count
        units = count // unit
        free = self._free_units(store, b, units, scores.device)  # [b, units]: free unit slots, lowest first
        rank = keep.long().cumsum(-1) - 1
        unit_of = (rank // unit).clamp(0, units - 1)
        slot = free.gather(1, unit_of.view(b, h * n)).view(b, h, n) * unit + rank.remainder(unit)
        block.slots = torch.where(keep, slot, torch.full_like(slot, count))
        # each head's kept tokens in order (as the pipeline packs them), scored per unit where they land
        idx = torch.arange(n, device=keep.device)
        packed = scores.gather(2, torch.where(keep, idx, idx + n).argsort(dim=-1))
        n_units = -(-n // unit)
        live = (idx.view(1, 1, n) < kept.view(b, 1, 1)).expand(b, h, n).float()
        pad = n_units * unit - n
        if pad:
            packed, live = F.pad(packed, (0, pad)), F.pad(live, (0, pad))
        live = live.view(b, h, n_units, unit)
        unit_score = (packed.view(b, h, n_units, unit) * live).sum(-1) / live.sum(-1).clamp(min=1)
        dest = free.gather(1, torch.arange(n_units, device=keep.device).clamp(max=units - 1).expand(b, n_units))
        dest = torch.where(live[..., 0] > 0, dest.unsqueeze(1), units)  # [b, h, n_units]; unused: the trash
        state.scores.scatter_(2, dest, unit_score)
        state.entered = True
        return keep

    @staticmethod
    def _free_units(store, batch: int, units: int, device) -> torch.Tensor:
        """``[batch, units]``: each row's free slot units first (lowest index first), then the occupied ones."""
        occupied = store.slot_valid()
        if occupied is None:
            return torch.arange(units, device=device).expand(batch, units)
        return free_first(occupied.view(batch, units, -1).any(-1))

    def _replace(self, layer, block: KVBlock, obs, state: ScoreState) -> None:
        """Decoding under a budget (and every block after the first prefill one): per head, the incoming units
        that score above that head's lowest stored units replace them one for one; new units fill the row's free
        slots (the same ones for every head) while the row is under its budget.  Sets ``block.slots``; fixed
        shapes, no host read (a static cache's decode step runs it every step, ``block.due`` gating).  The
        decision is :func:`replace_units` (:func:`replace_one_unit` for a block of one unit: a decode step)."""
        store = layer.middle
        unit, count = store.slot_unit, store.slot_count
        units = count // unit
        b, n = block.valid.shape
        h = layer.info.num_kv_heads
        if n % unit:
            raise ValueError(f"{self.name}: a block of {n} tokens does not split into slot units of {unit} tokens")
        nu = n // unit
        dev = block.valid.device
        valid = block.valid if block.due is None else block.valid & block.due
        incoming_ok = valid.view(b, nu, unit).all(-1)  # [b, nu]: a unit enters whole or not at all
        incoming = self._sanitize(self.score(layer, block, obs))
        incoming = incoming.view(b, h, nu) if unit == 1 else incoming.view(b, h, nu, unit).mean(-1)
        occupied = store.slot_valid()
        live = (torch.zeros(b, units, dtype=torch.bool, device=dev) if occupied is None
                else occupied if unit == 1 else occupied.view(b, units, unit).any(-1))
        fresh = self.stored_scores(layer, obs)
        if fresh is not None and fresh.shape[-1] >= count:
            fresh = self._sanitize(fresh[..., :count])
            state.scores[..., :units] = fresh if unit == 1 else fresh.view(b, h, units, unit).mean(-1)
        decide = replace_one_unit if nu == 1 else replace_units
        target = decide(state.scores[..., :units], live, state.target, incoming, incoming_ok)
        state.scores.scatter_(2, target, incoming)
        block.slots = target if unit == 1 else (target.unsqueeze(-1) * unit
                                                + torch.arange(unit, device=dev)).view(b, h, n)

    @staticmethod
    def _sanitize(scores: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(scores.float(), nan=0.0, posinf=3.0e38, neginf=-3.0e38)

    # -- selection --------------------------------------------------------------------------------------------
    def _state(self, layer) -> ScoreState:
        state = layer.state.get(self.name)
        if state is None:
            state = layer.state[self.name] = ScoreState()
        return state

    @staticmethod
    def _middle_count(layer) -> torch.Tensor | None:
        stored = layer.middle.valid_mask() if layer.middle is not None else None
        return None if stored is None else stored.sum(dim=1)

    def _entry_keep(self, layer, block: KVBlock, scores: torch.Tensor,
                    cap: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head top-k of a prefill block: ``[batch, kv_heads, tokens]`` with ``k`` per row (the same for every
        head): the budget left after what the row holds, or ``ratio`` of its prompt tokens; ``cap`` ``[batch]``:
        at most this many middle tokens per row (slot mode: whole units)."""
        valid = block.valid
        b, n = valid.shape
        count = valid.sum(dim=1)
        held = layer.held_tokens()
        stored = self._middle_count(layer)
        stored = torch.zeros_like(count) if stored is None else stored
        factor = self.layer_factor(layer.info)
        c = self.config
        if c.budget is not None:
            lay = layer.layout
            target = max(0, self.layer_budget(layer.info) - (lay.sinks or 0) - (lay.recent or 0))
            keep_n = (target - stored).clamp(min=0)
        else:
            total = held + stored + count
            target = ((c.ratio * total.double() - held.double()).clamp(min=0) * factor).floor().long()
            keep_n = (target - stored).clamp(min=0)
        s = self._sanitize(scores)
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        order = s.argsort(dim=-1, descending=True, stable=True)  # ties: the older token first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=s.device).expand_as(order))
        if c.schedule == "adaptive":
            return self._adaptive_keep(layer, s, rank, valid, target, count)
        keep_n = torch.minimum(keep_n, count)
        if cap is not None:
            keep_n = torch.minimum(keep_n, (cap - stored).clamp(min=0))
        return (rank < keep_n.view(b, 1, 1)) & valid.unsqueeze(1)

    def _adaptive_keep(self, layer, s: torch.Tensor, rank: torch.Tensor, valid: torch.Tensor, target,
                       count: torch.Tensor) -> torch.Tensor:
        """AdaKV's allocation (arXiv 2407.11550) of one prefill block: the row's budget over all its kv heads
        (``kv_heads x`` the per-head ``target`` less what the heads already hold) goes to the top scores of the
        flattened ``[kv_heads x tokens]`` scores, after each head's top ``floor(alpha x`` the budget ``/ kv_heads)``
        tokens are reserved for it.  ``s``: sanitized scores, ``-inf`` where invalid; ``rank``: each token's rank in
        its head (0 = best).  Ties: the lower head, then the older token.  Fixed shapes, no host read."""
        b, h, n = s.shape
        held = layer.middle.head_valid_mask() if layer.middle is not None else None
        if held is None:
            rows = self._middle_count(layer)
            stored = (torch.zeros(b, device=s.device, dtype=torch.long) if rows is None else rows) * h
        else:
            stored = held.sum(dim=(1, 2))
        total = (target * h - stored).clamp(min=0) if isinstance(target, torch.Tensor) else (
            (torch.full_like(count, target * h) - stored).clamp(min=0))
        total = torch.minimum(total, count * h)  # [b]
        floor = torch.minimum((self.config.alpha * total.double() / h).floor().long(), count)  # [b]
        reserved = (rank < floor.view(b, 1, 1)) & valid.unsqueeze(1)
        flat = torch.where(reserved, torch.full_like(s, float("inf")), s).reshape(b, h * n)
        order = flat.argsort(dim=-1, descending=True, stable=True)
        flat_rank = torch.empty_like(order).scatter_(-1, order, torch.arange(h * n, device=s.device).expand_as(order))
        return (flat_rank.view(b, h, n) < total.view(b, 1, 1)) & valid.unsqueeze(1)


def free_first(live: torch.Tensor) -> torch.Tensor:
    """``[batch, units]``: each row's slot units not ``live`` first (lowest index first), then the live ones."""
    idx = torch.arange(live.shape[-1], device=live.device)
    return torch.where(live, idx + live.shape[-1], idx).argsort(dim=-1)


def replace_units(stored: torch.Tensor, live: torch.Tensor, target: torch.Tensor, incoming: torch.Tensor,
                  incoming_ok: torch.Tensor) -> torch.Tensor:
    """Where each incoming unit of a budgeted middle goes (:meth:`ScoreEvictor._replace`), per kv head.

    ``stored`` ``[batch, kv_heads, units]``: each head's score of the unit in each slot unit (read where ``live``);
    ``live`` ``[batch, units]``: slot units that hold tokens; ``target`` ``[batch]``: units a row holds at most;
    ``incoming`` ``[batch, kv_heads, n]`` the incoming units' scores, ``incoming_ok`` ``[batch, n]`` the units that
    may enter.  A row keeps its ``min(target, held + incoming)`` best units (never fewer than it holds; ties: a
    stored unit before an incoming one, an older slot before a newer one, an earlier incoming before a later one);
    each kept incoming unit takes the slot of one of its head's dropped stored units (lowest slot first), then
    the row's free slots (lowest first, the same for every head).  Returns ``[batch, kv_heads, n]`` int64 slot
    units; ``units`` (the trash unit) for a unit that does not enter.  Fixed shapes, no host read."""
    b, h, units = stored.shape
    nu = incoming.shape[-1]
    dev = stored.device
    inf = torch.full((), float("-inf"), device=dev)
    cand = torch.cat([torch.where(live.unsqueeze(1), stored, inf), torch.where(incoming_ok.unsqueeze(1), incoming,
                                                                                 inf)], dim=-1)
    held = live.sum(1)
    # at most the target; never fewer than held (an evictor never frees a slot it does not refill)
    most = torch.maximum(torch.minimum(target, held + incoming_ok.sum(1)), held)
    order = cand.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(units + nu, device=dev).expand_as(order))
    kept = (rank < most.view(b, 1, 1)) & torch.cat([live, incoming_ok], dim=1).unsqueeze(1)
    kept_in = kept[..., units:]  # [b, h, nu]
    victim = live.unsqueeze(1) & ~kept[..., :units]  # [b, h, units]
    n_victims = victim.sum(-1, keepdim=True)
    idx = torch.arange(units, device=dev)
    victims = torch.where(victim, idx, idx + units).argsort(dim=-1)  # each head's victims first, lowest first
    free = free_first(live).unsqueeze(1).expand(b, h, units)
    j = kept_in.long().cumsum(-1) - 1  # the j-th kept incoming unit of a head
    to_victim = victims.gather(-1, j.clamp(0, units - 1))
    to_free = free.gather(-1, (j - n_victims).clamp(0, units - 1))
    slot = torch.where(j < n_victims, to_victim, to_free)
    return torch.where(kept_in, slot, torch.full_like(slot, units))  # dropped: the trash unit


def replace_one_unit(stored: torch.Tensor, live: torch.Tensor, target: torch.Tensor, incoming: torch.Tensor,
                     incoming_ok: torch.Tensor) -> torch.Tensor:
    """:func:`replace_units` for one incoming unit (``n == 1``: a decode step), the same decision in a handful of
    kernels instead of two sorts: a row under its target puts the unit in its lowest free slot; a full row lets it
    replace, per head, that head's lowest-scoring stored unit (ties: the newest slot) when it scores strictly
    higher."""
    b, h, units = stored.shape
    ok = incoming_ok[:, 0]  # [b]
    inc = incoming[..., 0]  # [b, h]
    masked = torch.where(live.unsqueeze(1), stored, float("inf"))
    low, last = masked.flip(-1).min(-1)  # the first minimum of the reversed slots: the newest lowest one
    victim = units - 1 - last  # [b, h]
    room = live.sum(1) < target  # [b]
    free = (~live).to(torch.uint8).argmax(1)  # [b]: the lowest free slot (one exists while under the target)
    slot = torch.where(room.unsqueeze(1), free.unsqueeze(1), torch.where(inc > low, victim, units))
    return torch.where(ok.unsqueeze(1), slot, units).unsqueeze(-1)


__all__ = ["CHUNK_HEADS", "PHASES", "PYRAMID_BETA", "SCHEDULES", "ScoreConfig", "ScoreEvictor", "ScoreState",
           "chunk_scores", "free_first", "replace_one_unit", "replace_units"]
