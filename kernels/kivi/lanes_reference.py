"""KIVI lanes: several packed KIVI regions over the same token slots, read as ONE region (PyTorch reference).

A stacked LeanK + KIVI layer (prune -> regroup -> quantize) stores its middle as *lanes*: heads with the same
kept key-channel count are regrouped into one dense tensor, which KIVI quantizes on its own (keys per channel,
values per token).  Every lane covers the same token slots (one ring, one ``valid`` mask) but different kv heads
and different kept channels.  :class:`PackedLanes` holds all of them, so attention reads the whole quantized
middle of a layer with one op (``kvcompress::kivi_lanes_partial``; on CUDA one Triton launch plus one small
merge, :mod:`.lanes_triton`) instead of one KIVI launch, a query gather and a scatter per lane.

A lane is a :class:`KiviLane`:

* ``heads`` - LongTensor ``[h]``: the region's heads the lane holds (``None`` = all ``num_heads`` heads, in order);
* ``channels`` - LongTensor ``[h, c]``: the query channels each of those heads' keys kept (``None`` = all ``D``);
* the lane's packed KIVI payload (layout of :mod:`.reference`): ``k_codes [B, h, NG, ceil(c/PER), G]``,
  ``k_scale`` / ``k_zero`` ``[B, h, NG, c]``, ``v_codes [B, h, NG*G, Dv/PER]``, ``v_scale`` / ``v_zero``
  ``[B, h, NG*G, Dv/Gv]``.

Semantics (:func:`kivi_lanes_attention_partial`): the query rows of each lane's heads, gathered to the lane's kept
channels, attend over the lane's dequantized keys and values with the full head's softmax ``scale``; only
``valid`` (and ``length``) masks keys (decode: every stored token precedes the query).  A head in several lanes
gets the joint softmax over all of them; a head no lane covers gets ``lse = -inf`` and a zero output.  Outputs
``(out [B, H, M, Dv] fp32, lse [B, H, M] fp32)``, merged with other regions by log-sum-exp like every partial.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple, Sequence

import torch

from .reference import PackedKV, dequantize_keys, dequantize_values
from .reference import kivi_attention_partial as _packed_partial

PAYLOAD = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


class KiviLane(NamedTuple):
    heads: torch.Tensor | None
    channels: torch.Tensor | None
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    def packed(self, bits: int, group: int, valid: torch.Tensor) -> PackedKV:
        """This lane's payload as a :class:`~.reference.PackedKV` (no copy)."""
        return PackedKV(bits, group, self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                        self.v_zero, valid)


