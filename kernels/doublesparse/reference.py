"""DoubleSparse read-time ops in PyTorch: label quantization, label scores + top-k, gather attention.

DoubleSparse (Yang et al., arXiv 2408.07092) scores every cached token from a few *label*
channels of its post-RoPE key, keeps the top-k tokens per query head and attends exactly to
them.  These functions are the CPU path, the oracle of the Triton kernels
(:mod:`.triton_kernel`, same signatures) and the benchmark baseline.

Shapes (``Hkv`` kv heads, ``G`` query heads per kv head, ``r`` label channels):

* label cache :class:`Labels`: ``bits == 16``: ``data [B, Hkv, T, r]`` in the key dtype;
  ``bits in (4, 2)``: ``data`` uint8 codes packed per token ``[B, Hkv, T, r*bits/8]`` (the code of
  channel ``c`` sits in byte ``c % nb`` at bit ``bits * (c // nb)``, ``nb = r*bits/8``) and
  ``scale``/``zero`` fp16 ``[B, Hkv, T]`` (asymmetric min-max per token and head);
* ``channels`` int64 ``[Hkv, r]``: the label channels of each kv head (the query is gathered to them);
* ``valid`` bool ``[B, T]`` or ``None``; invalid tokens score ``-inf`` and are never read.
"""

from __future__ import annotations

import dataclasses

import torch

LABEL_BITS = (16, 4, 2)


@dataclasses.dataclass
class Labels:
    """A label cache view: ``data`` (+ ``scale``/``zero`` when quantized), ``bits`` in (16, 4, 2)."""

    data: torch.Tensor
    bits: int = 16
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.data.shape[2]

    def narrow(self, start: int, length: int) -> "Labels":
        cut = (lambda t: None if t is None else t.narrow(2, start, length))
        return Labels(cut(self.data), self.bits, cut(self.scale), cut(self.zero))


def quantize_labels(x: torch.Tensor, bits: int) -> Labels:
    """Per-token asymmetric min-max quantization of labels ``x [B, H, T, r]`` (``r * bits`` divisible by 8)."""
    if bits == 16:
        return Labels(x, 16)
    if bits not in LABEL_BITS:
        raise ValueError(f"label bits must be one of {LABEL_BITS}, got {bits}")
    r = x.shape[-1]
    per = 8 // bits
    if r % per:
        raise ValueError(f"{r} label channels do not pack into bytes at {bits} bits (need a multiple of {per})")
    xf = x.float()
    lo, hi = xf.amin(-1), xf.amax(-1)
    scale = ((hi - lo) / (2 ** bits - 1)).half()
    zero = lo.half()
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.clamp(torch.round((xf - zero.float()[..., None]) / s[..., None]), 0, 2 ** bits - 1).to(torch.uint8)
    nb = r // per
    packed = torch.zeros(*x.shape[:-1], nb, dtype=torch.uint8, device=x.device)
    for j in range(per):
        packed |= codes[..., j * nb:(j + 1) * nb] << (bits * j)
    return Labels(packed, bits, scale, zero)


def dequantize_labels(labels: Labels) -> torch.Tensor:
    """Labels as float32 ``[B, H, T, r]``."""
    if labels.bits == 16:
        return labels.data.float()
    per, mask = 8 // labels.bits, 2 ** labels.bits - 1
    parts = [((labels.data >> (labels.bits * j)) & mask) for j in range(per)]
    codes = torch.cat(parts, dim=-1).float()
    s = labels.scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return codes * s[..., None] + labels.zero.float()[..., None]


def label_scores(query: torch.Tensor, labels: Labels, channels: torch.Tensor,
                 valid: torch.Tensor | None) -> torch.Tensor:
    """Approximate scores ``q[channels] . label`` for every token and query head.

    Args:
        query: ``[B, Hq, D]`` (one decode position).
        labels: label cache of ``T`` tokens.
        channels: ``[Hkv, r]`` label channels per kv head.
        valid: ``[B, T]`` or ``None``.

    Returns:
        float32 ``[B, Hq, T]``, ``-inf`` on invalid tokens.
    """
    b, hq, d = query.shape
    hkv, r = channels.shape
    g = hq // hkv
    qg = query.float().view(b, hkv, g, d).gather(-1, channels.view(1, hkv, 1, r).expand(b, hkv, g, r))
    s = torch.einsum("bhgr,bhtr->bhgt", qg, dequantize_labels(labels)).reshape(b, hq, -1)
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return s


