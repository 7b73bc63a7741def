"""The log-sum-exp merge of a read's region partials in one Triton launch.

Same semantics as :func:`.reference.merge_partials` (without learned sinks) followed by the cast to the query's dtype:
``parts`` = ``(out [..., Dv] float32, lse [...] float32)`` of disjoint key regions (a static layer's sinks + recent
buffer and its middle store's segments), the joint softmax output ``sum_i exp(lse_i - top) out_i / max(1, sum_i
exp(lse_i - top))`` with ``top`` the rows' largest finite LSE (rows no region sees: zeros).  The PyTorch version
dispatches about ten small kernels per read (two stacks, a max, ``nan_to_num``, ``exp``, a product, two sums, a
clamp, a division, the cast) - at batch 1 they cost more than the attention kernels they merge.  Nothing is compiled
at import.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .partials import MERGE_MAX_PARTS as MAX_PARTS  # a static read: the buffer plus a few middle segments


@triton.jit
def _merge_kernel(O0, O1, O2, O3, L0, L1, L2, L3, OUT, ROWS,
                  DV: tl.constexpr, DV_PAD: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_ok = rows < ROWS
    d = tl.arange(0, DV_PAD)
    ok = r_ok[:, None] & (d < DV)[None, :]
    at = rows[:, None] * DV + d[None, :]
    l0 = tl.load(L0 + rows, mask=r_ok, other=float("-inf"))
    top = l0
    if R > 1:
        l1 = tl.load(L1 + rows, mask=r_ok, other=float("-inf"))
        top = tl.maximum(top, l1)
    if R > 2:
        l2 = tl.load(L2 + rows, mask=r_ok, other=float("-inf"))
        top = tl.maximum(top, l2)
    if R > 3:
        l3 = tl.load(L3 + rows, mask=r_ok, other=float("-inf"))
        top = tl.maximum(top, l3)
    top = tl.where(top == float("-inf"), 0.0, top)  # rows no region sees: any finite shift (every weight is 0)
    w = tl.exp(l0 - top)
    total = w
    acc = w[:, None] * tl.load(O0 + at, mask=ok, other=0.0)
    if R > 1:
        w = tl.exp(l1 - top)
        total += w
        acc += w[:, None] * tl.load(O1 + at, mask=ok, other=0.0)
    if R > 2:
        w = tl.exp(l2 - top)
        total += w
        acc += w[:, None] * tl.load(O2 + at, mask=ok, other=0.0)
    if R > 3:
        w = tl.exp(l3 - top)
        total += w
        acc += w[:, None] * tl.load(O3 + at, mask=ok, other=0.0)
    # the largest weight of a row with a visible key is exp(0) = 1, so total >= 1 there; rows with none: 0 / 1 = 0
    out = acc / tl.maximum(total, 1.0)[:, None]
    tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=ok)


def supports(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether one launch merges ``parts``: 1 to :data:`MAX_PARTS` float32 partials of one shape on one device."""
    if not 1 <= len(parts) <= MAX_PARTS:
        return False
    o0, l0 = parts[0]
    return all(o.shape == o0.shape and l.shape == l0.shape and o.dtype == l.dtype == torch.float32
               and o.device == l.device == o0.device for o, l in parts) and tuple(o0.shape[:-1]) == tuple(l0.shape)


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The joint output of ``parts`` (see the module docstring) as ``dtype``, shaped like the partials' outputs."""
    if not supports(parts):
        raise ValueError(f"merge_partials: 1..{MAX_PARTS} float32 partials of one shape, got "
                         f"{[(tuple(o.shape), o.dtype, tuple(l.shape)) for o, l in parts]}")
    outs = [o.contiguous() for o, _ in parts]
    lses = [l.contiguous() for _, l in parts]
    dv = outs[0].shape[-1]
    out = torch.empty(outs[0].shape, device=outs[0].device, dtype=dtype)
    rows = lses[0].numel()
    if rows == 0 or dv == 0:
        return out.zero_()
    r = len(parts)
    outs += [outs[0]] * (MAX_PARTS - r)  # unused pointer slots (R is a compile-time constant)
    lses += [lses[0]] * (MAX_PARTS - r)
    dv_pad = max(16, triton.next_power_of_2(dv))
    block = max(1, min(64, 4096 // dv_pad))
    _merge_kernel[(triton.cdiv(rows, block),)](*outs, *lses, out, rows, DV=dv, DV_PAD=dv_pad, R=r, BLOCK_R=block,
                                               num_warps=4)
    return out


__all__ = ["MAX_PARTS", "merge_partials", "supports"]
