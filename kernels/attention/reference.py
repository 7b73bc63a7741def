"""Reference attention over compressed-cache segments (pure PyTorch).

This is the CPU implementation used by the registered attention of kvcompress
and the oracle GPU kernels are tested against.  It computes exactly::

    softmax(cap(scale * [qmap_s(q) . K_s^T for each segment s]), masked, [sink]) . [V_s]

with one joint softmax across segments, in float32.  A key of a segment is
visible to a query when its row (or, for a segment with a per-head validity
``[batch, heads, tokens]``, its row and head) is valid and its logical position is not
after the query's position; kv heads a segment does not cover see ``-inf``.
Fully masked query rows return zeros (never NaN).

Two attention variants of some model families (what their eager attention computes):

* **logit soft-capping** (Gemma 2, ``softcap``): ``cap(s) = softcap * tanh(s / softcap)`` on the scaled
  scores, before masking; every partial applies it to its own scores.
* **learned attention sinks** (gpt-oss, ``sink_logits``: one logit per query head): an extra logit that joins
  the softmax denominator and contributes no value.  It belongs to the joint softmax, so partials never
  see it: :func:`merge_partials` adds it exactly once, to the merged denominator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvcompress.state import Segment, TokenSelection, as_token_selection, head_mask


def segment_mask(seg: Segment, q_positions: torch.Tensor | None) -> torch.Tensor:
    """Boolean visibility ``[batch or 1, heads or 1, q_len, tokens]`` of one segment (``heads``: the segment's own
    heads, when its validity is per head).  ``q_positions`` ``None``: one query position at or after every stored
    token (a decode step's), so only validity masks (``q_len`` 1)."""
    if q_positions is None:
        if seg.valid is None:
            return torch.ones(1, 1, 1, seg.num_tokens, dtype=torch.bool, device=seg.positions.device)
        return head_mask(seg.valid).unsqueeze(2)
    pos = seg.positions if seg.positions.dim() == 2 else seg.positions.unsqueeze(0)
    mask = (pos.unsqueeze(1) <= q_positions.view(1, -1, 1)).unsqueeze(1)  # [b|1, 1, q, t]
    if seg.valid is not None:
        mask = mask & head_mask(seg.valid).unsqueeze(2)
    return mask


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit soft-capping); ``scores`` unchanged for ``None``."""
    if not softcap:
        return scores
    return torch.tanh(scores / softcap) * softcap


def sink_rows(sink_logits: torch.Tensor, kv_heads: int, q_len: int) -> torch.Tensor:
    """Per-query-head sink logits ``[q_heads]`` as float32 ``[1, kv_heads, group * q_len]``: the grouped query rows
    of the partials (row ``g * q_len + i`` is query head ``h * group + g`` at position ``i``)."""
    group = sink_logits.shape[0] // kv_heads
    rows = sink_logits.float().view(1, kv_heads, group, 1).expand(1, kv_heads, group, q_len)
    return rows.reshape(1, kv_heads, group * q_len)


def segment_attention(
    query: torch.Tensor,
    segments: Sequence[Segment],
    q_positions: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over ``segments``.

    Args:
        query: ``[batch, q_heads, q_len, head_dim]``.
        segments: regions to read; kv heads = ``q_heads / group``.
        q_positions: ``[q_len]`` logical positions of the queries.
        scale: softmax scale (``1/sqrt(head_dim)`` of the full head, also for pruned keys).
        softcap: logit soft-cap applied to the scaled scores (``None``: none).
        sink_logits: ``[q_heads]`` learned sink logits joining each query head's softmax denominator (``None``: none).

    Returns:
        ``[batch, q_heads, q_len, v_dim]`` in the query's dtype.
    """
    b, hq, q_len, d = query.shape
    kvs = [seg.keys_values() for seg in segments]  # packed segments are decoded here, transiently
    kvs = [(k, v if seg.vmap is None else seg.vmap(v)) for seg, (k, v) in zip(segments, kvs)]  # value coordinates
    kv_heads = next(kv[0].shape[1] for kv, s in zip(kvs, segments) if s.heads is None) if any(
        s.heads is None for s in segments) else None
    if kv_heads is None:
        kv_heads = max(int(s.heads.max()) + 1 for s in segments)
    group = hq // kv_heads
    qg = query.float().view(b, kv_heads, group, q_len, d)
    scores = []
    for seg, (seg_k, _) in zip(segments, kvs):
        heads = seg.heads
        qs = qg if heads is None else qg.index_select(1, heads)
        if seg.qmap is not None:
            qs = seg.qmap(qs)
        s = soft_cap(torch.einsum("bhgqd,bhtd->bhgqt", qs, seg_k.float()) * scale, softcap)
        t = s.shape[-1]
        m = segment_mask(seg, q_positions).unsqueeze(2)  # [b|1, h_seg|1, 1, q, t] over the segment's heads
        select = as_token_selection(seg.select)
        if isinstance(select, TokenSelection):  # per query head: [b, hq, q, t] -> [b, h, g, q, t]
            sel = select.mask(t).view(b, kv_heads, group, q_len, t)
            m = m & (sel if heads is None else sel.index_select(1, heads))
        elif select is not None:  # per kv head: [b, h, q, t] -> [b, h, 1, q, t]
            sel = select.unsqueeze(2)
            m = m & (sel if heads is None else sel.index_select(1, heads))
        s = s.masked_fill(~m, float("-inf"))
        if heads is not None:
            full = s.new_full((b, kv_heads, group, q_len, t), float("-inf"))
            full[:, heads] = s
            s = full
        scores.append(s)
    s = torch.cat(scores, dim=-1)
    if sink_logits is not None:  # one more logit per query head: in the denominator, with no value
        sink = sink_logits.float().view(1, kv_heads, group, 1, 1).expand(b, kv_heads, group, q_len, 1)
        s = torch.cat([s, sink], dim=-1)
    mx = s.amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    denom = p.sum(dim=-1, keepdim=True)
    if sink_logits is not None:
        p = p[..., :-1]
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    dv = max(v.shape[-1] for _, v in kvs)
    out = qg.new_zeros(b, kv_heads, group, q_len, dv)
    start = 0
    for seg, (seg_k, seg_v) in zip(segments, kvs):
        t = seg_k.shape[-2]
        ps = p[..., start:start + t]
        start += t
        if seg.heads is None:
            out = out + torch.einsum("bhgqt,bhtd->bhgqd", ps, seg_v.float())
        else:
            part = torch.einsum("bhgqt,bhtd->bhgqd", ps.index_select(1, seg.heads), seg_v.float())
            out.index_add_(1, seg.heads, part)
    return out.view(b, hq, q_len, dv).to(query.dtype)


