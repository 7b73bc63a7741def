"""Command line: ``kvcompress generate | validate | plugins | eval | bench``."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Callable, Sequence

from .errors import ConfigError, KVCompressError, KVCompressWarning, Phrase, shorten

#: Largest --max-new-tokens (a documented maximum; the model's max_position_embeddings bounds it further).
MAX_NEW_TOKENS = 1 << 20
MAX_SEED = 2**63 - 1


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvcompress generate: error: argument --max-new-tokens: ...``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {shorten(message)} (see {self.prog} --help)\n")


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (checked by the parser, before any work)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {shorten(repr(text), 80)}")
        return value

    return parse


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

    from .models import check_model_name

    if not args.prompt.strip():
        raise ConfigError("PROMPT", "a non-empty prompt", args.prompt)
    stack = load_stack(args.stack) if args.stack else as_stack(None)  # validate before loading the model
    check_model_name(args.model)
    if args.compile:
        from .evaluation.runner import check_compile_supported

        check_compile_supported()
    device = _resolve_device(args.device)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device, **_placement(args))
    device = _input_device(model, device)
    inputs = {k: v.to(device) for k, v in _prompt_inputs(tokenizer, args, hf.text_config(model)).items()}
    torch.manual_seed(args.seed)
    pad = tokenizer.pad_token_id or tokenizer.eos_token_id
    if args.compile:
        # a static cache; the decode step compiled once and, on CUDA, replayed as one CUDA graph (GraphStep)
        from .evaluation.runner import graph_step

        capacity = inputs["input_ids"].shape[1] + args.max_new_tokens
        with compress(model, stack, max_cache_len=capacity) as cache, torch.no_grad():
            gen = torch.Generator(device=device).manual_seed(args.seed) if args.sample else None
            out = hf.step_generate(model, inputs["input_ids"], cache, graph_step(model), args.max_new_tokens,
                                   do_sample=args.sample, generator=gen, pad_token_id=pad)
    else:
        with compress(model, stack) as cache, torch.no_grad():
            out = model.generate(**inputs, **{hf.cache_kwarg(model): cache}, max_new_tokens=args.max_new_tokens,
                                 do_sample=args.sample, pad_token_id=pad)
    prompt_len = inputs["input_ids"].shape[1]
    print(tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True))
    if args.report:
        report = cache.memory_report(all_ranks=True)  # under tensor parallelism: every rank's heads (a collective)
        print(f"\nKV cache memory, stack '{stack.label}' ({len(cache.compressed_layers)} compressed layers):")
        print(report.table())
    return 0


def _prompt_inputs(tokenizer: Any, args: argparse.Namespace, config: Any) -> Any:
    """The prompt's model inputs, within the model's positions less --max-new-tokens: a longer prompt is
    refused, or cut to fit from the side --truncate names (the chat template, if any, is kept whole)."""
    from .cache import max_positions

    def encode(text: str) -> Any:
        if args.raw or not getattr(tokenizer, "chat_template", None):
            return tokenizer(text, return_tensors="pt")
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)

    inputs = encode(args.prompt)
    positions = max_positions(config)
    if positions is None:
        return inputs
    if args.max_new_tokens >= positions:
        raise ConfigError("--max-new-tokens", f"fewer than the model's max_position_embeddings ({positions})",
                          args.max_new_tokens)
    limit, length = positions - args.max_new_tokens, inputs["input_ids"].shape[1]
    if length <= limit:
        return inputs
    if args.truncate is None:
        raise ConfigError("PROMPT", f"at most {limit:,} tokens (max_position_embeddings {positions:,} - "
                          f"--max-new-tokens {args.max_new_tokens:,})", Phrase(f"{length:,} tokens"),
                          hint="shorten it, or pass --truncate left (keep its end) or --truncate right (keep its start)")
    content = list(tokenizer(args.prompt, add_special_tokens=False).input_ids)
    excess = length - limit
    for _ in range(4):  # decoding and re-encoding a cut text can merge tokens differently: cut again if needed
        keep = max(len(content) - excess, 0)
        kept = content[len(content) - keep:] if args.truncate == "left" else content[:keep]
        inputs = encode(tokenizer.decode(kept))
        if inputs["input_ids"].shape[1] <= limit:
            break
        excess += inputs["input_ids"].shape[1] - limit
    if inputs["input_ids"].shape[1] > limit or not keep:
        raise ConfigError("--truncate", f"a prompt that fits in {limit:,} tokens once cut", args.truncate,
                          hint="the chat template alone is too long; use --raw or fewer --max-new-tokens")
    print(f"[kvcompress] prompt truncated ({args.truncate}): {length:,} -> {inputs['input_ids'].shape[1]:,} tokens "
          f"(the model takes {positions:,} positions, {args.max_new_tokens:,} kept for new tokens)", file=sys.stderr)
    return inputs


def _launched_ranks() -> int:
    from .distributed import launched_ranks

    return launched_ranks()


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    """How the model is loaded: split over the ranks of a torchrun launch (transformers' tensor parallelism,
    ``tp_plan="auto"``), placed over devices (``--device-map auto``), or on ``--device``."""
    ranks = _launched_ranks()
    device_map = getattr(args, "device_map", None)
    if ranks > 1 and device_map is not None:
        raise ConfigError("--device-map", "omitted under a torchrun launch of several processes (the model is split "
                          f"over the {ranks} ranks by tensor parallelism)", device_map)
    if ranks > 1:
        return {"tp_plan": "auto"}
    return {"device_map": device_map} if device_map is not None else {}


def _input_device(model: Any, device: str) -> Any:
    """Where inputs go: the model's (first) device when it was placed by transformers, else ``device``."""
    if getattr(model, "hf_device_map", None) or (getattr(model, "_tp_size", None) or 1) > 1:
        return model.device
    return device


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():

        raise ConfigError("--device", "'cpu', or 'cuda' on a machine with a CUDA GPU", name,
                          hint="no CUDA device is available")
    return name


