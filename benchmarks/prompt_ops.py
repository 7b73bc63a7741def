"""How many aten ops a chunked prompt dispatches, per stack - on a GPU each is a kernel launch (or more), so a stack
whose prompt adds tens of thousands of small ops is launch-bound there, whatever the CPU timing says:
    python benchmarks/prompt_ops.py --stack none paged-1024 paged-1024-kivi2

A tiny random Llama (8 layers, 4/2 heads x 16) on the CPU takes 8 x 16384 prompt tokens in 2048-token calls on a
static cache: the batch, length and chunking of ``benchmarks/prefill_time.py --device cuda``, whose host work (pages,
boundaries, lanes) depends on rows and tokens, not on the head size.  Session 63: PagedEviction's page boundaries and
page writes before and after their host-side rewrite.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.e2e import BUILTIN_STACKS


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", nargs="+", default=["none", "paged-1024"],
                    help="names of kvcompress bench's stacks, or stack YAML files (examples/stacks/)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=args.prompt)
    model = LlamaForCausalLM(config).eval()
    kw = hf.cache_kwarg(model)
    ids = torch.randint(1, 256, (args.batch, args.prompt))
    print(f"aten ops of a {args.batch} x {args.prompt} prompt in {args.chunk}-token calls, {args.layers} layers, "
          f"static cache\n\n| stack | aten ops | beyond none |\n|---|---|---|")
    base = None
    for name in args.stack:
        if name in BUILTIN_STACKS:
            stack = kvcompress.parse_stack(BUILTIN_STACKS[name], source=f"--stack {name}")
        elif os.path.isfile(name):
            stack = kvcompress.load_stack(name)
        else:
            raise SystemExit(f"--stack: expected one of {', '.join(BUILTIN_STACKS)} or a stack file, got {name!r}")
        count = _Count()
        with kvcompress.compress(model, stack, max_cache_len=args.prompt) as cache, torch.no_grad(), count:
            for a in range(0, args.prompt, args.chunk):
                b = min(args.prompt, a + args.chunk)
                model(ids[:, a:b], **{kw: cache},
                      position_ids=torch.arange(a, b).expand(args.batch, -1))
        if cache.get_seq_length() != args.prompt:
            raise SystemExit(f"{name}: the cache saw {cache.get_seq_length()} of {args.prompt} tokens")
        base = count.ops if name == "none" else base
        print(f"| {name} | {count.ops} | {'-' if base is None or name == 'none' else count.ops - base} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
