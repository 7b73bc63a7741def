"""Example inputs for every registered op of :mod:`kvcompress.kernels.ops`, and how to check a result.

Shared by ``tests/test_kernel_ops.py`` (small odd shapes on the CPU; the ``gpu`` tests) and
``benchmarks/gpu_ops_check.py`` (small and Llama-like shapes on a GPU).  Every case is a static-cache-like read:
buffers sized for a capacity, a random ``valid`` mask (padding, evicted slots), a dead batch row where the batch
allows it, and a live ``length`` (0-dim device tensor) below the capacity where the op takes one.

A case's :meth:`OpCase.fn` returns ``f(*case.args)`` that calls the op the way the core does - through the
subpackage dispatchers with ``impl=`` (``PackedKV(..., impl=, length=).attention_partial``,
``paged_attention_partial(..., impl=, length=)``, ...) - so compiling ``f`` checks the whole call path, not just the
op.  Nothing here runs at import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

ATOL, RTOL, LSE_ATOL = 3e-3, 1e-2, 2e-3  # as the kernels' own tests (fp16 operands, fp32 accumulation)
BUILD_ELEMENTS = 1 << 30  # fp32 elements of keys (or values) a case builder quantizes at a time (4 GB)
OUTPUT_OPS = ("kivi_partial", "kivi_buffer_partial", "paged_partial", "lanes_partial", "gather_partial",
              "kivi_lanes_partial", "select_gather")


@dataclasses.dataclass
class OpCase:
    """One op call: ``fn(impl)(*args)`` returns the op's outputs."""

    name: str
    op: str  # a key of kvcompress.kernels.ops.OPS
    args: tuple
    fn: Callable[[str], Callable[..., Any]]
    facts: dict  # static facts for ops.choose
    static: tuple[int, ...] = ()  # indices of args that are cache buffers (static addresses under CUDA graphs)
    extra: dict = dataclasses.field(default_factory=dict)  # what check() needs (select_topk: k, scores)
    batch_args: tuple[int, ...] = ()  # indices of args whose first dim is the batch (rows are read independently)

    def reference(self, batch_chunk: int | None = None):
        """The reference outputs (eager).  ``batch_chunk``: computed ``batch_chunk`` batch rows at a time (cases with
        ``batch_args`` only) and concatenated - the reference's fp32 copies of a whole B64 / 128k cache would not fit
        beside it (34 GB each at Llama heads)."""
        f = self.fn("reference")
        batch = self.args[0].shape[0]
        if not batch_chunk or not self.batch_args or batch <= batch_chunk:
            return f(*self.args)
        parts = []
        for lo in range(0, batch, batch_chunk):
            args = tuple(a[lo: lo + batch_chunk] if i in self.batch_args and a is not None else a
                         for i, a in enumerate(self.args))
            parts.append(f(*args))
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        return tuple(torch.cat([p[j] for p in parts]) for j in range(len(parts[0])))

    def check(self, got, ref=None) -> tuple[bool, float, str]:
        """``(ok, max abs error, message)`` of ``got`` against the reference outputs ``ref``."""
        if ref is None:
            ref = self.reference()
        if self.op == "select_topk":
            from .doublesparse.reference import is_topk

            ok = is_topk(got, self.extra["scores"], self.extra["k"], self.extra["tol"])
            return ok, 0.0 if ok else float("inf"), "" if ok else "not a top-k of the reference label scores"
        if self.op == "select_gather":  # a top-k of the scores, and the attention over exactly what it chose
            from .doublesparse.reference import is_topk

            out, lse, index = got
            if index.dtype != torch.int32 or not is_topk(index.long(), self.extra["scores"], self.extra["k"],
                                                         self.extra["tol"]):
                return False, float("inf"), "not a top-k of the reference label scores (int32)"
            return check_partial((out, lse), self.extra["gather"](index))
        if self.op == "merge_partials":
            return check_merged(got, ref)
        return check_partial(got, ref)


def check_partial(got, ref, atol: float = ATOL, rtol: float = RTOL, lse_atol: float = LSE_ATOL
                  ) -> tuple[bool, float, str]:
    """``(ok, max abs error over out and lse, message)`` of a partial ``(out, lse)`` against the reference: the same
    shapes and dtypes (``out`` float32 unless the case asks for another dtype, ``lse`` float32), no NaN, ``-inf`` LSE (and a zero output) exactly where the reference has one, ``out`` within
    ``atol + rtol * |ref|``, finite LSE within ``lse_atol``."""
    out, lse = got
    ref_out, ref_lse = ref
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape or out.dtype != ref_out.dtype \
            or lse.dtype != torch.float32:
        return False, float("inf"), f"shapes {tuple(out.shape)} / {tuple(lse.shape)} {out.dtype}"
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return False, float("nan"), "NaN"
    finite = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), finite):
        return False, float("inf"), "-inf LSE where the reference has a finite one, or the other way round"
    if (out[~finite] != 0).any():
        return False, float("inf"), "rows without a valid key must be zero"
    err = (out.float() - ref_out.float()).abs()
    lerr = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    worst = max(err.max().item() if err.numel() else 0.0, lerr)
    ok = bool((err <= atol + rtol * ref_out.float().abs()).all()) and lerr <= lse_atol
    return ok, worst, "" if ok else f"max |out - ref| {err.max().item():.2e}, max |lse - ref| {lerr:.2e}"