def _model_name(name: str | None) -> str:
    from .models import DEFAULT_ALIASES, DEFAULT_MODEL

    return DEFAULT_MODEL if name is None or name in DEFAULT_ALIASES else name


def _check_outputs(args: argparse.Namespace, *outputs: tuple[str, str | None]) -> None:
    """Output paths and the model name, checked before any model loads or any work starts."""
    from .files import check_output
    from .models import check_model_name

    for option, path in outputs:
        check_output(option, path)
    if getattr(args, "model", None) is not None:
        check_model_name(args.model)


def _write_json(path: str, obj: object) -> None:
    import json

    if _rank() != 0:  # a torchrun launch: rank 0 writes
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluation.runner import EvalSettings
    from .stack import load_stack

    # Everything is validated before the model is loaded.
    settings = EvalSettings.for_task(args.task, args.context, args.samples, args.tokens, args.seed, args.question)
    files = args.sweep if args.sweep else [args.stack]
    if args.plot and not args.sweep:
        raise ConfigError("--plot", "used together with --sweep FILE...", args.plot)
    stacks = [load_stack(f) for f in files]
    _check_outputs(args, ("--json", args.json), ("--plot", args.plot))
    device = _resolve_device(args.device)
    if args.compile:
        from .evaluation.runner import check_compile_supported

        check_compile_supported()

    import torch

    from .evaluation.runner import Evaluator
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device, **_placement(args))
    evaluator = Evaluator(model, tokenizer, _model_name(args.model), progress=not args.quiet, compile=args.compile)
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
    from .stack import load_stack

    _check_outputs(args, ("--json", args.json))
    if args.kernels and (args.device_map is not None or _launched_ranks() > 1):
        raise ConfigError("--kernels", "omitted with --device-map or under a torchrun launch (it loads no model to "
                          "place or split)", True)
    if args.model_shape is not None and args.device_map is not None:
        raise ConfigError("--device-map", "omitted with --model-shape (the random model is built on --device, or "
                          "split over the ranks of a torchrun launch)", args.device_map)
    if args.weights_dir is not None and (args.model_shape is None or _launched_ranks() < 2):
        raise ConfigError("--weights-dir", "used with --model-shape under a torchrun launch of several processes "
                          "(where rank 0 writes the random weights the ranks load)", args.weights_dir)
    if args.model_shape is not None:  # the end-to-end benchmark at a model shape (kvcompress/evaluation/e2e.py)
        from .evaluation import e2e

        e2e.validate_args(args)
        return e2e.main_from_args(args, _resolve_device(args.device))
    for option, given in (("--random-weights", args.random_weights), ("--throughput", args.throughput),
                          ("--points", args.points is not None), ("--no-eager", args.no_eager),
                          ("--no-baseline", args.no_baseline), ("--fill-rows", args.fill_rows)):
        if given:
            raise ConfigError(option, "used together with --model-shape", given)
    args.context = 1024 if args.context is None else args.context
    args.rounds = 3 if args.rounds is None else args.rounds
    for option, value, lo in (("--context", args.context, 1), ("--steps", args.steps, 1), ("--rounds", args.rounds, 1)):
        if not lo <= value <= (1 << 17):
            raise ConfigError(option, f"an integer in [{lo}, {1 << 17}]", value)
    stacks = [load_stack(f) for f in args.stack]
    device = _resolve_device(args.device)
    if args.compile and stacks and not args.kernels:
        from .evaluation.runner import check_compile_supported

        check_compile_supported()
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

    from .evaluation.bench import COMPILED_UNTIMED, bench_decode
    from .evaluation.data import document_tokens
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device, **_placement(args))
    tokens = document_tokens(tokenizer)
    extra = COMPILED_UNTIMED if args.compile else 0
    if args.context + extra + args.steps > len(tokens):
        raise ConfigError("--context", f"context + steps{' + 2' if extra else ''} <= {len(tokens)} "
                          "(tokens in the document text)", args.context)
    from .adapters import hf
    from .cache import max_positions

    positions = max_positions(hf.text_config(model))
    if args.compile and positions is not None and args.context + extra + args.steps > positions:
        raise ConfigError("--context", f"with --compile, context + steps + {extra} <= the model's {positions} "
                          "positions (the static cache's capacity)", args.context)
    result = bench_decode(model, tokens, stacks, context=args.context, steps=args.steps, rounds=args.rounds,
                          model_name=_model_name(args.model), progress=not args.quiet, compile=args.compile)
    print(result.table(markdown=args.markdown))
    if args.json:
        _write_json(args.json, result.to_dict())
    return 0


