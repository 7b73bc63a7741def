"""Per-kernel GPU time of the DoubleSparse select (issue 19): the fused select against the radix select.

For each shape (Llama or SmolLM2 heads, fp16 channel-major labels, r = 16, k = ctx/16 per query head) runs
``triton_kernel.select_topk`` with ``config={"method": M}`` for each method under ``torch.profiler`` (warm L2, no
CUDA graph) and prints each kernel's mean time per call, so a slow select shows which launch is slow.

    python benchmarks/gpu_select_profile.py --out DIR [--shapes llama3-8b:1:32k,...] [--methods fused,radix]

``--read per-head`` / ``--read shared`` profiles the whole decode read instead (``bench.ds_decode``: the group sum
of a shared selection, the select and the gather attention, as benchutil's ``ds16`` / ``ds16-shared`` time it), so
the select's share of the read shows; ``--frac 8`` keeps ctx/8 tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import types

import torch

HEADS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama3-8b:1:32k,llama3-8b:16:32k,smollm2-135m:1:32k")
    ap.add_argument("--methods", default="fused,radix")
    ap.add_argument("--configs", default="{}", help="JSON list/object of extra radix configs (each a run)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--read", choices=("select", "per-head", "shared"), default="select",
                    help="profile the select alone, or the whole decode read")
    ap.add_argument("--frac", type=int, default=16, help="keep ctx/FRAC tokens")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    from kvcompress.kernels.doublesparse import triton_kernel as tk
    from kvcompress.kernels.doublesparse.bench import ds_decode, ds_inputs

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "select_profile.json")
    extra = json.loads(args.configs)
    extra = extra if isinstance(extra, list) else [extra]
    runs = [(m, {"method": m}) for m in args.methods.split(",")]
    runs += [(f"radix {json.dumps(c)}", {"method": "radix", "radix": c}) for c in extra if c]
    rows = []
    for spec in args.shapes.split(","):
        model, b, ctx = spec.split(":")
        b, ctx = int(b), int(ctx.rstrip("k")) * 1024
        hq, hkv, d = HEADS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, lab, ch, k, v = ds_inputs(b, hq, hkv, ctx, d, 16, 16, "cuda", gen)
        kk = ctx // args.frac
        for name, cfg in runs:
            if args.read == "select":
                def call():
                    tk.select_topk(q, lab, ch, None, kk, config=cfg)
            else:
                ops = types.SimpleNamespace(select_topk=functools.partial(tk.select_topk, config=cfg),
                                            gather_partial_attention=tk.gather_partial_attention)

                def call():
                    ds_decode(q, lab, ch, k, v, kk, d ** -0.5, ops=ops, shared=args.read == "shared")
            try:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.reps):
                        call()
                    torch.cuda.synchronize()
                kernels = {}
                for ev in prof.key_averages():
                    if ev.device_type.name == "CUDA" and ev.count:
                        kernels[ev.key] = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / args.reps
                total = sum(kernels.values())
                rows.append({"shape": spec, "method": name, "kernels_us": kernels, "total_us": total})
                print(f"## {spec} {name}: {total:.1f} us of kernels per select")
                for key, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"   {us:8.1f} us  {key[:90]}")
            except Exception as exc:  # noqa: BLE001 - a run that fails is a result too
                rows.append({"shape": spec, "method": name, "error": repr(exc)[:400]})
                print(f"## {spec} {name}: ERROR {repr(exc)[:400]}")
            with open(path, "w") as fh:  # after every run: a device call cut short keeps what it measured
                json.dump(rows, fh, indent=1)
        del q, lab, ch, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