def check_merged(got: torch.Tensor, ref: torch.Tensor, atol: float = 1e-3, rtol: float = 1e-2
                 ) -> tuple[bool, float, str]:
    """``(ok, max abs error, message)`` of a merged output against the reference merge: same shape and dtype, no NaN,
    zeros exactly where the reference's rows are zero (no region saw them), within ``atol + rtol * |ref|`` (the
    outputs are rounded to the query's dtype once, by both)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf"), f"shape / dtype {tuple(got.shape)} {got.dtype} against {tuple(ref.shape)} {ref.dtype}"
    if torch.isnan(got).any():
        return False, float("nan"), "NaN"
    dead = (ref == 0).all(-1)
    if (got[dead] != 0).any():
        return False, float("inf"), "rows no region sees must be zero"
    err = (got.float() - ref.float()).abs()
    worst = err.max().item() if err.numel() else 0.0
    ok = bool((err <= atol + rtol * ref.float().abs()).all())
    return ok, worst, "" if ok else f"max |out - ref| {worst:.2e}"


def _gen(seed: int, device) -> torch.Generator:
    """A seeded generator on ``device`` (inputs are made where they are used: no host copies of large caches)."""
    return torch.Generator(device=device).manual_seed(seed)


def _valid(batch: int, tokens: int, gen, dead_row: bool, keep: float = 0.85) -> torch.Tensor:
    valid = torch.rand(batch, tokens, generator=gen, device=gen.device) < keep
    valid[0, : min(7, tokens)] = False  # left padding of row 0
    if dead_row and batch > 1:
        valid[batch - 1] = False  # a row with no valid slot: -inf LSE, zero output
    return valid


def _length(live: int | None, device) -> torch.Tensor | None:
    return None if live is None else torch.tensor(live, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- KIVI


def kivi_case(batch: int = 2, kv_heads: int = 1, rows: int = 3, head_dim: int = 64, capacity: int = 96,
              live: int | None = 71, bits: int = 2, group: int = 32, v_group: int = 32, v_dim: int | None = None,
              query_dtype=torch.float16, dead_row: bool = True, device="cpu", seed: int = 0,
              softcap: float | None = None) -> OpCase:
    """A packed KIVI region of ``capacity`` slots (a multiple of ``group``), quantized from random K/V."""
    from .kivi.reference import PackedKV, quantize_keys, quantize_values

    gen = _gen(seed, device)
    dv = v_dim or head_dim
    t = -(-capacity // group) * group
    # a few batch rows at a time where the fp32 keys / values would be large (B64 / 128k at Llama heads: 34 GB each)
    step = max(1, min(batch, BUILD_ELEMENTS // max(1, kv_heads * t * max(head_dim, dv))))
    quantized = []
    for lo in range(0, batch, step):
        n = min(step, batch - lo)
        k = torch.randn(n, kv_heads, t, head_dim, generator=gen, device=gen.device) * 1.5 + 0.3
        v = torch.randn(n, kv_heads, t, dv, generator=gen, device=gen.device)
        if step == batch:  # a whole-batch build draws q after k and v, as before: its inputs are unchanged
            q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(query_dtype)
        quantized.append((*quantize_keys(k, bits, group), *quantize_values(v, bits, v_group)))
        del k, v
    if step < batch:
        q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(query_dtype)
    kc, ks, kz, vc, vs, vz = (torch.cat([part[j] for part in quantized]) for j in range(6))
    del quantized
    valid = _valid(batch, t, gen, dead_row)
    args = tuple(x.to(device) for x in (q, kc, ks, kz, vc, vs, vz, valid)) + (_length(live, device),)
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, kc, ks, kz, vc, vs, vz, valid, length):
            packed = PackedKV(bits, group, kc, ks, kz, vc, vs, vz, valid, impl=impl, length=length)
            return packed.attention_partial(q, scale, softcap=softcap)
        return f

    facts = dict(bits=bits, group=group, head_dim=head_dim, v_dim=dv, v_group=v_group, tokens=t)
    return OpCase(f"kivi{bits}-b{batch}-h{kv_heads}-m{rows}-d{head_dim}-t{t}-live{live}{_cap(softcap)}", "kivi_partial",
                  args, fn,
                  facts, static=tuple(range(1, 8)), batch_args=tuple(range(8)))


def kivi_buffer_case(batch: int = 2, kv_heads: int = 1, rows: int = 3, head_dim: int = 64, capacity: int = 96,
                     live: int | None = 71, slots: int = 45, buffer_live: int | None = 41, bits: int = 2,
                     group: int = 32, v_group: int = 32, dtype=torch.float16, query_dtype=torch.float16,
                     dead_row: bool = True, device="cpu", seed: int = 0, softcap: float | None = None) -> OpCase:
    """The packed KIVI region of :func:`kivi_case` read together with a full-precision buffer of ``slots`` slots in
    ``dtype`` (a static layer's sinks + recent window), ``buffer_live`` of them live."""
    from . import ops
    from .kivi.reference import PackedKV

    region = kivi_case(batch=batch, kv_heads=kv_heads, rows=rows, head_dim=head_dim, capacity=capacity, live=live,
                       bits=bits, group=group, v_group=v_group, query_dtype=query_dtype, dead_row=dead_row,
                       device=device, seed=seed)
    gen = _gen(seed + 1000, device)
    bk = (torch.randn(batch, kv_heads, slots, head_dim, generator=gen, device=gen.device) * 1.5).to(dtype)
    bv = torch.randn(batch, kv_heads, slots, head_dim, generator=gen, device=gen.device).to(dtype)
    bvalid = _valid(batch, slots, gen, dead_row)
    args = region.args + tuple(x.to(device) for x in (bk, bv, bvalid)) + (_length(buffer_live, device),)
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, kc, ks, kz, vc, vs, vz, valid, length, bk, bv, bvalid, blen):
            packed = PackedKV(bits, group, kc, ks, kz, vc, vs, vz, valid, impl=impl, length=length)
            return ops.kivi_buffer_attention(q, packed, scale, bk, bv, bvalid, blen, impl=impl, softcap=softcap)
        return f

    name = (f"{region.name.replace(f'kivi{bits}-', f'kivi{bits}-buffer-', 1)}-s{slots}-blive{buffer_live}"
            f"-{str(dtype).removeprefix('torch.')}{_cap(softcap)}")
    return OpCase(name, "kivi_buffer_partial", args, fn, region.facts, static=region.static + (9, 10, 11),
                  batch_args=region.batch_args + (9, 10, 11))


