"""Where the DoubleSparse cluster select spends its time, phase by phase (issue 19: the SmolLM2 B1 reads below SDPA).

Builds ``radix_cuda.build(("DS_PHASES",))`` - a separate library whose cluster kernel writes, per CTA, clock64() at
each phase boundary and the global timer at entry and exit (``radix_cuda.cu``, "Phase clocks") - and runs the
cluster select exactly as ``select_topk_cuda`` would (its own cluster size unless ``--cluster``), on benchutil's
DoubleSparse inputs (16 fp16 label channels, k = ctx / frac).  Per shape it prints and writes (``phases.json``):

* the median per-CTA time of each phase (µs, clock64 deltas at the CTA's measured clock rate): query load, label
  scoring + first-digit histogram, first digit (a cluster histogram), the later digit passes, the cross-CTA counts,
  the index writes; and within the first digit: its cluster barrier (waiting for the slowest CTA included) and the
  find's warp (remote group sums and bins read, the digit found: "reads"; session 47's data also has "find", the
  block scan of the find before the grouped one);
* the digit passes after the first, the spread of the CTAs' entry times (launch skew) and the kernel's mean time per
  call from CUDA events (no graph, so launch gaps included);
* that the instrumented library picks the same indices as the library the kernels use.

    python benchmarks/gpu_cluster_phases.py --out DIR [--shapes smollm2-135m:1:32k:8,...] [--cluster 8] [--reps 20]

A shape is ``model:batch:ctx:frac`` with an optional ``:shared`` (group-shared selection).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

import torch

HEADS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
PHASES = ("query", "score", "digit1", "passes", "counts", "emit")
SLOTS = 16
SUB = ("d1_barrier", "d1_reads")  # within the first digit: slots 5 -> 11 -> 12
DEFAULT_SHAPES = ("smollm2-135m:1:32k:8,smollm2-135m:1:32k:16,smollm2-135m:1:32k:8:shared,smollm2-135m:1:128k:8,"
                  "smollm2-135m:4:32k:8,llama3-8b:1:32k:16,llama3-8b:1:32k:16:shared")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--cluster", type=int, default=None, help="CTAs per head (default: the select's own rule)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--config", default="{}", help="JSON entries of RADIX_CUDA_CONFIG for the run (e.g. emit_vectors)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from kvcompress.kernels.doublesparse import radix_cuda as rc
    from kvcompress.kernels.doublesparse.bench import ds_inputs
    from kvcompress.kernels.doublesparse.triton_kernel import group_rows

    os.makedirs(args.out, exist_ok=True)
    cfg = dict(rc.RADIX_CUDA_CONFIG)
    cfg.update(json.loads(args.config))
    lib = rc.build(("DS_PHASES",))
    plain = rc.build()
    if args.cluster is not None:
        cfg["cluster"] = args.cluster
    rows = []
    for spec in args.shapes.split(","):
        parts = spec.split(":")
        model, b, ctx, frac = parts[0], int(parts[1]), int(parts[2].rstrip("k")) * 1024, int(parts[3])
        shared = len(parts) > 4 and parts[4] == "shared"
        hq, hkv, d = HEADS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, lab, ch, _, _ = ds_inputs(b, hq, hkv, ctx, d, 16, 16, "cuda", gen)
        kk = ctx // frac
        group = hq // hkv if shared else 1
        query = group_rows(q, lab, ch, group, False)
        cl = rc._cluster_for(query, lab.num_tokens, cfg)
        if cl is None:
            print(f"## {spec}: no cluster select at this shape (cluster {cfg['cluster']})")
            rows.append({"shape": spec, "error": "no cluster plan"})
            continue
        c, n = cl

        def run(library):
            return rc._cluster_select(library, query, lab, ch, None, kk, cl, int(cfg["cluster_threads"]),
                                      int(cfg["cluster_rows_in_flight"]), group, q.stride(1),
                                      rc.emit_vectors_for(cfg, n, int(cfg["cluster_threads"])))

        same = bool(torch.equal(run(lib).sort(-1).values, run(plain).sort(-1).values))
        ctas = query.shape[0] * query.shape[1] * c
        per_phase = {p: [] for p in PHASES}
        passes, skew, clock_ghz = [], [], []
        for _ in range(args.reps):
            run(lib)
            torch.cuda.synchronize()
            buf = (ctypes.c_longlong * (ctas * SLOTS))()
            err = lib.ds_radix_phases(buf, ctas * SLOTS)
            if err:
                raise RuntimeError(f"ds_radix_phases: {lib.ds_radix_error_string(err).decode()}")
            recs = [list(buf[i * SLOTS:(i + 1) * SLOTS]) for i in range(ctas)]
            starts = [r[0] for r in recs]
            skew.append((max(starts) - min(starts)) / 1e3)
            for r in recs:
                ns, cycles = r[10] - r[0], r[9] - r[3]
                ghz = cycles / ns if ns > 0 else 1.0
                clock_ghz.append(ghz)
                for i, p in enumerate(PHASES):
                    per_phase[p].append((r[4 + i] - r[3 + i]) / ghz / 1e3)
                if r[11]:  # a build with the first digit's stamps
                    for p, (a, z) in zip(SUB, ((5, 11), (11, 12))):
                        per_phase.setdefault(p, []).append((r[z] - r[a]) / ghz / 1e3)
                passes.append(r[2])
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {}
        for name, library in (("instrumented", lib), ("plain", plain)):
            for _ in range(3):
                run(library)
            ev0.record()
            for _ in range(args.reps):
                run(library)
            ev1.record()
            torch.cuda.synchronize()
            times[name] = ev0.elapsed_time(ev1) * 1e3 / args.reps
        med = {p: statistics.median(v) for p, v in per_phase.items()}
        row = {"shape": spec, "cluster": c, "tokens_per_cta": n, "threads": int(cfg["cluster_threads"]), "k": kk,
               "ctas": ctas, "same_indices": same, "phase_us_median": med,
               "phase_us_max": {p: max(v) for p, v in per_phase.items()},
               "passes": {str(x): passes.count(x) for x in sorted(set(passes))},
               "entry_skew_us_median": statistics.median(skew), "clock_ghz_median": statistics.median(clock_ghz),
               "call_us_events": times}
        rows.append(row)
        print(f"## {spec}: C {c}, {n} tokens per CTA, {ctas} CTAs, k {kk}, same indices {same}, "
              f"call {times['plain']:.1f} us plain / {times['instrumented']:.1f} instrumented (events, no graph)")
        print("   " + "  ".join(f"{p} {med[p]:.2f}" for p in PHASES)
              + f"  = {sum(med[p] for p in PHASES):.2f} us in the CTA")
        if SUB[0] in med:
            print("   first digit: " + "  ".join(f"{p[3:]} {med[p]:.2f}" for p in SUB))
        print(f"   passes after the first {row['passes']}, entry skew {row['entry_skew_us_median']:.2f} us, "
              f"clock {row['clock_ghz_median']:.2f} GHz")
        with open(os.path.join(args.out, "phases.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
        del q, lab, ch, query
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
