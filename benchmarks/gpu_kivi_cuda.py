"""GPU session script for the hand-written CUDA KIVI kernel (v3, kernels/kivi/cuda_kernel.cu).

One self-contained run on a CUDA machine, from the repository root (the package importable as
``kvcompress``, e.g. assembled under /tmp/site as benchmarks/gpu_session.sh does; if it is not importable
this script assembles /tmp/site itself):

    PYTHONPATH=/tmp/site python benchmarks/gpu_kivi_cuda.py --out $OUT

Stages (each in try/except: a failure prints its traceback and the next stage runs):
  1. build the v3 libraries with nvcc (every (bits, Dk, Dv) x register cap 1 / 4 (default) / 5, and the
     key-scale-fold / value-fold builds (kfold, vfold) in (1, 0) (2, 0) (0, 1) (1, 1) (2, 1) at cap 4, in parallel),
  2. correctness against a float64 evaluation of the reference on 8 shapes x 15 configs (the default, the
     configs / builds that failed to launch in the first H200 run, the largest shared-memory request, the
     variants timed below, the key-scale-fold / value-fold builds) and one check that the dispatcher
     (kernels.kivi.kivi_attention_partial) takes v3,
  3. timing: the v3 default and variants vs the Triton v2 kernel vs SDPA (best of cuDNN / FlashAttention on
     the fp16 cache), CUDA graphs over >= 400 MB of rotating inputs (cold L2), median of 20 replays
     (kvcompress.kernels.benchutil.time_op), Llama B in {1, 16, 64} x ctx {4k, 32k} and SmolLM B in {1, 16}
     x 32k, bits 2 and 4,
  4. ``pytest -m gpu tests/test_kivi_cuda.py tests/test_kivi_kernel.py``.
Writes $OUT/kivi_cuda.json, prints a Markdown table and ends with the line ``correctness N/N ok``.  A time
budget (--budget, default 120 s) skips the remaining timing variants when it runs out (the whole run must stay
under 3 minutes; the first run took 37 s, the second 52 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def ensure_package() -> None:
    """Make ``kvcompress.kernels`` importable (the repo's package-dir mapping needs an install or /tmp/site)."""
    try:
        if importlib.util.find_spec("kvcompress.kernels.kivi.cuda_kernel") is not None:
            return
    except ModuleNotFoundError:
        pass
    site = "/tmp/site"
    os.makedirs(site, exist_ok=True)
    shutil.rmtree(os.path.join(site, "kvcompress"), ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "kvcompress"), os.path.join(site, "kvcompress"))
    os.symlink(os.path.join(ROOT, "kernels"), os.path.join(site, "kvcompress", "kernels"))
    os.symlink(os.path.join(ROOT, "plugins"), os.path.join(site, "kvcompress", "plugins"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    for name in [n for n in sys.modules if n == "kvcompress" or n.startswith("kvcompress.")]:
        del sys.modules[name]
    log("assembled", site)


ensure_package()

import torch  # noqa: E402

from kvcompress.kernels import benchutil  # noqa: E402
from kvcompress.kernels.kivi import cuda_kernel as ck  # noqa: E402
from kvcompress.kernels.kivi import reference as ref  # noqa: E402

# v3 launch variants (cuda_kernel.DEFAULT_CONFIG overridden); min_blocks is the build's register cap
# (__launch_bounds__(128, min_blocks): 4 -> <= 128 registers (default, 123 used at 2 bits, Dk = Dv = 128), 5 -> <= 102
# (96 used, no spills at 2 bits), 1 -> uncapped (150)); warps_per_sm tells the split count how many warps are resident
VARIANTS = {
    "v3": {},
    "v3-old": {"stages": 3, "waves": 2.0, "min_tiles": 4},  # the first run's default
    "v3-st3": {"stages": 3},
    "v3-st4": {"stages": 4},
    "v3-nw2": {"nw": 2},
    "v3-r5": {"min_blocks": 5, "warps_per_sm": 20},  # 5 CTAs (20 warps) per SM instead of 4
    "v3-r5-st3": {"min_blocks": 5, "warps_per_sm": 20, "stages": 3},
    "v3-r5-w2": {"min_blocks": 5, "warps_per_sm": 20, "waves": 2.0},
    "v3-r1": {"min_blocks": 1},
    "v3-mt2": {"min_tiles": 2},
    "v3-mt8": {"min_tiles": 8},
    "v3-waves2": {"waves": 2.0},
    # key-scale fold / value fold (cuda_kernel.py docstring, "Key-scale fold", "Value fold"); SASS per tile at 2 bits,
    # Dk = Dv = 128: default 733, kf1 706, kf2 722, vf 718, kf2-vf 687, kf1-vf 671
    "v3-kf1": {"kfold": 1},
    "v3-kf2": {"kfold": 2},
    "v3-vf": {"vfold": 1},
    "v3-kf1-vf": {"kfold": 1, "vfold": 1},
    "v3-kf2-vf": {"kfold": 2, "vfold": 1},
    "v3-kf1-vf-r1": {"kfold": 1, "vfold": 1, "min_blocks": 1},
}
QUICK = ["v3", "v3-old", "v3-r5", "v3-kf1", "v3-kf2", "v3-vf", "v3-kf1-vf", "v3-kf2-vf"]  # kept at the biggest shapes

CORRECTNESS = [  # b, h, m, dk, dv, tokens, bits, g, gv
    (2, 8, 4, 128, 128, 4096, 2, 32, 32), (2, 8, 4, 128, 128, 4096, 4, 32, 32),
    (3, 3, 3, 64, 64, 2048, 2, 32, 32), (1, 8, 4, 128, 128, 32768, 2, 32, 32),
    (2, 4, 4, 64, 128, 1024, 2, 64, 16), (2, 2, 12, 128, 64, 960, 4, 32, 32), (1, 2, 40, 128, 128, 512, 2, 128, 64),
    (2, 8, 8, 128, 128, 2048, 4, 128, 32),
]

SHAPES = [  # model, q heads, kv heads, head dim, batch, ctx
    ("llama3-8b", 32, 8, 128, 1, 4096), ("llama3-8b", 32, 8, 128, 1, 32768),
    ("llama3-8b", 32, 8, 128, 16, 4096), ("llama3-8b", 32, 8, 128, 16, 32768),
    ("llama3-8b", 32, 8, 128, 64, 4096), ("llama3-8b", 32, 8, 128, 64, 32768),
    ("smollm2-135m", 9, 3, 64, 1, 32768), ("smollm2-135m", 9, 3, 64, 16, 32768),
]


def stage(name, fn, *a, **k):
    log(f"=== {name}")
    try:
        return fn(*a, **k)
    except Exception:  # keep going: one failing stage must not lose the others
        traceback.print_exc()
        sys.stdout.flush()
        return None


def build_all() -> dict:
    dims = [(bits, dk, dv) for bits in (2, 4) for dk in (64, 128) for dv in (64, 128)]
    folds = [(1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    keys = sorted([(*d, mb) for d in dims for mb in (1, 4, 5)] + [(*d, 4, kf, vf) for d in dims for kf, vf in folds]
                  + [(b, d, d, 1, 1, 1) for b in (2, 4) for d in (64, 128)])  # v3-kf1-vf-r1 at the timed shapes
    res = subprocess.run([ck.nvcc_path() or "nvcc", "--version"], capture_output=True, text=True)
    log("nvcc:", res.stdout.strip().splitlines()[-1] if res.stdout else res.stderr[-200:])
    t0 = time.time()
    out = {}

    def one(key):
        t = time.time()
        try:
            ck.build(*key)
            return key, time.time() - t, None
        except Exception as exc:  # noqa: BLE001
            return key, time.time() - t, f"{type(exc).__name__}: {exc}"[-3000:]

    with ThreadPoolExecutor(max_workers=min(len(keys), os.cpu_count() or 4)) as pool:
        for key, sec, err in pool.map(one, keys):
            out[str(key)] = {"seconds": sec, "error": err}
            log(f"build {key}: {sec:.1f}s" + (f" ERROR {err}" if err else ""))
    log(f"build total {time.time() - t0:.1f}s (wall, {len(keys)} libraries in parallel)")
    return out


def correctness() -> list[dict]:
    rows = []
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    configs = {"v3": ({}, None), "v3-nw1-st2": ({"nw": 1, "stages": 2}, None),  # default: 4 warps, 2 stages
               "v3-nw2-st4-5splits": ({"nw": 2, "stages": 4}, 5), "v3-r1-st3": ({"min_blocks": 1, "stages": 3}, None),
               "v3-nw4-st3-7splits": ({"nw": 4, "stages": 3}, 7),  # the failed test_configs_and_splits_on_gpu[cfg2-7]
               "v3-nw4-st4-3splits": ({"nw": 4, "stages": 4}, 3),  # the largest shared-memory request (94720 B)
               "v3-r5": (VARIANTS["v3-r5"], None), "v3-r5-st3": (VARIANTS["v3-r5-st3"], None),
               "v3-old": (VARIANTS["v3-old"], None),
               "v3-kf1": (VARIANTS["v3-kf1"], None), "v3-kf2": (VARIANTS["v3-kf2"], None),
               "v3-vf": (VARIANTS["v3-vf"], None), "v3-kf1-vf": (VARIANTS["v3-kf1-vf"], None),
               "v3-kf2-vf": (VARIANTS["v3-kf2-vf"], None),
               "v3-kf1-vf-nw2-st4-5splits": ({"kfold": 1, "vfold": 1, "nw": 2, "stages": 4}, 5)}
    from gpu_kivi import fp64_reference  # the v2 session script's reference (imports kvcompress: after ensure_package)

    from kvcompress.kernels import kivi
    for case in CORRECTNESS:
        b, h, m, dk, dv, t, bits, g, gv = case
        k = torch.randn(b, h, t, dk, device=dev, generator=gen) * 2 + 0.5
        v = torch.randn(b, h, t, dv, device=dev, generator=gen)
        q = torch.randn(b, h, m, dk, device=dev, generator=gen).half()
        valid = torch.rand(b, t, device=dev, generator=gen) > 0.1
        valid[0, :17] = False
        if b > 1:
            valid[1] = False  # an all-invalid row
        packed = ref.PackedKV(bits, g, *ref.quantize_keys(k, bits, g), *ref.quantize_values(v, bits, gv), valid)
        scale = dk ** -0.5
        r_out, r_lse = fp64_reference(q, packed, scale)
        fin = torch.isfinite(r_lse)
        for name, (cfg, splits) in configs.items():
            try:
                assert ck.supports(q, packed), ck._problem(q, packed)
                out, lse = ck._forward(q, packed, scale, cfg=cfg, splits=splits)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                rows.append({"case": case, "config": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
                log(name, case, "ERROR", str(exc)[:500])
                continue
            row = {"case": case, "config": name,
                   "max_abs_err": float((out.double() - r_out).abs().max()),
                   "rel_err": float((out.double() - r_out).norm() / r_out.norm()),
                   "lse_max_abs_err": float((lse.double()[fin] - r_lse[fin]).abs().max()) if fin.any() else 0.0,
                   "inf_match": bool(torch.equal(torch.isfinite(lse), fin)),
                   "dead_rows_zero": bool((out[~fin] == 0).all()),
                   "nan": bool(torch.isnan(out).any() or torch.isnan(lse).any())}
            row["ok"] = (row["max_abs_err"] < 3e-3 + 1e-2 * float(r_out.abs().max()) and row["lse_max_abs_err"] < 2e-3
                         and row["inf_match"] and row["dead_rows_zero"] and not row["nan"])
            if name == "v3":  # the dispatcher's default path on CUDA is v3 (bit-identical to the direct call)
                dout, dlse = kivi.kivi_attention_partial(q, packed, scale)
                row["dispatch_is_v3"] = bool(torch.equal(dout, out) and torch.equal(dlse, lse))
                row["ok"] = row["ok"] and row["dispatch_is_v3"]
            rows.append(row)
            log(f"{name:20s} {str(case):44s} rel {row['rel_err']:.1e} max {row['max_abs_err']:.1e} "
                f"lse {row['lse_max_abs_err']:.1e} inf_ok {row['inf_match']} nan {row['nan']} "
                f"{'OK' if row['ok'] else 'FAIL'}")
    return rows


def timing(budget_s: float, results: dict) -> list[dict]:
    from gpu_kivi import sdpa_time  # best of cuDNN / FlashAttention on the fp16 cache, as for v2

    from kvcompress.kernels.kivi import triton_kernel as tk

    rows = results.setdefault("timing", [])
    for model, hq, hkv, d, batch, ctx in SHAPES:
        m = hq // hkv
        scale = d ** -0.5
        try:
            sdpa, base = sdpa_time(batch, hkv, ctx, d, m, "cuda")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            sdpa, base = float("nan"), {}
        log(f"{model} B={batch} ctx={ctx}: SDPA {sdpa:.1f} us {base}")
        for bits in (2, 4):
            try:
                q0, p0 = benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, 32, m, torch.device("cuda"))
                nbytes = benchutil.kivi_bytes(q0, p0)
                n = benchutil.copies_for(nbytes)
                data = [(q0, p0)] + [benchutil.kivi_inputs(batch, hkv, ctx, d, bits, 32, 32, m, torch.device("cuda"))
                                     for _ in range(n - 1)]
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            try:  # v3 against v2 on the timed inputs themselves (large shapes: offsets, split counts, combine)
                o2, l2 = tk._forward(q0, p0, scale)
                o3, l3 = ck._forward(q0, p0, scale)
                agree = {"model": model, "batch": batch, "ctx": ctx, "bits": bits,
                         "max_abs_out_v3_vs_v2": float((o3 - o2).abs().max()),
                         "max_abs_lse_v3_vs_v2": float((l3 - l2).abs().max()),
                         "nan": bool(torch.isnan(o3).any() or torch.isnan(l3).any())}
                results.setdefault("agreement", []).append(agree)
                log(f"  v3 vs v2 on the timed inputs: max |out| diff {agree['max_abs_out_v3_vs_v2']:.1e}, "
                    f"max |lse| diff {agree['max_abs_lse_v3_vs_v2']:.1e}, nan {agree['nan']}")
                del o2, l2, o3, l3
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            names = ["v2-triton"] + (QUICK if batch * ctx >= 64 * 32768 else list(VARIANTS))
            for name in names:
                if time.time() - T0 > budget_s and name not in ("v2-triton", "v3"):
                    log("time budget spent: skipping", name)
                    continue
                try:
                    if name == "v2-triton":
                        fn = lambda q, p: tk._forward(q, p, scale)  # noqa: E731
                    else:
                        cfg = VARIANTS[name]
                        fn = lambda q, p, cfg=cfg: ck._forward(q, p, scale, cfg=cfg)  # noqa: E731
                    t = benchutil.time_op(fn, data)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    rows.append({"model": model, "batch": batch, "ctx": ctx, "bits": bits, "impl": name,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                row = {"model": model, "batch": batch, "ctx": ctx, "bits": bits, "impl": name,
                       "cfg": VARIANTS.get(name), "us": t.us, "spread": t.spread, "method": t.method, "calls": t.calls,
                       "bytes": nbytes, "tbps": nbytes / t.seconds / 1e12, "sdpa_us": sdpa, "sdpa": base,
                       "speedup_vs_sdpa": sdpa / t.us}
                rows.append(row)
                log(f"  {model:13s} B={batch:3d} ctx={ctx:6d} bits={bits} {name:10s} {t.us:9.1f} us "
                    f"{row['tbps']:.2f} TB/s  x{row['speedup_vs_sdpa']:.2f} vs SDPA  ({t.method}, {t.calls} copies)")
            del data, q0, p0
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | B | ctx | bits | SDPA µs | v2 Triton µs (x SDPA) | v3 first-run default µs (x SDPA) | "
           "v3 default µs (x SDPA, TB/s) | v3-kf1 µs (x SDPA) | v3-kf2-vf µs (x SDPA) | v3-kf1-vf µs (x SDPA) | "
           "best v3 | best v3 µs (x SDPA) | v3 / v2 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        k = (r["model"], r["batch"], r["ctx"], r["bits"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in rows if (r["model"], r["batch"], r["ctx"], r["bits"]) == k and "us" in r]
        by = {r["impl"]: r for r in rs}
        v3s = [r for r in rs if r["impl"].startswith("v3")]
        if not rs:
            continue
        sdpa = rs[0]["sdpa_us"]
        v2 = by.get("v2-triton")
        d = by.get("v3")
        best = min(v3s, key=lambda r: r["us"]) if v3s else None

        def f(r):
            return "-" if r is None else f"{r['us']:.1f} ({sdpa / r['us']:.2f}x)"

        dflt = "-" if d is None else "%.1f (%.2fx, %.2f)" % (d["us"], sdpa / d["us"], d["tbps"])
        bname = "-" if best is None else best["impl"]
        ratio = "-" if best is None or v2 is None else "%.2fx" % (v2["us"] / best["us"])
        out.append(f"| {k[0]} | {k[1]} | {k[2] // 1024}k | {k[3]} | {sdpa:.1f} | {f(v2)} | {f(by.get('v3-old'))} | "
                   f"{dflt} | {f(by.get('v3-kf1'))} | {f(by.get('v3-kf2-vf'))} | {f(by.get('v3-kf1-vf'))} | {bname} | "
                   f"{f(best)} | {ratio} |")
    return "\n".join(out)


def gpu_tests() -> dict:
    cwd = "/tmp/site" if os.path.isdir("/tmp/site/kvcompress") else ROOT  # the checkout's kvcompress/ has no kernels/
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", os.path.join(ROOT, "tests", "test_kivi_cuda.py"),
           os.path.join(ROOT, "tests", "test_kivi_kernel.py"), "-p", "no:cacheprovider", "--rootdir", ROOT]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=200)
    tail = (res.stdout + res.stderr)[-6000:]
    print(tail, flush=True)
    return {"returncode": res.returncode, "tail": tail}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds after which timing variants are skipped")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path = os.path.join(args.out, "kivi_cuda.json")

    def save():
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    try:
        results["device"] = torch.cuda.get_device_name()
        results["torch"] = torch.__version__
        results["triton"] = __import__("triton").__version__
        props = torch.cuda.get_device_properties(0)
        results["sms"] = props.multi_processor_count
        log(results["device"], "torch", results["torch"], "triton", results["triton"], "SMs", results["sms"])
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit",
                              "--format=csv"], capture_output=True, text=True)
        results["nvidia_smi"] = smi.stdout
        print(smi.stdout, flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    results["build"] = stage("build", build_all)
    save()
    results["correctness"] = stage("correctness (fp64 reference)", correctness)
    save()
    stage("timing", timing, args.budget, results)
    save()
    rows = results.get("timing") or []
    if rows:
        md = table(rows)
        results["table"] = md
        print("\n" + md + "\n", flush=True)
    save()
    if not args.skip_tests:
        results["pytest_gpu"] = stage("pytest -m gpu tests/test_kivi_cuda.py tests/test_kivi_kernel.py", gpu_tests)
        save()
    corr = results.get("correctness") or []
    n_ok = sum(bool(r.get("ok", False)) for r in corr)
    results["correctness_summary"] = f"{n_ok}/{len(corr)}"
    save()
    tests = results.get("pytest_gpu") or {}
    log(f"done: wrote {path}; gpu tests rc {tests.get('returncode')}; total {time.time() - T0:.0f}s")
    print(f"correctness {n_ok}/{len(corr)} ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