# ----------------------------------------------------------------------------- paged


def paged_case(batch: int = 2, kv_heads: int = 2, rows: int = 3, head_dim: int = 48, capacity: int = 150,
               live: int | None = 101, page: int = 16, v_dim: int | None = None, dtype=torch.float16,
               dead_row: bool = True, device="cpu", seed: int = 1, softcap: float | None = None) -> OpCase:
    """A page pool with ``ceil(capacity / page)`` table entries per row (pages shuffled, one missing entry)."""
    from .paged import paged_attention_partial

    gen = _gen(seed, device)
    dv = v_dim or head_dim
    w = -(-capacity // page)
    n = batch * w + 3  # a few spare pages
    k = torch.randn(n, kv_heads, page, head_dim, generator=gen, device=gen.device).to(dtype)
    v = torch.randn(n, kv_heads, page, dv, generator=gen, device=gen.device).to(dtype)
    page_valid = torch.rand(n, page, generator=gen, device=gen.device) < 0.85
    table = torch.randperm(n, generator=gen, device=gen.device)[: batch * w].view(batch, w).to(torch.int32)
    if w > 1:
        table[0, w // 2] = -1  # a row without a page at one table position
    if dead_row and batch > 1:
        page_valid[table[batch - 1].long()] = False
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(dtype)
    args = tuple(x.to(device) for x in (q, k, v, page_valid, table)) + (_length(live, device),)
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, k, v, page_valid, table, length):
            return paged_attention_partial(q, k, v, page_valid, table, scale, impl=impl, length=length,
                                           softcap=softcap)
        return f

    facts = dict(page_size=page, head_dim=head_dim, v_dim=dv, dtype=dtype)
    return OpCase(f"paged-b{batch}-h{kv_heads}-m{rows}-d{head_dim}-p{page}-w{w}-live{live}{_cap(softcap)}",
                  "paged_partial", args,
                  fn, facts, static=(1, 2, 3, 4), batch_args=(0, 4))


# ----------------------------------------------------------------------------- LeanK lanes


def lanes_case(batch: int = 2, kv_heads: int = 4, rows: int = 3, head_dim: int = 64, capacity: int = 77,
               live: int | None = 52, counts: tuple[int, ...] | None = None, dense_tokens: int = 23,
               dtype=torch.float16, dead_row: bool = True, device="cpu", seed: int = 2,
               softcap: float | None = None, rank: int | None = None, out_dtype=None) -> OpCase:
    """One lane per kept count (``counts`` per kv head; 0 = the head keeps nothing) over ``capacity`` slots, plus
    a dense all-channel lane of ``dense_tokens`` slots (the sinks + window; no ``valid`` mask when ``dead_row`` is
    false).  ``rank``: also a low-rank lane over the last and the first kv head (keys as coordinates in a random
    orthonormal ``[head_dim, rank]`` basis per head, which the lane carries).  ``length`` bounds every lane's slots.
    ``out_dtype``: the output in that dtype (a read whose only part the launch is).  Arguments: the query, then per
    lane field (heads, channels, k, v, valid, basis) one entry per lane, the length."""
    from .leank import grouped_partial_attention

    gen = _gen(seed, device)
    if counts is None:
        mix = (0, 16, 32, 48)
        counts = tuple(mix[i % len(mix)] * head_dim // 64 for i in range(kv_heads))
    heads, channels, ks, vs, valids, bases = [], [], [], [], [], []
    for c in sorted(set(counts) - {0}, reverse=True):
        hs = [h for h, n in enumerate(counts) if n == c]
        heads.append(torch.tensor(hs, device=gen.device))
        channels.append(torch.stack([torch.randperm(head_dim, generator=gen, device=gen.device)[:c].sort().values
                                     for _ in hs]))
        ks.append((torch.randn(batch, len(hs), capacity, c, generator=gen, device=gen.device) * 1.3).to(dtype))
        vs.append(torch.randn(batch, len(hs), capacity, head_dim, generator=gen, device=gen.device).to(dtype))
        valids.append(_valid(batch, capacity, gen, dead_row))
        bases.append(None)
    if rank:
        hs = sorted({kv_heads - 1, 0}, reverse=True)
        heads.append(torch.tensor(hs, device=gen.device))
        channels.append(None)
        gauss = torch.randn(len(hs), head_dim, head_dim, generator=gen, device=gen.device)
        bases.append(torch.linalg.qr(gauss.cpu())[0][..., :rank].contiguous().to(gauss.device).to(dtype))
        ks.append((torch.randn(batch, len(hs), capacity, rank, generator=gen, device=gen.device) * 1.3).to(dtype))
        vs.append(torch.randn(batch, len(hs), capacity, head_dim, generator=gen, device=gen.device).to(dtype))
        valids.append(_valid(batch, capacity, gen, dead_row))
    if dense_tokens:
        heads.append(None)
        channels.append(None)
        ks.append(torch.randn(batch, kv_heads, dense_tokens, head_dim, generator=gen, device=gen.device).to(dtype))
        vs.append(torch.randn(batch, kv_heads, dense_tokens, head_dim, generator=gen, device=gen.device).to(dtype))
        valids.append(_valid(batch, dense_tokens, gen, dead_row) if dead_row else None)
        bases.append(None)
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(dtype)
    mv = (lambda x: None if x is None else x.to(device))
    n = len(ks)
    flat = [mv(x) for x in (*heads, *channels, *ks, *vs, *valids, *bases)]
    args = (q.to(device), *flat, _length(live, device))
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, *rest):
            return grouped_partial_attention(q, lanes_of(rest[:-1]), scale, impl=impl, length=rest[-1],
                                             softcap=softcap, out_dtype=out_dtype)
        return f

    kept = tuple(sorted(set(counts) - {0}))
    facts = dict(head_dim=head_dim, v_dim=head_dim, kept=kept, dtype=dtype)
    static = tuple(1 + 2 * n + i for i in range(4 * n))  # k, v, valid and basis of every lane
    return OpCase(f"lanes-b{batch}-h{kv_heads}-m{rows}-d{head_dim}-t{capacity}-lanes{n}-live{live}"
                  f"{f'-r{rank}' if rank else ''}{f'-out{str(out_dtype)[6:]}' if out_dtype else ''}{_cap(softcap)}",
                  "lanes_partial", args, fn, facts, static=static, extra={"out_dtype": out_dtype},
                  batch_args=(0, *range(1 + 2 * n, 1 + 5 * n)))  # the query, every lane's k, v and valid


def lanes_of(parts) -> list[tuple]:
    """The lanes ``(heads, channels, k, v, valid, basis)`` of a :func:`lanes_case`'s arguments between the query and
    the length (one entry per lane for each field, field after field)."""
    n = len(parts) // 6
    return [tuple(parts[j * n + i] for j in range(6)) for i in range(n)]


# ----------------------------------------------------------------------------- KIVI lanes (LeanK + KIVI stacked)


def kivi_lanes_case(batch: int = 2, kv_heads: int = 4, rows: int = 3, head_dim: int = 64, capacity: int = 96,
                    live: int | None = 71, bits: int = 2, group: int = 32, counts: tuple[int, ...] | None = None,
                    query_dtype=torch.float16, dead_row: bool = True, device="cpu", seed: int = 10,
                    softcap: float | None = None) -> OpCase:
    """A stacked LeanK + KIVI middle (``PackedLanes``): one KIVI lane per kept count (``counts`` per kv head; 0 = the
    head keeps nothing) over ``capacity`` slots (a multiple of ``group``), quantized from random keys / values."""
    from .kivi.lanes_reference import KiviLane, PackedLanes
    from .kivi.reference import quantize_keys, quantize_values

    gen = _gen(seed, device)
    t = -(-capacity // group) * group
    v_group = min(32, head_dim)
    if counts is None:
        mix = (0, 1, 2, 3, 4)
        counts = tuple(mix[(i + 1) % len(mix)] * head_dim // 4 for i in range(kv_heads))
    parts = []
    for c in sorted(set(counts) - {0}, reverse=True):
        hs = [h for h, n in enumerate(counts) if n == c]
        channels = torch.stack([torch.randperm(head_dim, generator=gen, device=gen.device)[:c].sort().values
                                for _ in hs])
        k = torch.randn(batch, len(hs), t, c, generator=gen, device=gen.device) * 1.5 + 0.3
        v = torch.randn(batch, len(hs), t, head_dim, generator=gen, device=gen.device)
        full = c == head_dim and len(hs) == kv_heads
        parts.append((torch.tensor(hs, device=gen.device), None if full else channels,
                      *quantize_keys(k, bits, group), *quantize_values(v, bits, v_group)))
    valid = _valid(batch, t, gen, dead_row)
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(query_dtype)
    mv = (lambda x: None if x is None else x.to(device))
    n = len(parts)
    flat = [mv(x) for part in parts for x in part]
    args = (q.to(device), valid.to(device), _length(live, device), *flat)
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, valid, length, *rest):
            lanes = tuple(KiviLane(*rest[8 * i: 8 * i + 8]) for i in range(n))
            region = PackedLanes(bits, group, lanes, valid, kv_heads, head_dim, impl=impl, length=length)
            return region.attention_partial(q, scale, softcap=softcap)
        return f

    facts = dict(bits=bits, group=group, head_dim=head_dim, v_dim=head_dim, v_group=v_group,
                 kept=tuple(sorted(set(counts) - {0})), k_per_token=False)
    static = (1,) + tuple(3 + 8 * i + j for i in range(n) for j in range(2, 8))  # valid and every lane's payload
    return OpCase(f"kivi{bits}-lanes-b{batch}-h{kv_heads}-m{rows}-d{head_dim}-t{t}-lanes{n}-live{live}{_cap(softcap)}",
                  "kivi_lanes_partial", args, fn, facts, static=static, batch_args=static + (0,))


def kivi_lanes_buffer_case(batch: int = 2, kv_heads: int = 4, rows: int = 3, head_dim: int = 64, capacity: int = 96,
                           live: int | None = 71, slots: int = 45, buffer_live: int | None = 41, bits: int = 2,
                           group: int = 32, counts: tuple[int, ...] | None = None, dtype=torch.float16,
                           dead_row: bool = True, device="cpu", seed: int = 10,
                           softcap: float | None = None) -> OpCase:
    """The KIVI lanes of :func:`kivi_lanes_case` read together with a full-precision buffer of ``slots`` slots over
    every head and all ``head_dim`` query channels, in ``dtype`` (a static layer's sinks + recent window),
    ``buffer_live`` of them live.  Arguments: the lanes case's, then the buffer's keys, values, validity, length."""
    from . import ops
    from .kivi.lanes_reference import KiviLane, PackedLanes

    lanes = kivi_lanes_case(batch=batch, kv_heads=kv_heads, rows=rows, head_dim=head_dim, capacity=capacity,
                            live=live, bits=bits, group=group, counts=counts, dead_row=dead_row, device=device,
                            seed=seed)
    gen = _gen(seed + 1000, device)
    bk = (torch.randn(batch, kv_heads, slots, head_dim, generator=gen, device=gen.device) * 1.5).to(dtype)
    bv = torch.randn(batch, kv_heads, slots, head_dim, generator=gen, device=gen.device).to(dtype)
    bvalid = _valid(batch, slots, gen, dead_row)
    args = lanes.args + tuple(x.to(device) for x in (bk, bv, bvalid)) + (_length(buffer_live, device),)
    n = (len(lanes.args) - 3) // 8
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, valid, length, *rest):
            payload, (bk, bv, bvalid, blen) = rest[:-4], rest[-4:]
            region = PackedLanes(bits, group, tuple(KiviLane(*payload[8 * i: 8 * i + 8]) for i in range(n)), valid,
                                 kv_heads, head_dim, impl=impl, length=length)
            return ops.kivi_lanes_buffer_attention(q, region, scale, bk, bv, bvalid, blen, impl=impl,
                                                   softcap=softcap)
        return f

    k = len(args)
    name = (f"{lanes.name.replace('-lanes-', '-lanes-buffer-', 1)}-s{slots}-blive{buffer_live}"
            f"-{str(dtype).removeprefix('torch.')}")
    return OpCase(name, "kivi_lanes_buffer_partial", args, fn, lanes.facts, static=lanes.static + (k - 4, k - 3, k - 2),
                  batch_args=lanes.batch_args + (k - 4, k - 3, k - 2))


# ----------------------------------------------------------------------------- DoubleSparse


def select_case(batch: int = 2, kv_heads: int = 2, group: int = 3, tokens: int = 97, head_dim: int = 32, r: int = 8,
                bits: int = 16, k: int = 13, query_dtype=torch.float16, dead_row: bool = False, device="cpu",
                seed: int = 3, shared: bool = False) -> OpCase:
    """Label scores + top-``k`` over a channel-major label cache (the plugin's layout), with padding; ``shared``: one
    selection per kv head from its ``group`` query heads' summed scores (``group=``)."""
    from .doublesparse import select_topk
    from .doublesparse.reference import Labels, group_query, label_scores, quantize_labels

    gen = _gen(seed, device)
    keys = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen, device=gen.device)
    channels = torch.stack([torch.randperm(head_dim, generator=gen, device=gen.device)[:r]
                            for _ in range(kv_heads)])
    lab = quantize_labels(keys.gather(-1, channels.view(1, kv_heads, 1, r).expand(batch, kv_heads, tokens, r))
                          .to(torch.float16), bits)
    data = lab.data.transpose(-1, -2).contiguous().transpose(-1, -2)  # channel-major: token stride 1
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen, device=gen.device).to(query_dtype)
    valid = _valid(batch, tokens, gen, dead_row, keep=0.9)
    mv = (lambda x: None if x is None else x.to(device))
    args = (q.to(device), data.to(device), mv(lab.scale), mv(lab.zero), channels.to(device), valid.to(device))

    def fn(impl: str):
        def f(q, data, scale, zero, channels, valid):
            return select_topk(q, Labels(data, bits, scale, zero), channels, valid, k, impl=impl,
                               group=group if shared else 1)
        return f

    scores = label_scores(group_query(args[0], group if shared else 1), Labels(args[1], bits, args[2], args[3]),
                          args[4], args[5])
    facts = dict(label_bits=bits, label_channels=r, query_dtype=query_dtype, label_dtype=torch.float16)
    name = f"select-b{batch}-hq{kv_heads * group}-t{tokens}-r{r}-bits{bits}-k{k}" + ("-shared" if shared else "")
    return OpCase(name, "select_topk", args, fn,
                  facts, static=(1, 2, 3, 4, 5), extra=dict(k=k, scores=scores, tol=2e-2))


