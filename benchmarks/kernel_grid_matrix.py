"""Issue 19's grid as one matrix per model: speed-up over SDPA on the uncompressed cache of every op at every
(batch, context) shape, from the JSON files ``python -m kvcompress.kernels.benchutil --ops grid --out F.json``
writes.  Cells below 1.0x (the op is slower than not compressing) are marked in bold.

    python benchmarks/kernel_grid_matrix.py docs/data/kernel_grid_*_h200_s13.json [--metric speedup|us|pct]
"""

from __future__ import annotations

import argparse
import json
import sys


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def matrix(rows: list[dict], model: str, metric: str = "speedup") -> str:
    rows = [r for r in rows if r.get("model") == model and r.get("latency_us") is not None]
    shapes = sorted({(r["batch"], r["ctx"]) for r in rows})
    ops: list[str] = []
    for r in rows:
        if r["op"] not in ops:
            ops.append(r["op"])
    cell = {(r["op"], r["batch"], r["ctx"]): r for r in rows}
    head = "| op | " + " | ".join(f"B{b}/{_ctx(c)}" for b, c in shapes) + " |"
    out = [head, "|" + "---|" * (len(shapes) + 1)]
    for op in ops:
        vals = []
        for b, c in shapes:
            r = cell.get((op, b, c))
            if r is None:
                vals.append("-")
            elif metric == "us":
                vals.append(f"{r['latency_us']:.1f}")
            elif metric == "pct":
                vals.append(f"{r['pct_of_4p3']:.0f}%")
            else:
                x = r.get("speedup_vs_sdpa")
                vals.append("-" if x is None else (f"**{x:.2f}**" if x < 1.0 else f"{x:.2f}"))
        out.append(f"| {op} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--metric", choices=("speedup", "us", "pct"), default="speedup")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    for f in args.files:
        with open(f, encoding="utf-8") as fh:
            rows += json.load(fh)["rows"]
    for model in sorted({r["model"] for r in rows}):
        print(f"\n{model} ({args.metric})\n")
        print(matrix(rows, model, args.metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
