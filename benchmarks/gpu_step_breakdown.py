"""Where a compiled kvcompress decode step spends its time (issue 16), on the GPU machine:
    python benchmarks/gpu_step_breakdown.py --stack kivi2 --batch 1 --ctx 32768 --out DIR
Llama-3-8B-shaped random bf16 model, static cache, prefill (eager), compiled decode (reduce-overhead);
prints wall ms per step with and without dynamo guard evaluation (torch.compiler.set_stance
skip_guard_eval_unsafe) and the top CUDA kernels of 5 profiled steps (torch.profiler)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.e2e import BUILTIN_STACKS, SHAPES


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", default="kivi2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = hf.random_llama(SHAPES["llama3-8b"], "random-llama3-8b", "cuda", torch.bfloat16)
    stack = kvcompress.parse_stack(BUILTIN_STACKS[args.stack]) if BUILTIN_STACKS[args.stack]["compressors"] else None
    b, ctx = args.batch, args.ctx
    kw = hf.cache_kwarg(model)
    res = {"stack": args.stack, "batch": b, "ctx": ctx}
    with kvcompress.compress(model, stack, max_cache_len=ctx + 64, max_batch_size=b) as cache, torch.no_grad():
        ids = torch.randint(1000, (b, ctx), device="cuda")
        for s in range(0, ctx, 8192):
            model(ids[:, s:s + 8192], position_ids=torch.arange(s, min(ctx, s + 8192), device="cuda")[None].expand(b, -1),
                  logits_to_keep=1, **{kw: cache})
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        tok = torch.randint(1000, (b, 1), device="cuda")
        pos = [torch.full((b, 1), ctx + i, device="cuda") for i in range(60)]
        i = 0

        def run():
            nonlocal i
            torch.compiler.cudagraph_mark_step_begin()
            step(input_ids=tok, position_ids=pos[i], logits_to_keep=1, **{kw: cache})
            i += 1

        t0 = time.time()
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        res["compile_s"] = time.time() - t0
        for label, unsafe in (("guards", False), ("no_guard_eval", True)):
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=unsafe):
                ts = []
                for _ in range(args.steps // 2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    ts.append((time.perf_counter() - t0) * 1e3)
            ts.sort()
            res[f"wall_ms_{label}"] = ts[len(ts) // 2]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
        res["top_kernels"] = table
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=90)
        res["top_cpu"] = cpu
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("top")}))
    print(res["top_kernels"])
    print(res["top_cpu"])
    with open(os.path.join(args.out, f"breakdown_{args.stack}_b{b}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
