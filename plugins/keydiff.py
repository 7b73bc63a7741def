"""KeyDiff: keep, per kv head, the tokens whose keys differ most from the cache's average key direction.

Park, Jones, Morse, Goel, Lee, Lott. *KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments.* arXiv:2504.15364, 2025 (kvpress' ``KeyDiffPress``).

A token's score is minus the cosine similarity between its key and the *anchor*: the mean of the unit-length keys
of its kv head (post-RoPE, full precision).  Keys close to the average direction are redundant and go first;
distinctive keys stay.  No query and no attention weight is read, so it runs wherever the read kernels return
none (as ``knorm``), and it costs one normalisation and one dot product per key.

Which keys form the anchor:

* a prefill block (``phase: prefill`` or ``both``): the keys of every valid token that has left the window so far in
  this row and layer (the block itself for a one-block prefill; the chunks so far under a chunked prefill, as the
  paper's block-wise eviction does).  kvpress' press averages over every prompt key, the sinks and the last
  ``recent`` tokens included; here those never enter a block (they are never evicted), so they are not in the
  anchor (docs/results.md, issue 17, session 20, has both on the same windows).
* decoding under a budget (``phase: decode`` / ``both``): the paper's block-wise rule - the anchor over the keys
  the middle holds plus the incoming block's, and the stored tokens rescored against it every flush (the
  ``ScoreEvictor.stored_tokens`` of a middle that is one lane of every head, a quantized one decoded); with pruned
  or low-rank lanes the stored tokens keep the score they entered with and the anchor is the running one above.

Parameters: ``ratio`` or ``budget``, ``sinks`` (4), ``recent`` (64), ``phase`` ("prefill"), ``schedule``, ``chunk``
(see :class:`kvcompress.scoring.ScoreConfig`; ``window`` is unused: nothing is observed but the keys).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvcompress import CompressorSpec, ScoreConfig, ScoreEvictor, hookimpl, param
from kvcompress.static import mark_static, remap_rows


@dataclasses.dataclass(frozen=True)
class KeyDiffConfig(ScoreConfig):
    window: int = param(1, "last prefill queries an observation keeps (keydiff reads none)", min=1, max=1 << 16)


class KeySum:
    """Per layer (``layer.state``): the running sum of the unit keys that left the window, ``[batch, kv_heads,
    head_dim]`` float32 - the anchor's direction.  Static caches update it in place inside the compiled step."""

    def __init__(self, static: bool) -> None:
        self.static = static
        self.total: torch.Tensor | None = None
        self.stored: torch.Tensor | None = None  # the stored slots' scores of the current flush, until used

    def add(self, unit: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """Adds the valid columns of ``unit`` (``[b, h, n, d]``, ``ok`` ``[b, n]``); returns the sum."""
        part = (unit * ok[:, None, :, None]).sum(2)
        if self.total is None:
            self.total = torch.zeros_like(part)
            if self.static:
                mark_static(self.total)
        self.total.add_(part)
        return self.total

    def map_batch(self, fn) -> None:
        if self.total is not None:
            self.total = remap_rows(self.total, fn) if self.static else fn(self.total)

    def reset(self) -> None:
        self.stored = None
        if self.total is not None:
            self.total.zero_()

    def nbytes(self) -> int:
        return 0 if self.total is None else self.total.numel() * self.total.element_size()

    def row_nbytes(self) -> int:
        return 0  # every byte is per kv head


def keydiff_scores(unit: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``-cos(k, anchor)`` ``[b, h, n]`` of unit keys ``[b, h, n, d]`` against an anchor direction ``[b, h, d]``
    (any length; zero: every score 0)."""
    return -(unit * F.normalize(direction, dim=-1).unsqueeze(2)).sum(-1)


class KeyDiffCompressor(ScoreEvictor):
    name = "keydiff"

    def _sum(self, layer) -> KeySum:
        key = f"{self.name}:anchor"
        state = layer.state.get(key)
        if state is None:
            state = layer.state[key] = KeySum(bool(layer.static))
        return state

    def score(self, layer, block, obs):
        valid = block.valid if block.due is None else block.valid & block.due
        unit = F.normalize(block.k.float(), dim=-1)
        running = self._sum(layer)
        stored = self.stored_tokens(layer, block, obs)
        if stored is None:
            return keydiff_scores(unit, running.add(unit, valid))
        keys, _, ok = stored  # the paper's block-wise rule: anchor over the held keys and the block's
        held = F.normalize(keys.float(), dim=-1)
        direction = (held * ok[:, None, :, None]).sum(2) + (unit * valid[:, None, :, None]).sum(2)
        running.stored = keydiff_scores(held, direction)
        return keydiff_scores(unit, direction)

    def stored_scores(self, layer, obs):
        state = self._sum(layer)
        out, state.stored = state.stored, None
        return out


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="keydiff", axis="evict", config=KeyDiffConfig, factory=KeyDiffCompressor,
        summary="KeyDiff: per-head keep the keys least similar to the mean key direction (arXiv:2504.15364, "
                "kvpress KeyDiffPress)",
    ))
