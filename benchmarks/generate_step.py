"""The decode step of ``model.generate`` itself on a static kvcompress cache (transformers compiles it on CUDA):
    python benchmarks/generate_step.py --rows static none leank-rope70 leank-rope70@reduce-overhead \
        leank-rope70@unplanned --batch 8 --ctx 16384

Llama-3-8B-shaped random bf16 model.  A row is a kvcompress.evaluation.e2e.BUILTIN_STACKS name, run by
``model.generate`` inside ``kvcompress.compress`` on a static cache (``max_cache_len``), or ``static``: transformers'
own StaticCache, no kvcompress.  Suffixes:
  (none)             generate without a compile_config: since session 62 its single-token steps replay kvcompress'
                     GraphStep graphs, one per plan key (``hf.PlannedCall`` over ``hf.CompiledForward``);
  @reduce-overhead   generate with transformers' default CompileConfig given explicitly: its own
                     ``mode="reduce-overhead"`` compiled step, each step planned by the cache (``hf.PlannedCall``);
  @unplanned         the model's own ``get_compiled_call`` restored inside the scope: transformers' compiled step with
                     no plan, as before session 62.
Each row runs one warm-up generate of ``--long`` tokens (compiles every variant), then ``--repeats`` pairs of
generates of ``--short`` and ``--long`` new tokens on fresh caches (one capacity, one attach scope per row) and the
same prompt.  The time per decode step is the difference of a pair's times over the difference of their token counts
(the prompt and the first steps cancel); the median pair is reported.  The long generates also note the time of each
step (a stopping criterion that never stops): ``step_median_ms``, the typical step, and ``steps_over_median_ms``,
what the slower steps (graph captures, flush variants' first runs) add per generate beyond it, with the slowest.
``--busy``: the GPU work per step the same way, from a profiled pair (summed kernel durations, kernel count, top
kernels), to set beside the wall time.  Greedy, with ``min_new_tokens`` = ``max_new_tokens`` (random weights may emit
the end token).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation import e2e


class _Stamps:
    """A stopping criterion that never stops and notes the host time each time ``generate`` asks it (once per new
    token, after that token's step).  ``generate`` reads its unfinished-rows flag on the host every step (a device
    sync), so the gaps between stamps are the wall time of each decode step, graph captures and flush steps included."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def one_generate(model, stack, ids, new: int, mode: str, capacity: int, chunk: int = 0, stamps=None) -> float:
    """Seconds of one ``generate`` of ``new`` tokens on a fresh static cache of ``capacity`` tokens (synchronised).
    Off CUDA (a smoke run) the step compiles with ``aot_eager`` through a ``compile_config`` that allows the CPU.
    ``stamps`` (a :class:`_Stamps`): notes the time of every step."""
    from transformers import CompileConfig, StoppingCriteriaList

    cuda = ids.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw: dict = {}
    if not cuda:
        kw["compile_config"] = hf.compile_config({"backend": "aot_eager", "fullgraph": True})
    elif mode == "reduce-overhead":
        kw["compile_config"] = CompileConfig()
    if stamps is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([stamps])
    if chunk:
        kw["prefill_chunk_size"] = chunk  # generate sends the prompt in chunks (eagerly on a kvcompress cache)
    if stack is None:
        kw["cache_implementation"] = "static"
    else:
        kw[hf.cache_kwarg(model)] = kvcompress.Cache(stack, model, max_cache_len=capacity, max_batch_size=ids.shape[0])
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, **kw)
    sync()
    dt = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, asked {new}")
    return dt