def gather_case(batch: int = 2, kv_heads: int = 2, rows: int = 3, tokens: int = 97, head_dim: int = 32,
                selected: int = 19, shared: bool = False, v_dim: int | None = None, dtype=torch.float16,
                dead_row: bool = True, device="cpu", seed: int = 4, softcap: float | None = None) -> OpCase:
    """Attention over ``selected`` distinct tokens per row (``shared``: one selection per kv head, ``[B, H, 1, K]``)."""
    from .doublesparse import gather_partial_attention

    gen = _gen(seed, device)
    dv = v_dim or head_dim
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen, device=gen.device).to(dtype)
    v = torch.randn(batch, kv_heads, tokens, dv, generator=gen, device=gen.device).to(dtype)
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen, device=gen.device).to(dtype)
    valid = _valid(batch, tokens, gen, dead_row)
    sel_rows = 1 if shared else rows
    index = torch.rand(batch, kv_heads, sel_rows, tokens, generator=gen, device=gen.device).argsort(-1)
    index = index[..., :selected]
    args = tuple(x.to(device) for x in (q, k, v, valid, index))
    scale = head_dim ** -0.5

    def fn(impl: str):
        def f(q, k, v, valid, index):
            return gather_partial_attention(q, k, v, valid, index, scale, impl=impl, softcap=softcap)
        return f

    facts = dict(head_dim=head_dim, v_dim=dv, dtype=dtype, query_dtype=dtype)
    return OpCase(f"gather{'-shared' if shared else ''}-b{batch}-h{kv_heads}-m{rows}-t{tokens}-k{selected}"
                  f"{_cap(softcap)}",
                  "gather_partial", args, fn, facts, static=(1, 2, 3), batch_args=(0, 1, 2, 3, 4))


