#!/usr/bin/env bash
# Session 31 (issue 19): the changes made without a GPU, checked and timed in the next device calls.
#   cd .gpusrc && PART=tests bash benchmarks/gpu_s31_session.sh $OUT       (call 1; the exported tree)
#   PART=ab bash .gpusrc/benchmarks/gpu_s31_session.sh $OUT .gpusrc_old .gpusrc
#       (call 2, from the repository root; .gpusrc_old: `git archive 37bdce0`, the tree before this session)
#   cd .gpusrc && PART=sweep bash benchmarks/gpu_s31_session.sh $OUT       (call 3)
#   cd .gpusrc && PART=pdl bash benchmarks/gpu_s31_session.sh $OUT         (call 4, session 32)
#   cd .gpusrc && PART=pdl-ds bash benchmarks/gpu_s31_session.sh $OUT      (call 5, session 32)
#   cd .gpusrc && PART=pdl-kivi bash benchmarks/gpu_s31_session.sh $OUT    (call 6, session 32)
#   cd .gpusrc && PART=ops-pdl bash benchmarks/gpu_s31_session.sh $OUT     (call 7, session 32: every op compiled with PDL)
# tests: the GPU tests of every file the session touched - the lanes kernel's in-kernel low-rank projection
#   (tests/test_lowrank_lanes.py, tests/test_leank_kernel.py incl. the resident split rule), the registered ops
#   (tests/test_kernel_ops.py, tests/test_scored_reads.py), the KIVI lanes + buffer launch (tests/test_kivi_lanes_buffer.py,
#   tests/test_kivi_lanes.py), and session 30's DoubleSparse review commit (tests/test_doublesparse_cuda.py, the group
#   cases of tests/test_doublesparse_kernel.py) - in S31_XDIST pytest-xdist workers (wheels in ../.gpuwheels).
# ab: the rows these changes should move, this tree against OLD_TREE, alternating rounds in one call
#   (benchmarks/gpu_ab_trees.sh): low-rank (projection in the kernel), leank70-kivi2 (buffer in the lanes launch at
#   B1 / B4), the empty stack's read, KIVI-2's static read - since session 32 every one of these writes the read's
#   dtype from its last launch (no cast launch), so none of them is a noise floor any more; sdpa is.
# sweep: the lanes kernel's opt-in split rule, KVCOMPRESS_LEANK_CONFIG '{"split_rows": "resident"}' against the
#   default, for none / lowrank / leank50 / leank70 (benchmarks/gpu_paged_sweep.sh with PS_VAR); and the same rule
#   with one split wherever the long rows exceed a wave ('"fill_splits": 1', session 31's rule), which isolates
#   session 32's wave fill (wave_fill_splits: Llama B64 = 512 rows on 396 slots takes 3 splits).
set -o pipefail
OUT=$(realpath -m "${1:-out}")
HERE=$(cd "$(dirname "$0")" && pwd)
PART=${PART:-tests}
SHAPES=llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:4k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k,smollm2-135m:4:32k,smollm2-135m:16:32k
if [ "$PART" = tests ]; then
  source "$HERE/gpu_site.sh"  # install under /tmp/site, cd there
  python -m pip install -q --no-index --no-deps --target /tmp/xdist "$SRC"/../.gpuwheels/*.whl 2>&1 | tail -2
  T="$SRC/tests"
  PYTHONPATH=$PYTHONPATH:/tmp/xdist timeout "${S31_TEST_TIMEOUT:-520}" python -m pytest -q -m gpu -p no:cacheprovider -n "${S31_XDIST:-8}" \
    "$T/test_lowrank_lanes.py" "$T/test_leank_kernel.py" "$T/test_kernel_ops.py" "$T/test_scored_reads.py" \
    "$T/test_kivi_lanes_buffer.py" "$T/test_kivi_lanes.py" "$T/test_lowrank.py" "$T/test_doublesparse_cuda.py" \
    "$T/test_doublesparse_kernel.py" "$T/test_kivi_buffer_read.py" -k "not test_doublesparse_kernel or group" 2>&1 \
    | tail -15 | tee "$OUT/tests.txt"
  date -u | tee -a "$OUT/log.txt"
elif [ "$PART" = ops-pdl ]; then
  # session 32: the registered ops compiled (reduce-overhead, CUDA graphs) at odd shapes with every kernel's PDL on,
  # against the eager reference (benchmarks/gpu_ops_check.py; the fp16-output lanes case included)
  source "$HERE/gpu_site.sh"
  KVCOMPRESS_LEANK_CONFIG='{"pdl": true}' KVCOMPRESS_PAGED_CONFIG='{"pdl": true}' KVCOMPRESS_DS_CONFIG='{"pdl": true}' \
    KVCOMPRESS_KIVI_CUDA_CONFIG='{"pdl": true}' timeout 540 python "$SRC/benchmarks/gpu_ops_check.py" --quick \
    --out "$OUT/ops_pdl" 2>&1 | tail -40 | tee "$OUT/ops_pdl.txt"
elif [ "$PART" = ab ]; then
  AB_OPS=sdpa,none,lowrank,leank70-kivi2,kivi2-static AB_SHAPES=$SHAPES AB_ROUNDS=${AB_ROUNDS:-2} \
    bash "$HERE/gpu_ab_trees.sh" "$OUT" "${2:-.gpusrc_old}" "${3:-.gpusrc}"
elif [ "$PART" = pdl ] || [ "$PART" = pdl-ds ] || [ "$PART" = pdl-kivi ]; then
  # session 32: programmatic dependent launch of the split merges (opt-in "pdl"), against the plain launches, at the
  # small reads where a launch's latency is a large share; first tests/test_pdl.py's GPU cases (eager + CUDA graph)
  B_SHAPES=llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:4k,llama3-8b:4:32k,smollm2-135m:1:4k,smollm2-135m:1:32k,smollm2-135m:4:4k,smollm2-135m:4:32k
  if [ "$PART" = pdl ]; then
    mkdir -p "$OUT/lanes" "$OUT/paged"
    PS_VAR=KVCOMPRESS_LEANK_CONFIG PS_OPS=none,lowrank,leank70 PS_TESTS=tests/test_pdl.py PS_SHAPES=$B_SHAPES \
      bash "$HERE/gpu_paged_sweep.sh" "$OUT/lanes" '{}' '{"pdl": true}'
    PS_VAR=KVCOMPRESS_PAGED_CONFIG PS_OPS=paged-dense PS_TESTS=tests/test_pdl.py PS_SHAPES=$B_SHAPES \
      bash "$HERE/gpu_paged_sweep.sh" "$OUT/paged" '{}' '{"pdl": true}'
  elif [ "$PART" = pdl-ds ]; then
    PS_VAR=KVCOMPRESS_DS_CONFIG PS_OPS=ds8,ds16,ds8-shared,ds16-shared PS_TESTS=tests/test_pdl.py \
      PS_SHAPES=$B_SHAPES bash "$HERE/gpu_paged_sweep.sh" "$OUT" '{}' '{"pdl": true}'
  else  # the KIVI CUDA kernels' combine (plain, static with its buffer CTAs, the LeanK + KIVI lanes)
    PS_VAR=KVCOMPRESS_KIVI_CUDA_CONFIG PS_OPS=kivi2,kivi4,kivi2-static,leank70-kivi2 PS_TESTS=tests/test_pdl.py \
      PS_SHAPES=$B_SHAPES bash "$HERE/gpu_paged_sweep.sh" "$OUT" '{}' '{"pdl": true}'
  fi
elif [ "$PART" = sweep ]; then
  # (none / low rank: the rows with cells below 1x; SmolLM2 low rank B1 under "auto" runs one program per SM - 44
  # splits x 3 rows at 128k - where the empty stack runs two; LeanK-50/70 are at or above 1x but B16/4k)
  PS_VAR=KVCOMPRESS_LEANK_CONFIG PS_OPS=${S31_SWEEP_OPS:-none,lowrank} PS_TESTS=tests/test_leank_kernel.py \
    PS_SHAPES=$SHAPES,llama3-8b:4:128k,llama3-8b:64:32k,smollm2-135m:1:128k,smollm2-135m:64:4k,smollm2-135m:64:32k \
    PS_ROUNDS=${PS_ROUNDS:-1} \
    bash "$HERE/gpu_paged_sweep.sh" "$OUT" '{}' '{"split_rows": "resident"}' \
    '{"split_rows": "resident", "fill_splits": 1}'
else
  echo "PART: tests, ab, sweep, pdl, pdl-ds, pdl-kivi or ops-pdl" >&2
  exit 2
fi
