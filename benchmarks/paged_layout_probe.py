"""Issue 19: why the paged dense read falls below SDPA from B16 (0.85-0.95x at Llama heads on the H200, session 38)
while the lanes kernel reading the same bytes from one contiguous region stays at 0.94-1.1x.

The same read (``PagedView.attention_partial``, the Triton paged kernel, as benchutil's ``paged-dense``) over pools
that differ only in how their pages lie in memory, beside SDPA on the same tokens held contiguously (each read is
checked against SDPA's output):

* ``p16``: the grid's pool - 16-token pages, filled as benchutil fills it (rows' pages interleave chunk by chunk, a
  chunk being ``FILL_CHUNK_BYTES`` of K: runs of hundreds of pages per row);
* ``p16-decode``: 16-token pages appended one page per row at a time, as a pool fills while decoding (every row's
  consecutive pages ``batch`` pages apart);
* ``p64``: 64-token pages (16 KB of one head's K contiguous per page at d 128, the lanes kernel's step);
* ``p16-heads`` / ``p16-decode-heads``: the ``p16`` / ``p16-decode`` pools stored head-major (``[heads, pages, P,
  d]``, read through a ``[pages, heads, P, d]`` view): a head's pages lie together instead of every page holding all
  heads (session 39: three rounds on an H100 moved ``p16`` against ``p16-decode`` by 10-15 % in opposite directions
  at B16 and B64, and ``p64`` by up to 25 % between rounds - the pool's placement, not the page size).

If ``p64`` closes the gap the page granularity is the cost; if ``p16-decode`` widens it, the scatter.

    python benchmarks/paged_layout_probe.py [--shapes llama3-8b:64:32k,...] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

VARIANTS = {"p16": dict(page=16), "p16-decode": dict(page=16, per_append=16), "p64": dict(page=64),
            "p16-heads": dict(page=16, heads_major=True),
            "p16-decode-heads": dict(page=16, per_append=16, heads_major=True)}


def probe(shapes: str, variants: str, device=None, *, time_reads: bool = True, log=print) -> list[dict]:
    """One row per read: ``sdpa`` and each variant's pool, all holding the same tokens.  ``err``: each pool read's
    largest difference from SDPA's output (the pools differ only in layout, so only rounding may differ);
    ``us``: the read's time (:func:`kvcompress.kernels.benchutil.time_op`: CUDA graphs, one copy - every pool here is
    far larger than L2), ``None`` without ``time_reads``."""
    import torch

    from kvcompress.kernels import benchutil
    from kvcompress.kernels.paged import bench as paged_bench

    unknown = [v for v in variants.split(",") if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    log("| model | B | ctx | read | µs | vs SDPA | largest difference from SDPA |")
    log("|---|---|---|---|---|---|---|")
    for spec in shapes.split(","):
        name, batch, ctx = spec.split(":")
        shape, batch, ctx = benchutil._shape_named(name), int(batch), benchutil.parse_context(ctx)
        m = shape.q_heads // shape.kv_heads
        scale = shape.head_dim ** -0.5
        gen = torch.Generator(dev).manual_seed(0)
        q, k, v = benchutil.dense_inputs(batch, shape.kv_heads, ctx, shape.head_dim, m, dev, gen)
        sdpa = benchutil._sdpa_fn(None)
        want = sdpa(q, k, v).float()
        base = benchutil.time_op(sdpa, [(q, k, v)]).us if time_reads else None
        rows.append(dict(model=name, batch=batch, ctx=ctx, read="sdpa", us=base, err=0.0))
        log(f"| {name} | {batch} | {ctx} | sdpa | {_us(base)} | 1.00x | 0 |")
        for var in variants.split(","):
            opts = VARIANTS[var]
            chunk = (batch * shape.kv_heads * shape.head_dim * 2 * opts["per_append"] if "per_append" in opts
                     else paged_bench.FILL_CHUNK_BYTES)
            t0 = time.perf_counter()
            _, view = paged_bench.paged_pool(batch, shape.kv_heads, ctx, shape.head_dim, dev, page=opts["page"],
                                             kv=(k, v), chunk_bytes=chunk)
            if opts.get("heads_major"):  # the same pool re-laid head by head: [heads, pages, P, d] storage, read
                # through a [pages, heads, P, d] view (the kernel takes the strides) - a head's pages contiguous
                for part in ("k", "v"):
                    view.payload[part] = view.payload[part].transpose(0, 1).contiguous().transpose(0, 1)
            fill = time.perf_counter() - t0
            err = (view.attention_partial(q, scale)[0].float() - want).abs().max().item()
            us = benchutil.time_op(lambda qq, vv: vv.attention_partial(qq, scale), [(q, view)]).us if time_reads \
                else None
            rows.append(dict(model=name, batch=batch, ctx=ctx, read=var, us=us, err=err, fill_s=fill,
                             pages=int(view.table.shape[1])))
            ratio = f"{base / us:.2f}x" if us else "-"
            log(f"| {name} | {batch} | {ctx} | {var} | {_us(us)} | {ratio} | {err:.2e} |")
            del view
        del q, k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _us(us) -> str:
    return "-" if us is None else f"{us:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama3-8b:64:32k,smollm2-135m:64:32k,llama3-8b:16:32k")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = probe(args.shapes, args.variants, log=lambda line: print(line, flush=True))
    if args.out:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": name, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
