"""GPU end-to-end check: decode logits through the fused CUDA read path vs the PyTorch reference path.

Tiny random-weight llama (tests/models.py) in fp32 on CUDA; for each example-like stack, 150
teacher-forced decode steps with ``KVCOMPRESS_KERNELS=auto`` (Triton kernels) and ``=reference``;
prints the max |Δlogit|.  Run on the device machine from the repository root:
    PYTHONPATH=<assembled package> python benchmarks/gpu_e2e.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import kvcompress  # noqa: E402
from models import tiny_model  # noqa: E402

STACKS = {
    "kivi2": [{"kivi": {"bits": 2, "group": 16, "residual": 32}}],
    "kivi4+sinks": [{"kivi": {"bits": 4, "group": 16, "residual": 32, "sinks": 4}}],
    "leank-rope50": [{"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 32, "flush": 16}}],
    "leank-rope50+kivi2": [{"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 32,
                                      "flush": 16}}, {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "paged": [{"paged_eviction": {"budget": 96, "block": 16}}],
    "window": [{"window": {"sinks": 4, "recent": 64}}],
}


def registry():
    """The built-ins registered directly (the device image runs the package from a copied tree,
    without installed entry points)."""
    from kvcompress.plugins import kivi, leank, paged_eviction, window
    from kvcompress.registry import Registry

    reg = Registry()
    for module in (kivi, leank, paged_eviction, window):
        module.kvcompress_register_compressors(lambda spec: reg.add(spec, "built-in"))
    return reg


def run(model, ids, stack):
    from kvcompress.adapters import hf

    out = []
    stack = kvcompress.parse_stack({"compressors": stack}, registry=registry())
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        kw = {hf.cache_kwarg(model): cache}  # transformers 5.17 (device image) vs 5.24
        model(ids[:, :100], **kw)
        for t in range(100, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], **kw).logits[:, -1].float())
    return torch.stack(out)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("llama").to(dev)
    ids = torch.randint(1, 256, (2, 250), generator=torch.Generator().manual_seed(0)).to(dev)
    worst = 0.0
    for name, stack in STACKS.items():
        os.environ["KVCOMPRESS_KERNELS"] = "auto"
        fused = run(model, ids, stack)
        os.environ["KVCOMPRESS_KERNELS"] = "reference"
        ref = run(model, ids, stack)
        err = (fused - ref).abs().max().item()
        worst = max(worst, err)
        print(f"{name:22s} max|dlogit| fused vs reference = {err:.2e}  (logit scale {ref.abs().max().item():.1f})")
    print("OK" if worst < 2e-2 else "FAIL", f"worst {worst:.2e}")


if __name__ == "__main__":
    main()
