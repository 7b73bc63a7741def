"""Passkey with the question inside the compressed prefill (SnapKV's own setting), next to ``kvcompress eval
--task passkey``'s protocol (haystack prefilled and compressed, then the question fed one token at a time, so an
evictor scoring at prefill never sees the question: the query-agnostic setting, as kvpress compresses a context
before its question).  Same prompts (kvcompress.evaluation.data.passkey_samples), default model, greedy:
    python benchmarks/passkey_question_prefill.py --stack examples/stacks/snapkv25.yaml [--samples 5] [--context 4096]
Prints, per sample, whether the first number generated is the key, for the uncompressed model and the stack, with
the question in the prefill (all prompt tokens but the last prefilled) and after it (the eval's protocol)."""

from __future__ import annotations

import argparse
import json

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation import metrics
from kvcompress.evaluation.data import passkey_samples
from kvcompress.models import load_model


def answer(model, tokenizer, stack, ids, prefill, new=8):
    kw = hf.cache_kwarg(model)
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        x = torch.tensor([ids])
        o = model(x[:, :prefill], **{kw: cache})
        for t in range(prefill, len(ids)):
            o = model(x[:, t:t + 1], **{kw: cache})
        out = []
        for _ in range(new):
            tok = int(o.logits[0, -1].argmax())
            out.append(tok)
            o = model(torch.tensor([[tok]]), **{kw: cache})
    return tokenizer.decode(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", required=True)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tokenizer = load_model(None, dtype=getattr(torch, args.dtype), device="cpu")
    stack = kvcompress.load_stack(args.stack)
    rows = []
    for s in passkey_samples(tokenizer, args.context, args.samples):
        row = {"depth": s.depth, "key": s.key}
        for where, prefill in (("question in prefill", len(s.ids) - 1), ("question after prefill", s.question_start)):
            for label, st in (("uncompressed", None), (stack.label, stack)):
                text = answer(model, tokenizer, st, list(s.ids), prefill)
                row[f"{label}, {where}"] = metrics.passkey_correct(text, s.key)
                row[f"{label}, {where}: text"] = text
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k not in ("depth", "key") and not k.endswith(": text")]
    print("| run | correct |\n|---|---|")
    for k in keys:
        print(f"| {k} | {sum(r[k] for r in rows)}/{len(rows)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stack": args.stack, "context": args.context, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
