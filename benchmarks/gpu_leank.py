"""GPU session script for the LeanK grouped decode kernels: a config sweep against torch SDPA.

Run on a CUDA machine from the repository root (the package importable as ``kvcompress``):

    python benchmarks/gpu_leank.py --out DIR [--sweep] [--tilelang] [--shapes quick|wide]

Each shape: Llama-like heads (32 q / 8 kv, d 128), ``ctx`` total tokens = 1024 full-precision
(sinks + local window, all channels) + ``ctx - 1024`` middle tokens pruned to the kept-channel mix of
``benchutil.LEANK_COUNTS`` (50 % / 70 %; one count-0 head without middle K and V).  SDPA reads the
uncompressed fp16 cache of the same total length.  Writes DIR/leank_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from kvcompress.kernels import benchutil
from kvcompress.kernels.leank import reference
from kvcompress.kernels.leank import triton_kernel as tk

CONFIGS = {  # defaults in triton_kernel._config
    "default": {},
    "s2": {"num_stages": 2},
    "s3": {"num_stages": 3},
    "s5": {"num_stages": 5},
    "w2": {"waves": 2},
    "w8": {"waves": 8},
    "bn32s6": {"BN": 32, "num_stages": 6},
    "bn128": {"BN": 128},
    "bn128w8": {"BN": 128, "num_warps": 8},
    "bn128w8s3": {"BN": 128, "num_warps": 8, "num_stages": 3},
}

SHAPES = {
    "quick": [(16, 32768, 70), (16, 32768, 50)],
    "q70": [(16, 32768, 70)],
    "q50": [(16, 32768, 50)],
    "wide": [(16, 32768, 70), (16, 32768, 50), (16, 9216, 70), (1, 32768, 70), (64, 9216, 70)],
}


def check(q, lanes, scale, fn) -> dict:
    out, lse = fn(q, lanes, scale)
    r_out, r_lse = reference.grouped_partial_attention(q, lanes, scale)
    fin = torch.isfinite(r_lse)
    return {"rel_err": float((out.double() - r_out.double()).norm() / r_out.double().norm()),
            "max_abs_err": float((out.double() - r_out.double()).abs().max()),
            "lse_err": float((lse[fin] - r_lse[fin]).abs().max()), "inf_match": bool(torch.equal(lse.isfinite(), fin))}


def tilelang_fn():
    from kvcompress.kernels.leank import tilelang_kernel

    return tilelang_kernel.grouped_partial_attention


def sweep(configs, shapes, with_tilelang=False, dev="cuda") -> list[dict]:
    rows = []
    hq, hkv, d = 32, 8, 128
    m = hq // hkv
    scale = d ** -0.5
    for batch, ctx, ratio in shapes:
        from gpu_kivi import sdpa_time

        sdpa, base = sdpa_time(batch, hkv, ctx, d, m, dev)
        middle = ctx - benchutil.LEANK_FP_TOKENS
        q0, l0 = benchutil.leank_inputs(batch, hkv, middle, d, m, ratio, torch.device(dev))
        nbytes = benchutil.leank_bytes(q0, l0)
        dense = 2 * batch * hkv * ctx * d * 2
        n = benchutil.copies_for(nbytes)
        data = [(q0, l0)] + [benchutil.leank_inputs(batch, hkv, middle, d, m, ratio, torch.device(dev))
                             for _ in range(n - 1)]
        todo = {name: (lambda cfg: (lambda q, lanes, s: tk.grouped_partial_attention(q, lanes, s, config=cfg)))(cfg)
                for name, cfg in configs.items()}
        if with_tilelang:
            try:
                todo["tilelang"] = tilelang_fn()
            except Exception as exc:  # reported, the rest goes on
                print("tilelang import failed:", type(exc).__name__, str(exc)[:300], flush=True)
        for name, fn in todo.items():
            t0 = time.time()
            try:
                small = [(q[:, :, :, :], lanes) for q, lanes in data[:1]]
                err = check(*small[0], scale, fn) if batch * ctx <= 16 * 32768 else {}
                t = benchutil.time_op(lambda q, lanes: fn(q, lanes, scale), data)
            except Exception as exc:
                rows.append({"shape": [batch, ctx, ratio], "config": name, "error": str(exc)[:400]})
                print(name, "FAILED", type(exc).__name__, str(exc)[:400], flush=True)
                continue
            row = {"shape": [batch, ctx, ratio], "config": name, "us": t.us, "spread": t.spread, "method": t.method,
                   "bytes": nbytes, "dense_bytes": dense, "tbps": nbytes / t.seconds / 1e12, "sdpa_us": sdpa,
                   "sdpa": base, "speedup": sdpa / t.us, "byte_ceiling": dense / nbytes, **err,
                   "wall_s": time.time() - t0}
            rows.append(row)
            print(f"B={batch:3d} ctx={ctx:6d} {ratio}% {name:10s} {t.us:8.1f} us {row['tbps']:.2f} TB/s "
                  f"sdpa {sdpa:7.1f} us x{row['speedup']:.2f} (bytes x{row['byte_ceiling']:.2f}) "
                  f"err {err.get('rel_err', float('nan')):.1e} ({row['wall_s']:.0f}s)", flush=True)
        del data
        torch.cuda.empty_cache()
    return rows


def pick_best(rows):
    by = {}
    for r in rows:
        if "us" in r and r["config"] in CONFIGS:
            by.setdefault(r["config"], []).append(r["us"])
    n = max((len(v) for v in by.values()), default=0)
    scores = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in by.items() if len(v) == n}
    name = min(scores, key=scores.get) if scores else "default"
    return {"name": name, "config": CONFIGS[name], "geomean_us": scores.get(name)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tilelang", action="store_true")
    ap.add_argument("--shapes", default="quick")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    rows = sweep(configs, SHAPES[args.shapes], with_tilelang=args.tilelang)
    best = pick_best(rows)
    json.dump({"rows": rows, "best": best}, open(os.path.join(args.out, f"leank_sweep_{args.shapes}.json"), "w"),
              indent=1)
    print("BEST", json.dumps(best), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
