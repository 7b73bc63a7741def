"""One table of a launch-configuration sweep: every read under every configuration, side by side.

``benchmarks/gpu_paged_sweep.sh`` (and the session scripts built on it) run ``kvcompress.kernels.benchutil`` once per
configuration and leave ``configs.json`` (``config_1`` .. ``config_N``, in the order given, rounds one after the
other) and ``rows.md`` (whose ``## round R config {...}`` lines name them).  This prints, per read (op, model, batch,
context), the latency under each configuration, its change against the first, and the speed-up over SDPA measured
in the same configuration's run; then per configuration: how many reads it made faster or slower by more than
``--noise`` percent, the geometric mean of its latency ratios, and how many reads are below 1.0x SDPA - also for the
fastest configuration of each read; last, the reads whose rounds of one configuration differ by more than
``--state`` percent (:func:`unsteady`).

    python benchmarks/sweep_table.py OUT/configs.json [--rows OUT/rows.md] [--noise 2] [--ops a,b]
        [--variant-suffix=-fused] [--state 10]

``--variant-suffix S``: ops named ``X`` + ``S`` (e.g. ``ds16-fused``) are variants of op ``X`` timed in the same runs;
each run then gives two columns, ``X`` and its variant, so the variant is compared with the op read for read.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def labels(rows_md: Path | None, count: int) -> list[str]:
    """The configurations' names from ``rows.md`` (``## round R config C``), else ``config_1`` ..."""
    found = []
    if rows_md is not None and rows_md.is_file():
        for line in rows_md.read_text().splitlines():
            m = re.match(r"## round (\d+) config (.*)$", line.strip())
            if m:
                found.append(m.group(2) if m.group(1) == "1" else f"{m.group(2)} (round {m.group(1)})")
    return found if len(found) == count else [f"config_{i + 1}" for i in range(count)]


def read_runs(path: Path) -> list[dict]:
    """``configs.json`` -> one ``{(op, model, batch, ctx): row}`` per configuration, in the order run."""
    runs = json.loads(path.read_text())
    keys = sorted(runs, key=lambda k: int(k.rsplit("_", 1)[1]))
    out = []
    for k in keys:
        r = runs[k]
        rows = r["rows"] if isinstance(r, dict) else r
        out.append({(x["op"], x["model"], x["batch"], x["ctx"]): x for x in rows if "latency_us" in x})
    return out


def split_variants(runs: list[dict], names: list[str], suffix: str) -> tuple[list[dict], list[str]]:
    """Each run as two: its rows of ops without ``suffix`` (and SDPA), and its rows of ops ``X + suffix`` renamed
    ``X`` (and SDPA), named ``name`` and ``name + suffix``."""
    out, out_names = [], []
    for run, name in zip(runs, names):
        plain = {key: row for key, row in run.items() if not key[0].endswith(suffix)}
        variant = {(key[0][:-len(suffix)], *key[1:]) if key[0].endswith(suffix) else key: row
                   for key, row in run.items() if key[0].endswith(suffix) or key[0] == "sdpa"}
        out += [plain, variant]
        out_names += [name, f"{name} {suffix}"]
    return out, out_names


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def table(runs: list[dict], names: list[str], noise: float = 2.0, ops: set[str] | None = None) -> str:
    reads = [key for key in runs[0] if key[0] != "sdpa" and (ops is None or key[0] in ops)]
    for run in runs[1:]:
        reads += [key for key in run if key not in reads and key[0] != "sdpa" and (ops is None or key[0] in ops)]
    lines = ["| op | model | B | ctx | " + " | ".join(names) + " | fastest |",
             "|---|---|---|---|" + "---|" * (len(names) + 1)]
    stats = [{"faster": 0, "slower": 0, "logs": [], "below": 0} for _ in names]
    best_below = 0
    for key in reads:
        lat = [run.get(key, {}).get("latency_us") for run in runs]
        sdpa = [run.get(("sdpa", *key[1:]), {}).get("latency_us") for run in runs]
        speed = [s / x if x and s else None for x, s in zip(lat, sdpa)]
        cells = []
        for i, (x, sp) in enumerate(zip(lat, speed)):
            if x is None:
                cells.append("-")
                continue
            change = "" if i == 0 or lat[0] is None else f" ({(x / lat[0] - 1) * 100:+.1f}%)"
            cells.append(f"{x:.1f}{change}, {sp:.2f}x" if sp else f"{x:.1f}{change}")
            if sp is not None and sp < 1.0:
                stats[i]["below"] += 1
            if i and lat[0]:
                stats[i]["logs"].append(math.log(x / lat[0]))
                if x < lat[0] * (1 - noise / 100):
                    stats[i]["faster"] += 1
                elif x > lat[0] * (1 + noise / 100):
                    stats[i]["slower"] += 1
        present = [i for i, x in enumerate(lat) if x is not None]
        best = min(present, key=lambda i: lat[i]) if present else None
        if best is not None and speed[best] is not None and speed[best] < 1.0:
            best_below += 1
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {_ctx(key[3])} | " + " | ".join(cells)
                     + f" | {names[best] if best is not None else '-'} |")
    lines += ["", f"| configuration | faster / slower than {names[0]} by > {noise:g}% | geometric mean latency ratio "
              f"| reads below 1.0x SDPA |", "|---|---|---|---|"]
    for i, (name, s) in enumerate(zip(names, stats)):
        ratio = f"{math.exp(sum(s['logs']) / len(s['logs'])):.3f}" if s["logs"] else "-"
        counts = "-" if i == 0 else f"{s['faster']} / {s['slower']}"
        lines.append(f"| {name} | {counts} | {ratio} | {s['below']} of {len(reads)} |")
    lines.append(f"| the fastest of each read | - | - | {best_below} of {len(reads)} |")
    return "\n".join(lines)


