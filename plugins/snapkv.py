"""SnapKV: keep, per kv head, the prompt tokens the last queries of the prompt attend to.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen. *SnapKV: LLM Knows What You are Looking for
Before Generation.* NeurIPS 2024, arXiv:2404.14469.

At prefill the last ``window`` queries of the prompt (the observation window) attend to the whole prompt;
each token's score is the attention it received, averaged over the window and summed over the query heads
of its kv head (GQA: one decision per kv head, as kvpress does after SnapKV issue 22, which averages; the
sum ranks the same), then smoothed along the tokens by a pooling of ``kernel`` tokens (clusters of
neighbours are kept together).  The observation's mass is per kv head, so the pooling follows the sum over
the group; kvpress pools each query head first - the same result for ``avg`` pooling (linear), a slightly
different one for ``max``.  Each kv head keeps its top-scoring tokens (:class:`kvcompress.ScoreEvictor`:
uniform per-head budgets, the survivors packed per head, so the middle holds only them); tokens of the
observation window are always kept (scored above every other token, as kvpress does).

The attention is exact: the observation's mass is a softmax over everything the step read, with the
model's soft-cap and sink logits (``kvcompress.observe``).  Pooling: ``pool: max`` with ``kernel: 7`` is
what the SnapKV authors' configurations use; kvpress' ``SnapKVPress`` averages (``pool: avg``) with a
kernel of 5.  The pooled sequence stops before the observation window (kvpress cuts it there too);
tokens outside the prompt pad it (zeros for ``avg``, i.e. ``count_include_pad``; nothing for ``max``).

Parameters: ``ratio`` or ``budget`` (see :class:`kvcompress.scoring.ScoreConfig`), ``window`` (64),
``kernel`` (7), ``pool`` ("max"), ``sinks`` (4), ``recent`` (64; keep it >= ``window`` so the observation
window stays in full precision), ``phase`` ("prefill"), ``schedule`` ("uniform"; "pyramid" is PyramidKV;
"adaptive" is AdaKV over SnapKV's scores, kvpress' ``AdaKVPress(SnapKVPress)``: the layer's budget of a row goes to
the top scores of all its kv heads together, each head keeping at least ``alpha`` x the uniform budget; phase
"prefill" only; examples/stacks/adakv25.yaml), ``alpha`` (0.2, AdaKV's ``alpha_safeguard``; 1 = uniform).  With
"adaptive" the heads of a row keep different numbers of tokens; in a dynamic cache each kv head's middle is a lane of
its own length (docs/writing-a-plugin.md, "Adaptive per-head budgets").
``value_norm`` (False): multiply each token's pooled score by the L1 norm of its value vector in its kv head, as
VATP does (Guo, Kamigaito, Watanabe. *Attention Score is not All You Need for Token Importance Indicator in KV Cache
Reduction: Value Also Matters.* EMNLP 2024, arXiv:2406.12335): a token that is attended but whose value is near zero
adds little to the output.  On the default model at 25% kept it lowers the loss slightly (docs/results.md, issue 17,
session 15).
``chunk`` (1, every :class:`kvcompress.ScoreEvictor` takes it): keep whole chunks of ``chunk`` consecutive tokens,
ranked by the mean of their tokens' scores, as ChunkKV does (Liu et al. *ChunkKV: Semantic-Preserving KV Cache
Compression for Efficient Long-Context LLM Inference.* NeurIPS 2025, arXiv:2502.00299; kvpress' ``ChunkKVPress``,
chunk 20): a multi-token
entity (a number split into several tokens) survives or goes as a whole.  ``chunk_heads`` ("shared"): one chunk
ranking per layer from the scores summed over the kv heads (ChunkKV), or "each" kv head its own; the observation
window's tokens stay outside the chunks (always kept).
The default window is kvpress' 64 queries; the example stacks (examples/stacks/snapkv.yaml, snapkv25.yaml) observe
128, which on the default model's perplexity windows loses a quarter to a half of what 64 loses (docs/results.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvcompress import CompressorSpec, hookimpl, param
from kvcompress.errors import ConfigError
from kvcompress.scoring import ScoreConfig, ScoreEvictor


@dataclasses.dataclass(frozen=True)
class SnapKVConfig(ScoreConfig):
    kernel: int = param(7, "pooling kernel along the tokens (odd; 1 = no pooling)", min=1, max=63)
    pool: str = param("max", "pooling: 'max' (the SnapKV authors' configurations) or 'avg' (kvpress' SnapKVPress)",
                      choices=("max", "avg"))
    value_norm: bool = param(False, "weight each token's pooled score by its value's L1 norm (VATP, arXiv 2406.12335)")

    def check(self, path: str) -> None:
        super().check(path)
        if self.kernel % 2 == 0:
            raise ConfigError(f"{path}.kernel", "an odd number of tokens", self.kernel)


def pooled_window_attention(obs, positions: torch.Tensor, kernel: int, pool: str,
                            weight: torch.Tensor | None = None) -> torch.Tensor:
    """SnapKV's score ``[batch, kv_heads, n]`` of the tokens at ``positions`` (``[n]``, contiguous, ascending):
    the observed queries' attention mass (averaged over them, summed over each kv head's query heads), pooled over
    ``kernel`` neighbouring positions before the observation window; tokens inside the window score above every
    other token of their head.  The average makes a decode step's score (one query) comparable to the prompt's.
    ``weight`` (``[batch, kv_heads, n]``, optional) multiplies the pooled scores before the window is ranked on top."""
    half = kernel // 2
    n = positions.shape[0]
    span = positions[0] - half + torch.arange(n + 2 * half, device=positions.device)
    first_query = obs.query_positions[0]
    inside = (span >= 0) & (span < first_query)  # kvpress pools the tokens before the window
    mass = obs.token_mass(span)  # [b, h, n + 2 half]
    b, h, length = mass.shape
    if pool == "max":
        mass = mass.masked_fill(~inside, float("-inf"))
        pooled = F.max_pool1d(mass.reshape(b * h, 1, length), kernel, stride=1)
    else:
        pooled = F.avg_pool1d((mass * inside).reshape(b * h, 1, length), kernel, stride=1)
    pooled = pooled.view(b, h, n) / obs.query.shape[2]  # averaged over the window: decode steps score alike
    if weight is not None:
        pooled = torch.where(torch.isfinite(pooled), pooled * weight, pooled)  # -inf (nothing pooled) stays -inf
    in_window = (positions >= first_query).view(1, 1, n)
    return torch.where(in_window, pooled.amax(dim=-1, keepdim=True).clamp(min=0) + 1.0, pooled)


class SnapKVCompressor(ScoreEvictor):
    name = "snapkv"
    attention = True

    def score(self, layer, block, obs):
        weight = block.v.float().abs().sum(-1) if self.config.value_norm else None  # VATP: |v|_1 per token
        return pooled_window_attention(obs, block.positions, self.config.kernel, self.config.pool, weight)

    def chunk_exempt(self, layer, block, obs):
        return (block.positions >= obs.query_positions[0]).view(1, 1, -1)  # the observation window: always kept


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="snapkv", axis="evict", config=SnapKVConfig, factory=SnapKVCompressor,
        summary="SnapKV: per-head top tokens by the prompt's last-window attention, pooled (arXiv:2404.14469)",
    ))
