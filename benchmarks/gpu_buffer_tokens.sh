#!/usr/bin/env bash
# Issue 19, session 26: when, and with how many buffer CTAs, the KIVI kernel should read a static layer's buffer in the
# same launch as its middle.  One device call: the static KIVI-2 layer's whole decode read (benchutil op kivi2-static:
# CUDA graphs, cold L2) under each launch configuration given (KVCOMPRESS_KIVI_CUDA_CONFIG JSON: buffer_tokens = slots
# per buffer CTA, 0 = the buffer and the region read apart; buffer_rows / buffer_work = the most batch x head x
# row-block rows, or rows x region slots, read in one launch), beside SDPA and the region alone (kivi2).
#   bash benchmarks/gpu_buffer_tokens.sh OUTDIR [CONFIG_JSON...]
#   default configs: '{"buffer_tokens": 0}' '{"buffer_rows": 1000000}' '{}' (apart, always one launch, the default)
#   BT_SHAPES: benchutil --only-shapes; BT_ROUNDS: rounds over the configs (default 1)
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=('{"buffer_tokens": 0}' '{"buffer_rows": 1000000}' '{}')
SHAPES=${BT_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:1:32k,smollm2-135m:16:32k}
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
timeout 150 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,kivi2 --only-shapes "$SHAPES" \
  --out "$OUT/base.json" 2>/dev/null | grep '^|' | tee -a "$OUT/rows.md"
i=0
for r in $(seq 1 "${BT_ROUNDS:-1}"); do
  for c in "${CONFIGS[@]}"; do
    i=$((i + 1))
    echo "## round $r config $c" | tee -a "$OUT/rows.md"
    KVCOMPRESS_KIVI_CUDA_CONFIG="$c" timeout 150 python -m kvcompress.kernels.benchutil \
      --device cuda --ops sdpa,kivi2-static --only-shapes "$SHAPES" --out "$OUT/config_$i.json" 2>/dev/null \
      | grep '^|' | grep -v '^| sdpa\|^|---\|^| op' | tee -a "$OUT/rows.md"
  done
done
date -u | tee -a "$OUT/log.txt"
