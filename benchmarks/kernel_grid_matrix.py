"""Issue 19's grid as one matrix per model: speed-up over SDPA on the uncompressed cache of every op at every
(batch, context) shape, from the JSON files ``python -m kvcompress.kernels.benchutil --ops grid --out F.json``
writes.  Cells below 1.0x (the op is slower than not compressing) are marked in bold.

    python benchmarks/kernel_grid_matrix.py docs/data/kernel_grid_*_h200_s13.json [--metric speedup|us|pct]

Files are read in the order given and a later row of the same (model, op, batch, context) replaces an earlier one,
so measurements listed oldest first give each cell's latest measurement.  ``--sources F`` reads that list from a
file (one JSON path per line - or a benchutil table, ``.md``, where the JSON was lost: :func:`md_rows` - relative
to the file's directory, ``#`` comments; ``path:key`` takes the rows under ``key`` of a file holding several runs,
e.g. a sweep's ``config_2``): ``docs/data/grid_latest.txt`` lists issue 19's current grid.  ``--count`` adds, per
model and op, the cells below 1.0x and the source of every cell, and the total over the grid's ops
(:data:`GRID_OPS`); ``--only-grid`` drops rows of other ops (``sdpa``, variants); ``--summary`` prints only one line
per op (speed-up range per model, cells below 1.0x: the README's table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: issue 19's ops (every one but ``sdpa``, the baseline): the cells its "every op >= 1.0x" counts
GRID_OPS = ("kivi2", "kivi4", "leank50", "leank70", "leank70-kivi2", "ds8", "ds16", "ds8-shared", "ds16-shared",
            "paged-dense", "paged-kivi2", "lowrank", "none")


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def load_rows(path: str, name: str | None = None) -> list[dict]:
    """The rows of one benchutil JSON (``path`` or ``path:key``), each tagged with ``name`` (default: ``path``) as
    ``source``."""
    name = name or path
    key = None
    if ":" in os.path.basename(path):
        path, key = path.rsplit(":", 1)
    if path.endswith(".md"):
        return [dict(r, source=name) for r in md_rows(path)]
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if key is not None:
        if not isinstance(data, dict) or key not in data:
            raise SystemExit(f"{path}: no entry {key!r} (has: {', '.join(data) if isinstance(data, dict) else '-'})")
        data = data[key]
    rows = data["rows"] if isinstance(data, dict) else data
    # a bf16 row (benchutil --dtype bfloat16) is its own op, ``kivi2@bf16``: never a cell of the float16 grid
    return [dict(r, source=name, op=r["op"] + ("@bf16" if r.get("dtype") == "bfloat16" else ""))
            for r in rows if isinstance(r, dict) and "op" in r]


def md_rows(path: str) -> list[dict]:
    """The rows of a benchutil table (``| op (impl) | model | B | ctx | latency (µs) | bytes read (MB) | TB/s | % of
    4.3 TB/s | vs SDPA | ... |``, as benchutil prints it) where its JSON is missing: latency, bytes and speed-up as
    printed (rounded: 0.1 µs, 0.1 MB, 0.01x)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 9 or not cells[2].isdigit() or not cells[8].endswith("x"):
                continue
            ctx = cells[3]
            rows.append(dict(op=cells[0].split(" (")[0], model=cells[1], batch=int(cells[2]),
                             ctx=int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx),
                             latency_us=float(cells[4]), bytes=float(cells[5]) * 1e6,
                             pct_of_4p3=float(cells[7].rstrip("%")), speedup_vs_sdpa=float(cells[8][:-1])))
    return rows


