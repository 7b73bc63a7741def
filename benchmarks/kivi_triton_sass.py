"""The plain Triton KIVI kernel's sm_90 build at 32 configurations, without a GPU: SASS instructions, registers and
the opcode histogram of each (``--json OUT``), to check that a source change leaves the machine code alone.

The launch is recorded from a real CPU call of ``_forward`` (``tests/triton_offline.py``: the constexprs and launch
options the wrapper picks) and compiled with Triton's real pipeline for sm_90; bits 2 / 4, the default launch and
the ``TRANS / LAZY / PREFETCH`` off launch, with and without the scores output, a live length and a soft-cap.  Use
the GPU image's Triton (3.6 on the lent machines):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/kivi_triton_sass.py --json before.json     # then again after the change
    python benchmarks/kivi_triton_sass.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packed(bits: int):
    import torch

    from kvcompress.kernels.kivi.reference import PackedKV, quantize_keys, quantize_values

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 8, 256, 128, generator=gen), torch.randn(2, 8, 256, 128, generator=gen)
    kc, ks, kz = quantize_keys(k, bits, 32)
    vc, vs, vz = quantize_values(v, bits, 32)
    return PackedKV(bits, 32, kc, ks, kz, vc, vs, vz, torch.ones(2, 256, dtype=torch.bool))


def _sass(compiled) -> list[str]:
    from read_occupancy import cuobjdump

    return [re.sub(r"/\*[0-9a-f]+\*/", "", ln).strip() for ln in cuobjdump(compiled, "-sass").splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]


def build_stats(launch) -> dict:
    """A recorded launch (``tests/triton_offline.py``) compiled for sm_90: its SASS instruction count, registers per
    thread, opcode histogram (predicates dropped) and a SHA-1 of the SASS text (equal builds, instruction for
    instruction).  Shared by the Triton SASS scripts (``leank_triton_sass.py``, ``paged_triton_sass.py``)."""
    import hashlib

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from read_occupancy import usage
    from triton_offline import compile_launch

    built = compile_launch(launch)
    ins = _sass(built)
    ops = collections.Counter(re.sub(r"^@!?U?P[0-9T]+\s*", "", s).split()[0] for s in ins)
    return {"instructions": len(ins), "registers": usage(built)["registers"], "opcodes": dict(sorted(ops.items())),
            "sha1": hashlib.sha1("\n".join(ins).encode()).hexdigest()}


def builds() -> dict:
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    sys.path.insert(0, str(ROOT / "tests"))
    from triton_offline import record_launches

    from kvcompress.kernels.kivi import triton_kernel as tk

    rows, mp = {}, MonkeyPatch()
    try:
        for bits in (2, 4):
            packed = _packed(bits)
            q = torch.randn(2, 8, 4, 128, dtype=torch.float16)
            for cfg in ({}, {"TRANS": False, "LAZY": False, "PREFETCH": False}):
                for logits in (False, True):
                    for length in (False, True):
                        for softcap in (None, 30.0):
                            lg = torch.full((2, 8, 4, 256), float("-inf")) if logits else None
                            ln = torch.tensor(200) if length else None
                            seen = record_launches(mp, [(tk, "_kivi_split_kernel")], lambda: tk._forward(
                                q, packed, 0.1, splits=1, config=cfg, logits=lg, length=ln, softcap=softcap))
                            key = (f"bits {bits} {json.dumps(cfg)} logits={logits} length={length} "
                                   f"softcap={softcap}")
                            rows[key] = build_stats(seen[0])
                            print(f"{key}: {rows[key]['instructions']} instructions, {rows[key]['registers']} "
                                  "registers", flush=True)
    finally:
        mp.undo()
    return rows


def compare(a: dict, b: dict) -> None:
    for key in a:
        x, y = a[key], b.get(key)
        if y is None:
            print(f"{key}: missing")
            continue
        diff = {op: y["opcodes"].get(op, 0) - x["opcodes"].get(op, 0)
                for op in set(x["opcodes"]) | set(y["opcodes"]) if y["opcodes"].get(op, 0) != x["opcodes"].get(op, 0)}
        print(f"{key}: {x['instructions']} -> {y['instructions']} instructions, {x['registers']} -> "
              f"{y['registers']} registers; opcodes changed: {diff or 'none'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the builds here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --json files")
    args = ap.parse_args(argv)
    if args.compare:
        compare(*(json.loads(Path(p).read_text()) for p in args.compare))
        return 0
    rows = builds()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