def select_gather_case(batch: int = 2, kv_heads: int = 2, group: int = 3, tokens: int = 97, head_dim: int = 32,
                       r: int = 8, bits: int = 16, k: int = 13, shared: bool = False, v_dim: int | None = None,
                       dtype=torch.float16, dead_row: bool = True, device="cpu", seed: int = 15,
                       softcap: float | None = None) -> OpCase:
    """The label select and the gather over what it chose, as one op (:func:`ops.select_gather_attention`, what a
    static DoubleSparse read calls with ``fuse_gather`` on), over the plugin's channel-major labels of ``k``, with
    padding and a dead row; ``shared``: one selection per kv head (``group=``)."""
    from . import ops
    from .doublesparse.reference import Labels, gather_partial_attention, group_query, label_scores, \
        quantize_labels, selection_rows

    gen = _gen(seed, device)
    dv = v_dim or head_dim
    keys = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen, device=gen.device)
    v = torch.randn(batch, kv_heads, tokens, dv, generator=gen, device=gen.device).to(dtype)
    channels = torch.stack([torch.randperm(head_dim, generator=gen, device=gen.device)[:r]
                            for _ in range(kv_heads)])
    lab = quantize_labels(keys.gather(-1, channels.view(1, kv_heads, 1, r).expand(batch, kv_heads, tokens, r))
                          .to(dtype), bits)
    data = lab.data.transpose(-1, -2).contiguous().transpose(-1, -2)  # channel-major: token stride 1
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen, device=gen.device).to(dtype)
    valid = _valid(batch, tokens, gen, dead_row, keep=0.9)
    mv = (lambda x: None if x is None else x.to(device))
    args = (q.to(device), data.to(device), mv(lab.scale), mv(lab.zero), channels.to(device), valid.to(device),
            keys.to(dtype).to(device), v.to(device))
    scale = head_dim ** -0.5
    sel_group = group if shared else 1

    def fn(impl: str):
        def f(q, data, scale_, zero, channels, valid, k_, v_):
            return ops.select_gather_attention(q, Labels(data, bits, scale_, zero), channels, valid, k_, v_, k, scale,
                                               impl=impl, group=sel_group, softcap=softcap)
        return f

    def gather(index):
        """The reference attention over ``index`` (what the op chose: ties may order or pick differently)."""
        b, hq, d = args[0].shape
        return gather_partial_attention(args[0].view(b, kv_heads, group, d), args[6], args[7], args[5],
                                        selection_rows(index.long(), kv_heads, group), scale, softcap=softcap)

    scores = label_scores(group_query(args[0], sel_group), Labels(args[1], bits, args[2], args[3]), args[4], args[5])
    facts = dict(label_bits=bits, label_channels=r, label_dtype=dtype, head_dim=head_dim, v_dim=dv, dtype=dtype,
                 query_dtype=dtype)
    name = (f"select-gather-b{batch}-hq{kv_heads * group}-t{tokens}-r{r}-bits{bits}-k{k}"
            + ("-shared" if shared else "") + _cap(softcap))
    return OpCase(name, "select_gather", args, fn, facts, static=(1, 2, 3, 4, 5, 6, 7),
                  extra=dict(k=k, scores=scores, tol=2e-2, gather=gather), batch_args=(0, 1, 2, 3, 5, 6, 7))


