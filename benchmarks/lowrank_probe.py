"""Low-rank keys on the default model: the probes behind docs/results.md "Low-rank keys (issue 8)".

    python benchmarks/lowrank_probe.py memory STACK...   # middle K bytes vs dense after a 2048-token prefill
    python benchmarks/lowrank_probe.py score-error       # E[(q.(k - k_hat))^2] / E[(q.k)^2]: PCA vs LeanK masks
    python benchmarks/lowrank_probe.py readpath          # CPU read path: one layer, lowrank lane vs LeanK lane
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model():
    from kvcompress.models import load_model

    model, tok = load_model(None)
    return model.to(torch.bfloat16), tok


def memory(stacks: list[str]) -> None:
    import kvcompress
    from kvcompress.calibration import data

    model, tok = _model()
    ids = torch.tensor([data.split_tokens(tok, "heldout")[:2048]])
    from kvcompress.adapters import hf

    kw = hf.cache_kwarg(model)  # ``cache`` from transformers 5.24, ``past_key_values`` before
    for stack in stacks:
        with kvcompress.compress(model, stack) as cache, torch.no_grad():
            model(ids, **{kw: cache})
            layers = cache.compressed_layers
            k = sum(buf.k[:, :, :buf.size].nbytes for layer in layers for _, buf in layer.middle.lanes)
            v = sum(buf.v[:, :, :buf.size].nbytes for layer in layers for _, buf in layer.middle.lanes)
            info, tokens = layers[0].info, layers[0].middle.num_tokens
            dense = tokens * len(layers) * info.num_kv_heads * info.head_dim * 2
            print(f"== {stack}: middle tokens {tokens}; middle K {k:,} B vs dense {dense:,} B = {k / dense:.4f}; "
                  f"middle V {v:,} B")
            print(cache.memory_report().table())


def score_error() -> None:
    from kvcompress.adapters import hf
    from kvcompress.calibration import data
    from kvcompress.calibration.attention import ScaledKeys, scaled_keys
    from kvcompress.calibration.lowrank import load_basis
    from kvcompress.calibration.masks import load_mask

    model, tok = _model()
    basis = load_basis("masks/smollm2-135m-lowrank-48.safetensors", model.config).basis
    masks = {n: load_mask(f"masks/smollm2-135m-leank-{n}.safetensors", model.config).keep.float() for n in (50, 70)}
    acc: dict[str, list[float]] = {}

    def observe(layer, q, k):  # queries 512.. against keys 16..511 (middle-like), every head
        q, k = q.float()[:, :, 512:], k.float()[:, :, 16:512]
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, 1)
        total = ((q @ k.transpose(-1, -2)) ** 2).sum().item()
        approx = {f"pca r={r}": k @ (u := basis[layer, :, :, :r].repeat_interleave(g, 0)[None]) @ u.transpose(-1, -2)
                  for r in (20, 32, 48)}
        approx.update({f"leank{n}": k * m[layer].repeat_interleave(g, 0)[None, :, None, :] for n, m in masks.items()})
        for name, k_hat in approx.items():
            a = acc.setdefault(name, [0.0, 0.0])
            a[0] += ((q @ (k - k_hat).transpose(-1, -2)) ** 2).sum().item()
            a[1] += total

    with torch.no_grad(), scaled_keys(model, ScaledKeys(observer=observe)):
        for window in data.windows(data.split_tokens(tok, "heldout"), 1024, 2):
            hf.final_hidden_states(model, torch.tensor([window]))
    for name, (err, total) in acc.items():
        print(f"{name}: relative score error {err / total:.4f}")


def readpath() -> None:
    from kvcompress.kernels.attention import attend_segments
    from kvcompress.state import HeadGroup, Segment

    torch.manual_seed(0)
    b, h, g, d, t = 1, 3, 3, 64, 3072
    q = torch.randn(b, h * g, 1, d, dtype=torch.bfloat16)
    k, v = torch.randn(b, h, t, d, dtype=torch.bfloat16), torch.randn(b, h, t, d, dtype=torch.bfloat16)
    qpos, heads = torch.tensor([t + 1000]), torch.arange(h)

    def bench(group: HeadGroup | None, width: int) -> float:
        seg = Segment(k[..., :width].contiguous(), v, None, torch.arange(t))
        segs = [seg if group is None else group.attach(seg)]
        for _ in range(20):
            attend_segments(q, segs, qpos, d ** -0.5)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            attend_segments(q, segs, qpos, d ** -0.5)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    print(f"dense d={d}: {bench(None, d):.0f} us")
    for r in (16, 32):
        u = torch.linalg.qr(torch.randn(h, d, r))[0]
        leank = HeadGroup(heads, None, None, torch.arange(r).expand(h, r).contiguous())
        lowrank = HeadGroup(heads, None, None, qmap=lambda x, u=u: torch.einsum("bhgqd,hdr->bhgqr", x.float(), u).to(x.dtype))
        print(f"r={r}: leank lane {bench(leank, r):.0f} us, lowrank lane {bench(lowrank, r):.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    sub.add_parser("memory").add_argument("stacks", nargs="+")
    sub.add_parser("score-error")
    sub.add_parser("readpath")
    args = p.parse_args()
    if args.probe == "memory":
        memory(args.stacks)
    elif args.probe == "score-error":
        score_error()
    else:
        readpath()


if __name__ == "__main__":
    main()
