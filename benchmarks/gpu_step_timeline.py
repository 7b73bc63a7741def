"""Where the wall time of a compiled decode step goes (issue 16), on the GPU machine:
    python benchmarks/gpu_step_timeline.py --rows static none kivi2 --batch 1 --ctx 32768 --out DIR

Llama-3-8B-shaped random bf16 model; for each row (``static`` = transformers StaticCache + compile, else a
name of kvcompress.evaluation.e2e.BUILTIN_STACKS, compiled with reduce-overhead) it splits a synchronised step
(wall) into
  host_ms     time until the compiled call returns (dynamo guards, cudagraph-tree bookkeeping, launch);
  gpu_ms      GPU time of the step's work alone, kernels and the gaps between them (CUDA events around
              the call, queued behind a long sleep kernel so the host cost is hidden);
  busy_ms     the sum of kernel durations (torch.profiler), and kernels per step;
  noguard_ms  wall with dynamo guard evaluation skipped (set_stance skip_guard_eval_unsafe);
and writes the top host functions of 20 steps (cProfile) to DIR/timeline_<row>.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import time
import traceback

import torch

from kvcompress.evaluation import e2e


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure(model, row: str, batch: int, ctx: int, steps: int, out: str) -> dict:
    if row == "static":
        spec = e2e.RowSpec("static", "transformers StaticCache + compile")
    else:
        stack = e2e.resolve_stacks([row], model)[0]
        spec = e2e.RowSpec("compiled", f"{row} + compile", stack)
    res: dict = {"row": row, "batch": batch, "ctx": ctx}
    cuda = next(model.parameters()).device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 3 + 5 * steps + 30
    with contextlib.ExitStack() as scope, torch.no_grad():
        dec = e2e._Decoder(model, spec, batch, ctx + n + 8, scope)
        ids = torch.randint(model.config.vocab_size, (batch, ctx))
        dec.prefill(ids, 8192)
        dec.prepare(ctx, n, model.config.vocab_size, 0)
        i = 0
        t0 = time.perf_counter()
        for _ in range(3):
            dec.step(i)
            i += 1
        sync()
        res["compile_s"] = time.perf_counter() - t0

        walls, hosts, gpus = [], [], []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            dec.step(i)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            i += 1
            walls.append((t2 - t0) * 1e3)
            hosts.append((t1 - t0) * 1e3)
        for _ in range(steps):
            sync()
            if not cuda:
                break
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if cuda:
                torch.cuda._sleep(200_000_000)  # ~100 ms: the host queues the step behind it
            e0.record()
            dec.step(i)
            e1.record()
            sync()
            i += 1
            gpus.append(e0.elapsed_time(e1))
        res.update(wall_ms=median(walls), host_ms=median(hosts), gpu_ms=median(gpus) if gpus else None)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            ng = []
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                dec.step(i)
                sync()
                ng.append((time.perf_counter() - t0) * 1e3)
                i += 1
        res["noguard_ms"] = median(ng)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                dec.step(i)
                i += 1
            sync()
        busy, count = e2e.kernel_time(prof)
        res["busy_ms"], res["kernels_per_step"] = busy / 5, count / 5
        kt = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=80)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            dec.step(i)
            i += 1
        pr.disable()
        sync()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(out, f"timeline_{row}_b{batch}.txt"), "w") as f:
            f.write(json.dumps(res) + "\n\n" + kt + "\n\n" + s.getvalue())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["static", "none", "kivi2"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="out")
    ap.add_argument("--shape", default="llama3-8b", help="a kvcompress.evaluation.e2e.SHAPES name (tiny: CPU smoke)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = e2e.random_model(args.shape, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    results = []
    for row in args.rows:
        try:
            r = measure(model, row, args.batch, args.ctx, args.steps, args.out)
        except Exception as exc:  # one row's failure never ends the run
            r = {"row": row, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, f"timeline_b{args.batch}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'row':24} {'wall':>7} {'host':>7} {'gpu':>7} {'busy':>7} {'kern':>6} {'noguard':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['row']:24} ERROR {r['error'][:200]}")
            continue
        print(f"{r['row']:24} {r['wall_ms']:7.2f} {r['host_ms']:7.2f} {r['gpu_ms'] or 0:7.2f} {r['busy_ms']:7.2f} "
              f"{r['kernels_per_step']:6.0f} {r['noguard_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
