"""Left padding vs each row alone, for every registered compressor (docs/results.md, "Conformance"):
    python benchmarks/padding_alignment.py [--pads 3 16]
Prints the max |logit difference| between row 0 of a left-padded batch of two and the same row alone (prefill of
29 real tokens + 12 teacher-forced decode steps, tiny random Llama, fp32, CPU), with the configurations of
tests/test_conformance.py."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_conformance as conf  # noqa: E402
from models import tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pads", type=int, nargs="+", default=[3, 16])
    args = ap.parse_args()
    registry = conf.make_registry()
    model = tiny_model("llama", layers=1)
    basis = conf.make_basis(model, Path(tempfile.mkdtemp(prefix="padding")))
    print("| compressor | " + " | ".join(f"padding {p}" for p in args.pads) + " |")
    print("|---|" + "---|" * len(args.pads))
    for name in sorted(conf.CONFIGS):
        stack = conf._stack(registry, name, basis)
        cells = []
        for pad in args.pads:
            ids = torch.randint(1, 256, (2, conf.PROMPT + pad + conf.STEPS), generator=torch.Generator().manual_seed(1))
            mask = torch.ones_like(ids)
            mask[0, :pad] = 0
            batch, _ = conf._teacher_forced(model, stack, ids, mask, conf.STEPS)
            alone, _ = conf._teacher_forced(model, stack, ids[:1, pad:], mask[:1, pad:], conf.STEPS)
            cells.append(f"{(batch[:, 0] - alone[:, 0]).abs().max().item():.1e}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