def group_query(query: torch.Tensor, group: int) -> torch.Tensor:
    """``query [B, Hq, D]`` with each run of ``group`` consecutive heads summed (fp32 accumulation; fp32 out unless
    ``group`` is 1, then ``query`` itself): ``[B, Hq / group, D]``.  Label scores are linear in the query, so a row of
    the result scores the sum of its heads' scores - one group-shared selection per kv head when ``group`` = G."""
    if group == 1:
        return query
    b, hq, d = query.shape
    if group < 1 or hq % group:
        raise ValueError(f"group must divide the {hq} query heads, got {group}")
    return query.reshape(b, hq // group, group, d).sum(2, dtype=torch.float32)


def select_topk(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                k: int, group: int = 1) -> torch.Tensor:
    """Indices ``[B, Hq / group, k]`` (int64, unordered) of the ``k`` best-scoring tokens per query head, or per
    ``group`` consecutive query heads scored together (:func:`group_query`: their summed scores).

    ``k`` must be at most the number of tokens; rows with fewer than ``k`` valid tokens also get
    invalid ones (their score is ``-inf``; attention masks them).
    """
    scores = label_scores(group_query(query, group), labels, channels, valid)
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def is_topk(index: torch.Tensor, scores: torch.Tensor, k: int, tol: float) -> bool:
    """Whether ``index [..., k]`` is a top-``k`` of ``scores [..., T]``: ``k`` distinct tokens, every token scoring
    more than ``tol`` above the k-th best score chosen, none more than ``tol`` below it (ties and near-ties at the
    k-th score may go either way; with fewer than ``k`` finite scores every finite one is chosen).  The check the
    tests and the GPU benchmark apply to any selection kernel, since tie-breaking is not specified."""
    if index.shape[-1] != k or bool((index.sort(-1).values.diff(dim=-1) == 0).any()):
        return False
    kth = scores.topk(k, dim=-1).values[..., -1:]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True)
    finite_kth = torch.isfinite(kth)
    must = torch.where(finite_kth, scores > kth + tol, torch.isfinite(scores))
    may = torch.where(finite_kth, scores >= kth - tol, torch.ones_like(chosen))
    return bool((chosen | ~must).all() and (~chosen | may).all())


def gather_partial_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                             index: torch.Tensor, scale: float,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of every query row over its own selected tokens, as a mergeable partial.

    Args:
        query: ``[B, Hkv, M, D]`` grouped query rows (``M = G * q_len``, row ``g * q_len + i``).
        k, v: ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]``.
        valid: ``[B, T]`` or ``None``.
        index: ``[B, Hkv, M, K]`` token indices per row (duplicates are not allowed).
        scale: softmax scale.
        softcap: logit soft-cap of the scaled scores (``None`` or 0: none).

    Returns:
        ``(out [B, Hkv, M, Dv] float32, lse [B, Hkv, M] float32)``; a row without a valid selected
        token gets ``lse = -inf`` and zeros.
    """
    b, h, m, kk = index.shape
    flat = index.reshape(b, h, m * kk, 1)
    ks = k.gather(2, flat.expand(b, h, m * kk, k.shape[-1])).view(b, h, m, kk, -1).float()
    vs = v.gather(2, flat.expand(b, h, m * kk, v.shape[-1])).view(b, h, m, kk, -1).float()
    from kvcompress.kernels.attention.reference import soft_cap

    s = soft_cap(torch.einsum("bhmd,bhmkd->bhmk", query.float(), ks) * scale, softcap)
    if valid is not None:
        ok = valid.gather(1, index.reshape(b, -1)).view(b, h, m, kk)
        s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("bhmk,bhmkd->bhmd", p, vs), lse


def selection_rows(index: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """:func:`select_topk`'s ``index [B, rows, k]`` as the gather's indices ``[B, kv_heads, group, k]`` for the
    ``group`` query rows of each kv head: one selection per query head (``rows = kv_heads * group``), or one per kv
    head (``rows = kv_heads``) repeated for its query rows as a stride-0 view (read once per group)."""
    b, rows, k = index.shape
    if rows == kv_heads:
        return index.view(b, kv_heads, 1, k).expand(b, kv_heads, group, k)
    return index.view(b, kv_heads, group, k)


def select_gather_partial(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                          k: torch.Tensor, v: torch.Tensor, kk: int, scale: float, group: int = 1,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`select_topk` then :func:`gather_partial_attention` over what it selected, as one call.

    ``query [B, Hq, D]``; ``k`` / ``v`` ``[B, Hkv, T, D / Dv]``; ``kk`` tokens per selection; ``group`` 1: one
    selection per query head, ``Hq / Hkv``: one per kv head from its heads' summed query (group-shared).  Returns
    ``(out [B, Hkv, G, Dv], lse [B, Hkv, G], index [B, Hq / group, kk])`` (``G = Hq / Hkv``; ``index`` as
    :func:`select_topk` returns it)."""
    b, hq, d = query.shape
    hkv = k.shape[1]
    g = hq // hkv
    if group not in (1, g):
        raise ValueError(f"select_gather_partial: group must be 1 (a selection per query head) or {g} (one per kv "
                         f"head), got {group}")
    index = select_topk(query, labels, channels, valid, kk, group)
    out, lse = gather_partial_attention(query.view(b, hkv, g, d), k, v, valid, selection_rows(index, hkv, g), scale,
                                        softcap)
    return out, lse, index


def selection_mask(index: torch.Tensor, tokens: int) -> torch.Tensor:
    """Boolean ``[..., tokens]`` mask with True at ``index [..., K]``."""
    mask = torch.zeros(*index.shape[:-1], tokens, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, index, True)
