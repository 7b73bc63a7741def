"""Host cost of calling a compiled decode step, with the compiled graph's own work taken out (issue 16).

Under ``torch.compile(mode="reduce-overhead")`` every call of the step runs torch's dispatch in Python and C++ before
the CUDA graph replays: frame evaluation, guard checks over every object and tensor the traced code touched (the
model, the cache and its layers), loading the graph's inputs, and replaying the step's Python side effects.  Session
15 measured reduce-overhead decode steps of an 8B-shaped model at 1.40-1.43x their GPU-busy time (GraphStep, which
replays one captured graph without this dispatch: 1.005x).  This script isolates the dispatch on the CPU: a tiny
random Llama with ``--layers`` layers (default 32, as Llama-3-8B), one decode step compiled with ``fullgraph=True``
through a backend that runs the graph once and then only returns that first result, so each timed call is dispatch
alone.  Rows: transformers' ``StaticCache`` and kvcompress static caches of a few stacks (capacity 64)::

    python benchmarks/compile_dispatch_cost.py [--layers 32] [--calls 300] [--rounds 3]

Prints the graph inputs of each step and the best-of-rounds µs per call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

import kvcompress
from kvcompress.adapters.hf import cache_kwarg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import tiny_model  # noqa: E402

STACKS = {
    "none": [],
    "window": [{"window": {"sinks": 4, "recent": 28}}],
    "kivi2": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "leank": [{"leank": {"mask": "rope", "ratio": 0.7, "align": 4, "sinks": 4, "local": 24, "flush": 16}}],
    "leank+kivi2": [{"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 24, "flush": 16}},
                    {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
}


def replay_first(record: list):
    """A backend that runs the graph on its first call and afterwards returns that result without any work."""
    def backend(gm, example_inputs):
        record.append(sum(isinstance(x, torch.Tensor) for x in example_inputs))
        first = {}

        def fn(*args):
            if "out" not in first:
                first["out"] = gm.forward(*args)
            return first["out"]
        return fn
    return backend


def measure(model, cache_factory, ids, calls: int, rounds: int) -> tuple[int, float]:
    record: list = []
    torch._dynamo.reset()
    with cache_factory() as cache, torch.no_grad():
        key = cache_kwarg(model)  # (transformers 5.17 takes past_key_values=, later versions cache=)
        model(ids[:, :40], **{key: cache})
        if cache.get_seq_length() != 40:
            raise SystemExit(f"the model did not use the cache passed as {key}=")
        step = torch.compile(model.forward, backend=replay_first(record), fullgraph=True)
        kw = dict(input_ids=ids[:, 40:41], position_ids=torch.tensor([[40]]), **{key: cache})
        for _ in range(5):
            step(**kw)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                step(**kw)
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return record[-1], best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from transformers import StaticCache

    torch.manual_seed(0)
    model = tiny_model("llama", layers=args.layers)
    ids = torch.randint(1, 200, (1, 48))
    weights = len(list(model.parameters())) + len(list(model.buffers()))

    @contextlib.contextmanager
    def static():
        yield StaticCache(config=model.config, max_cache_len=64)

    print(f"torch {torch.__version__}, {args.layers} layers, {weights} weight tensors")
    print("| cache | graph inputs | dispatch µs per call |")
    print("|---|---|---|")
    n, us = measure(model, static, ids, args.calls, args.rounds)
    print(f"| transformers StaticCache | {n} | {us:.0f} |")
    for name, entries in STACKS.items():
        n, us = measure(model, lambda: kvcompress.compress(model, {"compressors": entries}, max_cache_len=64), ids,
                        args.calls, args.rounds)
        print(f"| kvcompress {name} | {n} | {us:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
