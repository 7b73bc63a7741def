"""Where one decode step's time goes on a GPU: plain transformers vs a kvcompress stack (host work vs kernels).

    python benchmarks/gpu_step_profile.py --out $OUT [--context 8192] [--stack examples/stacks/kivi2.yaml]

Default model in bf16 on CUDA, one prefill of ``--context`` random tokens, then: the median wall time of 20 decode
steps (synchronised per step), the aten op count per step, torch.profiler's top ops by self CPU time and by CUDA
time, and cProfile's top Python functions by own time (kvcompress' host work shows up there).  Writes
``$OUT/step_profile.txt`` (and prints it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch


def steps_ms(model, ids, cache, n: int = 20) -> float:
    out = []
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        for _ in range(5):
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        for _ in range(n):
            t = time.perf_counter()
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def profile(model, ids, cache, write) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    with torch.no_grad():
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model(ids[:, -1:], past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
        ev = prof.key_averages()
        n_aten = sum(e.count for e in ev if e.key.startswith("aten::")) / 3
        n_kern = sum(e.count for e in ev if getattr(e, "device_type", None) is not None
                     and str(e.device_type).endswith("CUDA")) / 3
        write(f"aten ops per step: {n_aten:.0f}; CUDA kernels per step: {n_kern:.0f}")
        write(ev.table(sort_by="self_cpu_time_total", row_limit=30))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
    write(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("kvcompress|kernels|plugins", 45)
    write(s.getvalue())


def main() -> int:
    import kvcompress
    from kvcompress.models import load_model
    from transformers import DynamicCache

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--stack", nargs="*", default=["examples/stacks/none.yaml", "examples/stacks/kivi2.yaml"])
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    lines: list[str] = []

    def write(x: str) -> None:
        print(x, flush=True)
        lines.append(x)

    model, _ = load_model(None, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(1, 1000, (1, a.context), generator=torch.Generator().manual_seed(0)).cuda()
    write(f"{torch.cuda.get_device_name()} torch {torch.__version__} context {a.context} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    write(f"plain transformers: {steps_ms(model, ids, DynamicCache()):.2f} ms/step")
    for path in a.stack:
        with kvcompress.compress(model, kvcompress.load_stack(path)) as cache:
            write(f"{path}: {steps_ms(model, ids, cache):.2f} ms/step")
    if not a.no_profile:
        for path in a.stack[-1:]:
            write(f"===== profile: {path}")
            with kvcompress.compress(model, kvcompress.load_stack(path)) as cache:
                with torch.no_grad():
                    model(ids, past_key_values=cache, use_cache=True)
                profile(model, ids, cache, write)
    with open(os.path.join(a.out, "step_profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