def partial_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one full-precision region, returned as a mergeable partial.

    Args:
        query: ``[B, Hkv, M, D]`` grouped query rows.
        k, v: ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]``.
        mask: boolean, broadcastable to ``[B, Hkv, M, T]`` (True = visible), or ``None``.
        scale: softmax scale.
        softcap: logit soft-cap of the scaled scores (``None``: none).

    Returns:
        ``(out [B, Hkv, M, Dv] float32, lse [B, Hkv, M] float32)``; rows with no visible key get
        ``lse = -inf`` and a zero output.
    """
    k, v = to_float32(k), to_float32(v)
    step = rows_per_chunk(query.shape[0], query.shape[1], query.shape[2], k.shape[2])
    if step < query.shape[2]:  # many query rows (a prefill chunk over a long cache): bound the score tensor
        outs, lses = [], []
        for m0 in range(0, query.shape[2], step):
            n = min(step, query.shape[2] - m0)
            rows = mask if mask is None or mask.dim() < 2 or mask.shape[-2] == 1 else mask.narrow(-2, m0, n)
            o, l = partial_attention(query[:, :, m0:m0 + step], k, v, rows, scale, softcap)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, 2), torch.cat(lses, 2)
    out, lse, _ = partial_scored(query, k, v, mask, scale, softcap)
    return out, lse


def partial_scored(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`partial_attention` that also returns its scores: ``(out, lse, logits [B, Hkv, M, T] float32)``, the
    scaled (soft-capped) scores in natural-log units, ``-inf`` where ``mask`` hides a key.  For decode-sized query
    rows (the scores are materialized whole)."""
    s = soft_cap(torch.einsum("bhmd,bhtd->bhmt", to_float32(query), to_float32(k)) * scale, softcap)
    if mask is not None:
        s = torch.where(mask, s, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # rows without a visible key (lse = -inf) are shifted by 0: exp(-inf) = 0, a zero output
    p = torch.exp(s - lse.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1))
    return torch.einsum("bhmt,bhtd->bhmd", p, to_float32(v)), lse, s


def merged_lse(lses: Sequence[torch.Tensor], sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The joint log-sum-exp of partials' ``lse`` (``[B, Hkv, M]`` each) and, when given, the learned sink logits
    (:func:`sink_rows`): the denominator of the joint softmax that :func:`merge_partials` computes.  ``-inf`` for
    rows that see nothing."""
    stacked = torch.stack(list(lses))
    if sink_logits is not None:
        stacked = torch.cat([stacked, sink_logits.expand_as(stacked[0]).unsqueeze(0)])
    return torch.logsumexp(stacked, dim=0)


def to_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 (itself when it already is: no op dispatched)."""
    return t if t.dtype == torch.float32 else t.float()


#: most float32 scores a reference partial materializes at once (1 GiB); more query rows are read in chunks
SCORE_ELEMENTS = 1 << 28


def rows_per_chunk(batch: int, heads: int, rows: int, tokens: int) -> int:
    """Query rows per chunk so that a ``[batch, heads, rows, tokens]`` score tensor stays within
    :data:`SCORE_ELEMENTS` (all ``rows`` when it fits; at least one).  Shapes only: fixed in a compiled step."""
    per_row = max(1, batch * heads * tokens)
    return max(1, min(rows, SCORE_ELEMENTS // per_row))


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Combine ``(out, lse)`` partials of disjoint key regions into the joint softmax output (float32).

    ``sink_logits``: learned sink logits broadcastable to the partials' ``lse`` (``[1, Hkv, M]``, :func:`sink_rows`):
    one more term of the joint denominator, with no value - added here once, whatever the number of partials.
    """
    if len(parts) == 1 and sink_logits is None:
        return parts[0][0]  # an empty region's output is already zero
    lses = torch.stack([lse for _, lse in parts])  # [R, ...]
    top = lses.amax(dim=0)
    if sink_logits is not None:
        top = torch.maximum(top, sink_logits)
    top = top.nan_to_num(neginf=0.0)  # rows where every region is empty: any finite shift
    weights = torch.exp(lses - top)  # exp(-inf) = 0 for empty regions
    out = (weights.unsqueeze(-1) * torch.stack([o for o, _ in parts])).sum(dim=0)
    total = weights.sum(dim=0)
    if sink_logits is not None:
        total = total + torch.exp(sink_logits - top)
    # the largest weight of a row with a visible key (or a sink) is exp(0) = 1, so total >= 1 there; rows with
    # none have total = 0 and out = 0, which clamp_min(1) leaves at 0
    return out / total.clamp_min(1.0).unsqueeze(-1)
