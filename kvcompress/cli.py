"""Command line: ``kvcompress generate | validate | plugins | eval | bench``."""

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


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from .errors import ConfigError

        raise ConfigError("--device", "'cpu', or 'cuda' on a machine with a CUDA GPU", name,
                          hint="no CUDA device is available")
    return name


def _model_name(name: str | None) -> str:
    from .models import DEFAULT_ALIASES, DEFAULT_MODEL

    return DEFAULT_MODEL if name is None or name in DEFAULT_ALIASES else name


def _write_json(path: str, obj: object) -> None:
    import json

    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


def _cmd_eval(args: argparse.Namespace) -> int:
    from .errors import ConfigError
    from .evaluation.runner import EvalSettings
    from .stack import load_stack

    # Everything is validated before the model is loaded.
    settings = EvalSettings.for_task(args.task, args.context, args.samples, args.tokens, args.seed)
    files = args.sweep if args.sweep else [args.stack]
    if args.plot and not args.sweep:
        raise ConfigError("--plot", "used together with --sweep FILE...", args.plot)
    stacks = [load_stack(f) for f in files]
    device = _resolve_device(args.device)

    import torch

    from .evaluation.runner import Evaluator
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    evaluator = Evaluator(model, tokenizer, _model_name(args.model), progress=not args.quiet)
    evaluator.check(settings)
    if not args.sweep:
        result = evaluator.run(stacks[0], settings)
        print(result.table(markdown=args.markdown))
        if args.json:
            _write_json(args.json, result.to_dict())
        return 0
    from .evaluation import sweep

    results = sweep.run_sweep(evaluator, stacks, settings)
    print(sweep.sweep_table(results, markdown=args.markdown))
    plot = args.plot or f"kvcompress-sweep-{settings.task}.png"
    print(f"wrote {sweep.plot_sweep(results, plot)}")
    if args.json:
        _write_json(args.json, sweep.sweep_dict(results))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .errors import ConfigError
    from .stack import load_stack

    for option, value, lo in (("--context", args.context, 1), ("--steps", args.steps, 1), ("--rounds", args.rounds, 1)):
        if not lo <= value <= (1 << 17):
            raise ConfigError(option, f"an integer in [{lo}, {1 << 17}]", value)
    stacks = [load_stack(f) for f in args.stack]
    device = _resolve_device(args.device)
    if args.kernels:
        from .evaluation.bench import run_kernel_benchmarks

        available, result = run_kernel_benchmarks(device=device, out=args.kernels_out)
        if not available:
            print(f"kvcompress: {result}", file=sys.stderr)
            return 1
        if isinstance(result, str):
            print(result)
        return 0

    import torch

    from .evaluation.bench import bench_decode
    from .evaluation.data import document_tokens
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    tokens = document_tokens(tokenizer)
    if args.context + args.steps > len(tokens):
        raise ConfigError("--context", f"context + steps <= {len(tokens)} (tokens in the document text)",
                          args.context)
    result = bench_decode(model, tokens, stacks, context=args.context, steps=args.steps, rounds=args.rounds,
                          model_name=_model_name(args.model), progress=not args.quiet)
    print(result.table(markdown=args.markdown))
    if args.json:
        _write_json(args.json, result.to_dict())
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

    ev = sub.add_parser("eval", help="measure a stack's quality against the uncompressed model",
                        description="Run a quality task through the compressed cache (prefill, then one decode "
                                    "step at a time) and against plain transformers on the same tokens. "
                                    "Tasks: ppl, passkey, agreement (docs/evaluation.md).")
    which = ev.add_mutually_exclusive_group(required=True)
    which.add_argument("--stack", metavar="FILE", help="YAML stack file to evaluate")
    which.add_argument("--sweep", metavar="FILE", nargs="+", help="several stack files: a table and a PNG plot")
    ev.add_argument("--task", metavar="TASK", help="ppl | passkey | agreement")
    ev.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    ev.add_argument("--context", type=int, default=None, metavar="N",
                    help="prompt tokens (defaults: ppl 2048, passkey 4096, agreement 1024)")
    ev.add_argument("--samples", type=int, default=None, metavar="K",
                    help="text windows / passkey prompts / agreement prompts (defaults: 1, 5, 4)")
    ev.add_argument("--tokens", type=int, default=None, metavar="M",
                    help="scored tokens (ppl, default 256) or generated tokens (passkey 8, agreement 64) per sample")
    ev.add_argument("--seed", type=int, default=0, help="seed of the passkey keys (default 0)")
    ev.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="model and cache dtype (default bfloat16, SmolLM2's training dtype)")
    ev.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ev.add_argument("--json", metavar="OUT", help="write the result (one JSON object) to OUT")
    ev.add_argument("--plot", metavar="OUT.png", help="with --sweep: where to write the plot "
                    "(default kvcompress-sweep-TASK.png)")
    ev.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/results.md)")
    ev.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    ev.set_defaults(func=_cmd_eval)

    bn = sub.add_parser("bench", help="decode latency, cache memory and kvcompress overhead per decode step",
                        description="Time teacher-forced decode steps of the full model with plain transformers "
                                    "and each stack; report cache memory and kvcompress' own work per step.")
    bn.add_argument("--stack", metavar="FILE", nargs="*", default=[], help="YAML stack files to compare "
                    "(plain transformers is always measured)")
    bn.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    bn.add_argument("--context", type=int, default=1024, metavar="N", help="prefilled tokens (default 1024)")
    bn.add_argument("--steps", type=int, default=32, help="timed decode steps per round (default 32)")
    bn.add_argument("--rounds", type=int, default=3, help="timed rounds per cache (default 3)")
    bn.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    bn.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    bn.add_argument("--json", metavar="OUT", help="write the result (one JSON object) to OUT")
    bn.add_argument("--kernels", action="store_true", help="run the per-kernel benchmarks "
                    "(kvcompress.kernels.benchutil) instead of the model-level ones")
    bn.add_argument("--kernels-out", metavar="OUT", default=None, help="with --kernels: where they write results")
    bn.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/results.md)")
    bn.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    bn.set_defaults(func=_cmd_bench)

    from .calibration.cli import add_parser as add_calibrate  # argparse only; nothing heavy is imported

    add_calibrate(sub)
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
