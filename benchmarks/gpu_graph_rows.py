"""Decode-step rows of kvcompress' own CUDA-graph replay (kvcompress.graphs.GraphStep) on the GPU machine:
    python benchmarks/gpu_graph_rows.py --stack kivi2 none --points 1x32768 8x16384 --out DIR
Same measurement as benchmarks/e2e_decode.py (kvcompress.evaluation.e2e.measure_row), "graph" rows only:
the Llama-3-8B shape with random bf16 weights, static cache, torch.compile(fullgraph=True) without CUDA-graph
trees, captured once and replayed."""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvcompress.evaluation import e2e


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", nargs="+", default=["kivi2"])
    ap.add_argument("--points", nargs="+", default=["1x32768"])
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = e2e.random_model("llama3-8b", "cuda", torch.bfloat16)
    rows = []
    for point in args.points:
        b, c = (int(x) for x in point.split("x"))
        for name in args.stack:
            stack = e2e.resolve_stacks([name], model)[0]
            row = e2e.measure_row(model, e2e.RowSpec("graph", f"{name} + compile + CUDA graph", stack), b, c)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("label", "batch", "context", "wall_ms", "gpu_busy_ms",
                                                  "wall_over_busy", "kernels_per_step", "compile_s", "graphs",
                                                  "cache_bytes", "error")}), flush=True)
            with open(os.path.join(args.out, "graph_rows.json"), "w") as f:
                json.dump({"environment": e2e.environment(torch.device("cuda")), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
