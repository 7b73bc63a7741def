#!/usr/bin/env bash
# Session 21 (issue 19), second device call: the DoubleSparse GPU tests with the new select default, issue 19's whole
# grid (every op of GRID_OPS, both head shapes), then the select kernel's chunk size at small batch (information).
#   bash benchmarks/gpu_grid_session.sh OUTDIR
set -o pipefail
OUT=$(realpath -m "${1:-out}")
source "$(dirname "$0")/gpu_ds_common.sh"  # install under /tmp/site, cd there, DS GPU tests
for M in llama3-8b smollm2-135m; do
  date -u | tee -a "$OUT/log.txt"
  timeout 200 python -m kvcompress.kernels.benchutil --device cuda --ops grid --models $M --max-seconds 170 \
    --out "$OUT/grid_$M.json" 2>"$OUT/grid_$M.err" | grep '^|' > "$OUT/grid_$M.md"
  tail -2 "$OUT/grid_$M.err"
done
date -u | tee -a "$OUT/log.txt"
timeout 100 python "$SRC/benchmarks/gpu_select_sweep.py" --out "$OUT" \
  --only llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,smollm2-135m:1:32k \
  --configs '{}' '{"chunk_tokens": 8192}' '{"chunk_tokens": 4096}' '{"chunk_tokens": 2048}' 2>"$OUT/sweep.err" \
  | grep '^|' > "$OUT/chunk_sweep.md"
tail -2 "$OUT/sweep.err"
date -u | tee -a "$OUT/log.txt"
