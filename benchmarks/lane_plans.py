"""The split plans of the lanes reads at issue 19's grid shapes, without a GPU: one count for every lane against a
count per lane (``lane_balance``), for the benchmark's LeanK-70 lanes (``kernels/benchutil.leank_counts``).

* KIVI lanes kernel (LeanK-70 + KIVI-2, CUDA; ``lane_balance`` the default since session 54): the plan
  ``lanes_cuda._plan`` makes (``lanes_cuda.split_plan_of``) with the default configuration (4 warps, 2 stages: 4 CTAs
  per SM), with ``lane_balance`` off and on.
* Triton LeanK lanes kernel (LeanK-70 / LeanK-50, ``lane_balance`` opt-in): the resident rule's count
  (``resident_split_count``) and ``balanced_lane_splits`` for ``--per-sm`` programs per SM (Triton 3.6 on sm_90 holds
  2 at Llama heads, 4 at SmolLM2 heads: ``benchmarks/read_occupancy.py``); resident launches only (B16 and B64).

    python benchmarks/lane_plans.py [--sms 132] [--per-sm-llama 2] [--per-sm-smollm2 4]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import benchutil as bu  # noqa: E402
from kernels.kivi import cuda_kernel as ck  # noqa: E402
from kernels.kivi.lanes_cuda import split_plan_of  # noqa: E402
from kernels.leank import triton_kernel as tk  # noqa: E402

CTX = {"4k": 4096, "32k": 32768, "128k": 131072}


def kivi_rows(sms: int):
    for shape in bu.SHAPES:
        lanes = [(c, n) for c, n in sorted(collections.Counter(bu.leank_counts(70, shape.kv_heads,
                                                                               shape.head_dim)).items(),
                                           reverse=True) if c]
        m = shape.q_heads // shape.kv_heads
        cfg = dict(ck.DEFAULT_CONFIG)
        nw, stages, smem, _ = ck.plan_launch(2, lanes[0][0], shape.head_dim, cfg["nw"], cfg["stages"], ck.SMEM_OPTIN_MAX)
        cfg.update(nw=nw, stages=stages)
        wave = round(ck.wave_ctas(sms, cfg, smem))
        for b in (1, 4, 16, 64):
            for name, ctx in CTX.items():
                nt = (ctx - bu.LEANK_FP_TOKENS) // ck.TILE
                rows = b * -(-m // 8)
                one, per = (split_plan_of(nt, lanes, rows, sms, dict(cfg, lane_balance=on), smem, shape.head_dim)[2]
                            for on in (False, True))

                def ctas(plan):
                    return sum(k * n * rows for (k, _), (_, n) in zip(plan, lanes))

                yield (shape.model, b, name, lanes, wave, f"{one[0][0]} ({ctas(one)} CTAs)",
                       f"{'/'.join(str(k) for k, _ in per)} ({ctas(per)} CTAs)")


def leank_rows(sms: int, per_sm: dict):
    cfg = tk._config()
    for ratio in (70, 50):
        for shape in bu.SHAPES:
            counts = collections.Counter(bu.leank_counts(ratio, shape.kv_heads, shape.head_dim))
            slots = per_sm[shape.model] * sms
            for b in (16, 64):
                for name, ctx in CTX.items():
                    middle = ctx - bu.LEANK_FP_TOKENS
                    lanes = [(c, n, middle) for c, n in sorted(counts.items(), reverse=True) if c]
                    lanes.append((shape.head_dim, shape.kv_heads, bu.LEANK_FP_TOKENS))
                    uni = tk.resident_split_count(cfg, b, [(n, t) for _, n, t in lanes], 1, slots)
                    got = tk.balanced_lane_splits(cfg, b, lanes, shape.head_dim, 1, slots)
                    per = "-" if got is None else "/".join(str(uni if n is None else n) for n in got)
                    yield f"leank{ratio}", shape.model, b, name, [(c, n) for c, n, _ in lanes], slots, uni, per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--per-sm-llama", type=int, default=2)
    ap.add_argument("--per-sm-smollm2", type=int, default=4)
    a = ap.parse_args(argv)
    print(f"KIVI lanes kernel (LeanK-70 + KIVI-2), {a.sms} SMs\n")
    print("| model | B | ctx | lanes (key channels, heads) | wave (CTAs) | one count | a count per lane |")
    print("|---|---|---|---|---|---|---|")
    for row in kivi_rows(a.sms):
        print("| " + " | ".join(map(str, row)) + " |")
    per_sm = {"llama3-8b": a.per_sm_llama, "smollm2-135m": a.per_sm_smollm2}
    print(f"\nTriton LeanK lanes kernel, resident launches, {a.sms} SMs x programs per SM {per_sm}\n")
    print("| op | model | B | ctx | lanes (channels, heads; the last full precision) | slots | one count | "
          "a count per lane (- : more long programs than slots) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in leank_rows(a.sms, per_sm):
        print("| " + " | ".join(map(str, row)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
