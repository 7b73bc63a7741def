"""Greedy decoding of the default model, eager vs compiled, for every example stack (issue 16's GPU test).

For each stack: one static cache per path (``kvcompress.compress(model, stack, max_cache_len=...)``), the
same prompt (a slice of the evaluation document), the prefill run eagerly, then ``--steps`` greedy decode
steps, each path feeding back its own tokens:

* ``eager``   - ``model.forward`` as it is;
* ``compiled``- ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (CUDA graphs: what
  transformers' generate uses for a compileable cache);
* ``graph``   - :class:`kvcompress.GraphStep` over ``torch.compile(model.forward, fullgraph=True)``.

``--stacks transformers-static`` runs transformers' own ``StaticCache`` the same way (eager vs compiled, no
kvcompress): its first divergence is the noise floor of compiled bf16 decoding on this model.

Prints, per stack and dtype, whether the compiled paths' tokens equal the eager ones (and the first
divergence), the number of compiled graphs and the max |logit difference| of the steps before any
divergence.  Run on the GPU machine with kvcompress installed (benchmarks/gpu_eval.sh, phase ``greedy``):
    python benchmarks/gpu_default_greedy.py --out DIR [--steps 256] [--prompt 600] [--dtype bfloat16 float32]
``--jobs N`` runs N stacks at once, one process each (each compile is mostly single-threaded host work).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import traceback

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.data import document_tokens
from kvcompress.models import load_model


#: pseudo stack: transformers' own StaticCache (no kvcompress), for the noise floor of compiled vs eager decoding
TRANSFORMERS_STATIC = "transformers-static"


def decode(model, stack, prompt_ids, steps, mode):
    from kvcompress.evaluation.runner import static_cache

    kw = hf.cache_kwarg(model)
    n = prompt_ids.shape[1]
    capacity = n + steps + 8
    tokens, logits = [], []
    with static_cache(model, stack, capacity) as cache, torch.no_grad():
        if mode == "compiled":
            fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        elif mode == "graph":
            if stack is None:
                raise ValueError("GraphStep serves kvcompress caches only (transformers-static: use --modes compiled)")
            fn = kvcompress.GraphStep(torch.compile(model.forward, fullgraph=True), warmup=2)
        else:
            fn = model.forward
        out = model(prompt_ids, **{kw: cache})
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            pos = torch.full((1, 1), n + i, dtype=torch.long, device=prompt_ids.device)
            if mode == "compiled":
                torch.compiler.cudagraph_mark_step_begin()
            o = fn(input_ids=tok, position_ids=pos, **{kw: cache}, logits_to_keep=1)
            last = o.logits[:, -1].float()
            logits.append(last.clone())
            tok = last.argmax(-1, keepdim=True)
            tokens.append(tok.clone())
    return torch.cat(tokens, 1)[0], torch.stack(logits)[:, 0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=600, help="prompt tokens (a slice of the evaluation document)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--stacks", nargs="*", default=None, help="stack files (default: examples/stacks/*.yaml); "
                    f"'{TRANSFORMERS_STATIC}' = transformers' own StaticCache, eager vs compiled: the noise floor "
                    "(with --modes compiled)")
    ap.add_argument("--modes", nargs="+", default=["compiled", "graph"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--jobs", type=int, default=1, help="stacks run at once, one process each")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    files = args.stacks or sorted(glob.glob("examples/stacks/*.yaml"))
    if args.jobs > 1 and len(files) > 1:
        return run_jobs(args, files)
    rows = []
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        model, tokenizer = load_model(None, dtype=dtype, device=args.device)
        model.eval()
        ids = torch.tensor([document_tokens(tokenizer)[:args.prompt]], device=args.device)
        for path in files:
            row = {"stack": os.path.basename(path), "dtype": dtype_name}
            t0 = time.time()
            try:
                stack = None if path == TRANSFORMERS_STATIC else kvcompress.load_stack(path)
                ref_tok, ref_logits = decode(model, stack, ids, args.steps, "eager")
                for mode in args.modes:
                    if stack is None and mode == "graph":
                        continue
                    torch.compiler.reset()
                    from torch._dynamo.utils import counters

                    counters.clear()
                    tok, logits = decode(model, stack, ids, args.steps, mode)
                    diff = (tok != ref_tok).long()
                    first = int(diff.argmax()) if bool(diff.any()) else None
                    upto = args.steps if first is None else first + 1  # logits of the steps on equal inputs
                    row[mode] = {"identical": first is None, "first_divergence": first,
                                 "max_abs_logit_diff": (logits[:upto] - ref_logits[:upto]).abs().max().item(),
                                 "graphs": int(counters["stats"]["unique_graphs"])}
                row["ok"] = all(row[m]["identical"] for m in args.modes if m in row)
            except Exception as exc:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                row["traceback"] = traceback.format_exc()[-2000:]
                row["ok"] = False
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            with open(os.path.join(args.out, "default_greedy.json"), "w") as f:
                json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "steps": args.steps,
                           "prompt": args.prompt, "rows": rows}, f, indent=1)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0 if all(r["ok"] for r in rows) else 1


def run_jobs(args, files) -> int:
    """One child process per stack file (``--jobs`` at a time); their rows merged into one JSON."""
    pending, running, rows = list(files), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            path = pending.pop(0)
            sub = os.path.join(args.out, f"job-{os.path.basename(path)}")
            cmd = [sys.executable, __file__, "--out", sub, "--steps", str(args.steps), "--prompt", str(args.prompt),
                   "--device", args.device, "--dtype", *args.dtype, "--modes", *args.modes, "--stacks", path]
            log = open(sub + ".log", "w")
            running.append((path, sub, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(1)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            path, sub, proc, log = item
            log.close()
            try:
                with open(os.path.join(sub, "default_greedy.json")) as f:
                    got = json.load(f)["rows"]
            except (OSError, ValueError, KeyError):
                got = [{"stack": os.path.basename(path), "ok": False, "error": f"child exit {proc.returncode}"}]
            for row in got:
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            with open(os.path.join(args.out, "default_greedy.json"), "w") as f:
                json.dump({"torch": torch.__version__, "steps": args.steps, "prompt": args.prompt, "jobs": args.jobs,
                           "rows": rows}, f, indent=1)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
