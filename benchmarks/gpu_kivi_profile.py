"""Where the time of the CUDA KIVI decode kernel (v3) goes, on one large shape (Llama-3-8B heads, B = 16, 32k).

Two modes, both on a CUDA machine from the repository root (``bash benchmarks/gpu_session.sh $OUT kiviprof``
runs both and Nsight Compute):

    python benchmarks/gpu_kivi_profile.py --out $OUT --time        # probes and variants, CUDA-graph timing
    python benchmarks/gpu_kivi_profile.py --run NAME [--bits 2]    # a few launches of one variant (under ncu)

``--time`` times the default kernel against timing probes that leave one stage out (built with ``-DKIVI_PROBE``;
their results are wrong on purpose, they only measure): ``copies`` = the cp.async pipeline alone (the memory side
of this access pattern), ``nopv`` = no P.V product, ``lop3`` = dequantization as the LOP3 alone (no HSUB2 / HFMA2).
Differences between them place the time (H200.md: "time variants that leave one stage out").  Writes
``$OUT/kivi_profile.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kivi_cuda import ensure_package, log  # noqa: E402  (assembles /tmp/site when needed)

ensure_package()

import torch  # noqa: E402

from kvcompress.kernels import benchutil  # noqa: E402
from kvcompress.kernels.kivi import cuda_kernel as ck  # noqa: E402

VARIANTS = {
    "v3": {},
    "copies": {"probe": 1},
    "nopv": {"probe": 2},
    "lop3": {"probe": 3},
    "kf1-vf": {"kfold": 1, "vfold": 1},
    "st3": {"stages": 3},
    "copies-st3": {"probe": 1, "stages": 3},
    "st4": {"stages": 4},
    "copies-st4": {"probe": 1, "stages": 4},
}
SHAPES_BY_NAME = {"b16": (16, 8, 32768, 128, 4), "b64": (64, 8, 32768, 128, 4), "b1": (1, 8, 32768, 128, 4),
                  "b64-128k": (64, 8, 131072, 128, 4), "b16-128k": (16, 8, 131072, 128, 4)}  # batch, kv heads, ctx, d, GQA
SHAPES = [SHAPES_BY_NAME[n] for n in ("b16", "b64", "b1")]  # the default --time set
# The value-fold-2 variants (vfold = 2 with kf1 / kf2, stages 3 / 4, min_blocks 1 / 3) were timed with this script and
# --variants / --shapes in session 6 and reverted (docs/results.md, "Value fold 2"; docs/data/kivi_fold2_h200.json).


def prebuild(names: list[str], dk: int = 128, dv: int = 128) -> None:
    """Compile every variant's library in parallel (nvcc runs minutes when serial)."""
    from concurrent.futures import ThreadPoolExecutor

    opts = ("min_blocks", "kfold", "vfold", "probe")  # what tells two libraries apart: each is compiled once
    jobs = {}
    for bits in (2, 4):
        for name in names:
            c = {**ck.config(bits), **VARIANTS[name]}
            jobs[(bits, *(c.get(o) for o in opts))] = (bits, c)
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=12) as ex:
        list(ex.map(lambda j: ck.build_for(j[0], dk, dv, j[1]), jobs.values()))
    log(f"built {len(jobs)} libraries in {time.time() - t0:.0f} s")


def check_variants(names: list[str]) -> list[dict]:
    """Each variant against the reference on a small case (the probes are wrong on purpose and skipped)."""
    from kvcompress.kernels.kivi.reference import kivi_attention_partial

    rows = []
    for bits in (2, 4):
        q, p = benchutil.kivi_inputs(2, 4, 4096, 128, bits, 32, 32, 4, torch.device("cuda"))
        ref_o, ref_l = kivi_attention_partial(q, p, 128 ** -0.5)
        for name in names:
            if "probe" in VARIANTS[name]:
                continue
            o, lse = ck._forward(q, p, 128 ** -0.5, cfg=VARIANTS[name])
            err = (o - ref_o).abs().max().item()
            lerr = (lse - ref_l).abs().max().item()
            ok = bool(torch.allclose(o, ref_o, atol=3e-3, rtol=1e-2) and lerr <= 2e-3)
            rows.append({"bits": bits, "variant": name, "max_abs_err": err, "lse_err": lerr, "ok": ok})
            log(f"  check bits={bits} {name:12s} max|o-ref| {err:.2e} max|lse-ref| {lerr:.2e} {'ok' if ok else 'FAIL'}")
    return rows


def run_one(name: str, bits: int) -> None:
    q, p = benchutil.kivi_inputs(16, 8, 32768, 128, bits, 32, 32, 4, torch.device("cuda"))
    for _ in range(3):
        ck._forward(q, p, 128 ** -0.5, cfg=VARIANTS[name])
    torch.cuda.synchronize()


def timing(out: str, names: list[str] | None = None, shapes: list[str] | None = None) -> None:
    from gpu_kivi import sdpa_time

    rows = []
    checks = []
    variants = VARIANTS if names is None else {n: VARIANTS[n] for n in names}
    if names is not None:
        prebuild(names)
        checks = check_variants(names)
    for batch, hkv, ctx, d, m in (SHAPES if shapes is None else [SHAPES_BY_NAME[x] for x in shapes]):
        sdpa, base = sdpa_time(batch, hkv, ctx, d, m, "cuda")
        log(f"B={batch} ctx={ctx}: SDPA {sdpa:.1f} us {base}")
        for bits in (2, 4):
            q0, p0 = benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, 32, m, torch.device("cuda"))
            nbytes = benchutil.kivi_bytes(q0, p0)
            data = [(q0, p0)] + [benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, 32, m, torch.device("cuda"))
                                 for _ in range(benchutil.copies_for(nbytes) - 1)]
            for name, cfg in variants.items():
                if names is None and batch != 16 and name not in ("v3", "copies"):
                    continue
                try:
                    t = benchutil.time_op(lambda q, p, cfg=cfg: ck._forward(q, p, d ** -0.5, cfg=cfg), data)
                except Exception as exc:  # noqa: BLE001
                    log(f"  {name}: {type(exc).__name__}: {exc}")
                    continue
                row = {"batch": batch, "ctx": ctx, "bits": bits, "variant": name, "cfg": cfg, "us": t.us,
                       "spread": t.spread, "tbps": nbytes / t.seconds / 1e12, "sdpa_us": sdpa,
                       "x_sdpa": sdpa / t.us, "bytes": nbytes}
                rows.append(row)
                log(f"  B={batch:3d} bits={bits} {name:12s} {t.us:8.1f} us  {row['tbps']:.2f} TB/s  "
                    f"x{row['x_sdpa']:.2f} SDPA")
            del data, q0, p0
            torch.cuda.empty_cache()
    with open(os.path.join(out, "kivi_profile.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "device": torch.cuda.get_device_name(), "rows": rows, "checks": checks}, f, indent=1)
    print("| B | bits | variant | µs | TB/s | x SDPA |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['bits']} | {r['variant']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['x_sdpa']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--run", choices=sorted(VARIANTS))
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4))
    ap.add_argument("--variants", help="comma-separated VARIANTS names (default: all, probes at B = 16 only); "
                    "builds them in parallel and checks each against the reference first")
    ap.add_argument("--shapes", help=f"comma-separated of {sorted(SHAPES_BY_NAME)}")
    a = ap.parse_args()
    if a.run:
        run_one(a.run, a.bits)
    if a.time:
        os.makedirs(a.out, exist_ok=True)
        timing(a.out, a.variants.split(",") if a.variants else None, a.shapes.split(",") if a.shapes else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
