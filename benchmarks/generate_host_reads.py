"""Device-to-host reads (syncs on a GPU) per decode step of ``model.generate`` with a kvcompress cache, batch 1
and a left-padded batch of 2, on the tiny random Llama (CPU): counts the ``item`` / ``is_nonzero`` /
``_local_scalar_dense`` / ``nonzero`` dispatches of a 9-token generation minus a 1-token one, over 8 steps.
Plain transformers' generate is printed beside them (its stopping criteria read the device too).

    .venv/bin/python benchmarks/generate_host_reads.py [--stack none kivi2 window-4+1020 ...]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.e2e import random_model, resolve_stacks

READS = ("item", "is_nonzero", "_local_scalar_dense", "nonzero")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def reads(model, stack, ids, mask, new: int) -> int:
    counter = _Count()
    with torch.no_grad(), counter:
        if stack is None:
            model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        else:
            with kvcompress.compress(model, stack) as cache:
                model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               **{hf.cache_kwarg(model): cache})
    return counter.n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", nargs="*", default=["none", "kivi2", "window-4+1020", "paged-1024"])
    args = ap.parse_args(argv)
    model = random_model("tiny", "cpu", torch.float32)
    layers = model.config.num_hidden_layers
    print(f"tiny random Llama, {layers} layers; host reads per decode step (8 steps)")
    print("| cache | batch 1 | batch 2, one row left-padded |\n|---|---|---|")
    for label, stack in [("transformers (plain generate)", None)] + [
            (st.label, st) for st in resolve_stacks(args.stack, model)]:
        cells = []
        for bs in (1, 2):
            ids = torch.randint(1, 200, (bs, 300), generator=torch.Generator().manual_seed(bs))
            mask = torch.ones_like(ids)
            if bs == 2:
                mask[1, :5] = 0
            cells.append((reads(model, stack, ids, mask, 9) - reads(model, stack, ids, mask, 1)) / 8)
        print(f"| {label} | {cells[0]:.1f} | {cells[1]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
