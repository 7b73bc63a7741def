"""Fused KIVI decode attention in Triton (v2): reads packed 2/4-bit codes in place.

Same signature and semantics as :func:`.reference.kivi_attention_partial`
(``(out fp32 [B, Hkv, M, Dv], lse fp32 [B, Hkv, M])``).  Nothing is compiled at
import; each configuration is JIT-compiled by Triton on first use.

How one program works (split-KV flash decoding: one kv head, one block of query
rows, a range of tokens, ``BN`` tokens per loop iteration):

* Both code tensors are packed along **channels** (``reference.py``: keys
  ``[B, H, NG, Dk/PER, G]``, word-major inside a token group, values ``[B, H, T, Dv/PER]``),
  and inside a word even codes fill the low 16-bit half and odd codes the high half.
  A word therefore unpacks into packed fp16 pairs of *adjacent channels of one token*:
  ``(w & mask) | exponent`` is one LOP3 giving ``E + code`` in both halves (a code in the
  mantissa of a half with a fixed exponent is an exact fp16 number, no int->float
  conversion), ``- E`` one HSUB2, and ``* scale + zero`` one HFMA2 - 1.5 instructions per
  two codes.  The unpacked tiles come out in natural channel order (no permutation
  bookkeeping for the query, the output or the scales).
* The key tile ``[BN, Dk]`` and value tile ``[BN, Dv]`` feed ``tl.dot`` (fp16 operands,
  fp32 accumulation, tensor cores).  ``TRANS`` (default) computes ``S^T = K q^T`` and
  ``O^T = V^T P^T``: the GQA rows are the small N operand (padded to ``min_rows``, 8 by
  default - half the padding of the 16-row M operand), the token and channel tiles are M.
* Online softmax in base 2; ``LAZY`` rescales the accumulator only in the iterations
  where a row maximum grows (a warp-uniform branch; rare after the first blocks).
* Default launch (measured on an H200): 1-warp CTAs, 16-token tiles, registers capped at 128, so the
  softmax reductions stay inside a warp and ~16 CTAs per SM hide latency; the split count targets two
  waves of them.  The valid flags and value scales (too small for async copies) are prefetched one tile
  ahead in registers; ``num_stages`` software-pipelines the code and key-scale loads.  Each split writes a
  normalised partial and its LSE; a second small kernel merges the splits (skipped for one split).

Performance (H200, Triton 3.6; docs/results.md "KIVI decode kernel", v2): correct to fp16 level;
Llama B = 16, 32k: 552 us for KIVI-2 (0.88x torch SDPA on the fp16 cache, 1.22x the v1 kernel), 0.74
TB/s on the compressed bytes.  Still latency-bound (~4.8 SASS instructions per code, issued at about a
quarter of the SMs' rate); slower than v1 at B = 1.

Inputs: the query may be any float dtype and any strides (it is tiny).  Packed
tensors may be strided views (the first ``n`` groups of a preallocated buffer) as
long as their innermost dimensions are contiguous (``[Dk/PER, G]`` words per key
group, ``[Dv/PER]`` words and ``[Dv/Gv]`` scales per value token, ``[Dk]`` scales per key
group, the tokens of ``valid``); otherwise they are copied with ``.contiguous()``.

Limits (:func:`supports`, the dispatcher's capability check): key group ``G`` a power of
two in 16..128; an even ``Dk`` up to 256 (padded in registers to a power of two); ``Dv`` a
multiple of ``PER`` and of the value group ``Gv`` (a power of two >= 2), up to 256; per-channel
keys (the ``k_per_token`` ablation goes to the reference).

Tuning: :func:`_config` holds the measured defaults; ``KVCOMPRESS_KIVI_CONFIG`` (JSON)
overrides them for experiments (``benchmarks/gpu_kivi.py`` sweeps it).
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import cap_base2, combine_splits, soft_cap
from kvcompress.kernels.attention.triton_shared import num_sms as _num_sms
from kvcompress.kernels.attention.triton_shared import pow2 as _pow2

from .reference import PackedKV, codes_per_word

LOG2E = 1.4426950408889634
MAX_DIM = 256


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _halves(x):
    """int32 ``[...]`` holding two fp16 -> (low, high) fp16 ``[...]`` (bit casts, no arithmetic)."""
    lo = x.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _pair(lo, hi):
    """Two fp16 ``[...]`` -> one int32 ``[...]`` holding them (low, high)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _deq(src, s: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Field ``s`` of both 16-bit halves of each word as exact codes: int32 holding fp16 ``(low, high)``.

    ``src`` is the word (or the word shifted down, for the fields above bit 9 of a half).  A code inside
    the 10-bit mantissa of a half becomes a number without an int->float conversion: OR-ing in the
    exponent of ``E = 2**(10 - BITS*s')`` gives exactly ``E + code`` (``s'`` the field's slot counted
    from bit 0; one LOP3 for both halves), then ``- E`` is one exact HSUB2.
    """
    DIRECT: tl.constexpr = 10 // BITS
    SP: tl.constexpr = s if s < DIRECT else s - DIRECT
    EXP: tl.constexpr = ((25 - BITS * SP) << 10) * 0x10001
    E: tl.constexpr = 1 << (10 - BITS * SP)
    MASK: tl.constexpr = (((1 << BITS) - 1) * 0x10001) << (BITS * SP)
    if ASM:  # EXP read as an fp16 pair is exactly (E, E): the same constant serves the OR and the subtraction
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, $2, $3, 0xea; sub.f16x2 $0, t, $3; }",
            "=r,r,r,r", [src, tl.full(src.shape, MASK, tl.int32), tl.full(src.shape, EXP, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        xl, xh = _halves((src & MASK) | EXP)
        return _pair(xl - E, xh - E)


@triton.jit
def _fma(y, sc, zc, ASM: tl.constexpr):
    """``y * sc + zc`` on int32 tensors each holding an fp16 pair: one ``fma.rn.f16x2`` per element."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [y, sc, zc],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        yl, yh = _halves(y)
        sl, sh = _halves(sc)
        zl, zh = _halves(zc)
        return _pair(yl * sl + zl, yh * sh + zh)


@triton.jit
def _codes(w, BITS: tl.constexpr, ASM: tl.constexpr):
    """int32 words ``[...]`` -> exact codes as int32 fp16 pairs ``[..., 2, 2, 2]`` (2-bit) / ``[..., 2, 2]``.

    Element ``[..., b2, b1, b0]`` holds codes ``2f`` and ``2f + 1`` of the word, ``f = 4*b2 + 2*b1 + b0``.
    Each ``tl.join`` appends the fastest-varying register dimension, so the highest field bit is joined
    first: the fields of a word end up in registers in natural order.
    """
    DIRECT: tl.constexpr = 10 // BITS
    hi = w >> (BITS * DIRECT)  # fields above bit 9 of a half, shifted once per word
    if BITS == 2:
        a = tl.join(_deq(w, 0, BITS, ASM), _deq(w, 4, BITS, ASM))
        b = tl.join(_deq(w, 1, BITS, ASM), _deq(hi, 5, BITS, ASM))
        c = tl.join(_deq(w, 2, BITS, ASM), _deq(hi, 6, BITS, ASM))
        d = tl.join(_deq(w, 3, BITS, ASM), _deq(hi, 7, BITS, ASM))
        return tl.join(tl.join(a, c), tl.join(b, d))
    else:
        return tl.join(tl.join(_deq(w, 0, BITS, ASM), _deq(hi, 2, BITS, ASM)),
                       tl.join(_deq(w, 1, BITS, ASM), _deq(hi, 3, BITS, ASM)))


@triton.jit
def _to_f16(y):
    """int32 fp16 pairs ``[...]`` -> fp16 ``[..., 2]`` (the half is the fastest register dim: no data movement)."""
    lo, hi = _halves(y)
    return tl.join(lo, hi)


@triton.jit
def _small_loads(va_base, vs_base, vz_base, t0, t_end, j, svs_t, svz_t, vgrp, vw_ok,
                 BITS: tl.constexpr, PER: tl.constexpr, GV: tl.constexpr):
    """Valid flags and value scales / zeros of the tile at ``t0``: the loads too small for async copies.

    They are issued one iteration ahead (register prefetch), so their latency hides behind a tile of work.
    """
    t = t0 + j
    t_ok = t < t_end
    ok = tl.load(va_base + t, mask=t_ok, other=0) != 0
    if GV >= PER:
        v_ok = t_ok[:, None] & vw_ok[None, :]
        vs = tl.load(vs_base + t[:, None] * svs_t + vgrp, mask=v_ok, other=0.0)
        vz = tl.load(vz_base + t[:, None] * svz_t + vgrp, mask=v_ok, other=0.0)
    elif BITS == 2:
        vf_ok = t_ok[:, None, None, None, None] & vw_ok[None, :, None, None, None]
        tv = t[:, None, None, None, None]
        vs = tl.load(vs_base + tv * svs_t + vgrp, mask=vf_ok, other=0.0)
        vz = tl.load(vz_base + tv * svz_t + vgrp, mask=vf_ok, other=0.0)
    else:
        vf_ok = t_ok[:, None, None, None] & vw_ok[None, :, None, None]
        tv = t[:, None, None, None]
        vs = tl.load(vs_base + tv * svs_t + vgrp, mask=vf_ok, other=0.0)
        vz = tl.load(vz_base + tv * svz_t + vgrp, mask=vf_ok, other=0.0)
    return ok & t_ok, vs, vz


@triton.jit
def _attend_tokens(Q, q_off, sq_m, CH, ch_off, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base, va_base,
                   skc_g, sks_g, skz_g, svc_t, svs_t, svz_t, t_start, t_end, qk_scale, cap, M, pid_m, LG, lg_off, slg_m,
                   HAS_CHAN: tl.constexpr, DK: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr,
                   DV: tl.constexpr, VW_PAD: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr, LAZY: tl.constexpr,
                   ASM: tl.constexpr, PREFETCH: tl.constexpr, SOFTCAP: tl.constexpr, LOGITS: tl.constexpr):
    """Flash decoding of one KV head over tokens ``[t_start, t_end)`` of a packed region: ``(out [BLOCK_M, DV_PAD]``
    normalised, ``lse [BLOCK_M, 1]`` natural log, ``-inf`` where no token was valid) - the inner loop of both Triton
    KIVI kernels (:func:`_kivi_split_kernel`, one head of a plain region; the lanes kernel, one head of one lane).

    ``*_base``: the head's code / scale / zero tensors (``ks_base`` / ``kz_base`` as int32 pairs of adjacent
    channels) and the row's valid flags.  ``HAS_CHAN``: the query is gathered to the ``DK`` channels listed at
    ``CH + ch_off`` (a LeanK lane's kept channels; else the first ``DK``).  ``LOGITS``: every score is also stored
    (natural-log units, ``-inf`` where masked) at ``LG + lg_off + row * slg_m + token``."""
    PER: tl.constexpr = 32 // BITS
    HP: tl.constexpr = PER // 2  # fields (code pairs) per word
    DK_PAD: tl.constexpr = KW_PAD * PER
    DV_PAD: tl.constexpr = VW_PAD * PER
    NB: tl.constexpr = BN // G if BN > G else 1  # key groups per tile
    GT: tl.constexpr = BN // NB  # tokens of one group in a tile

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_c = tl.arange(0, DK_PAD)
    c_ok = offs_c < DK
    if HAS_CHAN:  # the lane's kept channels: the query is gathered here, not by a launch of its own
        ch = tl.load(CH + ch_off + offs_c, mask=c_ok, other=0)
    else:
        ch = offs_c
    q = tl.load(Q + q_off + offs_m[:, None] * sq_m + ch[None, :], mask=m_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)
    q = (q * qk_scale).to(tl.float16)  # softmax scale * log2(e) folded in: exp2 below

    j = tl.arange(0, BN)
    offs_kw = tl.arange(0, KW_PAD)
    kw_ok = offs_kw < KW
    offs_nb = tl.arange(0, NB)
    offs_gt = tl.arange(0, GT)
    # key words of a tile [KW_PAD, NB, GT]: word-major inside a group, tokens contiguous
    kw_off = offs_kw[:, None, None] * G + offs_nb[None, :, None] * skc_g + offs_gt[None, None, :]
    # scale / zero pairs of a tile, shaped like the unpacked fields: [KW_PAD, NB, 1, 2, 2(, 2)]
    f2 = tl.arange(0, 2)
    if BITS == 2:
        fld3 = f2[:, None, None] * 4 + f2[None, :, None] * 2 + f2[None, None, :]
        fld = fld3[None, None, None, :, :, :]
        kp_off = offs_kw[:, None, None, None, None, None] * HP + fld
        nb_x = offs_nb[None, :, None, None, None, None]
        kp_ok = kw_ok[:, None, None, None, None, None] & (fld < HP) & (kp_off < DK // 2)  # padded last word
    else:
        fld3 = f2[:, None] * 2 + f2[None, :]
        fld = fld3[None, None, None, :, :]
        kp_off = offs_kw[:, None, None, None, None] * HP + fld
        nb_x = offs_nb[None, :, None, None, None]
        kp_ok = kw_ok[:, None, None, None, None] & (fld < HP) & (kp_off < DK // 2)
    offs_vw = tl.arange(0, VW_PAD)
    vw_ok = offs_vw * PER < DV
    if GV >= PER:  # one value group per word
        vgrp = ((offs_vw * PER) // GV)[None, :]
    elif BITS == 2:  # per field
        vgrp = ((offs_vw[:, None, None, None] * PER + 2 * fld3[None, :, :, :]) // GV)[None, :, :, :, :]
    else:
        vgrp = ((offs_vw[:, None, None] * PER + 2 * fld3[None, :, :]) // GV)[None, :, :, :]

    if TRANS:
        m_i = tl.full([1, BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([1, BLOCK_M], tl.float32)
        acc = tl.zeros([DV_PAD, BLOCK_M], tl.float32)
        qt = tl.trans(q)
        RED: tl.constexpr = 0
    else:
        m_i = tl.full([BLOCK_M, 1], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M, 1], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        RED: tl.constexpr = 1

    if PREFETCH:
        ok, vs, vz = _small_loads(va_base, vs_base, vz_base, t_start, t_end, j, svs_t, svz_t, vgrp, vw_ok, BITS,
                                  PER, GV)
    for t0 in range(t_start, t_end, BN):
        t = t0 + j
        t_ok = t < t_end
        g0 = t0 // G
        if PREFETCH:
            ok_n, vs_n, vz_n = _small_loads(va_base, vs_base, vz_base, t0 + BN, t_end, j, svs_t, svz_t, vgrp, vw_ok,
                                            BITS, PER, GV)
        else:
            ok, vs, vz = _small_loads(va_base, vs_base, vz_base, t0, t_end, j, svs_t, svz_t, vgrp, vw_ok, BITS,
                                      PER, GV)
        # ---- keys: [BN, DK_PAD] dequantized in registers
        tk_ok = ((t0 + offs_nb * GT)[None, :, None] + offs_gt[None, None, :]) < t_end
        kw = tl.load(kc_base + g0 * skc_g + (t0 % G) + kw_off, mask=kw_ok[:, None, None] & tk_ok, other=0)
        ks = tl.load(ks_base + (g0 + nb_x) * sks_g + kp_off, mask=kp_ok, other=0)
        kz = tl.load(kz_base + (g0 + nb_x) * skz_g + kp_off, mask=kp_ok, other=0)
        kt = _to_f16(_fma(_codes(kw, BITS, ASM), ks, kz, ASM))  # [KW_PAD, NB, GT, 2, .., 2]
        if BITS == 2:
            kt = tl.permute(kt, (1, 2, 0, 3, 4, 5, 6))
        else:
            kt = tl.permute(kt, (1, 2, 0, 3, 4, 5))
        k = tl.reshape(kt, (BN, DK_PAD))
        if TRANS:
            s = tl.dot(k, qt)  # [BN, BLOCK_M]
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BN]
        if SOFTCAP:
            s = soft_cap(s, cap)
        if TRANS:
            s = tl.where(ok[:, None], s, float("-inf"))
        else:
            s = tl.where(ok[None, :], s, float("-inf"))
        if LOGITS:
            if TRANS:
                tl.store(LG + lg_off + offs_m[None, :] * slg_m + t[:, None], s * 0.6931471805599453,
                         mask=t_ok[:, None] & m_ok[None, :])
            else:
                tl.store(LG + lg_off + offs_m[:, None] * slg_m + t[None, :], s * 0.6931471805599453,
                         mask=m_ok[:, None] & t_ok[None, :])

        # ---- online softmax (base 2)
        m_blk = tl.max(s, axis=RED, keep_dims=True)
        if LAZY:
            if tl.max(m_blk - m_i) > 0:  # some row maximum grew: rescale (block-uniform branch)
                m_new = tl.maximum(m_i, m_blk)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha
                l_i = l_i * alpha
                m_i = m_new
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = tl.exp2(s - m_safe)
            l_i = l_i + tl.sum(p, axis=RED, keep_dims=True)
        else:
            m_new = tl.maximum(m_i, m_blk)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=RED, keep_dims=True)
            acc = acc * alpha
            m_i = m_new

        # ---- values: [BN, DV_PAD] dequantized in registers
        v_ok = t_ok[:, None] & vw_ok[None, :]
        vw = tl.load(vc_base + t[:, None] * svc_t + offs_vw[None, :], mask=v_ok, other=0)
        vsp = _pair(vs, vs)
        vzp = _pair(vz, vz)
        if GV >= PER:
            if BITS == 2:
                vsp = vsp[:, :, None, None, None]
                vzp = vzp[:, :, None, None, None]
            else:
                vsp = vsp[:, :, None, None]
                vzp = vzp[:, :, None, None]
        vt = _to_f16(_fma(_codes(vw, BITS, ASM), vsp, vzp, ASM))  # [BN, VW_PAD, 2, .., 2]
        v = tl.reshape(vt, (BN, DV_PAD))
        if TRANS:
            acc = tl.dot(tl.trans(v), p.to(tl.float16), acc)  # [DV_PAD, BLOCK_M]
        else:
            acc = tl.dot(p.to(tl.float16), v, acc)  # [BLOCK_M, DV_PAD]
        if PREFETCH:
            ok, vs, vz = ok_n, vs_n, vz_n

    if TRANS:
        acc = tl.trans(acc)
        m_i = tl.reshape(m_i, [BLOCK_M, 1])
        l_i = tl.reshape(l_i, [BLOCK_M, 1])
    # normalised partial + natural-log LSE (-inf and zeros when nothing was valid)
    l_ok = l_i > 0.0
    out = acc / tl.where(l_ok, l_i, 1.0)
    lse = tl.where(l_ok, (m_i + tl.log2(tl.where(l_ok, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _kivi_split_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, VALID, LENGTH, OUT, LSE,
    qk_scale, cap, M, H, NT, tokens_per_split,
    sq_b, sq_h, sq_m,
    skc_b, skc_h, skc_g,
    sks_b, sks_h, sks_g,
    skz_b, skz_h, skz_g,
    svc_b, svc_h, svc_t,
    svs_b, svs_h, svs_t,
    svz_b, svz_h, svz_t,
    sva_b,
    so_s, so_b, so_h, so_m,
    sl_s, sl_b, sl_h,
    LG, slg_b, slg_h,
    DK: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr, DV: tl.constexpr, VW_PAD: tl.constexpr,
    G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
    TRANS: tl.constexpr, LAZY: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, HAS_LENGTH: tl.constexpr,
    SOFTCAP: tl.constexpr, LOGITS: tl.constexpr,
):
    """One (split, batch*kv-head, row block): flash-decoding over ``tokens_per_split`` tokens.

    ``LOGITS``: every score is also stored (natural-log units, ``-inf`` where masked) at
    ``LG + b * slg_b + h * slg_h + row * NT + token`` (a contiguous ``[B, H, M, NT]`` float32 tensor).

    ``KS`` / ``KZ`` are the key scales / zeros viewed as int32 pairs of adjacent channels (strides in pairs).
    ``HAS_LENGTH``: ``LENGTH`` points to the number of leading token slots that may be live (a 0-dim device
    tensor); slots at or after it are neither loaded nor attended (a split entirely beyond it exits at once).
    ``SOFTCAP``: the scores (base 2) are soft-capped at ``cap`` (``softcap * log2(e)``) before masking.
    """
    DV_PAD: tl.constexpr = VW_PAD * (32 // BITS)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    t_start = pid_s * tokens_per_split
    t_end = tl.minimum(t_start + tokens_per_split, NT)
    if HAS_LENGTH:
        t_end = tl.minimum(t_end, tl.load(LENGTH).to(tl.int32))
    out, lse = _attend_tokens(
        Q, b * sq_b + h * sq_h, sq_m, Q, 0,
        KC + b * skc_b + h * skc_h, KS + b * sks_b + h * sks_h, KZ + b * skz_b + h * skz_h,
        VC + b * svc_b + h * svc_h, VS + b * svs_b + h * svs_h, VZ + b * svz_b + h * svz_h, VALID + b * sva_b,
        skc_g, sks_g, skz_g, svc_t, svs_t, svz_t, t_start, t_end, qk_scale, cap, M, pid_m,
        LG, b * slg_b + h * slg_h, NT,
        False, DK, KW, KW_PAD, DV, VW_PAD, G, GV, BITS, BLOCK_M, BN, TRANS, LAZY, ASM, PREFETCH, SOFTCAP, LOGITS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, DV_PAD)
    o_ptr = OUT + pid_s * so_s + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :]
    tl.store(o_ptr, out, mask=m_ok[:, None] & (offs_d < DV)[None, :])
    tl.store(LSE + pid_s * sl_s + b * sl_b + h * sl_h + offs_m[:, None], lse, mask=m_ok[:, None])


def _target_programs(device: torch.device, waves: float, num_warps: int) -> int:
    """Programs for ``waves`` full waves: an SM holds about 16 warps of this kernel (~128 registers per thread)."""
    if device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
        return int(waves * sms * max(1, 16 // num_warps))
    return 8  # interpreter / CPU: a few splits, so tests exercise the combine


def _inner_contiguous(t: torch.Tensor, inner: int) -> torch.Tensor:
    """``t`` if its last ``inner`` dims are densely packed (row-major), else a contiguous copy."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-inner:]), reversed(t.stride()[-inner:])):
        if size != 1 and stride != expected:
            return t.contiguous()
        expected *= size
    return t


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """fp16 ``[..., Dk]`` (Dk even) viewed as int32 pairs of adjacent channels ``[..., Dk/2]`` (no copy if possible)."""
    t = _inner_contiguous(t, 1)
    if t.storage_offset() % 2 or any(st % 2 for st in t.stride()[:-1]):
        t = t.contiguous()
    return t.view(torch.int32)


def _asm_ok(device: torch.device) -> bool:
    """Inline PTX only on a real GPU (the interpreter cannot run it: the pure-Triton path is used there)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _config(bits: int, group: int, dk: int, dv: int, v_group: int) -> dict:
    """Kernel constexprs and launch options for one problem class (measured on an H200, Triton 3.6:
    ``benchmarks/gpu_kivi.py --sweep``; the 1-warp, 16-token configuration won at B >= 16 for both widths).

    ``combine`` is read by the KIVI lanes kernel only (:mod:`.lanes_triton`: its split merge, "splits" measured best in
    session 16).  ``KVCOMPRESS_KIVI_CONFIG`` (JSON) overrides entries, either flat (``{"BN": 64}``) or per bit width
    (``{"2": {...}, "4": {...}}``) - a tuning knob for benchmarks, not needed for correctness.
    """
    cfg = dict(BN=16, TRANS=True, LAZY=True, ASM=True, PREFETCH=True, num_warps=1, num_stages=2, waves=2, min_rows=8,
               maxnreg=128, min_split_tokens=512, combine="splits")
    env = os.environ.get("KVCOMPRESS_KIVI_CONFIG")
    if env:
        over = json.loads(env)
        cfg.update(over.get(str(bits), {}) if any(k in over for k in ("2", "4")) else over)
    return cfg


def supports(query: torch.Tensor, packed: PackedKV) -> bool:
    """Whether the kernel handles this call: the dispatcher's explicit capability check."""
    try:
        _validate(query, packed)
    except ValueError:
        return False
    return True


def _validate(query: torch.Tensor, packed: PackedKV) -> None:
    if getattr(packed, "k_per_token", False):
        raise ValueError("the Triton KIVI kernel reads per-channel keys only (k_per_token is an ablation)")
    codes_per_word(packed.bits)
    per = 32 // packed.bits
    g = packed.group
    if g < 16 or g > 128 or g & (g - 1):
        raise ValueError(f"key group must be a power of two in 16..128, got {g}")
    if query.dim() != 4:
        raise ValueError(f"query must be [B, Hkv, M, Dk], got {tuple(query.shape)}")
    b, h, m, dk = query.shape
    kc = packed.k_codes
    if kc.dim() != 5 or kc.shape[:2] != (b, h) or kc.shape[3] != -(-dk // per) or kc.shape[4] != g \
            or packed.k_scale.shape[-1] != dk:
        raise ValueError(f"k_codes {tuple(kc.shape)} does not match query {tuple(query.shape)} / group {g}")
    if dk > MAX_DIM or dk % 2:
        raise ValueError(f"key dim {dk}: the kernel needs an even key dim up to {MAX_DIM}")
    dv = packed.v_codes.shape[-1] * per
    gv = packed.v_group
    if dv > MAX_DIM or gv < 2 or gv & (gv - 1) or dv % gv or packed.v_codes.shape[:3] != (b, h, kc.shape[2] * g):
        raise ValueError(f"value codes {tuple(packed.v_codes.shape)} / group {gv} not supported")
    if packed.valid.shape != (b, kc.shape[2] * g):
        raise ValueError(f"valid {tuple(packed.valid.shape)} should be {(b, kc.shape[2] * g)}")


def _forward(query: torch.Tensor, packed: PackedKV, scale: float, *, splits: int | None = None,
             config: dict | None = None, length: torch.Tensor | None = None,
             base: dict | None = None, softcap: float | None = None,
             logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch.  ``length`` (default ``packed.length``): 0-dim int device tensor, the number of leading token
    slots that may be live
    (slots at or after it are treated as invalid and not read; the grid stays sized for the whole capacity, so
    the launch is the same whatever its value: CUDA-graph safe).  ``base``: the launch configuration to start from
    instead of :func:`_config` (which reads ``KVCOMPRESS_KIVI_CONFIG``); ``config`` entries override either.
    ``softcap``: logit soft-cap of the scores (``None`` / 0: none; a compile-time switch of the kernel).
    ``logits``: a contiguous float32 ``[B, H, M, T]`` tensor the kernel fills with the scores it computes
    (natural-log units, ``-inf`` on invalid slots; slots it does not read keep their content: pass it filled with
    ``-inf``), as :func:`.reference.kivi_attention_scored` returns them (a compile-time switch)."""
    _validate(query, packed)
    if length is None:
        length = getattr(packed, "length", None)
    if length is not None and (length.dim() != 0 or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"length must be a 0-dim int32/int64 tensor, got {tuple(length.shape)} {length.dtype}")
    b, h, m, dk = query.shape
    bits, g = packed.bits, packed.group
    per = 32 // bits
    ng = packed.k_codes.shape[2]
    nt = ng * g
    dv = packed.v_codes.shape[-1] * per
    gv = packed.v_group
    dev = query.device
    out = torch.empty(b, h, m, dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, h, m, device=dev, dtype=torch.float32)
    if logits is not None and (tuple(logits.shape) != (b, h, m, nt) or logits.dtype != torch.float32
                               or not logits.is_contiguous()):
        raise ValueError(f"logits must be a contiguous float32 tensor {(b, h, m, nt)}, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if b * h * m == 0:
        return out, lse
    if ng == 0:
        return out.zero_(), lse.fill_(float("-inf"))

    q = query if query.stride(-1) == 1 else query.contiguous()
    kc = _inner_contiguous(packed.k_codes, 2)
    ks = _pairs(packed.k_scale)
    kz = _pairs(packed.k_zero)
    vc = _inner_contiguous(packed.v_codes, 1)
    vs = _inner_contiguous(packed.v_scale, 1)
    vz = _inner_contiguous(packed.v_zero, 1)
    valid = _inner_contiguous(packed.valid, 1)
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)

    cfg = dict(base if base is not None else _config(bits, g, dk, dv, gv))
    if config:
        cfg.update(config)
    bn = int(cfg["BN"])
    if bn > g and bn % g:
        bn = g
    block_m = min(64, max(cfg["min_rows"] if cfg["TRANS"] else 16, _pow2(m)))
    m_blocks = triton.cdiv(m, block_m)
    if splits is None:  # enough programs for a few full waves, each split a whole number of tiles
        most = -(-nt // max(bn, cfg["min_split_tokens"])) if dev.type == "cuda" else -(-nt // bn)
        want = -(-_target_programs(dev, cfg["waves"], cfg["num_warps"]) // (b * h * m_blocks))
        splits = max(1, min(most, want))
    tps = -(-nt // splits)
    tps = -(-tps // bn) * bn
    splits = -(-nt // tps)

    if splits == 1:
        po, pl = out, lse
        po_strides, pl_strides = (0, *out.stride()[:3]), (0, *lse.stride()[:2])
    else:
        po = torch.empty(splits, b, h, m, dv, device=dev, dtype=torch.float32)
        pl = torch.empty(splits, b, h, m, device=dev, dtype=torch.float32)
        po_strides, pl_strides = po.stride()[:4], pl.stride()[:3]

    kw = kc.shape[3]
    vw = vc.shape[-1]
    _kivi_split_kernel[(splits, b * h, m_blocks)](
        q, kc, ks, kz, vc, vs, vz, valid, length if length is not None else valid, po, pl,
        float(scale) * LOG2E, cap_base2(softcap), m, h, nt, tps,
        q.stride(0), q.stride(1), q.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        kz.stride(0), kz.stride(1), kz.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        vz.stride(0), vz.stride(1), vz.stride(2),
        valid.stride(0),
        *po_strides, *pl_strides,
        logits if logits is not None else pl, h * m * nt if logits is not None else 0, m * nt,
        DK=dk, KW=kw, KW_PAD=max(_pow2(kw), -(-16 // per)), DV=dv, VW_PAD=max(_pow2(vw), -(-16 // per)),
        G=g, GV=gv, BITS=bits, BLOCK_M=block_m, BN=bn, TRANS=cfg["TRANS"], LAZY=cfg["LAZY"],
        ASM=bool(cfg["ASM"]) and (base is not None or _asm_ok(dev)), PREFETCH=bool(cfg["PREFETCH"]),
        HAS_LENGTH=length is not None, SOFTCAP=bool(softcap), LOGITS=logits is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}),
    )
    if splits > 1:
        combine_splits(po, pl, out, lse, splits, b * h * m, dv)
    return out, lse


def resolved_config(bits: int, group: int, dk: int, dv: int, v_group: int, device: torch.device) -> dict:
    """The launch configuration of one problem class with every environment input applied
    (``KVCOMPRESS_KIVI_CONFIG``, inline PTX only on a real GPU): what :mod:`kvcompress.kernels.ops` resolves once and
    passes as ``base`` (no environment read per call)."""
    cfg = dict(_config(bits, group, dk, dv, v_group))
    cfg["ASM"] = bool(cfg["ASM"]) and _asm_ok(device)
    return cfg


def kivi_attention_partial(query: torch.Tensor, packed: PackedKV, scale: float, *,
                           length: torch.Tensor | None = None,
                           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention over a packed KIVI region; see :func:`.reference.kivi_attention_partial` (``length``: see
    :func:`_forward`)."""
    return _forward(query, packed, scale, length=length, softcap=softcap)
