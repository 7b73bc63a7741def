#!/usr/bin/env bash
# GPU re-checks left by session 14 (H200 image: torch 2.11, triton 3.6, transformers 5.17), one phase per device call
# (each fits the 10-minute limit).  From the repository root of an exported tree (git archive), on the device:
#   bash benchmarks/gpu_recheck.sh OUTDIR PHASE
# PHASE:
#   compile  - GPU tests of the KIVI lanes read (reduce-overhead included) and the compiled-vs-eager check of every
#              built-in stack (tiny llama, mode="reduce-overhead"): the cudagraph-pool failure of leank+kivi2 fixed in
#              fef4d9c / 42c9d15 on CPU only; then the FlashAttention-2 probe (benchmarks/gpu_flash_probe.py)
#   kernels  - the one-launch KIVI lanes read against SDPA with its new split floor, and the kivi-lanes config sweep
#   rows     - reduce-overhead ("compiled") and GraphStep rows at B1/32k after the static-address marking (42c9d15):
#              session 8 measured reduce-overhead at 1.29-1.59x its GPU-busy time
#   lanes    - session 15 found the GraphStep row of leank-rope70-kivi2 at B1/32k slower with the one-launch KIVI
#              lanes read (10.67 ms GPU-busy, split floor 128) than with the per-lane read in session 9 (9.39): the
#              same row with the lanes kernel's split floor at 512 tokens (the default again since session 15) and 128
#   lanes2   - the same row with the merge that folds several splits per step (combine: "splits", session 15,
#              unmeasured) at floors 128 and 512
#   sweep    - session 16: the grouped (dense) lanes kernel with the multi-split merge, against its defaults
#   confirm  - session 16: the issue-19 reads with the new lanes defaults (multi-split merge, 4 waves at 17-64 rows),
#              the lanes kernels' GPU tests, and the leank-rope70-kivi2 GraphStep row at B1/32k
#   confirm2 - session 16: the reads after the launch-shape rule (3 stages for full-width lanes up to 128 programs per
#              split), and the lanes kernel's GPU tests
#   scored   - session 17: the scored reads (kernels return their scores; decode-step attention mass from the read):
#              their GPU tests, TOVA's compiled-vs-eager check, and GraphStep rows of TOVA-8192 (dense and KIVI-4
#              middle) at B1/32k; ROWS_ONLY=1 runs the rows alone.  The rows of an older tree (the reference mass
#              pass before session 17): from inside that tree, ROWS_ONLY=1 bash NEWTREE/benchmarks/gpu_recheck.sh
#              OUT scored (it installs the current folder; the rows script and stack files come from NEWTREE)
#   rows18   - session 18: TOVA's one-unit replacement and SnapKV's static store sized at the first prefill: the
#              compiled-vs-eager check of tova, tova+kivi4, snapkv+leank, then GraphStep rows at B1/32k of
#              ROW_STACKS (default: tova-8192, snapkv25, none); ROWS_ONLY=1 rows alone; from inside an older tree
#              (ROWS_ONLY=1 ROW_STACKS=... bash NEWTREE/benchmarks/gpu_recheck.sh OUT rows18) times that tree;
#              ROW_POINTS (default 1x32768): e.g. ROW_POINTS=8x32768 ROW_STACKS=".../snapkv25.yaml" for the chunked
#              prefill's store shrink (session 18, not yet measured)
#   profile  - session 16: the KIVI lanes GPU tests with the new defaults (floor 128, combine "splits"), every kernel
#              of one static read (benchmarks/gpu_read_profile.py) and the reads against SDPA, Triton KIVI included
set -o pipefail
OUT=$(realpath -m "${1:-out}"); PHASE=${2:-compile}
mkdir -p "$OUT" /tmp/site
python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 | tail -2
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SRC=$PWD
HERE=$(cd "$(dirname "$0")" && pwd)  # this script's folder (the scored phase's rows may time another tree)
date -u | tee -a "$OUT/log.txt"
# run from outside the checkout: its kvcompress/ (without kernels/ and plugins/) must not shadow the installed package
cd /tmp/site
case "$PHASE" in
  compile)
    timeout 120 python -m pytest -q -m gpu "$SRC/tests/test_kivi_lanes.py" -p no:cacheprovider -p no:logging 2>&1 \
      | grep -v DEBUG | tail -15 | tee "$OUT/pytest_kivi_lanes.log"
    timeout 330 python "$SRC/benchmarks/gpu_compiled_check.py" --out "$OUT/cc" --steps 64 2>&1 | grep '^{' \
      | tee "$OUT/compiled_check.log"
    timeout 90 python "$SRC/benchmarks/gpu_flash_probe.py" --out "$OUT" 2>&1 | tail -20 | tee "$OUT/flash_probe.log"
    ;;
  kernels)
    timeout 150 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,kivi2,leank70-kivi2,leank70-kivi2-perlane \
      --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:4k,smollm2-135m:16:32k \
      --out "$OUT/kivi_lanes.json" 2>&1 | grep '^|' | tee "$OUT/kivi_lanes.md"
    timeout 380 python "$SRC/benchmarks/gpu_lanes_sweep.py" --kernel kivi-lanes --out "$OUT/sweep" --max-seconds 300 \
      2>&1 | tail -20 | tee "$OUT/sweep.log"
    ;;
  rows)
    timeout 330 python "$SRC/benchmarks/gpu_graph_rows.py" --kind compiled --stack kivi2 leank-rope70-kivi2 \
      --points 1x32768 --jobs 2 --out "$OUT/compiled" 2>&1 | grep '^{' | tee "$OUT/rows_compiled.log"
    # GraphStep with the one-launch KIVI lanes read (default since session 13; its row has not been measured)
    timeout 220 python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph --stack leank-rope70-kivi2 \
      --points 1x32768 --out "$OUT/graph" 2>&1 | grep '^{' | tee "$OUT/rows_graph.log"
    ;;
  lanes)
    for floor in 512 128; do
      KVCOMPRESS_KIVI_CONFIG="{\"lanes_min_split_tokens\": $floor}" timeout 280 python "$SRC/benchmarks/gpu_graph_rows.py" \
        --kind graph --stack leank-rope70-kivi2 --points 1x32768 --out "$OUT/floor$floor" 2>&1 | grep '^{' \
        | tee "$OUT/rows_floor$floor.log"
    done
    ;;
  lanes2)
    for floor in 128 512; do
      KVCOMPRESS_KIVI_CONFIG="{\"lanes_min_split_tokens\": $floor, \"combine\": \"splits\"}" timeout 280 \
        python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph --stack leank-rope70-kivi2 --points 1x32768 \
        --out "$OUT/combine$floor" 2>&1 | grep '^{' | tee "$OUT/rows_combine$floor.log"
    done
    ;;
  sweep)
    timeout 500 python "$SRC/benchmarks/gpu_lanes_sweep.py" --kernel lanes --out "$OUT/sweep" --max-seconds 420 \
      --configs default,combine_splits,split128_combine_splits,split64_combine_splits,bn64s3_combine_splits,waves4_combine_splits,waves1_combine_splits,bn128s3_combine_splits,bn64s3,waves4 \
      2>&1 | tail -45 | tee "$OUT/sweep.log"
    ;;
  confirm)
    timeout 200 python -m kvcompress.kernels.benchutil --device cuda \
      --ops sdpa,leank50,leank70,none,lowrank,leank70-kivi2 \
      --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:16:32k \
      --out "$OUT/reads.json" 2>&1 | grep '^|' | tee "$OUT/reads.md"
    timeout 120 python -m pytest -q -m gpu "$SRC/tests/test_leank_kernel.py" -p no:cacheprovider -p no:logging 2>&1 \
      | grep -v DEBUG | tail -5 | tee "$OUT/pytest_leank.log"
    timeout 150 python "$SRC/benchmarks/gpu_graph_rows.py" --kind graph --stack leank-rope70-kivi2 --points 1x32768 \
      --out "$OUT/graph" 2>&1 | grep '^{' | tee "$OUT/rows_graph.log"
    ;;
  confirm2)
    timeout 150 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa,none,leank70,lowrank,leank70-kivi2 \
      --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:8:32k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:4:32k,smollm2-135m:16:32k \
      --out "$OUT/reads.json" 2>&1 | grep '^|' | tee "$OUT/reads.md"
    timeout 60 python -m pytest -q -m gpu "$SRC/tests/test_leank_kernel.py" -p no:cacheprovider -p no:logging 2>&1 \
      | grep -v DEBUG | tail -3 | tee "$OUT/pytest_leank.log"
    ;;
  profile)
    timeout 150 python -m pytest -q -m gpu "$SRC/tests/test_kivi_lanes.py" -p no:cacheprovider -p no:logging 2>&1 \
      | grep -v DEBUG | tail -15 | tee "$OUT/pytest_kivi_lanes.log"
    timeout 200 python "$SRC/benchmarks/gpu_read_profile.py" --ops leank70-kivi2,none,lowrank \
      --shapes llama3-8b:1:32k,llama3-8b:16:32k,smollm2-135m:1:32k --out "$OUT/read_profile.json" 2>&1 \
      | tee "$OUT/read_profile.log"
    timeout 200 python -m kvcompress.kernels.benchutil --device cuda \
      --ops sdpa,kivi2,kivi2-triton,leank70,leank70-kivi2,none,lowrank \
      --only-shapes llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:16:32k,smollm2-135m:1:32k,smollm2-135m:16:32k \
      --out "$OUT/reads.json" 2>&1 | grep '^|' | tee "$OUT/reads.md"
    ;;
  scored)
    if [ -z "$ROWS_ONLY" ]; then
      timeout 150 python -m pytest -q -m gpu "$SRC/tests/test_scored_reads.py" -p no:cacheprovider -p no:logging 2>&1 \
        | grep -v DEBUG | tail -15 | tee "$OUT/pytest_scored.log"
      timeout 150 python "$SRC/benchmarks/gpu_compiled_check.py" --only tova,tova+kivi4 --no-bf16 --steps 16 \
        --out "$OUT/cc" 2>&1 | grep '^{' | tee "$OUT/compiled_check.log"
    fi
    STACKS=$HERE/stacks
    timeout 420 python "$HERE/gpu_graph_rows.py" --kind graph --stack "$STACKS/tova-8192.yaml" \
      "$STACKS/tova-8192-kivi4.yaml" --points 1x32768 --jobs 2 --out "$OUT/rows" 2>&1 | grep '^{' \
      | tee "$OUT/rows.log"
    ;;
  rows18)
    if [ -z "$ROWS_ONLY" ]; then
      timeout 150 python "$SRC/benchmarks/gpu_compiled_check.py" --only tova,tova+kivi4,snapkv+leank --no-bf16 \
        --steps 16 --out "$OUT/cc" 2>&1 | grep '^{' | tee "$OUT/compiled_check.log"
    fi
    # shellcheck disable=SC2086  # ROW_STACKS: a list of stacks
    STACKS=${ROW_STACKS:-"$HERE/stacks/tova-8192.yaml $SRC/examples/stacks/snapkv25.yaml none"}
    set -- $STACKS
    # shellcheck disable=SC2086  # ROW_POINTS: a list of BxCTX points (8x32768 prefills in 4096-token chunks)
    timeout 450 python "$HERE/gpu_graph_rows.py" --kind graph --stack "$@" --points ${ROW_POINTS:-1x32768} --jobs $# \
      --out "$OUT/rows" 2>&1 | grep '^{' | tee "$OUT/rows.log"
    ;;
  *) echo "unknown phase $PHASE (compile | kernels | rows | lanes | lanes2 | sweep | confirm | confirm2 | profile | scored | rows18)"; exit 2 ;;
esac
date -u | tee -a "$OUT/log.txt"