def _cap(softcap: float | None) -> str:
    return f"-cap{softcap:g}" if softcap else ""


# ----------------------------------------------------------------------------- the region merge


def merge_case(batch: int = 2, kv_heads: int = 3, rows: int = 5, v_dim: int = 48, parts: int = 3,
               dtype: torch.dtype = torch.float16, device="cpu", seed: int = 0) -> OpCase:
    """``parts`` region partials ``(out [B, H, M, Dv] fp32, lse [B, H, M] fp32)`` as a read makes them: normalised
    outputs, LSEs spread over tens of units (one region dominates some rows), a region that sees nothing on some rows
    (LSE ``-inf``, zero output), rows no region sees (the last batch row); merged into ``dtype``."""
    from . import ops

    gen = _gen(seed, device)
    outs, lses = [], []
    for i in range(parts):
        out = torch.randn(batch, kv_heads, rows, v_dim, generator=gen, device=device)
        lse = torch.randn(batch, kv_heads, rows, generator=gen, device=device) * 20
        empty = torch.rand(batch, kv_heads, rows, generator=gen, device=device) < 0.3 * (i > 0)
        if batch > 1:
            empty[batch - 1] = True
        lse = lse.masked_fill(empty, float("-inf"))
        outs.append(out.masked_fill(empty.unsqueeze(-1), 0.0))
        lses.append(lse)

    def fn(impl):
        return lambda *a: ops.merge_attention(list(zip(a[:parts], a[parts:])), dtype, impl=impl)

    name = f"merge-{parts}parts-b{batch}-h{kv_heads}-m{rows}-dv{v_dim}-{str(dtype).split('.')[-1]}"
    return OpCase(name, "merge_partials", (*outs, *lses), fn, dict(v_dim=v_dim))


