"""GPU session script for the KIVI kernel (v2): fp64 correctness, a config sweep, v1 before/after.

Run on a CUDA machine from the repository root (the package importable as ``kvcompress``; see
docs/results.md "KIVI decode kernel" for the exact commands used on the H200):

    python benchmarks/gpu_kivi.py --out DIR [--correctness] [--sweep] [--v1] [--shapes quick|wide]

Writes DIR/kivi_correctness.json, DIR/kivi_sweep.json and prints short tables (last lines: the best
config per bit width, as JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from kvcompress.kernels import benchutil
from kvcompress.kernels.kivi import reference as ref
from kvcompress.kernels.kivi import triton_kernel as tk


def fp64_reference(q, packed, scale):
    k, v = packed.dequantize()
    s = torch.einsum("bhmd,bhtd->bhmt", q.double(), k.double()) * scale
    s = s.masked_fill(~packed.valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    fin = torch.isfinite(lse)
    p = torch.exp(s - torch.where(fin, lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("bhmt,bhtd->bhmd", p, v.double()), lse


CASES = [  # b, h, m, dk, dv, tokens, bits, g, gv
    (2, 8, 4, 128, 128, 4096, 2, 32, 32), (2, 8, 4, 128, 128, 4096, 4, 32, 32),
    (3, 3, 3, 64, 64, 2048, 2, 32, 32), (1, 8, 4, 128, 128, 32768, 2, 32, 32),
    (2, 4, 4, 48, 128, 1024, 2, 64, 128), (2, 2, 12, 32, 64, 960, 4, 16, 8), (1, 2, 100, 128, 128, 512, 2, 128, 64),
    (2, 8, 8, 128, 128, 2048, 4, 128, 32),
]


def correctness(configs: dict[str, dict], dev: str = "cuda") -> list[dict]:
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for case in CASES:
        b, h, m, dk, dv, t, bits, g, gv = case
        k = torch.randn(b, h, t, dk, device=dev, generator=gen) * 2 + 0.5
        v = torch.randn(b, h, t, dv, device=dev, generator=gen)
        q = torch.randn(b, h, m, dk, device=dev, generator=gen).half()
        valid = torch.rand(b, t, device=dev, generator=gen) > 0.1
        valid[0, :17] = False
        packed = ref.PackedKV(bits, g, *ref.quantize_keys(k, bits, g), *ref.quantize_values(v, bits, gv), valid)
        scale = dk ** -0.5
        r_out, r_lse = fp64_reference(q, packed, scale)
        for name, cfg in configs.items():
            try:
                out = torch.full((b, h, m, dv), float("nan"), device=dev)
                o, lse = tk._forward(q, packed, scale, config=cfg)
                out.copy_(o)
                torch.cuda.synchronize()
            except Exception as exc:
                rows.append({"case": case, "config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                print(name, case, "ERROR", str(exc)[:300], flush=True)
                continue
            fin = torch.isfinite(r_lse)
            row = {
                "case": case, "config": name,
                "max_abs_err": float((out.double() - r_out).abs().max()),
                "rel_err": float((out.double() - r_out).norm() / r_out.norm()),
                "lse_max_abs_err": float((lse.double()[fin] - r_lse[fin]).abs().max()),
                "inf_match": bool(torch.equal(torch.isfinite(lse), fin)),
                "nan": bool(torch.isnan(out).any()),
            }
            rows.append(row)
            print(f"{name:12s} {str(case):44s} rel {row['rel_err']:.1e} max {row['max_abs_err']:.1e} "
                  f"lse {row['lse_max_abs_err']:.1e} inf_ok {row['inf_match']} nan {row['nan']}", flush=True)
    return rows


def v1_inputs(batch, kv_heads, tokens, head_dim, bits, group, v_group, m, device):
    """Random words in the v1 layout (keys packed along tokens): same bytes as v2's."""
    per = 32 // bits
    ng = tokens // group
    q, p = benchutil.kivi_inputs(batch, kv_heads, tokens, head_dim, bits, group, v_group, m, device)
    p.k_codes = p.k_codes.view(batch, kv_heads, ng, head_dim, group // per)
    return q, p


def sdpa_time(batch, hkv, ctx, d, m, dev):
    dense = 2 * batch * hkv * ctx * d * 2
    n = benchutil.copies_for(dense)
    data = [benchutil.dense_inputs(batch, hkv, ctx, d, m, torch.device(dev)) for _ in range(n)]
    base = {}
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        try:
            base[be] = benchutil.time_op(benchutil._sdpa_fn(be), data).us
        except RuntimeError as exc:
            base[be] = str(exc)[:80]
    del data
    torch.cuda.empty_cache()
    return min(x for x in base.values() if isinstance(x, float)), base


def sweep(configs: dict[str, dict], shapes, dev: str = "cuda", v1: bool = False) -> list[dict]:
    rows = []
    for (model, hq, hkv, d, batch, ctx, bits, gv) in shapes:
        m = hq // hkv
        scale = d ** -0.5
        sdpa, base = sdpa_time(batch, hkv, ctx, d, m, dev)
        q0, p0 = benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, gv, m, torch.device(dev))
        nbytes = benchutil.kivi_bytes(q0, p0)
        n = benchutil.copies_for(nbytes)
        data = [(q0, p0)] + [benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, gv, m, torch.device(dev))
                             for _ in range(n - 1)]
        todo = dict(configs)
        if v1:
            todo["v1"] = None
        for name, cfg in todo.items():
            t0 = time.time()
            try:
                if cfg is None:
                    # v1 lives in git history (kernels/kivi/triton_kernel.py at commit b3d01f2):
                    #   git show b3d01f2:kernels/kivi/triton_kernel.py > benchmarks/kivi_v1_kernel.py
                    sys.path.insert(0, os.path.dirname(__file__))
                    import kivi_v1_kernel as v1k

                    per = 32 // bits
                    d1 = [(q, type(p)(**{**p.__dict__, "k_codes": p.k_codes.view(batch, hkv, ctx // 32, d, 32 // per)}))
                          for q, p in data]
                    t = benchutil.time_op(lambda q, p: v1k._forward(q, p, scale), d1)
                else:
                    t = benchutil.time_op(lambda q, p: tk._forward(q, p, scale, config=cfg, splits=cfg.get("splits")),
                                          data)
            except Exception as exc:
                rows.append({"shape": [model, batch, ctx, bits, gv], "config": name, "error": str(exc)[:300]})
                print(name, "FAILED", str(exc)[:300], flush=True)
                continue
            row = {"shape": [model, batch, ctx, bits, gv], "config": name, "cfg": cfg, "us": t.us,
                   "spread": t.spread, "method": t.method, "tbps": nbytes / t.seconds / 1e12, "sdpa_us": sdpa,
                   "sdpa": base, "speedup": sdpa / t.us, "wall_s": time.time() - t0}
            rows.append(row)
            print(f"{model:13s} B={batch:3d} ctx={ctx:6d} bits={bits} {name:14s} {t.us:8.1f} us "
                  f"{row['tbps']:.2f} TB/s  sdpa {sdpa:7.1f} us  x{row['speedup']:.2f}  ({row['wall_s']:.0f}s)",
                  flush=True)
        del data
        torch.cuda.empty_cache()
    return rows


CONFIGS = {  # v2 variants (defaults in triton_kernel._config: BN 32, 2 warps, TRANS, inline-PTX dequant,
    # register prefetch of the small loads, maxnreg 128, 2 waves of ~16 resident warps per SM)
    "default": {},
    "pure": {"ASM": False},
    "noprefetch": {"PREFETCH": False},
    "nocap": {"maxnreg": 0},
    "r96": {"maxnreg": 96},
    "waves1": {"waves": 1},
    "waves4": {"waves": 4},
    "w1bn16": {"BN": 16, "num_warps": 1},
    "w1bn32": {"BN": 32, "num_warps": 1},
    "w2bn32s3": {"num_stages": 3},
    "w2bn64": {"BN": 64},
    "w4bn64": {"BN": 64, "num_warps": 4},
    "w4bn128": {"BN": 128, "num_warps": 4},
    "eager": {"LAZY": False},
    "rows16": {"min_rows": 16},
}


def pick_best(rows: list[dict]) -> dict[str, dict]:
    """Per bit width, the config with the best geometric-mean time over the swept shapes."""
    best = {}
    for bits in (2, 4):
        by = {}
        for r in rows:
            if r["shape"][3] == bits and "us" in r and r["config"] != "v1":
                by.setdefault(r["config"], []).append(r["us"])
        n = max((len(v) for v in by.values()), default=0)
        scores = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in by.items() if len(v) == n}
        if scores:
            name = min(scores, key=scores.get)
            best[str(bits)] = {"name": name, "geomean_us": scores[name], "config": CONFIGS[name]}
    return best


SHAPES = {
    "quick": [("llama3-8b", 32, 8, 128, 16, 32768, 2, 32), ("llama3-8b", 32, 8, 128, 16, 32768, 4, 32)],
    "q2": [("llama3-8b", 32, 8, 128, 16, 32768, 2, 32)],
    "q4": [("llama3-8b", 32, 8, 128, 16, 32768, 4, 32)],
    "wide": [("llama3-8b", 32, 8, 128, 16, 32768, 2, 32), ("llama3-8b", 32, 8, 128, 1, 32768, 2, 32),
             ("llama3-8b", 32, 8, 128, 64, 4096, 2, 32), ("smollm2-135m", 9, 3, 64, 16, 32768, 2, 32),
             ("llama3-8b", 32, 8, 128, 16, 32768, 4, 32), ("llama3-8b", 32, 8, 128, 1, 32768, 4, 32)],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--correctness", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--v1", action="store_true")
    ap.add_argument("--shapes", default="quick")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__, flush=True)
    if args.correctness:
        rows = correctness({k: CONFIGS[k] for k in ("default", "pure")})
        json.dump(rows, open(os.path.join(args.out, "kivi_correctness.json"), "w"), indent=1)
    if args.sweep:
        configs = {k: CONFIGS[k] for k in args.configs.split(",")}
        rows = sweep(configs, SHAPES[args.shapes], v1=args.v1)
        best = pick_best(rows)
        json.dump({"rows": rows, "best": best}, open(os.path.join(args.out, f"kivi_sweep_{args.shapes}.json"), "w"),
                  indent=1)
        print("BEST", json.dumps(best), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
