"""TOVA: token omission via attention - keep, per head, the tokens the current query attends to most.

Oren, Hassid, Yarden, Adi, Schwartz. *Transformers are Multi-State RNNs.* EMNLP 2024, arXiv:2401.06104.

A fixed budget of tokens per row and layer; at every decoding step, once the budget is full, the token
that received the lowest attention from the current query is dropped.  Here each kv head decides for itself
(the attention summed over the query heads of its group, ``heads: kv``) - or, as the paper and kvpress'
``TOVAPress`` do, every head of the layer together (summed over all heads, ``heads: layer``).  The scores of
the stored tokens are the current step's attention (``obs.mass["middle"]``, recomputed each step), so a
token that stops being attended to leaves at the next step that needs room.

Built on :class:`kvcompress.ScoreEvictor` with per-head slots: while decoding (``phase: decode`` or ``both``,
the default), tokens leaving the full-precision window replace the lowest-scoring stored tokens of each head
in place, so the cache's memory stays flat under the budget (dense middle, or KIVI's preallocated store:
then whole groups of G tokens, scored by their mean attention).  At prefill (``phase: both`` or ``prefill``) the
prompt is cut to the budget by the last prompt query's attention, as kvpress' TOVAPress does.

Parameters: ``budget`` (tokens per row and layer: sinks + recent + middle), ``sinks`` (0), ``recent`` (1:
the newest token, which kvpress also protects), ``heads`` ("kv"), ``phase`` ("both"), ``schedule``
("uniform"); see :class:`kvcompress.scoring.ScoreConfig`.
"""

from __future__ import annotations

import dataclasses

from kvcompress import CompressorSpec, hookimpl, param
from kvcompress.distributed import sum_over_heads
from kvcompress.scoring import PHASES, ScoreConfig, ScoreEvictor


@dataclasses.dataclass(frozen=True)
class TOVAConfig(ScoreConfig):
    sinks: int = param(0, "first real tokens of each row never evicted (attention sinks)", min=0, max=1 << 20)
    recent: int = param(1, "newest tokens kept in full precision, never evicted", min=0, max=1 << 24)
    window: int = param(1, "last prefill queries whose attention scores the prompt (TOVA: the last one)", min=1,
                        max=1 << 16)
    phase: str = param("both", "when to evict: 'prefill', 'decode' or 'both' (TOVA: while decoding)",
                       choices=PHASES)
    heads: str = param("kv", "'kv': each kv head decides (attention summed over its query heads); 'layer': one "
                       "decision for every head (the paper, kvpress)", choices=("kv", "layer"))


class TOVACompressor(ScoreEvictor):
    name = "tova"
    attention = True

    def _heads(self, scores, layer):
        if self.config.heads == "layer":  # pooled over the model's heads (all-reduced under tensor parallelism)
            return sum_over_heads(scores, layer.info, keepdim=True).expand_as(scores)
        return scores

    def score(self, layer, block, obs):
        return self._heads(obs.token_mass(block.positions), layer)

    def stored_scores(self, layer, obs):
        return self._heads(obs.mass["middle"], layer)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="tova", axis="evict", config=TOVAConfig, factory=TOVACompressor,
        summary="TOVA: per-head budget, drop the tokens the current query attends to least (arXiv:2401.06104)",
    ))
