"""KIVI lanes in Triton: every quantized lane of a layer read in ONE split-KV launch (plus one small merge).

Same signature and semantics as :func:`.lanes_reference.kivi_lanes_attention_partial`
(``(out fp32 [B, H, M, Dv], lse fp32 [B, H, M])``).  Nothing is compiled at import.

How it works (the LeanK lanes kernel's launch scheme, :mod:`kvcompress.kernels.leank.triton_kernel`, over the KIVI
kernel's in-register dequantisation, :mod:`.triton_kernel`):

* Every (lane, head) pair is one *row* of a flat row space.  Program ``(split, batch * row, row block)`` finds its
  lane by a static loop over the lanes (one specialised copy of the inner loop per lane: the lane's kept-channel
  count, its packed key words and their power-of-two padding are compile-time constants, so a 32-channel lane
  unpacks 32 channels, not the 128 of a full head).  The lanes share their token slots (one ring, one ``valid``),
  so every lane is split at the same token boundaries.
* Inner loop: :func:`.triton_kernel._attend_tokens`, the plain KIVI v2 kernel's own - the query rows of the head,
  gathered in-kernel to the lane's kept channels (no gather launch) and pre-scaled by ``scale * log2(e)``, are
  loaded once; per tile of ``BN`` tokens the packed key and value words are unpacked into fp16 tiles (two codes per
  instruction, scales and zeros by one packed FMA), ``S = K q^T`` and ``O^T = V^T P^T`` run on tensor cores
  (``tl.dot``, the GQA rows as the small N operand), with an online base-2 softmax.
* Each program writes a normalised partial and its LSE; the LeanK lanes kernel's merge
  (:func:`~kvcompress.kernels.leank.triton_kernel._combine_splits_kernel`, which folds several splits per step - the
  default since session 16 -, or with ``combine: "loop"`` in the configuration
  :func:`kvcompress.kernels.leank.triton_kernel._combine_kernel`, one split per step) then folds, per (batch, head),
  every split of every lane row that holds that head (heads no lane covers: ``-inf`` and zeros).

Launches: one (or one per :data:`MAX_LANES` lanes) + one merge, whatever the number of lanes; before, a stacked
layer ran a KIVI launch (plus its split merge), a query gather and a head scatter per lane.

Launch configuration: the KIVI kernel's (:func:`.triton_kernel._config`, ``KVCOMPRESS_KIVI_CONFIG``), resolved once
by :mod:`kvcompress.kernels.ops` and passed as ``base``.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import cap_base2
from kvcompress.kernels.attention.triton_shared import pow2 as _pow2
from kvcompress.kernels.leank.triton_kernel import launch_combine

from .lanes_reference import KiviLane, PackedLanes
from .triton_kernel import MAX_DIM, _asm_ok, _attend_tokens, _config, _inner_contiguous, _pairs, _target_programs

LOG2E = 1.4426950408889634
MAX_LANES = 8


# Runtime sizes are not specialised (token counts, heads per lane, rows: one compile per layer layout, whatever
# the cache length); strides stay specialised (stable per store, and they enable vector loads).
@triton.jit(do_not_specialize=["NHS", "ROW0", "M", "R", "RLO", "RN", "NBATCH", "NT", "TPS"])
def _kivi_lanes_kernel(
    Q, sq_b, sq_h, sq_m, VALID, sva_b, LENGTH, PO, PL,
    KCS, KSS, KZS, VCS, VSS, VZS, CHS, HDS,
    SKC_B, SKC_H, SKC_G, SKS_B, SKS_H, SKS_G, SKZ_B, SKZ_H, SKZ_G,
    SVC_B, SVC_H, SVC_T, SVS_B, SVS_H, SVS_T, SVZ_B, SVZ_H, SVZ_T, SCH, NHS, ROW0,
    qk_scale, cap, M, R, RLO, RN, NBATCH, NT, TPS, LGS,
    HAS_CHAN: tl.constexpr, HAS_HEADS: tl.constexpr, DK: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr,
    NL: tl.constexpr, DV: tl.constexpr, VW_PAD: tl.constexpr, G: tl.constexpr, GV: tl.constexpr,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr, LAZY: tl.constexpr,
    ASM: tl.constexpr, PREFETCH: tl.constexpr, HAS_LENGTH: tl.constexpr, SOFTCAP: tl.constexpr,
    LOGITS: tl.constexpr,
):
    """One (split, batch * lane row, row block): the partial of one head of one lane over ``TPS`` token slots.

    ``KSS`` / ``KZS``: each lane's key scales / zeros viewed as int32 pairs of adjacent channels (strides in
    pairs).  ``HAS_LENGTH``: slots at or after ``*LENGTH`` are neither loaded nor attended (the splits stay sized
    for the capacity, so a split beyond it writes an empty partial at once: the grid never depends on it)."""
    DV_PAD: tl.constexpr = VW_PAD * (32 // BITS)
    pid_s = tl.program_id(0)
    pid_br = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_br // RN).to(tl.int64)
    r = RLO + pid_br % RN
    t_start = pid_s * TPS
    t_end = tl.minimum(t_start + TPS, NT)
    if HAS_LENGTH:
        t_end = tl.minimum(t_end, tl.load(LENGTH).to(tl.int32))
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, DV_PAD)
    for i in tl.static_range(NL):
        if (r >= ROW0[i]) & (r < ROW0[i] + NHS[i]):
            j = (r - ROW0[i]).to(tl.int64)
            if HAS_HEADS[i]:
                head = tl.load(HDS[i] + j).to(tl.int64)
            else:
                head = j
            out, lse = _attend_tokens(
                Q, b * sq_b + head * sq_h, sq_m, CHS[i], j * SCH[i],
                KCS[i] + b * SKC_B[i] + j * SKC_H[i], KSS[i] + b * SKS_B[i] + j * SKS_H[i],
                KZS[i] + b * SKZ_B[i] + j * SKZ_H[i], VCS[i] + b * SVC_B[i] + j * SVC_H[i],
                VSS[i] + b * SVS_B[i] + j * SVS_H[i], VZS[i] + b * SVZ_B[i] + j * SVZ_H[i], VALID + b * sva_b,
                SKC_G[i], SKS_G[i], SKZ_G[i], SVC_T[i], SVS_T[i], SVZ_T[i], t_start, t_end, qk_scale, cap, M, pid_m,
                LGS[i], (b * NHS[i] + j) * M * NT, NT,
                HAS_CHAN[i], DK[i], KW[i], KW_PAD[i], DV, VW_PAD, G, GV, BITS, BLOCK_M, BN, TRANS, LAZY, ASM,
                PREFETCH, SOFTCAP, LOGITS)
            row = (pid_s.to(tl.int64) * NBATCH + b) * R + r
            tl.store(PO + (row * M + offs_m[:, None]) * DV + offs_d[None, :], out,
                     mask=m_ok[:, None] & (offs_d < DV)[None, :])
            tl.store(PL + row * M + offs_m[:, None], lse, mask=m_ok[:, None])


# ----------------------------------------------------------------------------- host side


def problem(query: torch.Tensor, region: PackedLanes) -> str | None:
    """Why the kernel cannot take this call (``None``: it can): the capability check, shapes and dtypes only."""
    bits, g = region.bits, region.group
    if bits not in (2, 4):
        return f"bits {bits}"
    if g < 16 or g > 128 or g & (g - 1):
        return f"key group {g} (a power of two in 16..128)"
    if getattr(region, "k_per_token", False):
        return "per-token keys (ablation)"
    if query.dim() != 4 or not region.lanes:
        return "query must be [B, H, M, D] and there must be at least one lane"
    b, h, m, d = query.shape
    per = 32 // bits
    t = region.valid.shape[-1]
    if tuple(region.valid.shape) != (b, t) or t % g:
        return f"valid {tuple(region.valid.shape)}"
    dv = region.lanes[0].v_codes.shape[-1] * per
    gv = dv // max(1, region.lanes[0].v_scale.shape[-1])
    if dv > MAX_DIM or gv < 2 or gv & (gv - 1) or dv % gv:
        return f"value dim {dv} / group {gv}"
    if d > MAX_DIM:
        return f"query dim {d} (up to {MAX_DIM})"
    for lane in region.lanes:
        nh = h if lane.heads is None else lane.heads.shape[0]
        c = lane.k_scale.shape[-1]
        if c % 2 or c > MAX_DIM or (lane.channels is None and c != d):
            return f"a lane of {c} key channels (even, up to {MAX_DIM}; all {d} without a channel list)"
        if lane.channels is not None and tuple(lane.channels.shape) != (nh, c):
            return f"channels {tuple(lane.channels.shape)} for {nh} heads of {c} channels"
        if tuple(lane.k_codes.shape) != (b, nh, t // g, -(-c // per), g) or lane.k_zero.shape != lane.k_scale.shape \
                or tuple(lane.k_scale.shape) != (b, nh, t // g, c):
            return f"key payload {tuple(lane.k_codes.shape)} / {tuple(lane.k_scale.shape)}"
        if tuple(lane.v_codes.shape) != (b, nh, t, dv // per) or lane.v_zero.shape != lane.v_scale.shape \
                or tuple(lane.v_scale.shape) != (b, nh, t, dv // gv):
            return f"value payload {tuple(lane.v_codes.shape)} / {tuple(lane.v_scale.shape)}"
        if lane.k_codes.dtype != torch.int32 or lane.v_codes.dtype != torch.int32 \
                or lane.k_scale.dtype != torch.float16 or lane.v_scale.dtype != torch.float16:
            return "int32 codes and fp16 scales"
    return None


def supports(query: torch.Tensor, region: PackedLanes) -> bool:
    return problem(query, region) is None


def _lane_tensors(lane: KiviLane, dummy: torch.Tensor) -> tuple:
    """One lane's eight pointer arguments as the kernel reads them (innermost dims contiguous, scales as pairs;
    ``dummy`` stands for an absent channel / head list), and its channel list (``None``: all channels)."""
    kc = _inner_contiguous(lane.k_codes, 2)
    ks, kz = _pairs(lane.k_scale), _pairs(lane.k_zero)
    vc = _inner_contiguous(lane.v_codes, 1)
    vs, vz = _inner_contiguous(lane.v_scale, 1), _inner_contiguous(lane.v_zero, 1)
    ch = lane.channels
    if ch is not None and ch.stride(-1) != 1:
        ch = ch.contiguous()
    return (kc, ks, kz, vc, vs, vz, ch if ch is not None else dummy,
            lane.heads if lane.heads is not None else dummy), ch


def _lane_args(lane: KiviLane, dummy: torch.Tensor) -> dict:
    """One lane's tensors and strides as the kernel reads them (:func:`_lane_tensors`)."""
    pointers, ch = _lane_tensors(lane, dummy)
    kc, ks, kz, vc, vs, vz = pointers[:6]
    pairs = ((kc, lane.k_codes), (ks, lane.k_scale), (kz, lane.k_zero), (vc, lane.v_codes), (vs, lane.v_scale),
             (vz, lane.v_zero), (ch, lane.channels))
    copied = any(t is not None and t.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
                 for t, src in pairs)
    return dict(copied=copied, t=pointers,
                s=(kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
                   kz.stride(0), kz.stride(1), kz.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                   vs.stride(0), vs.stride(1), vs.stride(2), vz.stride(0), vz.stride(1), vz.stride(2),
                   ch.stride(0) if ch is not None else 0),
                h=kc.shape[1], c=lane.k_scale.shape[-1], kw=kc.shape[3], has_chan=ch is not None,
                has_heads=lane.heads is not None)


