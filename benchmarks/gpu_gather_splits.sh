#!/usr/bin/env bash
# Session 21 (issue 19), fourth device call: the DoubleSparse gather's split count at small batch.  The DS GPU tests,
# then the DoubleSparse rows at B1 / B4 (both head shapes) and Llama B16/4k for each minimum of indices per split
# (KVCOMPRESS_DS_CONFIG '{"min_per_split": N}', each in its own process; 64 = the split rule before this session).
#   bash benchmarks/gpu_gather_splits.sh OUTDIR
set -o pipefail
OUT=$(realpath -m "${1:-out}")
source "$(dirname "$0")/gpu_ds_common.sh"  # install under /tmp/site, cd there, DS GPU tests
SHAPES=llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:1:128k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:16:4k
SHAPES=$SHAPES,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k,smollm2-135m:4:32k
for N in 64 256 1024 4096 64; do
  date -u | tee -a "$OUT/log.txt"
  KVCOMPRESS_DS_CONFIG="{\"min_per_split\": $N}" timeout 90 python -m kvcompress.kernels.benchutil --device cuda \
    --ops sdpa,ds8,ds16,ds8-shared,ds16-shared --only-shapes $SHAPES --max-seconds 80 \
    --out "$OUT/splits_$N.json" 2>"$OUT/splits_$N.err" | grep '^|' > "$OUT/splits_$N.md"
  [ -f "$OUT/splits_$N.json" ] && cp "$OUT/splits_$N.json" "$OUT/splits_${N}_$(date +%s).json"
  tail -1 "$OUT/splits_$N.err"
done
date -u | tee -a "$OUT/log.txt"
