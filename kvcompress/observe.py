"""Observations: what a layer's attention saw in one forward call, handed to ``kvcompress_observe``.

Once per compressed layer and forward call, after the step's attention and before the step's tokens are
committed (so a flush the commit triggers sees it), a layer whose stack has a compressor implementing
:meth:`kvcompress.hookspecs.CacheCompressor.kvcompress_observe` builds an :class:`Observation`: the
step's queries (the last ``Layout.observe`` positions of a multi-token step, the query of a decode
step), the step's own keys and values, and - when a layout asks for it (``Layout.attention``) - the
attention probability *mass* every token received from the observed queries, per region of the layer.

Where the mass comes from:

* **decode steps** of the phases ``Layout.attention`` names (``True`` or ``"decode"``): from the read itself.  The
  layer reads with :func:`kvcompress.kernels.attention.attend_segments` ``(scored=True)``: every kernel also
  writes the scores it computed (the ``kvcompress::*_scored`` ops: the dense lanes kernel, the KIVI kernel - its
  Triton version, the CUDA v3 kernel has no such output - and the KIVI lanes kernel), and the mass of a token is
  ``exp(score - joint LSE)`` summed over its kv head's query heads, with the joint LSE of the merged partials.
  The extra cost is writing ``[batch, q_heads, tokens]`` float32 scores, not a second pass over the keys.  Readers
  without a score output (DoubleSparse's gather, a packed region that does not declare ``supports_scores``) read
  their segment through the reference in such steps, scores included.
* **prefills** (and decode steps of a ``"prefill"`` layout, if an observer reads the mass there):
  :func:`attention_mass`, an exact reference pass over the observed queries (one joint softmax over exactly the
  segments attention read, with the model's soft-cap, learned sink logits, masks and read-time selections applied;
  packed segments are dequantized with :meth:`~kvcompress.state.Segment.keys_values`), run on first access.  The
  prefill's own attention runs in the model's backend (SDPA, FlashAttention), which returns no scores; the pass
  covers only the last ``Layout.observe`` query positions, and past :data:`MASS_CHUNK_ELEMENTS` scores it runs over
  token chunks in two passes (log-sum-exp, then mass), so a long prompt's observation never holds all of its
  ``queries x tokens`` scores at once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from .state import Segment, TokenSelection, as_token_selection

#: the regions of :attr:`Observation.mass`, in the order a layer reads them
REGIONS = ("sinks", "middle", "recent", "new")


@dataclasses.dataclass
class Observation:
    """What one layer's attention saw in one forward call (see the module docstring).

    Attributes:
        query: ``[batch, q_heads, w, head_dim]`` observed queries, full precision, after RoPE: the last ``w``
            positions of the step (``w = min(q, Layout.observe)``; 1 when no layout sets ``observe``).
        query_positions: ``[w]`` their logical positions.
        keys, values: ``[batch, kv_heads, q, head_dim]`` the step's own keys (after RoPE) and values, full precision.
        positions: ``[q]`` the step's logical positions (shared by all rows).
        valid: ``[batch, q]`` bool, False for the step's padding tokens, or ``None`` when every token is real.
        scaling: the softmax scale the model uses.
        softcap: the model's logit soft-cap (Gemma 2), or ``None``.
        sink_logits: ``[q_heads]`` learned sink logits (gpt-oss), or ``None``.
        mass: only when a layout of the stack sets ``Layout.attention`` (else ``None``), computed on first access,
            which must happen inside ``kvcompress_observe`` (the layer changes when the step commits; an observer
            that does not read it costs nothing): a dict ``region -> [batch, kv_heads,
            slots]`` float32, the attention probability each token received from the observed queries, summed
            over the query heads of its kv head and over the observed query positions, in each region's own
            slot coordinates: ``"sinks"`` (the layer's sink slots), ``"recent"`` (the full-precision ring's
            slots), ``"middle"`` (the middle store's segment columns; regrouped lanes are scattered back to the
            full kv-head dimension, heads a lane does not cover get 0) and ``"new"`` (the step's ``q`` tokens).
            For each query head and observed position, the masses over all regions sum to 1 (less the share of
            a learned sink logit). In a static cache's decode step the step's token is read from its ring slot:
            its mass is reported under ``"new"`` and that slot's ``"recent"`` entry is 0 (a token that becomes
            a sink in that step is reported under ``"sinks"``).
        slot_positions: logical positions of each region's slots where the layer knows them (``"sinks"``
            ``[batch, slots]``, ``"recent"`` ``[slots]``, ``"new"`` ``[q]``); used by :meth:`token_mass`.
    """

    query: torch.Tensor
    query_positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    scaling: float
    softcap: float | None = None
    sink_logits: torch.Tensor | None = None
    slot_positions: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    _mass: dict[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    _mass_fn: Callable[[], dict[str, torch.Tensor]] | None = dataclasses.field(default=None, repr=False)
    _sealed: bool = dataclasses.field(default=False, repr=False)

    @property
    def mass(self) -> dict[str, torch.Tensor] | None:
        if self._mass is None and self._mass_fn is not None:
            if self._sealed:
                raise RuntimeError("Observation.mass is computed from the layer as it was read: read it inside "
                                   "kvcompress_observe (the step has committed since)")
            self._mass, self._mass_fn = self._mass_fn(), None
        return self._mass

    @property
    def has_mass(self) -> bool:
        """Whether the stack asked for the attention mass (``Layout.attention``)."""
        return self._mass is not None or self._mass_fn is not None

    def seal(self) -> None:
        """Called by the layer once every observer ran: a mass not read by then is never computed."""
        self._sealed = True

    @property
    def prefill(self) -> bool:
        """Whether the step had more than one token (a prefill or a multi-token chunk)."""
        return self.keys.shape[2] > 1

    def token_mass(self, positions: torch.Tensor) -> torch.Tensor:
        """The mass ``[batch, kv_heads, n]`` of the tokens at logical ``positions`` ``[n]`` that the step read in the
        recent ring or among its own tokens (the tokens a flush of this step can hand to the pipeline); 0 for a
        position found in neither.  Needs :attr:`mass`.  Fixed shapes, no host read (graph-safe)."""
        mass = self.mass
        if mass is None:
            raise ValueError("this observation carries no attention mass: declare Layout(attention=True)")
        new = mass["new"]
        first = self.positions[0]
        q = new.shape[-1]
        index = positions - first
        inside = (index >= 0) & (index < q)
        out = new.gather(-1, index.clamp(0, q - 1).view(1, 1, -1).expand(new.shape[0], new.shape[1], -1))
        out = out * inside.to(out.dtype)
        recent, slots = mass.get("recent"), self.slot_positions.get("recent")
        if recent is not None and slots is not None and recent.shape[-1]:
            match = (slots.view(1, -1) == positions.view(-1, 1)).to(recent.dtype)  # [n, slots]
            out = out + torch.einsum("bhs,ns->bhn", recent, match)
        return out


#: most score elements (``batch x q_heads x observed queries x tokens``) :func:`attention_mass` materialises at once;
#: past it the mass is computed in token chunks with two passes (the log-sum-exp first), so a 32k-token prefill's
#: observation at batch 8 holds ~256 MB of scores instead of several GB
MASS_CHUNK_ELEMENTS = 1 << 26


def attention_mass(query: torch.Tensor, segments: Sequence[Segment], q_positions: torch.Tensor, scale: float,
                   kv_heads: int, softcap: float | None = None,
                   sink_logits: torch.Tensor | None = None, max_elements: int | None = None) -> list[torch.Tensor]:
    """Attention probability mass per segment: ``[batch, kv_heads, tokens]`` float32 for each of ``segments``.

    One joint softmax over every segment, as :func:`kvcompress.kernels.attention.segment_attention` computes it
    (soft-cap on the scaled scores before masking, learned sink logits in the denominator, per-row validity and
    logical-position masks, read-time selections), summed over the query heads of each kv head and over the query
    positions.  A segment covering some kv heads (``heads``) reports 0 for the others.  Fixed shapes and no host
    read: it runs inside a compiled decode step.

    Past ``max_elements`` scores (default :data:`MASS_CHUNK_ELEMENTS`) the scores are never held all at once: a
    first pass over token chunks accumulates each query's log-sum-exp, a second recomputes each chunk's scores and
    sums ``exp(score - LSE)`` (the same mass, to float rounding; twice the ``q x tokens`` products, which are a
    ``w / P`` share of a prefill's attention).

    Args:
        query: ``[batch, q_heads, q_len, head_dim]``.
        segments: what attention read.
        q_positions: ``[q_len]`` logical positions of the queries.
        scale: the softmax scale.
        kv_heads: the layer's kv heads.
        softcap, sink_logits: the model's attention variants (``None``: none).
        max_elements: the chunking threshold (tests use a small one).
    """
    from kvcompress.kernels.attention.reference import segment_mask, soft_cap, to_float32

    b, hq, q_len, d = query.shape
    group = hq // kv_heads
    qg = to_float32(query).view(b, kv_heads, group, q_len, d)
    plans = []  # per segment: (queries, keys, mask or None, head spreading or None)
    for seg in segments:
        k, _ = seg.keys_values()
        heads = seg.heads
        qs = qg if heads is None else qg.index_select(1, heads)
        if seg.qmap is not None:
            qs = seg.qmap(qs)
        t = k.shape[2]
        if q_len == 1 and seg.select is None and seg.packed is None:
            # one query (decode): every stored token precedes it (its own is at its position): validity only
            if seg.valid is None:
                m = None
            elif seg.valid.dim() == 3:  # a per-head validity (adaptive per-head budgets)
                m = seg.valid[:, :, None, None, :]
            else:
                m = seg.valid.view(seg.valid.shape[0], 1, 1, 1, t)
        else:
            m = segment_mask(seg, q_positions).unsqueeze(2)  # [b|1, h|1, 1, q, t]
        if seg.packed is not None:
            m = m & seg.packed.live_valid()[:, None, None, None, :]
        select = as_token_selection(seg.select)
        if isinstance(select, TokenSelection):
            sel = select.mask(t).view(b, kv_heads, group, q_len, t)
            m = m & (sel if heads is None else sel.index_select(1, heads))
        elif select is not None:  # [b, kv_heads, q, t]
            sel = select.unsqueeze(2)
            m = m & (sel if heads is None else sel.index_select(1, heads))
        src = spread = None
        if heads is not None:  # spread the segment's heads over all kv heads (-inf elsewhere), functionally
            onehot = heads.view(-1, 1) == torch.arange(kv_heads, device=heads.device).view(1, -1)  # [n, kv_heads]
            src, spread = onehot.to(torch.int32).argmax(0), onehot.any(0).view(1, -1, 1, 1, 1)
        plans.append((qs, k, m, src, spread))  # keys in their dtype: a chunk is converted when it is scored

    def scores(plan, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        qs, k, m, src, spread = plan
        if lo is not None:
            k = k[:, :, lo:hi]
            m = None if m is None else m[..., lo:hi]
        s = soft_cap(torch.einsum("bhgqd,bhtd->bhgqt", qs, to_float32(k)) * scale, softcap)
        if m is not None:
            s = torch.where(m, s, float("-inf"))
        if src is not None:
            s = torch.where(spread, s.index_select(1, src), float("-inf"))
        return s

    sizes = [plan[1].shape[2] for plan in plans]
    total = b * hq * q_len * sum(sizes)
    limit = MASS_CHUNK_ELEMENTS if max_elements is None else max_elements
    if total <= limit:  # one pass over every score
        s = torch.cat([scores(plan) for plan in plans], dim=-1)
        if sink_logits is not None:
            sink = sink_logits.float().view(1, kv_heads, group, 1, 1).expand(b, kv_heads, group, q_len, 1)
            s = torch.cat([s, sink], dim=-1)
        top = s.amax(dim=-1, keepdim=True).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # non-finite: shift by 0
        p = torch.exp(s - top)
        denom = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(denom > 0, denom, 1.0)  # rows that see nothing: 0
        if sink_logits is not None:
            p = p[..., :-1]
        mass = p.sum(dim=(2, 3))  # [b, kv_heads, tokens]
        return list(mass.split(sizes, dim=-1))
    chunk = max(1, limit // max(1, b * hq * q_len))
    spans = [(i, lo, min(lo + chunk, n)) for i, n in enumerate(sizes) for lo in range(0, n, chunk)]
    lse = torch.full((b, kv_heads, group, q_len), float("-inf"), device=query.device)
    if sink_logits is not None:
        lse = sink_logits.float().view(1, kv_heads, group, 1).expand(b, kv_heads, group, q_len).clone()
    for i, lo, hi in spans:  # pass 1: each query's log-sum-exp over everything it read
        lse = torch.logaddexp(lse, scores(plans[i], lo, hi).logsumexp(dim=-1))
    shift = torch.where(torch.isfinite(lse), lse, float("inf")).unsqueeze(-1)  # rows that see nothing: 0
    out = [[] for _ in plans]
    for i, lo, hi in spans:  # pass 2: exp(score - LSE), summed over the query heads of a kv head and the queries
        out[i].append(torch.exp(scores(plans[i], lo, hi) - shift).sum(dim=(2, 3)))
    return [torch.cat(parts, dim=-1) if parts else torch.zeros(b, kv_heads, 0, device=query.device)
            for parts in out]


def observe_window(layout, q: int) -> int:
    """Query positions an observation keeps: ``min(q, Layout.observe)`` (1 when no layout sets it)."""
    return max(1, min(q, layout.observe or 1))


__all__ = ["MASS_CHUNK_ELEMENTS", "Observation", "REGIONS", "attention_mass", "observe_window"]
