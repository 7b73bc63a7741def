"""Production read path: one attention partial per segment, merged by log-sum-exp.

Each segment is read in its own format - full-precision regions by
:func:`~.reference.partial_attention`, encoded regions (``Segment.packed``) by
their own op (e.g. the KIVI kernel, which reads packed codes in place) - and
the partials ``(out, lse)`` are merged into the joint softmax.  Mathematically
equal to :func:`~.reference.segment_attention`, the oracle it is tested against.

On CUDA, for a single query position (decode: every stored token precedes the
query, so only ``valid`` masks keys), every full-precision segment without a
read-time selection - sinks, window, new tokens, LeanK lanes (``Segment.channels``:
the query is gathered to each head's kept channels) and low-rank lanes (a projecting
``qmap``: a :class:`~kvcompress.state.LinearQueryMap` is applied by the kernel itself, ``q U``
inside each program; any other map's projected query is appended to the query as extra
columns and the lane's channels point at them, :func:`_split_lanes`) - is read by ONE launch
of the grouped split-KV kernel (:mod:`kvcompress.kernels.leank`), when its capability check
accepts them (query width up to 256 columns; appended low-rank lanes that do not fit, and
lanes with an output map ``vmap``, take the PyTorch partial).  CPU behaviour is the reference
path below, unchanged.

Attention variants (see :mod:`.reference`): ``softcap`` goes to every partial (each kernel caps its own
scores; a packed region whose ``attention_partial`` does not declare ``supports_softcap`` is read through the
reference instead, decoded); ``sink_logits`` join the merged denominator once, in :func:`~.reference.merge_partials`.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from kvcompress.state import LabelTopK, LinearQueryMap, Segment, TokenSelection

from .reference import merge_partials, merged_lse, partial_attention, partial_scored, segment_mask, sink_rows

#: the most region partials one ``kvcompress::merge_partials`` call merges (one Triton launch; more: the reference)
MERGE_MAX_PARTS = 4


def _kv_heads(segments: Sequence[Segment]) -> int:
    for seg in segments:
        if seg.heads is None:
            return seg.packed.k_codes.shape[1] if seg.packed is not None else seg.k.shape[1]
    return max(int(s.heads.max()) + 1 for s in segments)


def _readable(seg: Segment) -> bool:
    """Full precision, no read-time selection, no output map: what the grouped kernel can read."""
    return seg.packed is None and seg.select is None and seg.k is not None and seg.vmap is None


def _projects(seg: Segment) -> bool:
    """A low-rank lane: the query map projects (``q U``) instead of gathering channels."""
    return _readable(seg) and seg.qmap is not None and seg.channels is None


def _lane_of(seg: Segment):
    """The segment as a grouped-kernel lane ``(heads, channels, k, v, valid)`` over the model's query, or ``None``
    if it is not one (a projecting segment is a lane over an extended query only: :func:`_split_lanes`)."""
    if not _readable(seg) or _projects(seg):
        return None
    return (seg.heads, seg.channels, seg.k, seg.v, seg.valid)


def _split_lanes(q5: torch.Tensor, segments: Sequence[Segment], max_width: int):
    """``(query [B, Hkv, M, D (+ R)], lanes, their segments, the other segments)`` for one grouped launch.

    Channel-gather and dense segments are lanes over the model's query.  A projecting segment whose map is a
    :class:`~kvcompress.state.LinearQueryMap` (the built-in low-rank keys) is a lane over the model's query too, with
    the map's ``weight`` as the lane's basis: the kernel projects the query rows itself (no projection, cast or
    concatenation launches).  Any other projecting segment (``qmap`` without ``channels``, e.g. a plugin's own
    function) becomes a lane over an extended query: its projected query ``qmap(q)`` (``[B, h, M, r]``, on its
    heads' rows, zeros on the others) is appended to the query as ``r`` more columns and the lane's channels
    point at them, so the kernel's channel gather reads ``q U`` against the stored coordinates (the other lanes
    then name their channels too: dense ones the first ``D`` columns).  Projecting segments are taken in order
    while the query stays within ``max_width`` columns and the map returns the query's dtype and the
    coordinates' width; the others stay with the PyTorch partial.  Decided from shapes and dtypes only (the same
    decision for every call of one shape: nothing read from the device)."""
    b, hkv, group, q_len, d = q5.shape
    m = group * q_len
    query = q5.reshape(b, hkv, m, d)
    lanes, lane_segments, rest, extra = [], [], [], []
    width = d
    for seg in segments:
        lane = _lane_of(seg)
        if lane is None and _projects(seg) and isinstance(seg.qmap, LinearQueryMap):
            w = seg.qmap.weight
            h = seg.k.shape[1]
            if w.dtype == seg.k.dtype and tuple(w.shape) == (h, d, seg.k.shape[-1]):
                lane = (seg.heads, None, seg.k, seg.v, seg.valid, w)  # the kernel projects the query itself
        if lane is None and _projects(seg) and width + seg.k.shape[-1] <= max_width:
            h, r = seg.k.shape[1], seg.k.shape[-1]
            qs = seg.qmap(q5 if seg.heads is None else q5.index_select(1, seg.heads))
            if tuple(qs.shape) == (b, h, group, q_len, r) and qs.dtype == query.dtype:
                qs = qs.reshape(b, h, m, r)
                if seg.heads is not None:  # the kernel reads the query by kv head: place the lane's rows there
                    full = qs.new_zeros(b, hkv, m, r)
                    full[:, seg.heads] = qs
                    qs = full
                extra.append(qs)
                channels = torch.arange(width, width + r, device=query.device).view(1, r).expand(h, r)
                lane = (seg.heads, channels, seg.k, seg.v, seg.valid)
                width += r
        if lane is None:
            rest.append(seg)
        else:
            lanes.append(lane)
            lane_segments.append(seg)
    if extra:
        query = torch.cat([query, *extra], dim=-1)
        # a lane without channels reads the whole query; over the extended query it names its d columns instead
        model_columns = torch.arange(d, device=query.device).view(1, d)
        lanes = [lane if lane[1] is not None or len(lane) > 5 else
                 (lane[0], model_columns.expand(lane[2].shape[1], d), *lane[2:]) for lane in lanes]
    return query, lanes, lane_segments, rest


def _lanes_length(segments: Sequence[Segment]) -> torch.Tensor | None:
    """One bound for a launch over these lane segments: the largest :attr:`Segment.length`, or ``None``
    (no bound) when any segment has none."""
    lengths = [seg.length for seg in segments]
    if not lengths or any(n is None for n in lengths):
        return None
    out = lengths[0]
    for n in lengths[1:]:
        out = torch.maximum(out, n)
    return out


def _has_lanes(segments: Sequence[Segment]) -> bool:
    return any(_lane_of(seg) is not None or _projects(seg) for seg in segments)


def _fused_dense(q5: torch.Tensor, segments: Sequence[Segment], scale: float, fused: bool | None = None,
                 impl: str | None = None, softcap: float | None = None, scored: bool = False,
                 out_dtype: torch.dtype | None = None):
    """CUDA decode: ``(partial, remaining segments, scores)`` with the full-precision lanes (low-rank ones included)
    read in one launch.  ``q5``: the grouped query ``[B, Hkv, group, q_len, D]``.  ``scored``: the launch also
    returns its scores, and ``scores`` pairs each segment it read with them (``[B, h, M, T]``); else ``[]``.
    ``out_dtype``: the read's output dtype, which the launch writes where it reads every segment (its partial is then
    the read's output: no merge, no cast after it); else its output is float32."""
    q_len = q5.shape[3]
    if impl is not None:  # chosen when the cache was built: the registered op, nothing decided here
        if impl == "reference" or q_len != 1 or not _has_lanes(segments):
            return None, segments, []
        from kvcompress.kernels import leank
        from kvcompress.kernels.leank import triton_kernel

        query4, lanes, lane_segments, rest = _split_lanes(q5, segments, triton_kernel.MAX_DIM)
        if not lanes or not triton_kernel.supports(query4, lanes):  # shapes only: decided at trace time
            return None, segments, []
        length = _lanes_length(lane_segments)
        if scored:
            from kvcompress.kernels import ops

            out, lse, logits = ops.lanes_attention_scored(query4, lanes, scale, impl=impl, length=length,
                                                          softcap=softcap)
            return (out, lse), rest, list(zip(lane_segments, logits))
        return leank.grouped_partial_attention(query4, lanes, scale, impl=impl, length=length, softcap=softcap,
                                               out_dtype=None if rest else out_dtype), rest, []
    if fused is False:
        return None, segments, []
    mode = "triton" if fused else os.environ.get("KVCOMPRESS_KERNELS", "auto")  # "triton" forces it
    if q_len != 1 or mode == "reference" or not (q5.is_cuda or mode == "triton"):
        return None, segments, []
    if not _has_lanes(segments):
        return None, segments, []
    from kvcompress.kernels import leank

    if not leank.triton_available():
        return None, segments, []
    from kvcompress.kernels.leank import triton_kernel

    query4, lanes, lane_segments, rest = _split_lanes(q5, segments, triton_kernel.MAX_DIM)
    if not lanes or not triton_kernel.supports(query4, lanes):
        return None, segments, []
    if scored:
        logits = [query4.new_full((query4.shape[0], ln[2].shape[1], query4.shape[2], ln[2].shape[2]), float("-inf"),
                                  dtype=torch.float32) for ln in lanes]
        out, lse = triton_kernel.grouped_partial_attention(query4, lanes, scale, softcap=softcap, logits=logits)
        return (out, lse), rest, list(zip(lane_segments, logits))
    return triton_kernel.grouped_partial_attention(query4, lanes, scale, softcap=softcap,
                                                   out_dtype=None if rest else out_dtype), rest, []


