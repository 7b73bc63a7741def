"""The paged Triton split kernel's sm_90 builds without a GPU: instructions, registers, the opcode histogram and a
SHA-1 of the SASS of each (fp16 / bf16 pages, head dims 128 and 64; with ``--new`` also ``bf16_scale_in_exponent``
on), to check what a source change does to the machine code.  Launches recorded from real CPU calls of ``_forward``
(``tests/triton_offline.py``), one split, 3 stages.  Use the GPU image's Triton (3.6 on the lent machines):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/paged_triton_sass.py before.json      # then after the change (--new)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def builds(new: bool) -> dict:
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kivi_triton_sass import build_stats
    from triton_offline import record_launches

    from kvcompress.kernels.paged import triton_kernel as tk

    rows, mp = {}, MonkeyPatch()
    try:
        for d, h, m in ((128, 8, 4), (64, 3, 3)):
            for dtype in (torch.float16, torch.bfloat16):
                for flag in ((False, True) if new else (False,)):
                    b, p, n, w = 2, 16, 64, 40
                    q, k, v = (torch.randn(b, h, m, d).to(dtype), torch.randn(n, h, p, d).to(dtype),
                               torch.randn(n, h, p, d).to(dtype))
                    valid = torch.ones(n, p, dtype=torch.bool)
                    table = (torch.arange(b * w).view(b, w) % n).int()
                    # (the setting named: its default is True since session 58, so flag=False builds the old arithmetic)
                    base = {**tk._config(), "num_stages": 3, "bf16_scale_in_exponent": flag}
                    seen = record_launches(mp, [(tk, "_paged_split_kernel")], lambda: tk._forward(
                        q, k, v, valid, table, 0.1, splits=1, base=base))
                    key = f"d{d} {str(dtype)[6:]} flag={flag}"
                    rows[key] = row = build_stats(seen[0])
                    print(key, {k: row[k] for k in ("instructions", "registers", "sha1")},
                          {op: row["opcodes"].get(op, 0) for op in ("FMUL", "FFMA", "FADD")}, flush=True)
    finally:
        mp.undo()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file for the builds")
    ap.add_argument("--new", action="store_true", help="also build with bf16_scale_in_exponent on")
    args = ap.parse_args(argv)
    Path(args.out).write_text(json.dumps(builds(args.new), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