@dataclasses.dataclass(eq=False)
class PackedLanes:
    """The quantized lanes of one layer's middle, read as one region (``Segment.packed``).

    ``num_heads``: the heads of the region (the query's dim 1 when it is read; lanes' ``heads`` index them);
    ``head_dim``: the query width the lanes' ``channels`` index.  ``impl``: the ``kvcompress::kivi_lanes_partial``
    implementation, chosen once when the store was built (:func:`kvcompress.kernels.ops.choose`; ``None``: decided
    per call).  ``length``: optional 0-dim int device tensor, the leading token slots that may be live (see
    :class:`~.reference.PackedKV`).

    Read in place by :meth:`attention_partial`.  :meth:`dequantize` (the fallback readers: selections, attention-mass
    observers, the joint-softmax oracle) spreads each lane's kept channels back into ``D``-wide keys (zeros on the
    pruned channels, which leaves every score unchanged) and needs lanes that cover each head at most once (what the
    stores build); a head no lane covers gets zero keys and values there, so a segment over this region masks it
    with a per-head validity (``Segment.valid`` ``[B, H, T]``, :class:`kvcompress.plugins.kivi.MergedLanes`).
    """

    bits: int
    group: int
    lanes: tuple[KiviLane, ...]
    valid: torch.Tensor
    num_heads: int
    head_dim: int
    impl: str | None = None
    length: torch.Tensor | None = None

    #: :meth:`attention_partial` takes ``softcap=`` (every implementation applies it)
    supports_softcap = True
    #: :meth:`attention_scored` returns the scores the read computed (attention-mass observers use them)
    supports_scores = True
    #: every reader (reference, Triton, CUDA) gives heads no lane covers ``lse = -inf``: a segment's per-head validity
    #: ``valid & covered`` (:class:`kvcompress.plugins.kivi.MergedLanes`) masks nothing more for them
    masks_uncovered_heads = True
    #: :meth:`attention_partial_with_buffer` takes ``out_dtype=`` (the joint output in the read's dtype)
    buffer_out_dtype = True
    k_per_token = False

    @property
    def num_tokens(self) -> int:
        return self.valid.shape[-1]

    @property
    def v_dim(self) -> int:
        return self.lanes[0].v_codes.shape[-1] * (32 // self.bits)

    @property
    def v_group(self) -> int:
        return self.v_dim // self.lanes[0].v_scale.shape[-1]

    @property
    def k_codes(self) -> torch.Tensor:
        """Not codes: a view shaped ``[B, num_heads, ...]`` (no copy) for readers that count a packed region's heads
        from ``k_codes.shape[1]`` (``kvcompress.kernels.attention.partials``).  The lanes hold the codes."""
        s = self.lanes[0].k_scale
        return s[:, :1].expand(s.shape[0], self.num_heads, *s.shape[2:])

    def live_valid(self) -> torch.Tensor:
        """``valid`` restricted to the slots before ``length`` (``valid`` itself without a length)."""
        if self.length is None:
            return self.valid
        t = self.valid.shape[-1]
        return self.valid & (torch.arange(t, device=self.valid.device) < self.length.to(self.valid.device))

    def with_length(self, length: torch.Tensor | None) -> "PackedLanes":
        """The same region with another ``length`` (no copy of any tensor)."""
        return PackedLanes(self.bits, self.group, self.lanes, self.valid, self.num_heads, self.head_dim, self.impl,
                           length)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, H, T, D]`` (kept channels in place, zeros elsewhere) and values ``[B, H, T, Dv]``, float32."""
        b, t = self.valid.shape
        k = torch.zeros(b, self.num_heads, t, self.head_dim, device=self.valid.device)
        v = torch.zeros(b, self.num_heads, t, self.v_dim, device=self.valid.device)
        for lane in self.lanes:
            kl = dequantize_keys(lane.k_codes, lane.k_scale, lane.k_zero, self.bits)
            vl = dequantize_values(lane.v_codes, lane.v_scale, lane.v_zero, self.bits)
            h, c = kl.shape[1], kl.shape[-1]
            heads = torch.arange(h, device=kl.device) if lane.heads is None else lane.heads
            if lane.channels is not None:
                full = kl.new_zeros(b, h, t, self.head_dim)
                full.scatter_(-1, lane.channels.view(1, h, 1, c).expand(b, h, t, c), kl)
                kl = full
            k.index_copy_(1, heads, kl)
            v.index_copy_(1, heads, vl)
        return k, v

    def attention_partial(self, query: torch.Tensor, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``query [B, H, M, D]`` over every lane: through the registered op with the chosen
        ``impl`` when it is set, else decided per call (:func:`kvcompress.kernels.kivi.lanes_attention_partial`)."""
        if self.impl is not None:
            from kvcompress.kernels import ops

            return ops.kivi_lanes_attention(query, self, scale, impl=self.impl, softcap=softcap)
        from . import lanes_attention_partial

        return lanes_attention_partial(query, self, scale, softcap=softcap)

    def attention_partial_with_buffer(self, query: torch.Tensor, scale: float, k: torch.Tensor, v: torch.Tensor,
                                      valid: torch.Tensor, length: torch.Tensor | None = None,
                                      softcap: float | None = None, out_dtype: torch.dtype | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(out, lse)`` over every lane and a full-precision buffer ``k`` / ``v`` ``[B, H, T, D / Dv]`` (every head,
        all query channels; validity ``valid [B, T]``, ``length`` bounding its slots) in ONE launch - the CUDA lanes
        kernel's buffer CTAs (registered op ``kvcompress::kivi_lanes_buffer_partial``), or, with the launch setting
        ``buffer_lanes``, the Triton lanes kernel beside it into the same split combine - or ``None`` when the region's
        implementation cannot (not ``"cuda"``, or shapes / dtypes it does not take) or should not (a read large
        enough that the two regions apart are faster, by the plain kernel's rule: :func:`.cuda_kernel.buffer_read`);
        the caller then reads the two apart.  Decided from shapes only.  ``out_dtype``: ``out``'s dtype (``None``:
        float32), stored by the split combine."""
        if self.impl != "cuda":
            return None
        from . import cuda_kernel, lanes_cuda

        if lanes_cuda.buffer_problem(query, self, k, v, valid, region_checked=True) is not None:  # shapes only
            return None
        how = cuda_kernel.buffer_read(self.bits, *query.shape[:3], self.num_tokens, k.shape[2])
        if how is None or (how == "lanes" and not cuda_kernel.buffer_lanes_ok(query, k, v, valid)):
            return None
        from kvcompress.kernels import ops

        return ops.kivi_lanes_buffer_attention(query, self, scale, k, v, valid, length, impl=self.impl,
                                               softcap=softcap, out_dtype=out_dtype)

    def attention_scored(self, query: torch.Tensor, scale: float, softcap: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`attention_partial` that also returns its scores as ``[B, H, M, T]`` (natural-log units; ``-inf`` on
        slots not attended and on heads no lane covers; a head in two lanes gets ``logaddexp`` of their scores, so
        ``exp(score - lse)`` is still the slot's probability): through ``kvcompress::kivi_lanes_partial_scored`` with the
        region's ``impl``, without one the reference."""
        if self.impl is not None:
            from kvcompress.kernels import ops

            out, lse, logits = ops.kivi_lanes_attention_scored(query, self, scale, impl=self.impl, softcap=softcap)
        else:
            out, lse, logits = kivi_lanes_attention_scored(query, self, scale, softcap=softcap)
        b, hkv, m, _ = query.shape
        full = None
        for lane, s in zip(self.lanes, logits):
            if lane.heads is not None:
                s = s.new_full((b, hkv, m, s.shape[-1]), float("-inf")).index_copy(1, lane.heads, s)
            # a slot's probability is exp(score - lse): two lanes holding one head add theirs (logaddexp)
            full = s if full is None else torch.logaddexp(full, s)
        return out, lse, full


def gather_query(query: torch.Tensor, heads: torch.Tensor | None, channels: torch.Tensor | None) -> torch.Tensor:
    """``query [B, H, M, D]`` -> a lane's rows ``[B, h, M, c]`` (its heads, its kept channels)."""
    q = query if heads is None else query.index_select(1, heads)
    if channels is None:
        return q
    h, c = channels.shape
    return q.gather(-1, channels.view(1, h, 1, c).expand(q.shape[0], h, q.shape[2], c))


def merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint ``(out, lse)`` of partials over disjoint key regions (float32)."""
    lses = torch.stack([lse for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)
    total = w.sum(dim=0)
    out = sum(wi.unsqueeze(-1) * o for wi, (o, _) in zip(w, parts))
    ok = total > 0
    out = out / torch.where(ok, total, torch.ones_like(total)).unsqueeze(-1)
    lse = torch.where(ok, top + torch.log(torch.where(ok, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse


def kivi_lanes_attention_partial(query: torch.Tensor, region: PackedLanes, scale: float, *,
                                 length: torch.Tensor | None = None,
                                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over every lane of ``region``, unnormalised across regions.

    Args:
        query: ``[B, H, M, D]`` - the ``M = group * q_len`` query rows of each of the region's ``H`` heads, over the
            full head dimension (each lane gathers its kept channels).
        region: the lanes (:class:`PackedLanes`; its ``valid`` masks every lane's slots).
        scale: softmax scale of the full head (``1/sqrt(D)``), also for pruned keys.
        length: 0-dim int tensor (default ``region.length``): slots at or after it are treated as invalid.
        softcap: logit soft-cap ``softcap * tanh(s / softcap)`` of the scaled scores (``None`` / 0: none).

    Returns:
        ``(out [B, H, M, Dv] float32, lse [B, H, M] float32)``; heads no lane covers get ``lse = -inf`` and zeros.
    """
    return _read_lanes(query, region, length,
                       lambda q, packed: _packed_partial(q, packed, scale, softcap=softcap or None))


def kivi_lanes_buffer_attention_partial(query: torch.Tensor, region: PackedLanes, scale: float, k: torch.Tensor,
                                        v: torch.Tensor, valid: torch.Tensor, length: torch.Tensor | None = None, *,
                                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over every lane of ``region`` and a full-precision buffer together (what the CUDA lanes kernel reads
    in one launch, :meth:`PackedLanes.attention_partial_with_buffer`): the two regions' partials merged by log-sum-exp.
    ``k`` / ``v`` ``[B, H, T, D / Dv]`` over every region head and all query channels, ``valid [B, T]``; ``length``
    (0-dim int tensor or ``None``): only the buffer's slots before it may be live.  Returns ``(out [B, H, M, Dv]
    float32, lse [B, H, M] float32)`` as :func:`kivi_lanes_attention_partial`."""
    from kvcompress.kernels.attention.reference import merge_partials, merged_lse

    from .reference import buffer_attention_partial

    lanes = kivi_lanes_attention_partial(query, region, scale, softcap=softcap)
    buffer = buffer_attention_partial(query, k, v, valid, length, scale, softcap=softcap)
    return merge_partials([lanes, buffer]), merged_lse([lanes[1], buffer[1]])


def kivi_lanes_attention_scored(query: torch.Tensor, region: PackedLanes, scale: float, *,
                                length: torch.Tensor | None = None, softcap: float | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`kivi_lanes_attention_partial` that also returns what it scored: ``(out, lse, logits)``, ``logits[i]``
    ``[B, h_i, M, T]`` float32 for lane ``i`` (``h_i``: its heads, all ``H`` for a lane without a head list), the
    scaled (soft-capped) scores of its dequantized keys in natural-log units, ``-inf`` on slots not attended."""
    from .reference import kivi_attention_scored

    logits = []

    def read(q, packed):
        o, l, s = kivi_attention_scored(q, packed, scale, softcap=softcap or None)
        logits.append(s)
        return o, l

    out, lse = _read_lanes(query, region, length, read)
    return out, lse, logits


def _read_lanes(query: torch.Tensor, region: PackedLanes, length: torch.Tensor | None, read
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every lane's partial (``read(lane query [B, h, M, c], lane region)``, called once per lane in order) placed on
    its heads and merged: :func:`kivi_lanes_attention_partial`'s ``(out, lse)``."""
    if length is None:
        length = region.length
    valid = region.with_length(length).live_valid()
    b, hkv, m, _ = query.shape
    dv = region.v_dim
    if not region.lanes:
        raise ValueError("kivi_lanes_attention_partial needs at least one lane")
    disjoint = _disjoint(region)
    if disjoint:  # each head in one lane at most (what the stores build): partials placed, no merge
        out = query.new_zeros((b, hkv, m, dv), dtype=torch.float32)
        lse = query.new_full((b, hkv, m), float("-inf"), dtype=torch.float32)
    parts = []
    for lane in region.lanes:
        o, l = read(gather_query(query, lane.heads, lane.channels), lane.packed(region.bits, region.group, valid))
        if lane.heads is None:  # every head
            if len(region.lanes) == 1:
                return o, l
            parts.append((o, l))
        elif disjoint:
            out.index_copy_(1, lane.heads, o)
            lse.index_copy_(1, lane.heads, l)
        else:
            full_out = o.new_zeros(b, hkv, m, dv)
            full_lse = l.new_full((b, hkv, m), float("-inf"))
            full_out.index_copy_(1, lane.heads, o)
            full_lse.index_copy_(1, lane.heads, l)
            parts.append((full_out, full_lse))
    if disjoint:
        return out, lse
    return parts[0] if len(parts) == 1 else merge(parts)


#: attribute of a region's ``valid`` tensor: ``(weak references to the lanes' head tensors, whether no head is in
#: two lanes)`` - weak, so that the cache keeps no tensor alive (a call recorded into CUDA graphs sees tensors of the
#: graphs' pool, and one kept past the call fails the recording)
DISJOINT_ATTR = "_kvcompress_kivi_lanes_disjoint"


def _disjoint(region: PackedLanes) -> bool:
    """Whether every lane lists its heads and no head is in two lanes: read from the head lists once per region
    (cached on its ``valid`` tensor while the lanes' head tensors are the same objects), not at every call.  ``False``
    when it is not known without a host read during a CUDA-graph capture (:func:`disjoint_or_none`): the
    joint-softmax path, right for disjoint lanes too."""
    return bool(disjoint_or_none(region))


def disjoint_or_none(region: PackedLanes) -> bool | None:
    """:func:`_disjoint`, or ``None`` during a CUDA-graph capture of a call whose head tensors are not the cached ones
    (``torch.compile``'s CUDA graphs copy their inputs; a capture forbids the host read that would decide it)."""
    heads = tuple(lane.heads for lane in region.lanes)
    if any(h is None for h in heads):
        return False
    cached = getattr(region.valid, DISJOINT_ATTR, None)
    if cached is not None and len(cached[0]) == len(heads) and all(a() is c for a, c in zip(cached[0], heads)):
        return cached[1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    flat = [h for t in heads for h in t.tolist()]  # once per region (a store change)
    answer = len(set(flat)) == len(flat)
    setattr(region.valid, DISJOINT_ATTR, (tuple(weakref.ref(h) for h in heads), answer))
    return answer


__all__ = ["KiviLane", "PAYLOAD", "PackedLanes", "disjoint_or_none", "gather_query", "kivi_lanes_attention_partial",
           "kivi_lanes_attention_scored", "merge"]
