"""LeanK grouped decode attention in Triton: one split-KV launch over every lane.

Same signature and semantics as :func:`.reference.grouped_partial_attention`
(``(out fp32 [B, Hkv, M, Dv], lse fp32 [B, Hkv, M])``).  Nothing is compiled at
import; each configuration is JIT-compiled by Triton on first use.

How it works:

* The lanes (up to :data:`MAX_LANES` per launch; more lanes take more launches into
  the same partial buffers) are passed as tuples of tensors and strides.  Every
  (lane, head) pair is one *row* of a flat row space; program ``(split, batch * row,
  row block)`` finds its lane by a static loop over the lanes (one specialised copy
  of the inner loop per lane, with that lane's kept-channel count padded to a power
  of two as a compile-time constant: no wasted lanes of a 128-wide tile on a
  32-channel lane).
* Compiles: runtime sizes (token counts, heads per lane, query rows) are not specialised, so
  a model compiles one kernel per distinct layer layout (set of kept counts; 16 on SmolLM2 at
  50%).  ``canonical`` (off by default, ``KVCOMPRESS_LEANK_CONFIG='{"canonical": true}'``) places
  lanes whose counts are multiples of 16 in fixed slots (16, 32, ..., head_dim; empty slots hold
  no rows) so every layer shares one layout (:func:`_canonical_slots`, :func:`launch_layout`);
  it is off because its one end-to-end H200 run was not faster to first token (see
  docs/results.md, "LeanK decode kernel").
* Inner loop (flash decoding): the query rows of the head, gathered to the lane's
  kept channels and pre-scaled by ``scale * log2(e)``, are loaded once;
  per block of ``BN`` tokens, ``S = q K^T`` and ``acc += P V`` run on tensor cores
  (``tl.dot``, rows padded to 16), with an online base-2 softmax.
* Every program writes a normalised partial and its LSE; a second small kernel
  merges, for each kv head, the partials of all splits of every lane row that holds
  that head (heads no lane covers get ``-inf`` and zeros).

Validity: a lane's ``valid`` is ``[B, T]`` (one mask for every head of a row) or ``[B, h, T]`` (per head: a middle
store under adaptive per-head budgets); the kernel reads it through a head stride (0 for the row-level form).

Limits: ``k`` and ``v`` of a lane may be strided views (e.g. a ring buffer's live
slots), but their last dimension must be contiguous; channel counts and ``Dv`` up to
256; the same ``Dv`` and the same K/V dtype in every lane (fp16, bf16 or fp32; fp32
products run in IEEE fp32).  :func:`supports` checks all of this; the dispatcher in
:mod:`kvcompress.kernels.leank` falls back to the reference otherwise.

Tuning: :func:`_config` holds the defaults; ``KVCOMPRESS_LEANK_CONFIG`` (JSON)
overrides them (``benchmarks/gpu_leank.py`` and ``benchmarks/gpu_lanes_sweep.py`` sweep it).  ``combine``:
``"splits"`` (default since session 16: :func:`_combine_splits_kernel`, one program per (batch, head, row) folding up
to 32 splits per step) or ``"loop"`` (:func:`_combine_kernel`, one program per (batch, head, row block) walking the
splits one by one; session 16's H200 sweep: 1.1-2.3x slower reads at batch 1, equal elsewhere).  ``split_rows``:
how the token splits count the rows of programs (:func:`counts_work`, :func:`split_count`): ``"auto"`` (default since
session 19: by each lane's work under head dim 128, per lane at 128 and above), ``"work"`` or ``"lanes"``; or
``"resident"`` (opt-in: :func:`resident_split_count`, whole waves of the programs the GPU holds at a time, as the
paged kernel counts them; ``waves`` then counts those waves, default 1; where the long rows alone exceed one wave, the
fewest splits, at most ``fill_splits``, whose waves are ``fill`` full: :func:`wave_fill_splits`; session 34 on the
H200: LeanK SmolLM2 B64 / 32k 1.4x -> 2.0x SDPA, but B1 / 128k and B4 / 32k 8-12 % slower than "auto").
``splits`` (default ``None``: the rules above): a fixed split count for every launch, for sweeps that time
the rules' choices against each other (``benchmarks/gpu_s34_session.sh``).  ``resident_batch`` (default 16 since
session 34): "auto" takes the resident count from this many batch rows
(:func:`uses_resident`).  ``whole_waves`` (default True since session 34; not where the resident count is taken):
the other rules' count moved to the nearest whole number of resident waves once the long programs exceed one
(:func:`whole_wave_splits`; low rank Llama B4 / 32k 198 -> 136 us).  ``valid_ahead`` (default True since
session 36): each token block's valid flags loaded a block ahead (:func:`_attend`; sm_90 SASS, session 35: the
flags' four byte loads sat at the top of each block, waited for before its scores were masked).  H100, session 36,
two rounds over 35 reads: 12-13 faster by more than 2 %, none slower in both rounds (low rank 5-23 % faster, the
empty stack SmolLM2 B1 / 32k 12 %, LeanK-70 + KIVI-2 SmolLM2 B16 / B64 4 %).  ``pdl`` (opt-in; mixed on the H200 in
session 33): the split merge is launched with programmatic dependent launch on Hopper
(:func:`~kvcompress.kernels.attention.triton_shared.use_pdl`): it starts while the lanes kernel's last wave runs and
waits for it on the device, so its launch latency and prologue overlap the split kernel.
``proj_stages_tokens`` (default 8192 since session 40): launches with a low-rank lane whose longest lane holds at
most that many token slots take the empty stack's 3-stage rule (:func:`_launch_shape`).
``resident_full_width_rows`` (default 32 since session 40): launches whose lanes read every channel take the
resident split count from that many batch x kv-head rows (:func:`uses_resident`).  ``one_split_tokens`` (default
4096 since session 43; 0 / ``None``: never): such launches at head dim 128 or more whose rows of programs fill one
program per SM (``fill`` of the SMs) and whose longest lane holds at least that many slots take one split - no
merge launch (:func:`one_split`).  ``lane_balance`` (opt-in since session 54, not yet timed on a GPU): resident
launches whose long programs fit one wave give each long lane its own split count, wider lanes more
(:func:`balanced_lane_splits`); ``lane_splits`` (default ``None``): a fixed count per lane, for tests and sweeps;
session 57's H100 runs found it mixed (up to 2.7 % faster at Llama B16/128k, 5 % slower at SmolLM2 LeanK-50
B16/32k): still opt-in.  ``scale_in_exponent`` (default ``True`` since session 57): lanes of bf16 keys take the
query unscaled and apply the scale to the fp32 scores (:func:`_attend`,
:func:`~kvcompress.kernels.attention.triton_shared.scale_in_exponent`); ``"all"``: every lane
(the interpreter's tests of that arithmetic), ``False``: none (the scaled query rounded to the keys' dtype).
``proj_query`` (:data:`PROJ_QUERY`, default ``"split"`` since session 58): how a low-rank lane's projected query
``q U`` (fp32 from its tensor-core dot) enters the dot with the stored coordinates - ``"split"`` the scaled projection
as two halves in the keys' dtype (the part the first rounding lost rounded again), two dots a block; ``"scaled"``
rounded once after the softmax scale (the default until session 58); ``"unscaled"`` rounded once before it, the scale
then in the exponent. H100, session 58 (``benchmarks/gpu_lowrank_bf16_probe.py``, float64 oracle of the stored
coordinates, 4k-32k tokens): one rounding is 6.4e-3 to 1.1e-2 off in bf16 LSE (fp16: 1.0e-3 to 2.1e-3), the halves
7.5e-6 to 1.5e-5 (fp16: 2.8e-6 to 5.8e-6); the bf16 low-rank reads took the same time under the three settings
(Llama B1 / B16 and SmolLM2 B16 at 32k, two alternating rounds: within 0.6 %).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.split_plan import lane_splits
from kvcompress.kernels.attention.triton_shared import (SCALE_IN_EXPONENT, cap_base2, check_choice, env_config,
                                                         fold_splits, pdl_launch, pdl_trigger, pdl_wait,
                                                         power_of_two_setting, resident_programs, scale_in_exponent,
                                                         soft_cap, use_pdl)

from .reference import Lane

LOG2E = 1.4426950408889634
MAX_LANES = 8
MAX_DIM = 256
#: the values of the ``proj_query`` setting: how a low-rank lane's projected query ``q U`` enters its dot with the
#: stored coordinates (:func:`_attend`'s ``PQ``)
PROJ_QUERY = ("scaled", "unscaled", "split")



@triton.jit
def _attend(Q, q_off, sq_m, CH, ch_off, K, k_off, sk_t, V, v_off, sv_t, VA, va_off, C, start, end, qk_scale, M, pid_m,
            cap, LG, lg_off, slg_m, U, u_off, su_d, DQ, HAS_CHAN: tl.constexpr, HAS_VALID: tl.constexpr,
            DKP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
            IEEE: tl.constexpr, SOFTCAP: tl.constexpr, LOGITS: tl.constexpr, PROJ: tl.constexpr, DQP: tl.constexpr,
            VA_AHEAD: tl.constexpr = False, WG: tl.constexpr = 1, SCALE_EXP: tl.constexpr = False,
            PQ: tl.constexpr = 0):
    """Flash-decoding over tokens ``[start, end)`` of one head of one lane: ``(acc, m, l)`` (base 2).  ``LOGITS``:
    also store every score it computed (natural-log units, ``-inf`` where masked) at ``LG + lg_off + row * slg_m +
    token``.  ``PROJ``: the keys are coordinates in a basis, and the query rows (``DQ`` columns) are projected
    by the head's ``[DQ, C]`` basis at ``U + u_off`` (row stride ``su_d``) instead of gathered.  ``VA_AHEAD``: each
    block's valid flags are loaded one block ahead (a value carried by the loop): the pipeline copies K and V ahead
    but not the flags - a byte a token, too narrow for an asynchronous copy - so each block waited for its own flags
    before its scores could be masked.  ``PQ`` (a projecting lane's query, :data:`PROJ_QUERY`): 0 the scaled projection
    rounded to the keys' dtype, 1 the unscaled projection rounded (the reference's rounding) with the scale in the
    exponent, 2 the scaled projection as two halves in the keys' dtype (``hi + lo``, two dots a block)."""
    # the query enters the dot unscaled and the scale is applied to the fp32 scores (in the exponent where no soft
    # cap or stored scores need them scaled): bf16 keys' full-width and channel lanes (SCALE_EXP), projecting lanes
    # with PQ 1
    UNSCALED: tl.constexpr = (SCALE_EXP and not PROJ) or (PROJ and PQ == 1)
    # WG > 1: the query rows repeated WG times, group g scoring only the g-th part of each block's tokens, with its
    # own softmax state - each warp then owns whole rows (no exchange between warps per block); merged at the end
    if WG > 1:
        offs_r = tl.arange(0, WG * BLOCK_M)
        offs_m = pid_m * BLOCK_M + offs_r % BLOCK_M
        # [rows, BN]: the tokens of a block a row scores
        mine = (tl.arange(0, BN) // (BN // WG))[None, :] == (offs_r // BLOCK_M)[:, None]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_c = tl.arange(0, DKP)
    c_ok = offs_c < C
    if PROJ:  # q U on tensor cores (rows padded to 16), fp32 accumulation, then scaled and rounded once
        offs_q = tl.arange(0, DQP)
        dq_ok = offs_q < DQ
        qf = tl.load(Q + q_off + offs_m[:, None] * sq_m + offs_q[None, :], mask=m_ok[:, None] & dq_ok[None, :],
                     other=0.0)
        u = tl.load(U + u_off + offs_q[:, None] * su_d + offs_c[None, :], mask=dq_ok[:, None] & c_ok[None, :],
                    other=0.0)
        if IEEE:
            qp = tl.dot(qf.to(tl.float32), u.to(tl.float32), input_precision="ieee")
        else:
            qp = tl.dot(qf.to(u.dtype), u)
        if PQ == 1:
            q = qp.to(K.dtype.element_ty)
        elif PQ == 2:  # bf16's 8-bit mantissa twice: the part the first rounding lost, rounded again
            qs = qp * qk_scale
            q = qs.to(K.dtype.element_ty)
            q_lo = (qs - q.to(tl.float32)).to(K.dtype.element_ty)
        else:
            q = (qp * qk_scale).to(K.dtype.element_ty)
    else:
        if HAS_CHAN:
            ch = tl.load(CH + ch_off + offs_c, mask=c_ok, other=0)
        else:
            ch = offs_c
        q = tl.load(Q + q_off + offs_m[:, None] * sq_m + ch[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
        if SCALE_EXP:
            # (bf16 keys by default, triton_shared.scale_in_exponent): the query enters the dot as given and the
            # scale is applied to the fp32 scores - in the exponent (the running maximum unscaled until the end)
            # where no soft cap or stored scores need them scaled. A separate multiply cost the bf16 LeanK reads up
            # to 2.8 % (H100, session 57); fp16's 11 mantissa bits keep the scaled query's rounding within 3e-4
            q = q.to(K.dtype.element_ty)
        else:
            q = (q.to(tl.float32) * qk_scale).to(K.dtype.element_ty)
    offs_d = tl.arange(0, DVP)
    d_ok = offs_d < DV
    m_i = tl.full([WG * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([WG * BLOCK_M], tl.float32)
    acc = tl.zeros([WG * BLOCK_M, DVP], tl.float32)
    if HAS_VALID and VA_AHEAD:
        t_first = start + tl.arange(0, BN)
        va_next = tl.load(VA + va_off + t_first, mask=t_first < end, other=0)
    for t0 in range(start, end, BN):
        t = t0 + tl.arange(0, BN)
        t_ok = t < end
        k = tl.load(K + k_off + t[:, None] * sk_t + offs_c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            if PROJ and PQ == 2:
                s = tl.dot(q_lo, tl.trans(k), s)
        if UNSCALED and (SOFTCAP or LOGITS):
            s = s * qk_scale
        if SOFTCAP:
            s = soft_cap(s, cap)
        ok = t_ok
        if HAS_VALID:
            if VA_AHEAD:
                ok = ok & (va_next != 0)
                va_next = tl.load(VA + va_off + t + BN, mask=t + BN < end, other=0)
            else:
                ok = ok & (tl.load(VA + va_off + t, mask=t_ok, other=0) != 0)
        if WG > 1:
            s = tl.where(ok[None, :] & mine, s, float("-inf"))
        else:
            s = tl.where(ok[None, :], s, float("-inf"))
        if LOGITS:  # (with WG > 1 each score stored by the group that computed it)
            lg_ok = m_ok[:, None] & t_ok[None, :]
            if WG > 1:
                lg_ok = lg_ok & mine
            tl.store(LG + lg_off + offs_m[:, None] * slg_m + t[None, :], s * 0.6931471805599453, mask=lg_ok)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if UNSCALED and not SOFTCAP and not LOGITS:
            m_scaled = m_safe * qk_scale
            p = tl.exp2(s * qk_scale - m_scaled[:, None])
            alpha = tl.exp2(m_i * qk_scale - m_scaled)
        else:
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + v_off + t[:, None] * sv_t + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    if UNSCALED and not SOFTCAP and not LOGITS:
        m_i = m_i * qk_scale  # (the scale is positive: -inf stays -inf)
    if WG > 1:  # the groups' partials of each row merged by log-sum-exp
        mg = tl.reshape(m_i, (WG, BLOCK_M))
        top = tl.max(mg, axis=0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        f = tl.where(mg == float("-inf"), 0.0, tl.exp2(mg - top_safe[None, :]))
        l_out = tl.sum(tl.reshape(l_i, (WG, BLOCK_M)) * f, axis=0)
        acc_out = tl.sum(tl.reshape(acc, (WG, BLOCK_M, DVP)) * f[:, :, None], axis=0)
    else:
        acc_out, top, l_out = acc, m_i, l_i
    return acc_out, top, l_out


# Runtime sizes are not specialised (``== 1`` / ``% 16`` variants would compile a copy per layer
# and per cache length); strides stay specialised (they are stable and enable vector loads).
@triton.jit(do_not_specialize=["TS", "NSP", "NHS", "CS", "ROW0", "M", "R", "RLO", "RN", "NBATCH"])
def _lanes_kernel(
    Q, sq_b, sq_h, sq_m,
    KS, VS, VAS, CHS, HDS, US,
    SKB, SKH, SKT, SVB, SVH, SVT, SVAB, SVAH, SCH, SUH, SUD, TS, NHS, CS, ROW0, NSP,
    PO, PL, LENGTH, qk_scale, M, R, RLO, RN, NBATCH, cap, LGS, DQ,
    HAS_VALID: tl.constexpr, HAS_CHAN: tl.constexpr, HAS_HEADS: tl.constexpr, PROJ: tl.constexpr, DKP: tl.constexpr,
    NL: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr, HAS_LENGTH: tl.constexpr, SOFTCAP: tl.constexpr, LOGITS: tl.constexpr, DQP: tl.constexpr,
    PDL: tl.constexpr = False, VA_AHEAD: tl.constexpr = False, WG: tl.constexpr = 1, PDL_END: tl.constexpr = False,
    SCALE_EXP: tl.constexpr = False, PQ: tl.constexpr = 0,
):
    """One (split, batch * lane row, row block): the partial of one head of one lane over one token range.

    ``HAS_LENGTH``: every lane's token slots at or after ``*LENGTH`` are dead (not read); the splits stay sized
    for the lanes' capacity, so a split beyond the live length writes an empty partial at once.  ``LOGITS``: the
    scores are also stored, lane ``i``'s in ``LGS[i]`` (contiguous ``[B, h_i, M, T_i]``; slots not read keep what
    the caller put there).  ``PROJ[i]``: lane ``i`` projects the query by its heads' bases ``US[i]`` (``[h_i, DQ,
    C_i]``, strides ``SUH[i]`` / ``SUD[i]``).  ``PDL``: the split merge after it is launched with programmatic
    dependent launch; every program lets it start as soon as the last one has started.  ``VA_AHEAD``: the valid flags
    are loaded a block ahead (:func:`_attend`).  ``NSP[i]``: lane ``i``'s own split count (at most the grid's; its
    programs past it write an empty partial at once: ``lane_splits``, ``lane_balance``).  ``PDL_END``: the launch
    runs beside the kernel before it (programmatic dependent launch, ``concurrent``: it reads nothing that kernel
    writes) and every program waits for that kernel at its end, so this launch completes only after it."""
    pdl_trigger(PDL)
    pid_s = tl.program_id(0)
    pid_br = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_br // RN
    r = RLO + pid_br % RN
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, DVP)
    for i in tl.static_range(NL):
        if (r >= ROW0[i]) & (r < ROW0[i] + NHS[i]):
            j = r - ROW0[i]
            if HAS_HEADS[i]:
                head = tl.load(HDS[i] + j).to(tl.int64)
            else:
                head = j.to(tl.int64)
            b64 = b.to(tl.int64)
            j64 = j.to(tl.int64)
            tps = tl.cdiv(tl.cdiv(TS[i], NSP[i]), BN) * BN
            start = pid_s * tps
            end = tl.minimum(start + tps, TS[i])
            if HAS_LENGTH:
                end = tl.minimum(end, tl.load(LENGTH).to(tl.int32))
            acc, m_i, l_i = _attend(
                Q, b64 * sq_b + head * sq_h, sq_m, CHS[i], j64 * SCH[i], KS[i], b64 * SKB[i] + j64 * SKH[i], SKT[i],
                VS[i], b64 * SVB[i] + j64 * SVH[i], SVT[i], VAS[i], b64 * SVAB[i] + j64 * SVAH[i], CS[i], start, end,
                qk_scale, M,
                pid_m, cap, LGS[i], (b64 * NHS[i] + j64) * M * TS[i], TS[i], US[i], j64 * SUH[i], SUD[i], DQ,
                HAS_CHAN[i], HAS_VALID[i], DKP[i], DV, DVP, BLOCK_M, BN, IEEE, SOFTCAP, LOGITS, PROJ[i], DQP, VA_AHEAD,
                WG, SCALE_EXP, PQ)
            l_ok = l_i > 0.0
            out = acc / tl.where(l_ok, l_i, 1.0)[:, None]
            lse = tl.where(l_ok, (m_i + tl.log2(tl.where(l_ok, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            row = (pid_s.to(tl.int64) * NBATCH + b64) * R + r
            tl.store(PO + (row * M + offs_m[:, None]) * DV + offs_d[None, :], out.to(PO.dtype.element_ty),
                     mask=m_ok[:, None] & (offs_d < DV)[None, :])
            tl.store(PL + row * M + offs_m, lse, mask=m_ok)
    pdl_wait(PDL_END)


@triton.jit(do_not_specialize=["NHS", "ROW0", "S", "R", "M", "H", "NBATCH"])
def _combine_kernel(PO, PL, OUT, LSE, HDS, NHS, ROW0, S, R, M, H, NBATCH,
                    HAS_HEADS: tl.constexpr, NL: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                    BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """Per (batch, kv head): log-sum-exp merge of every split of every lane row holding that head.  ``PDL``: launched
    with programmatic dependent launch, it waits for the lanes kernel before reading a partial."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, DVP)
    ok = m_ok[:, None] & (offs_d < DV)[None, :]
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(NL):
        for j in range(NHS[i]):
            if HAS_HEADS[i]:
                hh = tl.load(HDS[i] + j).to(tl.int32)
            else:
                hh = j
            if hh == h:
                for s in range(S):
                    row = (s * NBATCH + b) * R + ROW0[i] + j
                    lse = tl.load(PL + row * M + offs_m, mask=m_ok, other=float("-inf"))
                    o = tl.load(PO + (row * M + offs_m[:, None]) * DV + offs_d[None, :], mask=ok, other=0.0)
                    new = tl.maximum(top, lse)
                    safe = tl.where(new == float("-inf"), 0.0, new)
                    a = tl.exp(top - safe)
                    w = tl.exp(lse - safe)
                    acc = acc * a[:, None] + w[:, None] * o
                    tot = tot * a + w
                    top = new
    t_ok = tot > 0.0
    dst = (b * H + h) * M + offs_m
    tl.store(OUT + dst[:, None] * DV + offs_d[None, :],
             (acc / tl.where(t_ok, tot, 1.0)[:, None]).to(OUT.dtype.element_ty), mask=ok)
    tl.store(LSE + dst, tl.where(t_ok, top + tl.log(tl.where(t_ok, tot, 1.0)), float("-inf")), mask=m_ok)


@triton.jit(do_not_specialize=["NHS", "ROW0", "S", "R", "M", "H", "NBATCH"])
def _combine_splits_kernel(PO, PL, OUT, LSE, HDS, NHS, ROW0, S, R, M, H, NBATCH,
                           HAS_HEADS: tl.constexpr, NL: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                           SB: tl.constexpr, PDL: tl.constexpr = False):
    """:func:`_combine_kernel` with one program per (batch, kv head, row) folding ``SB`` splits per step (a
    ``[SB, DV]`` tile) instead of one: the merge's chain of dependent loads is ``S / SB`` long, not ``S`` - for reads
    split many ways (small batches over long lanes).  Same arguments and result; the grid is ``(NBATCH * H, M)``."""
    pid = tl.program_id(0)
    m = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_s = tl.arange(0, SB)
    offs_d = tl.arange(0, DVP)
    d_ok = offs_d < DV
    top = tl.max(tl.full([SB], float("-inf"), tl.float32), axis=0)
    tot = tl.sum(tl.zeros([SB], tl.float32), axis=0)
    acc = tl.zeros([DVP], tl.float32)
    pdl_wait(PDL)
    for i in tl.static_range(NL):
        for j in range(NHS[i]):
            if HAS_HEADS[i]:
                hh = tl.load(HDS[i] + j).to(tl.int32)
            else:
                hh = j
            if hh == h:
                for s0 in range(0, S, SB):
                    sp = s0 + offs_s
                    s_ok = sp < S
                    row = (sp.to(tl.int64) * NBATCH + b) * R + ROW0[i] + j
                    lse = tl.load(PL + row * M + m, mask=s_ok, other=float("-inf"))
                    o = tl.load(PO + (row * M + m)[:, None] * DV + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                                other=0.0)
                    top, tot, acc = fold_splits(top, tot, acc, lse, o)
    t_ok = tot > 0.0
    dst = (b * H + h) * M + m
    tl.store(OUT + dst * DV + offs_d, (acc / tl.where(t_ok, tot, 1.0)).to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(LSE + dst, tl.where(t_ok, top + tl.log(tl.where(t_ok, tot, 1.0)), float("-inf")))


def launch_combine(cfg: dict, splits: int, b: int, hkv: int, m: int, block_m: int, m_blocks: int):
    """``(kernel, grid, extra constexprs)`` of the split merge the configuration names: ``combine: "loop"`` (default,
    :func:`_combine_kernel`, one split per step) or ``"splits"`` (:func:`_combine_splits_kernel`)."""
    kind = cfg.get("combine", "loop")
    if kind == "splits":
        return _combine_splits_kernel, (b * hkv, m), dict(SB=max(2, min(32, _pow2(splits))), num_warps=4)
    if kind != "loop":
        raise ValueError(f"combine: expected 'loop' or 'splits', got {kind!r}")
    return _combine_kernel, (b * hkv, m_blocks), dict(BLOCK_M=block_m, num_warps=4)


# ----------------------------------------------------------------------------- host side


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: ``batch x kv_heads x head_dim`` above which, and up to :data:`MID_WORK_MAX`, ``waves: None`` launches 4 waves of
#: programs instead of 2 (lanes not all full width; those take the 3-stage rule of :func:`_launch_shape` first).
#: Session 16 on an H200 (docs/results.md, issue 19): 4 waves won for LeanK at Llama B1 / B4 (1024 / 4096: LeanK-70
#: 1.12x -> 1.32x SDPA at B1/32k) and SmolLM2 B4 / B16 (768 / 3072: 1.09x -> 1.30x, 0.97x -> 1.50x), lost at Llama
#: B8 / B16 (8192 / 16384: 1.24x -> 1.13x, 1.41x -> 1.22x) and SmolLM2 B1 (192).
MID_WORK_MIN, MID_WORK_MAX = 512, 4096


def counts_work(cfg: dict, head_dim: int) -> bool:
    """Whether a launch counts its rows of programs by work (:func:`split_count`): ``split_rows`` "work", or "auto"
    (the default) with a head dim under 128 - where it was measured faster at every shape of issue 19's grid, while
    at Llama heads (128) the per-lane count stays (session 19, docs/results.md)."""
    mode = cfg.get("split_rows", "auto")
    return mode == "work" or (mode == "auto" and head_dim < 128)


def uses_resident(cfg: dict, batch: int, full_width: bool = False, rows: int = 0) -> bool:
    """Whether a launch counts its splits by residency (:func:`resident_split_count`): ``split_rows`` "resident", or
    "auto" (the default) from ``resident_batch`` batch rows (default 16 since session 34; 0 / ``None``: never).  Two
    H200 sweeps (session 34, docs/results.md; none, low rank, LeanK-50/70, LeanK-70 + KIVI-2 at 14 and 10 shapes):
    at B16 and B64 the resident count was within 1.4 % or faster at every read (LeanK SmolLM2 B64 / 32k 308 -> 210
    us, Llama B64 / 32k 4-5 % faster), while at B1 / B4 it lost by up to 20 % (LeanK SmolLM2 B1 / 32k 17.4 -> 20.9
    us) where it won elsewhere (low rank SmolLM2 B1 / 128k 79 -> 50 us) - below 16 rows the other rules stay.

    ``resident_full_width_rows`` (default 32 since session 40; 0 / ``None``: never; ``full_width``: every lane reads
    all channels - the empty stack's one lane; ``rows``: batch x kv heads): such launches take the resident count from
    that many rows, at any batch.  H100, session 40, two rounds that agree (``PART=none-resident``, the resident
    count at every batch against the rule): Llama B4 (32 rows) 6.4-7.6 % faster at 4k / 32k / 128k (B4 / 128k 776
    -> 716-720 us, 0.92x -> 0.99x SDPA), Llama B1 (8 rows) within 2 %, SmolLM2 B4 (12 rows) within 2 %, SmolLM2 B1
    (3 rows) 8-12 % slower at 32k / 128k.  Session 34's one H200 round had Llama B4 / 32k 143.7 -> 133.6 us and
    B4 / 4k 27.4 -> 25.9 (``docs/data/s34_h200/lanes_rule/``); the rule's 9 splits at Llama B4 fill 288 of an H200's
    396 program slots, the resident 12 fill 384."""
    mode = cfg.get("split_rows", "auto")
    if mode == "resident":
        return True
    wide = cfg.get("resident_full_width_rows")
    if mode == "auto" and full_width and wide and rows >= int(wide):
        return True
    first = cfg.get("resident_batch")
    return mode == "auto" and bool(first) and batch >= int(first)


def one_split(cfg: dict, full_width: bool, d: int, programs: int, tokens: int, sms: int,
              sm_gbps: float = 0.0) -> bool:
    """Whether a launch takes one token split (``one_split_tokens``): every lane full width (the empty stack's read),
    head dim ``d`` >= 128, ``programs`` (batch x kv heads x row blocks) at least ``fill`` x ``sms``, and the longest
    lane ``tokens`` >= ``one_split_tokens`` slots.  One program per (row, head) then streams its whole row, and the
    read needs no merge launch.  H100, session 43, two rounds that agree (``PART=splits1``, Llama heads, one split
    against the rules' 2-3): the empty stack B16 / 4k 100.0-100.2 -> 95.1-95.6 us (0.95x -> 1.00x SDPA), B16 / 32k
    and 128k 0.5-1.0 % faster, B64 / 4k 0.7-1.6 % faster.  Low rank (not full width) lost 15-20 % at B16 / 32k and
    128k with one split, and head dim 64 was not timed: both keep the rules.

    ``one_split_max_sm_gbps`` (opt-in, session 54, not yet timed; default ``None``: no limit): only on a GPU whose
    peak memory bandwidth per SM (``sm_gbps``, :func:`sm_bandwidth_gbps`; 0: unknown, no limit) is at most this
    many GB/s.  Why: the H200's grid of session 54 read the empty stack at Llama B16 7-9 % slower than session 38's,
    whose plan had 3 splits (session 27's profile: 4.57 TB/s); one program per SM may not keep enough bytes in flight
    on the H200 (about 37 GB/s per SM) where it does on the H100 (about 25) - ``PART=none-plan`` times it."""
    least = cfg.get("one_split_tokens") or 0
    most_gbps = cfg.get("one_split_max_sm_gbps")
    if most_gbps and sm_gbps > float(most_gbps):
        return False
    return (bool(least) and full_width and d >= 128 and sms > 0 and programs >= float(cfg.get("fill", 0.9)) * sms
            and tokens >= int(least))


@functools.lru_cache(maxsize=None)
def sm_bandwidth_gbps(device_index: int) -> float:
    """Peak DRAM bandwidth per SM in GB/s of CUDA device ``device_index``, from the memory clock and bus width torch
    reports (double data rate; H100 SXM about 25, H200 about 37); 0.0 where this torch does not report them."""
    p = torch.cuda.get_device_properties(device_index)
    clock_khz = getattr(p, "memory_clock_rate", 0) or 0
    bus_bits = getattr(p, "memory_bus_width", 0) or 0
    if not clock_khz or not bus_bits:
        return 0.0
    return 2 * clock_khz * 1e3 * bus_bits / 8 / p.multi_processor_count / 1e9


def _launch_shape(cfg: dict, b: int, hkv: int, d: int, full_width: bool, work: bool = False,
                  projected: bool = False, tokens: int = 0) -> tuple[int, int]:
    """``(waves, num_stages)`` of a launch: the configuration's values where set (not ``None``), else the H200 rule.

    Every lane full width (the empty stack's read, one lane): session 16's rule - ``d >= 128`` and at most 128
    programs per split -> 3 stages and 2 waves (Llama B4 / B16 0.71x / 0.76x -> 0.98x / 0.98x SDPA; B64 lost with 3
    stages, 0.94x -> 0.78x; presumably four stages of 64 x 128 fp16 K and V tiles, 128 KB of shared memory, leave one
    program per SM, not profiled); otherwise 4 stages, and 4 waves when ``MID_WORK_MIN < batch x kv_heads x
    head_dim <= MID_WORK_MAX``, else 2.

    Lanes of several widths (LeanK's pruned lanes, low-rank coordinates, beside the full-precision buffer lane), 4
    stages: counted over every lane's heads (``work`` False), session 16's waves as above; counted by work
    (:func:`counts_work`, :func:`split_count`), waves of the programs that do the work: 1 wave up to
    ``MID_WORK_MIN``, 4 up to ``MID_WORK_MAX``, else 2 (SmolLM2 heads, H200, 32k: LeanK-70 B4 / B16 / B64 1.29x /
    1.46x / 0.89x -> 1.45x / 1.81x / 1.47x, low-rank 0.59x / 0.66x / 0.50x -> 0.66x / 0.85x / 0.87x; docs/results.md,
    issue 19, session 19).

    ``proj_stages_tokens`` (default 8192 since session 40; 0 / ``None``: never): a launch with a low-rank
    (``projected``) lane whose longest lane holds at most that many token slots (``tokens``) takes the empty stack's
    3-stage rule too (``d >= 128``, at most 128 programs per split, 2 waves).  Offline (Triton 3.6, sm_90) the
    Llama low-rank build holds 2 programs per SM at 4 stages and 3 at 3.  H100, session 40, two rounds that agree
    (``PART=proj-stages``, 3 stages at every length against 4): at 4k 2.5-5.4 % faster at B1 / B4 / B16 (B4 / 4k
    33.7 -> 31.9-32.2 us, 0.97x -> 1.02x SDPA), but at 32k / 128k 9-20 % slower at B1 / B4 (B1 / 128k 151.5 ->
    181.6 us) and within 2 % at B16; B64 is outside the rule."""
    size = b * hkv * d
    short = cfg.get("proj_stages_tokens")
    three = full_width or (projected and bool(short) and tokens <= int(short))
    if three and d >= 128 and b * hkv <= 128:
        waves, stages = 2, 3
    elif full_width or not work:
        waves, stages = (4 if MID_WORK_MIN < size <= MID_WORK_MAX else 2), 4
    else:
        waves, stages = (1 if size <= MID_WORK_MIN else 4 if size <= MID_WORK_MAX else 2), 4
    if cfg.get("waves") is not None:
        waves = int(cfg["waves"])
    if cfg.get("num_stages") is not None:
        stages = int(cfg["num_stages"])
    return waves, stages


def split_count(cfg: dict, b: int, lanes: Sequence[tuple[int, int]], m_blocks: int, waves: int, sms: int,
                work: bool = False) -> int:
    """Token splits of a launch over lanes of ``(heads, token slots)``: enough programs for ``waves x sms``, each
    split at least ``min_split_tokens`` (and ``BN``) tokens of the longest lane.  ``sms`` 0 (the interpreter): 4
    programs in all, so the tests exercise the merge.  With one wave (``waves`` 1: a launch of little work, SmolLM2
    heads at batch 1), each split keeps at most ``single_wave_split_tokens`` tokens of the longest lane (default 1480;
    0 / ``None``: no cap): one program per SM streaming ~3k tokens alone left its latency unhidden (H200, session 37,
    SmolLM2 B1 / 128k: low rank 53.0 us at the rule's 44 splits, 41.2 at 88; LeanK-70 38.3 at 66, 34.5 at 88; at 32k,
    where the rule's splits hold under 1k tokens, 88 was no faster: LeanK-70 17.0 -> 18.3 us).  1480 gives that shape
    the 88 splits timed; against no cap (H100, session 38, two rounds) 9-20% faster at SmolLM2 B1 / 128k, the same
    split counts at 4k / 32k.

    ``work`` (:func:`counts_work`) says what a row of programs counts for: False every lane's heads count alike (the
    only count until session 19), True each head counts for its lane's share of the longest lane's tokens.  A short
    full-precision lane (the sinks + recent window, ~1k slots) beside a long middle lane (LeanK's pruned keys,
    low-rank coordinates) then no longer halves the splits of the long lane (counted per lane, its programs finish
    at once and leave the long lane's programs ``waves / 2`` waves; session 19, ``benchmarks/gpu_read_profile.py``:
    low-rank SmolLM2 B16 / 32k read 32k tokens in 3 splits, 245 µs against 104 µs for the empty stack's 11)."""
    bn = cfg["BN"]
    t_max = max((t for _, t in lanes), default=0)
    if work and t_max > 0:
        n_rows = sum(h * t for h, t in lanes) / t_max
    else:
        n_rows = sum(h for h, _ in lanes)
    programs = b * max(n_rows, 1e-9) * m_blocks
    if sms <= 0:
        splits = math.ceil(4 / programs)
    else:
        splits = min(math.ceil(waves * sms / programs), -(-t_max // max(bn, cfg["min_split_tokens"])))
        long_tokens = cfg.get("single_wave_split_tokens") or 0
        if waves == 1 and long_tokens > 0:  # one wave of long programs: more, shorter ones (above)
            splits = max(splits, -(-t_max // long_tokens))
    return max(1, min(splits, -(-max(t_max, 1) // bn)))


def most_splits(t_max: int, bn: int, min_split_tokens: int) -> int:
    """The most token splits of a launch whose longest lane holds ``t_max`` slots: each split at least
    ``min_split_tokens`` and ``bn`` (one block) of them; at least 1."""
    return max(1, min(-(-t_max // max(bn, min_split_tokens)), -(-t_max // bn)))


def resident_split_count(cfg: dict, b: int, lanes: Sequence[tuple[int, int]], m_blocks: int, slots: int,
                         waves: int = 1) -> int:
    """``split_rows: "resident"``: token splits giving ``waves`` whole waves of the long lanes' programs, where a wave is
    ``slots`` programs (how many the GPU runs at a time: :func:`~kvcompress.kernels.attention.triton_shared.
    resident_programs` x SMs, from the compiled kernel's registers and shared memory), rounded down - the paged
    kernel's rule (session 27: one program too many starts a second, nearly empty wave).  Long programs are those of
    lanes at least half as long as the longest; every lane is split as many ways, so a short lane's programs (the
    full-precision sinks + window beside a 32k middle) finish early and fill the slots the long ones leave, and are
    not counted.  Each split keeps at least ``min_split_tokens`` (and ``BN``) tokens of the longest lane.

    More long rows than one wave holds (Llama heads from batch 64 at 3 programs per SM: 512 rows, 396 slots):
    :func:`wave_fill_splits` - one split would leave the second wave 29 % full."""
    bn = cfg["BN"]
    t_max = max((t for _, t in lanes), default=0)
    if t_max <= 0:
        return 1
    long_rows = sum(h for h, t in lanes if 2 * t >= t_max)
    rows = max(1, b * long_rows * m_blocks)
    most = most_splits(t_max, bn, cfg["min_split_tokens"])
    if rows > slots:
        return wave_fill_splits(rows, slots, min(most, int(cfg.get("fill_splits", 4))), float(cfg.get("fill", 0.9)))
    return max(1, min(waves * slots // rows, most))


def whole_wave_splits(cfg: dict, b: int, lanes: Sequence[tuple[int, int]], m_blocks: int, slots: int,
                      splits: int) -> int:
    """``whole_waves`` (the default since session 34): the rule's ``splits`` (:func:`split_count`) moved to the
    nearest whole number of waves of the long lanes' programs, where a wave is ``slots`` programs (how many the GPU
    runs at a time, :func:`~kvcompress.kernels.attention.triton_shared.resident_programs` x SMs).  Where the long
    programs fit one wave the count stays (batch 1: the rule's count was faster than a fuller wave for LeanK).
    Otherwise it becomes the most splits whose long programs fill ``k`` waves, ``k`` the nearest whole number to the
    rule's waves: 1.09 waves (low rank, Llama heads B4 / 32k: 9 splits of 32 long rows on 264 slots, the second wave
    24 programs long) -> 1 wave of 8 splits; 1.45 waves (LeanK, SmolLM2 heads B64 / 32k: 2 splits of 192 rows) -> 1
    split; 1.95 waves -> 2 waves, at most one split more.  Long lanes, the split floor and ``min_split_tokens`` as in
    :func:`resident_split_count`; never below 1 split (more long rows than one wave holds at 1 split stays 1)."""
    bn = cfg["BN"]
    t_max = max((t for _, t in lanes), default=0)
    if t_max <= 0 or slots <= 0:
        return splits
    rows = max(1, b * sum(h for h, t in lanes if 2 * t >= t_max) * m_blocks)
    waves = rows * splits / slots
    if waves <= 1.0:
        return splits
    most = most_splits(t_max, bn, cfg["min_split_tokens"])
    return max(1, min(int(waves + 0.5) * slots // rows, most))


def wave_fill_splits(rows: int, slots: int, most: int, target: float = 0.9) -> int:
    """Splits of ``rows`` long programs (more than ``slots``, one wave) that fill their last wave: the fewest
    (1 .. ``most``) whose waves are at least ``target`` full on average (``rows x s / (ceil(rows x s / slots) x
    slots)``), else the fullest.  512 rows on 396 slots: 1 split fills 65 %, 2 splits 86 %, **3** splits 97 %."""
    def fill(s: int) -> float:
        return rows * s / (-(-rows * s // slots) * slots)

    best = 1
    for s in range(1, max(1, most) + 1):
        if fill(s) >= target:
            return s
        if fill(s) > fill(best) + 1e-9:
            best = s
    return best


def balanced_lane_splits(cfg: dict, b: int, lanes: Sequence[tuple[int, int, int]], dv: int, m_blocks: int,
                         slots: int) -> list[int | None] | None:
    """``lane_balance`` (opt-in, session 54, not yet timed on a GPU): a split count per long lane for a resident launch
    (:func:`resident_split_count`) whose long programs fit ``slots`` (one wave) at one split each.  ``lanes`` lists
    ``(channels, heads, token slots)``; a long lane (at least half the longest) costs ``channels + dv`` per token, and
    :func:`kvcompress.kernels.attention.split_plan.lane_splits` gives the costliest lanes more splits within
    ``slots`` programs (at most the resident rule's ``most`` each).  Short lanes (the full-precision sinks + window)
    get ``None``: the launch's count.  ``None`` where the long programs exceed one wave (the rule's
    :func:`wave_fill_splits` then).  Why: LeanK-70's Llama lanes keep 96, 64 and 5 x 32 channels; one count for every
    lane leaves the 32-channel programs (160 channels with the values) done while the 96-channel ones (224) read on -
    the KIVI lanes kernel's same plan was 10-20 % faster from B4 (session 54)."""
    got = _balanced_lane_splits(int(cfg["BN"]), int(cfg["min_split_tokens"]), b, tuple(map(tuple, lanes)), dv,
                                m_blocks, slots)
    return None if got is None else list(got)


@functools.lru_cache(maxsize=1024)
def _balanced_lane_splits(bn: int, min_split_tokens: int, b: int, lanes: tuple, dv: int, m_blocks: int,
                          slots: int) -> tuple | None:
    """:func:`balanced_lane_splits`, once per launch shape (the greedy loops over splits; an eager decode step asks
    for the same shapes at every layer)."""
    t_max = max((t for _, _, t in lanes), default=0)
    if t_max <= 0 or slots <= 0:
        return None
    long = [k for k, (_, h, t) in enumerate(lanes) if h and 2 * t >= t_max]
    if b * m_blocks * sum(lanes[k][1] for k in long) > slots:
        return None
    most = most_splits(t_max, bn, min_split_tokens)
    got = lane_splits([(lanes[k][0] + dv, lanes[k][1], -(-lanes[k][2] // bn)) for k in long], b * m_blocks, slots,
                      most)
    out: list[int | None] = [None] * len(lanes)
    for k, n in zip(long, got):
        out[k] = n
    return tuple(out)


def _fixed_lane_splits(value, n: int, canonical: bool) -> list[int]:
    """The configuration's ``lane_splits``: one integer >= 1 per lane, in the lanes' order."""
    if canonical:
        raise ValueError("KVCOMPRESS_LEANK_CONFIG: lane_splits needs canonical false (canonical slots reorder lanes)")
    if (not isinstance(value, (list, tuple)) or len(value) != n
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in value)):
        raise ValueError(f"KVCOMPRESS_LEANK_CONFIG: lane_splits must be a list of {n} integers >= 1 (one per lane) "
                         f"or null, got {value!r}")
    return list(value)


_RESIDENT: dict = {}  # (device, constexprs, warps, stages) -> programs of the lanes kernel one SM holds at a time


def warp_groups(cfg: dict, bn: int, block_m: int) -> int:
    """Row groups of a launch (``warp_groups``, opt-in, not yet timed; default 1): the query rows repeated that many
    times, group ``g`` scoring only the ``g``-th part of each block's tokens with its own softmax state, the groups
    merged once at the end (:func:`_attend`).  With 4 groups of 16 rows the MMA tile is 64 rows and each warp owns
    whole rows: no exchange between warps per block (4 warps splitting a block's tokens pass 7 block-wide barriers
    per block; sm_90 SASS, session 35), for 4x the tensor-core work of a memory-bound read.  Taken only for one row
    block of at most 16 rows, and where each group gets at least 16 of a block's tokens; else 1."""
    wg = cfg.get("warp_groups")
    wg = power_of_two_setting("KVCOMPRESS_LEANK_CONFIG", "warp_groups", 1 if wg is None else wg,
                              "a power of two >= 1")
    return wg if block_m == 16 and bn % wg == 0 and bn // wg >= 16 else 1


def _config() -> dict:
    """Launch defaults (H200, Triton 3.6); ``KVCOMPRESS_LEANK_CONFIG`` (JSON) overrides entries.  ``combine:
    "splits"`` since session 16: at batch 1 the one-split-per-step merge took 15-27 µs of a 40-60 µs read
    (``benchmarks/gpu_read_profile.py``); ``waves`` / ``num_stages`` ``None`` follow :func:`_launch_shape`;
    ``scale_in_exponent`` (:func:`~kvcompress.kernels.attention.triton_shared.scale_in_exponent`)."""
    cfg = dict(BN=64, num_warps=4, num_stages=None, waves=None, min_split_tokens=256, canonical=False, combine="splits",
               split_rows="auto", splits=None, resident_batch=16, whole_waves=True, fill=0.9, fill_splits=4, pdl=False,
               valid_ahead=True, warp_groups=1, single_wave_split_tokens=1480, proj_stages_tokens=8192,
               resident_full_width_rows=32, one_split_tokens=4096, lane_balance=False, lane_splits=None,
               one_split_max_sm_gbps=None, scale_in_exponent=True, proj_query="split")
    cfg.update(env_config("KVCOMPRESS_LEANK_CONFIG", cfg))
    check_choice("KVCOMPRESS_LEANK_CONFIG", "scale_in_exponent", cfg["scale_in_exponent"], SCALE_IN_EXPONENT)
    check_choice("KVCOMPRESS_LEANK_CONFIG", "proj_query", cfg["proj_query"], PROJ_QUERY)
    return cfg


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def supports(query: torch.Tensor, lanes: Sequence[Lane | tuple]) -> bool:
    """Whether the kernel handles this call (shapes, dtypes, sizes); the dispatcher's capability check."""
    lanes = [Lane(*lane) for lane in lanes]
    if not lanes or query.dim() != 4 or query.shape[-1] > MAX_DIM:
        return False
    dtype, dv = lanes[0].k.dtype, lanes[0].v.shape[-1]
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or dv > MAX_DIM:
        return False
    b, hkv, m, d = query.shape
    for heads, channels, k, v, valid, basis in lanes:
        if k.dtype != dtype or v.dtype != dtype or v.shape[-1] != dv or k.dim() != 4 or v.dim() != 4:
            return False
        if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] > MAX_DIM:
            return False
        h = hkv if heads is None else heads.shape[0]
        if k.shape[1] != h:
            return False
        if basis is not None:  # projected coordinates: a [h, D, c] basis in the keys' dtype, no channel list
            if channels is not None or basis.dtype != dtype or tuple(basis.shape) != (h, d, k.shape[-1]):
                return False
        else:
            c = d if channels is None else channels.shape[-1]
            if k.shape[-1] != c or (channels is not None and channels.shape[0] != h):
                return False
            if channels is None and c != d:
                return False
        if valid is not None and tuple(valid.shape) not in ((b, k.shape[2]), (b, h, k.shape[2])):
            return False
    return True


SLOT = 16  # kept counts that are multiples of SLOT map to fixed slots (one compiled layout per head_dim)


def _canonical_slots(rows: list[dict], d: int, iota: torch.Tensor) -> list[dict]:
    """One slot per kept count ``SLOT, 2*SLOT, ..., ceil(d / SLOT) * SLOT``, empty slots padded.

    The compile-time layout of a launch (lane count, per-lane tile widths and flags) then depends
    on ``d`` alone, not on which kept counts a layer happens to have: a LeanK model compiles the
    kernel once instead of once per distinct layer layout (16 layouts on SmolLM2 at 50%).  Empty slots hold no rows and are never read.  Rows are returned
    unchanged when they do not fit the scheme (counts not multiples of ``SLOT``, two lanes of
    one count, more slots than :data:`MAX_LANES`, mixed valid-mask presence, or a projecting lane).
    """
    n_slots = -(-d // SLOT)
    counts = [r["c"] for r in rows]
    if (n_slots > MAX_LANES or any(c % SLOT for c in counts) or len(set(counts)) != len(counts)
            or len({r["has_valid"] for r in rows}) != 1 or any(r["proj"] for r in rows)):
        return rows
    by_count = {r["c"]: r for r in rows}
    ref = rows[0]
    out, r0 = [], 0
    for i in range(1, n_slots + 1):
        c = i * SLOT
        r = by_count.get(c)
        if r is None:  # empty slot: zero heads, never indexed
            r = dict(k=ref["k"], v=ref["v"], va=ref["va"], ch=iota[:1], hd=iota[:1], u=ref["k"], h=0, t=0, c=c,
                     has_valid=ref["has_valid"], has_chan=True, has_heads=True, proj=False, empty=True)
        else:
            r = dict(r)
            if not r["has_heads"]:
                r.update(hd=iota[:r["h"]], has_heads=True)
            if not r["has_chan"]:  # a full-width lane (c == d): channel i is channel i
                r.update(ch=iota[:c].expand(r["h"], c), has_chan=True)
            r.update(hd=r["hd"].long(), ch=r["ch"].long())  # one pointer type per slot
        r["r0"] = r0
        r0 += r["h"]
        out.append(r)
    return out


def _stride(r: dict, key: str, dim: int) -> int:
    return 0 if r.get("empty") else r[key].stride(dim)


def _lane_rows(lanes: Sequence[Lane], d: int, dev: torch.device, canonical: bool) -> list[dict]:
    """Per lane (or canonical slot): the tensors, sizes and flags one launch takes."""
    # canonical slots: identity heads / channels as views of one index tensor made per call (never a module-level
    # cache of device tensors: made during a CUDA-graph warm-up it would live in the graph's private pool untracked,
    # and recording the graph would fail).  Otherwise absent tensors get the lane's own keys as a placeholder pointer
    # (never read: their HAS_* flag is off), so a read makes no index tensor (an arange launch per layer and step).
    iota = (torch.arange(max([d, 1] + [lane.k.shape[1] for lane in lanes]), device=dev, dtype=torch.int64)
            if canonical else None)
    rows = []  # per lane: tensors and strides
    r0 = 0
    for heads, channels, k, v, valid, basis in lanes:
        k, v = _last_contiguous(k), _last_contiguous(v)
        dummy = iota[:1] if canonical else k
        if basis is not None:
            basis = _last_contiguous(basis)
        h, t, c = k.shape[1], k.shape[2], k.shape[3]
        if valid is not None:
            valid = valid if valid.stride(-1) == 1 else valid.contiguous()
            valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
        if channels is not None:
            channels = _last_contiguous(channels)
        rows.append(dict(k=k, v=v, va=valid if valid is not None else dummy, ch=channels if channels is not None
                         else dummy, hd=heads if heads is not None else dummy, u=basis if basis is not None else k,
                         h=h, t=t, c=c, r0=r0, has_valid=valid is not None, has_chan=channels is not None,
                         has_heads=heads is not None, proj=basis is not None))
        r0 += h
    return _canonical_slots(rows, d, iota) if canonical else rows


def launch_layout(lanes: Sequence[Lane | tuple], d: int, canonical: bool = True) -> tuple:
    """The compile-time part of a launch over ``lanes`` (lane count, tile widths, flags): calls with
    equal layouts share one compiled kernel."""
    lanes = [Lane(*lane) for lane in lanes]
    rows = _lane_rows(lanes, d, lanes[0].k.device, canonical)
    return tuple((max(16, _pow2(r["c"])), r["has_valid"], r["has_chan"], r["has_heads"], r["proj"]) for r in rows)


def grouped_partial_attention(query: torch.Tensor, lanes: Sequence[Lane | tuple], scale: float, *,
                              splits: int | None = None, config: dict | None = None,
                              length: torch.Tensor | None = None, base: dict | None = None,
                              softcap: float | None = None, logits: Sequence[torch.Tensor] | None = None,
                              out_dtype: torch.dtype | None = None, into: Callable | None = None,
                              concurrent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused grouped partial attention; see :func:`.reference.grouped_partial_attention`.

    ``out_dtype``: the output's dtype (``None``: float32): the split merge stores it rounded (a read whose only part
    this is needs no cast launch after it); with one split of one lane of every head the kernel stores it so.

    ``logits``: one contiguous float32 tensor ``[B, h_i, M, T_i]`` per lane, which the kernel fills with the scores
    it computes (natural-log units, ``-inf`` on invalid slots; slots it does not read - at or after ``length`` -
    keep their content: pass them filled with ``-inf``), as
    :func:`.reference.grouped_partial_scored` returns them (attention-mass observers; a compile-time switch).

    ``softcap``: logit soft-cap of the scores, applied in the kernel (``None`` or 0: none; a compile-time switch).

    ``length``: 0-dim int device tensor, the number of leading token slots of every lane that may be live (later
    slots are treated as invalid and not read; the launch does not depend on its value: CUDA-graph safe).
    ``base``: the configuration to start from instead of :func:`_config` (which reads ``KVCOMPRESS_LEANK_CONFIG``);
    ``config`` entries override either.

    ``into``: ``into(splits) -> (po, pl)``, called once the split count is known: contiguous float32 ``[splits, B,
    H, M, Dv]`` / ``[splits, B, H, M]`` tensors (another launch's split partials, e.g. a slice of the KIVI lanes
    kernel's: :func:`kvcompress.kernels.kivi.lanes_cuda.kivi_lanes_attention_partial`) that receive this launch's
    per-split partials - normalised outputs and natural-log LSEs, the layout the KIVI split combine merges - instead
    of a merge; returns ``(po, pl)``.  One lane over every head in order only (a full-precision buffer: no heads,
    channels or basis).  ``concurrent`` (with ``into``, on a GPU that has programmatic dependent launch): the launch
    runs beside the kernel launched just before it on this stream, which must write nothing this launch reads; each
    program waits for that kernel at its end (``PDL_END``), so a plain launch after this one sees both finished.
    """
    lanes = [Lane(*lane) for lane in lanes]
    if not supports(query, lanes):
        raise ValueError("unsupported lanes for the Triton LeanK kernel (see supports())")
    if into is not None and (logits is not None or len(lanes) != 1 or lanes[0].heads is not None
                             or lanes[0].channels is not None or lanes[0].basis is not None
                             or lanes[0].k.shape[1] != query.shape[1]):
        raise ValueError("into: one lane over every head (no heads, channels, basis or logits)")
    if length is not None and (length.dim() != 0 or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"length must be a 0-dim int32/int64 tensor, got {tuple(length.shape)} {length.dtype}")
    cfg = dict(base if base is not None else _config())
    if config:
        cfg.update(config)
    if into is not None:  # one row per head in order: the partials' layout is [splits, B, H, M, Dv]
        cfg["canonical"] = False
    b, hkv, m, d = query.shape
    dv = lanes[0].v.shape[-1]
    dev = query.device
    out = torch.empty(b, hkv, m, dv, device=dev, dtype=out_dtype or torch.float32)
    lse = torch.empty(b, hkv, m, device=dev, dtype=torch.float32)
    if b * hkv * m == 0:
        return out, lse
    q = query if query.stride(-1) == 1 else query.contiguous()
    if logits is not None:
        shapes = [(b, lane.k.shape[1], m, lane.k.shape[2]) for lane in lanes]
        if len(logits) != len(lanes) or any(tuple(x.shape) != sh or x.dtype != torch.float32 or not x.is_contiguous()
                                            for x, sh in zip(logits, shapes)):
            raise ValueError(f"logits must be one contiguous float32 tensor per lane shaped {shapes}")
    rows = _lane_rows(lanes, d, dev, cfg["canonical"] and logits is None)  # canonical slots reorder the lanes
    for r, x in zip(rows, logits if logits is not None else [None] * len(rows)):
        r["lg"] = x if x is not None else lse  # a placeholder pointer when no scores are stored (never written)
        r["nsp"] = 1  # each lane's split count: set below, once the launch's count is known
    n_rows = sum(r["h"] for r in rows)
    block_m = min(64, max(16, _pow2(m)))
    m_blocks = triton.cdiv(m, block_m)
    bn = cfg["BN"]
    # the rule's head dimension is the values' (a low-rank lane over an extended query has d = head_dim + r)
    full_width = all(r["c"] == d for r in rows)
    t_max = max((r["t"] for r in rows), default=0)  # the longest lane's token slots
    resident = uses_resident(cfg, b, full_width, b * hkv)
    work = resident or counts_work(cfg, dv)
    waves, stages = _launch_shape(cfg, b, hkv, dv, full_width, work, projected=any(r["proj"] for r in rows),
                                  tokens=t_max)
    ieee = lanes[0].k.dtype == torch.float32
    scale_exp = scale_in_exponent(cfg.get("scale_in_exponent", True), lanes[0].k.dtype)  # (one dtype: supports())
    pdl = use_pdl(cfg.get("pdl"), dev) and into is None  # the merge starts during the lanes kernel's last wave
    beside = into is not None and use_pdl(concurrent, dev)  # runs beside the launch before it (Hopper)
    wg = warp_groups(cfg, bn, block_m)

    def tup(chunk, key):
        return tuple(r[key] for r in chunk)

    def constexprs(chunk):
        """The kernel's constexprs over ``chunk`` (rows of at most MAX_LANES lanes)."""
        return dict(
            HAS_VALID=tup(chunk, "has_valid"), HAS_CHAN=tup(chunk, "has_chan"), HAS_HEADS=tup(chunk, "has_heads"),
            PROJ=tup(chunk, "proj"),
            DKP=tuple(max(16, _pow2(r["c"])) for r in chunk), NL=len(chunk), DV=dv, DVP=max(16, _pow2(dv)),
            BLOCK_M=block_m, BN=bn, IEEE=ieee, HAS_LENGTH=length is not None, SOFTCAP=bool(softcap),
            LOGITS=logits is not None, DQP=max(16, _pow2(d)), PDL=pdl, VA_AHEAD=bool(cfg.get("valid_ahead")),
            WG=wg, PDL_END=beside, SCALE_EXP=scale_exp, PQ=PROJ_QUERY.index(cfg.get("proj_query", "split")))

    def launch(chunk, po, pl):
        """``(arguments, constexprs)`` of the kernel over ``chunk``."""
        n_chunk = sum(r["h"] for r in chunk)
        args = (
            q, q.stride(0), q.stride(1), q.stride(2),
            *(tup(chunk, key) for key in ("k", "v", "va", "ch", "hd", "u")),
            tuple(_stride(r, "k", 0) for r in chunk), tuple(_stride(r, "k", 1) for r in chunk),
            tuple(_stride(r, "k", 2) for r in chunk), tuple(_stride(r, "v", 0) for r in chunk),
            tuple(_stride(r, "v", 1) for r in chunk), tuple(_stride(r, "v", 2) for r in chunk),
            tuple(_stride(r, "va", 0) if r["has_valid"] else 0 for r in chunk),
            tuple(_stride(r, "va", 1) if r["has_valid"] and r["va"].dim() == 3 else 0 for r in chunk),
            tuple(_stride(r, "ch", 0) if r["has_chan"] else 0 for r in chunk),
            tuple(_stride(r, "u", 0) if r["proj"] else 0 for r in chunk),
            tuple(_stride(r, "u", 1) if r["proj"] else 0 for r in chunk),
            *(tup(chunk, key) for key in ("t", "h", "c", "r0", "nsp")),
            po, pl, length if length is not None else pl, float(scale) * LOG2E, m, n_rows, chunk[0]["r0"], n_chunk, b,
            cap_base2(softcap), tup(chunk, "lg"), d)
        return args, constexprs(chunk)

    counts = None  # a split count per lane (lane_balance, lane_splits); None: the launch's for every lane
    if cfg.get("lane_splits") is not None:  # a fixed count per lane (tests, sweeps)
        counts = _fixed_lane_splits(cfg["lane_splits"], len(lanes), bool(cfg["canonical"] and logits is None))
    if splits is None and cfg.get("splits") is not None:  # a fixed count (benchmark sweeps of the split rules)
        splits = cfg["splits"]
        if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
            raise ValueError(f"KVCOMPRESS_LEANK_CONFIG: splits must be an integer >= 1 or null, got {splits!r}")
    if splits is None:
        index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else -1
        sms = _num_sms(index) if index >= 0 else 0
        shapes = [(r["h"], r["t"]) for r in rows]
        per_sm = 0
        gbps = sm_bandwidth_gbps(index) if sms > 0 and cfg.get("one_split_max_sm_gbps") else 0.0
        if one_split(cfg, full_width, dv, b * hkv * m_blocks, t_max, sms, gbps):
            splits = 1
        else:
            if (resident or cfg.get("whole_waves")) and sms > 0:
                # the compiled kernel of the first chunk says how many programs an SM holds (compiled at its first
                # use; float32 partials, as a split launch stores them)
                chunk = rows[:MAX_LANES]
                per_sm = resident_programs(_lanes_kernel, lambda: launch(chunk, lse, lse)[0], constexprs(chunk),
                                           cfg["num_warps"], stages, dev, _RESIDENT)
            if resident and per_sm:
                slots = per_sm * sms * int(cfg.get("waves") or 1)
                splits = resident_split_count(cfg, b, shapes, m_blocks, per_sm * sms, int(cfg.get("waves") or 1))
                if cfg.get("lane_balance") and counts is None:
                    counts = balanced_lane_splits(cfg, b, [(r["c"], r["h"], r["t"]) for r in rows], dv, m_blocks,
                                                  slots)
            else:
                splits = split_count(cfg, b, shapes, m_blocks, waves, sms, work)
                if per_sm:
                    splits = whole_wave_splits(cfg, b, shapes, m_blocks, per_sm * sms, splits)
    for k, r in enumerate(rows):
        r["nsp"] = splits if counts is None or counts[k] is None else counts[k]
    splits = max(r["nsp"] for r in rows)
    # one split of one lane of every head in order (a short buffer's read): the kernel's partial is already the
    # result, in the output's layout - the merge would copy it (bit for bit: one finite weight of exactly 1)
    direct = into is None and splits == 1 and len(rows) == 1 and not rows[0]["has_heads"] and n_rows == hkv
    if into is not None:  # (one lane over every head: n_rows == hkv)
        po, pl = into(splits)
        if (tuple(po.shape) != (splits, b, hkv, m, dv) or tuple(pl.shape) != (splits, b, hkv, m)
                or po.dtype != torch.float32 or pl.dtype != torch.float32 or not po.is_contiguous()
                or not pl.is_contiguous()):
            raise ValueError(f"into({splits}) must return contiguous float32 [{splits}, {b}, {hkv}, {m}, {dv}] / "
                             f"[{splits}, {b}, {hkv}, {m}] tensors, got {tuple(po.shape)} {po.dtype} / "
                             f"{tuple(pl.shape)} {pl.dtype}")
    else:
        po = torch.empty(splits, b, n_rows, m, dv, device=dev, dtype=out.dtype if direct else torch.float32)
        pl = torch.empty(splits, b, n_rows, m, device=dev, dtype=torch.float32)
    for first in range(0, len(rows), MAX_LANES):
        chunk = rows[first:first + MAX_LANES]
        n_chunk = sum(r["h"] for r in chunk)
        if n_chunk == 0:
            continue
        args, consts = launch(chunk, po, pl)
        _lanes_kernel[(splits, b * n_chunk, m_blocks)](*args, **consts, num_warps=cfg["num_warps"], num_stages=stages,
                                                       **pdl_launch(beside))

    if into is not None:
        return po, pl
    if direct:
        return po[0], pl[0]

    def tup_all(key):
        return tuple(r[key] for r in rows)

    kernel, grid, extra = launch_combine(cfg, splits, b, hkv, m, block_m, m_blocks)
    kernel[grid](po, pl, out, lse, tup_all("hd"), tup_all("h"), tup_all("r0"), splits, n_rows, m, hkv, b,
                 HAS_HEADS=tup_all("has_heads"), NL=len(rows), DV=dv, DVP=max(16, _pow2(dv)), PDL=pdl, **extra,
                 **pdl_launch(pdl))
    return out, lse
