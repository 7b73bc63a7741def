"""``kvcompress calibrate lowrank``: PCA basis of post-RoPE keys per (layer, KV head) for ``lowrank``.

argparse only at import; the handler loads the model and :mod:`.lowrank` when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys


DESCRIPTION = """\
Make the key basis of the `lowrank` compressor (Loki arXiv 2406.02542, Palu arXiv 2407.21118,
Eigen Attention arXiv 2408.05646): per layer and KV head, the PCA (uncentred) of post-RoPE keys over
--samples windows of --context tokens of offline documentation text (pydoc_data, training split),
the first --skip keys of each window (attention sinks) left out.  Keep the top --rank directions
of every head, or per head the fewest keeping --energy of the key energy, rounded up to --align;
--value-rank adds a value basis (PCA of values, same text) for the compressor's value_rank option.
Written as safetensors with the model's identity; the compressor refuses it for another model.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``lowrank`` (``kvcompress calibrate lowrank ...``) to ``subparsers``; returns its parser."""
    from .lowrank import LowRankSettings

    d = LowRankSettings()
    p = subparsers.add_parser("lowrank", help="low-rank key basis (PCA of post-RoPE keys)", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--rank", type=int, help="directions kept per head (a multiple of --align)")
    target.add_argument("--energy", type=float, help="per head, the fewest directions keeping this fraction, e.g. 0.9")
    p.add_argument("--value-rank", type=int, default=None,
                   help="also store a value basis of this rank per head (optional; values are unchanged without it)")
    p.add_argument("--align", type=int, default=d.align, help=f"ranks are multiples of this (default {d.align})")
    p.add_argument("--out", required=True, metavar="FILE.safetensors", help="where to write the basis")
    p.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--context", type=int, default=d.context, help=f"tokens per window (default {d.context})")
    p.add_argument("--samples", type=int, default=d.samples, help=f"text windows (default {d.samples})")
    p.add_argument("--skip", type=int, default=d.skip, help=f"leading keys of a window left out (default {d.skip})")
    p.add_argument("--seed", type=int, default=d.seed, help="shifts the window offsets (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handler; returns the exit code (0 ok, 2 invalid input)."""
    from .cli import guarded

    return guarded(_run)(args)


def _run(args: argparse.Namespace) -> int:
    from .cli import _model_name, check_output_and_model, set_threads
    from .lowrank import LowRankSettings, calibrate

    settings = LowRankSettings(rank=args.rank, energy=args.energy, align=args.align, context=args.context,
                               samples=args.samples, skip=args.skip, seed=args.seed,
                               value_rank=args.value_rank).validate()
    check_output_and_model(args)
    set_threads(args.threads)
    f = calibrate(settings, model=args.model, model_name=_model_name(args.model), out=args.out,
                  log=None if args.quiet else sys.stderr)
    m = f.meta
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {m['target']}, align {m['align']}, mean rank {m['mean_rank']} of "
          f"{f.basis.shape[2]}, key energy kept mean {m['mean_energy_kept']:.4f} (min {m['min_energy_kept']:.4f}), "
          f"{size:,} bytes, {m['seconds']} s")
    return 0
