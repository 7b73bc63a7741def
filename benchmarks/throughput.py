"""Decode throughput at a fixed KV-cache memory budget (issue 6; PagedEviction's headline metric).

A compressed cache holds fewer bytes per sequence, so the same memory serves a larger batch.  For
plain transformers (``none``) and each stack this script

1. measures the cache bytes one sequence holds after ``context`` prompt tokens plus ``new``
   generated tokens (``Cache.memory_report()``; for plain transformers the DynamicCache's keys
   and values), with a batch of 2 rows;
2. picks the largest batch whose caches fit in ``--kv-gib`` GiB (capped by ``--max-batch``);
3. runs ``model.generate`` (greedy, exactly ``new`` tokens) on that batch twice — once with
   ``max_new_tokens=1`` (prefill) and once in full — timed with CUDA events / perf_counter;
   decode throughput = batch * (new - 1) / (full - prefill).  The CUDA allocator's peak during
   the full run (minus what was allocated before it: the weights) is reported next to the budget,
   so a row whose transients exceed the budget is visible.

Run from the repository root (GPU): ``python benchmarks/throughput.py --device cuda --kv-gib 8
--stack none examples/stacks/paged_eviction.yaml ... --out out/throughput.json``.
Prints a Markdown table; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.data import document_tokens, spread_offsets
from kvcompress.evaluation.report import environment, markdown_table
from kvcompress.evaluation.runner import cache_memory
from kvcompress.models import load_model
from kvcompress.stack import load_stack


def _prompts(tokenizer, batch: int, context: int, device) -> torch.Tensor:
    toks = document_tokens(tokenizer)
    return torch.tensor([toks[o:o + context] for o in spread_offsets(len(toks), context, batch)], device=device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, tokenizer, ids: torch.Tensor, new: int, stack) -> tuple[float, int]:
    """(seconds, cache bytes held at the end) of one greedy generate call of exactly ``new`` tokens."""
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        if stack is None:
            out = model.generate(ids, return_dict_in_generate=True, **kw)
            _sync(ids.device)
            dt = time.perf_counter() - t0
            return dt, cache_memory(hf.output_cache(out))[0]
        with kvcompress.compress(model, stack) as cache:
            model.generate(ids, **{hf.cache_kwarg(model): cache}, **kw)
            _sync(ids.device)
            dt = time.perf_counter() - t0
            return dt, cache_memory(cache)[0]


def measure(model, tokenizer, label: str, stack, args, device) -> dict:
    _, held2 = _generate(model, tokenizer, _prompts(tokenizer, 2, args.context, device), args.new, stack)
    per_seq = held2 / 2
    batch = max(1, min(args.max_batch, int(args.kv_gib * 2**30 // per_seq)))
    ids = _prompts(tokenizer, batch, args.context, device)
    _generate(model, tokenizer, ids[:, : args.context], 2, stack)  # warm-up at this batch (allocator, kernels)
    t_prefill, _ = _generate(model, tokenizer, ids, 1, stack)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t_full, held = _generate(model, tokenizer, ids, args.new, stack)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    decode_s = max(t_full - t_prefill, 1e-9)
    row = dict(label=label, batch=batch, bytes_per_seq=per_seq, cache_bytes=held, peak_bytes=peak,
               prefill_s=t_prefill, total_s=t_full, decode_tok_s=batch * (args.new - 1) / decode_s,
               total_tok_s=batch * args.new / t_full)
    print(f"[throughput] {label}: batch {batch}, {per_seq / 2**20:.1f} MiB/seq, decode "
          f"{row['decode_tok_s']:.0f} tok/s, prefill {t_prefill:.2f} s, total {t_full:.2f} s", file=sys.stderr)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stack", nargs="+", required=True, help="'none' (plain transformers) and/or YAML stack files")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--kv-gib", type=float, default=8.0, help="memory budget for the KV caches of the batch (GiB)")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stacks = [(s, None if s == "none" else load_stack(s)) for s in args.stack]  # validate before the model
    device = torch.device(args.device)
    model, tokenizer = load_model(None, dtype=getattr(torch, args.dtype), device=args.device)
    rows = [measure(model, tokenizer, s if st is None else st.label, st, args, device) for s, st in stacks]
    base = rows[0]["decode_tok_s"]
    table = [["cache", "batch", "MiB/seq", "cache GiB", "peak GiB (alloc)", "prefill s", "decode tok/s", f"vs {rows[0]['label']}"]]
    for r in rows:
        table.append([r["label"], r["batch"], f"{r['bytes_per_seq'] / 2**20:.1f}", f"{r['cache_bytes'] / 2**30:.2f}",
                      "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}",
                      f"{r['prefill_s']:.2f}", f"{r['decode_tok_s']:.0f}", f"{r['decode_tok_s'] / base:.2f}x"])
    print(f"context {args.context} + {args.new} new tokens, KV budget {args.kv_gib} GiB, {args.dtype}, {args.device}")
    print(markdown_table(table))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(settings=vars(args), rows=rows, environment=environment(args.device)), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
