"""The Triton LeanK lanes read with fp16 against bf16 keys, same shapes, same call (GPU).

Session 57: with bf16 keys the kernel scales the scores after its dot (one multiply per score) instead of rounding
the scaled query to bf16 (session 56's 2.2e-3 LSE error); fp16 keys keep the scaled query. Before that change both
dtypes ran the same instructions, so bf16 / fp16 here is what the multiply costs. benchutil's inputs (LeanK-50/70
lanes over ctx - 1024 tokens plus the 1024-token full-precision region; the empty stack's one full-width lane),
CUDA graphs, inputs rotated past L2, rounds alternating the dtypes.

    python benchmarks/gpu_bf16_lanes_probe.py [--rounds 2] [--shapes llama3-8b:16:32k,...] > table.md
"""

from __future__ import annotations

import argparse

import torch

from kvcompress.kernels import benchutil as bu
from kvcompress.kernels.leank.reference import Lane
from kvcompress.kernels.leank.triton_kernel import grouped_partial_attention

SHAPES = "llama3-8b:1:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:16:32k"


def inputs(op: str, shape, batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator):
    m = shape.q_heads // shape.kv_heads
    if op == "none":
        def t(d):
            return torch.randn(batch, shape.kv_heads, ctx, d, device="cuda", dtype=dtype, generator=gen)
        q = torch.randn(batch, shape.kv_heads, m, shape.head_dim, device="cuda", dtype=dtype, generator=gen)
        return q, [Lane(None, None, t(shape.head_dim), t(shape.head_dim), None)]
    return bu.leank_inputs(batch, shape.kv_heads, ctx - bu.LEANK_FP_TOKENS, shape.head_dim, m, int(op[5:]),
                           torch.device("cuda"), gen, dtype=dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ops", default="leank70,leank50,none")
    args = ap.parse_args()
    print("| round | op | shape | fp16 (µs) | bf16 (µs) | bf16 / fp16 |")
    print("|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        for spec in args.shapes.split(","):
            model, b, ctx = spec.split(":")
            shape, batch, ctx = bu._shape_named(model), int(b), bu.parse_context(ctx)
            scale = shape.head_dim ** -0.5
            for op in args.ops.split(","):
                times = {}
                for dtype in ((torch.float16, torch.bfloat16) if r % 2 else (torch.bfloat16, torch.float16)):
                    gen = torch.Generator(device="cuda").manual_seed(r)
                    first = inputs(op, shape, batch, ctx, dtype, gen)
                    n = bu.copies_for(bu.leank_bytes(*first))
                    data = [first] + [inputs(op, shape, batch, ctx, dtype, gen) for _ in range(n - 1)]
                    t = bu.time_op(lambda q, lanes: grouped_partial_attention(q, lanes, scale), data)
                    times[dtype] = t.seconds * 1e6
                    del data, first
                    torch.cuda.empty_cache()
                f16, b16 = times[torch.float16], times[torch.bfloat16]
                print(f"| {r} | {op} | {spec} | {f16:.1f} | {b16:.1f} | {b16 / f16:.3f} |", flush=True)


if __name__ == "__main__":
    main()
