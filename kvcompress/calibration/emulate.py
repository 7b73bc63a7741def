"""Quick one-pass emulation of LeanK channel pruning (a quality check, not the real compressor).

Every query at ``t`` reads its middle keys (``sinks <= j < t - local``) only on the kept channels
(``q . (keep * k)``), sinks and local window exact, in one teacher-forced forward: the oracle of
``shared/notes/algorithms.md`` section 9, which equals streaming decode with a pruned middle.
Metrics over positions ``start ..`` of the text, against the unpruned model: mean KL(full || pruned),
perplexity and top-1 agreement.

    python -m kvcompress.calibration.emulate masks/a.safetensors ... [--rope 0.5 0.7] [--qk 0.5 0.7]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import torch

from ..adapters import hf
from .attention import ScaledKeys, scaled_keys


@torch.no_grad()
def pruned_logits(model: Any, ids: torch.Tensor, keep: torch.Tensor, sinks: int, local: int) -> torch.Tensor:
    """Logits ``[length, vocab]`` of one forward where middle keys keep only ``keep``'s channels."""
    alpha = keep.to(torch.float32)
    with scaled_keys(model, ScaledKeys(alpha=alpha, sinks=sinks, local=local)):
        return hf.logits(model, ids.reshape(1, -1))[0].float()


@torch.no_grad()
def compare(base: torch.Tensor, other: torch.Tensor, ids: torch.Tensor, start: int) -> dict:
    """Sums over predicted positions ``start .. length-2``: KL(base || other), NLLs, top-1 matches."""
    ids = ids.reshape(-1)
    lp = torch.log_softmax(base[start:-1], -1)
    lq = torch.log_softmax(other[start:-1], -1)
    target = ids[start + 1:]
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"n": int(target.numel()), "kl": float(kl.sum()),
            "nll_base": float(-lp.gather(-1, target[:, None]).sum()),
            "nll": float(-lq.gather(-1, target[:, None]).sum()),
            "top1": float((lp.argmax(-1) == lq.argmax(-1)).sum())}


def summarize(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    total = {k: sum(p[k] for p in parts) for k in ("kl", "nll_base", "nll", "top1")}
    return {"kl": total["kl"] / n, "ppl_base": float(torch.tensor(total["nll_base"] / n).exp()),
            "ppl": float(torch.tensor(total["nll"] / n).exp()), "top1": total["top1"] / n, "positions": n}


def evaluate_masks(model: Any, texts: list[torch.Tensor], masks: dict[str, torch.Tensor], sinks: int, local: int,
                   start: int, log: Any = sys.stderr) -> dict[str, dict]:
    """{label: summary} of every mask over every text (a ``[length]`` LongTensor each)."""
    parts: dict[str, list[dict]] = {label: [] for label in masks}
    for i, ids in enumerate(texts):
        with torch.no_grad():
            base = hf.logits(model, ids.reshape(1, -1))[0].float()
        for label, keep in masks.items():
            t0 = time.monotonic()
            parts[label].append(compare(base, pruned_logits(model, ids, keep, sinks, local), ids, start))
            if log is not None:
                print(f"[emulate] text {i + 1}/{len(texts)} {label}: KL {parts[label][-1]['kl'] / parts[label][-1]['n']:.5f}"
                      f" ({time.monotonic() - t0:.0f} s)", file=log, flush=True)
    return {label: summarize(p) for label, p in parts.items()}


def main(argv: Sequence[str] | None = None) -> int:
    from ..models import load_model
    from . import data
    from .masks import binarize, geometry, load_mask, rope_mask
    from .qk import qk_scores

    ap = argparse.ArgumentParser(prog="python -m kvcompress.calibration.emulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("masks", nargs="*", help="mask files")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rope", type=float, nargs="*", default=[], help="also the RoPE mask at these ratios")
    ap.add_argument("--qk", type=float, nargs="*", default=[], help="also the |q.k| mask at these ratios")
    ap.add_argument("--random", type=float, nargs="*", default=[], help="also a random mask at these ratios")
    ap.add_argument("--align", type=int, default=16, help="align of the --rope/--qk/--random masks")
    ap.add_argument("--texts", type=int, default=4, help="held-out windows")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--start", type=int, default=512, help="first scored position")
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--local", type=int, default=256)
    ap.add_argument("--qk-texts", type=int, default=4, help="calibration windows (training split) of --qk")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.requires_grad_(False)
    masks: dict[str, torch.Tensor] = {}
    for path in args.masks:
        masks[path] = load_mask(path, model.config).keep
    for r in args.rope:
        masks[f"rope {r}"] = rope_mask(model.config, r, args.align)
    if args.qk:
        calib = data.windows(data.split_tokens(tokenizer, "train"), args.length, args.qk_texts)
        scores = qk_scores(model, torch.tensor(calib))
        for r in args.qk:
            masks[f"qk {r}"] = binarize(scores, r, args.align)
    for r in args.random:
        g = torch.Generator().manual_seed(0)
        masks[f"random {r}"] = binarize(torch.rand(geometry(model.config), generator=g), r, args.align)
    texts = [torch.tensor(w) for w in data.windows(data.split_tokens(tokenizer, "heldout"), args.length, args.texts)]
    results = evaluate_masks(model, texts, masks, args.sinks, args.local, args.start)
    print(f"| mask | kept | KL(full‖pruned) | ppl (base {next(iter(results.values()))['ppl_base']:.2f}) | top-1 |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        kept = float(masks[label].float().mean())
        print(f"| {label} | {kept:.1%} | {r['kl']:.4f} | {r['ppl']:.2f} | {r['top1']:.1%} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
