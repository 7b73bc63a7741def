"""DoubleSparse decode-read benchmark pieces (used by ``kernels.benchutil`` and ``benchmarks/gpu_doublesparse.py``).

One sparse decode read = top-k selection from label scores (r label channels per kv head; the fused
Triton select kernel on channel-major labels, as the plugin's label cache stores them, or Triton
scores + ``torch.topk`` on token-major labels) + Triton gather attention over the selected tokens.
Inputs are random fp16 K/V of ``ctx`` tokens; labels are K on ``r`` random channels (fp16, or 4-bit
per token).
"""

from __future__ import annotations

import torch

from .reference import Labels, quantize_labels, selection_rows


def ds_inputs(batch: int, q_heads: int, kv_heads: int, ctx: int, head_dim: int, r: int, bits: int,
              device, gen=None, channel_major: bool = True, dtype=torch.float16) -> tuple:
    """``(q [B, Hq, D], labels, channels [Hkv, r], k, v)``; labels channel-major unless ``channel_major=False``;
    the query, K and V in ``dtype``."""
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=dtype, generator=gen)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    ch = torch.stack([torch.randperm(head_dim, device=device, generator=gen)[:r] for _ in range(kv_heads)])
    lab = quantize_labels(k.gather(-1, ch.view(1, kv_heads, 1, r).expand(batch, kv_heads, ctx, r)).contiguous(), bits)
    if channel_major:
        lab = Labels(lab.data.transpose(-1, -2).contiguous().transpose(-1, -2), lab.bits, lab.scale, lab.zero)
    return q, lab, ch, k, v


def label_bytes(labels: Labels) -> int:
    return sum(x.numel() * x.element_size() for x in (labels.data, labels.scale, labels.zero) if x is not None)


def ds_read_bytes(q, labels: Labels, k, kk: int, shared: bool = False) -> int:
    """Bytes one sparse read (fused select + gather) moves: labels, the gathered K/V rows, indices written and
    read; a group-shared selection reads each token once per kv head."""
    b, hq, d = q.shape
    heads = k.shape[1] if shared else hq
    return label_bytes(labels) + 2 * b * heads * kk * d * k.element_size() + 2 * 8 * b * heads * kk


def ds_decode(q, labels: Labels, channels, k, v, kk: int, scale: float, ops=None, gather_config=None,
              shared: bool = False, fused: bool | None = None):
    """One sparse decode read with the Triton kernels (``ops``: the module, default ``triton_kernel``);
    ``shared``: one selection per kv head from the group's summed query (the plugin's ``group_shared``); ``fused``:
    the select and the gather in one kernel (``ops.select_gather_partial``), ``None``: where a model's read takes it
    (``ops.fuses_gather``: ``fuse_gather`` in ``KVCOMPRESS_DS_CONFIG``, else its rule ``fuse_rule``)."""
    if ops is None:
        from . import triton_kernel as ops
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if fused is None:  # (the reference module decides nothing: two calls)
        fused = hasattr(ops, "fuses_gather") and ops.fuses_gather(q, labels, channels, k, v, kk, g if shared else 1)
    if fused:
        out, lse, _ = ops.select_gather_partial(q, labels, channels, None, k, v, kk, scale, group=g if shared else 1)
        return out, lse
    # shared, as the plugin: the select sums each kv head's G query rows as it loads them
    sel = selection_rows(ops.select_topk(q, labels, channels, None, kk, group=g if shared else 1), hkv, g)
    extra = {"config": gather_config} if gather_config else {}
    return ops.gather_partial_attention(q.view(b, hkv, hq // hkv, d), k, v, None, sel, scale, **extra)
