"""LeanK grouped decode attention: reference (pure PyTorch).

LeanK (Zhang et al., EMNLP 2025, arXiv:2508.02215) keeps, per kv head, only some
key channels of the cache middle and regroups heads with the same kept count into
one dense tensor (a *lane*).  One decode step attends every lane with the query
gathered to the lane's kept channels; the softmax scale stays the full head's
``1/sqrt(D)``.  Heads that keep no channel have no lane (no middle K and no
middle V): their rows get ``lse = -inf`` and a zero output here and are served by
the full-precision sinks and local window, merged by log-sum-exp.

A lane is ``(heads, channels, k, v, valid, basis)`` (:class:`Lane`):

* ``heads`` - LongTensor ``[h]``: the kv heads the lane holds (``None`` = every head, in order);
* ``channels`` - LongTensor ``[h, c]``: the key channels each of those heads kept
  (``None`` = all ``D`` channels, i.e. an unpruned dense region such as the sinks or the window);
* ``k`` ``[B, h, T, c]`` and ``v`` ``[B, h, T, Dv]``;
* ``valid`` - bool ``[B, T]`` (``None`` = every slot valid), or ``[B, h, T]``: a per-head validity (a middle
  store under adaptive per-head budgets, where each head of a row keeps its own tokens);
* ``basis`` - ``[h, D, c]`` (``None`` = no projection): the lane's keys are coordinates in a per-head basis (low-rank
  keys, :class:`kvcompress.LinearQueryMap`'s ``weight``), and each head's query rows are projected, ``q @ basis[h]``
  (the product in float32, kept in float32 since session 58), instead of gathered; ``channels`` is then ``None``.

Every stored token precedes the query (decode), so only ``valid`` masks keys.
A head that appears in several lanes gets the joint softmax over all of them.
The GPU kernels (``triton_kernel.py``, ``tilelang_kernel.py``) have the same signature.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch


class Lane(NamedTuple):
    heads: torch.Tensor | None
    channels: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None = None
    basis: torch.Tensor | None = None


def gather_query(query: torch.Tensor, heads: torch.Tensor | None, channels: torch.Tensor | None,
                 basis: torch.Tensor | None = None) -> torch.Tensor:
    """``query [B, Hkv, M, D]`` -> the lane's rows ``[B, h, M, c]`` (its heads, its kept channels, or its projected
    coordinates when the lane has a ``basis``: float32, not rounded to the query's dtype - one bf16 rounding of the
    projection moved a read's LSE by up to 1.1e-2, session 58; the Triton kernel keeps it as two halves)."""
    q = query if heads is None else query.index_select(1, heads)
    if basis is not None:
        return torch.einsum("bhmd,hdr->bhmr", q.float(), basis.float())
    if channels is None:
        return q
    h, c = channels.shape
    return q.gather(-1, channels.view(1, h, 1, c).expand(q.shape[0], h, q.shape[2], c))


def merge_with_lse(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials ``(out, lse)`` of disjoint key regions: the joint output and its LSE (float32)."""
    lses = torch.stack([lse.float() for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)
    total = w.sum(dim=0)
    out = sum(wi.unsqueeze(-1) * o.float() for wi, (o, _) in zip(w, parts))
    ok = total > 0
    out = out / torch.where(ok, total, torch.ones_like(total)).unsqueeze(-1)
    lse = torch.where(ok, top + torch.log(torch.where(ok, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse


def lane_logits(query: torch.Tensor, lane: Lane, scale: float, softcap: float | None = None) -> torch.Tensor:
    """The scaled (soft-capped) scores ``[B, h, M, T]`` float32 of one lane's heads, ``-inf`` on invalid slots."""
    from kvcompress.kernels.attention.reference import soft_cap

    heads, channels, k, v, valid, basis = Lane(*lane)
    q = gather_query(query, heads, channels, basis).float()
    s = soft_cap(torch.einsum("bhmd,bhtd->bhmt", q, k.float()) * scale, softcap)
    if valid is not None:
        s = s.masked_fill(~(valid[:, :, None, :] if valid.dim() == 3 else valid[:, None, None, :]), float("-inf"))
    return s


def lane_partial(query: torch.Tensor, lane: Lane, scale: float,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, h, M, Dv], lse [B, h, M])`` of one lane's heads (float32); ``softcap``: logit soft-cap."""
    return _partial_from_logits(lane_logits(query, lane, scale, softcap), lane.v)