def read_sources(listing: str) -> list[tuple[str, str]]:
    """``(path, name as listed)`` of the JSON files a sources file lists, oldest first, paths resolved against the
    file's directory."""
    base = os.path.dirname(os.path.abspath(listing))
    out = []
    with open(listing, encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append((line if os.path.isabs(line) else os.path.join(base, line), line))
    return out


def latest_cells(rows: list[dict]) -> dict[tuple, dict]:
    """``(model, op, batch, ctx) -> row``, the last timed row of each cell in the order given."""
    return {(r["model"], r["op"], r["batch"], r["ctx"]): r for r in rows
            if r.get("latency_us") is not None and "model" in r}


def matrix(rows: list[dict], model: str, metric: str = "speedup") -> str:
    cell = {(op, b, c): r for (m, op, b, c), r in latest_cells(rows).items() if m == model}
    shapes = sorted({(b, c) for _, b, c in cell})
    ops: list[str] = []
    for r in rows:
        if r.get("model") == model and r.get("latency_us") is not None and r["op"] not in ops:
            ops.append(r["op"])
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
                pct = r.get("pct_of_peak", r.get("pct_of_4p3"))
                vals.append("-" if pct is None else f"{pct:.0f}%")
            else:
                x = r.get("speedup_vs_sdpa")
                vals.append("-" if x is None else (f"**{x:.2f}**" if x < 1.0 else f"{x:.2f}"))
        out.append(f"| {op} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def compared_cells(rows: list[dict], ops=GRID_OPS) -> dict[tuple, dict]:
    """The latest cells of ``ops`` that have a speed-up over SDPA."""
    return {k: r for k, r in latest_cells(rows).items() if k[1] in ops and r.get("speedup_vs_sdpa") is not None}


def below(rows: list[dict], ops=GRID_OPS) -> dict[tuple, dict]:
    """The latest cells of ``ops`` slower than SDPA (speed-up below 1.0)."""
    return {k: r for k, r in compared_cells(rows, ops).items() if r["speedup_vs_sdpa"] < 1.0}


#: a cell below 1.0x at this speed-up or above is "near" it (``--count`` says how many)
NEAR = 0.98


def count_table(rows: list[dict], ops=GRID_OPS) -> str:
    """Per model and op: cells timed, cells below 1.0x, and the sources of the cells; then the totals, and how many
    of the cells below 1.0x are at :data:`NEAR` or above."""
    cells = compared_cells(rows, ops)
    slow = below(rows, ops)
    out = ["| model | op | cells | below 1.0x | sources (cells) |", "|---|---|---|---|---|"]
    for model in sorted({k[0] for k in cells}):
        for op in ops:
            mine = [k for k in cells if k[0] == model and k[1] == op]
            if not mine:
                continue
            src: dict[str, int] = {}
            for k in mine:
                src[cells[k]["source"]] = src.get(cells[k]["source"], 0) + 1
            n_slow = sum(1 for k in mine if k in slow)
            out.append(f"| {model} | {op} | {len(mine)} | {n_slow} | "
                       + ", ".join(f"{s} ({n})" for s, n in src.items()) + " |")
    out.append(f"\n**{len(slow)} of {len(cells)} cells below 1.0x.**")
    near = sum(1 for r in slow.values() if r["speedup_vs_sdpa"] >= NEAR)
    if slow:
        out.append(f"\n{near} of the {len(slow)} at {NEAR:.2f}x or above. SDPA's own time at a cell differs by up to"
                   " about 2 % from one machine to another (session 50: 1.7 % at the median cell), so a rerun can move"
                   " these to either side of 1.0x.")
    return "\n".join(out)


#: the README's names of the grid's head shapes
MODEL_NAMES = {"llama3-8b": "Llama-3-8B heads", "smollm2-135m": "SmolLM2 heads"}


def summary_table(rows: list[dict], ops=GRID_OPS) -> str:
    """One line per op: the lowest and highest speed-up over SDPA at each model's shapes (each cell's latest
    measurement), and the cells below 1.0x of all cells timed.  The README quotes this table (``--summary``)."""
    cells = compared_cells(rows, ops)
    models = sorted({k[0] for k in cells})
    out = ["| op | " + " | ".join(MODEL_NAMES.get(m, m) for m in models) + " | below 1x |",
           "|---|" + "---|" * len(models) + "---|"]
    for op in ops:
        mine = {k: r["speedup_vs_sdpa"] for k, r in cells.items() if k[1] == op}
        if not mine:
            continue
        parts = []
        for m in models:
            v = [x for k, x in mine.items() if k[0] == m]
            parts.append(f"{min(v):.2f}-{max(v):.2f}x" if v else "-")
        n_slow = sum(1 for x in mine.values() if x < 1.0)
        out.append(f"| {op} | " + " | ".join(parts) + f" | {n_slow} of {len(mine)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="benchutil JSON files, oldest first (path or path:key)")
    ap.add_argument("--sources", help="a file listing the JSON files, oldest first (see the module docstring)")
    ap.add_argument("--metric", choices=("speedup", "us", "pct"), default="speedup")
    ap.add_argument("--count", action="store_true", help="also count the grid ops' cells below 1.0x, with sources")
    ap.add_argument("--only-grid", action="store_true", help="only issue 19's ops (and no sdpa rows)")
    ap.add_argument("--summary", action="store_true",
                    help="only the per-op table of speed-up ranges and cells below 1.0x (the README's)")
    args = ap.parse_args(argv)
    files = [(f, f) for f in args.files] + (read_sources(args.sources) if args.sources else [])
    if not files:
        ap.error("give benchutil JSON files or --sources")
    rows: list[dict] = []
    for path, name in files:
        rows += load_rows(path, name)
    if args.only_grid:
        rows = [r for r in rows if r.get("op") in GRID_OPS]
    if args.summary:
        print(summary_table(rows))
        return 0
    for model in sorted({r["model"] for r in rows if "model" in r}):
        print(f"\n{model} ({args.metric})\n")
        print(matrix(rows, model, args.metric))
    if args.count:
        print()
        print(count_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
