#!/usr/bin/env bash
# Issue 19, session 26: how many buffer CTAs the KIVI kernel's one-launch read of a static layer should use.  One
# device call: the static KIVI-2 layer's whole decode read (benchutil op kivi2-static: CUDA graphs, cold L2) with the
# launch setting buffer_tokens = slots per buffer CTA (KVCOMPRESS_KIVI_CUDA_CONFIG; 0 = the buffer and the region
# read apart, as before session 25), beside SDPA and the region alone (kivi2), alternating the settings over rounds.
#   bash benchmarks/gpu_buffer_tokens.sh OUTDIR [TOKENS...]     (default 0 32 64 256)
set -o pipefail
OUT=$(realpath "${1:-out}"); shift || true
TOKENS=("$@")
[ ${#TOKENS[@]} -gt 0 ] || TOKENS=(0 32 64 256)
SHAPES=${BT_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:1:32k,smollm2-135m:16:32k}
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
timeout 150 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,kivi2 --only-shapes "$SHAPES" \
  --out "$OUT/base.json" 2>/dev/null | grep '^|' | tee -a "$OUT/rows.md"
for r in $(seq 1 "${BT_ROUNDS:-2}"); do
  for t in "${TOKENS[@]}"; do
    echo "## round $r buffer_tokens $t" | tee -a "$OUT/rows.md"
    KVCOMPRESS_KIVI_CUDA_CONFIG="{\"buffer_tokens\": $t}" timeout 150 python -m kvcompress.kernels.benchutil \
      --device cuda --ops sdpa,kivi2-static --only-shapes "$SHAPES" --out "$OUT/tokens_${t}_r$r.json" 2>/dev/null \
      | grep '^|' | grep -v '^| sdpa\|^|---\|^| op' | tee -a "$OUT/rows.md"
  done
done
date -u | tee -a "$OUT/log.txt"