#: fewest tokens per split on CUDA (``lanes_min_split_tokens`` in the configuration overrides it).  128 with the merge
#: that folds several splits per step (``combine: "splits"``, the default of :func:`.triton_kernel._config`), measured
#: in session 16 on an H200 (docs/results.md, issue 19): the leank-rope70-kivi2 GraphStep step at Llama B1/32k takes
#: 8.60 ms GPU-busy (floor 512: 8.83; with the one-split-per-step merge 10.78 at floor 128 and 9.38 at 512; the
#: per-lane read of session 9: 9.39), and the kernel sweep ranks it first or equal at B1/4k, B1/32k and B16/32k.
#: The one-split merge walked 256 splits serially at B1/32k, which is why the low floor lost with it.
LANES_MIN_SPLIT_TOKENS = 128

#: attribute of a region's ``valid`` tensor holding the launch plan of its lanes (see :func:`_cached_plan`)
PLAN_ATTR = "_kvcompress_kivi_lanes_plan"


class _Plan:
    """Everything a launch takes that depends on the lanes' tensors (strides, shapes), the query's shape and the
    configuration, not on any value: built once per store change and reused by every call of a decode.

    A plan holds no tensor: the lanes it was made for are weak references (``inputs``, checked by identity), and the
    pointer arguments are taken from the call's own lanes (:func:`_lane_tensors`).  A plan cached on a store's
    ``valid`` therefore keeps nothing else alive - under ``torch.compile(mode="reduce-overhead")`` the tensors a call
    sees while CUDA graphs are recorded live in the graphs' private pool, and a cache holding one of them fails the
    recording ("tensors in the cudagraph pool not tracked as outputs")."""

    __slots__ = ("base", "shape", "inputs", "copied", "chunks", "combine", "n_rows", "splits", "dv", "block_m",
                 "m_blocks", "tensors")


