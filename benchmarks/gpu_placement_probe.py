"""Is a slow large read the buffer's placement?  (issue 19; docs/results.md "Session 46")

Sessions 39 and 46 saw the same read of the same cache run at one of two speeds, 13-19 % apart, from process to
process and from allocation to allocation (paged dense Llama B16 / 4k 100.5 or 115.5 us; B64 / 32k 2737 or 3248 us),
under PyTorch's caching allocator and under a pool of ``cuMemCreate`` memory alike, while SDPA - always the first
op of a shape, on buffers allocated first - did not move.  This probe allocates ``--copies`` K / V caches of one
shape one after another in one process (each its own allocation, all alive together) and times, on each copy, both
SDPA (the grid's baseline: cuDNN / flash) and kvcompress' lanes read of the whole cache (the empty stack's kernel),
CUDA graphs, one copy per timing (each read larger than L2).  If a copy is slow for both, the slowdown belongs to
where the buffer lies, not to a kernel; if only for one, to that kernel.  CUDA only::

    python benchmarks/gpu_placement_probe.py --out OUT [--shapes llama3-8b:16:4k,llama3-8b:64:32k] [--copies 6] [--churn] [--static]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:32k")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--static", action="store_true",
                    help="copies are static layers of the empty stack built by benchutil (filled through the layer's "
                         "own prefill); each is timed four ways: its static read, the lanes read and SDPA on its own "
                         "K / V buffers, and the lanes read on fresh clones of them")
    ap.add_argument("--churn", action="store_true",
                    help="before each copy, hold a tensor of a different size (1-6 GiB) and free it after the copy is "
                         "allocated, as other ops' buffers come and go in a grid run")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from kvcompress.kernels import benchutil as bu
    from kvcompress.kernels.leank import triton_kernel as lanes
    from kvcompress.kernels.leank.reference import Lane

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    shapes = {s.model: s for s in bu.SHAPES}
    sdpa = bu._sdpa_fn(None)
    rows = []
    for spec in args.shapes.split(","):
        model, b, ctx = spec.split(":")
        b, ctx = int(b), int(ctx.rstrip("k")) * 1024
        s = shapes[model]
        m = s.q_heads // s.kv_heads
        gen = torch.Generator(device=dev).manual_seed(1)
        if args.static:
            _static_copies(bu, lanes, Lane, sdpa, s, b, ctx, spec, dev, gen, args, rows)
            torch.cuda.empty_cache()
            continue
        copies = []
        for i in range(args.copies):
            try:
                held = torch.empty((1 + (i * 5) % 6) << 30, dtype=torch.uint8, device=dev) if args.churn else None
                copies.append(bu.dense_inputs(b, s.kv_heads, ctx, s.head_dim, m, dev, gen))
                del held
            except torch.OutOfMemoryError:
                break
        for i, (q, k, v) in enumerate(copies):
            t_sdpa = bu.time_op(sdpa, [(q, k, v)], device=dev)
            t_lanes = bu.time_op(lambda q, k, v: lanes.grouped_partial_attention(q, [Lane(None, None, k, v, None)],
                                                                                  s.head_dim ** -0.5),
                                 [(q, k, v)], device=dev)
            row = {"shape": spec, "copy": i, "k_ptr": k.data_ptr(), "sdpa_us": t_sdpa.us, "lanes_us": t_lanes.us,
                   "method": t_sdpa.method, "churn": args.churn}
            rows.append(row)
            print(f"{spec} copy {i}: sdpa {t_sdpa.us:8.1f} us  lanes {t_lanes.us:8.1f} us  "
                  f"({t_lanes.us / t_sdpa.us:.3f}x the SDPA time)  k at {k.data_ptr():#x}", flush=True)
            with open(os.path.join(args.out, "placement_probe.json"), "w") as fh:
                json.dump(rows, fh, indent=1)
        del copies
        torch.cuda.empty_cache()
    return 0


def _static_copies(bu, lanes, Lane, sdpa, s, b, ctx, spec, dev, gen, args, rows) -> None:
    """``--static``: the copies are empty-stack static layers; see the option's help."""
    scale = s.head_dim ** -0.5
    layers = []
    for i in range(args.copies):
        try:
            layer = bu.build_static_layer("none", s, b, ctx, dev, gen)
        except torch.OutOfMemoryError:
            break
        layers.append(layer)
        q4 = torch.randn(b, s.kv_heads, s.q_heads // s.kv_heads, s.head_dim, device=dev, dtype=torch.float16,
                         generator=gen)
        q = q4.reshape(b, s.q_heads, 1, s.head_dim)
        k, v, valid = layer.k, layer.v, layer.valid
        kc, vc, vac = k.clone(), v.clone(), valid.clone()
        t = {
            "static_us": bu.time_op(lambda q, layer: bu.static_read(layer, q, scale), [(q, layer)], device=dev).us,
            "lanes_own_us": bu.time_op(lambda q, k, v, va: lanes.grouped_partial_attention(
                q, [Lane(None, None, k, v, va)], scale), [(q4, k, v, valid)], device=dev).us,
            "sdpa_own_us": bu.time_op(sdpa, [(q4, k, v)], device=dev).us,
            "lanes_clone_us": bu.time_op(lambda q, k, v, va: lanes.grouped_partial_attention(
                q, [Lane(None, None, k, v, va)], scale), [(q4, kc, vc, vac)], device=dev).us,
        }
        del kc, vc, vac
        rows.append({"shape": spec, "copy": i, "static": True, "k_ptr": k.data_ptr(), **t})
        print(f"{spec} layer {i}: static read {t['static_us']:8.1f} us  lanes on its buffers {t['lanes_own_us']:8.1f}"
              f"  SDPA on its buffers {t['sdpa_own_us']:8.1f}  lanes on clones {t['lanes_clone_us']:8.1f}  "
              f"k at {k.data_ptr():#x}", flush=True)
        with open(os.path.join(args.out, "placement_probe.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    del layers


if __name__ == "__main__":
    sys.exit(main())
