"""Where a KIVI CUDA read's warps spend their time, phase by phase (issue 19: the batch-1 reads behind the B1/32k goal).

Builds the phase-clock library (``cuda_kernel.build(..., phases=True)``: ``-DKIVI_PHASES=1``, results unchanged) in
which lane 0 of every region warp records clock64() at its phase boundaries (``cuda_kernel.cu``, "Phase clocks"), and
runs ``cuda_kernel._forward`` on benchutil's KIVI inputs (``kivi_inputs``: random codes, all slots valid) with the
launch configuration the read would use (``--config`` entries on top).  Per shape it prints and writes
(``phases.json``):

* the median and the 90th percentile over warps of each phase (µs, clock64 deltas at the warp's measured clock
  rate): ``prologue`` (the first copies issued), ``query`` (Q^T fragments built; before session 51's reorder it came
  first: its data in docs/data/s51/c3_h100 has the two the other way round), ``first_wait`` (until the first
  tile's copies landed), ``tiles`` (the rest of the warp's tiles), ``merge`` (the CTA's warps merged, waiting for the
  slowest included), ``write`` (the split partial written);
* the warps' tile counts, the spread of their entry times (launch skew) and the span from the first entry to the last
  exit (global timer), beside the read's time from CUDA events (no graph: launch gaps included) for the plain and
  the instrumented library;
* that both libraries give the same output.  The split combine is not instrumented.

    python benchmarks/gpu_kivi_phases.py --out DIR [--shapes llama3-8b:1:32k:2,...] [--config '{"min_tiles": 2}']

A shape is ``model:batch:ctx:bits``.
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
SLOTS = 16
PHASES = ("prologue", "query", "first_wait", "tiles", "merge", "write")
DEFAULT_SHAPES = "llama3-8b:1:32k:2,llama3-8b:1:4k:2,llama3-8b:1:128k:2,llama3-8b:16:32k:2,smollm2-135m:1:32k:2"


def warp_phases(rec: list[int]) -> dict[str, float] | None:
    """One warp's record (slots: 0 global timer at entry (ns), 1 SM, 2 tiles, clock64() at 3 entry, 4 prologue issued,
    5 query built, 6 first tile landed (0: no tile), 7 last tile done, 8 merged, 9 written, 10 global timer at
    the end) as µs per phase, at the warp's clock rate (cycles 3 -> 9 over nanoseconds 0 -> 10).  ``None`` for a
    record no warp wrote (no end time)."""
    ns, cycles = rec[10] - rec[0], rec[9] - rec[3]
    if ns <= 0 or cycles <= 0:
        return None
    per_us = cycles / ns * 1e3  # cycles per µs
    first = rec[6] if rec[2] > 0 and rec[6] else rec[5]  # a warp without tiles waits for nothing
    marks = [rec[3], rec[4], rec[5], first, rec[7], rec[8], rec[9]]
    return {p: (marks[i + 1] - marks[i]) / per_us for i, p in enumerate(PHASES)}


def summarize(records: list[list[int]]) -> dict:
    """Medians / 90th percentiles of each phase over the warps that wrote a record, their tile counts, the entry skew
    and the span from the first entry to the last exit (µs, global timer)."""
    rows = [(r, warp_phases(r)) for r in records]
    rows = [(r, ph) for r, ph in rows if ph is not None]
    if not rows:
        return {"warps": 0}
    out = {"warps": len(rows)}
    for p in PHASES:
        vals = sorted(ph[p] for _, ph in rows)
        out[p] = {"median": statistics.median(vals), "p90": vals[min(len(vals) - 1, int(0.9 * len(vals)))]}
    tiles = [r[2] for r, _ in rows]
    out["tile_counts"] = {str(t): tiles.count(t) for t in sorted(set(tiles))}
    starts, ends = [r[0] for r, _ in rows], [r[10] for r, _ in rows]
    out["entry_skew_us"] = (max(starts) - min(starts)) / 1e3
    out["span_us"] = (max(ends) - min(starts)) / 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--config", default="{}", help="JSON entries of KVCOMPRESS_KIVI_CUDA_CONFIG for the run")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from kvcompress.kernels import benchutil as bu
    from kvcompress.kernels.kivi import cuda_kernel as ck

    os.makedirs(args.out, exist_ok=True)
    extra = json.loads(args.config)
    results = []
    for spec in args.shapes.split(","):
        model, b, ctx, bits = spec.split(":")
        b, ctx, bits = int(b), bu.parse_context(ctx), int(bits)
        hq, hkv, d = HEADS[model]
        m = hq // hkv
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, packed = bu.kivi_inputs(b, hkv, ctx, d, bits, bu.KEY_GROUP, bu.VALUE_GROUP, m, torch.device("cuda"), gen)
        scale = d ** -0.5
        base = {**ck.config(bits), **extra}
        inst = {**base, "phases": 1}
        lib = ck.build_for(bits, d, d, inst)
        rows = b * hkv * -(-m // 8)  # CTA rows: (batch, kv head, row block of 8 query rows)
        _, nw, _, splits, *_ = ck._plan(bits, d, d, rows, ctx, torch.cuda.current_device(), None, dict(inst), None)
        warps = splits * rows * nw
        plain_out, _ = ck._forward(q, packed, scale, base=base)
        inst_out, _ = ck._forward(q, packed, scale, base=inst)
        same = bool(torch.equal(plain_out, inst_out))
        per = {p: [] for p in PHASES}
        summaries = []
        for _ in range(args.reps):
            ck._forward(q, packed, scale, base=inst)
            torch.cuda.synchronize()
            buf = (ctypes.c_longlong * (warps * SLOTS))()
            err = lib.kivi_v3_phases(buf, warps * SLOTS)
            if err:
                raise RuntimeError(f"kivi_v3_phases: error {err}")
            recs = [list(buf[i * SLOTS:(i + 1) * SLOTS]) for i in range(warps)]
            summaries.append(summarize(recs))
            if not summaries[-1]["warps"]:  # nothing decodable: say what came back, then go on to the next shape
                written = [r for r in recs if any(r)]
                print(f"## {spec}: no decodable record ({len(written)} of {warps} warps wrote any slot); first "
                      f"written: {written[:2]}")
                break
            for p in PHASES:
                per[p].append(summaries[-1][p]["median"])
        if not summaries[-1]["warps"]:
            results.append({"shape": spec, "config": extra, "splits": splits, "nw": nw, "warps": warps,
                            "same_output": same, "error": "no decodable record"})
            continue
        times = {}
        for name, cfg in (("plain", base), ("instrumented", inst)):
            for _ in range(3):
                ck._forward(q, packed, scale, base=cfg)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(args.reps):
                ck._forward(q, packed, scale, base=cfg)
            ev1.record()
            torch.cuda.synchronize()
            times[name] = ev0.elapsed_time(ev1) * 1e3 / args.reps
        last = summaries[-1]
        row = {"shape": spec, "config": extra, "splits": splits, "nw": nw, "warps": warps, "same_output": same,
               "phase_us_median": {p: statistics.median(v) for p, v in per.items()},
               "phase_us_p90_last": {p: last[p]["p90"] for p in PHASES}, "tiles_last": last["tile_counts"],
               "entry_skew_us_median": statistics.median(s["entry_skew_us"] for s in summaries),
               "span_us_median": statistics.median(s["span_us"] for s in summaries), "call_us_events": times}
        results.append(row)
        med = row["phase_us_median"]
        print(f"## {spec} {extra or ''}: {splits} splits x {nw} warps, {warps} warps, same output {same}, call "
              f"{times['plain']:.1f} us plain / {times['instrumented']:.1f} instrumented (events, no graph)")
        print("   " + "  ".join(f"{p} {med[p]:.2f}" for p in PHASES) + f"  = {sum(med.values()):.2f} us per warp")
        print(f"   tiles per warp {row['tiles_last']}, entry skew {row['entry_skew_us_median']:.2f} us, split kernel "
              f"span {row['span_us_median']:.2f} us")
        with open(os.path.join(args.out, "phases.json"), "w") as fh:
            json.dump(results, fh, indent=1)
        del q, packed
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
