"""Registers and spills of the DoubleSparse fused select kernels, compiled for sm_90 on a machine without a GPU.

Triton compiles for a named target without a device (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))``); the arguments that a launch would specialize as multiples of 16 (pointers, the strides, the token and chunk
counts at the benchmark shapes) get the same ``tt.divisibility`` hint, so the build matches what a launch compiles
(the fused select at 8192 tokens and 8 warps: 206 registers, as Nsight Compute read on the H200 in session 27).
Registers and local-memory stack per thread come from Triton's bundled ``cuobjdump -res-usage``.

Use the GPU image's Triton for numbers that hold there (it is 3.6 on the lent H200):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/select_regs.py [--out FILE.json]

Rows: the select kernel at each (tokens per program, warps) the launch rule picks (``elems_per_thread`` 16 / 32 / 64
over 4096-16384 tokens), with and without candidate output, with the placement in blocks (``compact_block``), and the
merge kernel.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings

from read_occupancy import cubin_resources  # (benchmarks/, beside this script)

SELECT_PTR = {"Q": "*fp16", "SC": "*fp16", "ZE": "*fp16", "L": "*fp16", "CH": "*i64", "VA": "*u8", "IDX": "*i32",
              "CKEY": "*i32"}
# integer arguments that are multiples of 16 at the benchmark shapes (a launch specializes them the same way)
SELECT_DIV = ("sq_b", "sq_h", "sch_h", "sl_b", "sl_h", "sl_c", "sz_b", "sz_h", "sva_b", "T", "K", "KC", "CHUNK", "HQ")


def resources(fn, consts: dict, warps: int, ptr: dict, div=(), stages: int = 3) -> dict:
    """Compile ``fn`` for sm_90 (``stages``: Triton's default 3, as the select launches) and read its registers /
    stack per thread (``cuobjdump``) and the shared memory a launch allocates (the compiled kernel's metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    consts = {**defaults, **consts}  # constexprs left at their defaults (PDL), as a launch leaves them
    sig = {n: ("constexpr" if n in consts else ptr.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in div or sig[n].startswith("*")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
    r = cubin_resources(c)
    return {"registers": r["registers"], "stack_bytes": r["stack_bytes"], "shared_bytes": r["shared_bytes"],
            "triton": triton.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    from kvcompress.kernels.doublesparse import triton_kernel as tk

    rows = []
    configs = [(np_, warps, cand, np_) for np_, warps in ((16384, 16), (8192, 16), (8192, 8), (8192, 4), (4096, 8),
                                                          (4096, 4), (2048, 2)) for cand in (True, False)]
    # compact_block: the placement a block at a time (SUB lanes), the keys computed again
    configs += [(8192, warps, True, sub) for warps in (8, 4) for sub in (2048, 1024)]
    configs += [(16384, 16, False, 2048)]
    for np_, warps, cand, sub in configs:
        consts = dict(W=16, PER=1, BITS=16, QUANT=False, HAS_VALID=False, CANDIDATES=cand, UNROLL=4, NP=np_, SUB=sub,
                      GROUP=1)
        ptr = dict(SELECT_PTR, IDX="*i32" if cand else "*i64")
        r = resources(tk._select_kernel, consts, warps, ptr, SELECT_DIV)
        rows.append({"kernel": "select", "tokens": np_, "warps": warps, "elems_per_thread": np_ // (32 * warps),
                     "candidates": cand, "compact_block": sub if sub < np_ else None, **r})
    for np_, warps, sub in ((16384, 16, 16384), (8192, 8, 8192), (8192, 16, 8192), (16384, 16, 2048),
                            (8192, 8, 1024)):
        r = resources(tk._merge_kernel, dict(NP=np_, SUB=sub), warps,
                      {"CKEY": "*i32", "CIDX": "*i32", "OUT": "*i64"}, ("N", "K"))
        rows.append({"kernel": "merge", "tokens": np_, "warps": warps, "elems_per_thread": np_ // (32 * warps),
                     "candidates": None, "compact_block": sub if sub < np_ else None, **r})
    for np_, warps, sub in ((16384, 8, 16384), (16384, 16, 16384), (16384, 8, 2048)):  # the multi-level merge
        r = resources(tk._merge_level_kernel, dict(NP=np_, SUB=sub), warps,
                      {"CKEY": "*i32", "CIDX": "*i32", "OKEY": "*i32", "OIDX": "*i32"}, ("N", "GS", "KC"))
        rows.append({"kernel": "merge level", "tokens": np_, "warps": warps, "elems_per_thread": np_ // (32 * warps),
                     "candidates": None, "compact_block": sub if sub < np_ else None, **r})
    print(f"Triton {rows[0]['triton']}, sm_90 (fp16 labels, r = 16)")
    print("| kernel | tokens | warps | per thread | candidates | compact_block | registers | stack (B) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['tokens']} | {r['warps']} | {r['elems_per_thread']} | {r['candidates']} | "
              f"{r['compact_block'] or '-'} | {r['registers']} | {r['stack_bytes']} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
