"""Triton pieces shared by the split-KV decode kernels (KIVI, paged, LeanK).

``combine_splits`` merges ``S`` split partials ``(out, lse)`` by log-sum-exp; ``soft_cap`` applies a logit
soft-cap (Gemma 2) to scores in the kernels' base-2 units; ``pow2`` and ``num_sms`` size launches.  Imported only by the kernels' ``triton_kernel`` modules, never at
package import.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` elementwise (``s`` fp32 scores, ``cap`` > 0 in the same units: a kernel whose scores
    are in base 2 passes ``softcap * log2(e)``).  ``tanh`` from one ``exp2`` of ``-2|x|`` (no overflow, exact
    sign; no libdevice call, so the Triton interpreter runs it too)."""
    x = s / cap
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


def cap_base2(softcap: float | None) -> float:
    """The ``cap`` argument of :func:`soft_cap` for scores in base 2 (``0.0``: no soft-cap)."""
    return float(softcap) * LOG2E if softcap else 0.0


LOG2E = 1.4426950408889634


@triton.jit
def _combine_kernel(PO, PL, OUT, LSE, S, M,
                    spo_s, spl_s,
                    DV: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge ``S`` split partials (contiguous ``[S, B*H, M, Dv]`` / ``[S, B*H, M]``) by log-sum-exp."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, DV_PAD)
    m_ok = offs_m < M
    lse = tl.load(PL + offs_s[:, None] * spl_s + pid_bh * M + offs_m[None, :],
                  mask=(offs_s < S)[:, None] & m_ok[None, :], other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - top[None, :]), axis=0)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    row = pid_bh * M * DV + offs_m[:, None] * DV + offs_d[None, :]
    ok = m_ok[:, None] & (offs_d < DV)[None, :]
    for s in range(S):
        w = tl.exp(tl.load(PL + s * spl_s + pid_bh * M + offs_m, mask=m_ok, other=float("-inf")) - top)
        acc += w[:, None] * tl.load(PO + s * spo_s + row, mask=ok, other=0.0)
    t_ok = total > 0.0
    tl.store(OUT + row, acc / tl.where(t_ok, total, 1.0)[:, None], mask=ok)
    tl.store(LSE + pid_bh * M + offs_m, tl.where(t_ok, top + tl.log(tl.where(t_ok, total, 1.0)), float("-inf")),
             mask=m_ok)


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count




def combine_splits(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, splits: int, m: int,
                   rows: int, dv: int, block_m: int) -> None:
    """Merge contiguous partials ``po [S, rows*M, Dv]`` / ``pl [S, rows*M]`` into ``out`` / ``lse``."""
    _combine_kernel[(rows, triton.cdiv(m, block_m))](
        po, pl, out, lse, splits, m, po.stride(0), pl.stride(0),
        DV=dv, DV_PAD=max(16, pow2(dv)), S_PAD=max(2, pow2(splits)), BLOCK_M=block_m, num_warps=4)
