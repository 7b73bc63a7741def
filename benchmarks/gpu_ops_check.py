"""GPU check of the registered kernel ops (kvcompress.kernels.ops) under CUDA graphs, with timings.

For every op and every implementation its CUDA kernel accepts (``reference``, ``triton``; KIVI also ``cuda``, the
hand-written v3 kernel, when ``ops.choose`` finds nvcc and a capable GPU), at small odd shapes and Llama-3-8B-like
shapes (32 query / 8 kv heads, head_dim 128, B 1 and 8, ~1000 and ~16000 live tokens in a static capacity, a random
``valid`` mask with padding and a dead row), the call the core makes (the dispatchers with ``impl=``) is compiled
with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` and checked against the eager PyTorch reference on
the same device; then timed (CUDA events over replays of the captured graph; the cache buffers are marked as static
addresses, as a static cache's are) next to the same implementation uncompiled.  One failing case never stops the
others: its error is recorded.

Run from the repository root on a GPU machine::

    python benchmarks/gpu_ops_check.py --out DIR [--quick] [--ops kivi_partial,paged_partial] [--shapes small]
        [--calls 50]

Writes ``DIR/gpu_ops_check.json`` (rewritten after every case, so a crash keeps what ran) and prints a table.
Exit status 0 when every case passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from kvcompress.kernels import opcases, ops

LIVE = {1024: 1001, 16384: 16001}  # capacity -> live tokens (odd, below the capacity)
# the reference computed this many batch rows at a time (OpCase.reference): its fp32 copies of a whole Llama
# B64 / 128k cache (34 GB each) did not fit beside the cache on an 80 GB H100 (session 39)
REF_BATCH_CHUNK = 8


def head_cases(batch: int, capacity: int, live: int, device: str, only: set[str], kv: int = 8, rows: int = 4,
               d: int = 128, dtype: torch.dtype = torch.float16) -> list:
    """Builders (op, thunk) of the cases of one head shape (default Llama-3-8B: 8 kv heads x 4 query rows, d = 128;
    SmolLM2: 3 x 3, d = 64).  ``dtype``: the model's (queries and full-precision K / V; KIVI scales stay fp16, as
    the stores hold them)."""
    todo = []

    def add(op, make):
        if op in only:
            todo.append((op, make))

    for bits in (2, 4):
        add("kivi_partial", lambda bits=bits: opcases.kivi_case(batch, kv, rows, d, capacity, live, bits=bits,
                                                                query_dtype=dtype, device=device, seed=bits))
    add("paged_partial", lambda: opcases.paged_case(batch, kv, rows, d, capacity, live, page=16, dtype=dtype,
                                                    device=device))
    counts = tuple((0, 1, 1, 2, 2, 3, 3, 4)[i % 8] * d // 4 for i in range(kv))  # a LeanK-like mix of kept channels
    add("lanes_partial", lambda: opcases.lanes_case(batch, kv, rows, d, capacity, live, counts=counts,
                                                    dense_tokens=1024, dtype=dtype, device=device))
    # the empty stack's / low rank's read: every head in one lane, the output in the read's dtype (out_dtype)
    add("lanes_partial", lambda: opcases.lanes_case(batch, kv, rows, d, capacity, live, counts=(0,) * kv,
                                                    dense_tokens=capacity, dtype=dtype, device=device, seed=31,
                                                    out_dtype=dtype))
    # the low-rank read (session 58): a rank d / 2 lane of two heads (the query projected in the kernel) beside a
    # 1024-token full-width lane of every head
    add("lanes_partial", lambda: opcases.lanes_case(batch, kv, rows, d, capacity, live, counts=(0,) * kv,
                                                    dense_tokens=1024, rank=d // 2, dtype=dtype, device=device,
                                                    seed=41))
    for bits in (2, 4):  # the stacked LeanK + KIVI middle, one region of lanes
        add("kivi_lanes_partial", lambda bits=bits: opcases.kivi_lanes_case(
            batch, kv, rows, d, capacity, live, bits=bits, counts=counts, query_dtype=dtype, device=device,
            seed=20 + bits))
    k = max(16, live // 16)
    for bits in (16, 4):
        add("select_topk", lambda bits=bits: opcases.select_case(batch, kv, rows, capacity, d, r=16, bits=bits, k=k,
                                                                 query_dtype=dtype, device=device))
    for shared in (False, True):
        add("gather_partial", lambda shared=shared: opcases.gather_case(batch, kv, rows, capacity, d, k,
                                                                        shared=shared, dtype=dtype, device=device))
    return todo


# issue 19's grid (kernels.benchutil): head shapes, batches, contexts; the check reads ctx - 37 live tokens (odd, not
# a multiple of any tile) of a capacity of ctx + 128 slots, with the cases' random valid masks (left padding of row
# 0, evicted slots, a dead last row)
GRID_HEADS = {"llama3-8b": (8, 4, 128), "smollm2-135m": (3, 3, 64)}
GRID_BATCHES = (1, 4, 16, 64)
GRID_CONTEXTS = (4096, 32768, 131072)


def grid_plan(only: set[str], device: str, dtype: torch.dtype = torch.float16) -> list[tuple[str, str, object]]:
    out = []
    tag = "" if dtype == torch.float16 else "-" + str(dtype).removeprefix("torch.")
    for model, (kv, rows, d) in GRID_HEADS.items():
        for batch in GRID_BATCHES:
            for ctx in GRID_CONTEXTS:
                live = ctx - 37
                for op, make in head_cases(batch, ctx + 128, live, device, only, kv, rows, d, dtype):
                    out.append((f"grid-{model}-b{batch}-{ctx // 1024}k-live{live}{tag}", op, make))
    return out


def plan(args) -> list[tuple[str, str, object]]:
    """``(shape label, op, thunk building the case)`` for every case to run."""
    only = set(args.ops.split(",")) if args.ops else set(ops.OPS)
    if args.grid:
        return grid_plan(only, args.device, getattr(torch, args.dtype))
    out = [("small", c.op, (lambda c=c: c)) for c in opcases.small_cases(args.device) if c.op in only]
    shapes = [(1, 1024), (8, 16384)] if args.quick else [(b, c) for b in (1, 8) for c in (1024, 16384)]
    for batch, capacity in shapes:
        for op, make in head_cases(batch, capacity, LIVE[capacity], args.device, only):
            out.append((f"llama-b{batch}-cap{capacity}-live{LIVE[capacity]}", op, make))
    if not args.quick:  # a static cache barely filled: what skipping the dead capacity buys (Triton) or not (v3)
        for op, make in head_cases(8, 16384, 1001, args.device, only & {"kivi_partial", "paged_partial",
                                                                          "lanes_partial"}):
            out.append(("llama-b8-cap16384-live1001", op, make))
    return out


def check_eager(case, impl: str, ref) -> dict:
    """``case.fn(impl)`` uncompiled against ``ref``, the case's eager reference on the same device (computed once per
    case, :data:`REF_BATCH_CHUNK` batch rows at a time)."""
    ok, err, msg = case.check(case.fn(impl)(*case.args), ref)
    return {"ok": bool(ok), "max_abs_err": float(err), "message": msg, "ms_per_call": None,
            "eager_ms_per_call": None}


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_ops_check.json")
    p.add_argument("--quick", action="store_true", help="B 1 / 1k and B 8 / 16k only")
    p.add_argument("--ops", default="", help=f"comma-separated subset of {sorted(ops.OPS)}")
    p.add_argument("--shapes", default="", help="comma-separated substrings of the shape labels to run (e.g. "
                   "small,llama-b1); default all")
    p.add_argument("--calls", type=int, default=50, help="timed calls per case")
    p.add_argument("--grid", action="store_true", help="issue 19's grid instead: both head shapes, B 1-64, 4k-128k "
                   "contexts, ctx - 37 live tokens with padding and a dead row (with --eager: ~10 min on an H200 "
                   "for all ops; split it with --shapes)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="with --grid: the model dtype of the cases (queries, full-precision K / V; KIVI scales stay "
                   "fp16); bf16 shape labels end in -bfloat16")
    p.add_argument("--eager", action="store_true", help="check each impl uncompiled against the reference (no "
                   "compile, no timings)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only as a smoke test of this script (the ops' CPU "
                   "implementation is the reference whatever impl says; no timings)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_ops_check: needs a CUDA device", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_ops_check.json"
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    report = {"environment": environment(), "command": " ".join(sys.argv), "results": []}

    def save():
        rs = report["results"]
        report["summary"] = {"cases": len(rs), "passed": sum(r.get("ok") is True for r in rs),
                             "failed": sum(r.get("ok") is False for r in rs),
                             "errors": sum("error" in r for r in rs), "skipped": sum("skipped" in r for r in rs)}
        path.write_text(json.dumps(report, indent=1))

    wanted = [w for w in args.shapes.split(",") if w]
    for shape, op, make in plan(args):
        if wanted and not any(w in shape for w in wanted):
            continue
        try:
            case = make()
        except Exception as exc:  # a case that cannot be built (e.g. out of memory) is recorded, not fatal
            report["results"].append({"shape": shape, "op": op, "error": f"building: {type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-3000:]})
            save()
            continue
        chosen = ops.choose(op, args.device, **case.facts)
        ref = None
        if args.eager:  # once per case, not per implementation
            try:
                ref = case.reference(REF_BATCH_CHUNK)
            except Exception as exc:
                report["results"].append({"shape": shape, "op": op, "case": case.name,
                                          "error": f"reference: {type(exc).__name__}: {exc}"[:2000],
                                          "traceback": traceback.format_exc()[-3000:]})
                save()
                del case
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
        for impl in ops.OPS[op]:
            row = {"shape": shape, "op": op, "case": case.name, "impl": impl, "chosen_by_choose": chosen}
            if impl == "cuda" and chosen != "cuda":
                row["skipped"] = f"choose() gives {chosen!r} here (nvcc, device or shape)"
                report["results"].append(row)
                print(f"SKIP  {shape:28s} {case.name:46s} {impl:9s} {row['skipped']}", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                if args.eager:
                    row.update(check_eager(case, impl, ref))
                else:
                    torch._dynamo.reset()
                    row.update(opcases.check_compiled(case, impl, mode="reduce-overhead", time_calls=args.calls))
            except torch.OutOfMemoryError as exc:
                if impl == "reference" and ref is not None:  # the oracle above is the same code, a few rows at a time
                    row["skipped"] = (f"the reference over the whole batch does not fit ({exc}"[:160] + "); the "
                                      f"kernels are checked against it computed {REF_BATCH_CHUNK} batch rows at a time")
                else:
                    row.update(ok=None, error=f"{type(exc).__name__}: {exc}"[:2000],
                               traceback=traceback.format_exc()[-3000:])
            except Exception as exc:  # one failing op / impl never stops the others
                row.update(ok=None, error=f"{type(exc).__name__}: {exc}"[:2000],
                           traceback=traceback.format_exc()[-3000:])
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            report["results"].append(row)
            save()
            if "skipped" in row:
                print(f"SKIP  {shape:28s} {case.name:46s} {impl:9s} {row['skipped']}", flush=True)
                continue
            status = "PASS" if row.get("ok") else ("ERROR" if "error" in row else "FAIL")
            ms = row.get("ms_per_call")
            eager = row.get("eager_ms_per_call")
            print(f"{status:5s} {shape:28s} {case.name:46s} {impl:9s} err {row.get('max_abs_err', float('nan')):.2e}"
                  f"  graph {ms if ms is None else round(ms, 4)} ms  eager {eager if eager is None else round(eager, 4)}"
                  f" ms  {row.get('message') or row.get('error', '')[:200]}", flush=True)
        del case, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()
    s = report["summary"]
    print(f"{s['passed']} passed, {s['failed']} failed, {s['errors']} errors, {s['skipped']} skipped -> {path}")
    return 0 if s["failed"] == 0 and s["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
