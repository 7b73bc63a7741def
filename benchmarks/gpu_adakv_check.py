"""AdaKV (``schedule: adaptive``) on CUDA: the static cache's decode step, compiled (Inductor, fullgraph) and eager,
against the dynamic cache on the CPU (reference read path), on a tiny random Llama (fp32, left-padded batch).

On CUDA the static cache reads the middle's lanes with the grouped Triton kernel (``kvcompress::lanes_partial``),
which takes the per-head validity through a head stride; the CPU run reads with the PyTorch reference.  Prints the
max |logit difference| per run and the per-head counts of the first layer.

    python benchmarks/gpu_adakv_check.py          (from /tmp/site, see benchmarks/gpu_session.sh)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import kvcompress  # noqa: E402
from kvcompress.adapters import hf  # noqa: E402
from models import tiny_model  # noqa: E402

STACK = {"compressors": [{"snapkv": {"ratio": 0.3, "sinks": 2, "recent": 8, "window": 8, "schedule": "adaptive"}}]}
PROMPT, STEPS = 96, 24


def run(model, ids, mask, device, static, compiled=False):
    model = model.to(device)
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    kw = {"max_cache_len": ids.shape[1] + 4} if static else {}
    out = []
    ck = hf.cache_kwarg(model)  # "cache" or "past_key_values", by transformers version
    with kvcompress.compress(model, STACK, **kw) as cache, torch.no_grad():
        step = torch.compile(model.forward, fullgraph=True) if compiled else model.forward
        first = model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], position_ids=pos[:, :PROMPT], **{ck: cache})
        out.append(first.logits[:, -1])
        counts = cache.compressed_layers[0].middle.head_valid_mask().sum(-1).tolist()
        for t in range(PROMPT, ids.shape[1]):
            o = step(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1].contiguous(),
                     position_ids=pos[:, t:t + 1], **{ck: cache})
            out.append(o.logits[:, -1])
    return torch.stack(out).float().cpu(), counts, getattr(cache.compressed_layers[0], "kernels", None)


def main() -> None:
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ref, counts, _ = run(model, ids, mask, "cpu", static=False)
    print("cpu dynamic: per-head counts of layer 0", counts)
    for static, compiled in ((False, False), (True, False), (True, True)):
        got, c, kernels = run(model, ids, mask, "cuda", static, compiled)
        print(f"cuda static={static} compiled={compiled} kernels={kernels} counts={c} "
              f"max|dlogit| vs cpu dynamic = {(got - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
