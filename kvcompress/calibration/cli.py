"""``kvcompress calibrate ALGORITHM ...``: make a calibration file (LeanK mask, ...).

Wire into the main parser with ``kvcompress.calibration.cli.add_parser(subparsers)``; each
algorithm is a sub-command whose handler (``args.func``) returns the exit code (0 ok, 2 invalid
input, 130 interrupted).  An algorithm lives in its own module exposing ``add_parser(subparsers)``
(argparse only: nothing heavy is imported until its handler runs) and is listed in
:data:`ALGORITHMS`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from ..errors import ConfigError, KVCompressError
from .settings import LeanKSettings

_DEFAULTS = LeanKSettings(ratio=0.5, align=16)

DESCRIPTION = """\
Make a LeanK key-channel mask (arXiv 2508.02215) for a model and save it as a safetensors file.

methods:
  trained  two-stage training (default): learn per-channel scaling factors of the middle keys on
           retrieval and plain-text samples built from the standard library's documentation,
           binarize at the ratio with per-head counts rounded to --align, fine-tune with a
           straight-through mask
  rope     training-free: every head keeps its lowest-frequency RoPE channel pairs
  qk       calibrated baseline: channels ranked by mean |q_c k_c| over documentation text

Training progress and the loss go to stderr; the state is checkpointed next to --out
(FILE.ckpt.safetensors) and an interrupted run continues with --resume.  See docs/calibration.md.
"""


# Modules (relative to this package) whose ``add_parser(subparsers)`` adds one algorithm's sub-command.
ALGORITHMS: tuple[str, ...] = (".lowrank_cli", ".doublesparse_cli")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``calibrate`` subcommand (one sub-command per algorithm) to ``subparsers``."""
    import importlib

    p = subparsers.add_parser("calibrate", help="make a calibration file (LeanK mask, ...)",
                              description="Make the calibration file an algorithm needs; "
                                          "`kvcompress calibrate ALGORITHM --help` for its options.")
    algos = p.add_subparsers(dest="algorithm", metavar="ALGORITHM", required=True)
    add_leank_parser(algos)
    for name in ALGORITHMS:
        importlib.import_module(name, __package__).add_parser(algos)
    return p