def _reads_softcap(packed) -> bool:
    """Whether a packed region's ``attention_partial`` takes ``softcap=`` (its class says so)."""
    return bool(getattr(packed, "supports_softcap", False))


def attend_segments(query: torch.Tensor, segments: Sequence[Segment], q_positions: torch.Tensor | None,
                    scale: float, fused: bool | None = None, impls: dict[str, str] | None = None,
                    softcap: float | None = None, sink_logits: torch.Tensor | None = None, scored: bool = False):
    """Same contract as :func:`~.reference.segment_attention`: ``[batch, q_heads, q_len, v_dim]``.  ``q_positions``
    ``None``: a single query position at or after every stored token (a static cache's decode step: only validity
    masks keys, and no position tensor is made per read).

    ``fused``: read the full-precision lanes with the grouped kernel (True), never (False), or as the
    environment says (``None``: ``KVCOMPRESS_KERNELS``, CUDA tensors only).  ``impls``: implementations
    chosen once when a static cache was built (:func:`kvcompress.kernels.ops.choose`), by op name
    (``"lanes_partial"``, ``"gather_partial"``, ``"merge_partials"`` - the log-sum-exp merge of the regions' partials
    and the cast, one launch instead of about ten, for up to 4 regions without learned sinks): the registered ops
    run them and nothing is decided per call (packed regions carry their own choice).  ``softcap`` / ``sink_logits``: the model's attention variants
    (:func:`~.reference.segment_attention`).

    ``scored`` (a single query position, decode): also return the attention probability *mass* each stored token
    received, ``(out, masses)`` with ``masses[i]`` ``[batch, kv_heads, tokens_i]`` float32 for ``segments[i]``,
    summed over the query heads of its kv head (0 on heads a segment does not cover).  The mass comes from the
    read itself: the kernels return the scores they computed (the ``*_scored`` ops), and the mass is
    ``exp(score - joint LSE)`` with the joint LSE of the merged partials - no second pass over the keys.  Readers
    without such an output (DoubleSparse's gather, a packed region that does not declare ``supports_scores``, a
    segment with a value map's output... see :func:`_reads_scores`) read their segment through the reference
    instead, scores included.
    """
    b, hq, q_len, d = query.shape
    if q_positions is None and q_len != 1:
        raise ValueError(f"attend_segments(q_positions=None) reads a single query position (decode), got {q_len}")
    if scored and q_len != 1:
        raise ValueError(f"attend_segments(scored=True) reads a single query position (decode), got {q_len}")
    kv_heads = _kv_heads(segments)
    group = hq // kv_heads
    m_rows = group * q_len
    q5 = query.view(b, kv_heads, group, q_len, d)
    parts = []
    scores: dict[int, torch.Tensor] = {}  # id(segment) -> its scores [b, h_seg, m_rows, t]
    impls = impls or {}
    softcap = softcap or None
    # a launch that reads every segment is the read's only part: it writes the read's dtype itself (no cast launch
    # after it); learned sinks are merged in float32 afterwards
    own_dtype = query.dtype if sink_logits is None else None
    together = None if scored or q_len != 1 else _buffer_with_region(q5, segments, scale, softcap, own_dtype)
    if together is not None:  # a full-precision buffer and a packed region in one launch: one partial
        parts.append(together)
        fused, segments_left, fused_scores = None, [], []
    else:
        fused, segments_left, fused_scores = _fused_dense(q5, segments, scale, fused, impls.get("lanes_partial"),
                                                          softcap, scored, own_dtype)
    if fused is not None:
        parts.append(fused)
        scores.update((id(seg), s) for seg, s in fused_scores)
    for seg in segments_left:
        select = seg.select
        if isinstance(select, LabelTopK):
            # a selection given by its label scores: read in one launch with its gather where a kernel does both
            # (a decode step over a full-precision middle); otherwise as its indices
            part = None
            if q_len == 1 and not scored and seg.packed is None and seg.heads is None and seg.qmap is None \
                    and seg.vmap is None:
                from kvcompress.kernels import doublesparse

                part = doublesparse.select_gather_attention(select, seg.k, seg.v, seg.valid, scale, softcap=softcap)
            if part is not None:
                parts.append(part)
                continue
            select = select.resolve()
        qs = q5 if seg.heads is None else q5.index_select(1, seg.heads)
        if seg.qmap is not None:
            qs = seg.qmap(qs)
        qs = qs.reshape(qs.shape[0], qs.shape[1], m_rows, qs.shape[-1])
        if seg.packed is not None and seg.select is None and (softcap is None or _reads_softcap(seg.packed)) \
                and (not scored or _reads_scores(seg.packed)):
            cap = {} if softcap is None else {"softcap": softcap}
            if scored:
                out, lse, scores[id(seg)] = seg.packed.attention_scored(qs, scale, **cap)
            else:
                out, lse = seg.packed.attention_partial(qs, scale, **cap)
        elif isinstance(select, TokenSelection) and seg.packed is None and q_len == 1 and not scored:
            # per-query-head indices (DoubleSparse): gather exactly the selected tokens (decode:
            # every stored token precedes the query, so only ``valid`` masks keys)
            from kvcompress.kernels import doublesparse

            index = select.grouped(kv_heads)
            if seg.heads is not None:
                index = index.index_select(1, seg.heads)
            out, lse = doublesparse.gather_partial_attention(qs, seg.k, seg.v, seg.valid, index, scale,
                                                             impl=impls.get("gather_partial"), softcap=softcap)
        elif q_len == 1 and seg.select is None:
            # decode: every stored token precedes the query (the step's own token is at its position), so
            # only validity masks keys (as in the kernels' decode path)
            k, v = seg.keys_values()
            valid = seg.valid
            if seg.packed is not None:
                valid = seg.packed.valid if valid is None or valid is seg.packed.valid else valid & seg.packed.valid
            if valid is None:
                mask = None
            elif valid.dim() == 3:  # a per-head validity (adaptive per-head budgets): [b, h, 1, t]
                mask = valid.unsqueeze(2)
            else:
                mask = valid.view(valid.shape[0], 1, 1, valid.shape[-1])  # (one op)
            if scored:
                out, lse, scores[id(seg)] = partial_scored(qs, k, v, mask, scale, softcap)
            else:
                out, lse = partial_attention(qs, k, v, mask, scale, softcap)
        else:
            k, v = seg.keys_values()
            mask = segment_mask(seg, q_positions)  # [b|1, h|1, q, t] (h: a per-head validity)
            if seg.packed is not None:
                mask = mask & seg.packed.valid[:, None, None, :]
            mask = mask.unsqueeze(2).expand(mask.shape[0], mask.shape[1], group, q_len, mask.shape[-1])
            if isinstance(select, TokenSelection):  # [b, hq, q, t] -> [b, h, g, q, t]
                sel = select.mask(mask.shape[-1]).view(b, kv_heads, group, q_len, -1)
                mask = mask & (sel if seg.heads is None else sel.index_select(1, seg.heads))
            elif select is not None:  # [b, h, q, t]
                mask = mask & select.unsqueeze(2)
            mask = mask.reshape(mask.shape[0], mask.shape[1], m_rows, mask.shape[-1])
            if scored:
                out, lse, scores[id(seg)] = partial_scored(qs, k, v, mask, scale, softcap)
            else:
                out, lse = partial_attention(qs, k, v, mask, scale, softcap)
        if seg.vmap is not None:  # value coordinates: the output is mapped back to the head dimension
            out = seg.vmap(out)
        if seg.heads is not None:
            full_out = out.new_zeros(b, kv_heads, m_rows, out.shape[-1])
            full_lse = lse.new_full((b, kv_heads, m_rows), float("-inf"))
            full_out[:, seg.heads] = out
            full_lse[:, seg.heads] = lse
            out, lse = full_out, full_lse
        parts.append((out, lse))
    dv = max(o.shape[-1] for o, _ in parts)
    parts = [(o if o.shape[-1] == dv else torch.nn.functional.pad(o, (0, dv - o.shape[-1])), lse) for o, lse in parts]
    sinks = None if sink_logits is None else sink_rows(sink_logits, kv_heads, q_len)
    merge = impls.get("merge_partials", "reference")
    if merge != "reference" and sinks is None and 1 < len(parts) <= MERGE_MAX_PARTS:
        from kvcompress.kernels import ops

        out = ops.merge_attention(parts, query.dtype, impl=merge)  # one launch: the merge and the cast
    else:
        out = merge_partials(parts, sinks)
    out = out.reshape(b, hq, q_len, dv)  # rows g * q_len + i of kv head h are query head h * group + g
    out = out if out.dtype == query.dtype else out.to(query.dtype)
    if not scored:
        return out
    # rows that see nothing have lse -inf and only -inf scores: shifted by 0, their mass is 0
    total = merged_lse([lse for _, lse in parts], sinks).nan_to_num(neginf=0.0)
    return out, [_mass(scores[id(seg)], total, seg.heads, kv_heads) for seg in segments]


