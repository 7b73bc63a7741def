"""DoubleSparse top-k selection as a distributed radix select (Triton): many programs per query head.

Same signature and semantics as :func:`.reference.select_topk` (exact top-k of the fp32 label scores; ties at
the k-th score go to the lowest token index).  The fused select (:func:`.triton_kernel.select_topk`) gives each
query head one program per chunk of up to 16384 tokens, and each program runs a 32-round block-wide search: at
batch 1 a few dozen programs do all the work in series (issue 19: "DoubleSparse top-k without one program per
head scanning all tokens"), and beyond 32k tokens at k = ctx/16 it has no plan at all.  Here every pass spreads
each head over ``C`` chunks (:func:`radix_plan`), in the manner of a GPU radix select (AIR top-k, Zhang et al.
2023, without its candidate buffers):

1. :func:`_radix_keys_kernel` - one program per kv head and chunk: the label scores of the kv head's ``G`` query
   heads (labels read once per kv head), mapped to order-preserving uint32 keys and stored ``[B*Hq, T]``, and
   each query head's per-chunk histogram of the keys' top digit.
2. :func:`_radix_pass_kernel`, once per further digit - one program per query head and chunk: sums the previous
   digit's per-chunk histograms, finds the digit of the k-th largest key and how many of k are still to place,
   then histograms the next digit among its chunk's keys that share the known prefix (the last pass also counts
   the keys above the prefix).
3. :func:`_radix_emit_kernel` - one program per query head and chunk: the k-th largest key is now known exactly,
   and every program knows from the per-chunk counts where its chunk's chosen tokens go (keys above the k-th in
   chunk order first, then the ties in token order until k are placed): the indices are written without atomics
   and the same on every run.

Digits are ``bits`` wide (8: five launches, 11: four); each pass reads the keys once more (4 bytes per token and
query head).  Nothing is compiled at import.

Status: opt-in (``triton_kernel.select_topk(config={"method": "radix"})``).  On an H200 it was slower than the fused
select at 39 of 40 cells timed (docs/results.md, session 28): Triton's ``tl.histogram`` costs about
``bins / 32 * log2(bins)`` operations per element and thread, so the keys kernel's 2 x G x 256 bins cost more than
the whole fused select, and at batch 1 every digit pays a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import num_sms, pow2

from .reference import Labels
from .triton_kernel import _orderable, supports_scores


@triton.jit
def _radix_keys_kernel(Q, sq_b, sq_h, CH, sch_h, L, sl_b, sl_h, sl_t, sl_c, SC, ZE, sz_b, sz_h, VA, sva_b,
                       KEYS, HIST, T, HKV, CHUNK, NCH,
                       G: tl.constexpr, GP: tl.constexpr, W: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr,
                       QUANT: tl.constexpr, HAS_VALID: tl.constexpr, BT: tl.constexpr, SHIFT: tl.constexpr,
                       NB: tl.constexpr):
    """Keys of the ``G`` query heads of one kv head over one chunk of tokens (labels read once for the group),
    and each head's histogram of the top digit (``key >> SHIFT``, ``NB`` bins) over the chunk."""
    pid = tl.program_id(0)  # b * HKV + h
    c = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)
    hq0 = (b * HKV + h) * G  # the kv head's first query-head row
    offs_g = tl.arange(0, GP)
    g_ok = offs_g < G
    q_rows = Q + b * sq_b + (h * G + offs_g).to(tl.int64) * sq_h
    qsum = tl.zeros([GP], tl.float32)
    if QUANT:  # the query summed over the label channels (the zero points' weight)
        for w in range(W):
            for j in tl.static_range(PER):
                qsum += tl.load(q_rows + tl.load(CH + h * sch_h + j * W + w), mask=g_ok, other=0.0).to(tl.float32)
    # one histogram of GP * NB bins for every head of the group; masked lanes count in bins >= GP * NB (dropped),
    # and no mask has to follow the [GP, BT] -> [GP * BT] reshape
    hist = tl.zeros([2 * GP * NB], tl.int32)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, T)
    for t0 in range(start, end, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < end
        acc = tl.zeros([GP, BT], tl.float32)
        for w in range(W):
            lab = tl.load(L + b * sl_b + h * sl_h + w * sl_c + offs_t.to(tl.int64) * sl_t, mask=t_ok, other=0)
            if QUANT:
                for j in tl.static_range(PER):
                    qv = tl.load(q_rows + tl.load(CH + h * sch_h + j * W + w), mask=g_ok, other=0.0).to(tl.float32)
                    acc += qv[:, None] * ((lab >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.float32)[None, :]
            else:
                qv = tl.load(q_rows + tl.load(CH + h * sch_h + w), mask=g_ok, other=0.0).to(tl.float32)
                acc += qv[:, None] * lab.to(tl.float32)[None, :]
        if QUANT:
            sc = tl.load(SC + b * sz_b + h * sz_h + offs_t, mask=t_ok, other=1.0).to(tl.float32)
            sc = tl.where(sc == 0.0, 1.0, sc)
            ze = tl.load(ZE + b * sz_b + h * sz_h + offs_t, mask=t_ok, other=0.0).to(tl.float32)
            acc = acc * sc[None, :] + qsum[:, None] * ze[None, :]
        if HAS_VALID:
            va = tl.load(VA + b * sva_b + offs_t, mask=t_ok, other=0) != 0
            acc = tl.where(va[None, :], acc, float("-inf"))
        key = _orderable(acc)
        ok = g_ok[:, None] & t_ok[None, :]
        tl.store(KEYS + (hq0 + offs_g)[:, None] * T + offs_t[None, :], key.to(tl.int32, bitcast=True), mask=ok)
        bins = tl.where(ok, offs_g[:, None] * NB + (key >> SHIFT).to(tl.int32), GP * NB)
        hist += tl.histogram(tl.reshape(bins, [GP * BT]), 2 * GP * NB)
    offs = tl.arange(0, 2 * GP * NB)
    g = offs // NB
    tl.store(HIST + ((hq0 + g) * NCH + c) * NB + offs % NB, hist, mask=g < G)


@triton.jit
def _resolve_digit(HIST, row, NCH, krem, NB: tl.constexpr, CB: tl.constexpr):
    """Sum one query head's per-chunk histograms ``HIST [rows, NCH, NB]`` and find the digit ``d`` of its
    ``krem``-th largest key among those counted: ``(d, krem - keys above d, summed histogram)``."""
    offs = tl.arange(0, NB)
    tot = tl.zeros([NB], tl.int32)
    for c0 in range(0, NCH, CB):
        cc = c0 + tl.arange(0, CB)
        tot += tl.sum(tl.load(HIST + (row * NCH + cc[:, None]) * NB + offs[None, :], mask=(cc < NCH)[:, None],
                              other=0), axis=0)
    at_least = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # counted keys with a digit >= d
    d = tl.sum((at_least >= krem).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(offs > d, tot, 0), axis=0)
    return d, krem - above


@triton.jit
def _radix_pass_kernel(KEYS, HPREV, HNEXT, STATE, ABOVE, T, K, CHUNK, NCH, PASS,
                       FIRST: tl.constexpr, NB_PREV: tl.constexpr, WIDTH_PREV: tl.constexpr, SHIFT: tl.constexpr,
                       NB: tl.constexpr, WIDTH: tl.constexpr, LAST: tl.constexpr, BT: tl.constexpr,
                       CB: tl.constexpr):
    """Resolve the previous digit (the top bits of the k-th largest key, and how many of the k are still to
    place among the keys sharing them), then histogram the next digit (``(key >> SHIFT) % NB``) among the chunk's
    keys with that prefix; ``LAST``: also count the chunk's keys above the prefix.  ``STATE [rows, 8, 2]``:
    (prefix, keys to place) after each pass, written by chunk 0."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if FIRST:
        prefix = tl.zeros([], tl.int32)
        krem = K
    else:
        prefix = tl.load(STATE + (row * 8 + PASS - 1) * 2)
        krem = tl.load(STATE + (row * 8 + PASS - 1) * 2 + 1)
    d, krem = _resolve_digit(HPREV, row, NCH, krem, NB_PREV, CB)
    prefix = (prefix << WIDTH_PREV) | d
    if c == 0:
        tl.store(STATE + (row * 8 + PASS) * 2, prefix)
        tl.store(STATE + (row * 8 + PASS) * 2 + 1, krem)
    pre = prefix.to(tl.uint32, bitcast=True)
    hist = tl.zeros([NB], tl.int32)
    above = tl.zeros([], tl.int32)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, T)
    for t0 in range(start, end, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < end
        key = tl.load(KEYS + row * T + offs_t, mask=t_ok, other=0).to(tl.uint32, bitcast=True)
        top = key >> (SHIFT + WIDTH)
        hist += tl.histogram(((key >> SHIFT) & (NB - 1)).to(tl.int32), NB, mask=t_ok & (top == pre))
        if LAST:
            above += tl.sum((t_ok & (top > pre)).to(tl.int32), axis=0)
    tl.store(HNEXT + (row * NCH + c) * NB + tl.arange(0, NB), hist)
    if LAST:
        tl.store(ABOVE + row * NCH + c, above)


@triton.jit
def _radix_emit_kernel(KEYS, HLAST, STATE, ABOVE, OUT, T, K, CHUNK, NCH, PASS,
                       NB: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr, CB: tl.constexpr):
    """The k-th largest key ``thr`` (the last digit resolved); the chunk's keys above it go to the slots after
    those of earlier chunks, then the ties in token order into the slots after every key above, until k are
    placed.  Writes the chosen token indices ``OUT [rows, K]`` (int64)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    prefix = tl.load(STATE + (row * 8 + PASS - 1) * 2)
    krem = tl.load(STATE + (row * 8 + PASS - 1) * 2 + 1)
    d, need = _resolve_digit(HLAST, row, NCH, krem, NB, CB)
    thr = (prefix.to(tl.uint32, bitcast=True) << WIDTH) | d.to(tl.uint32)
    offs = tl.arange(0, NB)
    base_above = tl.zeros([], tl.int32)
    base_tie = tl.zeros([], tl.int32)
    for c0 in range(0, c, CB):  # what the earlier chunks place
        cc = c0 + tl.arange(0, CB)
        cm = cc < c
        hh = tl.load(HLAST + (row * NCH + cc[:, None]) * NB + offs[None, :], mask=cm[:, None], other=0)
        base_above += tl.sum(tl.load(ABOVE + row * NCH + cc, mask=cm, other=0), axis=0)
        base_above += tl.sum(tl.sum(tl.where(offs[None, :] > d, hh, 0), axis=1), axis=0)
        base_tie += tl.sum(tl.sum(tl.where(offs[None, :] == d, hh, 0), axis=1), axis=0)
    n_above = K - need
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, T)
    for t0 in range(start, end, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < end
        key = tl.load(KEYS + row * T + offs_t, mask=t_ok, other=0).to(tl.uint32, bitcast=True)
        above = t_ok & (key > thr)
        tie = t_ok & (key == thr)
        run = tl.cumsum(tie.to(tl.int32) + (above.to(tl.int32) << 16), axis=0)
        tie_rank = base_tie + (run & 0xFFFF) - 1
        pos = tl.where(above, base_above + (run >> 16) - 1, n_above + tie_rank)
        tl.store(OUT + row * K + pos, offs_t.to(tl.int64), mask=above | (tie & (tie_rank < need)))
        base_above += tl.sum(above.to(tl.int32), axis=0)
        base_tie += tl.sum(tie.to(tl.int32), axis=0)


# bits: digit width (8: keys + 3 passes + emit; 11: keys + 2 passes + emit); block_t: tokens per loop step (at most
# 32768: the emit packs two counts in one prefix sum); programs_per_sm: chunks per head so that each pass runs about
# this many programs per SM; min_chunk: tokens a chunk holds at least; hist_chunks: per-chunk histograms summed per
# step
RADIX_CONFIG = dict(bits=8, block_t=1024, programs_per_sm=4, min_chunk=1024, num_warps=4, hist_chunks=8)


def digit_widths(bits: int) -> list[int]:
    """Widths of the key's digits, top first (they sum to 32)."""
    if not 4 <= bits <= 12:
        raise ValueError(f"radix digit bits must be in [4, 12], got {bits}")
    widths = []
    left = 32
    while left > 0:
        widths.append(min(bits, left))
        left -= widths[-1]
    if len(widths) > 8:
        raise ValueError(f"{bits}-bit digits need {len(widths)} passes; at most 8")
    return widths


def radix_plan(rows: int, tokens: int, sms: int, cfg: dict) -> tuple[int, int]:
    """``(chunks, tokens per chunk)``: each query head's tokens in chunks of whole ``block_t`` steps, at least
    ``min_chunk`` tokens, enough of them that a pass over ``rows`` heads runs ``programs_per_sm`` programs per SM."""
    bt = int(cfg["block_t"])
    want = max(1, -(-int(cfg["programs_per_sm"]) * sms // max(1, rows)))
    chunk = max(int(cfg["min_chunk"]), -(-tokens // want))
    chunk = -(-chunk // bt) * bt
    return -(-tokens // chunk), chunk


def select_topk_radix(query: torch.Tensor, labels: Labels, channels: torch.Tensor, valid: torch.Tensor | None,
                      k: int, *, config: dict | None = None) -> torch.Tensor:
    """See :func:`.reference.select_topk` (and the module docstring); ``config`` overrides :data:`RADIX_CONFIG`.
    Takes what :func:`.triton_kernel.supports_scores` accepts (any label layout; channel-major reads coalesce)."""
    if not supports_scores(query, labels, channels):
        raise ValueError("select_topk_radix: unsupported arguments (see triton_kernel.supports_scores)")
    t = labels.num_tokens
    if not 0 < k <= t:
        raise ValueError(f"k must be in [1, {t}], got {k}")
    cfg = {**RADIX_CONFIG, **(config or {})}
    b, hq, _ = query.shape
    hkv, _ = channels.shape
    g = hq // hkv
    rows = b * hq
    dev = query.device
    out = torch.empty(b, hq, k, device=dev, dtype=torch.int64)
    if rows == 0:
        return out
    widths = digit_widths(int(cfg["bits"]))
    sms = num_sms(dev.index or 0) if dev.type == "cuda" else 4
    chunks, chunk = radix_plan(rows, t, sms, cfg)
    bt = min(int(cfg["block_t"]), chunk)
    warps = int(cfg["num_warps"])
    cb = int(cfg["hist_chunks"])
    quant = labels.bits != 16
    lab = labels.data
    channels = channels.to(device=dev).contiguous()
    keys = torch.empty(rows, t, device=dev, dtype=torch.int32)
    hists = [torch.empty(rows, chunks, 1 << w, device=dev, dtype=torch.int32) for w in widths]
    state = torch.empty(rows, 8, 2, device=dev, dtype=torch.int32)
    above = torch.empty(rows, chunks, device=dev, dtype=torch.int32)
    sc = labels.scale if quant else keys
    ze = labels.zero if quant else keys
    va = valid.view(torch.uint8) if valid is not None else keys
    _radix_keys_kernel[(b * hkv, chunks)](
        query, query.stride(0), query.stride(1), channels, channels.stride(0),
        lab, lab.stride(0), lab.stride(1), lab.stride(2), lab.stride(3),
        sc, ze, sc.stride(0) if quant else 0, sc.stride(1) if quant else 0,
        va, va.stride(0) if valid is not None else 0,
        keys, hists[0], t, hkv, chunk, chunks,
        G=g, GP=max(2, pow2(g)), W=lab.shape[-1], PER=8 // labels.bits if quant else 1,
        BITS=labels.bits if quant else 16, QUANT=quant, HAS_VALID=valid is not None, BT=bt,
        SHIFT=32 - widths[0], NB=1 << widths[0], num_warps=warps)
    done = widths[0]
    for p in range(1, len(widths)):
        done += widths[p]
        _radix_pass_kernel[(rows, chunks)](
            keys, hists[p - 1], hists[p], state, above, t, k, chunk, chunks, p,
            FIRST=p == 1, NB_PREV=1 << widths[p - 1], WIDTH_PREV=widths[p - 1], SHIFT=32 - done,
            NB=1 << widths[p], WIDTH=widths[p], LAST=p == len(widths) - 1, BT=bt, CB=cb, num_warps=warps)
    _radix_emit_kernel[(rows, chunks)](keys, hists[-1], state, above, out, t, k, chunk, chunks, len(widths),
                                       NB=1 << widths[-1], WIDTH=widths[-1], BT=bt, CB=cb, num_warps=warps)
    return out
