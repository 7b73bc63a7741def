#!/usr/bin/env bash
# Issue 19, session 25: the KIVI CUDA kernel reads a static layer's full-precision buffer (sinks + recent window) in the
# same launch as its quantized middle (kvcompress::kivi_buffer_partial).  One device call:
#   bash benchmarks/gpu_buffer_session.sh OUTDIR [POINTS...]   (default point 1x4096)
# 1. every KIVI CUDA library compiled in parallel; the GPU tests of the one-launch read (tests/test_kivi_buffer_read.py),
#    the registered op's compiled cases (tests/test_kernel_ops.py -k buffer) and the plain kernel's reference checks
#    (tests/test_kivi_cuda.py -k matches_reference_on_gpu: Params grew by the buffer's entries);
# 2. only if they pass: the static KIVI-2 read against SDPA (benchutil op kivi2-static), then GraphStep rows of kivi2
#    and the empty stack (benchmarks/gpu_graph_rows.py) at POINTS.
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift || true
POINTS=("$@")
[ ${#POINTS[@]} -gt 0 ] || POINTS=(1x4096)
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
timeout 90 python "$SRC/benchmarks/gpu_prebuild_kivi.py" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
timeout 200 python -m pytest -q -m gpu "$SRC/tests/test_kivi_buffer_read.py" "$SRC/tests/test_kernel_ops.py" \
  "$SRC/tests/test_kivi_cuda.py" -k "buffer or matches_reference_on_gpu" -p no:cacheprovider -p no:logging 2>&1 \
  | grep -v DEBUG | grep -E "passed|failed|FAILED|Error|assert" | tail -20 | tee "$OUT/pytest.log"
rc=$?
date -u | tee -a "$OUT/log.txt"
if grep -q "failed\|FAILED\|error" "$OUT/pytest.log" || ! grep -q "passed" "$OUT/pytest.log"; then
  echo "GPU tests did not pass: no timing" | tee -a "$OUT/log.txt"
  exit 1
fi
# the static KIVI-2 layer's read (buffer + middle in one launch) against SDPA, the middle alone and the empty stack
timeout 120 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,kivi2,none,kivi2-static \
  --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,smollm2-135m:1:32k --out "$OUT/static_read.json" \
  2>/dev/null | grep '^|' | tee -a "$OUT/static_read.md"
timeout 330 python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph --stack kivi2 none --jobs 2 \
  --points "${POINTS[@]}" --out "$OUT/graph_rows" 2>&1 | grep -E '^\{|Error' | cut -c1-420 | tee -a "$OUT/log.txt"
date -u | tee -a "$OUT/log.txt"