_COMPILE_HELP = ("compile the decode step: the cache is static (transformers' StaticCache, "
                 "kvcompress.compress(model, stack, max_cache_len=N)) and single-token steps run through "
                 "torch.compile(model.forward, fullgraph=True): on CUDA Inductor kernels replayed as one CUDA graph "
                 "(generate and eval: kvcompress.GraphStep; bench measures both that and mode='reduce-overhead'); "
                 "on the CPU backend='aot_eager', which traces the step as one graph and runs it with the eager "
                 "kernels (same numbers; checks that the step compiles, it is not faster)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvcompress", description="Composable KV-cache compression for "
                    "Hugging Face causal language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation with a compressed cache")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--stack", default=None, help="YAML stack file (default: no compression)")
    gen.add_argument("--max-new-tokens", type=int_range(1, MAX_NEW_TOKENS), default=64,
                     help="tokens to generate (1 to the model's max_position_embeddings - 1; default 64)")
    gen.add_argument("--truncate", choices=("left", "right"), default=None,
                     help="a prompt longer than the model's positions less --max-new-tokens is refused; with "
                     "--truncate it is cut to fit: 'left' drops its start, 'right' its end")
    gen.add_argument("--report", action="store_true", help="print the memory held by the cache")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--seed", type=int_range(0, MAX_SEED), default=0)
    gen.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    gen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                     help="model and cache dtype (default bfloat16, SmolLM2's training dtype)")
    gen.add_argument("--compile", action="store_true", help=_COMPILE_HELP + " (generate: max_cache_len = prompt + "
                     "--max-new-tokens; the prefill runs eagerly, then every decode step goes through one compiled "
                     "step, on CUDA replayed as one CUDA graph by kvcompress.GraphStep)")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                     help="where the model runs (default: cuda when available)")
    gen.add_argument("--device-map", default=None, choices=("auto",), help=_PLACEMENT_HELP)
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
    ev.add_argument("--seed", type=int_range(0, MAX_SEED), default=0, help="seed of the passkey keys (default 0)")
    ev.add_argument("--question", default=None, metavar="WHERE",
                    help="passkey: 'after' (default: the haystack is prefilled and compressed, then the question is "
                    "fed; query-agnostic, as kvpress) or 'prefill' (the question ends the prefill: the standard "
                    "passkey prompt, SnapKV's setting)")
    ev.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="model and cache dtype (default bfloat16, SmolLM2's training dtype)")
    ev.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ev.add_argument("--device-map", default=None, choices=("auto",), help=_PLACEMENT_HELP)
    ev.add_argument("--json", metavar="OUT", help="write the result (one JSON object) to OUT")
    ev.add_argument("--plot", metavar="OUT.png", help="with --sweep: where to write the plot "
                    "(default kvcompress-sweep-TASK.png)")
    ev.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/results.md)")
    ev.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    ev.add_argument("--compile", action="store_true", help=_COMPILE_HELP + " (eval: each sample's cache holds its "
                    "prompt + decoded tokens; the uncompressed baseline stays plain eager transformers; numbers "
                    "equal eager ones within bf16 noise)")
    ev.set_defaults(func=_cmd_eval)

    bn = sub.add_parser("bench", help="decode latency, cache memory and kvcompress overhead per decode step",
                        description="Time teacher-forced decode steps of the full model with plain transformers "
                                    "and each stack; report cache memory and kvcompress' own work per step. "
                                    "With --model-shape: the end-to-end benchmark at a real model shape with "
                                    "random weights (docs/evaluation.md; also benchmarks/e2e_decode.py).")
    bn.add_argument("--stack", metavar="FILE", nargs="*", default=[], help="YAML stack files to compare "
                    "(plain transformers is always measured); with --model-shape also names of examples/stacks/ "
                    "files, of the built-in benchmark stacks, or 'builtin' for all of those")
    bn.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    bn.add_argument("--context", "--ctx", type=int, default=None, metavar="N",
                    help="prefilled tokens (default 1024; with --model-shape --throughput: prompt tokens, "
                    "default 32768)")
    bn.add_argument("--steps", type=int, default=32, help="timed decode steps per round (default 32)")
    bn.add_argument("--rounds", type=int, default=None, help="timed rounds per cache (default 3); with "
                    "--model-shape: time the eager rows of each point together in this many interleaved rounds "
                    "(default: each row alone)")
    bn.add_argument("--compile", action="store_true", help="also measure compiled rows; " + _COMPILE_HELP
                    + " (bench: transformers StaticCache + compile and every stack compiled; max_cache_len = "
                    "context + untimed + timed steps)")
    e2e_opts = bn.add_argument_group("end-to-end benchmark at a model shape (--model-shape)")
    e2e_opts.add_argument("--model-shape", default=None, metavar="SHAPE", help="build a Llama model of this shape "
                          "with random weights on the device: llama3-8b (32 layers, 4096 hidden, 32/8 heads x 128, "
                          "vocab 128256) or tiny (CPU smoke tests)")
    e2e_opts.add_argument("--random-weights", action="store_true", help="required with --model-shape: "
                          "the weights are random (speed and memory only; no quality)")
    e2e_opts.add_argument("--weights-dir", default=None, metavar="DIR", help="under torchrun (the model split over "
                          "the ranks by tensor parallelism): where rank 0 writes the random weights every rank loads "
                          "its shard of, kept for later launches (default: a folder named after the shape, dtype and "
                          "seed in the temp dir)")
    e2e_opts.add_argument("--points", default=None, metavar="BxCTX,...",
                          help="batch x context points (default 1x32768,8x16384)")
    e2e_opts.add_argument("--warmup", type=int, default=3, help="untimed decode steps before timing "
                          "(compilation, CUDA-graph recording; default 3)")
    e2e_opts.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler for "
                          "GPU-busy ms (default 5; 0: none)")
    e2e_opts.add_argument("--prefill-tokens", type=int, default=32768, help="prefill in chunks of at most this "
                          "many tokens per forward call, summed over the batch (default 32768)")
    e2e_opts.add_argument("--no-eager", action="store_true", help="with --compile: only the compiled rows")
    e2e_opts.add_argument("--throughput", action="store_true", help="throughput mode: largest batch whose cache "
                          "fits --kv-gib, decode tokens/s, for StaticCache + compile and every stack compiled")
    e2e_opts.add_argument("--kv-gib", type=float, default=100.0, help="with --throughput: KV-cache budget in GiB "
                          "(default 100)")
    e2e_opts.add_argument("--max-batch", type=int, default=1024, help="with --throughput: batch cap (default 1024)")
    e2e_opts.add_argument("--no-baseline", action="store_true", help="with --throughput: skip the transformers "
                          "StaticCache + compile row (measured before; gives the stacks the time)")
    e2e_opts.add_argument("--fill-rows", type=int, default=0, metavar="K", help="with --throughput: prefill only K "
                          "distinct prompts and repeat their cache rows over the batch (a decode step's time does not "
                          "depend on the values; a batch of ~100 x 32k-token prefills takes many minutes); 0 (default): "
                          "prefill every row")
    e2e_opts.add_argument("--time-budget", type=float, default=None, metavar="S", help="skip the rows that would "
                          "start after S seconds (they are listed as skipped; --json is written after every row)")
    e2e_opts.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    bn.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    bn.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    bn.add_argument("--device-map", default=None, choices=("auto",), help=_PLACEMENT_HELP)
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


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    if issubclass(category, KVCompressWarning):  # one line, no source location
        print(f"kvcompress: warning: {shorten(message)}", file=sys.stderr)
    else:
        _default(message, category, filename, lineno, file, line)


def _rank() -> int:
    """This process' rank in a torchrun launch (0 when not launched by torchrun)."""
    from .distributed import torchrun_env

    return torchrun_env("RANK", 0)


_PLACEMENT_HELP = ("place the model's layers over the available devices (transformers' device_map='auto'); each "
                   "layer's cache lives on its layer's device. Under `torchrun --nproc-per-node N` the model is "
                   "instead split over the N ranks by tensor parallelism (tp_plan='auto'); rank 0 prints")


def main(argv: Sequence[str] | None = None) -> int:
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        args = build_parser().parse_args(argv)
        if _rank() != 0 and getattr(args, "command", None) in ("generate", "eval", "bench"):
            import contextlib
            import os

            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # rank 0 prints
                args.quiet = True
                return _run(args)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except KVCompressError as exc:
        print(f"kvcompress: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcompress: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
