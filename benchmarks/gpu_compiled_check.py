"""GPU check of compiled decode (issue 16): every built-in stack on CUDA, static cache, eager vs
``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (CUDA graphs).

For each stack of tests/test_compiled_decode.py (tiny random llama, fp32 and bf16, batch 2 with a
left-padded row): prefill eagerly, then ``--steps`` decode steps eagerly and compiled on the same
tokens; prints the max |logit difference| (fp32) and whether greedy tokens agree (bf16 greedy
decoding, each path feeding its own tokens), the number of compiled graphs and CUDA-graph skips.
Run from the repository root on the GPU machine (kvcompress importable):
    python benchmarks/gpu_compiled_check.py --out DIR [--steps 256] [--only name,name]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import kvcompress  # noqa: E402
from models import tiny_model  # noqa: E402
from test_bounded_decode import _stack_of  # noqa: E402
from test_compiled_decode import STACKS, _stack  # noqa: E402

ISSUE17 = ("tova", "tova+kivi4", "snapkv-both", "expected_attention-both")  # score-based eviction while decoding


def lowrank_basis(model, path):
    from kvcompress.calibration.lowrank import kv_spectra, save_basis
    from kvcompress.calibration.masks import config_hash

    tokens = torch.randint(1, 256, (4, 96), generator=torch.Generator().manual_seed(7))
    (eigenvalues, vectors), _ = kv_spectra(tiny_model("llama"), tokens, skip=2)  # on the CPU, as the tests do
    save_basis(path, vectors.cpu(), torch.full((2, 2), 8, dtype=torch.int32), eigenvalues.cpu(),
               {"model": "tiny-llama", "model_config_hash": config_hash(model.config), "target": "test", "align": 1,
                "settings": {}})
    return path


def decode(model, stack, ids, mask, prompt, steps, compiled, greedy):
    from kvcompress.adapters import hf

    kw = hf.cache_kwarg(model)
    logits, tokens = [], []
    with kvcompress.compress(model, stack, max_cache_len=prompt + steps + 8) as cache, torch.no_grad():
        fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        full = torch.ones(ids.shape[0], prompt + steps + 8, dtype=mask.dtype, device=mask.device)
        full[:, :prompt] = mask[:, :prompt]  # a fixed-length 2-D mask: one graph
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt], **{kw: cache})
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            t = prompt + i
            inp = tok if greedy else ids[:, t:t + 1]
            torch.compiler.cudagraph_mark_step_begin()
            o = fn(input_ids=inp, attention_mask=full, position_ids=pos[:, prompt - 1:prompt] + 1 + i, **{kw: cache})
            logits.append(o.logits[:, -1].float().clone())
            tok = o.logits[:, -1:].argmax(-1)
            tokens.append(tok.clone())
    return torch.stack(logits), torch.cat(tokens, 1)


def plain(model, ids, mask, prompt, steps):
    """Logits of the same teacher-forced steps with transformers' own DynamicCache (the uncompressed model)."""
    logits = []
    with torch.no_grad():
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt], use_cache=True)
        past = out.past_key_values
        for i in range(steps):
            t = prompt + i
            am = torch.ones(ids.shape[0], t + 1, dtype=mask.dtype, device=mask.device)
            am[:, :prompt] = mask[:, :prompt]
            o = model(input_ids=ids[:, t:t + 1], attention_mask=am, position_ids=pos[:, prompt - 1:prompt] + 1 + i,
                      past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits.append(o.logits[:, -1].float().clone())
    return torch.stack(logits)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--only", default="")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 greedy comparison")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda"
    results = []
    names = [n for n in (*STACKS, *ISSUE17) if not args.only or n in args.only.split(",")]
    fp32 = tiny_model("llama").to(dev)
    bf16 = tiny_model("llama").to(dev, torch.bfloat16)
    basis = lowrank_basis(fp32, os.path.join(args.out, "basis.safetensors"))
    prompt = 40
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (2, prompt + args.steps), generator=g).to(dev)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for name in names:
        row = {"stack": name}
        t0 = time.time()
        try:
            stack = {"compressors": _stack_of(name)} if name in ISSUE17 else _stack(name, basis)
            torch.compiler.reset()
            from torch._dynamo.utils import counters

            counters.clear()
            # compiled first: its CUDA-graph warm-up must not depend on anything an eager step made
            comp, _ = decode(fp32, stack, ids, mask, prompt, args.steps, True, False)
            eager, _ = decode(fp32, stack, ids, mask, prompt, args.steps, False, False)
            row["fp32_max_abs_diff"] = (eager - comp).abs().max().item()
            if name == "none":  # the empty stack is the uncompressed model
                row["fp32_vs_plain"] = (plain(fp32, ids, mask, prompt, args.steps) - comp).abs().max().item()
            row["graphs"] = int(counters["stats"]["unique_graphs"])
            row["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
            row["ok"] = (row["fp32_max_abs_diff"] < 1e-3 and row["graphs"] <= 2
                         and row.get("fp32_vs_plain", 0.0) < 1e-3)
            if not args.no_bf16:
                torch.compiler.reset()
                _, t_comp = decode(bf16, stack, ids, mask, prompt, args.steps, True, True)
                _, t_eager = decode(bf16, stack, ids, mask, prompt, args.steps, False, True)
                same = (t_eager == t_comp).all(1)
                row["bf16_greedy_identical_rows"] = same.tolist()
                row["bf16_first_divergence"] = [(int((r != 0).nonzero()[0]) if (r != 0).any() else None)
                                                for r in (t_eager != t_comp).long()]
        except Exception as exc:  # noqa: BLE001 - report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            with open(os.path.join(args.out, f"error-{name}.txt"), "w") as f:  # the whole message (graphs)
                f.write(traceback.format_exc())
            row["traceback"] = traceback.format_exc()[-3000:]
            row["ok"] = False
        row["seconds"] = round(time.time() - t0, 1)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        with open(os.path.join(args.out, "compiled_check.json"), "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
