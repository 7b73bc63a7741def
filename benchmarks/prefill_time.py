"""Prompt (prefill) time of each stack against the uncompressed cache, in chunks, with where it goes (CPU or GPU).

Session 59's 8 x 16k whole-step run on an H100 (``python benchmarks/e2e_decode.py ... --points 8x16384``) spent
7.9-9.4 s prefilling the uncompressed and StaticCache rows but 22-27 s for KIVI-2 and 73 s for LeanK-70: the chunks
after the first read the compressed segments through the read path's reference partial attention (``q_len > 1``).
This script measures that on a small random-weight Llama (any machine), so a change to the multi-token read can be
timed before and after:

    python benchmarks/prefill_time.py --stack none kivi2 leank-rope70 leank-rope70-kivi2 [--prompt 8192] \\
        [--chunk 2048] [--batch 2] [--device cpu] [--profile kivi2] [--json FILE]

Stacks are the names of ``kvcompress bench --stack`` (``kvcompress.evaluation.e2e.BUILTIN_STACKS``) or YAML files.
Each row is one static cache (``max_cache_len`` = the prompt; ``--dynamic``: a dynamic one) prefilled in
``--chunk``-token calls; the time is the wall time of those calls (the device synchronised).  ``--profile NAME``:
cProfile of that stack's prefill, the 25 entries with the most cumulative time, on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


def _stack(name: str):
    import kvcompress
    from kvcompress.evaluation.e2e import BUILTIN_STACKS

    if name in BUILTIN_STACKS:  # parsed once the model is built (a random low-rank basis is made for its shapes)
        return name
    if Path(name).is_file():
        return kvcompress.load_stack(name)
    raise SystemExit(f"--stack: expected a name of kvcompress bench's stacks ({', '.join(BUILTIN_STACKS)}) or a "
                     f"YAML file, got {name!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", nargs="+", default=["none", "kivi2", "leank-rope70", "leank-rope70-kivi2"])
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens (default 8192)")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per prefill call (default 2048)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--layers", type=int, default=2, help="layers of the random Llama (on CUDA Llama-3-8B's: 32/8 "
                                                          "heads x 128, MLP 14336; on the CPU 8/2 heads x 128, MLP 1024)")
    ap.add_argument("--dynamic", action="store_true", help="dynamic caches (default: static, max_cache_len = prompt)")
    ap.add_argument("--profile", metavar="NAME", help="cProfile this stack's prefill (stderr)")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    for key in ("prompt", "chunk", "batch", "layers"):
        if getattr(args, key) < 1:
            ap.error(f"--{key}: expected a positive integer, got {getattr(args, key)}")
    if args.profile is not None and args.profile not in args.stack:
        ap.error(f"--profile: expected one of the --stack names ({', '.join(args.stack)}), got {args.profile!r}")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvcompress

    stacks = {name: _stack(name) for name in args.stack}  # every stack validated before the model is built
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    heads, kv_heads = (32, 8) if args.device == "cuda" else (8, 2)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=heads * 128, intermediate_size=14336 if args.device == "cuda" else heads * 128,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=128, vocab_size=1024, max_position_embeddings=max(args.prompt, 4096))
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    from kvcompress.adapters import hf
    from kvcompress.evaluation.e2e import resolve_stacks

    kw = hf.cache_kwarg(model)  # ``cache`` from transformers 5.24, ``past_key_values`` before (ignored otherwise)
    stacks = {name: resolve_stacks([name], model)[0] if isinstance(stack, str) else stack
              for name, stack in stacks.items()}
    size = {} if args.dynamic else {"max_cache_len": args.prompt}
    ids = torch.randint(1, 1024, (args.batch, args.prompt), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def prefill(cache, tokens: int) -> None:  # the first ``tokens`` prompt tokens in ``--chunk``-token calls
        for a in range(0, tokens, args.chunk):
            b = min(tokens, a + args.chunk)
            model(ids[:, a:b], **{kw: cache}, position_ids=torch.arange(a, b, device=args.device).expand(args.batch, -1))

    # untimed warm-up of every stack on two chunks: CUDA / cuBLAS start-up and kernel builds fall in no stack's time
    for stack in stacks.values():
        with kvcompress.compress(model, stack, **size) as cache, torch.no_grad():
            prefill(cache, min(args.prompt, 2 * args.chunk))
    sync()
    rows = []
    for name, stack in stacks.items():
        profiler = cProfile.Profile() if name == args.profile else None
        with kvcompress.compress(model, stack, **size) as cache, torch.no_grad():
            sync()
            start = time.perf_counter()
            if profiler:
                profiler.enable()
            prefill(cache, args.prompt)
            sync()
            if cache.get_seq_length() != args.prompt:  # the model did not use the cache: nothing was measured
                raise SystemExit(f"{name}: the cache saw {cache.get_seq_length()} of {args.prompt} tokens")
            if profiler:
                profiler.disable()
            seconds = time.perf_counter() - start
        rows.append({"stack": name, "seconds": seconds})
        print(f"{name}: {seconds:.2f} s", file=sys.stderr, flush=True)
        if profiler:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
            print(out.getvalue(), file=sys.stderr)
    base = next((r["seconds"] for r in rows if r["stack"] == "none"), None)
    print(f"Prefill of {args.batch} x {args.prompt} tokens in {args.chunk}-token calls: random Llama, "
          f"{args.layers} layers, {heads}/{kv_heads} heads x 128, {dtype}, {args.device}\n")
    print("| stack | prefill s | vs none |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['stack']} | {r['seconds']:.2f} | " + (f"{r['seconds'] / base:.2f}x |" if base else "- |"))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": str(dtype), "batch": args.batch,
                                               "prompt": args.prompt, "chunk": args.chunk, "layers": args.layers,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
