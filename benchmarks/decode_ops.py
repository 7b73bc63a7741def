"""Count the aten ops one decode step issues (torch.profiler, CPU): plain transformers vs kvcompress stacks.

Every op is a kernel launch on a GPU, so this is a first measure of kvcompress' per-step host work:

    python benchmarks/decode_ops.py [--context 1024] [--stack examples/stacks/none.yaml examples/stacks/kivi2.yaml]

Default model (SmolLM2-135M-Instruct), bf16, one prefill of ``--context`` random tokens, 3 warm-up steps, then
4 profiled decode steps; prints aten ops per step.  On the CPU the stacks' attention runs the PyTorch
references, whose ops are counted too.
"""

from __future__ import annotations

import argparse

import torch


def ops_per_step(model, ids, cache, steps: int = 4) -> float:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        for _ in range(3):
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                model(ids[:, -1:], past_key_values=cache, use_cache=True)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps


def main(argv=None) -> int:
    import kvcompress
    from kvcompress.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--stack", nargs="*", default=["examples/stacks/none.yaml", "examples/stacks/kivi2.yaml"])
    ap.add_argument("--static", action="store_true", help="also count the static cache (max_cache_len), eager")
    args = ap.parse_args(argv)
    model = load_model(None, dtype=torch.bfloat16)
    model = model[0] if isinstance(model, tuple) else model
    ids = torch.randint(1, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
    from transformers import DynamicCache

    print(f"plain transformers: {ops_per_step(model, ids, DynamicCache()):.0f} aten ops per decode step")
    for path in args.stack:
        with kvcompress.compress(model, kvcompress.load_stack(path)) as cache:
            print(f"{path}: {ops_per_step(model, ids, cache):.0f} aten ops per decode step")
        if args.static:
            with kvcompress.compress(model, kvcompress.load_stack(path), max_cache_len=args.context + 16) as cache:
                print(f"{path} (static, eager): {ops_per_step(model, ids, cache):.0f} aten ops per decode step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