def _partial_from_logits(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("bhmt,bhtd->bhmd", p, v.float()), lse


def grouped_partial_scored(query: torch.Tensor, lanes: Sequence[Lane | tuple], scale: float, *,
                           length: torch.Tensor | None = None, softcap: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`grouped_partial_attention` that also returns what it scored: ``(out, lse, logits)`` with ``logits[i]``
    ``[B, h_i, M, T_i]`` float32, lane ``i``'s scaled (soft-capped) scores in natural-log units, ``-inf`` on the
    slots it does not attend (invalid, or at or after ``length``).  The attention probability of a token is
    ``exp(logits - lse_joint)`` with the joint LSE of every region read (what attention-mass observers need,
    without a second pass over the keys)."""
    lanes = [Lane(*lane) for lane in lanes]
    if length is not None:
        lanes = [_bounded(lane, length) for lane in lanes]
    logits = [lane_logits(query, lane, scale, softcap) for lane in lanes]
    it = iter(logits)
    out, lse = combine_lanes(query, lanes, lambda lane: _partial_from_logits(next(it), lane.v))
    return out, lse, logits


def grouped_partial_attention(query: torch.Tensor, lanes: Sequence[Lane | tuple], scale: float, *,
                              length: torch.Tensor | None = None, softcap: float | None = None,
                              out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over LeanK lanes, unnormalised across regions.

    Args:
        query: ``[B, Hkv, M, D]`` - the ``M = group * q_len`` query rows that share each kv head,
            over the full head dimension (each lane gathers its kept channels itself).
        lanes: ``(heads, channels, k, v, valid[, basis])`` per lane (see the module docstring); at least one.
        scale: softmax scale of the full head (``1/sqrt(D)``), also for pruned keys.
        length: optional 0-dim int tensor: every lane's token slots at or after it are treated as invalid
            (the kernel does not read them).
        softcap: logit soft-cap ``softcap * tanh(s / softcap)`` of the scaled scores (``None``: none).
        out_dtype: the output's dtype (``None``: float32) - for a read whose only part this is, so that no cast
            follows it (the float32 result rounded once).

    Returns:
        ``(out [B, Hkv, M, Dv] float32, lse [B, Hkv, M] float32)``; heads no lane covers get
        ``lse = -inf`` and a zero output.  Merge with other regions by log-sum-exp
        (:func:`merge_with_lse`, :func:`kvcompress.kernels.attention.reference.merge_partials`).
    """
    if length is not None:
        lanes = [_bounded(Lane(*lane), length) for lane in lanes]
    out, lse = combine_lanes(query, lanes, lambda lane: lane_partial(query, lane, scale, softcap))
    return (out if out_dtype is None else out.to(out_dtype)), lse


def _bounded(lane: Lane, length: torch.Tensor) -> Lane:
    """``lane`` with ``valid`` restricted to the slots before ``length``."""
    b, _, t, _ = lane.k.shape
    ok = torch.arange(t, device=lane.k.device) < length.to(lane.k.device)
    return lane._replace(valid=ok.expand(b, t) if lane.valid is None else lane.valid & ok)  # (ok broadcasts)


def combine_lanes(query: torch.Tensor, lanes: Sequence[Lane | tuple],
                  lane_fn: Callable[[Lane], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-lane partials (``lane_fn(lane)`` over the lane's heads) scattered to every kv head and
    merged by log-sum-exp; heads no lane covers get ``lse = -inf`` and zeros.  Shared by the
    reference and the TileLang kernel (which differ only in how one lane is computed)."""
    lanes = [Lane(*lane) for lane in lanes]
    if not lanes:
        raise ValueError("grouped_partial_attention needs at least one lane")
    b, hkv, m, _ = query.shape
    dv = lanes[0].v.shape[-1]
    parts = []
    for lane in lanes:
        out, lse = lane_fn(lane)
        if lane.heads is not None:
            full_out = out.new_zeros(b, hkv, m, dv)
            full_lse = lse.new_full((b, hkv, m), float("-inf"))
            full_out.index_copy_(1, lane.heads, out)
            full_lse.index_copy_(1, lane.heads, lse)
            out, lse = full_out, full_lse
        parts.append((out, lse))
    return parts[0] if len(parts) == 1 else merge_with_lse(parts)
