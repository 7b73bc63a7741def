"""How many block-wide counting rounds the DoubleSparse fused select's threshold search takes (a CPU model).

The fused Triton select (:func:`kvcompress.kernels.doublesparse.triton_kernel._kth_key`) finds the threshold of the
``k`` largest label scores by a binary search over the 32 bits of order-preserving keys, one block-wide count per
bit, stopping at the first count of exactly ``k``.  Each round costs one pass over every key held by the program and
a cross-warp reduction, so at batch 1 and 4k tokens the round count sets much of the select's latency.  This script
counts the rounds on the CPU for label-score-like inputs (a query of ``r`` channels times fp16 labels), and for two
alternatives - interpolation search in key space and in value space, each with a bisection step whenever an
interpolation step did not halve the interval - and checks that every method returns a valid threshold (at least
``k`` keys at or above it, and either exactly ``k`` or the ``k``-th largest key itself)::

    python benchmarks/select_rounds_model.py [--trials 200]

Session 40 (docs/results.md, 200 trials): the bit search takes 15-26 rounds on average; interpolation in key space
11-14 (label scores at 4096 keys, k 256: 17.6 -> 11.0, the max / min reduction counted as a round), which is what the
kernel's opt-in ``search: "interpolation"`` does; interpolation in value space is worse on label scores (24.3).
"""
from __future__ import annotations

import argparse

import numpy as np


def orderable(x: np.ndarray) -> np.ndarray:
    """fp32 -> uint32 keys with the same order (the kernel's ``_orderable``), as int64."""
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, ~b & 0xFFFFFFFF, (b | 0x80000000) & 0xFFFFFFFF)


def key_value(k: int) -> float:
    """The fp32 value of an orderable key (the inverse of :func:`orderable`)."""
    b = (k & 0x7FFFFFFF) if k & 0x80000000 else (~k & 0xFFFFFFFF)
    return float(np.array([b], dtype=np.uint32).view(np.float32)[0])


def bit_search(key: np.ndarray, k: int) -> tuple[int, int]:
    """``(threshold, rounds)`` of the kernel's search (``_kth_key``)."""
    found, bit, cnt, rounds = 0, 1 << 31, k + 1, 0
    while bit and cnt != k:
        cand = found | bit
        cnt = int((key >= cand).sum())
        rounds += 1
        if cnt >= k:
            found = cand
        bit >>= 1
    return found, rounds


def interpolation_search(key: np.ndarray, k: int, values: bool) -> tuple[int, int]:
    """``(threshold, rounds)`` of a safeguarded interpolation search (in key space, or in value space); the first
    round is the max / min reduction."""
    lo, hi = int(key.min()), int(key.max()) + 1  # count(lo) = n >= k, count(hi) = 0
    flo, fhi, rounds, bisect = len(key), 0, 1, False
    while hi - lo > 1:
        width = hi - lo
        frac = (flo - k - 0.5) / (flo - fhi)  # aim between the k-th and the (k+1)-th key
        if bisect:
            mid = lo + width // 2
        elif values:
            a, b = key_value(lo), key_value(hi - 1)
            mid = int(orderable(np.array([a + frac * (b - a)], dtype=np.float32))[0])
        else:
            mid = lo + int(frac * width)
        mid = min(max(mid, lo + 1), hi - 1)
        c = int((key >= mid).sum())
        rounds += 1
        if c == k:
            return mid, rounds
        if c > k:
            lo, flo = mid, c
        else:
            hi, fhi = mid, c
        bisect = (hi - lo) * 2 > width and not bisect
    return lo, rounds


def scores(rng: np.random.Generator, n: int, kind: str, r: int = 16) -> np.ndarray:
    if kind == "heavy-tailed":
        return np.exp(rng.standard_normal(n) * 3).astype(np.float32)
    s = rng.standard_normal((n, r)).astype(np.float16).astype(np.float32) @ rng.standard_normal(r)
    return (s * 0.01 + 3.0 if kind == "narrow" else s).astype(np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    methods = {"bit search (the kernel)": bit_search,
               "interpolation, key space": lambda key, k: interpolation_search(key, k, False),
               "interpolation, value space": lambda key, k: interpolation_search(key, k, True)}
    print("| tokens | k | scores | " + " | ".join(f"{m}: mean / max rounds" for m in methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    for n, k in ((4096, 256), (4096, 512), (16384, 1024), (16384, 2048)):
        for kind in ("label scores", "narrow", "heavy-tailed"):
            rounds = {m: [] for m in methods}
            for _ in range(args.trials):
                key = orderable(scores(rng, n, kind))
                kth = int(np.sort(key)[-k])
                for m, fn in methods.items():
                    found, r = fn(key, k)
                    count = int((key >= found).sum())
                    if count < k or (count != k and found != kth):
                        raise AssertionError(f"{m}: not a top-{k} threshold ({count} keys at or above it)")
                    rounds[m].append(r)
            cells = " | ".join(f"{np.mean(v):.1f} / {max(v)}" for v in rounds.values())
            print(f"| {n} | {k} | {kind} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
