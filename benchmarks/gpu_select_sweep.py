"""The DoubleSparse select kernel's top-k search on a GPU (issue 19): configurations side by side.

Times ``kernels.doublesparse.triton_kernel.select_topk`` (fused label scores + exact top-k, channel-major fp16
labels, r = 16) per query head (``q [B, Hq, D]``) and group-shared (the group's summed query, ``[B, Hkv, D]``) at
k = ctx/16 and ctx/8, for the configurations of ``--configs`` (JSON objects for ``select_topk(config=)``: the
launch's ``elems_per_thread``, ``unroll``, ``chunk_tokens``), and ``--old MODULE`` (an earlier copy of the
kernel module, e.g. ``kvcompress.kernels.doublesparse.triton_kernel_old``) for a before / after.  Every
configuration's selection is checked against the fp32 label scores once per shape (``reference.is_topk``).

CUDA graphs, cold L2 (labels rotated over 400 MB, ``benchutil.time_op``).  Writes ``OUT/select_sweep.json`` and
prints a table (µs) and each configuration's geometric-mean speed-up over the first one; ``--best FILE`` writes
the configuration with the best geometric mean among those that selected a top-k everywhere (JSON, for
``KVCOMPRESS_DS_CONFIG``).

    python benchmarks/gpu_select_sweep.py --out DIR [--old MODULE] [--configs '{"search_high": 32}' ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

import torch

SHAPES = (("llama3-8b", 32, 8, 128, 1, 4096), ("llama3-8b", 32, 8, 128, 1, 32768),
          ("llama3-8b", 32, 8, 128, 4, 32768), ("llama3-8b", 32, 8, 128, 16, 32768),
          ("llama3-8b", 32, 8, 128, 64, 32768), ("llama3-8b", 32, 8, 128, 16, 4096),
          ("smollm2-135m", 9, 3, 64, 1, 32768), ("smollm2-135m", 9, 3, 64, 16, 32768),
          # beyond 32k (the fused plan's limit at ctx/16: '{"multilevel": true}' against the two-step fallback)
          ("llama3-8b", 32, 8, 128, 1, 65536), ("llama3-8b", 32, 8, 128, 1, 131072),
          ("llama3-8b", 32, 8, 128, 16, 131072), ("smollm2-135m", 9, 3, 64, 4, 131072))
CONFIGS = ('{}', '{"elems_per_thread": 16}', '{"elems_per_thread": 64}', '{"unroll": 2}')


def labels_for(b, hq, hkv, ctx, d, r, dev, gen):
    from kvcompress.kernels.doublesparse.reference import Labels

    data = torch.randn(b, hkv, r, ctx, device=dev, dtype=torch.float16, generator=gen).transpose(-1, -2)
    ch = torch.stack([torch.randperm(d, device=dev, generator=gen)[:r] for _ in range(hkv)])
    q = torch.randn(b, hq, d, device=dev, dtype=torch.float16, generator=gen) * 2
    return q, Labels(data, 16, None, None), ch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--old", default=None, help="module of an earlier select kernel, timed as 'old'")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--best", default=None, help="write the best correct configuration here (JSON)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated model:B:ctx shapes of SHAPES to run")
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny shape on the CPU (run under TRITON_INTERPRET=1): checks the script, times nothing real")
    args = ap.parse_args(argv)
    from kvcompress.kernels import benchutil
    from kvcompress.kernels.doublesparse import reference
    from kvcompress.kernels.doublesparse import triton_kernel as tk

    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = (("tiny", 4, 2, 32, 2, 600),) if args.smoke else SHAPES
    if args.only:
        want = set(args.only.split(","))
        shapes = tuple(s for s in shapes if f"{s[0]}:{s[4]}:{s[5] // 1024}k" in want)
    variants = [(c, tk, json.loads(c)) for c in args.configs]
    if args.old:
        variants.insert(0, ("old", importlib.import_module(args.old), None))
    rows = []
    for model, hq, hkv, d, b, ctx in shapes:
        gen = torch.Generator(device=dev).manual_seed(b * 7 + ctx)
        per = b * hkv * ctx * 16 * 2
        n = 1 if args.smoke else max(2, min(64, benchutil.copies_for(per)))
        data = [labels_for(b, hq, hkv, ctx, d, 16, dev, gen) for _ in range(n)]
        for shared in (False, True):
            inputs = [((q.float().view(b, hkv, hq // hkv, d).sum(2) if shared else q), lab, ch) for q, lab, ch in data]
            q0, lab0, ch0 = inputs[0]
            scores = reference.label_scores(q0.float(), reference.Labels(lab0.data.float(), 16, None, None), ch0,
                                            None)
            tol = 1e-3 * max(1.0, float(scores.abs().max()))
            for frac in (16, 8):
                kk = ctx // frac
                for name, mod, cfg in variants:
                    row = {"model": model, "batch": b, "ctx": ctx, "shared": shared, "k": kk, "variant": name}
                    extra = {} if cfg is None else {"config": cfg}
                    try:
                        got = mod.select_topk(q0, lab0, ch0, None, kk, **extra)
                        row["topk_ok"] = bool(reference.is_topk(got, scores, kk, tol))
                        t = benchutil.time_op(lambda q, lab, ch: mod.select_topk(q, lab, ch, None, kk, **extra),
                                              inputs, reps=1 if args.smoke else args.reps,
                                              warmup=0 if args.smoke else 3)
                        row.update(latency_us=t.us, spread=t.spread, method=t.method)
                    except Exception as exc:  # noqa: BLE001 - a configuration that fails is a result too
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del data, inputs
        torch.cuda.empty_cache()
    names = [v[0] for v in variants]
    keyf = (lambda r: (r["model"], r["batch"], r["ctx"], r["shared"], r["k"]))
    cells = sorted({keyf(r) for r in rows}, key=lambda k: (k[0], k[1], k[2], k[3], -k[4]))
    at = {(keyf(r), r["variant"]): r for r in rows}
    lines = ["| shape | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in cells:
        vals = []
        for nme in names:
            r = at.get((c, nme), {})
            v = f"{r['latency_us']:.1f}" if "latency_us" in r else "err"
            vals.append(v + ("" if r.get("topk_ok", False) else " (NOT top-k)") if "latency_us" in r else v)
        lines.append(f"| {c[0]} B{c[1]}/{c[2] // 1024}k {'shared' if c[3] else 'per-head'} k={c[4]} | "
                     + " | ".join(vals) + " |")
    summary = {}
    for nme in names:
        ratios = [at[(c, names[0])]["latency_us"] / at[(c, nme)]["latency_us"] for c in cells
                  if "latency_us" in at.get((c, nme), {}) and "latency_us" in at.get((c, names[0]), {})]
        ok = all(at.get((c, nme), {}).get("topk_ok", False) for c in cells)
        summary[nme] = {"geomean_speedup_vs_first": math.exp(sum(map(math.log, ratios)) / len(ratios))
                        if ratios else None, "all_topk": ok, "cells": len(ratios)}
    lines.append("")
    lines.append("| variant | geometric-mean speed-up over " + names[0] + " | every selection a top-k |")
    lines.append("|---|---|---|")
    for nme, s in summary.items():
        g = s["geomean_speedup_vs_first"]
        lines.append(f"| {nme} | {g:.3f} | {s['all_topk']} |" if g else f"| {nme} | - | {s['all_topk']} |")
    table = "\n".join(lines)
    print(table)
    doc = {"rows": rows, "summary": summary, "torch": torch.__version__,
           "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(dev)}
    with open(os.path.join(args.out, "select_sweep.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "select_sweep.md"), "w") as f:
        f.write(table + "\n")
    if args.best:
        good = [(s["geomean_speedup_vs_first"], n) for n, s in summary.items()
                if n != "old" and s["all_topk"] and s["geomean_speedup_vs_first"]]
        best = max(good)[1] if good else None
        with open(args.best, "w") as f:
            f.write(best or "{}")
        print("best:", best, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
