"""How far the Triton lanes kernel's low-rank lanes are from exact attention in fp16 and bf16 (GPU).

Session 57 moved the scale of bf16 scores into the exponent for lanes that read keys as stored; a low-rank lane
(keys are coordinates in a per-head basis) still rounds its projected, scaled query ``(q U) * scale * log2 e`` to
the keys' dtype before the dot, while the PyTorch reference rounds the unscaled projection ``q U`` to the query's
dtype. Both roundings cost accuracy in bf16: on the CPU (300 tokens, d 64, rank 32) the reference alone is 6.5e-3 off
a float64 oracle in LSE (fp16: 1.2e-3). This prints, per dtype and context, the LSE and output errors of the kernel
and of the reference against a float64 oracle of the same stored keys: what rounding the projection unscaled (the
reference's way), or keeping it in two bf16 halves (two tensor-core dots of a memory-bound read), would move: the
kernel's rows under each ``proj_query`` setting (session 58: "scaled", the default; "unscaled"; "split").

    python benchmarks/gpu_lowrank_bf16_probe.py > lowrank_bf16.md
    python benchmarks/gpu_lowrank_bf16_probe.py --emulate     # CPU: each setting's rounding, scores in float64

``--emulate`` (no GPU) applies each setting's rounding of the fp32 projection on the CPU at the same shapes and data
and scores in float64: the error the rounding alone causes, before any accumulation order.
"""

from __future__ import annotations

import sys

import torch

from kvcompress.kernels.leank import reference
from kvcompress.kernels.leank.reference import Lane
from kvcompress.kernels.leank.triton_kernel import PROJ_QUERY, grouped_partial_attention


def oracle(q, lane, scale):
    """float64: the query projected by the basis, scores against the stored coordinates."""
    qp = torch.einsum("bhmd,hdr->bhmr", q.double(), lane.basis.double())
    s = torch.einsum("bhmr,bhtr->bhmt", qp, lane.k.double()) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhmt,bhtd->bhmd", torch.softmax(s, -1), lane.v.double())
    return out, lse


def cases(device: str):
    """``(dtype, (b, h, m, d, r, t), q, lane)`` of the probe's shapes, the same data on any device."""
    for dtype in (torch.float16, torch.bfloat16):
        for b, h, m, d, r, t in ((2, 8, 4, 128, 64, 4096), (2, 8, 4, 128, 64, 32768), (2, 3, 3, 64, 32, 32768)):
            g = torch.Generator(device=device).manual_seed(t + r)
            basis = torch.linalg.qr(torch.randn(h, d, d, device=device, generator=g))[0][..., :r].contiguous()
            q = (torch.randn(b, h, m, d, device=device, generator=g) * 2).to(dtype)
            k = (torch.randn(b, h, t, r, device=device, generator=g) * 2).to(dtype)
            v = torch.randn(b, h, t, d, device=device, generator=g).to(dtype)
            yield dtype, (b, h, m, d, r, t), q, Lane(None, None, k, v, None, basis.to(dtype))


def emulate() -> None:
    """Each ``proj_query`` setting's rounding of the fp32 projection, scores and LSE in float64 (CPU)."""
    print("| dtype | B x heads x rows | tokens | rank | scaled LSE err | unscaled LSE err | split LSE err |")
    print("|---|---|---|---|---|---|---|")
    for dtype, (b, h, m, d, r, t), q, lane in cases("cpu"):
        scale = d ** -0.5
        _, o_lse = oracle(q, lane, scale)
        qp = torch.einsum("bhmd,hdr->bhmr", q.float(), lane.basis.float())
        hi = (qp * scale).to(dtype)
        rounded = {"scaled": hi.double(), "unscaled": qp.to(dtype).double() * scale,
                   "split": hi.double() + (qp * scale - hi.float()).to(dtype).double()}
        errs = [float((torch.logsumexp(torch.einsum("bhmr,bhtr->bhmt", x, lane.k.double()), -1) - o_lse).abs().max())
                for x in (rounded[pq] for pq in PROJ_QUERY)]
        print(f"| {str(dtype)[6:]} | {b} x {h} x {m} | {t} | {r} | " + " | ".join(f"{e:.2e}" for e in errs) + " |",
              flush=True)


def main() -> None:
    if "--emulate" in sys.argv[1:]:
        emulate()
        return
    print("| dtype | B x heads x rows | tokens | rank | proj_query | kernel LSE err | reference LSE err | "
          "kernel out err | reference out err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, (b, h, m, d, r, t), q, lane in cases("cuda"):
        scale = d ** -0.5
        r_out, r_lse = reference.grouped_partial_attention(q, [lane], scale)
        o_out, o_lse = oracle(q, lane, scale)

        def err(a, b_):
            return float((a.double() - b_).abs().max())

        for pq in PROJ_QUERY:
            out, lse = grouped_partial_attention(q, [lane], scale, config={"proj_query": pq})
            print(f"| {str(dtype)[6:]} | {b} x {h} x {m} | {t} | {r} | {pq} | {err(lse, o_lse):.2e} | "
                  f"{err(r_lse, o_lse):.2e} | {err(out, o_out):.2e} | {err(r_out, o_out):.2e} |", flush=True)

if __name__ == "__main__":
    main()
