"""Issue 17 probes: two SnapKV variants tried against the 25%-kept perplexity bar, run through ``kvcompress eval``.

Not product code: each probe replaces one method of a built-in class *in this process only*, to measure an idea
before building it (session 19, docs/results.md "Attention-aware eviction ... session 19").

* ``--layer-factors F0,F1,...`` (one per layer, mean 1): the per-layer budget factor of every score-based evictor
  (``ScoreEvictor.layer_factor``; what ``schedule: pyramid`` sets from a line), e.g. layer 0 uncompressed and the
  others smaller, or budgets rising with depth.
* ``--redundancy MU``: SnapKV's token weight (``value_norm``'s ``|v|_1``, or 1) times ``1 - MU x max(0, c)``, with
  ``c`` the largest cosine similarity between the token's key and a later key of its head in the same prefill
  block (R-KV's idea, arXiv 2505.24133: a key that a later one repeats is worth less).

* ``--merge``: registers, in this process only, a compressor ``snapkv_merge`` (SnapKV's config plus ``merge``
  "values" / "kv", ``merge_weight`` "uniform" / "score", ``merge_tau``): at prefill, each token SnapKV evicts is
  folded into the kept token of its head whose key is the most similar (cosine above ``merge_tau``), its value (and,
  with "kv", its key) averaged in with the kept token's (weights 1 or the tokens' SnapKV scores) - the merge idea of
  CaM (Zhang et al., ICML 2024) and D2O (arXiv 2406.13035): the evicted tokens' values are not lost outright.  The
  stacks name it, e.g. ``- snapkv_merge: {ratio: 0.25, ..., merge: values, merge_tau: 0.5}`` (use ``eval --sweep``:
  one baseline for every setting).

* ``--cake TAU1,TAU2``: per-layer budget factors in the manner of CAKE (Qin et al., *CAKE: Cascading and Adaptive
  KV Cache Eviction with Layer Preferences*, ICLR 2025, arXiv:2503.12491), fixed from calibration text before the
  run: on two 2048-token windows of the evaluation document that the ppl windows do not overlap (at 1/4 and 3/4 of
  it), each layer's last ``--cake-window`` prompt queries attend (eager attention) to the tokens before them; the
  layer's preference is ``H^(1/TAU1) x V^(1/TAU2)`` (``H``: entropy of the window's mean attention, the spatial
  dispersion; ``V``: the attention's variance over the window's queries summed over the tokens, the temporal shift;
  both averaged over the heads), and the factors are the preferences over their mean, capped at 1 / 0.25 = 4.

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


def merge_evicted(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, weight: torch.Tensor,
                  keys_too: bool, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` ``[b, h, n, d]``; ``keep`` ``[b, h, n]``; ``valid`` ``[b, n]``; ``weight`` ``[b, h, n]`` (>= 0).
    Each evicted token whose key's best cosine with a kept key of its head exceeds ``tau`` is averaged into that
    kept token (weighted); returns the new ``k``, ``v`` (kept columns changed, the others as given)."""
    ev = valid.unsqueeze(1) & ~keep
    kn = torch.nn.functional.normalize(k.float(), dim=-1)
    sim = (kn @ kn.transpose(-1, -2)).masked_fill(~keep.unsqueeze(-2), float("-inf"))
    best, dest = sim.max(-1)  # [b, h, n]
    w = weight.float().clamp(min=0) * (ev & (best > tau))
    acc_w = torch.zeros_like(w).scatter_add_(2, dest, w)
    own = weight.float().clamp(min=0) * keep
    total = (own + acc_w).clamp(min=1e-30).unsqueeze(-1)
    touched = (keep & (acc_w > 0)).unsqueeze(-1)

    def fold(x):
        acc = torch.zeros_like(x, dtype=torch.float32).scatter_add_(
            2, dest.unsqueeze(-1).expand(*dest.shape, x.shape[-1]), w.unsqueeze(-1) * x.float())
        return torch.where(touched, (own.unsqueeze(-1) * x.float() + acc) / total, x.float()).to(x.dtype)

    return (fold(k) if keys_too else k), fold(v)


