"""What an unplanned compiled decode step runs beyond a planned one, counted on the CPU (issue 19, session 61).

``transformers``' ``generate`` compiles the decode step of a static kvcompress cache itself
(``mode="reduce-overhead"``) and never asks the cache for a plan (``Cache.plan_step``), so every step offers a block
to the pipeline and lets the device decide; :class:`kvcompress.GraphStep` plans each step and compiles one variant
per plan (a step that flushes nothing runs no flush ops).  This counts, for a tiny random Llama (``--layers``), one
decode step after a prompt of about 100 tokens (the first length whose next step flushes nothing):

* aten ops of the traced forward graph (AOTAutograd, before any fusion), and
* kernels of the Inductor CPU code (fused loops + external calls): a proxy for the GPU kernels of a CUDA graph,

unplanned and planned, per stack::

    python benchmarks/unplanned_step_ops.py [--layers 2] [--stack none window leank kivi2 leank+kivi2]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

import kvcompress
from kvcompress.adapters.hf import cache_kwarg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import tiny_model  # noqa: E402

LEANK = {"leank": {"mask": "rope", "ratio": 0.7, "align": 4, "sinks": 4, "local": 24, "flush": 16}}
KIVI2 = {"kivi": {"bits": 2, "group": 16, "residual": 16}}
STACKS = {"none": [], "window": [{"window": {"sinks": 4, "recent": 28}}], "leank": [LEANK], "kivi2": [KIVI2],
          "leank+kivi2": [LEANK, KIVI2]}
PROMPT = 100


def _step(name: str, layers: int, planned: bool, compile_fn, prompt: int, quiet: bool = True):
    """``compile_fn(model, step kwargs)`` on the decode step after ``prompt`` tokens; with ``planned`` and ``quiet``,
    None when that step flushes a block (the caller tries the next length)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny_model("llama", layers=layers)
    ids = torch.randint(1, 200, (1, prompt + 1))
    with kvcompress.compress(model, {"compressors": STACKS[name]}, max_cache_len=prompt + 64) as cache, \
            torch.no_grad():
        kw = cache_kwarg(model)
        model(ids[:, :prompt], **{kw: cache})
        if cache.get_seq_length() != prompt:
            raise SystemExit(f"the model did not use the cache passed as {kw}=")
        if planned and cache.plan_step()[0] and quiet:
            cache.finish_step(False)
            return None
        try:
            return compile_fn(model, dict(input_ids=ids[:, prompt:], position_ids=torch.tensor([[prompt]]),
                                          **{kw: cache}))
        finally:
            if planned:
                cache.finish_step()


def quiet_prompt(name: str, layers: int) -> tuple[int, bool]:
    """``(length, quiet)``: the first prompt length from ``PROMPT`` whose next decode step flushes nothing, or
    ``(PROMPT, False)`` where every step flushes (a window of single-token flushes)."""
    for prompt in range(PROMPT, PROMPT + 64):
        if _step(name, layers, True, lambda model, kwargs: True, prompt):
            return prompt, True
    return PROMPT, False


def aten_ops(model, kwargs) -> int:
    from torch._functorch.aot_autograd import aot_module_simplified

    counts: collections.Counter = collections.Counter()

    def backend(gm, example_inputs):
        def forward(g, _):
            counts.update(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return g.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward)

    torch.compile(model.forward, backend=backend, fullgraph=True)(**kwargs)
    return sum(counts.values())


def inductor_kernels(model, kwargs) -> int:
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(torch.compile(model.forward, fullgraph=True), **kwargs)
    body = codes[-1].split("def call(")[-1]
    fused = re.findall(r"^\s+cpp_fused_\w+\(", body, re.M)
    calls = re.findall(r"^\s+(?:\w+ = )?(?:extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\(",
                       body, re.M)
    return len(fused) + len(calls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--stack", nargs="+", default=list(STACKS), choices=list(STACKS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, tiny random Llama, {args.layers} layers, one decode step after about {PROMPT} tokens (one "
          "that flushes nothing)")
    print("| stack | aten ops unplanned | aten ops planned | Inductor CPU kernels unplanned | kernels planned | "
          "extra kernels per layer |")
    print("|---|---|---|---|---|---|")
    for name in args.stack:
        prompt, quiet = quiet_prompt(name, args.layers)
        ops = [_step(name, args.layers, p, aten_ops, prompt, quiet) for p in (False, True)]
        ker = [_step(name, args.layers, p, inductor_kernels, prompt, quiet) for p in (False, True)]
        print(f"| {name}{'' if quiet else ' (every step flushes)'} | {ops[0]} | {ops[1]} | {ker[0]} | {ker[1]} | {(ker[0] - ker[1]) / args.layers:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
