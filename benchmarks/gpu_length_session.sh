#!/usr/bin/env bash
# Session 23 (issue 19): the KIVI CUDA kernels (plain and lanes) read the live length on the device (Params::len)
# instead of a per-read `valid & (slot < length)` op, and a static read makes no clamp / position op - in two calls.
#   PART=tests bash benchmarks/gpu_length_session.sh OUTDIR
#   PART=bench bash benchmarks/gpu_length_session.sh OUTDIR
# tests: every KIVI CUDA library the tests load compiled in parallel, then tests/test_kivi_cuda.py -m gpu (incl. the
#   new length test: every case at 5 lengths x 3 split counts, a graph replayed after the length changes in place)
#   and tests/test_kivi_lanes.py -m gpu (the lanes cases with odd live lengths now go through Params::len; a graph
#   test of the lanes kernel's length; LANES_K: a pytest -k filter).
# bench: issue 19's rows at the small shapes where the launches around the kernels matter (sdpa, kivi2, kivi4,
#   leank70-kivi2, none, lowrank); benchmarks/gpu_live_length.py (a KIVI-2 store early in a long generation:
#   capacity 32k / 128k, 1k-16k live tokens); the kernels of the leank70-kivi2 / none reads at Llama B1/4k.
set -o pipefail
OUT=$(realpath -m "${1:-out}")
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
if [ "${PART:-tests}" = tests ]; then
  source "$SRC/benchmarks/gpu_kivi_tests.sh"  # prebuild, then the KIVI CUDA / lanes GPU tests
  exit 0
fi
timeout 200 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,kivi2,kivi4,leank70-kivi2,none,lowrank \
  --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:1:4k,smollm2-135m:1:32k \
  --out "$OUT/rows.json" 2>/tmp/rows.err | grep '^|' | tee "$OUT/rows.md"
tail -2 /tmp/rows.err | tee -a "$OUT/log.txt"
date -u | tee -a "$OUT/log.txt"
for cfg in '{"interleave": 0}'; do  # the contiguous tile assignment (the default before session 23's interleave)
  KVCOMPRESS_KIVI_CUDA_CONFIG="$cfg" timeout 60 python -m kvcompress.kernels.benchutil --device cuda \
    --ops sdpa,kivi2,kivi4,leank70-kivi2 \
    --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:1:32k \
    --out "$OUT/rows_contiguous.json" 2>/dev/null | grep '^|' | tee "$OUT/rows_contiguous.md"
done
date -u | tee -a "$OUT/log.txt"
timeout 200 python "$SRC/benchmarks/gpu_live_length.py" --out "$OUT/live_length.json" 2>&1 | tail -20 \
  | tee "$OUT/live_length.md"
date -u | tee -a "$OUT/log.txt"
timeout 100 python "$SRC/benchmarks/gpu_read_profile.py" --ops leank70-kivi2,none --shapes llama3-8b:1:4k \
  --out "$OUT/read_profile.json" 2>&1 | grep -v Warn | tail -30 | tee "$OUT/read_profile.txt"
date -u | tee -a "$OUT/log.txt"
