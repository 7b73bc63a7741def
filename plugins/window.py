"""Ring-buffer window with attention sinks (StreamingLLM).

Xiao, Tian, Chen, Han, Lewis. *Efficient Streaming Language Models with
Attention Sinks.* ICLR 2024, arXiv:2309.17453.

Keeps the first ``sinks`` real tokens of each row and its ``recent`` most
recent tokens; everything in between is evicted, one token at a time, so the
cache never holds more than ``sinks + recent`` tokens per row (attention also
sees the token being processed).  Keys are stored after RoPE at their original
positions and never re-rotated (re-rotation only matters beyond the model's
trained length).

Stacked with a quantizer or a pruner, ``recent`` is the token budget of the
whole window: the compressors downstream may keep their own full-precision
recent tokens (e.g. KIVI's residual) and compress the rest of the budget.

The window is over positions: a row keeps its tokens at the ``recent`` newest positions (for left-padded
batches, exactly its ``recent`` newest real tokens; a mask with holes inside a row keeps fewer).

Parameters: ``sinks`` (default 4, the paper's choice), ``recent`` (default 1024;
the paper's streaming default is 4 + 1020 for Llama-2).
"""

from __future__ import annotations

import dataclasses

import torch

from kvcompress import Compressor, CompressorSpec, Layout, hookimpl, param
from kvcompress.state import DenseStore


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    sinks: int = param(4, "attention-sink tokens kept at the start of each row", min=0, max=1 << 20)
    recent: int = param(1024, "most recent tokens kept (the window's token budget)", min=1, max=1 << 24)


class WindowCompressor(Compressor):
    name = "window"
    graph_safe = True

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        # The window itself needs no full-precision ring: its tokens live in the middle
        # store (full precision unless a quantizer is stacked after it), which never holds more
        # than the window's budget.
        return Layout(sinks=self.config.sinks, recent=0, flush=1, middle=self.config.recent,
                      budget=self.config.sinks + self.config.recent)

    @hookimpl
    def kvcompress_evict_tokens(self, layer, block):
        # > 0: a stack whose full-precision window swallows the budget is refused (Layout.budget)
        budget = self.config.recent - (layer.layout.recent or 0)
        if layer.static:
            # Rows share positions (left padding keeps them aligned) and a row's real tokens are a
            # suffix of them, so "the budget newest real tokens" is "positions >= horizon".
            horizon = block.positions[-1] + 1 - budget
            positions = layer.middle.positions()  # None until the store's first block
            if positions is not None:
                stored = positions >= horizon
                if block.due is not None:
                    stored = stored | ~block.due
                layer.middle.retain(stored.unsqueeze(0))
            return (block.positions >= horizon).unsqueeze(0).expand_as(block.valid)
        store = layer.middle
        store.limit(budget)
        if isinstance(store, DenseStore) or (block.all_valid and store.known_all_valid()):
            # The budget newest real tokens of a row are its last `budget` columns: columns are positions shared
            # by every row, and a row's real tokens are a suffix of them (left padding; the sinks leave from the
            # front) - the static cache's rule too.  So drop the oldest columns, decided on the host: nothing is
            # read from the device (a padded batch used to sync ~3 times per layer and step here).  A full-
            # precision store drops any number of columns; other stores only when every token is known valid
            # (then the general path below would drop the same columns).
            stored, drop = store.num_tokens, store.num_tokens + block.num_tokens - budget
            if drop <= 0:
                return None
            store.drop_oldest(min(drop, stored))
            if drop <= stored:
                return None
            keep = torch.arange(block.num_tokens, device=block.valid.device) >= drop - stored
            return keep.unsqueeze(0).expand_as(block.valid)
        # a store that evicts in units (e.g. KIVI's groups) with padded rows: mask per row
        stored = store.valid_mask()
        combined = block.valid if stored is None else torch.cat([stored, block.valid], dim=1)
        # Rank tokens of each row from the newest; keep the `budget` newest real ones.
        rank = combined.flip(1).long().cumsum(1).flip(1)
        keep = combined & (rank <= budget)
        if stored is not None:
            layer.middle.retain(keep[:, : stored.shape[1]])
        return keep[:, combined.shape[1] - block.num_tokens:]


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="window", axis="evict", config=WindowConfig, factory=WindowCompressor,
        summary="StreamingLLM ring window: keep sinks + most recent tokens (arXiv:2309.17453)",
    ))
