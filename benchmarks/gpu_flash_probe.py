"""Probe (issue 19): can PyTorch's own FlashAttention-2 split-KV decode kernel read a static cache's dense region?

``torch.ops.aten._flash_attention_forward`` (torch >= 2.9 schema: ``seqused_k``, ``block_table``, ``num_splits``)
returns the output AND the log-sum-exp, so it could serve as a dense-region partial (merged with other segments by
LSE) if it (a) takes GQA natively, (b) takes a per-row used length from a device tensor (graph-capturable), and
(c) reads our head-major ``[B, H, T, D]`` buffer through a transposed view, or needs token-major storage.  This
script answers those on the GPU machine and times each variant against SDPA (``benchutil.time_op``: CUDA-graph
replay, median of 50; one buffer, so warm L2, unlike the kernel grid) on Llama-3-8B decode shapes.  It changes
nothing in kvcompress.

    python benchmarks/gpu_flash_probe.py --out DIR [--shapes 1x4096,1x32768,16x32768]
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch
import torch.nn.functional as F

from kvcompress.kernels.benchutil import time_op

HQ, HKV, D = 32, 8, 128


def timed(fn) -> float:
    """µs of one call (:func:`kvcompress.kernels.benchutil.time_op`: CUDA-graph replay, median)."""
    return time_op(fn, [()], reps=50, device="cuda").us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--shapes", default="1x4096,1x32768,16x32768")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    op = torch.ops.aten._flash_attention_forward.default
    res = {"torch": torch.__version__, "schema": str(op._schema), "rows": []}
    print(res["schema"], flush=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    for item in args.shapes.split(","):
        b, t = (int(x) for x in item.split("x"))
        cap = t + 256  # a static buffer a little longer than what is live
        g = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(b, HKV, cap, D, device=dev, dtype=dt, generator=g)  # head-major, as kvcompress stores
        v = torch.randn(b, HKV, cap, D, device=dev, dtype=dt, generator=g)
        q = torch.randn(b, HQ, 1, D, device=dev, dtype=dt, generator=g)
        used = torch.full((b,), t, device=dev, dtype=torch.int32)
        scale = D ** -0.5
        ref = F.scaled_dot_product_attention(q, k[:, :, :t], v[:, :, :t], scale=scale, enable_gqa=True)
        row = {"batch": b, "ctx": t}
        row["sdpa_us"] = timed(lambda: F.scaled_dot_product_attention(q, k[:, :, :t], v[:, :, :t], scale=scale,
                                                                       enable_gqa=True))
        qf = q.transpose(1, 2)  # [B, 1, Hq, D]
        variants = {
            # head-major buffer through a transposed view, used length from a device tensor
            "view+seqused_k": lambda: op(qf, k.transpose(1, 2), v.transpose(1, 2), None, None, 1, cap, 0.0, False,
                                         False, scale=scale, seqused_k=used),
            # the same on exactly the live prefix (no seqused_k): FA2 on a transposed view at all?
            "view, live prefix": lambda: op(qf, k[:, :, :t].transpose(1, 2), v[:, :, :t].transpose(1, 2), None, None,
                                            1, t, 0.0, False, False, scale=scale),
        }
        kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # token-major storage
        variants["token-major+seqused_k"] = lambda: op(qf, kt, vt, None, None, 1, cap, 0.0, False, False,
                                                       scale=scale, seqused_k=used)
        for name, fn in variants.items():
            try:
                out, lse = fn()[:2]
                err = (out.transpose(1, 2).float() - ref.float()).abs().max().item()
                row[name] = {"max_abs_err": err, "lse_shape": list(lse.shape), "us": timed(fn)}
            except Exception as e:  # noqa: BLE001 - a probe: record what failed and go on
                row[name] = {"error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-600:]}
            print(item, name, json.dumps(row[name])[:300], flush=True)
        print(item, "sdpa", f"{row['sdpa_us']:.1f} us", flush=True)
        res["rows"].append(row)
    with open(os.path.join(args.out, "flash_probe.json"), "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
