#!/usr/bin/env bash
# Issue 19 follow-up of session 22: the GPU tests of the refactored CUDA launchers, what the CUDA lanes kernel and the
# one-launch merge give in the model, and the CUDA KIVI launch configuration at batch 1 - in two device calls.
#   PART=tests bash benchmarks/gpu_lanes_tune.sh OUTDIR
#   PART=graph bash benchmarks/gpu_lanes_tune.sh OUTDIR [CONFIGS...]
# PART=tests: every KIVI CUDA library the tests load, compiled in parallel (benchmarks/gpu_prebuild_kivi.py), then
#   tests/test_kivi_cuda.py -m gpu in full (the plain kernel's launcher now shares check_launch / launch_variant with the
#   lanes kernel) and tests/test_kivi_lanes.py -m gpu (incl. the bf16 query case).
# PART=graph:
# 1. GraphStep decode rows (compiled + one CUDA graph, Llama-3-8B shape, random bf16 weights) of kivi2 and
#    leank-rope70-kivi2 at B1/32k (benchmarks/gpu_graph_rows.py; session 16: leank-rope70-kivi2 8.44 ms GPU-busy with
#    the Triton lanes kernel, kivi2 7.6 ms) - the first model-level timing of the CUDA lanes read and the merge op;
# 2. the batch-1 reads under each KVCOMPRESS_KIVI_CUDA_CONFIG in CONFIGS (default: the defaults, 4 and 2 tiles per
#    warp, 2 waves), each in its own process (the configuration is read once): kivi2 and leank70-kivi2 at Llama
#    B1/4k, B1/32k, SmolLM2 B1/32k and Llama B16/32k (the launch settings are shared by the plain and the lanes
#    kernel; the fold builds, timed in session 6 at 1-2%, apply to the plain kernel only).
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=('{}' '{"min_tiles": 4}' '{"min_tiles": 2}' '{"waves": 2}')
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
if [ "${PART:-tests}" = tests ]; then
  source "$SRC/benchmarks/gpu_kivi_tests.sh"  # prebuild, then the KIVI CUDA / lanes GPU tests
  exit 0
fi
timeout 330 python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph --stack kivi2 leank-rope70-kivi2 --jobs 2 \
  --points 1x32768 --out "$OUT/graph_rows" 2>&1 | tail -6 | tee -a "$OUT/log.txt"
date -u | tee -a "$OUT/log.txt"
i=0
for cfg in "${CONFIGS[@]}"; do
  echo "KVCOMPRESS_KIVI_CUDA_CONFIG=$cfg" | tee -a "$OUT/log.txt"
  KVCOMPRESS_KIVI_CUDA_CONFIG="$cfg" timeout 55 python -m kvcompress.kernels.benchutil --device cuda \
    --ops sdpa,kivi2,leank70-kivi2 --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,smollm2-135m:1:32k,llama3-8b:16:32k \
    --out "$OUT/tune_$i.json" 2>/dev/null | grep '^|' | tee -a "$OUT/tune.md"
  i=$((i + 1))
done
date -u | tee -a "$OUT/log.txt"