def measure(model, row: str, batch: int, ctx: int, short: int, long: int, repeats: int, busy: bool = False,
            chunk: int = 0) -> dict:
    name, _, mode = row.partition("@")
    if mode not in ("", "reduce-overhead", "unplanned"):
        raise ValueError(f"row {row!r}: the suffixes are @reduce-overhead and @unplanned")
    stack = None if name == "static" else e2e.resolve_stacks([name], model)[0]
    device = next(model.parameters()).device
    ids = torch.randint(model.config.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    cap = ctx + long + 8  # one capacity for every generate of the row (another buffer shape would recompile)
    torch._dynamo.reset()  # each row compiles its own variants (transformers keeps one compiled call per model)
    vars(model).pop("_compiled_call", None)
    with contextlib.ExitStack() as scope:
        if stack is not None:
            scope.enter_context(hf.attach(model))  # what kvcompress.compress does besides building the cache
            if mode == "unplanned":  # the method transformers defines (the scope restores it on exit)
                model.get_compiled_call = type(model).get_compiled_call.__get__(model)
        t0 = time.perf_counter()
        one_generate(model, stack, ids, long, mode, cap, chunk)
        res: dict = {"row": row, "batch": batch, "ctx": ctx, "short": short, "long": long, "prefill_chunk": chunk,
                     "warmup_s": round(time.perf_counter() - t0, 1)}
        pairs, steps = [], []
        for _ in range(repeats):
            a = one_generate(model, stack, ids, short, mode, cap, chunk)
            stamps = _Stamps()
            b = one_generate(model, stack, ids, long, mode, cap, chunk, stamps)
            pairs.append(((b - a) / (long - short) * 1e3, a, b))
            steps.append([(y - x) * 1e3 for x, y in zip(stamps.times, stamps.times[1:])])
        if busy and device.type == "cuda":  # GPU work per step: one more short / long pair under the profiler
            from torch.profiler import ProfilerActivity, profile

            tables = []
            for n in (short, long):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    one_generate(model, stack, ids, n, mode, cap, chunk)
                tables.append({r["kernel"]: (r["per_step"], r["us_per_step"])
                               for r in e2e.kernel_table(prof, 1, 10**6)})
            extra = long - short  # (not ``steps``: the stamps' per-step times below)
            per = {k: ((tables[1].get(k, (0, 0))[0] - tables[0].get(k, (0, 0))[0]) / extra,
                       (tables[1].get(k, (0, 0))[1] - tables[0].get(k, (0, 0))[1]) / extra)
                   for k in set(tables[0]) | set(tables[1])}
            res["busy_ms"] = round(sum(us for _, us in per.values()) / 1e3, 3)
            res["kernels_per_step"] = round(sum(c for c, _ in per.values()), 1)
            res["top_kernels"] = [{"kernel": k, "per_step": round(c, 2), "us_per_step": round(us, 1)}
                                  for k, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:15]]
    # each step of the long generates, from the stamps: the typical step, and what the slow ones (graph captures,
    # first flushes) add to a generate beyond it
    every = sorted(ms for run in steps for ms in run)
    res["step_median_ms"] = round(every[len(every) // 2], 3)
    res["steps_over_median_ms"] = [round(sum(run) - res["step_median_ms"] * len(run), 1) for run in steps]
    res["slowest_steps"] = [sorted(((round(ms, 2), i + 1) for i, ms in enumerate(run)), reverse=True)[:6]
                            for run in steps]
    pairs.sort()
    res["step_ms"] = round(pairs[len(pairs) // 2][0], 3)
    res["step_ms_all"] = [round(p[0], 3) for p in pairs]
    res["generate_s"] = [[round(p[1], 3), round(p[2], 3)] for p in pairs]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["static", "none", "leank-rope70", "leank-rope70@reduce-overhead",
                                                  "leank-rope70@unplanned"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (use --shape tiny)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="generate's prefill_chunk_size (0: the prompt in one "
                                                                    "call; 8 x 16k needs chunks on an 80 GB card)")
    ap.add_argument("--busy", action="store_true", help="also the GPU work per step (summed kernel time, kernels, "
                                                        "the top kernels) from one more profiled short / long pair")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = e2e.random_model(args.shape, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    model.generation_config.eos_token_id = None
    results = []
    for row in args.rows:
        try:
            r = measure(model, row, args.batch, args.ctx, args.short, args.long, args.repeats, args.busy,
                        args.prefill_chunk)
        except Exception as exc:  # one row's failure never ends the run
            r = {"row": row, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("traceback", "top_kernels")}), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, f"generate_step_b{args.batch}.json"), "w") as f:  # after every row
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                       "rows": results}, f, indent=1)
    print(f"{'row':28} {'ms/step':>8} {'median':>7} {'GPU busy':>9} {'kernels':>8}  all pairs")
    for r in results:
        busy = f"{r['busy_ms']:9.2f} {r['kernels_per_step']:8.1f}" if "busy_ms" in r else f"{'-':>9} {'-':>8}"
        print(f"{r['row']:28} " + (f"ERROR {r['error'][:200]}" if "error" in r
                                    else f"{r['step_ms']:8.2f} {r['step_median_ms']:7.2f} {busy}  {r['step_ms_all']}, "
                                         f"over the median per generate {r['steps_over_median_ms']} ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
