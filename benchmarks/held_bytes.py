"""Bytes a stack's cache holds after the prompt, at the end of decoding and at the peak, step by step (CPU).

Each stack prefills the first window of the perplexity text (``docs/data/ppl_windows.json``: 2048 tokens of the
default model's tokenizer) and then decodes the window's next ``--steps`` tokens teacher-forced, one per step, as
``kvcompress eval --task ppl`` does; the memory report is read after the prompt and after every step.  Bytes are
the report's ``cache_bytes`` (what the cache's tensors hold, capacity included) against the dense cache of the same
tokens in the model's dtype (``dense_native_bytes``).

    python benchmarks/held_bytes.py examples/stacks/snapkv25.yaml examples/stacks/none.yaml [--steps 256] \\
        [--dtype float32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stacks", nargs="+", help="stack YAML files")
    ap.add_argument("--steps", type=int, default=256, help="decode steps after the prompt (default 256)")
    ap.add_argument("--at", default="1,16,64,256", help="decode steps after which the table shows the bytes held")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", help="also write the rows as JSON")
    ap.add_argument("--prompt", type=int, default=2048,
                    help="prompt tokens, 1 to 2048 (default 2048; the window's first 2048 tokens)")
    args = ap.parse_args(argv)
    if not 1 <= args.prompt <= 2048:
        ap.error(f"--prompt: expected 1 to 2048 tokens (the perplexity window holds 2048 + 257), got {args.prompt}")

    import torch

    import kvcompress
    from kvcompress.models import load_model

    window = json.loads((ROOT / "docs/data/ppl_windows.json").read_text())["windows"][0]
    ids = torch.tensor([window])  # 2048 + 256 + 1 token ids
    prompt = args.prompt
    steps = min(args.steps, ids.shape[1] - prompt)
    stacks = [kvcompress.load_stack(s) for s in args.stacks]  # every file validated before the model loads
    model, _ = load_model(None, dtype=getattr(torch, args.dtype))
    from kvcompress.adapters import hf

    kw = hf.cache_kwarg(model)  # ``cache`` from transformers 5.24, ``past_key_values`` before
    rows = []
    for path, stack in zip(args.stacks, stacks):
        t0 = time.time()
        with kvcompress.compress(model, stack) as cache, torch.no_grad():
            model(ids[:, :prompt], **{kw: cache})
            first = end = cache.memory_report()
            held, dense = [first.cache_bytes], [first.dense_native_bytes]  # after the prompt, then each step
            for t in range(prompt, prompt + steps):
                model(ids[:, t:t + 1], position_ids=torch.full((1, 1), t), **{kw: cache})
                end = cache.memory_report()
                held.append(end.cache_bytes)
                dense.append(end.dense_native_bytes)
        row = {"stack": stack.label, "file": path, "tokens_after_prompt": prompt, "steps": steps,
               "after_prompt": first.cache_bytes, "after_prompt_x_dense": first.cache_bytes / first.dense_native_bytes,
               "end": end.cache_bytes, "end_x_dense": end.cache_bytes / end.dense_native_bytes, "peak": max(held),
               "segments_end": end.segments, "held_per_step": held, "dense_per_step": dense}
        rows.append(row)
        print(f"{stack.label}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    at = [n for n in map(int, args.at.split(",")) if n <= steps]
    print(f"Bytes held / the dense cache of the same tokens ({args.dtype}), after the {prompt}-token prompt and after "
          "N decode steps; peak in MiB\n")
    print("| stack | prompt | " + " | ".join(f"{n} steps" for n in at) + " | peak MiB |")
    print("|---|---|" + "---|" * len(at) + "---|")
    for r in rows:
        cells = [f"{r['held_per_step'][n] / r['dense_per_step'][n]:.3f}x" for n in at]
        print(f"| {r['stack']} | {r['after_prompt_x_dense']:.3f}x | " + " | ".join(cells) +
              f" | {r['peak'] / 2**20:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
