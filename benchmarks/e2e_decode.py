"""End-to-end decode benchmark at the Llama-3-8B shape with random weights (issue 16).

The same code as ``kvcompress bench --model-shape llama3-8b --random-weights`` (implementation:
``kvcompress/evaluation/e2e.py``; columns explained in docs/evaluation.md).  This script only
supplies those two options (a later ``--model-shape`` wins) and forwards every other option.

    python benchmarks/e2e_decode.py --compile --stack none kivi2 --points 1x32768,8x16384 \\
        --json out/e2e.json --markdown
    python benchmarks/e2e_decode.py --throughput --kv-gib 100 --ctx 32768 --stack kivi2 --json out/tput.json
    python benchmarks/e2e_decode.py --model-shape tiny --points 1x64 --steps 3 --device cpu   # CPU smoke run

Rows: plain transformers eager (DynamicCache); with ``--compile`` transformers StaticCache + compiled
decode step; each ``--stack`` (YAML files, names of examples/stacks/*.yaml, built-in benchmark
stacks such as ``kivi2`` or ``builtin`` for all of them) eager and, with ``--compile``, static +
compiled.  Per row: wall ms per step (median), GPU-busy ms per step (torch.profiler), cache bytes,
compile time, compiled graphs and recompiles.
"""

from __future__ import annotations

import sys

from kvcompress.cli import main  # the installed kvcompress (pip install -e . / --target), with its plugins


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return main(["bench", "--model-shape", "llama3-8b", "--random-weights", *argv])


if __name__ == "__main__":
    sys.exit(run())
