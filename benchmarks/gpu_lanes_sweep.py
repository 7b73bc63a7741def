"""Launch-configuration sweep of the grouped lanes kernel (kernels/leank/triton_kernel.py) on issue 19's grid ops
that read through it: ``none`` (the empty stack's dense read: the same bytes as SDPA), ``leank50`` / ``leank70``
and ``lowrank``.  Each configuration runs ``python -m kvcompress.kernels.benchutil`` in its own process with
``KVCOMPRESS_LEANK_CONFIG`` set (the kernel reads it once per process), on a few shapes, and the speed-ups over
SDPA are tabulated side by side (one JSON per configuration under --out, plus sweep.json / sweep.md).

    python benchmarks/gpu_lanes_sweep.py --out DIR [--configs default,bn128w8,...] [--shapes llama3-8b:1:32k,...]
        [--max-seconds 480]

``--kernel kivi-lanes`` sweeps the one-launch KIVI lanes read (kernels/kivi/lanes_triton.py, op
``leank70-kivi2``) instead, through ``KVCOMPRESS_KIVI_CONFIG`` (configurations :data:`KIVI_CONFIGS`; defaults BN 16,
1 warp, 2 stages, 2 waves, splits of >= 512 tokens - session 14's measured setting, 64 one-warp programs at B1 / 4k on
132 SMs: 110 µs there; ``split128`` is the floor session 14 set without measuring and session 15 reverted).

Configurations stop being started after --max-seconds (each takes ~10-20 s: Triton compiles, then CUDA-graph
timing); run on the GPU machine with kvcompress importable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: entries override triton_kernel._config() (defaults: BN 64, num_warps 4, num_stages 4, waves 2,
#: min_split_tokens 256)
CONFIGS = {
    "default": {},
    "bn128": {"BN": 128},
    "bn128w8": {"BN": 128, "num_warps": 8},
    "bn128w8s3": {"BN": 128, "num_warps": 8, "num_stages": 3},
    "bn128s3": {"BN": 128, "num_stages": 3},
    "bn64s3": {"num_stages": 3},
    "bn64w8": {"num_warps": 8},
    "waves4": {"waves": 4},
    "waves1": {"waves": 1},
    "split512": {"min_split_tokens": 512},
    "bn128w8waves4": {"BN": 128, "num_warps": 8, "waves": 4},
    "bn32s5": {"BN": 32, "num_stages": 5},
    "combine_splits": {"combine": "splits"},  # the merge that folds several splits per step (session 15)
    "split64_combine_splits": {"min_split_tokens": 64, "combine": "splits"},
    "split128_combine_splits": {"min_split_tokens": 128, "combine": "splits"},
    "bn64s3_combine_splits": {"num_stages": 3, "combine": "splits"},
    "waves4_combine_splits": {"waves": 4, "combine": "splits"},
    "waves1_combine_splits": {"waves": 1, "combine": "splits"},
    "bn128s3_combine_splits": {"BN": 128, "num_stages": 3, "combine": "splits"},
}

#: entries override kernels/kivi/triton_kernel._config() (the KIVI lanes kernel's base)
KIVI_CONFIGS = {
    "default": {},  # split floor 128, combine "splits" (session 16: best of the session-16 sweep at B1 and B4)
    "loop512": {"lanes_min_split_tokens": 512, "combine": "loop"},  # sessions 14-15's default
    "loop128": {"lanes_min_split_tokens": 128, "combine": "loop"},
    "split512": {"lanes_min_split_tokens": 512},
    "split256": {"lanes_min_split_tokens": 256},
    "split64": {"lanes_min_split_tokens": 64},
    "waves4": {"waves": 4},  # best at B64/32k with the loop merge in session 16
    "bn32": {"BN": 32},
    "nw2": {"num_warps": 2},
    "bn32nw2": {"BN": 32, "num_warps": 2},
}

SHAPES = ("llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,"
          "smollm2-135m:1:32k,smollm2-135m:16:32k")
OPS = "none,leank50,leank70,lowrank"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel", choices=("lanes", "kivi-lanes"), default="lanes",
                    help="lanes: the grouped lanes kernel (KVCOMPRESS_LEANK_CONFIG); kivi-lanes: the one-launch KIVI "
                         "lanes read (KVCOMPRESS_KIVI_CONFIG)")
    ap.add_argument("--configs", default=None, help="default: every configuration of the kernel")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ops", default=None, help="default: none,leank50,leank70,lowrank (lanes) / leank70-kivi2 "
                                                "(kivi-lanes)")
    ap.add_argument("--max-seconds", type=float, default=480.0)
    args = ap.parse_args(argv)
    table, variable = (CONFIGS, "KVCOMPRESS_LEANK_CONFIG") if args.kernel == "lanes" else \
        (KIVI_CONFIGS, "KVCOMPRESS_KIVI_CONFIG")
    if args.ops is None:
        args.ops = OPS if args.kernel == "lanes" else "leank70-kivi2"
    os.makedirs(args.out, exist_ok=True)
    names = [c for c in (args.configs or ",".join(table)).split(",") if c]
    unknown = [c for c in names if c not in table]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(table)}")
    t0 = time.time()
    results: dict[str, dict] = {}
    for name in names:
        if time.time() - t0 > args.max_seconds:
            print(f"[sweep] {name}: skipped (--max-seconds)", flush=True)
            continue
        out = os.path.join(args.out, f"{name}.json")
        env = dict(os.environ, **{variable: json.dumps(table[name])})
        ops = ",".join(dict.fromkeys(["sdpa", *args.ops.split(",")]))  # each file carries its own SDPA baseline
        cmd = [sys.executable, "-m", "kvcompress.kernels.benchutil", "--device", "cuda", "--ops", ops,
               "--only-shapes", args.shapes, "--out", os.path.abspath(out)]
        t1 = time.time()
        # from outside any checkout: a repository's kvcompress/ (without kernels/ and plugins/) must not shadow the
        # installed package
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
        print(f"[sweep] {name} {table[name]}: rc {proc.returncode}, {time.time() - t1:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-2000:], flush=True)
            continue
        with open(out, encoding="utf-8") as fh:
            rows = json.load(fh)["rows"]
        sdpa = {(r["model"], r["batch"], r["ctx"]): r["latency_us"] for r in rows
                if r["op"] == "sdpa" and r.get("latency_us")}
        results[name] = {f"{r['op']} {r['model']} B{r['batch']}/{r['ctx'] // 1024}k":
                         sdpa[(r["model"], r["batch"], r["ctx"])] / r["latency_us"]
                         for r in rows if r["op"] != "sdpa" and r.get("latency_us")
                         and (r["model"], r["batch"], r["ctx"]) in sdpa}
    keys = sorted({k for res in results.values() for k in res})
    lines = ["| op / shape | " + " | ".join(results) + " |", "|" + "---|" * (len(results) + 1)]
    for k in keys:
        vals = [results[n].get(k) for n in results]
        best = max((v for v in vals if v is not None), default=None)
        cells = ["-" if v is None else (f"**{v:.2f}**" if v == best else f"{v:.2f}") for v in vals]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    markdown = "\n".join(lines)  # not ``table``: the configurations' table is written beside it below
    print(markdown)
    with open(os.path.join(args.out, "sweep.md"), "w", encoding="utf-8") as fh:
        fh.write(markdown + "\n")
    with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as fh:
        json.dump({"kernel": args.kernel, "configs": {n: table[n] for n in results}, "speedup_vs_sdpa": results}, fh,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