def small_cases(device="cpu", softcap: float | None = None) -> list[OpCase]:
    """Small odd shapes of every op (CPU tests; the GPU tests and the GPU check's "small" shapes).  ``softcap``: the
    attention ops' cases read with that logit soft-cap (the selection op's are unchanged)."""
    cap = {"softcap": softcap}
    return [
        kivi_case(device=device, **cap),
        kivi_case(bits=4, group=16, v_group=16, rows=5, capacity=80, live=53, head_dim=32, v_dim=64, batch=1,
                  kv_heads=2, device=device, seed=5, **cap),
        kivi_buffer_case(device=device, **cap),
        kivi_buffer_case(bits=4, rows=12, head_dim=128, capacity=160, live=None, slots=200, buffer_live=None,
                         dtype=torch.bfloat16, batch=1, kv_heads=2, dead_row=False, device=device, seed=12, **cap),
        paged_case(device=device, **cap),
        paged_case(live=None, page=32, rows=1, head_dim=64, v_dim=32, device=device, seed=6, **cap),
        lanes_case(device=device, **cap),
        lanes_case(live=None, dead_row=False, kv_heads=3, rows=1, device=device, seed=7, **cap),
        lanes_case(kv_heads=3, rows=4, capacity=61, live=45, rank=16, device=device, seed=13, **cap),
        lanes_case(kv_heads=2, counts=(0, 0), rows=4, dense_tokens=57, device=device, seed=14, out_dtype=torch.float16,
                   **cap),
        kivi_lanes_case(device=device, **cap),
        kivi_lanes_case(bits=4, group=16, kv_heads=3, rows=1, head_dim=128, capacity=80, live=None, dead_row=False,
                        device=device, seed=11, **cap),
        kivi_lanes_buffer_case(device=device, **cap),
        kivi_lanes_buffer_case(bits=4, group=16, kv_heads=3, rows=9, head_dim=128, capacity=80, live=None,
                               slots=160, buffer_live=None, dtype=torch.bfloat16, dead_row=False, device=device,
                               seed=12, **cap),
        select_case(device=device),
        select_case(bits=4, r=16, k=20, tokens=131, group=4, device=device, seed=8),
        select_case(group=4, tokens=150, k=17, device=device, seed=9, shared=True),
        gather_case(device=device, **cap),
        gather_case(shared=True, rows=4, v_dim=64, device=device, seed=9, **cap),
        select_gather_case(device=device, **cap),
        select_gather_case(bits=4, r=16, k=20, tokens=131, group=4, shared=True, v_dim=64, device=device, seed=16,
                           **cap),
        merge_case(device=device),
        merge_case(batch=1, kv_heads=8, rows=4, v_dim=128, parts=2, dtype=torch.float32, device=device, seed=10),
    ]


