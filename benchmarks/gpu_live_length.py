"""A static cache early in a long generation: the KIVI middle holds ``live`` tokens in a store sized for ``capacity``.

Before session 23 the KIVI CUDA kernel (v3) read every slot of the capacity (the live length only masked, through
``PackedKV.live_valid``: one extra elementwise op per read); it now reads the live length from the device
(``Params::len``), skips the tiles after it and masks the last one.  This times, per (batch, capacity, live), the
KIVI-2 read (Llama-3-8B heads: 8 kv heads, 4 query rows each, d 128) of

* ``cuda, length``: the CUDA kernel given the length (what a static store reads now: tiles interleaved over the
  grid's warps), and ``cuda, length, contiguous splits``: the same with ``interleave`` 0 (each split a contiguous
  run of tiles sized for the capacity),
* ``cuda, whole capacity``: the same kernel without it (the work it did before; the old ``live_valid`` op not
  counted),
* ``triton, length``: the Triton kernel (v2), which always skipped by length,
* ``sdpa, capacity + mask``: SDPA on an uncompressed cache of that capacity behind a boolean mask (a masked SDPA
  call cannot take the flash kernel), and ``sdpa, live only``: SDPA on exactly the live tokens (the uncompressed
  cache's lower bound, what the last column compares with).

CUDA graphs, inputs rotated past L2 (:func:`kvcompress.kernels.benchutil.time_op`).  CUDA only::

    python benchmarks/gpu_live_length.py [--batches 1,16] [--capacity 32768,131072] [--live 1024,4096,16384]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--capacity", default="32768,131072")
    ap.add_argument("--live", default="1024,4096,16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kvcompress.kernels import benchutil as bu
    from kvcompress.kernels.kivi import cuda_kernel as ck
    from kvcompress.kernels.kivi import triton_kernel as tk

    dev = torch.device("cuda")
    kvh, rows, d = 8, 4, 128
    scale = d ** -0.5
    out = []
    print("| B | capacity | live | cuda, length (µs) | cuda, length, contiguous splits | cuda, whole capacity | "
          "triton, length | sdpa, capacity + mask | sdpa, live only | cuda length vs sdpa live only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        for cap in map(int, args.capacity.split(",")):
            for live in map(int, args.live.split(",")):
                if live > cap:
                    continue
                gen = torch.Generator(device=dev).manual_seed(0)
                q, packed = bu.kivi_inputs(b, kvh, cap, d, 2, 32, 32, rows, dev, gen)
                # distinct copies so that the live part of one pass over them streams from HBM (bounded: 24 GB)
                full = bu.kivi_bytes(q, packed)
                copies = max(1, min(bu.copies_for(full * live // cap), int(24e9 // full)))
                stores = [packed] + [bu.kivi_inputs(b, kvh, cap, d, 2, 32, 32, rows, dev, gen)[1]
                                     for _ in range(copies - 1)]
                length = torch.tensor(live, device=dev)
                for p in stores:
                    p.valid[:, live:] = False
                plain = [(q, p) for p in stores]
                inputs = [(q, dataclasses.replace(p, length=length)) for p in stores]
                t_len = bu.time_op(lambda qq, p: ck.kivi_attention_partial(qq, p, scale), inputs)
                t_run = bu.time_op(lambda qq, p: ck._forward(qq, p, scale, cfg={"interleave": 0}), inputs)
                t_all = bu.time_op(lambda qq, p: ck.kivi_attention_partial(qq, p, scale), plain)
                t_tri = bu.time_op(lambda qq, p: tk.kivi_attention_partial(qq, p, scale), inputs)
                with_len = inputs[0][1]
                del stores, plain, inputs
                # uncompressed: [B, Hkv, cap, d] fp16 behind a mask, and exactly the live tokens (rotated copies)
                k = torch.randn(b, kvh, cap, d, device=dev, dtype=torch.float16, generator=gen)
                v = torch.randn(b, kvh, cap, d, device=dev, dtype=torch.float16, generator=gen)
                qd = q.reshape(b, kvh, rows, d)
                mask = torch.zeros(b, 1, 1, cap, dtype=torch.bool, device=dev)
                mask[..., :live] = True
                sdpa = torch.nn.functional.scaled_dot_product_attention
                t_cap = bu.time_op(lambda qq, kk, vv, mm: sdpa(qq, kk, vv, attn_mask=mm), [(qd, k, v, mask)])
                live_bytes = 2 * k[:, :, :live].nbytes
                n_live = max(1, min(bu.copies_for(live_bytes), int(24e9 // live_bytes)))
                lives = [(qd, k[:, :, :live].clone(), v[:, :, :live].clone()) for _ in range(n_live)]
                t_live = bu.time_op(lambda qq, kk, vv: sdpa(qq, kk, vv), lives)
                del lives
                ref = ck.kivi_attention_partial(q, with_len, scale)
                g = live // 32
                cut = dataclasses.replace(packed, k_codes=packed.k_codes[:, :, :g], k_scale=packed.k_scale[:, :, :g],
                                          k_zero=packed.k_zero[:, :, :g], v_codes=packed.v_codes[:, :, :live],
                                          v_scale=packed.v_scale[:, :, :live], v_zero=packed.v_zero[:, :, :live],
                                          valid=packed.valid[:, :live])
                exp = ck.kivi_attention_partial(q, cut, scale)  # the same kernel on exactly the live slots
                err = max((ref[0] - exp[0]).abs().max().item(), (ref[1] - exp[1]).abs().max().item())
                row = {"batch": b, "capacity": cap, "live": live, "cuda_length_us": t_len.us,
                       "cuda_length_contiguous_us": t_run.us,
                       "cuda_capacity_us": t_all.us, "triton_length_us": t_tri.us, "sdpa_capacity_us": t_cap.us,
                       "sdpa_live_us": t_live.us, "max_abs_diff_vs_live_only": err}
                out.append(row)
                print(f"| {b} | {cap // 1024}k | {live // 1024}k | {t_len.us:.1f} | {t_run.us:.1f} | {t_all.us:.1f} | "
                      f"{t_tri.us:.1f} | {t_cap.us:.1f} | {t_live.us:.1f} | {t_live.us / t_len.us:.2f}x |", flush=True)
                del k, v, packed, with_len
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
