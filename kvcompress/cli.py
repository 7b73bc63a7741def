"""Command line: ``kvcompress generate | validate | plugins``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import KVCompressError


def _cmd_validate(args: argparse.Namespace) -> int:
    from .stack import load_stack

    stack = load_stack(args.file)
    names = ", ".join(e.name for e in stack.entries) or "no compressors (uncompressed)"
    print(f"{args.file}: valid stack ({names})")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from .config import config_fields
    from .manager import get_registry

    registry = get_registry()
    rows = [("name", "axis", "source", "summary")]
    for spec in registry:
        rows.append((spec.name, spec.axis, spec.source, spec.summary))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    if args.all:
        for spec in registry:
            print(f"\n{spec.name} parameters:")
            for name, default, allowed, doc in config_fields(spec.config):
                print(f"  {name} (default {default!r}; {allowed}): {doc}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .adapters import hf
    from .api import compress
    from .models import load_model
    from .stack import as_stack, load_stack

    stack = load_stack(args.stack) if args.stack else as_stack(None)  # validate before loading the model
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    if args.raw or not getattr(tokenizer, "chat_template", None):
        inputs = tokenizer(args.prompt, return_tensors="pt")
    else:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
    torch.manual_seed(args.seed)
    with compress(model, stack) as cache, torch.no_grad():
        out = model.generate(**inputs, **{hf.cache_kwarg(model): cache}, max_new_tokens=args.max_new_tokens,
                             do_sample=args.sample, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    prompt_len = inputs["input_ids"].shape[1]
    print(tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True))
    if args.report:
        report = cache.memory_report()
        print(f"\nKV cache memory, stack '{stack.label}' ({len(cache.compressed_layers)} compressed layers):")
        print(report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompress", description="Composable KV-cache compression for "
                                     "Hugging Face causal language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation with a compressed cache")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--stack", default=None, help="YAML stack file (default: no compression)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--report", action="store_true", help="print the memory held by the cache")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    gen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                     help="model and cache dtype (default bfloat16, SmolLM2's training dtype)")
    gen.set_defaults(func=_cmd_generate)

    val = sub.add_parser("validate", help="validate a stack file without loading a model")
    val.add_argument("file", metavar="FILE")
    val.set_defaults(func=_cmd_validate)

    plg = sub.add_parser("plugins", help="list registered compressors")
    plg.add_argument("--all", action="store_true", help="also list every parameter")
    plg.set_defaults(func=_cmd_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVCompressError as exc:
        print(f"kvcompress: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
