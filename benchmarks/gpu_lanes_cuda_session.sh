#!/usr/bin/env bash
# Session 22 (issue 19): the KIVI lanes read (LeanK-70 + KIVI-2, one launch over every lane) on the CUDA v3 kernel's
# inner loop, in one device call.
#   bash benchmarks/gpu_lanes_cuda_session.sh OUTDIR [MODELS] [BATCHES]
# 1. GPU tests: the CUDA lanes kernel and the Triton one against the reference / float64 oracle
#    (tests/test_kivi_lanes.py -m gpu), the plain CUDA kernel after its body became a device function shared with the
#    lanes kernel (tests/test_kivi_cuda.py -m gpu);
# 2. issue 19's grid for sdpa, kivi2, kivi4, leank70-kivi2 (now the CUDA lanes kernel) and leank70-kivi2-triton (the
#    same layer read by the Triton lanes kernel, the session-21 read), MODELS (default both) x BATCHES (default
#    1,4,16,64) x 4k / 32k / 128k;
# 3. with PROFILE=model:B:ctx,... : every kernel of the leank70-kivi2 read at those shapes (benchmarks/gpu_read_profile.py).
# 4. with CHECKS=1: benchmarks/gpu_ops_check.py for kvcompress::kivi_lanes_partial (every impl, the CUDA one included):
#    compiled with CUDA graphs at its small shapes (OUT/ops_small), and eager at every shape of issue 19's grid
#    (OUT/ops_grid).
# LANES_K: a pytest -k filter for the lanes tests; SKIP_CUDA_TESTS=1 skips the plain kernel's tests; GRID_SECONDS bounds step 2 (default 330).
set -o pipefail
OUT=$(realpath -m "${1:-out}"); MODELS=${2:-llama3-8b,smollm2-135m}; BATCHES=${3:-1,4,16,64}
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
timeout 220 python -m pytest -q -m gpu "$SRC/tests/test_kivi_lanes.py" -p no:cacheprovider -p no:logging ${LANES_K:+-k "$LANES_K"} 2>&1 \
  | grep -v DEBUG | tail -25 | tee "$OUT/pytest_lanes.log"
date -u | tee -a "$OUT/log.txt"
[ -n "$SKIP_CUDA_TESTS" ] || timeout 120 python -m pytest -q -m gpu "$SRC/tests/test_kivi_cuda.py" -p no:cacheprovider -p no:logging \
  -k "matches_reference_on_gpu or configs_and_splits_on_gpu or side_by_side or graph_capture" 2>&1 \
  | grep -v DEBUG | tail -15 | tee "$OUT/pytest_cuda.log"
date -u | tee -a "$OUT/log.txt"
timeout "${GRID_SECONDS:-330}" python -m kvcompress.kernels.benchutil --device cuda \
  --ops sdpa,kivi2,kivi4,leank70-kivi2,leank70-kivi2-triton --models "$MODELS" --batches "$BATCHES" \
  --max-seconds "$(( ${GRID_SECONDS:-330} - 40 ))" --out "$OUT/lanes_grid.json" 2>/tmp/grid.err | grep '^|' \
  | tee "$OUT/lanes_grid.md"
tail -3 /tmp/grid.err | tee -a "$OUT/log.txt"
date -u | tee -a "$OUT/log.txt"
if [ -n "$PROFILE" ]; then
  timeout 120 python "$SRC/benchmarks/gpu_read_profile.py" --ops leank70-kivi2,leank70-kivi2-triton --shapes "$PROFILE" \
    --out "$OUT/read_profile.json" 2>&1 | tail -40 | tee "$OUT/read_profile.txt"
  date -u | tee -a "$OUT/log.txt"
fi
if [ -n "$CHECKS" ]; then  # CHECKS=small: the compiled small shapes only
  timeout 150 python "$SRC/benchmarks/gpu_ops_check.py" --out "$OUT/ops_small" --ops kivi_lanes_partial --shapes small \
    2>&1 | grep -v "^PASS" | tail -8 | tee -a "$OUT/log.txt"
  [ "$CHECKS" = small ] || timeout 200 python "$SRC/benchmarks/gpu_ops_check.py" --out "$OUT/ops_grid" \
    --ops kivi_lanes_partial --grid --eager 2>&1 | grep -v "^PASS" | tail -8 | tee -a "$OUT/log.txt"
  date -u | tee -a "$OUT/log.txt"
fi
