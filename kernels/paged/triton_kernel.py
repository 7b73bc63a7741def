"""Paged split-KV decode attention in Triton: the block table is read inside the kernel.

Same signature and semantics as :func:`.reference.paged_attention_partial`
(``(out fp32 [B, H, M, Dv], lse fp32 [B, H, M])``).  Nothing is compiled at import;
each configuration is JIT-compiled by Triton on first use.

One program handles one (split, batch row x kv head, row block):

* the ``M`` grouped query rows (GQA group x q_len) are padded to ``BLOCK_M >= 16`` so both
  products run on tensor cores (``tl.dot``);
* it walks a contiguous range of the row's block-table entries, ``NBP`` pages per step: the
  page ids are loaded from the table, and the ``NBP * P`` key/value rows are gathered from
  the pool with per-token base offsets (``page * stride + slot * stride``); table entries of
  ``-1`` and invalid slots are masked, so no dense copy of the sequence is ever built;
* online softmax in base 2 (scale x log2(e) folded into the query), fp32 accumulation; each
  split writes a normalised partial and its natural-log LSE, and a small second kernel merges
  the splits (skipped with one split).

Dtypes: pages in fp16 / bf16 feed ``tl.dot`` natively (the query is cast to the pages'
dtype); fp32 pages use ``input_precision="ieee"``.  Limits: ``P`` a power of two in 16..128
(other page sizes use the reference), head dims of any width (padded to a power of two
>= 16 in registers).  The Triton interpreter on CPU computes bf16 ``tl.dot`` wrongly
(triton#11584): CPU tests use fp16 and fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import (SCALE_IN_EXPONENT, cap_base2, check_choice, combine_splits,
                                                         env_config, pdl_trigger, power_of_two_setting,
                                                         resident_programs, scale_in_exponent, soft_cap, use_pdl)
from kvcompress.kernels.attention.triton_shared import num_sms as _num_sms
from kvcompress.kernels.attention.triton_shared import pow2 as _pow2

LOG2E = 1.4426950408889634


@triton.jit
def _page_step(q, page, wi, slot, n_live, k_head, v_head, VALID, m_i, l_i, acc, offs_dk, offs_dv, dk_ok, dv_ok,
               cap, sk_p, sk_t, sv_p, sv_t, sva_p, P: tl.constexpr, IEEE: tl.constexpr, HAS_LENGTH: tl.constexpr,
               SOFTCAP: tl.constexpr, LATE: tl.constexpr = False, flags=None, VBLOCK: tl.constexpr = False,
               qk_scale=1.0, SCALE_EXP: tl.constexpr = False):
    """One step of the split loop: the ``[BN]`` token slots of block-table positions ``wi`` (page ids ``page``,
    ``-1`` for none) folded into the online softmax ``(m_i, l_i, acc)``.  ``LATE`` (``valid_late``, opt-in): the K
    copy is masked by the page alone, not by the slots' valid flags - the dead slots' scores (NaN included) are
    masked after the product - so the pipeline issues the K copy of a step ahead without waiting for that step's
    flags, a byte a slot loaded synchronously (sm_90 TTGIR, Triton 3.6: the flags' load sat before both copies).  V
    stays masked by the flags (a dead slot may hold inf; zeroing the V tile in registers instead sent it through
    shared memory twice: 150 registers and 88 KB against 108 and 72 KB, offline).  ``VBLOCK`` (``valid_block``,
    opt-in): the step's flags ``flags`` come from registers (loaded with the page ids of a block of steps), so no
    load in the step precedes its copies.  ``SCALE_EXP`` (bf16 pages, ``bf16_scale_in_exponent``): ``q`` is the
    query as given, the scores and ``m_i`` unscaled, and ``qk_scale`` rides in the exponent (one FFMA a score)."""
    p_ok = page >= 0
    if HAS_LENGTH:
        p_ok = p_ok & (wi * P + slot < n_live)
    page = tl.where(p_ok, page, 0).to(tl.int64)
    if VBLOCK:
        ok = p_ok & (flags != 0)
    else:
        ok = p_ok & (tl.load(VALID + page * sva_p + slot, mask=p_ok, other=0) != 0)
    k_mask = p_ok if LATE else ok
    k = tl.load(k_head + page[:, None] * sk_p + slot[:, None] * sk_t + offs_dk[None, :],
                mask=k_mask[:, None] & dk_ok[None, :], other=0.0)  # [BN, DK_PAD]
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = soft_cap(s, cap)
    s = tl.where(ok[None, :], s, float("-inf"))  # [BLOCK_M, BN]

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if SCALE_EXP:
        m_scaled = m_safe * qk_scale
        p = tl.exp2(s * qk_scale - m_scaled[:, None])
        alpha = tl.exp2(m_i * qk_scale - m_scaled)
    else:
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]

    v = tl.load(v_head + page[:, None] * sv_p + slot[:, None] * sv_t + offs_dv[None, :],
                mask=ok[:, None] & dv_ok[None, :], other=0.0)  # [BN, DV_PAD]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _paged_split_kernel(
    Q, K, V, VALID, TABLE, LENGTH, OUT, LSE,
    qk_scale, cap, M, H, W, pages_per_split,
    sq_b, sq_h, sq_m,
    sk_p, sk_h, sk_t,
    sv_p, sv_h, sv_t,
    sva_p, st_b,
    so_s, so_b, so_h, so_m,
    sl_s, sl_b, sl_h,
    DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    P: tl.constexpr, NBP: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr, HAS_LENGTH: tl.constexpr,
    SOFTCAP: tl.constexpr, TSTEPS: tl.constexpr, PDL: tl.constexpr = False, LATE: tl.constexpr = False,
    VBLOCK: tl.constexpr = False, SCALE_EXP: tl.constexpr = False,
):
    BN: tl.constexpr = NBP * P
    pdl_trigger(PDL)  # the split merge (launched with PDL) may start once every program has started
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    m_ok = offs_m < M
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV

    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_dk[None, :],
                mask=m_ok[:, None] & dk_ok[None, :], other=0.0).to(tl.float32)
    if SCALE_EXP:  # bf16 pages (by default): the query as given, the scale applied to the fp32 scores in the exponent
        q = q.to(K.dtype.element_ty)
    else:
        q = (q * qk_scale).to(K.dtype.element_ty)

    tok = tl.arange(0, BN)
    page_local = tok // P
    slot = tok % P
    k_head = K + h * sk_h
    v_head = V + h * sv_h
    table_row = TABLE + b * st_b

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)

    w_start = pid_s * pages_per_split
    w_end = tl.minimum(w_start + pages_per_split, W)
    if HAS_LENGTH:  # token slots at or after LENGTH (in block-table order) are dead: their pages are not read
        n_live = tl.load(LENGTH).to(tl.int32)
        w_end = tl.minimum(w_end, tl.cdiv(n_live, P))
    if not HAS_LENGTH:
        n_live = 0
    if TSTEPS > 1:  # the page ids of TSTEPS steps loaded at once; the steps take theirs from registers
        TB: tl.constexpr = TSTEPS * NBP
        tb_local = tl.arange(0, TB)
        for b0 in range(w_start, w_end, TB):
            wb = b0 + tb_local
            blk = tl.load(table_row + wb, mask=wb < w_end, other=-1)
            if VBLOCK:  # the valid flags of the block's TB * P slots, in one load after the page ids
                tslot = tl.arange(0, TB * P)
                bpage = tl.gather(blk, tslot // P, 0)
                f_ok = bpage >= 0  # (slots past a live length: masked by the step, as the page ids' holes)
                bflags = tl.load(VALID + tl.where(f_ok, bpage, 0).to(tl.int64) * sva_p + tslot % P, mask=f_ok,
                                 other=0)
            for s0 in range(0, tl.minimum(TB, w_end - b0), NBP):
                idx = s0 + page_local
                # the gathers' indices wrapped into the block (TB is a power of two): the pipeliner issues the next
                # steps' gathers ahead, past the block's last step (their copies masked off), and an index out of
                # the block reads past the gather's scratch (session 38: an illegal address in the DoubleSparse
                # gathers' same loop)
                step_flags = None
                if VBLOCK:
                    step_flags = tl.gather(bflags, (s0 * P + tok) & (TB * P - 1), 0)
                m_i, l_i, acc = _page_step(q, tl.gather(blk, idx & (TB - 1), 0), b0 + idx, slot, n_live, k_head,
                                           v_head, VALID, m_i, l_i, acc, offs_dk, offs_dv, dk_ok, dv_ok, cap, sk_p,
                                           sk_t, sv_p, sv_t, sva_p, P, IEEE, HAS_LENGTH, SOFTCAP, LATE, step_flags,
                                           VBLOCK, qk_scale, SCALE_EXP)
    else:
        for w0 in range(w_start, w_end, NBP):
            wi = w0 + page_local
            page = tl.load(table_row + wi, mask=wi < w_end, other=-1)
            m_i, l_i, acc = _page_step(q, page, wi, slot, n_live, k_head, v_head, VALID, m_i, l_i, acc, offs_dk,
                                       offs_dv, dk_ok, dv_ok, cap, sk_p, sk_t, sv_p, sv_t, sva_p, P, IEEE,
                                       HAS_LENGTH, SOFTCAP, LATE, None, False, qk_scale, SCALE_EXP)

    if SCALE_EXP:
        m_i = m_i * qk_scale  # (the scale is positive: -inf stays -inf)
    l_ok = l_i > 0.0
    out = acc / tl.where(l_ok, l_i, 1.0)[:, None]
    lse = tl.where(l_ok, (m_i + tl.log2(tl.where(l_ok, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(OUT + pid_s * so_s + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_dv[None, :], out,
             mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + pid_s * sl_s + b * sl_b + h * sl_h + offs_m, lse, mask=m_ok)


_RESIDENT: dict = {}  # (device, constexprs, warps, stages) -> programs of the split kernel one SM holds at a time


def _programs_per_sm(device: torch.device, args: tuple, consts: dict, num_warps: int, num_stages: int) -> int:
    """How many split programs one SM runs at a time (:func:`~kvcompress.kernels.attention.triton_shared.
    resident_programs`, cached in :data:`_RESIDENT`).  An H200 holds 4 at head dim 128 (112 registers x 128 threads;
    Nsight Compute, session 27)."""
    return resident_programs(_paged_split_kernel, args, consts, num_warps, num_stages, device, _RESIDENT)


def split_plan(table_width: int, pages_per_step: int, programs_per_split: int, waves: int, depths: tuple,
               slots) -> tuple[int, int]:
    """``(splits, pipeline depth)`` of a read: ``waves`` whole waves of programs (``slots(depth)``: how many the GPU
    holds at a time at that depth), each split a whole number of steps, rounded down - one program too many starts a
    second, nearly empty wave (Nsight Compute, B16 / 32k Llama heads: 5 splits = 640 programs where 528 run at a
    time, a tail of 113).  The first of ``depths`` at which the read still splits at least twice wins, else the last
    (3 stages hold fewer programs per SM, which costs where one wave of single-split programs is all there is)."""
    for depth in depths:
        splits = max(1, min(-(-table_width // pages_per_step), waves * slots(depth) // programs_per_split))
        if splits > 1:
            break
    return splits, depth


def _config() -> dict:
    """Launch defaults (H200, Triton 3.6); ``KVCOMPRESS_PAGED_CONFIG`` (JSON) overrides entries, read once by
    :mod:`kvcompress.kernels.ops` (passed as ``base``).  ``pages_per_step`` ``None``: ``64 // P`` pages (64 tokens)
    per step; ``waves``: programs aimed at, in waves (programs the GPU holds at a time: :func:`_programs_per_sm` x
    SMs), rounded down; ``table_steps``: > 1 loads the page ids of that many steps at once (the steps take theirs
    from registers, so their K / V loads wait on no table load); ``num_stages`` ``None``: 3 where the read splits at
    least twice, else 2 (H200, session 27: table_steps 16 with 3 stages 1.04-1.13x faster than the old loop at Llama
    B1-B16 and SmolLM2 B16-B64, 0.78x at Llama B64/32k - one split per row - where 2 stages keep 4 programs per SM).
    ``pdl`` (opt-in, not yet timed): the split merge is launched with programmatic dependent launch on Hopper
    (:func:`~kvcompress.kernels.attention.triton_shared.use_pdl`).  ``valid_late`` (opt-in, session 37): the K
    copies masked by the page, not the slots' flags (:func:`_page_step`).  ``valid_block`` (opt-in, session 37; with
    ``table_steps`` > 1): the valid flags of a block of steps loaded with its page ids, so the steps' copies wait on
    no load at all.  Neither was faster (H100, session 38, 9 reads x 2 rounds: geometric mean latency 0.98-0.99x
    and 0.99-1.02x the default's, within its round-to-round spread).  ``bf16_scale_in_exponent`` (default ``True``
    since session 58): bf16 pages without a soft-cap take the query as given and apply the scale to the fp32 scores
    in the exponent, as the lanes kernel does since session 57. H100, session 58 (``PARTS=paged-bf16`` in
    benchmarks/gpu_s35_session.sh): the pre-scaled bf16 query (``False``) put a 4k-token read 1.5e-2 off the float32
    reference in LSE, this setting within 5e-4, and the bf16 dense-pages reads took the same time (Llama B1 / B16 at
    32k, SmolLM2 B16 / 32k, two alternating rounds: within 0.7 %); ``"all"``: every dtype (the same arithmetic on
    fp16 pages: what the interpreter can test on a CPU, whose bf16 dots are not usable)."""
    cfg = dict(pages_per_step=None, num_warps=4, num_stages=None, waves=1, table_steps=16, pdl=False,
               valid_late=False, valid_block=False, bf16_scale_in_exponent=True)
    cfg.update(env_config("KVCOMPRESS_PAGED_CONFIG", cfg))
    # the kernel's blocks (a step's tokens, a block of page ids, its warps) are powers of two
    for key, off_ok in (("pages_per_step", True), ("table_steps", True), ("num_warps", False)):
        if not (off_ok and cfg[key] is None):
            power_of_two_setting("KVCOMPRESS_PAGED_CONFIG", key, cfg[key],
                                 "null, 0 or a power of two" if off_ok else "a power of two", zero=off_ok)
    check_choice("KVCOMPRESS_PAGED_CONFIG", "bf16_scale_in_exponent", cfg["bf16_scale_in_exponent"],
                 SCALE_IN_EXPONENT)
    if cfg["valid_block"] and not (cfg["table_steps"] or 0) > 1:
        raise ValueError("KVCOMPRESS_PAGED_CONFIG: valid_block loads the flags with a block of page ids: it needs "
                         f"table_steps > 1, got table_steps {cfg['table_steps']!r}")
    return cfg


def _validate(query, k_pages, v_pages, page_valid, block_table) -> None:
    b, h, m, dk = query.shape
    if k_pages.dim() != 4 or k_pages.shape[1] != h or k_pages.shape[3] != dk:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} does not match query {tuple(query.shape)}")
    n, _, p, _ = k_pages.shape
    if v_pages.shape[:3] != (n, h, p):
        raise ValueError(f"v_pages {tuple(v_pages.shape)} does not match k_pages {tuple(k_pages.shape)}")
    if p < 16 or p > 128 or p & (p - 1):
        raise ValueError(f"page size must be a power of two in 16..128, got {p}")
    if page_valid.shape != (n, p):
        raise ValueError(f"page_valid {tuple(page_valid.shape)} should be {(n, p)}")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table {tuple(block_table.shape)} should be [{b}, pages]")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")


def _forward(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_valid: torch.Tensor,
             block_table: torch.Tensor, scale: float, *, splits: int | None = None,
             pages_per_step: int | None = None, length: torch.Tensor | None = None,
             softcap: float | None = None, base: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch.  ``length``: 0-dim int device tensor, the number of leading token slots (block-table position
    ``w`` holds slots ``w*P .. w*P+P-1``) that may be live; later slots are treated as invalid and their pages are
    not read.  The grid stays sized for the whole table (CUDA-graph safe).  ``base``: the launch configuration
    (:func:`_config`); ``None``: the one :mod:`kvcompress.kernels.ops` resolved once (no environment read per call)."""
    if base is None:
        from kvcompress.kernels.ops import _paged_base

        base = _paged_base()
    cfg = base
    _validate(query, k_pages, v_pages, page_valid, block_table)
    if length is not None and (length.dim() != 0 or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"length must be a 0-dim int32/int64 tensor, got {tuple(length.shape)} {length.dtype}")
    b, h, m, dk = query.shape
    p = k_pages.shape[2]
    dv = v_pages.shape[3]
    w = block_table.shape[1]
    dev = query.device
    out = torch.empty(b, h, m, dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, h, m, device=dev, dtype=torch.float32)
    if b * h * m == 0:
        return out, lse
    if w == 0:
        return out.zero_(), lse.fill_(float("-inf"))

    q = query if query.stride(-1) == 1 else query.contiguous()
    k = k_pages if k_pages.stride(-1) == 1 else k_pages.contiguous()
    v = v_pages if v_pages.stride(-1) == 1 else v_pages.contiguous()
    valid = page_valid if page_valid.stride(-1) == 1 else page_valid.contiguous()
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    table = block_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()

    nbp = pages_per_step or cfg.get("pages_per_step") or max(1, 64 // p)
    block_m = min(64, max(16, _pow2(m)))
    m_blocks = triton.cdiv(m, block_m)
    consts = dict(DK=dk, DK_PAD=max(16, _pow2(dk)), DV=dv, DV_PAD=max(16, _pow2(dv)), P=p, NBP=nbp, BLOCK_M=block_m,
                  IEEE=k.dtype == torch.float32, HAS_LENGTH=length is not None, SOFTCAP=bool(softcap),
                  TSTEPS=int(cfg.get("table_steps") or 0), PDL=use_pdl(cfg.get("pdl"), dev),
                  LATE=bool(cfg.get("valid_late")),
                  VBLOCK=bool(cfg.get("valid_block")) and int(cfg.get("table_steps") or 0) > 1,
                  SCALE_EXP=scale_in_exponent(cfg.get("bf16_scale_in_exponent", True), k.dtype) and not softcap)
    warps = int(cfg["num_warps"])
    stage_choice = (int(cfg["num_stages"]),) if cfg.get("num_stages") else (3, 2)
    stages = stage_choice[0]

    def args(po, pl, pps, po_strides, pl_strides):
        return (q, k, v, valid, table, length if length is not None else table, po, pl,
                float(scale) * LOG2E, cap_base2(softcap), m, h, w, pps,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                valid.stride(0), table.stride(0),
                *po_strides, *pl_strides)

    one = (out, lse, w, (0, *out.stride()[:3]), (0, *lse.stride()[:2]))  # the launch of one split
    if splits is None:
        if dev.type == "cuda":
            sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())

            def slots(depth: int) -> int:
                return _programs_per_sm(dev, args(*one), consts, warps, depth) * sms
        else:
            def slots(depth: int) -> int:
                return 8  # interpreter: a few splits, so tests exercise the merge
        splits, stages = split_plan(w, nbp, b * h * m_blocks, int(cfg["waves"]), stage_choice, slots)
    pps = -(-w // splits)
    pps = -(-pps // nbp) * nbp if splits > 1 else pps
    splits = -(-w // pps)

    if splits == 1:
        launch = one
    else:
        po = torch.empty(splits, b, h, m, dv, device=dev, dtype=torch.float32)
        pl = torch.empty(splits, b, h, m, device=dev, dtype=torch.float32)
        launch = (po, pl, pps, po.stride()[:4], pl.stride()[:3])
    _paged_split_kernel[(splits, b * h, m_blocks)](*args(*launch), num_warps=warps, num_stages=stages, **consts)
    if splits > 1:
        combine_splits(po, pl, out, lse, splits, b * h * m, dv, pdl=consts["PDL"])
    return out, lse


def paged_attention_partial(query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            page_valid: torch.Tensor, block_table: torch.Tensor,
                            scale: float, *, length: torch.Tensor | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention; see :func:`.reference.paged_attention_partial` (``length``: see :func:`_forward`)."""
    return _forward(query, k_pages, v_pages, page_valid, block_table, scale, length=length, softcap=softcap)
