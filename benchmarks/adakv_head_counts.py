"""Per-head middle counts of an adaptive (AdaKV) stack on the default model, and the head-columns its middle allocates.

    python benchmarks/adakv_head_counts.py [STACK.yaml] [TOKENS]     (default: examples/stacks/adakv25.yaml, 2048)

Prefills the first TOKENS tokens of the eval document (the first perplexity window) through the stack (dynamic cache,
fp32, CPU) and prints, per layer, the middle tokens each kv head kept; then the kept total against the head-columns
the middle allocates (one lane per kv head, each as long as its own head: ``kvcompress.state.DenseStore``) and against
what one dense tensor per layer as long as its longest head allocated before (``DenseStore.head_lanes = False``), and
the memory report.
"""

from __future__ import annotations

import sys

import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.evaluation.data import document_text
from kvcompress.models import load_model


def main() -> None:
    stack = sys.argv[1] if len(sys.argv) > 1 else "examples/stacks/adakv25.yaml"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    model, tok = load_model()
    ids = torch.tensor([tok(document_text())["input_ids"][:tokens]])
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        model(ids, **{hf.cache_kwarg(model): cache})
    kept = allocated = longest = 0
    rows = []
    for layer in cache.compressed_layers:
        counts = layer.middle.head_valid_mask().sum(-1)[0].tolist()
        rows.append(counts)
        kept += sum(counts)
        longest += max(counts) * len(counts)
        allocated += sum(buf.capacity * buf.k.shape[1] for _, buf in layer.middle.lanes)
    print("per layer, middle tokens per kv head:", rows)
    print(f"kept middle tokens: {kept}; allocated head-columns: {allocated} ({allocated / kept:.2f}x); "
          f"as long as the longest head (the layout before per-head lanes): {longest} ({longest / kept:.2f}x)")
    print(cache.memory_report())


if __name__ == "__main__":
    main()