def _merge() -> None:
    import dataclasses

    from kvcompress import CompressorSpec
    from kvcompress.config import param
    from kvcompress.manager import get_registry
    from kvcompress.plugins import snapkv

    @dataclasses.dataclass(frozen=True)
    class MergeConfig(snapkv.SnapKVConfig):
        merge: str = param("values", "what evicted tokens fold into the kept ones", choices=("values", "kv", "none"))
        merge_weight: str = param("uniform", "weights of the average", choices=("uniform", "score"))
        merge_tau: float = param(0.0, "smallest key cosine that merges", min=-1.0, max=1.0)

    class MergeSnapKV(snapkv.SnapKVCompressor):
        name = "snapkv_merge"

        def _entry_keep(self, layer, block, scores, cap=None):
            keep = super()._entry_keep(layer, block, scores, cap)
            c = self.config
            if c.merge != "none" and keep.dim() == 3 and block.k is not None:
                valid = block.valid
                if c.merge_weight == "score":
                    s = self._sanitize(scores)
                    weight = s - s.masked_fill(~valid.unsqueeze(1), float("inf")).amin(-1, keepdim=True).clamp(max=0)
                else:
                    weight = torch.ones_like(keep, dtype=torch.float32)
                block.k, block.v = merge_evicted(block.k, block.v, keep, valid, weight, c.merge == "kv", c.merge_tau)
            return keep

    get_registry().add(CompressorSpec(name="snapkv_merge", axis="evict", config=MergeConfig, factory=MergeSnapKV,
                                      summary="probe: SnapKV whose evicted tokens fold into similar kept ones"),
                       "probe")


def cake_factors(tau1: float, tau2: float, window: int = 128, cap: float = 4.0) -> list[float]:
    """The per-layer factors ``--cake`` describes (mean 1, none above ``cap``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.evaluation import data
    from kvcompress.models import resolve_model_path

    path = resolve_model_path(None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    doc = data.document_tokens(tok)
    n = 2048
    room = len(doc) - n
    sums = None
    for frac in (0.25, 0.75):
        start = round(frac * room)
        ids = torch.tensor([doc[start:start + n]])
        with torch.no_grad():
            att = model(input_ids=ids, output_attentions=True).attentions
        stats = []
        for a in att:  # [1, heads, n, n]
            w = a[0, :, -window:, :n - window].float()  # the window's queries over the tokens before it
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
            mean = w.mean(1)  # [heads, tokens]
            h = -(mean * mean.clamp_min(1e-30).log()).sum(-1).mean()
            v = w.var(1).sum(-1).mean()
            stats.append((float(h), float(v)))
        sums = stats if sums is None else [(a + c, b + d) for (a, b), (c, d) in zip(sums, stats)]
        del att
    pref = torch.tensor([(h / 2) ** (1 / tau1) * (v / 2) ** (1 / tau2) for h, v in sums], dtype=torch.float64)
    f = pref / pref.mean()
    for _ in range(20):  # cap, then give the excess to the uncapped layers in proportion
        over = f > cap
        if not bool(over.any()):
            break
        excess = float((f[over] - cap).sum())
        f[over] = cap
        free = f < cap
        f[free] += excess * f[free] / f[free].sum()
    print("cake layer stats (H, V):", [(round(h / 2, 3), round(v / 2, 5)) for h, v in sums], file=sys.stderr)
    print("cake layer factors:", ",".join(f"{x:.4f}" for x in f.tolist()), file=sys.stderr)
    return f.tolist()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-factors", default=None, help="comma-separated per-layer budget factors (mean 1)")
    ap.add_argument("--redundancy", type=float, default=None, help="MU: damp tokens whose key a later key repeats")
    ap.add_argument("--merge", action="store_true", help="register the snapkv_merge probe compressor")
    ap.add_argument("--cake", default=None, help="TAU1,TAU2: CAKE-style per-layer factors from calibration text")
    ap.add_argument("--cake-window", type=int, default=128, help="observed prompt queries of the calibration")
    args = ap.parse_args(own)
    if args.cake:
        t1, t2 = (float(x) for x in args.cake.split(","))
        _layer_factors(cake_factors(t1, t2, args.cake_window))
    if args.merge:
        _merge()
    if args.layer_factors:
        _layer_factors([float(x) for x in args.layer_factors.split(",")])
    if args.redundancy is not None:
        _redundancy(args.redundancy)
    from kvcompress.cli import main as cli

    return cli(rest)


if __name__ == "__main__":
    sys.exit(main())