def _make_plan(query: torch.Tensor, region: PackedLanes, cfg: dict, splits: int | None) -> _Plan:
    b, hq, m, d = query.shape
    bits, g = region.bits, region.group
    per = 32 // bits
    nt = region.valid.shape[-1]
    lanes = region.lanes
    dv = lanes[0].v_codes.shape[-1] * per
    gv = dv // lanes[0].v_scale.shape[-1]
    bn = int(cfg["BN"])
    if bn > g and bn % g:
        bn = g
    block_m = min(64, max(cfg["min_rows"] if cfg["TRANS"] else 16, _pow2(m)))
    m_blocks = triton.cdiv(m, block_m)
    dummy = lanes[0].k_codes  # placeholder pointer of absent channel / head lists, never read
    rows = [_lane_args(lane, dummy) for lane in lanes]
    r0 = 0
    for r in rows:
        r["r0"] = r0
        r0 += r["h"]
    n_rows = r0
    if splits is None:  # enough programs for a few full waves, each split a whole number of tiles
        dev = query.device
        floor = cfg.get("lanes_min_split_tokens", LANES_MIN_SPLIT_TOKENS)
        most = -(-nt // max(bn, floor)) if dev.type == "cuda" else -(-nt // bn)
        want = -(-_target_programs(dev, cfg["waves"], cfg["num_warps"]) // (b * n_rows * m_blocks))
        splits = max(1, min(most, want))
    tps = -(-nt // max(1, min(splits, -(-nt // bn))))
    tps = -(-tps // bn) * bn
    splits = -(-nt // tps)
    asm = bool(cfg["ASM"])
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        options["maxnreg"] = int(cfg["maxnreg"])
    plan = _Plan()
    plan.chunks = []
    for first in range(0, len(rows), MAX_LANES):
        chunk = rows[first:first + MAX_LANES]
        n_chunk = sum(r["h"] for r in chunk)
        strides = tuple(tuple(r["s"][k] for r in chunk) for k in range(19))
        args = (*strides, tuple(r["h"] for r in chunk), tuple(r["r0"] for r in chunk))
        scalars = (m, n_rows, chunk[0]["r0"], n_chunk, b, nt, tps)
        constexprs = dict(
            HAS_CHAN=tuple(r["has_chan"] for r in chunk), HAS_HEADS=tuple(r["has_heads"] for r in chunk),
            DK=tuple(r["c"] for r in chunk), KW=tuple(r["kw"] for r in chunk),
            KW_PAD=tuple(max(_pow2(r["kw"]), -(-16 // per)) for r in chunk), NL=len(chunk), DV=dv,
            VW_PAD=max(_pow2(dv // per), -(-16 // per)), G=g, GV=gv, BITS=bits, BLOCK_M=block_m, BN=bn,
            TRANS=cfg["TRANS"], LAZY=cfg["LAZY"], ASM=asm, PREFETCH=bool(cfg["PREFETCH"]), **options)
        plan.chunks.append(((splits, b * n_chunk, m_blocks), (first, first + len(chunk)), args, scalars, constexprs))
    kernel, grid, extra = launch_combine(cfg, splits, b, hq, m, block_m, m_blocks)
    plan.combine = (kernel, grid, (tuple(r["h"] for r in rows), tuple(r["r0"] for r in rows), splits, n_rows, m, hq, b),
                    dict(HAS_HEADS=tuple(r["has_heads"] for r in rows), NL=len(rows), DV=dv, DVP=max(16, _pow2(dv)),
                         **extra))
    plan.n_rows, plan.splits, plan.dv, plan.block_m, plan.m_blocks = n_rows, splits, dv, block_m, m_blocks
    plan.copied = any(r["copied"] for r in rows)
    plan.base = plan.shape = plan.inputs = None
    plan.tensors = [r["t"] for r in rows]  # this call's pointers (dropped before the plan is cached)
    return plan


def _cached_plan(query: torch.Tensor, region: PackedLanes, base: dict) -> _Plan:
    """The plan of ``region``'s lanes for queries shaped like ``query`` under configuration ``base``, cached on the
    region's ``valid`` tensor.  A store builds its region's tensors once per change (a static store: once), so the
    plan is made once per change; a call then checks only that the lanes are the same tensor objects (the plan holds
    them while ``valid`` lives, and a store replaces its buffers and its mask together).  A lane whose tensors needed
    a contiguous copy is planned again at every call (a copy would not see the store's later writes)."""
    plan = _make_plan(query, region, base, None)
    plan.base, plan.shape = base, query.shape
    plan.inputs = tuple(None if x is None else weakref.ref(x) for lane in region.lanes for x in lane)
    if not plan.copied:
        setattr(region.valid, PLAN_ATTR, plan)
    return plan


def kivi_lanes_attention_partial(query: torch.Tensor, region: PackedLanes, scale: float, *,
                                 length: torch.Tensor | None = None, softcap: float | None = None,
                                 splits: int | None = None, config: dict | None = None,
                                 base: dict | None = None,
                                 logits: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention over every lane of ``region``; see :func:`.lanes_reference.kivi_lanes_attention_partial`.

    ``length`` (default ``region.length``): 0-dim int device tensor, the leading token slots that may be live (later
    slots are not read; the launch does not depend on its value: CUDA-graph safe).  ``base``: the launch
    configuration (:func:`.triton_kernel.resolved_config`, what :mod:`kvcompress.kernels.ops` resolves once): with
    it the launch plan is cached per region (:func:`_cached_plan`), and a call checks the region's shapes only when
    it plans; without it :func:`.triton_kernel._config` (which reads ``KVCOMPRESS_KIVI_CONFIG``) is read and the call
    planned.  ``config`` entries override either (no cache); ``splits``: force the number of token splits (tests).
    ``logits``: one contiguous float32 tensor ``[B, h_i, M, T]`` per lane, filled with the scores the kernel
    computes (natural-log units, ``-inf`` on invalid slots; slots not read keep their content: pass them filled
    with ``-inf``), as :func:`.lanes_reference.kivi_lanes_attention_scored` returns them (a compile-time switch)."""
    if length is None:
        length = region.length
    if length is not None and (length.dim() != 0 or length.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"length must be a 0-dim int32/int64 tensor, got {tuple(length.shape)} {length.dtype}")
    b, hq, m, d = query.shape
    dev = query.device
    cached = base is not None and not config and splits is None
    plan = getattr(region.valid, PLAN_ATTR, None) if cached else None
    if plan is None or plan.base is not base or plan.shape != query.shape or not _same_inputs(plan, region):
        why = problem(query, region)
        if why is not None:
            raise ValueError(f"the Triton KIVI lanes kernel does not take this call: {why}")
        if cached:
            plan = _cached_plan(query, region, base)
        else:
            cfg = dict(base) if base is not None else _config(region.bits, region.group, d, region.v_dim,
                                                              region.v_group)
            cfg["ASM"] = bool(cfg["ASM"]) and (base is not None or _asm_ok(dev))  # a base is resolved already
            if config:
                cfg.update(config)
            plan = _make_plan(query, region, cfg, splits)
    rows, plan.tensors = plan.tensors, None  # a plan made by this call: its pointers; a cached plan holds none
    out = torch.empty(b, hq, m, plan.dv, device=dev, dtype=torch.float32)
    lse = torch.empty(b, hq, m, device=dev, dtype=torch.float32)
    if b * hq * m == 0:
        return out, lse
    if region.valid.shape[-1] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if logits is not None:
        shapes = [(b, hq if lane.heads is None else lane.heads.shape[0], m, region.valid.shape[-1])
                  for lane in region.lanes]
        if len(logits) != len(shapes) or any(tuple(x.shape) != sh or x.dtype != torch.float32
                                             or not x.is_contiguous() for x, sh in zip(logits, shapes)):
            raise ValueError(f"logits must be one contiguous float32 tensor per lane shaped {shapes}")
    q = query if query.stride(-1) == 1 else query.contiguous()
    valid = region.valid if region.valid.stride(-1) == 1 else region.valid.contiguous()
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    po = torch.empty(plan.splits, b, plan.n_rows, m, plan.dv, device=dev, dtype=torch.float32)
    pl = torch.empty(plan.splits, b, plan.n_rows, m, device=dev, dtype=torch.float32)
    qk, cap = float(scale) * LOG2E, cap_base2(softcap)
    if rows is None:  # a cached plan: this call's lanes give the pointers
        dummy = region.lanes[0].k_codes
        rows = [_lane_tensors(lane, dummy)[0] for lane in region.lanes]
    for grid, (first, stop), args, scalars, constexprs in plan.chunks:
        tensors = tuple(tuple(t[k] for t in rows[first:stop]) for k in range(8))
        lgs = tuple(logits[first:stop]) if logits is not None else (pl,) * (stop - first)
        _kivi_lanes_kernel[grid](q, q.stride(0), q.stride(1), q.stride(2), valid, valid.stride(0),
                                 length if length is not None else valid, po, pl, *tensors, *args, qk, cap, *scalars,
                                 lgs, HAS_LENGTH=length is not None, SOFTCAP=bool(softcap),
                                 LOGITS=logits is not None, **constexprs)
    kernel, grid, args, constexprs = plan.combine
    kernel[grid](po, pl, out, lse, tuple(t[7] for t in rows), *args, **constexprs)
    return out, lse


def _same_inputs(plan: _Plan, region: PackedLanes) -> bool:
    """Whether ``region``'s lanes are the very tensor objects ``plan`` was made for (held by weak reference)."""
    inputs = plan.inputs
    i = 0
    for lane in region.lanes:
        for x in lane:
            if i >= len(inputs):
                return False
            ref = inputs[i]
            if (None if ref is None else ref()) is not x:
                return False
            i += 1
    return i == len(inputs)


__all__ = ["MAX_LANES", "kivi_lanes_attention_partial", "problem", "supports"]
