"""Benchmark of the paged decode kernel (``python -m kvcompress.kernels.paged.bench``).

Per shape (Llama-3-8B-like: 32 query / 8 kv heads, d = 128; SmolLM2-135M: 9 / 3, d = 64),
batch ``B`` and per-row budget ``T`` tokens (a PagedEviction cache holds ``T`` tokens per row
however long the sequence):

* ``paged``: the Triton paged kernel over fp16 pages of 16 tokens, the block tables a random
  permutation of the pool (a fragmented pool after many evictions), every slot valid;
* ``paged-ref``: its PyTorch reference (gather through the table, then attention), small shapes;
* ``sdpa``: ``scaled_dot_product_attention`` over a *contiguous* fp16 cache of the same tokens
  (GQA rows folded into the query length) - what the same budget costs without pages.

Timing, cold L2 and CUDA graphs come from :mod:`kvcompress.kernels.benchutil`.  Each row has the
median latency, the bytes read (K, V, slot flags, block table, query), the bandwidth on them and
the ratio to SDPA.  With ``--check`` the kernel is first compared with an fp64 reference.

:func:`paged_pool` and :func:`static_kivi_pool` build pools with the stores' own code (``kvcompress.paged``) for the
``paged-dense`` / ``paged-kivi2`` rows of :mod:`kvcompress.kernels.benchutil`.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Sequence

import torch

from kvcompress.kernels import benchutil
from kvcompress.kernels.benchutil import SHAPES, copies_for, time_op

PAGE = 16


def paged_inputs(batch: int, kv_heads: int, tokens: int, head_dim: int, m: int, device, gen=None):
    pages = batch * math.ceil(tokens / PAGE)
    k = torch.randn(pages, kv_heads, PAGE, head_dim, device=device, dtype=torch.float16, generator=gen)
    v = torch.randn(pages, kv_heads, PAGE, head_dim, device=device, dtype=torch.float16, generator=gen)
    valid = torch.ones(pages, PAGE, dtype=torch.bool, device=device)
    table = torch.randperm(pages, device=device, generator=gen).to(torch.int32).view(batch, -1)
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=torch.float16, generator=gen)
    return q, k, v, valid, table


def paged_bytes(q, k, v, valid, table) -> int:
    heads = k.shape[1]
    return sum(t.numel() * t.element_size() for t in (q, k, v)) + (valid.numel() + table.numel() * 4) * heads


# ----------------------------------------------------------------------------- pools built by the stores themselves
# (``kernels.benchutil`` rows ``paged-dense`` / ``paged-kivi2`` / ``paged-kivi2-gather``)

#: bytes of K per fill chunk (bounds the transient memory of building a large pool)
FILL_CHUNK_BYTES = 256 * 1024**2


def _chunk_tokens(batch: int, kv_heads: int, head_dim: int, unit: int, chunk_bytes: int = FILL_CHUNK_BYTES) -> int:
    n = max(unit, chunk_bytes // max(1, batch * kv_heads * head_dim * 2))
    return max(unit, n // unit * unit)


def _tokens(batch, kv_heads, start, n, head_dim, device, gen, kv, dtype):
    """Tokens ``[start, start + n)``: slices of ``kv = (K, V)`` when given (tests), else random."""
    if kv is not None:
        return kv[0][:, :, start:start + n].contiguous(), kv[1][:, :, start:start + n].contiguous()
    shape = (batch, kv_heads, n, head_dim)
    return (torch.randn(shape, device=device, dtype=dtype, generator=gen),
            torch.randn(shape, device=device, dtype=dtype, generator=gen))


def kivi_codec(head_dim: int, bits: int = 2, group: int = 32):
    """The KIVI compressor's own codec (``plugins/kivi.py``), as a paged pool receives it from the stack."""
    from kvcompress.plugins.kivi import KiviCodec, KiviConfig

    return KiviCodec(KiviConfig(bits=bits, group=group, residual=group), head_dim)


