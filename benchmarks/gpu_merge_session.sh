#!/usr/bin/env bash
# Session 22 (issue 19): the static read's region merge as one launch (kvcompress::merge_partials, Triton), in one
# short device call.
#   bash benchmarks/gpu_merge_session.sh OUTDIR [SHAPES]
# 1. GPU tests of the op (tests/test_kernel_ops.py -m gpu -k merge: each impl compiled with CUDA graphs against the
#    reference) and of the read paths that use it (tests/test_kivi_lanes.py static read, reduce-overhead);
# 2. the static-read rows that merge regions (leank70-kivi2, lowrank) beside SDPA and the empty stack's read at SHAPES
#    (default: Llama B1/4k, B1/32k, B16/32k, SmolLM2 B1/32k); compare with the same rows of session 22's lanes grid and
#    session 21's grid (docs/data), which ran the ~10-op PyTorch merge.
set -o pipefail
OUT=$(realpath -m "${1:-out}"); SHAPES=${2:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,smollm2-135m:1:32k}
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
timeout 100 python -m pytest -q -m gpu "$SRC/tests/test_kernel_ops.py" "$SRC/tests/test_kivi_lanes.py" \
  -k "merge or static_read" -p no:cacheprovider -p no:logging 2>&1 | grep -v DEBUG | tail -12 | tee "$OUT/pytest.log"
date -u | tee -a "$OUT/log.txt"
timeout 120 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,none,leank70-kivi2,lowrank \
  --only-shapes "$SHAPES" --out "$OUT/merge_rows.json" 2>/tmp/rows.err | grep '^|' | tee "$OUT/merge_rows.md"
tail -3 /tmp/rows.err | tee -a "$OUT/log.txt"
date -u | tee -a "$OUT/log.txt"