def op_args(case: OpCase) -> tuple:
    """The flat arguments ``case`` passes to its registered op (``torch.ops.kvcompress.<op>``), recorded from one
    eager reference call through the dispatcher (``impl`` last: ``"reference"``)."""
    from . import ops

    seen = {}
    real = ops._OPS[case.op]

    def spy(*args):
        seen["args"] = args
        return real(*args)

    ops._OPS[case.op] = spy
    try:
        case.reference()
    finally:
        ops._OPS[case.op] = real
    return seen["args"]


def _clone(outs):
    return tuple(o.clone() for o in outs) if isinstance(outs, (tuple, list)) else outs.clone()


def check_compiled(case: OpCase, impl: str, *, mode: str | None = "reduce-overhead", backend: str = "inductor",
                   time_calls: int = 0) -> dict:
    """Compile ``case.fn(impl)`` with ``torch.compile(fullgraph=True)`` (``mode`` / ``backend``), run it three times
    (warm-up, CUDA-graph capture, replay) and check the last result against the eager reference.  The case's cache
    buffers are marked as static addresses (as a static cache's are), so a CUDA-graph replay copies only the query.

    Returns ``{"ok", "max_abs_err", "message", "compile_s", "ms_per_call"}``; ``ms_per_call`` (CUDA events over
    ``time_calls`` replays; ``None`` without) and ``"eager_ms_per_call"`` (the same impl uncompiled)."""
    import time

    on_cuda = case.args[0].is_cuda
    if on_cuda:
        for i in case.static:
            if case.args[i] is not None:
                torch._dynamo.mark_static_address(case.args[i])
    ref = case.reference()
    kw = {"mode": mode} if mode else {}
    f = torch.compile(case.fn(impl), fullgraph=True, backend=backend, **kw)
    compile_s = 0.0
    for i in range(3):
        t0 = time.perf_counter()
        if on_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        got = _clone(f(*case.args))
        if on_cuda:
            torch.cuda.synchronize()
        if i == 0:
            compile_s = time.perf_counter() - t0  # trace + compile + the first (eager warm-up) run
    ok, err, msg = case.check(got, ref)
    res = {"ok": bool(ok), "max_abs_err": float(err), "message": msg, "compile_s": round(compile_s, 3),
           "ms_per_call": None, "eager_ms_per_call": None}
    if time_calls and on_cuda:
        res["ms_per_call"] = _time(lambda: f(*case.args), time_calls, mark=True)
        eager = case.fn(impl)
        res["eager_ms_per_call"] = _time(lambda: eager(*case.args), time_calls, mark=False)
    return res


def _time(call, n: int, mark: bool) -> float:
    """Milliseconds per call: CUDA events around ``n`` calls after 3 warm-up calls."""
    for _ in range(3):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n