def paged_pool(batch: int, kv_heads: int, tokens: int, head_dim: int, device, gen=None, *, page: int = PAGE,
               codec=None, kv=None, dtype=torch.float16, chunk_bytes: int = FILL_CHUNK_BYTES):
    """A dynamic :class:`kvcompress.paged.PagedStore` (what ``paged_eviction`` builds in a dynamic cache) holding
    ``tokens`` tokens per row, written by the store's own ``append`` in chunks (rows' pages interleave chunk by chunk,
    as a pool fills during decoding); ``codec``: ``None`` for dense pages, :func:`kivi_codec` for KIVI pages.
    Returns ``(store, view)``: ``view`` is the lane attention reads (:class:`kvcompress.paged.PagedView`)."""
    from kvcompress.paged import PagedStore
    from kvcompress.state import KVBlock

    store = PagedStore(page, codec)
    store.limit(tokens)  # the owner's bound: the pool grows to the pages it needs, not past them
    if tokens % page:
        raise ValueError(f"{tokens} tokens are not whole pages of {page}")
    chunk = _chunk_tokens(batch, kv_heads, head_dim, page, chunk_bytes)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        k, v = _tokens(batch, kv_heads, start, n, head_dim, device, gen, kv, dtype)
        store.append(KVBlock(k, v, torch.ones(batch, n, dtype=torch.bool, device=k.device),
                             torch.arange(start, start + n, device=k.device)))
    return store, store.segments()[0].packed


