"""KIVI lanes on the hand-written CUDA kernel (v3): every lane of a stacked LeanK + KIVI layer in ONE launch.

Same signature and semantics as :func:`.lanes_reference.kivi_lanes_attention_partial` (``(out fp32 [B, H, M, Dv],
lse fp32 [B, H, M])``), for regions whose lanes hold disjoint heads (what the stores build).  Nothing is compiled at
import: the first call builds the library for the region's ``(bits, Dv)`` and its lanes' kept-channel counts
(:func:`.cuda_kernel.build` with ``lane_dks``; cached like the plain kernel's).

How it works (``kivi_v3_lanes_kernel`` in ``cuda_kernel.cu``): the grid is the plain kernel's - ``(splits, B*H,
row blocks of 8)`` - over the REGION's heads; the CTA of head ``h`` looks up its lane and its row among the lane's
heads in the lanes' head lists (device tensors: nothing is read on the host per call, so the launch is captured into
CUDA graphs like any other; the lanes must be disjoint, checked once per region), and runs the plain kernel's body
(``attend``) specialised for that lane's kept-channel count ``c``: the query rows of the head are gathered to the
lane's kept channels while the B fragments are built (no gather launch), the packed keys of ``c`` channels are
dequantized in registers as in the plain kernel - with ``c`` not a multiple of 4 key words (16, 32, 48, 96 ... at 2
bits), the last words are shared by the 4 quad lanes, quad lane ``t`` taking quarter ``t`` of each after one shift
(:func:`.cuda_kernel.key_words`, :func:`.cuda_kernel.local_pair`; the CPU emulator :func:`.cuda_kernel.emulate` runs
the same mapping) - and the values as in the plain kernel.  A head no lane holds writes LSE ``-inf`` and zeros, so
the plain kernel's split merge (``kivi_v3_combine``) finishes the read: 2 launches whatever the number of lanes.

Before this, a stacked layer read its lanes with the Triton lanes kernel (:mod:`.lanes_triton`, the KIVI v2 inner
loop, about 3x slower per byte than this kernel's) or one launch per lane.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import cuda_kernel as ck
from .lanes_reference import PackedLanes, disjoint_or_none
from ..attention import split_plan
from ..leank.reference import merge_with_lse
from .reference import PackedKV

#: the most lanes one launch takes (``kivi_v3::MAX_LANES``)
MAX_LANES = 8
#: ints of one lane's entry in the launcher's argument array (``kivi_v3_lanes_launch``)
LANE_INTS = 29

_LOCK = threading.Lock()  # the launcher fills one static parameter block
_PLANS: dict[tuple, tuple] = {}


def covered_heads(region: PackedLanes) -> int:
    """How many of the region's heads some lane holds (from the lanes' shapes; the lanes are disjoint)."""
    return sum(n for _, n in lane_shapes(region))


def lane_shapes(region: PackedLanes) -> tuple[tuple[int, int], ...]:
    """``(kept key channels, heads)`` of each lane, in the lanes' order (what a launch's split plan depends on)."""
    return tuple((lane.k_scale.shape[-1], region.num_heads if lane.heads is None else lane.heads.numel())
                 for lane in region.lanes)


def _lane_packed(region: PackedLanes, lane) -> PackedKV:
    return PackedKV(region.bits, region.group, lane.k_codes, lane.k_scale, lane.k_zero, lane.v_codes, lane.v_scale,
                    lane.v_zero, region.valid)


def problem(query: torch.Tensor, region: PackedLanes) -> str | None:
    """Why this kernel cannot read ``region`` for ``query`` (``None`` when it can); shapes only, no device work."""
    if not isinstance(region, PackedLanes):
        return "not a PackedLanes region"
    if not region.lanes or len(region.lanes) > MAX_LANES:
        return f"{len(region.lanes)} lanes (1 .. {MAX_LANES})"
    if query.dim() != 4 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"query {tuple(query.shape)} {query.dtype} ([B, H, M, D] fp16 / bf16 / fp32: read as fp16)"
    b, h, m, d = query.shape
    if h != region.num_heads:
        return f"{h} query heads for a region of {region.num_heads}"
    if any(lane.heads is None for lane in region.lanes) and len(region.lanes) > 1:
        return "an all-heads lane beside others"
    if any(lane.heads is not None and (lane.heads.dtype != torch.int64 or lane.heads.dim() != 1
                                       or lane.heads.stride(0) != 1) for lane in region.lanes):
        return "lane head lists must be dense int64 vectors"
    disjoint = True if len(region.lanes) == 1 else disjoint_or_none(region)  # one host read per region (cached)
    if disjoint is None:
        return "a new region during CUDA-graph capture: run one call before capturing (it checks the lanes' heads)"
    if not disjoint:
        return "a head in two lanes"
    dv = None
    for lane in region.lanes:
        c = lane.k_scale.shape[-1]
        rows = region.num_heads if lane.heads is None else lane.heads.numel()
        if lane.channels is None and c != d:
            return f"a lane without a channel list keeps {c} of {d} channels"
        if lane.channels is not None and (lane.channels.dtype != torch.int64 or tuple(lane.channels.shape) != (rows, c)
                                          or lane.channels.stride(-1) != 1):
            return f"channels {tuple(lane.channels.shape)} {lane.channels.dtype} (int64 [{rows}, {c}], rows dense)"
        why = ck._problem(torch.empty((b, rows, m, c), dtype=query.dtype, device="meta"), _lane_packed(region, lane),
                          ck.LANE_DIMS)
        if why is not None:
            return f"lane of {c} channels: {why}"
        lane_dv = (lane.v_codes.shape[-1] * (32 // region.bits), lane.v_scale.shape[-1])
        if dv is not None and lane_dv != dv:
            return "lanes of different value widths or value groups"
        dv = lane_dv
    return None


def supports(query: torch.Tensor, region: PackedLanes) -> bool:
    """The explicit capability check: a CUDA device with nvcc, and :func:`problem` finds nothing."""
    return ck._device_ok(query.device) and problem(query, region) is None


def buffer_problem(query: torch.Tensor, region: PackedLanes, k: torch.Tensor, v: torch.Tensor,
                   valid: torch.Tensor, region_checked: bool = False) -> str | None:
    """Why the lanes launch cannot also read the full-precision buffer ``k`` / ``v`` ``[B, H, T, D / Dv]`` (every
    region head, all ``D`` query channels; fp16 or bf16, channels dense) with validity ``valid [B, T]`` (bool), as
    the plain kernel's buffer CTAs do (``None`` when it can).  ``region_checked``: the region itself is known to be
    readable (its implementation was chosen for it) - only the buffer's shapes are checked, nothing is read from the
    device (what a compiled step traces); else :func:`problem` first."""
    why = None if region_checked else problem(query, region)
    if why is not None:
        return why
    d = query.shape[-1]
    if d % 64 or not 64 <= d <= 256:
        return f"query head dim {d} (the buffer CTAs take multiples of 64 up to 256)"
    if region.v_dim % 32:
        return f"value width {region.v_dim} (the buffer CTAs take multiples of 32)"
    return ck.buffer_tensors_problem(query, region.bits, region.num_tokens, k, v, valid, d, region.v_dim)


def supports_buffer(query: torch.Tensor, region: PackedLanes, k: torch.Tensor, v: torch.Tensor,
                    valid: torch.Tensor) -> bool:
    """Whether :func:`kivi_lanes_attention_partial` can read this buffer in the same launch (shapes only)."""
    return ck._device_ok(query.device) and buffer_problem(query, region, k, v, valid) is None


def _qdim(d: int) -> int:
    """The buffer key dim a lanes library is built for (the query's head dim where the buffer CTAs take it)."""
    return d if d % 64 == 0 and 64 <= d <= 256 else 0


def balanced_splits(ntiles: int, lanes: list[tuple[int, int]], rows: int, budget: int, most: int,
                    dv: int, v_weight: float = 1.0) -> list[int]:
    """Splits per lane (configuration ``lane_balance``): ``lanes`` lists ``(kept channels, heads)``; ``rows`` the
    CTAs one head's split takes (batch x row blocks); ``budget`` about one wave (:func:`.cuda_kernel.wave_ctas`);
    ``most`` each warp's minimum of tiles (:func:`.cuda_kernel.most_splits`).  A tile of a lane costs ``dk + v_weight
    * dv`` (its key and value channels); :func:`kvcompress.kernels.attention.split_plan.lane_splits` gives the
    costliest lanes more splits.  Where the cap binds before the budget (batch 1) every lane reaches it - the uniform
    plan (session 54, H200: stopping the narrow lanes short there cost Llama B1/32k 27.7 -> 29.5 us)."""
    return split_plan.lane_splits([(dk + v_weight * dv, heads, ntiles) for dk, heads in lanes], rows, budget, most)


def split_plan_of(ntiles: int, lanes: list[tuple[int, int]], rows: int, sms: int, cfg: dict, cta_smem: int,
                  dv: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """``(splits, tiles per split, per-lane (splits, tokens per split))`` of a lanes launch over ``ntiles`` tiles
    (no device: :func:`_plan` with the device's SMs, ``benchmarks/lane_plans.py`` with any): ``lanes`` lists ``(kept
    channels, heads)``, ``rows`` the CTAs of one head's split, ``cfg`` the configuration with the launch's warps and
    stages.  Every lane has the launch's splits where ``lane_balance`` is off, else its own (:func:`balanced_splits`;
    ``lane_v_weight`` weighs a value channel against a key channel); the launch's own entry is then the largest."""
    covered = sum(n for _, n in lanes)
    s, tps = ck.split_runs(ntiles, ck.num_splits(ntiles, max(1, rows * covered), sms, cfg, cta_smem))
    per_lane = ((s, tps * ck.TILE),) * len(lanes)
    if cfg.get("lane_balance") and ntiles > 0:
        counts = balanced_splits(ntiles, lanes, rows, max(1, round(ck.wave_ctas(sms, cfg, cta_smem))),
                                 ck.most_splits(ntiles, rows * covered, sms, cfg), dv,
                                 float(cfg.get("lane_v_weight", 1.0)))
        per_lane = tuple((n, t * ck.TILE) for n, t in (ck.split_runs(ntiles, k) for k in counts))
        s = max(n for n, _ in per_lane)
        tps = max(t for _, t in per_lane) // ck.TILE  # (the region's own entry: unused by the lanes)
    return s, tps, per_lane


def _plan(region: PackedLanes, query: torch.Tensor, index: int, softcap, c: dict) -> tuple:
    """``(library, warps, stages, splits, tiles per split, interleave, PDL, buffer tokens, buffer CTAs, per-lane
    (splits, tokens per split))`` for this region's shapes (the buffer's settings:
    :func:`.cuda_kernel.buffer_launch`; the splits: :func:`split_plan_of`), decided once per shape."""
    dks = tuple(sorted({lane.k_scale.shape[-1] for lane in region.lanes}))
    dv = region.v_dim
    b, h, m, _ = query.shape
    nt = region.num_tokens
    lib = ck.build(region.bits, dks[-1], dv, int(c.get("min_blocks", 1)), softcap=bool(softcap), lane_dks=dks,
                   qdim=_qdim(query.shape[-1]))
    nw, stages, cta_smem, _ = ck.plan_launch(region.bits, dks[-1], dv, int(c["nw"]), int(c["stages"]),
                                             ck._smem_limit(index))
    if cta_smem != lib.kivi_v3_launch_smem(nw, stages):
        raise RuntimeError("KIVI CUDA lanes kernel: the library's shared-memory size disagrees with launch_smem()")
    s, tps, per_lane = split_plan_of(nt // ck.TILE, list(lane_shapes(region)), b * -(-m // 8), ck._sms(index),
                                     dict(c, nw=nw, stages=stages), cta_smem, dv)
    btok, bctas = ck.buffer_launch(b * h * -(-m // 8), nt, int(c.get("buffer_tokens") or ck.BUFFER_TOKENS),
                                   c.get("buffer_ctas", "auto"))
    return lib, nw, stages, s, tps, int(c.get("interleave", 1)), ck.pdl_ok(c, index), btok, bctas, per_lane


def launch_args(q: torch.Tensor, region: PackedLanes, valid8: torch.Tensor, po: int, pl: int, splits: int,
                tiles_per_split: int, length: torch.Tensor | None = None,
                interleave: int = 1, buffer: tuple | None = None,
                buffer_tokens: int = ck.BUFFER_TOKENS,
                buffer_ctas: int = ck.BUFFER_CTAS,
                lane_splits: tuple | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """The launcher's int64 argument array (``kivi_v3_lanes_launch``: the region's ``Params`` - query, valid flags,
    outputs, sizes, the live length (``length``: 0-dim int64 device tensor, or none), the tile-to-warp assignment
    (:data:`.cuda_kernel.DEFAULT_CONFIG`'s ``interleave``), the full-precision buffer (``buffer``: ``(k, v, valid
    uint8, length or None)``, ``buffer_tokens`` slots per buffer CTA, at most ``buffer_ctas`` CTAs; none: no buffer
    CTAs); the payload pointers
    and strides there unused -, the lane count, then :data:`LANE_INTS` per lane, ending in the lane's splits and
    tokens per split: ``lane_splits[i]``, or ``splits`` / ``tiles_per_split`` for every lane) and the tensors it
    points into (aligned copies where needed; keep them alive until the launch is issued)."""
    b, h, m, _ = q.shape
    dv = region.v_dim
    ngv = region.lanes[0].v_scale.shape[-1]
    args = [q.data_ptr(), 0, 0, 0, 0, 0, 0, valid8.data_ptr(), po, pl,
            *q.stride()[:3], *([0] * 16), valid8.stride(0),
            m, h, region.num_tokens, region.group.bit_length() - 1, tiles_per_split * ck.TILE, splits, ngv, dv // ngv,
            b * h, 0 if length is None else length.data_ptr(), int(interleave),
            *ck._buffer_args(buffer, buffer_tokens, buffer_ctas)]
    if len(args) != ck.PARAMS_INTS:
        raise RuntimeError(f"KIVI CUDA lanes kernel: {len(args)} region entries, the launcher reads {ck.PARAMS_INTS}")
    args.append(len(region.lanes))
    keep = [valid8, q] + ([length] if length is not None else []) + [x for x in (buffer or ()) if x is not None]
    if lane_splits is None:
        lane_splits = [(splits, tiles_per_split * ck.TILE)] * len(region.lanes)
    for lane, (lane_n, lane_tps) in zip(region.lanes, lane_splits, strict=True):
        kc, ks, kz, vc, vs, vz, _ = ck._kv_tensors(_lane_packed(region, lane))
        keep += [kc, ks, kz, vc, vs, vz]
        ch = lane.channels
        heads = lane.heads
        entry = [kc.data_ptr(), ks.data_ptr(), kz.data_ptr(), vc.data_ptr(), vs.data_ptr(), vz.data_ptr(),
                 0 if ch is None else ch.data_ptr(), 0 if ch is None else ch.stride(0),
                 0 if heads is None else heads.data_ptr(), region.num_heads if heads is None else heads.numel(),
                 *kc.stride()[:3], *ks.stride()[:3], *kz.stride()[:3], *vc.stride()[:3], *vs.stride()[:2],
                 *vz.stride()[:2], ks.shape[-1], lane_n, lane_tps]
        if len(entry) != LANE_INTS:
            raise RuntimeError(f"KIVI CUDA lanes kernel: {len(entry)} entries per lane, the launcher reads {LANE_INTS}")
        args += entry
    return args, keep


def kivi_lanes_attention_partial(query: torch.Tensor, region: PackedLanes, scale: float, *,
                                 softcap: float | None = None, base: dict | None = None, buffer: tuple | None = None,
                                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention over every lane of ``region``; see :func:`.lanes_reference.kivi_lanes_attention_partial`.
    ``base``: the launch configuration (:func:`.cuda_kernel.config`, resolved once by :mod:`kvcompress.kernels.ops`);
    ``None`` reads it here.  ``buffer``: ``(k, v, valid, length)`` of a full-precision region over every head and
    all query channels (a static layer's sinks + recent window, :func:`buffer_problem`; ``length`` a 0-dim int tensor
    bounding its slots, or ``None``) read by more CTAs of the same launch and merged with the lanes' splits by the
    same combine: one ``(out, lse)`` over both (:func:`.lanes_reference.kivi_lanes_buffer_attention_partial`).
    ``out_dtype``: ``out``'s dtype (``None``: float32), stored by the split combine
    (:func:`.cuda_kernel.combine_into`)."""
    b, h, m, _ = query.shape
    dv = region.v_dim
    dev = query.device
    valid = region.valid
    length = ck.live_length(region.length, dev)  # read by the kernel: slots after it neither read nor attended
    out = torch.empty(b, h, m, dv, device=dev, dtype=out_dtype or torch.float32)
    lse = torch.empty(b, h, m, device=dev, dtype=torch.float32)
    nt = region.num_tokens
    if buffer is not None:  # the buffer's shapes only: the region's own check needs a host read a graph capture forbids
        why = buffer_problem(query, region, *buffer[:3], region_checked=True)
        if why is not None:
            raise ValueError(f"KIVI CUDA lanes kernel: {why}")
    if b * h * m == 0:
        return out, lse
    if nt == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    c = dict(base if base is not None else ck.config(region.bits))
    # the lanes' widths AND head counts: the per-lane plan (lane_balance) differs between layers whose lanes have the
    # same widths but other head counts
    key = (region.bits, region.group, dv, b, h, m, query.shape[-1], nt, lane_shapes(region), index, bool(softcap),
           tuple(sorted(c.items())), query.dtype)
    plan = _PLANS.get(key)
    if plan is None:  # a new shape: checked once (a decode step reads the same shapes in every layer)
        why = problem(query, region)
        if why is not None:
            raise ValueError(f"KIVI CUDA lanes kernel: {why}")
        if len(_PLANS) >= 4096:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(region, query, index, softcap, c)
    lib, nw, stages, s, tps, interleave, pdl, btok, bctas, lane_splits = plan

    valid8 = valid.view(torch.uint8) if valid.dtype == torch.bool else valid.to(torch.uint8)
    valid8 = ck._aligned(valid8, 1, 16)
    q = ck._aligned(query.to(torch.float16), 1, 4)  # the kernel's operands are fp16 (a bf16 model: one cast)
    if buffer is not None:
        bk, bv, bvalid, blen = buffer
        buffer = (bk, bv, bvalid.view(torch.uint8), ck.live_length(blen, dev))
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)

    def launch(po: torch.Tensor, pl: torch.Tensor, buf: tuple | None = None) -> list:
        """The lanes kernel into ``po`` / ``pl`` (with the buffer's CTAs where ``buf``); what it reads."""
        args, keep = launch_args(q, region, valid8, po.data_ptr(), pl.data_ptr(), s, tps, length, interleave, buf,
                                 btok, bctas, lane_splits)
        arr = (ctypes.c_longlong * len(args))(*args)
        with _LOCK:
            rc = lib.kivi_v3_lanes_launch(arr, float(scale) * ck.LOG2E, float(softcap or 0.0) * ck.LOG2E, nw, stages,
                                          -(-m // 8), index, stream)
        if rc:
            raise RuntimeError(f"KIVI CUDA lanes kernel launch failed: {lib.kivi_v3_error_string(rc).decode()}")
        return keep

    if buffer is not None and ck.buffer_read(region.bits, b, h, m, nt, buffer[0].shape[2]) == "lanes":
        # three launches (buffer_lanes): the lanes' split partials, the buffer's after them, one combine
        ck.read_beside(query, buffer, scale, softcap, s, launch, lib, out, lse, index, stream, pdl)
        return out, lse
    total = ck.partial_count(s, buffer, btok, bctas)
    po, pl = ck.partial_buffers(out, lse, total)
    keep = launch(po, pl, buffer)
    ck.combine_into(lib, po, pl, out, lse, total, index, stream, pdl)
    del keep
    return out, lse


def emulate(query: torch.Tensor, region: PackedLanes, scale: float, *, buffer: tuple | None = None,
            buffer_tokens: int = ck.BUFFER_TOKENS, buffer_ctas: int = ck.BUFFER_CTAS,
            lane_splits: tuple[int, ...] | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's dataflow on the CPU: each lane's head rows through :func:`.cuda_kernel.emulate` (the same key
    mapping, quarter words included) on the query gathered to the lane's channels, placed on the lane's heads by the
    lanes' head lists as the kernel looks them up; heads no lane holds get ``-inf`` and zeros.  ``buffer``: ``(k, v,
    valid, length)`` read by the launch's buffer CTAs (the plain kernel's, :func:`.cuda_kernel._emulate_buffer`, on
    the whole query of every head), their partials merged with the lanes' by log-sum-exp as the split combine does.
    ``lane_splits``: each lane's own split count (``LaneParams::nsplit``, :func:`balanced_splits`) in place of
    ``splits``.  Slow; for tests."""
    why = problem(query, region) if buffer is None else buffer_problem(query, region, *buffer[:3])
    if why is not None:
        raise ValueError(why)
    from .lanes_reference import gather_query

    b, h, m, _ = query.shape
    out = torch.zeros(b, h, m, region.v_dim)
    lse = torch.full((b, h, m), float("-inf"))
    for i, lane in enumerate(region.lanes):  # the kernel's lookup: head -> (lane, row among the lane's heads)
        mine = kw if lane_splits is None else dict(kw, splits=lane_splits[i])
        o, l = ck.emulate(gather_query(query, lane.heads, lane.channels).float().half(),
                          PackedKV(region.bits, region.group, lane.k_codes, lane.k_scale, lane.k_zero, lane.v_codes,
                                   lane.v_scale, lane.v_zero, region.valid, length=region.length), scale, **mine)
        heads = range(h) if lane.heads is None else lane.heads.tolist()
        for row, head in enumerate(heads):
            out[:, head], lse[:, head] = o[:, row], l[:, row]
    if buffer is None:
        return out, lse
    nw = int(kw.get("nw", 2))  # (cuda_kernel.emulate's default)
    for bi in range(b):
        for hi in range(h):
            for rb in range(-(-m // 8)):
                rows = min(8, m - rb * 8)
                parts = [(out[bi, hi, rb * 8: rb * 8 + rows], lse[bi, hi, rb * 8: rb * 8 + rows])]
                parts += [(po[:rows], pl[:rows]) for po, pl in
                          ck._emulate_buffer(query, buffer, bi, hi, rb, nw, float(scale) * ck.LOG2E,
                                             float(kw.get("softcap") or 0.0) * ck.LOG2E, buffer_tokens,
                                             buffer_ctas)]
                o, l = merge_with_lse(parts)
                out[bi, hi, rb * 8: rb * 8 + rows], lse[bi, hi, rb * 8: rb * 8 + rows] = o, l
    return out, lse


__all__ = ["MAX_LANES", "balanced_splits", "buffer_problem", "covered_heads", "emulate", "kivi_lanes_attention_partial",
           "lane_shapes", "launch_args", "problem", "split_plan_of", "supports", "supports_buffer"]