def add_leank_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``leank`` (``kvcompress calibrate leank ...``) to ``subparsers``; returns its parser."""
    p = subparsers.add_parser("leank", help="LeanK K-channel mask (training or heuristics)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=float, required=True, help="fraction of K channels to prune, e.g. 0.5 or 0.7")
    p.add_argument("--align", type=int, required=True,
                   help="every head keeps a multiple of ALIGN channels (a divisor of head_dim, e.g. 16)")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the mask")
    p.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", choices=("trained", "rope", "qk"), default="trained")
    p.add_argument("--steps", type=int, default=_DEFAULTS.steps, help=f"stage-1 steps (default {_DEFAULTS.steps})")
    p.add_argument("--ft-steps", type=int, default=_DEFAULTS.ft_steps,
                   help=f"stage-2 fine-tuning steps (default {_DEFAULTS.ft_steps})")
    p.add_argument("--context", type=int, default=_DEFAULTS.context,
                   help=f"context tokens per training sample, or per qk calibration window (default {_DEFAULTS.context})")
    p.add_argument("--tail", type=int, default=_DEFAULTS.tail,
                   help=f"question/answer tokens per sample that the loss reads (default {_DEFAULTS.tail})")
    p.add_argument("--samples", type=int, default=_DEFAULTS.samples,
                   help=f"training samples, or qk calibration windows (default {_DEFAULTS.samples})")
    p.add_argument("--batch", type=int, default=_DEFAULTS.batch, help=f"samples per step (default {_DEFAULTS.batch})")
    p.add_argument("--sinks", type=int, default=_DEFAULTS.sinks,
                   help=f"leading keys never pruned while training (default {_DEFAULTS.sinks})")
    p.add_argument("--local", type=int, default=_DEFAULTS.local,
                   help=f"local window never pruned while training (default {_DEFAULTS.local})")
    p.add_argument("--lr", type=float, default=_DEFAULTS.lr, help=f"stage-1 learning rate (default {_DEFAULTS.lr})")
    p.add_argument("--ft-lr", type=float, default=_DEFAULTS.ft_lr,
                   help=f"stage-2 learning rate (default {_DEFAULTS.ft_lr})")
    p.add_argument("--reg", type=float, default=_DEFAULTS.reg, help=f"L1 weight of stage 1 (default {_DEFAULTS.reg})")
    p.add_argument("--data", default=",".join(_DEFAULTS.data), metavar="KINDS",
                   help="training sample kinds, comma-separated: passkey, key-value, text "
                        f"(default {','.join(_DEFAULTS.data)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples and their order (default 0)")
    p.add_argument("--resume", action="store_true", help="continue from FILE.ckpt.safetensors if present")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)
    return p


def _model_name(name: str | None) -> str:
    from ..models import DEFAULT_ALIASES, DEFAULT_MODEL

    return DEFAULT_MODEL if name is None or name in DEFAULT_ALIASES else name


def _settings(args: argparse.Namespace) -> LeanKSettings:
    return LeanKSettings(ratio=args.ratio, align=args.align, sinks=args.sinks, local=args.local, context=args.context,
                         tail=args.tail, samples=args.samples, batch=args.batch, steps=args.steps,
                         ft_steps=args.ft_steps, lr=args.lr, ft_lr=args.ft_lr, reg=args.reg, seed=args.seed,
                         data=tuple(k.strip() for k in args.data.split(",") if k.strip()))


def guarded(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A sub-command handler running ``body``: a KVCompressError is printed and gives exit code 2."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except KVCompressError as exc:
            print(f"kvcompress: error: {exc}", file=sys.stderr)
            return 2

    return handler


def check_output_and_model(args: argparse.Namespace) -> None:
    """``--out`` (a writable .safetensors path; missing folders are created) and ``--model``, before any work."""
    from ..files import check_output
    from ..models import check_model_name

    check_output("--out", args.out, suffix=".safetensors", make_parents=True)
    check_model_name(args.model)


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: torch's choice)."""
    if threads is not None:
        if threads < 1:
            raise ConfigError("--threads", "a positive integer", threads)
        import torch

        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    """Handler of ``kvcompress calibrate leank``; returns the exit code."""
    return guarded(_run)(args)


def _run(args: argparse.Namespace) -> int:
    settings = _settings(args).validate()  # everything but align-vs-head_dim, before the model loads
    check_output_and_model(args)
    set_threads(args.threads)
    log = None if args.quiet else sys.stderr
    from . import calibrate

    t0 = time.monotonic()
    try:
        mask = calibrate(args.method, settings, model=args.model, model_name=_model_name(args.model),
                         out=args.out, resume=args.resume, log=log)
    except KeyboardInterrupt:
        from .leank import checkpoint_path

        ckpt = checkpoint_path(args.out)
        more = f"; rerun the same command with --resume to continue from {ckpt}" if os.path.isfile(ckpt) else ""
        print(f"kvcompress: interrupted{more}", file=sys.stderr)
        return 130
    hist = ", ".join(f"{n}:{c}" for n, c in sorted(_histogram(mask.counts).items()))
    print(f"wrote {args.out}: method {args.method}, ratio {settings.ratio}, align {settings.align}, "
          f"kept {mask.kept_fraction:.1%} of K channels (heads by kept count {hist}), "
          f"{time.monotonic() - t0:.0f} s")
    return 0


def _histogram(counts) -> dict[int, int]:
    values, n = counts.flatten().unique(return_counts=True)
    return {int(v): int(c) for v, c in zip(values, n)}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m kvcompress.calibration.cli calibrate leank ...``)."""
    from ..cli import Parser

    parser = Parser(prog="kvcompress")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
