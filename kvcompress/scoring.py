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

Everything runs in eager steps and inside a static cache's compiled decode step (``graph_safe = True``: fixed
shapes, no host reads there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .compressor import Compressor
from .config import param
from .errors import ConfigError
from .hookspecs import hookimpl
from .state import KVBlock, LayerInfo, Layout

PHASES = ("prefill", "decode", "both")
SCHEDULES = ("uniform", "pyramid")
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
    schedule: str = param("uniform", "per-layer budgets: 'uniform' or 'pyramid' (PyramidKV)", choices=SCHEDULES)

    def check(self, path: str) -> None:
        if (self.budget is None) == (self.ratio is None):
            raise ConfigError(f"{path}.budget", "exactly one of budget (tokens per row and layer) or ratio (fraction of "
                              "the prompt kept)", {"budget": self.budget, "ratio": self.ratio})
        if self.ratio is not None and self.ratio <= 0.0:
            raise ConfigError(f"{path}.ratio", "a fraction in (0, 1]", self.ratio)
        if self.ratio is not None and self.phase == "decode":
            raise ConfigError(f"{path}.ratio", "null with phase 'decode' (decoding holds a token budget: set budget)",
                              self.ratio)
        if self.budget is not None and self.budget <= self.sinks + self.recent:
            raise ConfigError(f"{path}.budget", f"more than sinks + recent = {self.sinks + self.recent} (the tokens "
                              "never evicted)", self.budget,
                              hint="the budget would leave no middle token to choose")


class ScoreState:
    """Per-layer state of a :class:`ScoreEvictor` (``layer.state[name]``): the step's observation until the flush
    uses it."""

    def __init__(self) -> None:
        self.obs: Any = None

    def map_batch(self, fn) -> None:  # nothing batch-major is kept between steps
        return None

    def reset(self) -> None:
        self.obs = None


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

    # -- budgets ----------------------------------------------------------------------------------------------
    def layer_factor(self, info: LayerInfo) -> float:
        """The per-layer budget schedule: the middle's budget on this layer over the mean (1 for ``uniform``)."""
        if self.config.schedule == "uniform" or info.num_layers <= 1:
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
    def kvcompress_layer_layout(self, layer):
        c = self.config
        bounded = c.phase != "prefill" and c.budget is not None
        budget = self.layer_budget(layer) if bounded else None
        return Layout(sinks=c.sinks, recent=c.recent, flush=1, observe=c.window, attention=self.attention or None,
                      middle=None if budget is None else budget - c.sinks - c.recent, budget=budget)

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
        if obs is None:  # a static cache's warm-up block (no step was observed)
            return None
        if not obs.prefill:
            if self.config.phase == "prefill":
                return None  # decoding appends: only the prompt is compressed
            raise NotImplementedError("decode-phase eviction")
        return self._entry_keep(layer, block, self.score(layer, block, obs))

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

    def _entry_keep(self, layer, block: KVBlock, scores: torch.Tensor) -> torch.Tensor:
        """Per-head top-k of a prefill block: ``[batch, kv_heads, tokens]`` with ``k`` per row (the same for every
        head): the budget left after what the row holds, or ``ratio`` of its prompt tokens."""
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
        keep_n = torch.minimum(keep_n, count)
        s = torch.nan_to_num(scores.float(), nan=0.0, posinf=3.0e38, neginf=-3.0e38)
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        order = s.argsort(dim=-1, descending=True, stable=True)  # ties: the older token first
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=s.device).expand_as(order))
        return (rank < keep_n.view(b, 1, 1)) & valid.unsqueeze(1)


__all__ = ["PHASES", "PYRAMID_BETA", "SCHEDULES", "ScoreConfig", "ScoreEvictor", "ScoreState"]
