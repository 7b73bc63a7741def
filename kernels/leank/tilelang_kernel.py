"""LeanK grouped decode attention in TileLang (the LeanK authors' approach), GPU only.

Same signature and semantics as :func:`.reference.grouped_partial_attention`.  As in the
authors' deployment (microsoft/MInference, LeanK), every lane (one kept-channel count) gets
its own split-KV flash-decoding kernel over a dense ``[B, h, T, count]`` tile stream, the query
is gathered to the lane's kept channels beforehand (a small PyTorch gather), and the lanes'
partials are merged by log-sum-exp with PyTorch ops.  The Triton kernel (``triton_kernel.py``)
does all lanes in one launch instead.

TileLang 0.1.15 (+ apache-tvm-ffi < 0.1.13, torch-c-dlpack-ext, z3-solver < 4.15.5) is imported
lazily, on the first call; nothing here is compiled at import.  Kernels are built per static
shape ``(B, h, M, T, count, Dv, splits)`` and cached: a decode loop whose lanes grow by one token a
step would rebuild every step (the authors' kernels are likewise specialised per length bucket);
this module is for kernels benchmarks and cross-checks, the read path uses the Triton kernel.

``build(...)`` returns the TileLang prim_func, so ``tests/test_leank_kernel.py`` can lower it for
``sm_90a`` without a GPU (code generation only) where TileLang is installed.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from .reference import Lane, combine_lanes, gather_query, merge_with_lse

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


def build(batch: int, heads: int, rows: int, tokens: int, dk: int, dv: int, splits: int, *, dtype: str = "float16",
          block_n: int = 64, block_m: int = 64, threads: int = 128, num_stages: int = 2):
    """The split-KV decode prim_func of one lane (softmax scale passed at run time, base-2 inside)."""
    import tilelang.language as T

    tps = -(-tokens // splits)  # tokens per split
    n_blocks = -(-tps // block_n)
    acc = "float32"

    @T.prim_func
    def lane_decode(
        Q: T.Tensor((batch, heads, rows, dk), dtype),
        K: T.Tensor((batch, heads, tokens, dk), dtype),
        V: T.Tensor((batch, heads, tokens, dv), dtype),
        Mask: T.Tensor((batch, tokens), "uint8"),
        Scale: T.Tensor((1,), acc),
        O: T.Tensor((splits, batch, heads, rows, dv), acc),
        L: T.Tensor((splits, batch, heads, rows), acc),
    ):
        with T.Kernel(splits, batch * heads, threads=threads) as (bs, bbh):
            q_s = T.alloc_shared((block_m, dk), dtype)
            k_s = T.alloc_shared((block_n, dk), dtype)
            v_s = T.alloc_shared((block_n, dv), dtype)
            m_l = T.alloc_fragment((block_n,), "uint8")
            s_f = T.alloc_fragment((block_m, block_n), acc)
            p_f = T.alloc_fragment((block_m, block_n), dtype)
            o_f = T.alloc_fragment((block_m, dv), acc)
            m_prev = T.alloc_fragment((block_m,), acc)
            m_cur = T.alloc_fragment((block_m,), acc)
            alpha = T.alloc_fragment((block_m,), acc)
            l_blk = T.alloc_fragment((block_m,), acc)
            l_sum = T.alloc_fragment((block_m,), acc)
            b = bbh // heads
            h = bbh % heads
            start = bs * tps
            end = T.min(start + tps, tokens)
            for i, j in T.Parallel(block_m, dk):
                q_s[i, j] = T.if_then_else(i < rows, Q[b, h, T.min(i, rows - 1), j], T.cast(0, dtype))
            T.fill(o_f, 0)
            T.fill(l_sum, 0)
            T.fill(m_cur, -T.infinity(acc))
            for kb in T.Pipelined(n_blocks, num_stages=num_stages):
                t0 = start + kb * block_n
                T.copy(K[b, h, t0:t0 + block_n, :], k_s)
                for i in T.Parallel(block_n):
                    m_l[i] = Mask[b, T.min(t0 + i, tokens - 1)]
                T.clear(s_f)
                T.gemm(q_s, k_s, s_f, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block_m, block_n):
                    s_f[i, j] = T.if_then_else((t0 + j < end) & (m_l[j] != 0), s_f[i, j] * Scale[0],
                                               -T.infinity(acc))
                T.copy(m_cur, m_prev)
                T.reduce_max(s_f, m_cur, dim=1, clear=False)
                for i in T.Parallel(block_m):
                    alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(acc), 1.0, T.exp2(m_prev[i] - m_cur[i]))
                for i, j in T.Parallel(block_m, block_n):
                    s_f[i, j] = T.if_then_else(m_cur[i] == -T.infinity(acc), 0.0, T.exp2(s_f[i, j] - m_cur[i]))
                T.reduce_sum(s_f, l_blk, dim=1)
                for i in T.Parallel(block_m):
                    l_sum[i] = l_sum[i] * alpha[i] + l_blk[i]
                T.copy(s_f, p_f)
                for i, j in T.Parallel(block_m, dv):
                    o_f[i, j] = o_f[i, j] * alpha[i]
                T.copy(V[b, h, t0:t0 + block_n, :], v_s)
                T.gemm(p_f, v_s, o_f, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_m, dv):
                if i < rows:
                    O[bs, b, h, i, j] = T.if_then_else(l_sum[i] > 0, o_f[i, j] / l_sum[i], 0.0)
            for i in T.Parallel(block_m):
                if i < rows:
                    L[bs, b, h, i] = T.if_then_else(l_sum[i] > 0, (T.log2(l_sum[i]) + m_cur[i]) * LN2,
                                                    -T.infinity(acc))

    return lane_decode


@functools.lru_cache(maxsize=64)
def _kernel(batch, heads, rows, tokens, dk, dv, splits, dtype, block_n, block_m, threads, num_stages):
    import tilelang

    func = build(batch, heads, rows, tokens, dk, dv, splits, dtype=dtype, block_n=block_n, block_m=block_m,
                 threads=threads, num_stages=num_stages)
    return tilelang.compile(func, out_idx=[-2, -1], target="cuda")


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def lane_partial(query: torch.Tensor, lane: Lane, scale: float, *, splits: int | None = None, block_n: int = 64,
                 threads: int = 128, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, h, M, Dv], lse [B, h, M])`` of one lane (float32), split-KV in TileLang, splits merged here."""
    heads, channels, k, v, valid, basis = Lane(*lane)
    if k.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("the TileLang kernel takes fp16 / bf16 K and V")
    if valid is not None and valid.dim() == 3:
        raise ValueError("the TileLang kernel takes a row-level valid [B, T]; a per-head validity [B, h, T] "
                         "(adaptive per-head budgets) is read by the Triton kernel or the reference")
    q = gather_query(query, heads, channels, basis).to(k.dtype).contiguous()
    k, v = k.contiguous(), v.contiguous()
    b, h, t, c = k.shape
    m, dv = q.shape[2], v.shape[-1]
    mask = (torch.ones(b, t, device=k.device, dtype=torch.uint8) if valid is None
            else valid.to(torch.uint8).contiguous())
    if splits is None:
        splits = max(1, min(-(-t // 256), -(-2 * _num_sms(k.device) // (b * h))))
    block_m = max(64, 1 << (m - 1).bit_length())  # rows padded to 64, as in TileLang's GQA decode example
    dtype = "float16" if k.dtype == torch.float16 else "bfloat16"
    kern = _kernel(b, h, m, t, c, dv, splits, dtype, block_n, block_m, threads, num_stages)
    sc = torch.full((1,), scale * LOG2E, device=k.device, dtype=torch.float32)
    o, lse = kern(q, k, v, mask, sc)  # [S, B, h, M, Dv], [S, B, h, M]
    if splits == 1:
        return o[0], lse[0]
    return merge_with_lse([(o[s], lse[s]) for s in range(splits)])


def grouped_partial_attention(query: torch.Tensor, lanes: Sequence[Lane | tuple], scale: float, **kw
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """TileLang grouped partial attention; see :func:`.reference.grouped_partial_attention`."""
    return combine_lanes(query, lanes, lambda lane: lane_partial(query, lane, scale, **kw))


__all__ = ["build", "grouped_partial_attention", "lane_partial"]
del math