def _buffer_with_region(q5: torch.Tensor, segments: Sequence[Segment], scale: float, softcap: float | None,
                        out_dtype: torch.dtype | None = None):
    """A decode read of exactly ``[full-precision buffer, packed region]`` (a static layer's sinks + recent window and
    a quantized middle) by the region's reader in ONE launch, when it offers that
    (``packed.attention_partial_with_buffer``, e.g. the KIVI CUDA kernel's buffer CTAs): the joint ``(out, lse)``, or
    ``None`` (the segments are then read apart).  Decided from shapes and dtypes only."""
    if len(segments) != 2:
        return None
    buf, region = segments
    packed = region.packed
    if packed is None or region.select is not None or region.heads is not None or region.qmap is not None \
            or region.vmap is not None:
        return None
    # the segment masks exactly what the region's own validity does - the same tensor, or (a region whose readers
    # give heads no lane covers -inf themselves, ``masks_uncovered_heads``) that validity per head
    if region.valid is not None and region.valid is not packed.valid and not (
            getattr(packed, "masks_uncovered_heads", False) and region.valid.dim() == 3):
        return None
    if not callable(getattr(packed, "attention_partial_with_buffer", None)) or (
            softcap is not None and not _reads_softcap(packed)):
        return None
    if _lane_of(buf) is None or buf.heads is not None or buf.channels is not None or buf.valid is None \
            or buf.valid.dim() != 2:
        return None
    b, hkv, group, q_len, d = q5.shape
    cap = {} if softcap is None else {"softcap": softcap}
    if out_dtype is not None and getattr(packed, "buffer_out_dtype", False):  # the read's output, no cast after it
        cap["out_dtype"] = out_dtype
    return packed.attention_partial_with_buffer(q5.reshape(b, hkv, group * q_len, d), scale, buf.k, buf.v, buf.valid,
                                                buf.length, **cap)


def _reads_scores(packed) -> bool:
    """Whether a packed region's reader returns its scores (``attention_scored``, declared by its class)."""
    return bool(getattr(packed, "supports_scores", False))


def _mass(logits: torch.Tensor, lse: torch.Tensor, heads: torch.Tensor | None, kv_heads: int) -> torch.Tensor:
    """``[B, kv_heads, T]``: ``exp(logits - lse)`` summed over the query rows of each kv head (``logits``
    ``[B, h, M, T]`` over ``heads``, or every head; 0 for the other heads)."""
    if heads is not None:
        lse = lse.index_select(1, heads)
    mass = torch.exp(logits - lse.unsqueeze(-1)).sum(2)
    if heads is None:
        return mass
    return mass.new_zeros(mass.shape[0], kv_heads, mass.shape[-1]).index_copy(1, heads, mass)
