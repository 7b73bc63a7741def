"""GPU session script for the KIVI kernel: correctness vs an fp64 reference, a config sweep, the table.

Run on a CUDA machine from the repository root (after ``pip install --no-deps -e .``):

    python benchmarks/gpu_kivi.py --out DIR [--sweep] [--table] [--quick-table]

Writes DIR/correctness.json, DIR/sweep.json, DIR/kernels.json and prints short tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


def correctness(configs: dict[str, dict], dev: str = "cuda", smoke: bool = False) -> list[dict]:
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = [  # b, h, m, dk, dv, tokens, bits, g, gv
        (2, 8, 4, 128, 128, 4096, 2, 32, 32), (2, 8, 4, 128, 128, 4096, 4, 32, 32),
        (3, 3, 3, 64, 64, 2048, 2, 32, 32), (1, 8, 4, 128, 128, 32768, 2, 32, 32),
        (2, 4, 4, 48, 128, 1024, 2, 64, 128), (2, 2, 12, 32, 64, 960, 4, 16, 8), (1, 2, 100, 128, 128, 512, 2, 128, 64),
    ]
    if smoke:
        cases = [(1, 2, 4, 64, 64, 256, 2, 32, 32), (1, 1, 12, 32, 64, 96, 4, 16, 8)]
    for case in cases:
        b, h, m, dk, dv, t, bits, g, gv = case
        k = torch.randn(b, h, t, dk, device=dev, generator=gen) * 2 + 0.5
        v = torch.randn(b, h, t, dv, device=dev, generator=gen)
        q = torch.randn(b, h, m, dk, device=dev, generator=gen).half()
        valid = torch.rand(b, t, device=dev, generator=gen) > 0.1
        valid[0, :17] = False
        packed = ref.PackedKV(bits, g, *ref.quantize_keys(k, bits, g), *ref.quantize_values(v, bits, gv), valid)
        scale = dk ** -0.5
        r_out, r_lse = fp64_reference(q, packed, scale)
        f_out, f_lse = ref.kivi_attention_partial(q, packed, scale)  # the fp32 reference, for scale
        for name, cfg in configs.items():
            try:
                out, lse = tk._forward(q, packed, scale, config=cfg)
                if dev == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:
                rows.append({"case": case, "config": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            fin = torch.isfinite(r_lse)
            rows.append({
                "case": case, "config": name,
                "max_abs_err": float((out.double() - r_out).abs().max()),
                "rel_err": float((out.double() - r_out).norm() / r_out.norm()),
                "lse_max_abs_err": float((lse.double()[fin] - r_lse[fin]).abs().max()),
                "fp32_ref_rel_err": float((f_out.double() - r_out).norm() / r_out.norm()),
                "inf_match": bool(torch.equal(torch.isfinite(lse), fin)),
                "nan": bool(torch.isnan(out).any()),
            })
    return rows


def sweep(configs: dict[str, dict], shapes, dev: str = "cuda") -> list[dict]:
    rows = []
    for (model, hq, hkv, d, batch, ctx, bits, gv) in shapes:
        m = hq // hkv
        scale = d ** -0.5
        dense = 2 * batch * hkv * ctx * d * 2
        n = benchutil.copies_for(dense)
        data = [benchutil.dense_inputs(batch, hkv, ctx, d, m, torch.device(dev)) for _ in range(n)]
        base = {}
        for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION") if dev == "cuda" else (None,):
            try:
                base[be] = benchutil.time_op(benchutil._sdpa_fn(be), data).us
            except RuntimeError as exc:
                base[be] = str(exc)[:80]
        del data
        if dev == "cuda":
            torch.cuda.empty_cache()
        sdpa = min(x for x in base.values() if isinstance(x, float))
        q0, p0 = benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, gv, m, torch.device(dev))
        nbytes = benchutil.kivi_bytes(q0, p0)
        n = benchutil.copies_for(nbytes)
        data = [(q0, p0)] + [benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, gv, m, torch.device(dev))
                             for _ in range(n - 1)]
        for name, cfg in configs.items():
            try:
                t = benchutil.time_op(lambda q, p: tk._forward(q, p, scale, config=cfg, splits=cfg.get("splits")),
                                      data)
            except Exception as exc:
                rows.append({"shape": [model, batch, ctx, bits, gv], "config": name, "error": str(exc)[:300]})
                print(name, "FAILED", str(exc)[:300], flush=True)
                continue
            row = {"shape": [model, batch, ctx, bits, gv], "config": name, "us": t.us, "spread": t.spread,
                   "method": t.method, "tbps": nbytes / t.seconds / 1e12, "sdpa_us": sdpa, "sdpa": base,
                   "speedup": sdpa / t.us}
            rows.append(row)
            print(f"{model:14s} B={batch:3d} ctx={ctx:6d} bits={bits} gv={gv:3d} {name:24s} {t.us:9.1f} us "
                  f"{row['tbps']:.2f} TB/s  sdpa {sdpa:8.1f} us  x{row['speedup']:.2f}", flush=True)
        del data
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


CONFIGS = {
    "default": {},
    "no-prefetch": {"PREFETCH": False},
    "nb2": {"NB": 2},
    "waves2": {"waves": 2},
    "waves8": {"waves": 8},
    "rows8": {"min_rows": 8},
    "mma-v2": {"TRANS": False},
    "stages3": {"num_stages": 3},
}


def pick_best(rows: list[dict]) -> dict[str, dict]:
    """Per bit width, the config with the best geometric-mean time relative to ``default``."""
    import math

    best = {}
    for bits in (2, 4):
        ref = {tuple(r["shape"]): r["us"] for r in rows if r["config"] == "default" and r["shape"][3] == bits
               and "us" in r}
        scores = {}
        for name in CONFIGS:
            ratios = [r["us"] / ref[tuple(r["shape"])] for r in rows
                      if r["config"] == name and "us" in r and tuple(r["shape"]) in ref]
            if ratios and len(ratios) == len(ref):
                scores[name] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        if scores:
            name = min(scores, key=scores.get)
            best[str(bits)] = {"name": name, "score": scores[name], "config": CONFIGS[name]}
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--quick-table", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--pytest", action="store_true", help="also run pytest -m gpu tests/test_kivi_kernel.py")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton

    dev = "cpu" if args.smoke else "cuda"
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "smi": args.smoke or subprocess.run(
                ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,driver_version,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()}
    print(info, flush=True)
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    t0 = time.time()
    if args.sweep:
        shapes = [("llama3-8b", 32, 8, 128, 16, 32768, 2, 32), ("llama3-8b", 32, 8, 128, 1, 32768, 2, 32),
                  ("smollm2-135m", 9, 3, 64, 16, 32768, 2, 32), ("llama3-8b", 32, 8, 128, 16, 32768, 4, 32),
                  ("llama3-8b", 32, 8, 128, 1, 32768, 4, 32)]
        if args.smoke:
            shapes = [("tiny", 8, 2, 64, 1, 256, 2, 32), ("tiny", 8, 2, 64, 1, 256, 4, 64)]
        rows = sweep(configs, shapes, dev)
        best = pick_best(rows)
        print("best per bit width:", best, flush=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as fh:
            json.dump({"info": info, "rows": rows, "best": best}, fh, indent=1)
        os.environ["KVCOMPRESS_KIVI_CONFIG"] = json.dumps({k: v["config"] for k, v in best.items()})
        print(f"sweep done ({time.time() - t0:.0f}s); KVCOMPRESS_KIVI_CONFIG={os.environ['KVCOMPRESS_KIVI_CONFIG']}",
              flush=True)
    corr = correctness({"chosen": {}, "mma-v2": {"TRANS": False}}, dev, args.smoke)
    worst = max((r.get("rel_err", 1.0) for r in corr), default=0)
    print(f"correctness: {len(corr)} runs, worst rel err {worst:.2e}, "
          f"errors {[r for r in corr if 'error' in r or not r.get('inf_match', True) or r.get('nan')]} "
          f"({time.time() - t0:.0f}s)", flush=True)
    for r in corr:
        print("  ", r.get("case"), r.get("config"), {k: (f"{v:.2e}" if isinstance(v, float) else v)
                                                      for k, v in r.items() if k not in ("case", "config")})
    with open(os.path.join(args.out, "correctness.json"), "w") as fh:
        json.dump({"info": info, "config": os.environ.get("KVCOMPRESS_KIVI_CONFIG"), "rows": corr}, fh, indent=1)
    if args.pytest:
        # from another directory, so that ./kvcompress (without kernels/) does not shadow the installed package
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", os.path.abspath("tests/test_kivi_kernel.py")],
                           capture_output=True, text=True, cwd="/tmp")
        print("pytest -m gpu:", r.stdout.strip().splitlines()[-1:], flush=True)
    if args.table or args.quick_table:
        benchutil.run_kernel_benchmarks(dev, os.path.join(args.out, "kernels.json"), quick=args.quick_table)
        print(f"table done ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
