"""``kvcompress calibrate doublesparse``: rank DoubleSparse label channels and save them.

Argparse only at import; the model loads when the handler runs.
"""

from __future__ import annotations

import argparse
import time

from ..errors import ConfigError

DESCRIPTION = """\
Rank post-RoPE key channels per layer and KV head by mean |q_c k_c| over offline calibration text
(DoubleSparse, arXiv 2408.07092; the rotate_half layout of transformers) and save the best --channels
of each head as a safetensors file for the double_sparse compressor (`channels: FILE`, any r up to
--channels can be used from it).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doublesparse", help="DoubleSparse label channels (mean |q.k| ranking)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--channels", type=int, required=True, metavar="R", help="label channels per KV head, e.g. 16")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the channel file")
    p.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--samples", type=int, default=16, help="calibration windows (default 16)")
    p.add_argument("--context", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--seed", type=int, default=0, help="shifts the window offsets (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handler of ``kvcompress calibrate doublesparse``; returns the exit code."""
    from .cli import guarded

    return guarded(_run)(args)


def _run(args: argparse.Namespace) -> int:
    for name, lo in (("channels", 1), ("samples", 1), ("context", 16), ("seed", 0)):
        value = getattr(args, name)
        if value < lo:
            raise ConfigError(f"--{name}", f"an integer >= {lo}", value)
    from ..models import load_model
    from .cli import _model_name, check_output_and_model, set_threads

    check_output_and_model(args)

    set_threads(args.threads)
    from .doublesparse import calibrate_channels, save_channels
    from .masks import geometry

    t0 = time.monotonic()
    model, tokenizer = load_model(args.model)
    head_dim = geometry(model.config)[2]
    if args.channels > head_dim:
        raise ConfigError("--channels", f"an integer in [1, head_dim = {head_dim}]", args.channels)
    channels, scores = calibrate_channels(model, tokenizer, args.channels, samples=args.samples,
                                          context=args.context, seed=args.seed)
    settings = {"calibration": "mean |q_c k_c| over causal pairs, post-RoPE, summed over query heads",
                "windows": args.samples, "context": args.context, "seed": args.seed,
                "text": "pydoc_data.topics (training split)", "seconds": round(time.monotonic() - t0, 1)}
    save_channels(args.out, channels, scores, model.config, _model_name(args.model), settings)
    print(f"wrote {args.out}: {args.channels} label channels per KV head, {channels.shape[0]} layers x "
          f"{channels.shape[1]} KV heads, {time.monotonic() - t0:.0f} s")
    return 0