def unsteady(runs: list[dict], names: list[str], state: float = 10.0, ops: set[str] | None = None) -> str:
    """Reads whose rounds of one configuration (``X`` and ``X (round N)``) differ by more than ``state`` percent.

    On H100s the same read of the same cache ran at one of two speeds, 13-19 % apart, from process to process and
    round to round (docs/results.md, "Session 46"); each run of a sweep is its own process, so such a jump in one
    round is that state, not the configuration's effect.  Empty where every configuration's rounds agree."""
    base = [re.sub(r" \(round \d+\)$", "", n) for n in names]
    found = []
    for key in sorted({k for run in runs for k in run if k[0] != "sdpa" and (ops is None or k[0] in ops)}):
        for name in dict.fromkeys(base):
            lat = [run[key]["latency_us"] for run, b in zip(runs, base) if b == name and key in run]
            if len(lat) > 1 and max(lat) > min(lat) * (1 + state / 100):
                found.append(f"- {key[0]} {key[1]} B{key[2]} {_ctx(key[3])}, {name}: "
                             + " / ".join(f"{x:.1f}" for x in lat) + " µs")
    if not found:
        return ""
    return (f"\nRounds of one configuration more than {state:g}% apart (a process's slow state, not the setting: "
            "docs/results.md \"Session 46\"):\n" + "\n".join(found))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", type=Path, help="configs.json of a sweep")
    ap.add_argument("--rows", type=Path, help="its rows.md (for the configurations' names; default: beside it)")
    ap.add_argument("--noise", type=float, default=2.0, help="percent a change must exceed to count (default 2)")
    ap.add_argument("--ops", help="only these ops (comma-separated)")
    ap.add_argument("--variant-suffix", help="ops X + this suffix are variants of op X: a column each per run")
    ap.add_argument("--state", type=float, default=10.0,
                    help="list reads whose rounds of one configuration differ by more than this percent (default 10)")
    args = ap.parse_args(argv)
    runs = read_runs(args.configs)
    if not runs:
        ap.error(f"{args.configs}: no configuration runs in it")
    rows_md = args.rows or args.configs.with_name("rows.md")
    names = labels(rows_md, len(runs))
    if args.variant_suffix:
        runs, names = split_variants(runs, names, args.variant_suffix)
    ops = set(args.ops.split(",")) if args.ops else None
    print(table(runs, names, args.noise, ops))
    note = unsteady(runs, names, args.state, ops)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
