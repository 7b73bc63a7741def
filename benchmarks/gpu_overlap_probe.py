"""Probe (issue 19): how much of a LeanK-70 + KIVI-2 static read is its two big launches running one after the other?

A static LeanK + KIVI layer's decode read, where the KIVI kernel does not take the full-precision buffer in its own
launch (``fuses_buffer``: from about 32 rows at 4k), is two independent reads - the Triton lanes kernel over the
1024-slot buffer (sinks + window + flush) and the CUDA KIVI lanes kernel over the quantized middle - each with its
split combine, then one log-sum-exp merge.  Neither depends on the other, but on one stream the second starts only
when the first (and its combine) has finished, so each one's tail and launch gaps add up.  This probe times, in one
process and under CUDA graphs with cold L2 (``kernels.benchutil.time_op`` over deep copies of the layer):

* ``read``: the layer's own read (``StaticLayer._read``, what the grid times);
* ``apart``: the same two reads and merge, issued here on one stream (buffer first), to check the decomposition
  costs what ``read`` costs where ``read`` reads them apart;
* ``apart-kivi-first``: the same with the KIVI read issued first;
* ``streams``: the buffer read forked onto a second stream (captured as a fork / join in the graph), the KIVI read
  on the first, joined before the merge - the upper bound of what running the two concurrently can save.

Every variant's output is checked against ``read`` (max abs error).  Usage (on a GPU):

    python benchmarks/gpu_overlap_probe.py --shapes llama3-8b:4:4k,llama3-8b:16:32k --out overlap.json

prints a markdown table (µs per read, and SDPA on the uncompressed cache at the same shape for the ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from kvcompress.kernels import benchutil as bu


def _parse_shapes(text: str):
    out = []
    by_name = {s.model: s for s in bu.SHAPES}
    for item in text.split(","):
        model, b, ctx = item.split(":")
        ctx = int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx)
        out.append((by_name[model], int(b), ctx))
    return out


def _pieces(layer, q, scale):
    """The read's two parts as ``StaticLayer._read`` / ``attend_segments`` build them for ``[buffer, region]``."""
    from kvcompress.kernels.attention.partials import _fused_dense

    segs = bu.static_segments(layer)
    if len(segs) != 2:
        raise SystemExit(f"expected [buffer, one region], got {len(segs)} segments")
    buf, region = segs
    if region.packed is None or region.heads is not None or region.qmap is not None or region.vmap is not None:
        raise SystemExit("the middle is not one packed region over every head")
    b, hq, _, d = q.shape
    hkv = layer.k.shape[1]
    q5 = q.view(b, hkv, hq // hkv, 1, d)
    qs = q5.reshape(b, hkv, hq // hkv, d)

    def buffer_part():
        part, rest, _ = _fused_dense(q5, [buf], scale, False, layer.kernels["lanes_partial"])
        if part is None or rest:
            raise SystemExit("the buffer is not read by the lanes kernel")
        return part

    def region_part():
        return region.packed.attention_partial(qs, scale)

    def merge(parts):
        from kvcompress.kernels import ops

        impl = layer.kernels.get("merge_partials", "reference")
        if impl == "reference":
            from kvcompress.kernels.attention.partials import merge_partials

            out = merge_partials(parts, None).to(q.dtype)
        else:
            out = ops.merge_attention(parts, q.dtype, impl=impl)
        return out.reshape(b, hq, 1, -1).transpose(1, 2)

    return buffer_part, region_part, merge


def variants(side: torch.cuda.Stream):
    def read(q, layer, scale):
        return bu.static_read(layer, q, scale)

    def apart(q, layer, scale):
        bp, rp, merge = _pieces(layer, q, scale)
        a = bp()
        return merge([a, rp()])

    def apart_kivi_first(q, layer, scale):
        bp, rp, merge = _pieces(layer, q, scale)
        r = rp()
        return merge([bp(), r])

    def streams(q, layer, scale):
        bp, rp, merge = _pieces(layer, q, scale)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            a = bp()
        r = rp()
        main.wait_stream(side)
        for t in a:
            t.record_stream(main)
        return merge([a, r])

    return {"read": read, "apart": apart, "apart-kivi-first": apart_kivi_first, "streams": streams}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b:1:4k,llama3-8b:4:4k,llama3-8b:16:4k,llama3-8b:64:4k,"
                    "llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,llama3-8b:16:128k,"
                    "smollm2-135m:4:4k,smollm2-135m:16:4k,smollm2-135m:16:32k,smollm2-135m:64:32k")
    ap.add_argument("--op", default="leank70-kivi2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a check of the decomposition (no streams; the times mean nothing)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    fns = variants(side)
    if side is None:
        del fns["streams"]
    rows = []
    devname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# {devname}, op {args.op}", flush=True)
    print("| shape | round | sdpa | " + " | ".join(fns) + " | impl | max err |")
    print("|---|---|---|" + "---|" * len(fns) + "---|---|")
    for shape, b, ctx in _parse_shapes(args.shapes):
        gen = torch.Generator(dev).manual_seed(0)
        scale = 1 / math.sqrt(shape.head_dim)
        torch.cuda.empty_cache()
        # SDPA on the uncompressed cache at this shape (the grid's baseline: its fastest backend)
        sd = None
        dense = 2 * b * shape.kv_heads * ctx * shape.head_dim * 2
        dn = min(bu.copies_for(dense), int(torch.cuda.mem_get_info(dev)[0] * 0.8 // dense)) if dev.type == "cuda" else 0
        if dn >= 1:
            kv = [bu.dense_inputs(b, shape.kv_heads, ctx, shape.head_dim, shape.q_heads // shape.kv_heads, dev, gen)
                  for _ in range(dn)]
            for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    t = bu.time_op(bu._sdpa_fn(be), kv, reps=args.reps)
                except RuntimeError:
                    continue
                sd = t if sd is None or t.seconds < sd.seconds else sd
            del kv
            torch.cuda.empty_cache()
        q0 = torch.randn(b, shape.q_heads, 1, shape.head_dim, device=dev, dtype=torch.float16, generator=gen)
        layer = bu.build_static_layer(args.op, shape, b, ctx, dev, gen)
        nbytes = bu.static_read_bytes(layer, q0)
        alloc = sum(layer.memory().values())
        n = 1
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
            n = max(1, min(bu.copies_for(nbytes), bu.MAX_COPIES, 1 + int(free * 0.8 // max(1, alloc))))
        data = [(q0, layer)] + [(torch.randn_like(q0), bu._copy(layer)) for _ in range(n - 1)]
        ref = fns["read"](q0, layer, scale).float()
        errs = {}
        for name, fn in fns.items():
            try:
                errs[name] = float((fn(q0, layer, scale).float() - ref).abs().max())
            except SystemExit as e:
                errs[name] = str(e)
        for r in range(args.rounds):
            times = {}
            for name, fn in fns.items():
                if isinstance(errs.get(name), str):
                    times[name] = None
                    continue
                t = bu.time_op(lambda q, lay, fn=fn: fn(q, lay, scale), data, reps=args.reps)
                times[name] = t.us
            label = f"{shape.model} B{b}/{ctx // 1024}k"
            cells = " | ".join("-" if times[k] is None else f"{times[k]:.1f}" for k in fns)
            err = max((v for v in errs.values() if not isinstance(v, str)), default=float("nan"))
            print(f"| {label} | {r + 1} | {'-' if sd is None else f'{sd.us:.1f}'} | {cells} | "
                  f"{bu.static_impl(layer)} | {err:.1e} |", flush=True)
            rows.append({"model": shape.model, "batch": b, "ctx": ctx, "round": r + 1, "bytes": nbytes,
                         "copies": n, "sdpa_us": None if sd is None else sd.us, "us": times, "errors": errs,
                         "impl": bu.static_impl(layer)})
        del data, layer
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": devname, "op": args.op, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
