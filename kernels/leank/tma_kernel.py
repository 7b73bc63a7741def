"""The full-width lanes read with its K / V tiles copied by the tensor memory accelerator (TMA, sm_90+).

The empty stack's read (and any read of one lane holding every channel of every kv head in order: the static buffer
of a stack without middle stores) is :func:`.triton_kernel.grouped_partial_attention`'s one-lane, full-width case.
It reads exactly SDPA's bytes, so only the memory pipeline can make it faster; on H100s it ran at 0.95-1.00x of
cuDNN's SDPA at Llama B4-B64 / 32k-128k (docs/results.md, issue 19), at 90-91 % DRAM throughput against cuDNN's
(TMA) copies.  Here each block of ``BN`` tokens is one TMA copy per tensor (a host-built descriptor over the
``[B * H * T, D]`` rows of K and of V) instead of ``BN x D / 8`` per-thread 16-byte asynchronous copies with their
address arithmetic.

Opt-in while it is timed: ``KVCOMPRESS_LEANK_CONFIG='{"tma": true}'`` (read once, like every launch setting).
Same arguments, split count, partial layout and merge as the lanes kernel (:func:`.triton_kernel.grouped_partial_attention`
takes this launch instead of ``_lanes_kernel`` where :func:`supports` says so), so its reference is the same
:func:`.reference.grouped_partial_attention`; tests run it through the Triton interpreter on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.attention.triton_shared import pdl_trigger, soft_cap


@triton.jit(do_not_specialize=["M", "H", "T", "NBATCH"])
def _dense_tma_kernel(Q, sq_b, sq_h, sq_m, KD, VD, VA, sva_b, sva_h, PO, PL, LENGTH, qk_scale, M, H, T, NBATCH, cap,
                      HAS_VALID: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                      BN: tl.constexpr, IEEE: tl.constexpr, HAS_LENGTH: tl.constexpr, SOFTCAP: tl.constexpr,
                      PDL: tl.constexpr = False, VA_AHEAD: tl.constexpr = False):
    """One (split, batch * kv head, row block): the partial of the head's ``M`` query rows over one token range of its
    ``T`` slots, as ``_lanes_kernel`` writes it (``PO [splits, B, H, M, DV]``, ``PL [splits, B, H, M]``).  ``KD`` /
    ``VD``: descriptors over the ``[B * H * T, D]`` / ``[B * H * T, DV]`` rows, blocks ``[BN, D]`` / ``[BN, DV]``;
    a block past the head's last slot reads the next head's first rows (or zeros past the tensor), never used: every
    score at or after ``end`` is masked."""
    pdl_trigger(PDL)
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    n_split = tl.num_programs(0)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, DV)
    q = tl.load(Q + b64 * sq_b + h64 * sq_h + offs_m[:, None] * sq_m + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(KD.dtype)
    tps = tl.cdiv(tl.cdiv(T, n_split), BN) * BN
    start = pid_s * tps
    end = tl.minimum(start + tps, T)
    if HAS_LENGTH:
        end = tl.minimum(end, tl.load(LENGTH).to(tl.int32))
    row0 = pid_bh * T  # int32: the host checks B * H * T + BN < 2 ** 31 (TMA coordinates are 32-bit)
    va_off = b64 * sva_b + h64 * sva_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    if HAS_VALID and VA_AHEAD:
        t_first = start + tl.arange(0, BN)
        va_next = tl.load(VA + va_off + t_first, mask=t_first < end, other=0)
    for t0 in range(start, end, BN):
        t = t0 + tl.arange(0, BN)
        t_ok = t < end
        k = KD.load([row0 + t0, 0])
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = soft_cap(s, cap)
        ok = t_ok
        if HAS_VALID:
            if VA_AHEAD:
                ok = ok & (va_next != 0)
                va_next = tl.load(VA + va_off + t + BN, mask=t + BN < end, other=0)
            else:
                ok = ok & (tl.load(VA + va_off + t, mask=t_ok, other=0) != 0)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = VD.load([row0 + t0, 0])
        if IEEE:
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    l_ok = l_i > 0.0
    out = acc / tl.where(l_ok, l_i, 1.0)[:, None]
    lse = tl.where(l_ok, (m_i + tl.log2(tl.where(l_ok, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    row = (pid_s.to(tl.int64) * NBATCH + b64) * H + h64
    tl.store(PO + (row * M + offs_m[:, None]) * DV + offs_v[None, :], out.to(PO.dtype.element_ty), mask=m_ok[:, None])
    tl.store(PL + row * M + offs_m, lse, mask=m_ok)


def _pow2_dim(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0


def _rows_view(x: torch.Tensor) -> tuple[int, int] | None:
    """``(rows, row stride)`` of ``x [B, H, T, C]`` read as ``[B * H * T, C]`` rows (each head's slots follow the
    previous head's, the last dim contiguous), or None where the strides do not allow it."""
    b, h, t, c = x.shape
    st = x.stride(2)
    if x.stride(3) != 1 or (h > 1 and x.stride(1) != t * st) or (b > 1 and x.stride(0) != h * t * st):
        return None
    return b * h * t, st


def supports(rows: list[dict], d: int, dv: int, bn: int, block_m: int, wg: int, logits, device: torch.device) -> bool:
    """Whether :func:`.triton_kernel.grouped_partial_attention`'s launch over ``rows`` (its per-lane dicts) can take
    this kernel: one lane of every kv head in order (no head or channel list, no basis), full width, head dims that
    are powers of two from 16 to 256, K / V rows of 16-byte aligned strides and bases that read as ``[B * H * T, C]``
    within 32-bit coordinates, no stored scores and one warp group; on CUDA an sm_90+ device (TMA)."""
    if len(rows) != 1 or logits is not None or wg != 1:
        return False
    r = rows[0]
    if r["has_heads"] or r["has_chan"] or r["proj"] or r["c"] != d or not _pow2_dim(d) or not _pow2_dim(dv):
        return False
    if block_m > 64 or bn > 256:
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    for x in (r["k"], r["v"]):
        view = _rows_view(x)
        if view is None or x.data_ptr() % 16 or (view[1] * x.element_size()) % 16 or view[0] + bn >= 2 ** 31:
            return False
    return True


def launch(q: torch.Tensor, r: dict, po: torch.Tensor, pl: torch.Tensor, length: torch.Tensor | None, qk_scale: float,
           cap: float, *, splits: int, block_m: int, m_blocks: int, bn: int, softcap: bool, pdl: bool,
           valid_ahead: bool, num_warps: int, num_stages: int) -> None:
    """One launch over the lane ``r`` (:func:`supports` said yes) into the partials ``po`` / ``pl``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k, v = r["k"], r["v"]
    b, h, t, d = k.shape
    dv = v.shape[-1]
    n, sk = _rows_view(k)
    _, sv = _rows_view(v)
    kd = TensorDescriptor(k, [n, d], [sk, 1], [bn, d])
    vd = TensorDescriptor(v, [n, dv], [sv, 1], [bn, dv])
    va = r["va"]
    has_valid = r["has_valid"]
    _dense_tma_kernel[(splits, b * h, m_blocks)](
        q, q.stride(0), q.stride(1), q.stride(2), kd, vd, va, va.stride(0) if has_valid else 0,
        va.stride(1) if has_valid and va.dim() == 3 else 0, po, pl, length if length is not None else pl, qk_scale,
        q.shape[2], h, t, b, cap, HAS_VALID=has_valid, D=d, DV=dv, BLOCK_M=block_m, BN=bn,
        IEEE=k.dtype == torch.float32, HAS_LENGTH=length is not None, SOFTCAP=softcap, PDL=pdl,
        VA_AHEAD=valid_ahead, num_warps=num_warps, num_stages=num_stages)
