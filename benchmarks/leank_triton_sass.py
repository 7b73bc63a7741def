"""The Triton LeanK lanes kernel's sm_90 builds without a GPU: SASS instructions, registers and the opcode histogram of
each (``--json OUT``), to check what a source change does to the machine code.

Launches recorded from real CPU calls of ``grouped_partial_attention`` (``tests/triton_offline.py``: the constexprs and
launch options the wrapper picks) at Llama heads (8 kv heads, 4 rows, d 128) and SmolLM2 heads (3, 3, d 64): LeanK-70
lanes (kept channels plus the full-precision region), the empty stack's one full-width lane and a low-rank lane (rank
d / 2, the query projected in the kernel), fp16 and bf16, with
and without a soft-cap and stored scores; the low-rank lane under each ``proj_query`` setting (keys named
``proj_query=...`` except ``"scaled"``, the only arithmetic before session 58: the keys of older files).  Use the GPU
image's Triton (3.6 on the lent machines):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/leank_triton_sass.py --json before.json     # then again after the change
    python benchmarks/kivi_triton_sass.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def builds() -> dict:
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kivi_triton_sass import build_stats
    from triton_offline import record_launches

    from kvcompress.kernels import benchutil as bu
    from kvcompress.kernels.leank import triton_kernel as tk
    from kvcompress.kernels.leank.reference import Lane

    rows, mp = {}, MonkeyPatch()
    try:
        for model, hkv, m, d in (("llama", 8, 4, 128), ("smollm2", 3, 3, 64)):
            for op in ("leank70", "none", "lowrank"):
                for dtype in (torch.float16, torch.bfloat16):
                    gen = torch.Generator().manual_seed(0)
                    if op == "lowrank":  # keys as coordinates in a per-head basis of rank d / 2 (query projected)
                        q = torch.randn(2, hkv, m, d, generator=gen).to(dtype)
                        basis = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0][..., :d // 2]
                        lanes = [Lane(None, None, torch.randn(2, hkv, 300, d // 2, generator=gen).to(dtype),
                                      torch.randn(2, hkv, 300, d, generator=gen).to(dtype), None,
                                      basis.contiguous().to(dtype))]
                    elif op == "none":
                        q = torch.randn(2, hkv, m, d, generator=gen).to(dtype)
                        lanes = [Lane(None, None, torch.randn(2, hkv, 300, d, generator=gen).to(dtype),
                                      torch.randn(2, hkv, 300, d, generator=gen).to(dtype), None)]
                    else:
                        q, lanes = bu.leank_inputs(2, hkv, 300, d, m, 70, torch.device("cpu"), gen, fp_tokens=64,
                                                   dtype=dtype)
                    for pq in (tk.PROJ_QUERY if op == "lowrank" else ("scaled",)):  # (proj_query: low rank)
                        for softcap in (None, 30.0):
                            for logits in (False, True):
                                lg = ([torch.full((2, lane.k.shape[1] if lane.heads is None else len(lane.heads), m,
                                                   lane.k.shape[2]), float("-inf")) for lane in lanes]
                                      if logits else None)
                                seen = record_launches(mp, [(tk, "_lanes_kernel"), (tk, "_combine_kernel"),
                                                            (tk, "_combine_splits_kernel")],
                                                       lambda: tk.grouped_partial_attention(
                                                           q, lanes, d ** -0.5, softcap=softcap, logits=lg,
                                                           config={"proj_query": pq} if op == "lowrank" else None))
                                key = f"{model} {op} {str(dtype)[6:]} softcap={softcap} logits={logits}" + (
                                    "" if pq == "scaled" else f" proj_query={pq}")
                                rows[key] = row = build_stats(next(x for x in seen if x.fn.__name__ == "_lanes_kernel"))
                                ops = row["opcodes"]
                                print(f"{key}: {row['instructions']} instructions, {row['registers']} registers, FMUL "
                                      f"{ops.get('FMUL', 0)}, FFMA {ops.get('FFMA', 0)}, FADD {ops.get('FADD', 0)}",
                                      flush=True)
    finally:
        mp.undo()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the builds here")
    args = ap.parse_args(argv)
    rows = builds()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
