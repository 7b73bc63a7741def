"""Issue 17 probes: two SnapKV variants tried against the 25%-kept perplexity bar, run through ``kvcompress eval``.

Not product code: each probe replaces one method of a built-in class *in this process only*, to measure an idea
before building it (session 19, docs/results.md "Attention-aware eviction ... session 19").

* ``--layer-factors F0,F1,...`` (one per layer, mean 1): the per-layer budget factor of every score-based evictor
  (``ScoreEvictor.layer_factor``; what ``schedule: pyramid`` sets from a line), e.g. layer 0 uncompressed and the
  others smaller, or budgets rising with depth.
* ``--redundancy MU``: SnapKV's token weight (``value_norm``'s ``|v|_1``, or 1) times ``1 - MU x max(0, c)``, with
  ``c`` the largest cosine similarity between the token's key and a later key of its head in the same prefill
  block (R-KV's idea, arXiv 2505.24133: a key that a later one repeats is worth less).

Everything after ``--`` goes to ``kvcompress`` unchanged, e.g.::

    python benchmarks/snapkv_probes.py --redundancy 0.5 -- eval --stack examples/stacks/sweeps/adakv-25-vatp.yaml \\
        --task ppl --samples 3 --dtype float32 --device cpu --json OUT.json
"""
from __future__ import annotations

import argparse
import sys

import torch


def _layer_factors(factors: list[float]) -> None:
    from kvcompress import scoring

    def layer_factor(self, info):
        return factors[info.index]

    scoring.ScoreEvictor.layer_factor = layer_factor


def _redundancy(mu: float) -> None:
    from kvcompress.plugins import snapkv

    def score(self, layer, block, obs):
        weight = block.v.float().abs().sum(-1) if self.config.value_norm else torch.ones(block.v.shape[:3])
        keys = torch.nn.functional.normalize(block.k.float(), dim=-1)
        sim = keys @ keys.transpose(-1, -2)  # [b, h, n, n]
        n = sim.shape[-1]
        idx = torch.arange(n, device=sim.device)
        later = (idx.view(1, n) > idx.view(n, 1)) & block.valid.view(block.valid.shape[0], 1, 1, n)
        c = sim.masked_fill(~later, float("-inf")).amax(-1).nan_to_num(neginf=0.0).clamp(min=0)
        return snapkv.pooled_window_attention(obs, block.positions, self.config.kernel, self.config.pool,
                                              weight * (1 - mu * c))

    snapkv.SnapKVCompressor.score = score


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-factors", default=None, help="comma-separated per-layer budget factors (mean 1)")
    ap.add_argument("--redundancy", type=float, default=None, help="MU: damp tokens whose key a later key repeats")
    args = ap.parse_args(own)
    if args.layer_factors:
        _layer_factors([float(x) for x in args.layer_factors.split(",")])
    if args.redundancy is not None:
        _redundancy(args.redundancy)
    from kvcompress.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
