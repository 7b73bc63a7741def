"""Key-norm eviction: keep the tokens whose keys have the smallest L2 norm.

Devoto, Zhao, Scardapane, Minervini. *A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression.* EMNLP 2024, arXiv:2406.11430 (kvpress' ``KnormPress``).

Keys with a low L2 norm draw high attention, so each kv head keeps its tokens of lowest ``||K||_2`` (the
post-RoPE key, full precision, as the token leaves the window): score ``-||K||``, per-head top budget
(:class:`kvcompress.ScoreEvictor`).  A training-free, attention-free baseline: no query is needed, so it
runs where the read kernels return no attention weights.

Parameters: ``ratio`` or ``budget``, ``sinks`` (4), ``recent`` (64), ``phase`` ("prefill"), ``schedule``
(see :class:`kvcompress.scoring.ScoreConfig`; ``window`` is unused: nothing is observed but the keys).
"""

from __future__ import annotations

import dataclasses

from kvcompress import CompressorSpec, hookimpl, param
from kvcompress.scoring import ScoreConfig, ScoreEvictor


@dataclasses.dataclass(frozen=True)
class KnormConfig(ScoreConfig):
    window: int = param(1, "last prefill queries an observation keeps (knorm reads none)", min=1, max=1 << 16)


class KnormCompressor(ScoreEvictor):
    name = "knorm"

    def score(self, layer, block, obs):
        return -block.k.float().norm(dim=-1)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="knorm", axis="evict", config=KnormConfig, factory=KnormCompressor,
        summary="Key-norm eviction: per-head keep the lowest ||K|| (arXiv:2406.11430, kvpress KnormPress)",
    ))
