"""DoubleSparse's one-kernel rule (``fuse_rule``) against every measured one-kernel / two-kernel pair.

A DoubleSparse decode read either selects its tokens and gathers them in one kernel
(``kvcompress.kernels.doublesparse.triton_kernel.select_gather_partial``) or in two (the select, then the split
gather and its merge).  ``fuse_rule`` picks one from the read's shape when ``fuse_gather`` is unset (the default).
This prints every read timed both ways on a GPU: the one kernel's change in latency against the two, the rule's
choice, and whether the choice was the faster one (a change within ``--noise`` percent counts as a tie); then how many
choices were wrong and by how much.

    python benchmarks/fuse_rule_fit.py [--sms 132] [--noise 2]

The sweeps (H100, 132 SMs; ``python benchmarks/sweep_table.py`` prints each as measured):

- ``docs/data/s43_h100/ds-fused``: ``ds*`` (two kernels then) and ``ds*-fused`` in the same runs, 4k, two rounds;
- ``docs/data/s45_h100/rules43-ds``: ``{}`` under session 43's rule against ``{"fuse_gather": false}``, 4k, one
  round (only the reads session 43's rule sent to the one kernel are pairs);
- ``docs/data/s45_h100/ds-fused-long``: ``{"fuse_gather": false}`` against ``true``, 8k and 16k, two rounds.

Each side's latency is the median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sweep_table import labels  # benchmarks/ (the script's folder) is on the path

ROOT = Path(__file__).resolve().parents[1]

SOURCES = [("docs/data/s43_h100/ds-fused", "variants"), ("docs/data/s45_h100/rules43-ds", "rule43"),
           ("docs/data/s45_h100/ds-fused-long", "setting")]


def rule43(kk: int, programs: int, sms: int) -> bool:
    """Session 43's rule (the default that ``rules43-ds`` timed): ``kk <= 256``, or ``kk <= 512`` over more programs
    than a quarter of the SMs."""
    return kk <= 256 or (kk <= 512 and 4 * programs > sms)


@dataclass
class Pair:
    """One read timed with the one kernel (``one``) and the two (``two``), µs per round."""
    model: str
    batch: int
    tokens: int
    op: str
    k: int
    programs: int
    head_dim: int
    one: list = field(default_factory=list)
    two: list = field(default_factory=list)

    @property
    def change(self) -> float:
        """The one kernel's latency against the two kernels', minus 1 (negative: the one kernel is faster)."""
        return statistics.median(self.one) / statistics.median(self.two) - 1.0


def _programs(row: dict, op: str) -> int:
    return row["batch"] * (row["kv_heads"] if "shared" in op else row["q_heads"])


def measured_pairs(root: Path = ROOT, sms: int = 132) -> list[Pair]:
    """Every read of :data:`SOURCES` timed both ways, sorted by tokens, programs, k."""
    pairs: dict[tuple, Pair] = {}

    def add(row: dict, op: str, side: str) -> None:
        key = (row["model"], row["batch"], row["ctx"], op)
        if key not in pairs:
            pairs[key] = Pair(row["model"], row["batch"], row["ctx"], op, row["k"], _programs(row, op),
                              row["head_dim"])
        getattr(pairs[key], side).append(row["latency_us"])

    for rel, kind in SOURCES:
        folder = root / rel
        runs = json.loads((folder / "configs.json").read_text())
        names = sorted(runs, key=lambda n: int(n.rsplit("_", 1)[1]))
        settings = labels(folder / "rows.md", len(names))
        for name, label in zip(names, settings):
            setting = json.loads(label.split(" (round")[0]) if label.startswith("{") else None
            for row in runs[name]["rows"]:
                op = row["op"]
                if op == "sdpa" or row.get("latency_us") is None:
                    continue
                if kind == "variants":
                    add(row, op.removesuffix("-fused"), "one" if op.endswith("-fused") else "two")
                elif kind == "rule43":
                    if rule43(row["k"], _programs(row, op), sms):
                        add(row, op, "two" if setting.get("fuse_gather") is False else "one")
                elif setting and "fuse_gather" in setting:
                    add(row, op, "one" if setting["fuse_gather"] else "two")
    done = [p for p in pairs.values() if p.one and p.two]
    return sorted(done, key=lambda p: (p.tokens, p.programs, p.k, p.model, p.op))


def judge(pair: Pair, sms: int, noise: float) -> tuple[bool, bool]:
    """``(taken, right)``: whether ``fuse_rule`` takes the one kernel for the pair's read, and whether that is the
    faster side (or a tie within ``noise`` percent)."""
    from kvcompress.kernels.doublesparse.triton_kernel import fuse_rule

    taken = fuse_rule(pair.k, pair.programs, sms, pair.tokens, pair.head_dim)
    right = abs(pair.change) * 100 <= noise or taken == (pair.change < 0)
    return taken, right


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="the SMs of the GPU the sweeps ran on (H100: 132)")
    ap.add_argument("--noise", type=float, default=2.0, help="percent within which either side is right")
    args = ap.parse_args(argv)
    pairs = measured_pairs(ROOT, args.sms)
    print("| tokens | programs | k | head dim | read | one kernel vs two | rule | right |")
    print("|---|---|---|---|---|---|---|---|")
    wrong = []
    for p in pairs:
        taken, right = judge(p, args.sms, args.noise)
        if not right:
            wrong.append(p)
        print(f"| {p.tokens} | {p.programs} | {p.k} | {p.head_dim} | {p.op} {p.model} B{p.batch} | "
              f"{p.change * 100:+.1f}% | {'one' if taken else 'two'} | {'yes' if right else '**no**'} |")
    missed = [p for p in wrong if p.change < 0]
    taken_loss = [p for p in wrong if p.change > 0]
    print(f"\n{len(pairs)} reads, {len(wrong)} chosen wrong by more than {args.noise:g}%: "
          f"{len(missed)} one-kernel wins left out (up to {max([-p.change for p in missed] or [0]) * 100:.1f}%), "
          f"{len(taken_loss)} losses taken (up to {max([p.change for p in taken_loss] or [0]) * 100:.1f}%).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
