"""The calibrated |q.k| baseline: rank K channels by their mean contribution to attention scores.

DoubleSparse-style offline calibration (arXiv 2408.07092): for every layer, KV head and post-RoPE
channel ``c``, the score is the mean over causal (query, key) pairs of calibration text of
``|q_c * k_c|``, summed over the query heads that share the KV head.  The mask keeps the top
channels with the same rules as a trained mask (:func:`~kvcompress.calibration.masks.binarize`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..adapters import hf
from .attention import ScaledKeys, check_calibratable, compressed_layers, scaled_keys
from .masks import binarize, geometry


class _QKStats:
    def __init__(self, shape: tuple[int, int, int]):
        self.sums = torch.zeros(shape, dtype=torch.float64)
        self.pairs = 0

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        q = query.detach().float().abs()                   # [B, Hq, q, d]
        k = key.detach().float().abs()                     # [B, Hkv, kv, d]
        b, hq, q_len, d = q.shape
        hkv, kv_len = k.shape[1], k.shape[2]
        cum = k.cumsum(2)[:, :, kv_len - q_len:]           # sum of |k_j| over j <= t, per query t
        cum = cum.repeat_interleave(hq // hkv, dim=1)
        total = (q * cum).sum((0, 2)).view(hkv, hq // hkv, d).sum(1)
        self.sums[layer] += total.double()
        if layer == 0:
            self.pairs += b * sum(range(kv_len - q_len + 1, kv_len + 1))


@torch.no_grad()
def qk_scores(model: Any, tokens: Iterable[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Mean ``|q_c k_c|`` per (layer, KV head, channel) over causal pairs of ``tokens``.

    Args:
        model: a transformers causal LM whose layers are all full attention.
        tokens: LongTensor ``[n, length]`` or an iterable of ``[1, length]`` / ``[length]`` tensors.

    Returns:
        float32 ``[layers, kv_heads, head_dim]``.
    """
    check_calibratable(model)
    stats = _QKStats(geometry(model.config))
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
        tokens = list(tokens.split(1))
    with scaled_keys(model, ScaledKeys(observer=stats)):
        for ids in tokens:
            ids = torch.as_tensor(ids).reshape(1, -1)
            hf.final_hidden_states(model, ids)
    return (stats.sums / max(1, stats.pairs)).float()


def qk_mask(model: Any, tokens: Iterable[torch.Tensor] | torch.Tensor, ratio: float, align: int) -> torch.Tensor:
    """Keep mask from :func:`qk_scores`, binarized like a trained mask (global threshold, align; a hybrid's
    sliding-window layers keep everything)."""
    return binarize(qk_scores(model, tokens), ratio, align, compressed_layers(model))
