"""GPU session script for the DoubleSparse kernels: correctness on CUDA, then timings vs torch SDPA.

Run on a CUDA machine from the repository root (nothing to install; the package is imported from the
tree):

    python benchmarks/gpu_doublesparse.py --out DIR [--quick]

1. **Check**: the Triton label-score kernel (fp16 / 4-bit / 2-bit labels), top-k selection and the
   gather-attention kernel against the PyTorch references (kernels/doublesparse/reference.py) on
   CUDA, at Llama-like and odd shapes: max errors, identical top-k sets (fp32 scores), -inf rows.
2. **Time** (CUDA graphs, cold L2 via rotating buffers, CUDA events; kvcompress.kernels.benchutil):
   Llama-like heads (32 q / 8 kv, d 128; ``--model smollm2-135m``: 9 / 3, d 64), B in {1, 4, 16},
   ctx in {4k, 16k, 32k}, sparsity 1/8 and 1/16 (k = ctx/8, ctx/16 tokens per query head), r = 16 label channels (fp16 and 4-bit):
   ``select`` (the fused score + top-k kernel on channel-major labels), ``score`` + ``topk`` (the
   two-step path: Triton scores, torch.topk), ``gather`` (attention over the selected tokens),
   ``ds`` (fused select + gather: one sparse decode read as the plugin runs it), the two-step sum
   and ``sdpa`` (best backend on the full fp16 cache of ctx tokens).  Speed-up = sdpa / ds.
   Then a sweep of the select and gather launch settings (B 1 and 16, 32k, 1/16).

Writes DIR/doublesparse_check.json and DIR/doublesparse_bench_MODEL.json and prints Markdown tables.
Takes about 1-2 minutes on an H200 (``--quick``: B 1 and 16 at 32k only; ``--sweep`` adds the
launch-setting sweep that chose the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _imports():
    try:
        from kvcompress.kernels import benchutil
        from kvcompress.kernels.doublesparse import reference, triton_kernel
    except ImportError:  # run from a tree that is not pip-installed: map the folders by hand
        import importlib.util

        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        import kvcompress

        for sub, folder in (("plugins", "plugins"), ("kernels", "kernels")):
            spec = importlib.util.spec_from_file_location(f"kvcompress.{sub}", os.path.join(root, folder, "__init__.py"),
                                                          submodule_search_locations=[os.path.join(root, folder)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"kvcompress.{sub}"] = mod
            spec.loader.exec_module(mod)
            setattr(kvcompress, sub, mod)
        from kvcompress.kernels import benchutil
        from kvcompress.kernels.doublesparse import reference, triton_kernel
    return benchutil, reference, triton_kernel


def check(device: str) -> list[dict]:
    _, ref, tk = _imports()
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for (b, hkv, g, t, d, r, bits) in [(2, 8, 4, 4096, 128, 16, 16), (1, 8, 4, 8193, 128, 16, 4),
                                       (3, 3, 3, 1000, 64, 16, 2), (1, 2, 1, 77, 64, 32, 4)]:
        keys = torch.randn(b, hkv, t, d, device=device, generator=gen, dtype=torch.float16)
        q = torch.randn(b, hkv * g, d, device=device, generator=gen, dtype=torch.float16)
        ch = torch.stack([torch.randperm(d, device=device, generator=gen)[:r] for _ in range(hkv)])
        labels = ref.quantize_labels(keys.gather(-1, ch.view(1, hkv, 1, r).expand(b, hkv, t, r)), bits)
        valid = torch.rand(b, t, device=device, generator=gen) > 0.1
        s = tk.label_scores(q, labels, ch, valid)
        s_ref = ref.label_scores(q, labels, ch, valid)
        fin = torch.isfinite(s_ref)
        kk = max(1, t // 16)
        same = torch.equal(tk.select_topk(q, labels, ch, valid, kk).sort(-1).values,
                           torch.topk(s_ref, kk, -1, sorted=False).indices.sort(-1).values)
        rows.append({"op": "score+topk", "shape": [b, hkv, g, t, d, r], "bits": bits,
                     "max_abs_err": float((s[fin] - s_ref[fin]).abs().max()),
                     "rel_err": float((s[fin] - s_ref[fin]).norm() / s_ref[fin].norm()),
                     "same_inf": bool(torch.equal(s.isfinite(), fin)), "topk_same_sets": bool(same)})
    for (b, hkv, m, t, d, kk) in [(1, 8, 4, 32768, 128, 2048), (16, 8, 4, 4096, 128, 256), (2, 3, 3, 999, 64, 61)]:
        k = torch.randn(b, hkv, t, d, device=device, generator=gen, dtype=torch.float16)
        v = torch.randn(b, hkv, t, d, device=device, generator=gen, dtype=torch.float16)
        q = torch.randn(b, hkv, m, d, device=device, generator=gen, dtype=torch.float16)
        idx = torch.rand(b, hkv, m, t, device=device, generator=gen).topk(kk, -1).indices
        valid = torch.rand(b, t, device=device, generator=gen) > 0.1
        valid[0] = False if b > 1 else valid[0]
        out, lse = tk.gather_partial_attention(q, k, v, valid, idx, d ** -0.5)
        r_out, r_lse = ref.gather_partial_attention(q.double(), k.double(), v.double(), valid, idx, d ** -0.5)
        fin = torch.isfinite(r_lse)
        rows.append({"op": "gather", "shape": [b, hkv, m, t, d, kk],
                     "max_abs_err": float((out.double() - r_out).abs().max()),
                     "rel_err": float((out.double() - r_out).norm() / r_out.norm()),
                     "lse_err": float((lse.double()[fin] - r_lse[fin]).abs().max()) if bool(fin.any()) else 0.0,
                     "same_inf": bool(torch.equal(lse.isfinite(), fin))})
    return rows


def check_fused(device: str) -> list[dict]:
    """The fused select kernel on channel-major labels against exact scores (fp64 reference), large shapes."""
    _, ref, tk = _imports()
    from kvcompress.kernels.doublesparse.bench import ds_inputs

    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for (b, hq, hkv, t, d, r, bits, kk) in [(1, 32, 8, 32768, 128, 16, 16, 2048), (2, 32, 8, 20000, 128, 16, 4, 1250),
                                            (3, 9, 3, 4097, 64, 16, 2, 256), (1, 4, 4, 32768, 64, 64, 16, 32768)]:
        q, lab, ch, _, _ = ds_inputs(b, hq, hkv, t, d, r, bits, device, gen)
        valid = torch.rand(b, t, device=device, generator=gen) > 0.05
        idx = tk.select_topk(q, lab, ch, valid, kk)
        s_ref = ref.label_scores(q.double(), ref.Labels(lab.data, lab.bits, lab.scale, lab.zero), ch, valid).float()
        tol = 1e-3 * max(1.0, float(s_ref[s_ref.isfinite()].abs().max()))
        rows.append({"op": "fused-select", "shape": [b, hq, hkv, t, d, r], "bits": bits, "k": kk,
                     "fused": bool(tk.supports_fused(q, lab, ch, kk)), "topk_ok": ref.is_topk(idx, s_ref, kk, tol),
                     "same_inf": True, "rel_err": 0.0})
    return rows


HEADS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # query heads, kv heads, head dim


def bench(device: str, quick: bool, sweep: bool = False, model: str = "llama3-8b") -> list[dict]:
    benchutil, ref, tk = _imports()
    from kvcompress.kernels.doublesparse.bench import ds_decode, ds_inputs, ds_read_bytes

    dev = torch.device(device)
    hq, hkv, d = HEADS[model]
    r = 16
    g = hq // hkv
    scale = d ** -0.5
    cases = [(1, 32768), (16, 32768)] if quick else [(b, c) for b in (1, 4, 16) for c in (4096, 16384, 32768)]
    rows = []
    for b, ctx in cases:
        gen = torch.Generator(device=dev).manual_seed(b * 31 + ctx)
        kv_bytes = 2 * b * hkv * ctx * d * 2
        free = torch.cuda.mem_get_info(dev)[0] * 0.6
        n = max(1, min(benchutil.copies_for(kv_bytes), int(free // (kv_bytes * 1.3))))
        row0 = {"model": model, "batch": b, "ctx": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "r": r}
        base = None
        for bits in (16, 4):
            data = [ds_inputs(b, hq, hkv, ctx, d, r, bits, dev, gen) for _ in range(n)]
            tmajor = [(q, ref.Labels(lab.data.contiguous(), lab.bits, lab.scale, lab.zero), ch)
                      for q, lab, ch, _, _ in data]  # the two-step path's layout
            if bits == 16:  # SDPA on the same full fp16 caches
                best = None
                for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        t = benchutil.time_op(benchutil._sdpa_fn(be), [(q.view(b, hkv, g, d), k, v)
                                                                       for q, _, _, k, v in data], reps=20)
                    except RuntimeError:
                        continue
                    if best is None or t.seconds < best[1].seconds:
                        best = (be, t)
                if best:
                    base = best[1].seconds
                    rows.append({**row0, "op": "sdpa", "backend": best[0], "latency_us": best[1].us,
                                 "method": best[1].method, "bytes": kv_bytes})
            for frac in (8, 16):
                kk = ctx // frac
                q0, lab0, ch0, k0, _ = data[0]
                idx = tk.select_topk(q0, lab0, ch0, None, kk).view(b, hkv, g, kk)
                scores = tk.label_scores(q0, lab0, ch0, None)
                timings = {
                    "select": benchutil.time_op(lambda q, lab, ch, k, v: tk.select_topk(q, lab, ch, None, kk), data,
                                                reps=20),
                    "score": benchutil.time_op(lambda q, lab, ch: tk.label_scores(q, lab, ch, None), tmajor, reps=20),
                    "topk": benchutil.time_op(lambda s: torch.topk(s, kk, -1, sorted=False), [(scores,)], reps=20),
                    "gather": benchutil.time_op(lambda q, lab, ch, k, v: tk.gather_partial_attention(
                        q.view(b, hkv, g, d), k, v, None, idx, scale), data, reps=20),
                    "ds": benchutil.time_op(lambda q, lab, ch, k, v: ds_decode(q, lab, ch, k, v, kk, scale), data,
                                            reps=20),
                    "select-shared": benchutil.time_op(lambda q, lab, ch, k, v: tk.select_topk(
                        q, lab, ch, None, kk, group=g), data, reps=20),  # the group sum inside, as the plugin
                    "gather-shared": benchutil.time_op(lambda q, lab, ch, k, v: tk.gather_partial_attention(
                        q.view(b, hkv, g, d), k, v, None, idx[:, :, :1].expand(b, hkv, g, kk), scale), data, reps=20),
                    "ds-shared": benchutil.time_op(lambda q, lab, ch, k, v: ds_decode(q, lab, ch, k, v, kk, scale,
                                                                                      shared=True), data, reps=20),
                }
                for op, t in timings.items():
                    rows.append({**row0, "op": op, "label_bits": bits, "sparsity": f"1/{frac}", "k": kk,
                                 "latency_us": t.us, "method": t.method, "copies": t.calls,
                                 "speedup_vs_sdpa": base / t.seconds if base and op.startswith("ds") else None,
                                 "bytes": ds_read_bytes(q0, lab0, k0, kk, shared=op == "ds-shared")
                                 if op.startswith("ds") else None})
                unfused = timings["score"].seconds + timings["topk"].seconds + timings["gather"].seconds
                rows.append({**row0, "op": "ds-two-step (score+topk+gather)", "label_bits": bits,
                             "sparsity": f"1/{frac}", "k": kk, "latency_us": unfused * 1e6,
                             "speedup_vs_sdpa": base / unfused if base else None})
                if sweep and bits == 16 and frac == 16 and ctx == 32768:
                    rows += _sweep(benchutil, tk, data, idx, b, hkv, g, d, kk, scale, row0)
            del data, tmajor
            torch.cuda.empty_cache()
    return rows


def _sweep(benchutil, tk, data, idx, b, hkv, g, d, kk, scale, row0) -> list[dict]:
    """Launch settings of the gather and select kernels (same inputs; the defaults are the code's)."""
    rows = []

    def trial(op, cfg, fn):  # a config that does not compile is a result too
        try:
            rows.append({**row0, "op": op, "config": cfg, "latency_us": benchutil.time_op(fn, data, reps=10).us})
        except Exception as exc:  # noqa: BLE001
            rows.append({**row0, "op": op, "config": cfg, "error": repr(exc)[:300]})

    def gather(index, cfg):
        return lambda q, lab, ch, k, v: tk.gather_partial_attention(q.view(b, hkv, g, d), k, v, None, index, scale,
                                                                    config=cfg)

    for ept in (32, 64, 128):
        for unroll in (2, 4):
            cfg = {"elems_per_thread": ept, "unroll": unroll}
            trial("sweep-select", cfg, lambda q, lab, ch, k, v, cfg=cfg: tk.select_topk(q, lab, ch, None, kk, config=cfg))
    shared_idx = idx[:, :, :1].expand(b, hkv, g, kk)
    for bk in (32, 64, 128):
        for pps in (4, 8, 16):
            for warps in (2, 4, 8):
                cfg = {"shared_block_k": bk, "shared_programs_per_sm": pps, "shared_warps": warps, "num_stages": 3}
                trial("sweep-gather-shared", cfg, gather(shared_idx, cfg))
    for bk in (64, 128):
        for pps in (4, 8, 16):
            for warps in (2, 4):
                cfg = {"block_k": bk, "programs_per_sm": pps, "num_warps": warps, "num_stages": 3}
                trial("sweep-gather", cfg, gather(idx, cfg))
    for op in ("sweep-gather", "sweep-gather-shared", "sweep-select"):
        best = min((r for r in rows if r["op"] == op and "latency_us" in r), key=lambda r: r["latency_us"],
                   default=None)
        if best:
            print("best", op, best["config"], f"{best['latency_us']:.1f} us", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B | ctx | op | label bits | sparsity | latency (µs) | vs SDPA |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["op"].startswith("sweep") or "latency_us" not in r:
            continue
        sp = r.get("speedup_vs_sdpa")
        lines.append(f"| {r['batch']} | {r['ctx'] // 1024}k | {r['op']} | {r.get('label_bits', '')} | "
                     f"{r.get('sparsity', '')} | {r['latency_us']:.1f} | {f'{sp:.2f}x' if sp else ''} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON results")
    ap.add_argument("--quick", action="store_true", help="B 1 and 16 at 32k only")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernels' launch settings (B x 32k, 1/16)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--model", choices=sorted(HEADS), default="llama3-8b", help="head shape (default llama3-8b)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import triton

    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d")}
    t0 = time.time()
    ok = True
    if not args.skip_check:
        rows = check("cuda") + check_fused("cuda")
        for r in rows:
            print(json.dumps(r))
            good = r["same_inf"] and r.get("topk_same_sets", True) and r.get("topk_ok", True) and r["rel_err"] < 2e-3
            ok &= good
        with open(os.path.join(args.out, "doublesparse_check.json"), "w") as fh:
            json.dump({"conditions": info, "rows": rows, "all_ok": ok}, fh, indent=1)
        print(f"check: {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f} s)")
    rows = bench("cuda", args.quick, args.sweep, args.model)
    with open(os.path.join(args.out, f"doublesparse_bench_{args.model}.json"), "w") as fh:
        json.dump({"conditions": info, "rows": rows}, fh, indent=1)
    print(table(rows))
    for r in rows:
        if r["op"].startswith("sweep"):
            print(r["batch"], r["op"], r["config"], f"{r['latency_us']:.1f} us" if "latency_us" in r else r["error"])
    print(f"total {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