def static_kivi_pool(batch: int, kv_heads: int, tokens: int, head_dim: int, device, gen=None, *, bits: int = 2,
                     group: int = 32, page: int = 32, kv=None, dtype=torch.float16,
                     chunk_bytes: int = FILL_CHUNK_BYTES):
    """A :class:`kvcompress.paged.StaticPagedStore` of KIVI pages (what ``paged_eviction`` + ``kivi`` builds in a
    static cache) holding ``tokens`` tokens per row, every row's pages written in order.

    The store allocates and picks its encoder and read kernel through its own ``append`` (one page per row); the
    other pages are encoded by the store's encoder (the codec with the store's chosen ``impl``) and written where
    ``StaticPagedStore._write_page`` puts a row's ``j``-th page when its pages ``0..j-1`` are live: token slots
    ``[j*P, (j+1)*P)`` of the row's payload (tests/test_benchutil.py checks every buffer against a pool written by
    ``append`` alone).  Writing page by page through ``append`` costs a pass over the row's whole pool per page,
    too slow for 128k-token rows.  Returns ``(store, packed)``: ``packed`` is the
    :class:`~kvcompress.kernels.kivi.PackedKV` a decode step reads in place."""
    from kvcompress.paged import StaticPagedStore
    from kvcompress.state import KVBlock

    if tokens % page or page % group:
        raise ValueError(f"{tokens} tokens are not whole pages of {page} (a multiple of the KIVI group {group})")
    codec = kivi_codec(head_dim, bits, group)
    store = StaticPagedStore(page, tokens // page, codec)
    k, v = _tokens(batch, kv_heads, 0, page, head_dim, device, gen, kv, dtype)
    dev = k.device
    store.append(KVBlock(k, v, torch.ones(batch, page, dtype=torch.bool, device=dev), torch.arange(page, device=dev)))
    bufs = store.lanes[0][1]
    impl = store.quantizers[0]
    chunk = _chunk_tokens(batch, kv_heads, head_dim, page, chunk_bytes)
    for start in range(page, tokens, chunk):
        n = min(chunk, tokens - start)
        k, v = _tokens(batch, kv_heads, start, n, head_dim, device, gen, kv, dtype)
        valid = torch.ones(batch, n, dtype=torch.bool, device=dev)
        kw = {} if impl is None else {"impl": impl}
        for name, src in codec.encode(k, v, valid, fill=True, **kw).items():
            lo, hi = (start, start + n) if codec.token_axis(name) else (start // codec.unit, (start + n) // codec.unit)
            bufs[name][:, :, lo:hi].copy_(src.to(bufs[name].dtype))
        store.valid[:, start:start + n] = True
        store.pos[:, start:start + n] = torch.arange(start, start + n, device=dev)
        first, last = start // page, (start + n) // page
        store.live[:, first:last] = True
        store.age[:, first:last] = store.clock + torch.arange(last - first, device=dev)  # written in page order
        store.clock.add_(last - first)
    return store, store.segments()[0].packed


def pool_bytes(query, view) -> int:
    """Bytes one read of a dynamic pool's lane must move: the pages its block tables name (K and V, or the KIVI
    codes, scales and zeros), their slot flags and the table (both once per kv head), the query."""
    table = view.table
    used = int((table >= 0).sum())
    heads = query.shape[1]
    cap = view.store.capacity
    payload = sum(t.numel() * t.element_size() for t in view.payload.values()) * used // max(1, cap)
    page = view.page_size
    return query.numel() * query.element_size() + payload + (used * page + table.numel() * 4) * heads


def fp64_check(device, gen) -> dict:
    from .reference import gather_pages, gather_valid
    from .triton_kernel import _forward

    q, k, v, valid, table = paged_inputs(3, 4, 1000, 128, 4, device, gen)
    valid &= torch.rand(valid.shape, device=device, generator=gen) > 0.1
    table[1, -5:] = -1
    scale = 128 ** -0.5
    out, lse = _forward(q, k, v, valid, table, scale)
    kk, vv, ok = gather_pages(k, table).double(), gather_pages(v, table).double(), gather_valid(valid, table)
    s = torch.einsum("bhmd,bhtd->bhmt", q.double(), kk) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.einsum("bhmt,bhtd->bhmd", torch.softmax(s, -1), vv)
    return {"max_abs_err_out": float((out.double() - ref).abs().max()),
            "max_abs_err_lse": float((lse.double() - ref_lse).abs().max())}


def run(device: str = "cuda", budgets: Sequence[int] = (1024, 4096), batches: Sequence[int] = (1, 16, 64),
        check: bool = True) -> dict:
    from .reference import paged_attention_partial as reference
    from .triton_kernel import paged_attention_partial as fused

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "rows": []}
    if check and dev.type == "cuda":
        out["fp64_check"] = fp64_check(dev, gen)
    sdpa = benchutil._sdpa_fn(None)
    for shape in SHAPES:
        group = shape.q_heads // shape.kv_heads
        for batch in batches:
            for tokens in budgets:
                one = paged_inputs(batch, shape.kv_heads, tokens, shape.head_dim, group, dev, gen)
                nbytes = paged_bytes(*one)
                n = copies_for(nbytes) if dev.type == "cuda" else 1
                data = [one] + [paged_inputs(batch, shape.kv_heads, tokens, shape.head_dim, group, dev, gen)
                                for _ in range(n - 1)]
                scale = shape.head_dim ** -0.5
                t_paged = time_op(lambda q, k, v, ok, tb: fused(q, k, v, ok, tb, scale), data) \
                    if dev.type == "cuda" else None
                dense = [benchutil.dense_inputs(batch, shape.kv_heads, tokens, shape.head_dim, group, dev, gen)
                         for _ in range(n)]
                t_sdpa = time_op(sdpa, dense)
                t_ref = time_op(lambda q, k, v, ok, tb: reference(q, k, v, ok, tb, scale), data[:1], reps=5) \
                    if batch * tokens <= 16 * 4096 else None
                for op, t in (("paged", t_paged), ("paged-ref", t_ref), ("sdpa", t_sdpa)):
                    if t is None:
                        continue
                    row = benchutil._result(op, shape, batch, tokens, t, nbytes)
                    row["vs_sdpa"] = t_sdpa.seconds / t.seconds
                    out["rows"].append(row)
                del data, dense
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def markdown(result: dict) -> str:
    lines = ["| model | B | tokens/row | op | µs | GB/s | % of 4.3 TB/s | vs SDPA (contiguous) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['ctx']} | {r['op']} | {r['latency_us']:.1f} | "
                     f"{r['bandwidth_tbps'] * 1000:.0f} | {r['pct_of_4p3']:.0f}% | {r['vs_sdpa']:.2f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="one budget (1024), batches 1 and 16")
    args = parser.parse_args(argv)
    kwargs = dict(budgets=(1024,), batches=(1, 16)) if args.quick else {}
    if args.device == "cpu":
        kwargs = dict(budgets=(256,), batches=(1,))
    result = run(args.device, **kwargs)
    if "fp64_check" in result:
        print("fp64 check:", result["fp64_check"])
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
