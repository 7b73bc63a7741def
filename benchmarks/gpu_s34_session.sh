#!/usr/bin/env bash
# Session 34 (issue 19): the next device calls, each one command (run from the exported tree: cd .gpusrc; carry
# .gpusrc and .gpuwheels).
#   PART=grid    bash benchmarks/gpu_s34_session.sh $OUT   the lanes kernel's GPU tests (tests/test_leank_kernel.py,
#       tests/test_pdl.py) and the grid rows of the ops it reads - leank50, leank70, leank70-kivi2, none, lowrank - at
#       every shape under session 34's last default (resident_batch 16), which no grid has timed yet.  S34_TESTS /
#       S34_GRID_OPS replace the test files / the ops; S34_GRID_PART=grid2: no tests, the grid JSON continued
#   PART=splits  bash benchmarks/gpu_s34_session.sh $OUT   the split rules' choices against fixed split counts
#       (KVCOMPRESS_LEANK_CONFIG {"splits": N}) at the batch-1 / batch-4 reads where no rule wins for every op
#       (docs/results.md "Session 34", item 5), then where each read's GPU time goes (split kernel against merge,
#       benchmarks/gpu_read_profile.py) under the default rule
set -o pipefail
OUT=$(realpath -m "${1:-out}")
HERE=$(cd "$(dirname "$0")" && pwd)
case "${PART:-grid}" in
  grid)
    T="$(cd "$HERE/.." && pwd)/tests"  # the exported tree's tests (gpu_s33_session.sh runs them from /tmp/site)
    S33_TESTS=${S34_TESTS:-"$T/test_leank_kernel.py $T/test_pdl.py"} \
      GRID_OPS_S33=${S34_GRID_OPS:-leank50,leank70,leank70-kivi2,none,lowrank} \
      PART=${S34_GRID_PART:-grid} bash "$HERE/gpu_s33_session.sh" "$OUT"
    ;;
  splits)
    cd "$HERE/.." || exit 1
    PS_TESTS=none PS_VAR=KVCOMPRESS_LEANK_CONFIG PS_OPS=${S34_OPS:-none,lowrank,leank70} \
      PS_SHAPES=${S34_SHAPES:-smollm2-135m:1:32k,smollm2-135m:1:128k,smollm2-135m:4:32k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:1:128k} \
      PS_PROFILE=${S34_OPS:-none,lowrank,leank70} PS_PROFILE_SHAPES=smollm2-135m:1:32k,smollm2-135m:1:128k \
      bash benchmarks/gpu_paged_sweep.sh "$OUT" '{}' '{"splits": 22}' '{"splits": 44}' '{"splits": 66}' \
      '{"splits": 88}' '{"splits": 132}' '{"splits": 176}' '{"splits": 264}'
    rm -f "$OUT/base.json"
    ;;
  *) echo "PART: grid or splits" >&2; exit 2 ;;
esac
