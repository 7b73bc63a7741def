"""Where one static layer's decode read spends its GPU time: every kernel it launches, with its mean duration.

``kvcompress.kernels.benchutil`` times a whole read (``--ops none,leank70-kivi2,lowrank``); this script runs the same
read (:func:`kvcompress.kernels.benchutil.static_read` over :func:`~kvcompress.kernels.benchutil.build_static_layer`)
under ``torch.profiler`` and lists the CUDA kernels of one call: name, launches per call, mean µs, and each kernel's
tail - its time after every earlier kernel had ended (:func:`kernel_tails`: a kernel launched with programmatic
dependent launch starts early and waits on the device, so its duration overstates it) - with the read's GPU-busy
time, the sum of the tails.  It answers "is it the split kernel, the merge, or the small launches around them"
before any kernel is tuned.  CUDA only::

    python benchmarks/gpu_read_profile.py --ops leank70-kivi2,none --shapes llama3-8b:1:32k,llama3-8b:16:32k \
        --out OUT/read_profile.json
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NamedTuple

import torch


class Read(NamedTuple):
    """One read to profile: ``call()`` runs it; ``impl`` names its kernels; ``inputs`` are what it reads (the query
    and the K / V tensors, lanes or static layer)."""

    call: Callable[[], object]
    impl: str
    inputs: tuple


def reader(op: str, shape, batch: int, ctx: int, dev, gen) -> Read:
    """One call of ``op``'s read at this shape, as ``benchutil`` times it - a static layer's read
    (:data:`~kvcompress.kernels.benchutil.STATIC_OPS`), ``sdpa`` on the uncompressed cache (the grid's baseline, so
    a row's kernels can be set beside it from the same run), or ``leank50`` / ``leank70`` (the grouped lanes kernel
    over a pruned middle of ``ctx - 1024`` tokens and the full-precision region)."""
    from kvcompress.kernels import benchutil as bu

    m = shape.q_heads // shape.kv_heads
    scale = shape.head_dim ** -0.5
    if op == "sdpa":
        q, k, v = bu.dense_inputs(batch, shape.kv_heads, ctx, shape.head_dim, m, dev, gen)
        sdpa = bu._sdpa_fn(None)
        return Read(lambda: sdpa(q, k, v), "sdpa", (q, k, v))
    if op in ("leank50", "leank70"):
        from kvcompress.kernels.leank.triton_kernel import grouped_partial_attention

        q, lanes = bu.leank_inputs(batch, shape.kv_heads, ctx - bu.LEANK_FP_TOKENS, shape.head_dim, m, int(op[5:]),
                                   dev, gen)
        return Read(lambda: grouped_partial_attention(q, lanes, scale), "lanes:triton", (q, lanes))
    layer = bu.build_static_layer(op, shape, batch, ctx, dev, gen)
    q = torch.randn(batch, shape.q_heads, 1, shape.head_dim, device=dev, dtype=torch.float16, generator=gen)
    return Read(lambda: bu.static_read(layer, q, scale), bu.static_impl(layer), (q, layer))


def kernel_tails(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per kernel name, the summed part of its spans that lies after every earlier kernel had ended (``spans``:
    ``(name, start, end)`` on one stream, any order).  A kernel launched with programmatic dependent launch (the KIVI
    combine, DoubleSparse's gathers) starts while the kernel before it still runs and waits on the device, so its
    duration counts that wait; its tail does not.  The tails add up to the time the GPU was busy with any of them."""
    tails: dict[str, float] = {}
    frontier = float("-inf")
    for name, start, end in sorted(spans, key=lambda x: (x[1], x[2])):
        tails[name] = tails.get(name, 0.0) + max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return tails


def profile_read(op: str, shape_name: str, batch: int, ctx: int, iters: int = 20) -> dict:
    from kvcompress.kernels import benchutil as bu

    shape = bu._shape_named(shape_name)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    read, impl, _ = reader(op, shape, batch, ctx, dev, gen)
    for _ in range(3):
        read()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            read()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    spans: list[tuple[str, float, float]] = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time)  # µs
            tr = getattr(ev, "time_range", None)  # the kernel's device timestamps (µs), from the CUPTI activity
            if tr is not None:
                spans.append((ev.name, tr.start, tr.end))
    tails = kernel_tails(spans)
    total = sum(sum(v) for v in kernels.values()) / iters
    rows = sorted(({"kernel": k[:110], "per_call": len(v) / iters, "mean_us": sum(v) / len(v),
                    "us_per_call": sum(v) / iters, "tail_us_per_call": tails.get(k, 0.0) / iters}
                   for k, v in kernels.items()), key=lambda r: -r["us_per_call"])
    return {"op": op, "shape": shape_name, "batch": batch, "ctx": ctx, "impl": impl,
            "kernel_us_per_call": total, "busy_us_per_call": sum(tails.values()) / iters if spans else float("nan"),
            "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="leank70-kivi2,none")
    ap.add_argument("--shapes", default="llama3-8b:1:32k,llama3-8b:16:32k")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kvcompress.kernels.benchutil import parse_context

    results = []
    for spec in args.shapes.split(","):
        model, b, ctx = spec.split(":")
        for op in args.ops.split(","):
            try:
                r = profile_read(op, model, int(b), parse_context(ctx), args.iters)
            except Exception as exc:  # one failing row must not lose the others
                r = {"op": op, "shape": spec, "error": f"{type(exc).__name__}: {exc}"[:500]}
            results.append(r)
            print(f"## {op} {spec}: {r.get('impl', '')} - {r.get('kernel_us_per_call', float('nan')):.1f} µs of "
                  f"kernels per read, GPU busy {r.get('busy_us_per_call', float('nan')):.1f} µs {r.get('error', '')}",
                  flush=True)
            for k in r.get("kernels", []):  # tail: past the end of every earlier kernel (a PDL wait is not counted)
                print(f"  {k['us_per_call']:8.1f} µs  x{k['per_call']:.0f}  {k['mean_us']:8.1f} µs each  "
                      f"tail {k['tail_us_per_call']:7.1f} µs  {k['kernel']}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
