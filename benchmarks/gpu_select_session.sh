#!/usr/bin/env bash
# Session 21 (issue 19): the DoubleSparse select kernel's top-k search on the H200, in one device call (first run:
# the early stop and the scratch packing, since removed; second run: 1 or 2 bits per round, launch widths;
# the 2-bit rounds were removed after it).
#   bash benchmarks/gpu_select_session.sh OUTDIR [OLD_MODULE]
# 1. GPU tests of the DoubleSparse kernels (the search on constructed keys, scores + top-k, gathers);
# 2. benchmarks/gpu_select_sweep.py: select latency of each search configuration (and OLD_MODULE, an earlier copy
#    of the kernel module placed in the tree, as "old"; the sweep script's default configurations), the best
#    correct one written to OUT/best.json;
# 3. the DoubleSparse rows of issue 19's grid (both head shapes, every B x ctx) with that configuration
#    (KVCOMPRESS_DS_CONFIG).
set -o pipefail
OUT=$(realpath -m "${1:-out}"); OLD=${2:-}
source "$(dirname "$0")/gpu_ds_common.sh"  # install under /tmp/site, cd there, DS GPU tests
date -u | tee -a "$OUT/log.txt"
timeout 220 python "$SRC/benchmarks/gpu_select_sweep.py" --out "$OUT" ${OLD:+--old "$OLD"} --best "$OUT/best.json" \
  2>"$OUT/sweep.err" | grep '^|' | tee "$OUT/sweep.md"
tail -3 "$OUT/sweep.err"
date -u | tee -a "$OUT/log.txt"
BEST=$(cat "$OUT/best.json" 2>/dev/null || echo '{}')
echo "grid with KVCOMPRESS_DS_CONFIG=$BEST" | tee -a "$OUT/log.txt"
KVCOMPRESS_DS_CONFIG="$BEST" timeout 260 python -m kvcompress.kernels.benchutil --device cuda \
  --ops sdpa,ds8,ds16,ds8-shared,ds16-shared --models llama3-8b,smollm2-135m --max-seconds 220 \
  --out "$OUT/ds_grid.json" 2>"$OUT/grid.err" | grep '^|' | tee "$OUT/ds_grid.md"
tail -3 "$OUT/grid.err"
date -u | tee -a "$OUT/log.txt"
