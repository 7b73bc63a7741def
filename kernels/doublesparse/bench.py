"""DoubleSparse decode-read benchmark pieces (used by ``kernels.benchutil`` and ``benchmarks/gpu_doublesparse.py``).

One sparse decode read = Triton label scores (r label channels per kv head) + ``torch.topk`` (k per
query head) + Triton gather attention over the selected tokens.  Inputs are random fp16 K/V of
``ctx`` tokens; labels are K on ``r`` random channels (fp16, or 4-bit per token).
"""

from __future__ import annotations

import torch

from .reference import Labels, quantize_labels


def ds_inputs(batch: int, q_heads: int, kv_heads: int, ctx: int, head_dim: int, r: int, bits: int,
              device, gen=None) -> tuple:
    """``(q [B, Hq, D], labels, channels [Hkv, r], k, v)``."""
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.float16, generator=gen)
    v = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.float16, generator=gen)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=torch.float16, generator=gen)
    ch = torch.stack([torch.randperm(head_dim, device=device, generator=gen)[:r] for _ in range(kv_heads)])
    lab = quantize_labels(k.gather(-1, ch.view(1, kv_heads, 1, r).expand(batch, kv_heads, ctx, r)).contiguous(), bits)
    return q, lab, ch, k, v


def label_bytes(labels: Labels) -> int:
    return sum(x.numel() * x.element_size() for x in (labels.data, labels.scale, labels.zero) if x is not None)


def ds_read_bytes(q, labels: Labels, k, kk: int) -> int:
    """Bytes one sparse read moves: labels, the gathered K/V rows, fp32 scores written and read, indices."""
    b, hq, d = q.shape
    t = k.shape[2]
    return label_bytes(labels) + 2 * b * hq * kk * d * k.element_size() + 2 * 4 * b * hq * t + 8 * b * hq * kk


def ds_decode(q, labels: Labels, channels, k, v, kk: int, scale: float, ops=None):
    """One sparse decode read with the Triton kernels (``ops``: the module, default ``triton_kernel``)."""
    if ops is None:
        from . import triton_kernel as ops
    b, hq, d = q.shape
    hkv = k.shape[1]
    sel = ops.select_topk(q, labels, channels, None, kk).view(b, hkv, hq // hkv, kk)
    return ops.gather_partial_attention(q.view(b, hkv, hq // hkv, d), k, v, None, sel, scale)
