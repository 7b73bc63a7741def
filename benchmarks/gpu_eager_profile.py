"""Where an eager (dynamic-cache) decode step's host time goes, by Python function, at two batch sizes.

    python benchmarks/gpu_eager_profile.py --stack kivi4 --points 1x4096,8x4096 [--device cuda] > OUT/profile.txt

Llama-3-8B shape with random weights (``--model-shape tiny`` for a CPU smoke run), ``kvcompress.compress(model,
stack)`` without a capacity (the eager path users get by default), one prefill, a few warm-up steps, then the median
wall time of ``--steps`` synchronised decode steps and cProfile's top functions by own time and by cumulative time
over ``--steps`` more steps.  Host work that grows with the batch shows up as a function whose call count or time
grows between the two points.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation import e2e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", nargs="+", default=["kivi4"])
    ap.add_argument("--points", default="1x4096,8x4096")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--model-shape", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = e2e.random_model(args.model_shape, dev, dtype, 0)
    kw = hf.cache_kwarg(model)  # "past_key_values" before transformers 5.24: an unknown "cache=" is ignored
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for stack in e2e.resolve_stacks(args.stack, model):
        for batch, ctx in e2e.parse_points(args.points):
            ids = torch.randint(model.config.vocab_size, (batch, ctx), device=dev)
            step = torch.randint(model.config.vocab_size, (batch, 1), device=dev)
            with kvcompress.compress(model, stack) as cache, torch.no_grad():
                model(ids, logits_to_keep=1, **{kw: cache})
                pos = ctx

                def one() -> None:
                    nonlocal pos
                    model(step, position_ids=torch.full((batch, 1), pos, device=dev), logits_to_keep=1, **{kw: cache})
                    pos += 1

                for _ in range(3):
                    one()
                sync()
                times = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    one()
                    sync()
                    times.append((time.perf_counter() - t) * 1e3)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    one()
                sync()
                prof.disable()
            del cache
            # the same row through the end-to-end benchmark's harness, in this process (session 12 saw its eager
            # rows take up to 2x this script's steps; this line says whether the harness or the run differs)
            row = e2e.measure_row(model, e2e.RowSpec("eager", stack.label, stack), batch, ctx, steps=args.steps,
                                  warmup=3, profile_steps=0)
            print(f"\n==== {stack.label} B{batch}/{ctx}: median {statistics.median(times):.2f} ms/step "
                  f"(eager, dynamic cache; e2e.measure_row in this process: {row['wall_ms'] or float('nan'):.2f} ms, "
                  f"error {row['error']}), cProfile over {args.steps} steps")
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
                print("\n".join(buf.getvalue().splitlines()[4:]))
            torch.cuda.empty_cache() if dev.type == "cuda" else None


if __name__ == "__main__":
    main()
