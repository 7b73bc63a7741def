"""DoubleSparse in Triton: label scoring fused with exact top-k, and gather attention over selected tokens.

Same signatures and semantics as :mod:`.reference`.  Nothing is compiled at import.

* :func:`select_topk` (fused path, :func:`supports_fused`) - one program per query head and chunk of up
  to :data:`FUSED_MAX_TOKENS` tokens reads the chunk's labels (token-contiguous: the plugin's label
  cache is channel-major), computes the label scores **in registers** (4/2-bit codes unpacked in place,
  ``s = scale * (q . codes) + zero * sum(q)``), maps them to order-preserving uint32 keys and finds the
  k-th largest key exactly by a bitwise binary search (up to 32 block-wide counts; it stops at the first
  count of exactly k, when the keys at or above the tried prefix are the top-k set), then compacts the
  chosen token indices with one prefix sum.  No score tensor is written.  Longer contexts: each chunk keeps
  its ``min(k, chunk)`` best (key, token) pairs - a superset of its share of the global top-k - and a
  merge kernel picks the k best of them (:func:`fused_plan`).  Beyond that, or for token-major labels:
  :func:`select_topk_unfused` = :func:`label_scores` (fp32 scores of every head, labels read once per
  GQA group) + ``torch.topk``.
* :func:`gather_partial_attention` - split-K flash decoding over selected indices.  Per query row
  (each row its own indices): per block of ``BK`` indices the kernel gathers K and V rows of the row's
  kv head (copied a step ahead, ``cp.async``) and runs both products on tensor cores with the row as row 0 of
  a 16-row tile, with an online softmax (``rows_dot``; off: scores on CUDA cores in fp32).  Group-shared
  indices (every row of a kv head reads the same tokens, a stride-0 view:
  ``TokenSelection(group=...)``): one program per kv head gathers each row once for the whole group
  and runs both products on tensor cores.  Partials + LSE per split are merged by the shared combine
  kernel (:mod:`kvcompress.kernels.attention.triton_shared`).

``pdl`` (:data:`SELECT_CONFIG` and :data:`GATHER_CONFIG`, ``KVCOMPRESS_DS_CONFIG``; ``True`` / ``False``, default
``"auto"``: :func:`pdl_for`): on Hopper the gather is launched with programmatic dependent launch after the select
(whose programs signal their dependents as they start) and waits for it on the device before it touches memory, and
the gather's split merge follows it the same way (:func:`kvcompress.kernels.attention.triton_shared.use_pdl`).

Limits (:func:`supports_*`): last dims contiguous; ``D``, ``Dv``, ``r`` up to 256; query fp16, bf16 or
fp32; K/V fp16, bf16 or fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import (cap_base2, combine_splits, env_config, num_sms, pdl_launch,
                                                         pdl_trigger, pdl_wait, pow2, power_of_two_setting, soft_cap,
                                                         use_pdl)

from .reference import Labels, group_query, selection_rows

MAX_DIM = 256


@triton.jit
def _scores_kernel(Q, sq_b, sq_h, CH, sch_h, L, sl_b, sl_h, sl_t, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b,
                   OUT, so_b, so_h, T, HKV,
                   G: tl.constexpr, GP: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                   PER: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr, HAS_VALID: tl.constexpr,
                   BT: tl.constexpr):
    """Scores of the ``G`` query heads of one kv head over ``BT`` tokens (labels read once)."""
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_c = tl.arange(0, NBP)
    offs_t = pid_t * BT + tl.arange(0, BT)
    t_ok = offs_t < T
    g_ok = offs_g < G
    c_ok = offs_c < NB
    lab = tl.load(L + b * sl_b + h * sl_h + offs_t[:, None].to(tl.int64) * sl_t + offs_c[None, :] * sl_c,
                  mask=t_ok[:, None] & c_ok[None, :], other=0)
    q_rows = Q + b * sq_b + (h * G + offs_g)[:, None].to(tl.int64) * sq_h
    acc = tl.zeros([GP, BT], tl.float32)
    qsum = tl.zeros([GP], tl.float32)
    for j in tl.static_range(PER):
        ch = tl.load(CH + h * sch_h + j * NB + offs_c, mask=c_ok, other=0)
        qj = tl.load(q_rows + ch[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        if QUANT:
            part = ((lab >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)
            qsum += tl.sum(qj, axis=1)
        else:
            part = lab.to(tl.float32)
        acc += tl.sum(qj[:, None, :] * part[None, :, :], axis=2)
    if QUANT:
        s = tl.load(SC + b * sz_b + h * sz_h + offs_t, mask=t_ok, other=1.0).to(tl.float32)
        s = tl.where(s == 0.0, 1.0, s)
        z = tl.load(ZE + b * sz_b + h * sz_h + offs_t, mask=t_ok, other=0.0).to(tl.float32)
        acc = acc * s[None, :] + qsum[:, None] * z[None, :]
    ok = t_ok
    if HAS_VALID:
        ok = ok & (tl.load(VA + b * sva_b + offs_t, mask=t_ok, other=0) != 0)
    acc = tl.where(ok[None, :], acc, float("-inf"))
    tl.store(OUT + b * so_b + (h * G + offs_g)[:, None].to(tl.int64) * so_h + offs_t[None, :], acc,
             mask=g_ok[:, None] & t_ok[None, :])


def supports_scores(query: torch.Tensor, labels: Labels, channels: torch.Tensor, group: int = 1) -> bool:
    """Whether :func:`label_scores` (and :func:`select_topk`, with ``group`` query heads per row) handles these
    arguments (else use the reference)."""
    if query.dim() != 3 or labels.data.dim() != 4 or channels.dim() != 2:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or query.stride(-1) != 1:
        return False
    if group < 1 or query.shape[1] % group:
        return False
    if channels.shape[1] > MAX_DIM or (query.shape[1] // group) % channels.shape[0]:
        return False
    if labels.bits != 16 and (labels.scale.stride(-1) != 1 or labels.zero.stride(-1) != 1
                              or labels.scale.stride()[:2] != labels.zero.stride()[:2]):
        return False
    if labels.bits == 16:
        return labels.data.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return labels.bits in (4, 2) and labels.data.dtype == torch.uint8 and labels.scale is not None


def label_scores(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                 block_t: int = 128) -> torch.Tensor:
    """See :func:`.reference.label_scores`."""
    if not supports_scores(query, labels, channels):
        raise ValueError("label_scores: unsupported arguments (see supports_scores)")
    b, hq, _ = query.shape
    hkv, r = channels.shape
    g = hq // hkv
    t = labels.num_tokens
    quant = labels.bits != 16
    per = 8 // labels.bits if quant else 1
    nb = labels.data.shape[-1]
    out = torch.empty(b, hq, t, device=query.device, dtype=torch.float32)
    if t == 0 or b == 0:
        return out
    channels = channels.to(device=query.device).contiguous()  # int64 as the plugin keeps it: no per-step cast
    sc = labels.scale if quant else out
    ze = labels.zero if quant else out
    va = valid.view(torch.uint8) if valid is not None else out
    lab = labels.data
    _scores_kernel[(b * hkv, triton.cdiv(t, block_t))](
        query, query.stride(0), query.stride(1), channels, channels.stride(0),
        lab, lab.stride(0), lab.stride(1), lab.stride(2), lab.stride(3),
        sc, ze, sc.stride(0) if quant else 0, sc.stride(1) if quant else 0,
        va, va.stride(0) if valid is not None else 0,
        out, out.stride(0), out.stride(1), t, hkv,
        G=g, GP=max(2, pow2(g)), NB=nb, NBP=max(2, pow2(nb)), PER=per, BITS=labels.bits if quant else 16,
        QUANT=quant, HAS_VALID=valid is not None, BT=block_t, num_warps=4)
    return out


def select_topk_unfused(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                        k: int) -> torch.Tensor:
    """Two-step selection: :func:`label_scores` (fp32 scores of every head), then ``torch.topk``."""
    return torch.topk(label_scores(query, labels, channels, valid), k, dim=-1, sorted=False).indices


@triton.jit
def _orderable(x):
    """fp32 -> uint32 key with the same order (``-inf`` lowest; NaN is not expected)."""
    bits = x.to(tl.int32, bitcast=True)
    flipped = tl.where(bits < 0, ~bits, bits | (-2147483648))
    return flipped.to(tl.uint32, bitcast=True)


@triton.jit
def _group_value(q_row, sq_g, c, GROUP: tl.constexpr):
    """Channel ``c`` of the sum of ``GROUP`` query rows ``sq_g`` apart, in fp32 (rows added in order)."""
    v = tl.load(q_row + c).to(tl.float32)
    for j in tl.static_range(1, GROUP):
        v += tl.load(q_row + j * sq_g + c).to(tl.float32)
    return v


@triton.jit
def _label_keys(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b, b, hq, h, offs,
                ok, W: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                HAS_VALID: tl.constexpr, UNROLL: tl.constexpr, NP: tl.constexpr, GROUP: tl.constexpr):
    """Order-preserving keys of the label scores of tokens ``offs`` (token-contiguous labels); 0 where not ``ok``.
    Row ``hq`` scores the sum of ``GROUP`` query rows ``sq_g`` apart (fp32, added in row order)."""
    q_row = Q + b * sq_b + hq * sq_h
    acc = tl.zeros([NP], tl.float32)
    qsum = 0.0
    for w0 in range(0, W, UNROLL):  # UNROLL (divides W) label channels or code bytes of every token in flight
        for u in tl.static_range(UNROLL):
            w = w0 + u
            # the scalar part of the address first: no NP-wide pointer tensor stays live across the loop
            lab = tl.load(L + b * sl_b + h * sl_h + w * sl_c + offs, mask=ok, other=0)
            if QUANT:
                for j in tl.static_range(PER):
                    qv = _group_value(q_row, sq_g, tl.load(CH + h * sch_h + j * W + w), GROUP)
                    acc += qv * ((lab >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)
                    qsum += qv
            else:
                qv = _group_value(q_row, sq_g, tl.load(CH + h * sch_h + w), GROUP)
                acc += qv * lab.to(tl.float32)
    if QUANT:
        sc = tl.load(SC + b * sz_b + h * sz_h + offs, mask=ok, other=1.0).to(tl.float32)
        sc = tl.where(sc == 0.0, 1.0, sc)
        ze = tl.load(ZE + b * sz_b + h * sz_h + offs, mask=ok, other=0.0).to(tl.float32)
        acc = acc * sc + qsum * ze
    if HAS_VALID:
        acc = tl.where(tl.load(VA + b * sva_b + offs, mask=ok, other=0) != 0, acc, float("-inf"))
    # padding lanes get key 0: every real token (even -inf) has a larger key, and _top_slots only tries
    # candidates >= 1, so they are never counted or chosen (and no mask stays live)
    return tl.where(ok, _orderable(acc), 0)


@triton.jit
def _kth_key(key, K):
    """A threshold of the ``K`` largest of ``key`` (uint32, 0 = absent; at least ``K`` present), exactly: a
    binary search over the key bits from the top, one block-wide count of ``key >= prefix`` per bit.  It stops at
    the first count of exactly ``K``: the keys at or above that prefix are then already the top-``K`` set (ties at
    the K-th key included), which is all :func:`_top_slots` needs; otherwise it ends with the K-th largest key
    itself after 32 rounds.  Absent lanes (0) are never counted: every tried prefix is >= 1."""
    found = tl.zeros([], tl.uint32)
    bit = tl.full([], 1, tl.uint32) << 31
    cnt = K + 1
    while (bit != 0) & (cnt != K):
        cand = found | bit
        cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
        found = tl.where(cnt >= K, cand, found)
        bit = bit >> 1
    return found


@triton.jit
def _kth_key_interp(key, K):
    """:func:`_kth_key`'s threshold by a safeguarded interpolation search over the keys instead of one bit per round
    (``search: "interpolation"``, opt-in, session 40; on an H100 in session 41 2-5 % faster at SmolLM2 B1 / 4k and
    2-4 % slower at B16 / 4k, so it stays off).  One reduction gives the largest and the
    smallest present key and the present count; each round then counts ``key >= mid`` with ``mid`` interpolated
    between ``lo`` (count >= ``K``) and ``hi`` (count < ``K``) at the count ``K + 1/2``, or halfway after a step that
    did not halve the interval (so at most about twice the bit search's rounds).  It stops at a count of exactly
    ``K`` (the keys at or above ``mid`` are the top-``K`` set) or at ``hi = lo + 1`` (``lo`` is then the ``K``-th
    largest key): the same set as :func:`_kth_key`'s, so :func:`_place` picks the same lanes.  CPU model of the
    rounds: ``benchmarks/select_rounds_model.py`` (label scores, 4096 keys, ``K`` 256: 17.6 rounds -> 11.0)."""
    present = key > 0
    hi, lo, flo = tl.reduce((key, tl.where(present, key, 0xFFFFFFFF), present.to(tl.int32)), 0, _max_min_count)
    hi = hi + 1  # count(hi) = 0 (the largest key of a finite score is below 0xFFFFFFFF)
    fhi = tl.zeros([], tl.int32)
    c = flo
    halve = flo < 0  # False (a scalar boolean the loop can carry)
    while (hi - lo > 1) & (c != K):
        width = hi - lo
        frac = ((flo - K).to(tl.float32) - 0.5) / (flo - fhi).to(tl.float32)
        step = tl.where(halve, width // 2, (frac * width.to(tl.float32)).to(tl.uint32))
        mid = lo + tl.minimum(tl.maximum(step, 1), width - 1)
        c = tl.sum((key >= mid).to(tl.int32), axis=0)
        up = c >= K
        lo = tl.where(up, mid, lo)
        flo = tl.where(up, c, flo)
        hi = tl.where(up, hi, mid)
        fhi = tl.where(up, fhi, c)
        halve = ((hi - lo) > width // 2) & (not halve)
    return lo


@triton.jit
def _max_min_count(a_max, a_min, a_cnt, b_max, b_min, b_cnt):
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min), a_cnt + b_cnt


@triton.jit
def _top_slots(key, K, INTERP: tl.constexpr = False):
    """The ``K`` largest of ``key`` (uint32, 0 = absent; at least ``K`` present): ``(chosen, slot)`` with
    ``slot`` the rank of a chosen lane in lane order.  The threshold comes from :func:`_kth_key` (exact; ``INTERP``:
    :func:`_kth_key_interp`, the same set); ties at the K-th key go to the lowest lanes.  One prefix sum packs both
    counts (ties in the low 16 bits: at most 16384 lanes).  (Slower on an H200, docs/results.md: an 8-bit radix
    select over ``tl.histogram``; two bits per round from packed counts; packing the lanes still undecided after
    10-16 rounds into a scratch row to finish the search over those alone.)"""
    found, need = _threshold(key, K, INTERP)
    chosen, slot, _ = _place(key, found, need, tl.zeros([], tl.int32))
    return chosen, slot


@triton.jit
def _threshold(key, K, INTERP: tl.constexpr = False):
    """``(found, need)``: the threshold of the ``K`` largest keys (:func:`_kth_key`, or :func:`_kth_key_interp`
    with ``INTERP``) and how many of the keys equal to it are taken (the rest of ``K`` after every key above it)."""
    if INTERP:
        found = _kth_key_interp(key, K)
    else:
        found = _kth_key(key, K)
    return found, K - tl.sum((key > found).to(tl.int32), axis=0)


@triton.jit
def _place(key, found, need, base):
    """Chosen lanes and their slots given the threshold ``found`` and the ``need`` ties at it to take (lowest lanes
    first): ``base`` packs the keys above ``found`` (high 16 bits) and the ties (low 16 bits) of lanes before
    these, so a block can be placed in parts; returns the packed count after them too."""
    above = key > found
    tie = key == found
    inc = tie.to(tl.int32) + (above.to(tl.int32) << 16)
    run = tl.cumsum(inc, axis=0) + base
    ties = run & 0xFFFF
    chosen = above | (tie & (ties <= need))
    return chosen, (run >> 16) + tl.minimum(ties, need) - 1, base + tl.sum(inc, axis=0)


@triton.jit
def _select_kernel(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b,
                   IDX, CKEY, T, K, KC, CHUNK, HQ, G,
                   W: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                   HAS_VALID: tl.constexpr, CANDIDATES: tl.constexpr, UNROLL: tl.constexpr, NP: tl.constexpr,
                   SUB: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = False, INTERP: tl.constexpr = False):
    """One query head and one chunk of ``CHUNK`` tokens: label scores in registers, then either the head's
    ``K`` token indices (one chunk) or the chunk's ``KC`` best (key, token) candidates (``CANDIDATES``).
    ``INTERP``: the threshold by interpolation search (:func:`_kth_key_interp`; the same indices).
    ``SUB < NP``: once the threshold is found the keys are dropped and recomputed ``SUB`` lanes at a time for the
    placement (the prefix sum and the scattered stores then hold ``SUB`` lanes' state, not ``NP``: fewer
    registers for a second label read, :data:`SELECT_CONFIG` ``compact_block``); the same indices in the same
    order as in one pass."""
    pdl_trigger(PDL)  # a gather launched with PDL may start once every program has started
    pid = tl.program_id(0)  # b * HQ + hq
    chunk = tl.program_id(1)
    hq = (pid % HQ).to(tl.int64)
    b = (pid // HQ).to(tl.int64)
    h = hq // G
    first = chunk * CHUNK if CANDIDATES else 0
    end = tl.minimum(first + CHUNK, T) if CANDIDATES else T
    offs = first + tl.arange(0, NP)
    ok = offs < end
    key = _label_keys(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b, b, hq, h,
                      offs, ok, W, PER, BITS, QUANT, HAS_VALID, UNROLL, NP, GROUP)
    if CANDIDATES:
        kk = tl.minimum(KC, end - first)
        row = (pid.to(tl.int64) * tl.num_programs(1) + chunk) * KC
    else:
        kk = K
        row = pid.to(tl.int64) * K
    if SUB >= NP:
        chosen, slot = _top_slots(key, kk, INTERP)
        if CANDIDATES:
            tl.store(CKEY + row + slot, key.to(tl.int32, bitcast=True), mask=chosen)
            tl.store(IDX + row + slot, offs, mask=chosen)
        else:
            tl.store(IDX + row + slot, offs.to(tl.int64), mask=chosen)
    else:
        found, need = _threshold(key, kk, INTERP)
        base = tl.zeros([], tl.int32)
        for s0 in range(0, NP, SUB):
            offs_s = first + s0 + tl.arange(0, SUB)
            ok_s = offs_s < end
            key_s = _label_keys(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b, b,
                                hq, h, offs_s, ok_s, W, PER, BITS, QUANT, HAS_VALID, UNROLL, SUB, GROUP)
            chosen, slot, base = _place(key_s, found, need, base)
            if CANDIDATES:
                tl.store(CKEY + row + slot, key_s.to(tl.int32, bitcast=True), mask=chosen)
                tl.store(IDX + row + slot, offs_s, mask=chosen)
            else:
                tl.store(IDX + row + slot, offs_s.to(tl.int64), mask=chosen)
    if CANDIDATES:  # a short last chunk's unused slots [kk, KC): absent (key 0) - no memset of the buffer (KC <= NP)
        pad = tl.arange(0, NP)
        tl.store(CKEY + row + pad, tl.zeros([NP], tl.int32), mask=(pad >= kk) & (pad < KC))


@triton.jit
def _merge_kernel(CKEY, CIDX, OUT, N, K, NP: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr = False):
    """The ``K`` best of one head's ``N`` candidates (keys, token indices): the head's token indices.  ``SUB <
    NP``: placed ``SUB`` at a time, the keys loaded again (as :func:`_select_kernel`)."""
    pdl_trigger(PDL)
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NP)
    ok = offs < N
    key = tl.load(CKEY + pid * N + offs, mask=ok, other=0).to(tl.uint32, bitcast=True)
    if SUB >= NP:
        chosen, slot = _top_slots(key, K)
        tl.store(OUT + pid * K + slot, tl.load(CIDX + pid * N + offs, mask=chosen, other=0).to(tl.int64),
                 mask=chosen)
    else:
        found, need = _threshold(key, K)
        base = tl.zeros([], tl.int32)
        for s0 in range(0, NP, SUB):
            offs_s = s0 + tl.arange(0, SUB)
            key_s = tl.load(CKEY + pid * N + offs_s, mask=offs_s < N, other=0).to(tl.uint32, bitcast=True)
            chosen, slot, base = _place(key_s, found, need, base)
            tl.store(OUT + pid * K + slot, tl.load(CIDX + pid * N + offs_s, mask=chosen, other=0).to(tl.int64),
                     mask=chosen)


@triton.jit
def _merge_level_kernel(CKEY, CIDX, OKEY, OIDX, N, GS, KC, NP: tl.constexpr, SUB: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One group of ``GS`` of a head's ``N`` candidates keeps its ``min(KC, present)`` best (absent = key 0) in
    the group's ``KC`` output slots: a superset of the group's share of the head's top-``KC``.  ``SUB < NP``:
    placed ``SUB`` at a time, the keys loaded again (as :func:`_select_kernel`)."""
    pdl_trigger(PDL)
    pid = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    first = grp * GS
    end = tl.minimum(first + GS, N)
    offs = first + tl.arange(0, NP)
    key = tl.load(CKEY + pid * N + offs, mask=offs < end, other=0).to(tl.uint32, bitcast=True)
    kk = tl.minimum(KC, tl.sum((key != 0).to(tl.int32), axis=0))
    row = (pid * tl.num_programs(1) + grp) * KC
    if SUB >= NP:
        chosen, slot = _top_slots(key, kk)
        tl.store(OKEY + row + slot, key.to(tl.int32, bitcast=True), mask=chosen)
        tl.store(OIDX + row + slot, tl.load(CIDX + pid * N + offs, mask=chosen, other=0), mask=chosen)
    else:
        found, need = _threshold(key, kk)
        base = tl.zeros([], tl.int32)
        for s0 in range(0, NP, SUB):
            offs_s = first + s0 + tl.arange(0, SUB)
            key_s = tl.load(CKEY + pid * N + offs_s, mask=offs_s < end, other=0).to(tl.uint32, bitcast=True)
            chosen, slot, base = _place(key_s, found, need, base)
            tl.store(OKEY + row + slot, key_s.to(tl.int32, bitcast=True), mask=chosen)
            tl.store(OIDX + row + slot, tl.load(CIDX + pid * N + offs_s, mask=chosen, other=0), mask=chosen)
    pad = tl.arange(0, NP)  # a group with fewer present candidates: its unused slots [kk, KC) absent (KC <= NP)
    tl.store(OKEY + row + pad, tl.zeros([NP], tl.int32), mask=(pad >= kk) & (pad < KC))


@triton.jit
def _top_lanes_kernel(KEY, CHOSEN, SLOT, N, K, NP: tl.constexpr, INTERP: tl.constexpr = False):
    offs = tl.arange(0, NP)
    key = tl.load(KEY + offs, mask=offs < N, other=0).to(tl.uint32, bitcast=True)
    chosen, slot = _top_slots(key, K, INTERP)
    tl.store(CHOSEN + offs, chosen.to(tl.int32), mask=offs < N)
    tl.store(SLOT + offs, tl.where(chosen, slot, -1), mask=offs < N)


def top_lanes(keys: torch.Tensor, k: int, search: str = "bits") -> tuple[torch.Tensor, torch.Tensor]:
    """The select kernels' top-``k`` search (:func:`_top_slots`) on given keys, in one program: ``keys`` int32
    ``[N]`` (N <= 16384) holding uint32 bit patterns (0 = absent, at least ``k`` present).  Returns ``(chosen
    [N] int32 0/1, slot [N] int32, -1 where not chosen)``.  ``search``: :data:`SEARCHES`.  For tests and benchmarks
    of the search alone."""
    n = keys.numel()
    if not 0 < n <= FUSED_MAX_TOKENS:
        raise ValueError(f"top_lanes takes 1 to {FUSED_MAX_TOKENS} keys, got {n}")
    chosen = torch.empty(n, dtype=torch.int32, device=keys.device)
    slot = torch.empty(n, dtype=torch.int32, device=keys.device)
    _top_lanes_kernel[(1,)](keys, chosen, slot, n, k, NP=max(16, pow2(n)), INTERP=search_interp(search))
    return chosen, slot


#: the fused select's threshold searches (``search`` in :data:`SELECT_CONFIG`): ``"bits"`` (the default,
#: :func:`_kth_key`) or ``"interpolation"`` (opt-in, :func:`_kth_key_interp`; the same indices)
SEARCHES = ("bits", "interpolation")


def search_interp(search) -> bool:
    """Whether the ``search`` setting names the interpolation search; anything but :data:`SEARCHES` is refused."""
    if search not in SEARCHES:
        raise ValueError(f"KVCOMPRESS_DS_CONFIG: search must be one of {', '.join(map(repr, SEARCHES))}, "
                         f"got {search!r}")
    return search == "interpolation"


FUSED_MAX_TOKENS = 16384  # per program: the label scores stay in registers (~3 registers per token)
# 16 warps for 16384 tokens: ~94 registers, no spills (sm_90); chunk_tokens < FUSED_MAX_TOKENS exercises
# the chunk + merge path on small inputs (tests)
# multilevel: where fused_plan has no plan (contexts above 32k at ctx/16), merge the chunks' candidates in levels
# (fused_levels) instead of the two-step fallback; None = where the select runs at least half as many query heads as
# the GPU has SMs (session 28, H200, 128k at ctx/16: 1.03-1.26x faster than the fallback from 128 heads - Llama B4 -
# on, 0.78-0.97x at 9-36 heads: multilevel_auto)
# method: "fused" (this module's select), "radix" (radix_triton.select_topk_radix: many programs per head, any
# length; slower, opt-in), "cuda" (radix_cuda.select_topk_cuda: a CUDA radix select, keys over every SM, one CTA per
# head) or "auto" (select_method); radix / cuda: entries over radix_triton.RADIX_CONFIG / radix_cuda.RADIX_CUDA_CONFIG
# merge_tokens: candidates the merge program takes at most (fused_plan; None = chunk_tokens)
# compact_block: place the chosen lanes this many at a time, their label keys computed again (None: all at once).
# Offline (benchmarks/select_regs.py, Triton 3.6) the placement holds ~150 of the 206 registers of an 8192-token,
# 8-warp select and makes the 4-warp one spill, but on the H200 (session 29) compact_block 1024 was slower at all 36
# cells timed (Llama B16/32k ds16 467.2 against 382.5 us): computing the keys again costs more than the spills
# search: the select kernel's threshold search (SEARCHES): "bits" (one bit per round) or "interpolation" (opt-in,
# session 40: fewer rounds in the CPU model, benchmarks/select_rounds_model.py; session 41, H100: +-2-5 %, no read
# across 1.0x SDPA).  The merge kernels keep the bit search.
# fuse_gather: a model's decode read (kvcompress.state.LabelTopK over a full-precision middle) runs the select and
# its gather in one kernel (select_gather_partial) where it takes the shapes: true / false force it, None (the
# default since session 43) follows fuse_rule (the benchutil ds ops follow this setting too).  Static caches decide
# once, when they are built (ops.choose("select_gather", ...)).
# unroll: label channels (or code bytes) whose loads are issued before their multiply-adds (the largest power of two
# up to it that divides them); None = select_launch's rule: FEW_PROGRAMS_UNROLL where the launch has few programs (the
# elems_per_thread rule's condition), else 4.
#: ``unroll: None`` where a select launch has fewer programs than two per SM (:func:`select_launch`): every label
#: channel's load in flight before the first multiply-add.  Two H100 rounds (session 41, ds8 / ds16 / both shared at
#: 4k, B1 / B4 / B16 of both head shapes): 16 against 4 was faster at 21-22 of 24 reads by more than 2% (SmolLM2
#: B4/4k ds16-shared 16.8 -> 15.1-15.4 us, Llama B1/4k ds8-shared 18.8 -> 16.2-16.7), slower at none; the 2 reads
#: not faster (Llama B16/4k per head: 512 programs, +0.5-1.5%) are many-program launches.  Session 21's select-only
#: H200 sweep has 16 slower only at many-program launches too (Llama B4/32k per head +8%, B16/32k shared +7-10%,
#: SmolLM2 B16/32k per head +7-9%) and faster at every few-program one (B1, Llama B4/32k shared).
FEW_PROGRAMS_UNROLL = 16


def select_launch(cfg: dict, programs: int, sms: int) -> tuple[int, int]:
    """``(elems_per_thread, unroll)`` of a select launch of ``programs`` programs on ``sms`` SMs: the configuration's
    values, or where ``None`` the rules: with fewer than ``2 * sms`` programs 32 scores per thread (wide CTAs, measured
    on an H200 with benchmarks/gpu_doublesparse.py) and :data:`FEW_PROGRAMS_UNROLL` label loads in flight, else 64
    and 4."""
    few = programs < 2 * sms
    ept, unroll = cfg["elems_per_thread"], cfg["unroll"]
    for name, v in (("elems_per_thread", ept), ("unroll", unroll)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"KVCOMPRESS_DS_CONFIG: {name} must be null or an integer >= 1, got {v!r}")
    if ept is None:
        ept = 32 if few else 64
    if unroll is None:
        unroll = FEW_PROGRAMS_UNROLL if few else 4
    return ept, unroll


#: ``pdl: "auto"`` launches with PDL up to this many query rows (batch x query heads).  Two H200 rounds (sessions 33
#: and 34, ds8 / ds16 / both shared, docs/results.md): reads of up to 36 rows were faster with PDL - all but one read
#: of one round, equal within 0.2 % - (Llama B1: 32 rows, 0.1-1.5 us of 18-52 us; SmolLM2 B1 / B4: 9 / 36 rows,
#: 0.4-1.8 us of 15-47 us), while from 128 rows (Llama B4, SmolLM2 B16) reads went either way by up to 3-4 %
#: (ds8-shared SmolLM2 B16 / 32k 86.6 -> 90.5 us).
PDL_AUTO_ROWS = 64


def pdl_for(setting, rows: int, device: torch.device) -> bool:
    """Whether a DoubleSparse launch over ``rows`` query rows (batch x query heads; the select and the gather count
    the same rows, so a gather waits exactly when its select triggers) uses PDL: ``setting`` ``True`` / ``False``,
    or ``"auto"`` - on up to :data:`PDL_AUTO_ROWS` rows - on a device that has it (:func:`use_pdl`)."""
    if setting == "auto":
        setting = rows <= PDL_AUTO_ROWS
    elif not isinstance(setting, bool):
        raise ValueError(f"KVCOMPRESS_DS_CONFIG: pdl must be true, false or \"auto\", got {setting!r}")
    return use_pdl(setting, device)


SELECT_CONFIG = dict(elems_per_thread=None, chunk_tokens=FUSED_MAX_TOKENS, unroll=None, multilevel=None, method="auto",
                     radix={}, merge_tokens=None, compact_block=None, cuda={}, pdl="auto", search="bits",
                     fuse_gather=None)


@functools.lru_cache(maxsize=None)
def _env_config() -> dict:
    """``KVCOMPRESS_DS_CONFIG`` (JSON), read once (first call): entries over :data:`SELECT_CONFIG` and
    :data:`GATHER_CONFIG` (a key of either; anything else is refused)."""
    return env_config("KVCOMPRESS_DS_CONFIG", set(SELECT_CONFIG) | set(GATHER_CONFIG))


def _select_base() -> dict:
    """:data:`SELECT_CONFIG` with the select's ``KVCOMPRESS_DS_CONFIG`` entries over it."""
    return {**SELECT_CONFIG, **{k: v for k, v in _env_config().items() if k in SELECT_CONFIG}}


def fused_plan(tokens: int, k: int, chunk: int = FUSED_MAX_TOKENS,
               merge: int | None = None) -> tuple[int, int, int] | None:
    """``(chunks, tokens per chunk, candidates per chunk)`` of the fused selection, or ``None``.

    One chunk (``tokens <= chunk``): one kernel, indices straight out.  More: chunks of ``chunk // 2``
    tokens (a candidate program holds keys and token indices: half the tokens fit its registers) each keep
    their ``min(k, chunk // 2)`` best - a superset of their share of the global top-k - and a merge kernel
    picks the ``k`` best candidates; this needs the candidates to fit the merge program: at most ``merge``
    (``None``: ``chunk``; never more than :data:`FUSED_MAX_TOKENS`).  A ``chunk`` below the merge's capacity
    spreads a head over more, shorter select programs (more of them at batch 1) for a longer merge.
    """
    chunk = min(chunk, FUSED_MAX_TOKENS)
    merge = min(chunk if merge is None else merge, FUSED_MAX_TOKENS)
    if tokens <= chunk:
        return 1, tokens, k
    per = max(1, chunk // 2)
    chunks = -(-tokens // per)
    kc = min(k, per)
    return (chunks, per, kc) if chunks * kc <= merge else None


def fused_levels(tokens: int, k: int, chunk: int = FUSED_MAX_TOKENS
                 ) -> tuple[int, int, int, list[tuple[int, int, int]], int] | None:
    """The multi-level fused selection: ``(chunks, tokens per chunk, candidates per chunk, levels, final)`` or
    ``None``.

    Chunks of ``chunk`` tokens each keep their ``min(k, chunk)`` best (key, token) pairs; while more candidates
    are left than one program holds (``chunk``), a level (``(candidates, group, kept per group)``) splits them
    into groups of ``chunk`` that each keep their ``min(k, chunk)`` best - every group's share of the global top-k
    survives, so the result stays exact - and the last ``final`` candidates go to the merge kernel.  ``None``
    when a stage would keep everything it reads (``k >= chunk``; a level that keeps as many candidates as it reads,
    as with ``k`` above ``chunk / 2`` once few groups are left) or one chunk holds every token."""
    chunk = min(chunk, FUSED_MAX_TOKENS)
    if tokens <= chunk or k >= chunk:
        return None
    chunks = -(-tokens // chunk)
    n = chunks * k
    levels = []
    while n > chunk:
        groups = -(-n // chunk)
        if groups * k >= n:  # this level would not shrink the candidates (it would repeat forever)
            return None
        levels.append((n, chunk, k))
        n = groups * k
    return chunks, chunk, k, levels, n


def supports_fused(query: torch.Tensor, labels: Labels, channels: torch.Tensor, k: int = 1,
                   chunk: int = FUSED_MAX_TOKENS, multilevel: bool = False, merge: int | None = None) -> bool:
    """Whether :func:`select_topk` runs the fused kernels: token-contiguous labels (the plugin's channel-major
    label cache) and a :func:`fused_plan` (or, with ``multilevel``, :func:`fused_levels`)."""
    t = labels.num_tokens
    planned = fused_plan(t, k, chunk, merge) is not None or (multilevel and fused_levels(t, k, chunk) is not None)
    return supports_scores(query, labels, channels) and t > 0 and (labels.data.stride(2) == 1 or t == 1) \
        and planned


def multilevel_auto(query: torch.Tensor, cfg: dict) -> bool:
    """``cfg["multilevel"]``, or where it is None, whether the select runs at least half as many query heads
    (``B * Hq`` rows of ``query``) as the device has SMs."""
    if cfg["multilevel"] is not None:
        return bool(cfg["multilevel"])
    sms = num_sms(query.device.index or 0) if query.is_cuda else 4
    return query.shape[0] * query.shape[1] * 2 >= sms


def select_method(query: torch.Tensor, labels: Labels, channels: torch.Tensor, k: int, cfg: dict,
                  valid: torch.Tensor | None = None) -> str:
    """Which select :func:`select_topk` runs: ``"fused"`` (:func:`supports_fused`), ``"radix"``
    (:mod:`.radix_triton`), ``"cuda"`` (:mod:`.radix_cuda`) or ``"unfused"`` (scores + ``torch.topk``).
    ``cfg["method"]`` ``"fused"`` / ``"radix"`` / ``"cuda"`` asks for one (each falls back to the fused select, then
    the two-step path, where it cannot take the call); ``"auto"``: the CUDA select where :func:`.radix_cuda.auto`
    says it is faster, else the fused select, else the two-step path.  (The radix select is not chosen by ``"auto"``:
    slower at 39 of 40 cells timed on an H200, up to 3.8x per read, docs/results.md "Session 28".)"""
    method = cfg["method"]
    if method not in ("auto", "fused", "radix", "cuda"):
        raise ValueError(f"select method must be 'auto', 'fused', 'radix' or 'cuda', got {method!r}")
    if method == "radix" and supports_scores(query, labels, channels):
        return "radix"
    if method == "cuda":
        from .radix_cuda import problem

        if problem(query, labels, channels, valid, k, cfg["cuda"]) is None:
            return "cuda"
    if method == "auto" and query.is_cuda:
        from .radix_cuda import auto

        if auto(query, labels, channels, valid, k, cfg["chunk_tokens"], cfg["cuda"]):
            return "cuda"
    if supports_fused(query, labels, channels, k, cfg["chunk_tokens"], multilevel_auto(query, cfg),
                      cfg["merge_tokens"]):
        return "fused"
    return "unfused"


def _label_args(labels: Labels, valid: torch.Tensor | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The label and validity arguments of the fused select kernels (what :func:`_label_keys` reads): the positional
    run ``L`` .. ``sva_b`` and the constexprs ``W``, ``PER``, ``BITS``, ``QUANT``, ``HAS_VALID``; ``dummy`` stands
    in for the tensors a call does not have."""
    quant = labels.bits != 16
    lab = labels.data
    sc = labels.scale if quant else dummy
    ze = labels.zero if quant else dummy
    va = valid.view(torch.uint8) if valid is not None else dummy
    args = (lab, lab.stride(0), lab.stride(1), lab.stride(3), sc, ze, sc.stride(0) if quant else 0,
            sc.stride(1) if quant else 0, va, va.stride(0) if valid is not None else 0)
    return args, dict(W=lab.shape[-1], PER=8 // labels.bits if quant else 1, BITS=labels.bits if quant else 16,
                      QUANT=quant, HAS_VALID=valid is not None)


def _device_launch(cfg: dict, programs: int, dev: torch.device) -> tuple[int, int]:
    """:func:`select_launch` of ``programs`` programs on ``dev``'s SMs (4 on the CPU)."""
    return select_launch(cfg, programs, num_sms(dev.index or 0) if dev.type == "cuda" else 4)


def _warps(lanes: int, ept: int) -> int:
    """Warps of a select or merge program over ``lanes`` lanes at ``ept`` lanes per thread (1 to 16)."""
    return max(1, min(16, lanes // (32 * ept)))


def _candidate_keys(rows: int, n: int, dev) -> torch.Tensor:
    """The candidate keys of the fused select's chunks or of a merge level, ``[rows, n]`` int32.  Uninitialised: the
    kernel that fills them writes every slot a merge reads, absent candidates as key 0 - no memset per buffer
    (session 39; session 30's profile of a forced fused Llama ds16 B1/32k read had a 1.0 µs memset).  Only reads
    beyond ``chunk_tokens`` that the CUDA selects do not take run these chunks (``"auto"`` gives the CUDA selects
    the grid's 32k / 128k cells where nvcc and sm_90 are there), so the grid's numbers do not move."""
    return torch.empty(rows, n, device=dev, dtype=torch.int32)


def _sub(np_: int, cfg: dict) -> int:
    """Lanes the select / merge kernels place at a time (``compact_block``, a power of two; all ``np_`` if None)."""
    block = cfg["compact_block"]
    return np_ if block is None else max(16, min(np_, pow2(int(block))))


def _divisor(n: int, most: int) -> int:
    """The largest power of two <= ``most`` that divides ``n``."""
    d = 1
    while d * 2 <= most and n % (d * 2) == 0:
        d *= 2
    return d


def group_rows(query: torch.Tensor, labels: Labels, channels: torch.Tensor, group: int,
               checked: bool = False) -> torch.Tensor:
    """``query [B, Hq, D]`` as one row per ``group`` consecutive query heads (the view ``query[:, ::group]``: the rows'
    shape, and each row's first query head, for the selects' decisions and launches); raises where ``group`` does not
    split the heads into whole kv heads (``checked``: the caller already knows it does)."""
    if group == 1:
        return query
    if not checked and not supports_scores(query, labels, channels, group):
        raise ValueError(f"select_topk: group {group} must divide the {query.shape[1]} query heads into a multiple of "
                         f"the {channels.shape[0]} kv heads")
    return query[:, ::group]


def select_topk(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                k: int, *, config: dict | None = None, group: int = 1) -> torch.Tensor:
    """See :func:`.reference.select_topk`.  ``group`` > 1: each row scores the sum of ``group`` consecutive query
    heads (the fused and the CUDA selects add them as they load the query, in fp32 and head order: no separate sum
    kernel; the other paths sum first, :func:`.reference.group_query`).

    Fused (:func:`supports_fused`): one program per query head (and chunk of up to
    :data:`FUSED_MAX_TOKENS` tokens) computes the label scores in registers and selects by an exact
    radix (bitwise binary) search - no score tensor is written; longer contexts pass each chunk's best
    ``k`` (key, token) pairs to a merge kernel (:func:`fused_plan`); with ``multilevel`` (:func:`multilevel_auto`),
    contexts beyond that merge in levels (:func:`fused_levels`).  Otherwise :func:`select_topk_unfused`.  Ties at
    the k-th score go to the lowest token index.  ``config`` overrides :data:`SELECT_CONFIG` (a benchmark knob).
    """
    t = labels.num_tokens
    if not 0 < k <= t:
        raise ValueError(f"k must be in [1, {t}], got {k}")
    cfg = dict(_select_base(), **(config or {}))
    interp = search_interp(cfg["search"])  # refused here, whichever select runs
    full = query
    query = group_rows(full, labels, channels, group)  # one row per group: the shape every decision below reads
    method = select_method(query, labels, channels, k, cfg, valid)
    if method == "cuda":
        from .radix_cuda import select_topk_cuda

        return select_topk_cuda(full, labels, channels, valid, k, config=cfg["cuda"], checked=True, group=group)
    if method in ("radix", "unfused") and group != 1:
        query = group_query(full, group)
    if method == "radix":
        from .radix_triton import select_topk_radix

        return select_topk_radix(query, labels, channels, valid, k, config=cfg["radix"])
    if method == "unfused":
        return select_topk_unfused(query, labels, channels, valid, k)
    plan = fused_plan(t, k, cfg["chunk_tokens"], cfg["merge_tokens"])
    levels = []
    if plan is None:  # multilevel
        chunks, chunk, kc, levels, _ = fused_levels(t, k, cfg["chunk_tokens"])
    else:
        chunks, chunk, kc = plan
    b, hq, _ = query.shape
    hkv, r = channels.shape
    dev = query.device
    pdl = pdl_for(cfg.get("pdl", False), b * hq, dev)  # the programs let a PDL-launched gather start
    out = torch.empty(b, hq, k, device=dev, dtype=torch.int64)
    channels = channels.to(device=dev).contiguous()  # int64 as the plugin keeps it: no per-step cast
    label_args, label_consts = _label_args(labels, valid, out)
    np_ = max(16, pow2(chunk))
    ept, unroll = _device_launch(cfg, b * hq * chunks, dev)
    warps = _warps(np_, ept)
    if chunks > 1:
        ckey = _candidate_keys(b * hq, chunks * kc, dev)  # 0 = no candidate (every slot written by the select)
        cidx = torch.empty(b * hq, chunks * kc, device=dev, dtype=torch.int32)
    else:
        ckey, cidx = out, out
    _select_kernel[(b * hq, chunks)](
        query, query.stride(0), query.stride(1), full.stride(1), channels, channels.stride(0), *label_args,
        cidx, ckey, t, k, kc, chunk, hq, hq // hkv, **label_consts, CANDIDATES=chunks > 1,
        UNROLL=_divisor(label_consts["W"], unroll), NP=np_,
        SUB=_sub(np_, cfg), GROUP=group, PDL=pdl, INTERP=interp, num_warps=warps)
    n = chunks * kc  # candidates left
    for _, group, keep in levels:  # fused_levels' candidate counts are the n of each step here
        groups = -(-n // group)
        okey = _candidate_keys(b * hq, groups * keep, dev)
        oidx = torch.empty(b * hq, groups * keep, device=dev, dtype=torch.int32)
        np2 = max(16, pow2(group))
        _merge_level_kernel[(b * hq, groups)](ckey, cidx, okey, oidx, n, group, keep, NP=np2, SUB=_sub(np2, cfg),
                                              PDL=pdl, num_warps=_warps(np2, ept))
        ckey, cidx, n = okey, oidx, groups * keep
    if chunks > 1:
        np2 = max(16, pow2(n))
        _merge_kernel[(b * hq,)](ckey, cidx, out, n, k, NP=np2, SUB=_sub(np2, cfg), PDL=pdl,
                                 num_warps=_warps(np2, ept))
    return out


@triton.jit
def _readable(idx, k_ok, VA, b, sva_b, HAS_VALID: tl.constexpr):
    """Which of the selected token indices ``idx`` (``k_ok``: inside the list) attention may read."""
    if HAS_VALID:
        return k_ok & (tl.load(VA + b * sva_b + idx, mask=k_ok, other=0) != 0)
    return k_ok


@triton.jit
def _selected(i_base, VA, b, sva_b, k0, end, BK: tl.constexpr, HAS_VALID: tl.constexpr):
    """Token indices ``k0 .. k0 + BK`` of a selection (int64) and which of them attention may read."""
    offs_k = k0 + tl.arange(0, BK)
    k_ok = offs_k < end
    idx = tl.load(i_base + offs_k, mask=k_ok, other=0).to(tl.int64)
    return idx, _readable(idx, k_ok, VA, b, sva_b, HAS_VALID)


@triton.jit
def _gather_kernel(Q, sq_b, sq_h, sq_m, K, sk_b, sk_h, sk_t, V, sv_b, sv_h, sv_t, VA, sva_b,
                   IDX, si_b, si_h, si_m, PO, PL, HKV, M, NK, per_split, qk_scale, cap,
                   D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                   HAS_VALID: tl.constexpr, BK: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr = False):
    """One query row, one split of its selected indices: normalised partial + LSE (base e).  ``PDL``: launched with
    programmatic dependent launch - it lets its split merge start, then waits for the kernel before it (the select)
    before it touches memory."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid_row = tl.program_id(0)  # b * HKV * M + h * M + m
    pid_s = tl.program_id(1)
    rows = tl.num_programs(0)
    m = (pid_row % M).to(tl.int64)
    h = ((pid_row // M) % HKV).to(tl.int64)
    b = (pid_row // (M * HKV)).to(tl.int64)
    offs_d = tl.arange(0, DP)
    offs_v = tl.arange(0, DVP)
    d_ok = offs_d < D
    v_ok = offs_v < DV
    q = tl.load(Q + b * sq_b + h * sq_h + m * sq_m + offs_d, mask=d_ok, other=0.0).to(tl.float32) * qk_scale
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    i_base = IDX + b * si_b + h * si_h + m * si_m
    start = pid_s * per_split
    end = tl.minimum(start + per_split, NK)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([DVP], tl.float32)
    for k0 in range(start, end, BK):
        idx, ok = _selected(i_base, VA, b, sva_b, k0, end, BK, HAS_VALID)
        kt = tl.load(k_base + idx[:, None] * sk_t + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1)
        if SOFTCAP:
            s = soft_cap(s, cap)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        vt = tl.load(v_base + idx[:, None] * sv_t + offs_v[None, :], mask=ok[:, None] & v_ok[None, :],
                     other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(PO + pid_s * rows * DV + pid_row.to(tl.int64) * DV + offs_v, out, mask=v_ok)
    tl.store(PL + pid_s * rows + pid_row, lse)


@triton.jit
def _dot_gather_step(q, k_base, sk_t, v_base, sv_t, idx, ok, qk_scale, cap, offs_d, d_ok, offs_v, v_ok, m_i, l_i,
                     acc, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """One step of :func:`_dot_gather`: the K / V rows of token indices ``idx`` (``ok``: which may be read) folded into
    the online softmax ``(acc, m_i, l_i)``."""
    kt = tl.load(k_base + idx[:, None] * sk_t + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q.to(kt.dtype), tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(q.to(kt.dtype), tl.trans(kt))
    s = s * qk_scale
    if SOFTCAP:
        s = soft_cap(s, cap)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    vt = tl.load(v_base + idx[:, None] * sv_t + offs_v[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
    if IEEE:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit
def _dot_gather(q, k_base, sk_t, v_base, sv_t, i_base, VA, b, sva_b, start, end, qk_scale, cap, offs_d, d_ok, offs_v,
                v_ok, MP: tl.constexpr, DVP: tl.constexpr, HAS_VALID: tl.constexpr, BK: tl.constexpr,
                IEEE: tl.constexpr, SOFTCAP: tl.constexpr, ISTEPS: tl.constexpr = 0):
    """Flash decoding of the ``[MP, D]`` query rows ``q`` over selected indices ``start .. end`` of one list, ``BK``
    per step, both products on tensor cores: ``(acc, m, l)`` (base 2).  The K / V rows are gathered with per-row
    addresses that depend only on the index list, so Triton's pipeliner copies them ahead (``cp.async``).

    ``ISTEPS`` > 1 (``index_steps``, opt-in): the indices of that many steps loaded at once (one plain load), the
    steps taking theirs from registers.  Without it the pipeliner copies each step's indices ahead too, but commits
    that copy after the K / V copies it prefetches, and the next addresses need it: every step opens with a wait for
    all copies in flight (sm_90 TTGIR, Triton 3.6: ``ttg.async_wait {num = 0}``), so the K / V copies of the next
    step never overlap this step's products.  With the indices in registers the steps' copies wait on no index copy
    (as the paged kernel's ``table_steps``)."""
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, DVP], tl.float32)
    if ISTEPS > 1:
        TB: tl.constexpr = ISTEPS * BK
        tb_local = tl.arange(0, TB)
        loc = tl.arange(0, BK)
        for b0 in range(start, end, TB):
            wb = b0 + tb_local
            blk = tl.load(i_base + wb, mask=wb < end, other=0)
            for s0 in range(0, tl.minimum(TB, end - b0), BK):
                # the slot index wrapped into the block (TB is a power of two): the pipeliner issues the gathers
                # of the next steps' copies ahead, past the block's last step, and an index out of the block
                # reads past the gather's shared-memory scratch (session 38, H100: illegal address)
                idx = tl.gather(blk, (s0 + loc) & (TB - 1), 0).to(tl.int64)
                ok = _readable(idx, b0 + s0 + loc < end, VA, b, sva_b, HAS_VALID)
                acc, m_i, l_i = _dot_gather_step(q, k_base, sk_t, v_base, sv_t, idx, ok, qk_scale, cap, offs_d, d_ok,
                                                 offs_v, v_ok, m_i, l_i, acc, IEEE, SOFTCAP)
    else:
        for k0 in range(start, end, BK):
            idx, ok = _selected(i_base, VA, b, sva_b, k0, end, BK, HAS_VALID)
            acc, m_i, l_i = _dot_gather_step(q, k_base, sk_t, v_base, sv_t, idx, ok, qk_scale, cap, offs_d, d_ok,
                                             offs_v, v_ok, m_i, l_i, acc, IEEE, SOFTCAP)
    return acc, m_i, l_i


@triton.jit
def _normalised(acc, m_i, l_i):
    """``(out, lse)`` of :func:`_dot_gather`'s rows ``(acc, m, l)`` (base 2): ``acc / l`` and the LSE in natural-log
    units; a row that read no valid token gets zeros and ``-inf``."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _query_rows(q_base, sq_m, rows, D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                MP: tl.constexpr):
    """The ``rows`` query rows ``sq_m`` apart from ``q_base`` as an ``[MP, DP]`` tile (zero padded), with what a
    :func:`_dot_gather` needs beside it: ``(q, offs_m, m_ok, offs_d, d_ok, offs_v, v_ok)``."""
    offs_m = tl.arange(0, MP)
    offs_d = tl.arange(0, DP)
    offs_v = tl.arange(0, DVP)
    m_ok = offs_m < rows
    d_ok = offs_d < D
    v_ok = offs_v < DV
    q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sq_m + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    return q, offs_m, m_ok, offs_d, d_ok, offs_v, v_ok


@triton.jit
def _gather_shared_kernel(Q, sq_b, sq_h, sq_m, K, sk_b, sk_h, sk_t, V, sv_b, sv_h, sv_t, VA, sva_b,
                          IDX, si_b, si_h, PO, PL, HKV, M, NK, per_split, qk_scale, cap,
                          MP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                          HAS_VALID: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                          PDL: tl.constexpr = False, ISTEPS: tl.constexpr = 0):
    """All ``M`` query rows of one kv head over one split of their *shared* selected indices: each K/V row
    is gathered once for the group and both products run on tensor cores (rows padded to ``MP``).  ``PDL``: as
    :func:`_gather_kernel`'s."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid_bh = tl.program_id(0)  # b * HKV + h
    pid_s = tl.program_id(1)
    h = (pid_bh % HKV).to(tl.int64)
    b = (pid_bh // HKV).to(tl.int64)
    q, offs_m, m_ok, offs_d, d_ok, offs_v, v_ok = _query_rows(Q + b * sq_b + h * sq_h, sq_m, M, D, DP, DV, DVP, MP)
    start = pid_s * per_split
    end = tl.minimum(start + per_split, NK)
    acc, m_i, l_i = _dot_gather(q, K + b * sk_b + h * sk_h, sk_t, V + b * sv_b + h * sv_h, sv_t,
                                IDX + b * si_b + h * si_h, VA, b, sva_b, start, end, qk_scale, cap, offs_d, d_ok,
                                offs_v, v_ok, MP, DVP, HAS_VALID, BK, IEEE, SOFTCAP, ISTEPS)
    out, lse = _normalised(acc, m_i, l_i)
    rows = tl.num_programs(0) * M
    row = pid_bh.to(tl.int64) * M + offs_m
    tl.store(PO + pid_s * rows * DV + row[:, None] * DV + offs_v[None, :], out, mask=m_ok[:, None] & v_ok[None, :])
    tl.store(PL + pid_s * rows + row, lse, mask=m_ok)


@triton.jit
def _gather_rows_dot_kernel(Q, sq_b, sq_h, sq_m, K, sk_b, sk_h, sk_t, V, sv_b, sv_h, sv_t, VA, sva_b,
                            IDX, si_b, si_h, si_m, PO, PL, HKV, M, NK, per_split, qk_scale, cap,
                            D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                            HAS_VALID: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                            PDL: tl.constexpr = False, ISTEPS: tl.constexpr = 0):
    """:func:`_gather_kernel` (one query row, its own indices) on tensor cores: the row is row 0 of a 16-row tile
    (the rest zero and never stored), so the gathered K / V rows take the pipelined ``cp.async`` path of
    :func:`_dot_gather` instead of the per-row kernel's synchronous index -> K -> V loads.  ``PDL``: as
    :func:`_gather_kernel`'s."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid_row = tl.program_id(0)  # b * HKV * M + h * M + m
    pid_s = tl.program_id(1)
    rows = tl.num_programs(0)
    m = (pid_row % M).to(tl.int64)
    h = ((pid_row // M) % HKV).to(tl.int64)
    b = (pid_row // (M * HKV)).to(tl.int64)
    offs_r = tl.arange(0, 16)
    offs_d = tl.arange(0, DP)
    offs_v = tl.arange(0, DVP)
    d_ok = offs_d < D
    v_ok = offs_v < DV
    q = tl.load(Q + b * sq_b + h * sq_h + m * sq_m + offs_r[:, None] * 0 + offs_d[None, :],
                mask=(offs_r == 0)[:, None] & d_ok[None, :], other=0.0)
    start = pid_s * per_split
    end = tl.minimum(start + per_split, NK)
    acc, m_i, l_i = _dot_gather(q, K + b * sk_b + h * sk_h, sk_t, V + b * sv_b + h * sv_h, sv_t,
                                IDX + b * si_b + h * si_h + m * si_m, VA, b, sva_b, start, end, qk_scale, cap,
                                offs_d, d_ok, offs_v, v_ok, 16, DVP, HAS_VALID, BK, IEEE, SOFTCAP, ISTEPS)
    out, lse = _normalised(acc, m_i, l_i)
    first = offs_r == 0
    tl.store(PO + pid_s * rows * DV + pid_row.to(tl.int64) * DV + offs_r[:, None] * 0 + offs_v[None, :], out,
             mask=first[:, None] & v_ok[None, :])
    tl.store(PL + pid_s * rows + pid_row + offs_r * 0, lse, mask=first)


@triton.jit
def _select_gather_kernel(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b,
                          K, sk_b, sk_h, sk_t, V, sv_b, sv_h, sv_t, IDX, PO, PL, T, KK, HQ, G, qk_scale, cap,
                          W: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr,
                          HAS_VALID: tl.constexpr, UNROLL: tl.constexpr, NP: tl.constexpr, GROUP: tl.constexpr,
                          MP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                          BK: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr = False):
    """One selection row (a query head, or with ``GROUP`` > 1 a kv head's summed query rows) of :func:`_select_kernel`
    (one chunk: every token's label key in registers, the exact top-``KK``), then in the same program the attention of
    the row's ``GROUP`` query rows over the tokens it chose (:func:`_dot_gather`, ``BK`` per step): no second launch,
    no split merge.  The indices go through ``IDX`` (written, then read back by the program's other threads after a
    barrier)."""
    pid = tl.program_id(0)  # b * HQ + hq
    hq = (pid % HQ).to(tl.int64)
    b = (pid // HQ).to(tl.int64)
    h = hq // G
    offs = tl.arange(0, NP)
    ok = offs < T
    key = _label_keys(Q, sq_b, sq_h, sq_g, CH, sch_h, L, sl_b, sl_h, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b, b, hq, h,
                      offs, ok, W, PER, BITS, QUANT, HAS_VALID, UNROLL, NP, GROUP)
    chosen, slot = _top_slots(key, KK, INTERP)
    row = pid.to(tl.int64) * KK
    tl.store(IDX + row + slot, offs, mask=chosen)
    tl.debug_barrier()  # every thread's indices stored before any thread reads them
    q, offs_m, m_ok, offs_d, d_ok, offs_v, v_ok = _query_rows(Q + b * sq_b + hq * sq_h, sq_g, GROUP, D, DP, DV, DVP,
                                                              MP)
    acc, m_i, l_i = _dot_gather(q, K + b * sk_b + h * sk_h, sk_t, V + b * sv_b + h * sv_h, sv_t, IDX + row, VA, b,
                                sva_b, 0, KK, qk_scale, cap, offs_d, d_ok, offs_v, v_ok, MP, DVP, HAS_VALID, BK, IEEE,
                                SOFTCAP)
    out, lse = _normalised(acc, m_i, l_i)
    out_row = pid.to(tl.int64) * GROUP + offs_m  # query head (b, hq * GROUP + m): rows [B, Hq] in head order
    tl.store(PO + out_row[:, None] * DV + offs_v[None, :], out, mask=m_ok[:, None] & v_ok[None, :])
    tl.store(PL + out_row, lse, mask=m_ok)


def shared_rows(index: torch.Tensor) -> bool:
    """Whether every query row of a kv head reads the same indices (a group-shared selection's stride-0 view)."""
    return index.shape[2] > 1 and index.stride(2) == 0


def supports_gather(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether :func:`gather_partial_attention` handles these arguments (else use the reference)."""
    if query.dim() != 4 or k.dim() != 4 or v.dim() != 4 or index.dim() != 4:
        return False
    dt = (torch.float16, torch.bfloat16, torch.float32)
    if query.dtype not in dt or k.dtype not in dt or v.dtype not in dt:
        return False
    if k.shape[-1] > MAX_DIM or v.shape[-1] > MAX_DIM or query.shape[-1] != k.shape[-1]:
        return False
    return all(x.stride(-1) == 1 for x in (query, k, v, index))


# measured on an H200 (benchmarks/gpu_doublesparse.py sweep, Llama heads, 32k tokens, B 1 and 16): per-row
# programs want 2 warps, 64 indices per step and ~4 (few rows) to 8 (many rows) programs per SM; the shared
# (tensor-core) kernel 4 warps, 128 indices per step, 4 programs per SM.  programs_per_sm None = that rule.
# min_per_split: indices a split reads at least (fewer splits were slower for the per-row gather at every shape
# measured and 2-7% faster for the shared one at B1-B4 with 256: docs/results.md "Session 21")
# rows_dot: per-row selections read by _gather_rows_dot_kernel (tensor cores, pipelined gathers; num_warps warps)
# instead of _gather_kernel (CUDA cores, synchronous index -> K -> V loads).  Session 28 (gpu_paged_sweep.sh with
# PS_VAR=KVCOMPRESS_DS_CONFIG, 8 shapes, ds8 / ds16): with 2 warps within 0.7% or faster at every shape, up to 1.38x
# (SmolLM2 B16/32k ds8 217.7 -> 157.3 us); 4 warps or 4 stages or 32 indices per step no better
# index_steps (opt-in, session 37): > 1 loads the indices of that many steps at once, the tensor-core gathers' steps
# taking theirs from registers (_dot_gather: without it each step waits for every copy in flight).  Session 38 (H200,
# 15 reads x 2 rounds): 4 steps 1.4-1.5% slower (geometric mean; +11% at Llama B4/32k 1/16 shared: 139 KB of shared
# memory), 8 steps with shared_block_k 64 within 0.3%
GATHER_CONFIG = dict(block_k=64, programs_per_sm=None, num_warps=2, num_stages=3, shared_warps=4, shared_block_k=128,
                     shared_programs_per_sm=4, min_per_split=64, rows_dot=True, pdl="auto", index_steps=0)


def gather_partial_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                             index: torch.Tensor, scale: float, *, splits: int | None = None,
                             block_k: int | None = None, config: dict | None = None,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`.reference.gather_partial_attention` (``softcap``: applied in the kernels).

    ``config`` overrides :data:`GATHER_CONFIG` (indices per step, programs per SM and indices per split for the
    split count, warps, stages; ``shared_*`` for the group-shared kernel; ``KVCOMPRESS_DS_CONFIG`` entries come
    between the two): a benchmark knob, not needed for correctness.
    """
    cfg = {**GATHER_CONFIG, **{k: v for k, v in _env_config().items() if k in GATHER_CONFIG}, **(config or {})}
    if not supports_gather(query, k, v, index):
        raise ValueError("gather_partial_attention: unsupported arguments (see supports_gather)")
    steps = power_of_two_setting("KVCOMPRESS_DS_CONFIG", "index_steps", cfg["index_steps"] or 0, "0 or a power of two",
                                 zero=True)
    b, h, m, d = query.shape
    nk = index.shape[-1]
    dv = v.shape[-1]
    rows = b * h * m
    out = torch.empty(b, h, m, dv, device=query.device, dtype=torch.float32)
    lse = torch.empty(b, h, m, device=query.device, dtype=torch.float32)
    if rows == 0:
        return out, lse
    if nk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    shared = shared_rows(index) and m <= 64
    programs = b * h if shared else rows
    pdl = pdl_for(cfg["pdl"], rows, query.device)
    block_k = int(block_k or (cfg["shared_block_k"] if shared else cfg["block_k"]))
    if splits is None:
        sms = num_sms(query.device.index or 0) if query.is_cuda else 4
        per_sm = cfg["shared_programs_per_sm"] if shared else cfg["programs_per_sm"]
        if per_sm is None:
            per_sm = 4 if programs < 2 * sms else 8
        splits = max(1, min(triton.cdiv(nk, max(block_k, int(cfg["min_per_split"]))),
                            triton.cdiv(int(per_sm * sms), programs)))
    per_split = triton.cdiv(triton.cdiv(nk, splits), block_k) * block_k
    splits = triton.cdiv(nk, per_split)
    po = torch.empty(splits, rows, dv, device=query.device, dtype=torch.float32)
    pl = torch.empty(splits, rows, device=query.device, dtype=torch.float32)
    va = valid.view(torch.uint8) if valid is not None else pl
    if shared:
        _gather_shared_kernel[(b * h, splits)](
            query, query.stride(0), query.stride(1), query.stride(2),
            k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2),
            va, va.stride(0) if valid is not None else 0,
            index, index.stride(0), index.stride(1), po, pl, h, m, nk, per_split, scale * 1.4426950408889634,
            cap_base2(softcap), MP=max(16, pow2(m)), D=d, DP=max(16, pow2(d)), DV=dv, DVP=max(16, pow2(dv)),
            HAS_VALID=valid is not None, BK=block_k, IEEE=k.dtype == torch.float32, SOFTCAP=bool(softcap),
            PDL=pdl, ISTEPS=steps, num_warps=int(cfg["shared_warps"]), num_stages=int(cfg["num_stages"]),
            **pdl_launch(pdl))
    else:  # per-row selections: on tensor cores (rows_dot) or CUDA cores, the same arguments
        if cfg["rows_dot"]:
            kernel = _gather_rows_dot_kernel
            extra = dict(IEEE=k.dtype == torch.float32, num_warps=int(cfg["num_warps"]), ISTEPS=steps)
        else:
            kernel, extra = _gather_kernel, dict(num_warps=int(cfg["num_warps"]))
        kernel[(rows, splits)](
            query, query.stride(0), query.stride(1), query.stride(2),
            k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2),
            va, va.stride(0) if valid is not None else 0,
            index, index.stride(0), index.stride(1), index.stride(2), po, pl, h, m, nk, per_split,
            scale * 1.4426950408889634, cap_base2(softcap),
            D=d, DP=max(16, pow2(d)), DV=dv, DVP=max(16, pow2(dv)), HAS_VALID=valid is not None, BK=block_k,
            SOFTCAP=bool(softcap), PDL=pdl, num_stages=int(cfg["num_stages"]), **extra, **pdl_launch(pdl))
    if splits == 1:
        return po.view(b, h, m, dv), pl.view(b, h, m)
    combine_splits(po, pl, out, lse, splits, b * h * m, dv, pdl=pdl)
    return out, lse


#: the fused select + gather (:func:`select_gather_partial`) reads its selection in steps of this many indices (at
#: most; all of them in one step when fewer)
FUSED_GATHER_BLOCK = 256


def supports_select_gather(query: torch.Tensor, labels: Labels, channels: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, kk: int, group: int = 1, chunk: int = FUSED_MAX_TOKENS) -> bool:
    """Whether :func:`select_gather_partial` runs its one kernel: one fused select chunk (:func:`supports_fused`),
    ``group`` 1 or every query head of a kv head, and the gather's shapes and dtypes (:func:`supports_gather`)."""
    if query.dim() != 3 or k.dim() != 4 or k.shape[1] == 0 or query.shape[1] % k.shape[1]:
        return False
    b, hq, d = query.shape
    g = hq // k.shape[1]
    if group not in (1, g) or not 0 < kk <= labels.num_tokens:
        return False
    if labels.num_tokens > min(chunk, FUSED_MAX_TOKENS) or \
            not supports_fused(group_rows(query, labels, channels, group, checked=True), labels, channels, kk, chunk):
        return False  # (more than one select chunk: the candidates would need a merge)
    return supports_gather(query.view(b, k.shape[1], g, d), k, v, query.new_empty(1, 1, 1, 1, dtype=torch.int64))


#: ``fuse_gather: None``: where the one-kernel select + gather (:func:`select_gather_partial`) is taken
#: (:func:`fuse_rule`), fitted to every one-kernel / two-kernel pair measured on H100s (132 SMs; session 43 at 4k,
#: session 45 at 4k - 16k, B1 - B64, both head shapes, per query head and group-shared; ``python
#: benchmarks/fuse_rule_fit.py`` prints each pair beside the rule's choice).  One program selects and then gathers its
#: whole selection, so:
#: - over more than :data:`FUSE_MOST_PER_SM` programs per SM it is slower: the select holds its label keys in
#:   registers, the gather that follows runs at that residency, and the two kernels gather at full residency (Llama
#:   heads at 4k, 512 and 2048 programs: +59 to +138 %; SmolLM2 heads, 576 programs: -4 / +1 %; up to 192: faster);
#: - over a label cache of at most :data:`FUSE_SHORT_TOKENS` slots it is faster for selections of up to
#:   :data:`FUSE_ALWAYS_K` tokens at any number of programs (3 - 192: 2.6 - 23 %), and of up to :data:`FUSE_WIDE_K`
#:   where the launch has more programs than a quarter of the SMs (36 - 192: -19 to +1 %; 3 - 32 programs: +3 to
#:   +10 %, but Llama B4 group-shared, 32 programs: -5 %);
#: - over longer caches (8k, 16k: more label keys in registers) only with head dim :data:`FUSE_LONG_HEAD_DIM`+ and at
#:   least :data:`FUSE_LONG_WAVE` x SMs programs (Llama, 128 programs: 5 - 14 % faster at k 512 - 2048); SmolLM2 heads
#:   (d 64) at 3 - 144 programs were 1 - 60 % slower (but 48 programs group-shared, k 512 of 8k: -5 %), Llama heads at
#:   8 / 32 programs 2 - 57 % slower (but B4 group-shared, k 512 of 8k: -6 %).
FUSE_ALWAYS_K = 256
FUSE_WIDE_K = 512
FUSE_SHORT_TOKENS = 4096
FUSE_MOST_PER_SM = 2
FUSE_LONG_HEAD_DIM = 128
FUSE_LONG_WAVE = 0.9


def fuse_rule(kk: int, programs: int, sms: int, tokens: int, head_dim: int) -> bool:
    """``fuse_gather: None``: whether a decode read selecting ``kk`` of ``tokens`` label slots for each of ``programs``
    selection rows (batch x query heads, or x kv heads group-shared) with keys of ``head_dim`` channels, on ``sms``
    SMs, takes the one-kernel select + gather (the measurements: :data:`FUSE_ALWAYS_K`):

    - never over more than ``FUSE_MOST_PER_SM * sms`` programs;
    - with ``tokens <= FUSE_SHORT_TOKENS``: ``kk <= FUSE_ALWAYS_K``, or ``kk <= FUSE_WIDE_K`` and
      ``4 * programs > sms``;
    - with more tokens: ``head_dim >= FUSE_LONG_HEAD_DIM`` and ``programs >= FUSE_LONG_WAVE * sms``."""
    if programs > FUSE_MOST_PER_SM * sms:
        return False
    if tokens <= FUSE_SHORT_TOKENS:
        return kk <= FUSE_ALWAYS_K or (kk <= FUSE_WIDE_K and 4 * programs > sms)
    return head_dim >= FUSE_LONG_HEAD_DIM and programs >= FUSE_LONG_WAVE * sms


def fuse_gather_setting() -> bool | None:
    """``fuse_gather`` of :data:`SELECT_CONFIG` / ``KVCOMPRESS_DS_CONFIG``: ``True`` / ``False`` force the one-kernel
    read on / off, ``None`` (the default) leaves it to :func:`fuse_rule`; anything else is refused."""
    setting = _select_base()["fuse_gather"]
    if setting is not None and not isinstance(setting, bool):
        raise ValueError(f"KVCOMPRESS_DS_CONFIG: fuse_gather must be true, false or null, got {setting!r}")
    return setting


def fuse_gather_for(kk: int, programs: int, device: torch.device, tokens: int, head_dim: int) -> bool:
    """Whether a read of ``programs`` selection rows of ``kk`` of ``tokens`` label slots, keys of ``head_dim``
    channels, on ``device`` takes the one kernel: :func:`fuse_gather_setting`, or where it is ``None``
    :func:`fuse_rule` on the device's SMs (4 on the CPU, as :func:`select_launch` counts there)."""
    setting = fuse_gather_setting()
    if setting is not None:
        return setting
    device = torch.device(device)
    return fuse_rule(kk, programs, num_sms(device.index or 0) if device.type == "cuda" else 4, tokens, head_dim)


def fuses_gather(query: torch.Tensor, labels: Labels, channels: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kk: int, group: int = 1) -> bool:
    """Whether a model's DoubleSparse decode read (:func:`kvcompress.kernels.doublesparse.select_gather_attention`)
    takes the one-kernel select + gather: :func:`fuse_gather_for` its selection rows (batch x query heads, or x kv
    heads with ``group`` > 1) and :func:`supports_select_gather`."""
    rows = query.shape[0] * (query.shape[1] if group == 1 else k.shape[1])
    return fuse_gather_for(kk, rows, query.device, labels.num_tokens, k.shape[-1]) and supports_select_gather(
        query, labels, channels, k, v, kk, group, _select_base()["chunk_tokens"])


def one_chunk_tokens() -> int:
    """The most label tokens one select program takes (one chunk: the fused select + gather's limit)."""
    return min(FUSED_MAX_TOKENS, _select_base()["chunk_tokens"])


def select_gather_partial(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                          k: torch.Tensor, v: torch.Tensor, kk: int, scale: float, group: int = 1,
                          softcap: float | None = None, config: dict | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`.reference.select_gather_partial`.  One program per selection row computes the row's label keys,
    its exact top-``kk`` (the fused select's code, the same indices as :func:`select_topk`) and the attention of its
    query rows over them (session 41; a model's read takes it where :func:`fuses_gather` says so;
    ``benchutil`` ops ``ds*-fused``).  Where :func:`supports_select_gather` says no: :func:`select_topk`, then
    :func:`gather_partial_attention`.  ``index`` comes back as int32."""
    cfg = dict(_select_base(), **(config or {}))
    interp = search_interp(cfg["search"])
    b, hq, d = query.shape
    hkv = k.shape[1]
    g = hq // hkv if hkv else 1
    if group not in (1, g):
        raise ValueError(f"select_gather_partial: group must be 1 (a selection per query head) or {g} (one per kv "
                         f"head), got {group}")
    chunk = cfg["chunk_tokens"]
    if not supports_select_gather(query, labels, channels, k, v, kk, group, chunk):
        index = select_topk(query, labels, channels, valid, kk, config=config, group=group)
        out, lse = gather_partial_attention(query.view(b, hkv, g, d), k, v, valid, selection_rows(index, hkv, g),
                                            scale, softcap=softcap)
        return out, lse, index
    sel = group_rows(query, labels, channels, group, checked=True)  # one row per selection (its first query head)
    rows = sel.shape[1]
    t = labels.num_tokens
    dev = query.device
    dv = v.shape[-1]
    channels = channels.to(device=dev).contiguous()
    index = torch.empty(b, rows, kk, device=dev, dtype=torch.int32)
    out = torch.empty(b, hq, dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, hq, device=dev, dtype=torch.float32)
    label_args, label_consts = _label_args(labels, valid, out)
    np_ = max(16, pow2(t))
    ept, unroll = _device_launch(cfg, b * rows, dev)
    warps = _warps(np_, ept)
    _select_gather_kernel[(b * rows,)](
        sel, sel.stride(0), sel.stride(1), query.stride(1), channels, channels.stride(0), *label_args,
        k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2),
        index, out, lse, t, kk, rows, rows // hkv, scale * 1.4426950408889634, cap_base2(softcap),
        **label_consts, UNROLL=_divisor(label_consts["W"], unroll), NP=np_, GROUP=group,
        MP=max(16, pow2(group)), D=d, DP=max(16, pow2(d)), DV=dv, DVP=max(16, pow2(dv)),
        BK=min(FUSED_GATHER_BLOCK, max(16, pow2(kk))), IEEE=k.dtype == torch.float32, SOFTCAP=bool(softcap),
        INTERP=interp, num_warps=warps)
    return out.view(b, hkv, g, dv), lse.view(b, hkv, g), index
