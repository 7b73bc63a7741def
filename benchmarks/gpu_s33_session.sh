#!/usr/bin/env bash
# Session 33 (issue 19): the device calls of this session, each one command (run from the repository root with the
# exported tree in .gpusrc, session 30's tree in .gpusrc_old, the xdist wheels in .gpuwheels).
#   PART=grid  bash .gpusrc/benchmarks/gpu_s33_session.sh $OUT   the GPU tests of the files sessions 31-32 touched
#       (S33_TEST_TIMEOUT seconds, S33_XDIST workers; session 32's default-on changes first), then the grid rows whose latest cells
#       are stale (session 21/23) or changed since: sdpa + GRID_OPS_S33 (default none,lowrank,leank70-kivi2) at every
#       grid shape, both models, in --resume mode (G_RESUME: a grid JSON of an earlier call to continue, copied in)
#   PART=grid2 ...                                                the same grid continued, no tests
set -o pipefail
OUT=$(realpath -m "${1:-out}")
ROOT=$PWD
HERE=$(cd "$(dirname "$0")" && pwd)
PART=${PART:-grid}
mkdir -p "$OUT"
case "$PART" in grid | grid2) ;; *) echo "PART: grid or grid2" >&2; exit 2 ;; esac
cd "$HERE/.." && source benchmarks/gpu_site.sh  # install the tree under /tmp/site once, cd there
if [ "$PART" = grid ]; then
  python -m pip install -q --no-index --no-deps --target /tmp/xdist "$SRC"/../.gpuwheels/*.whl 2>&1 | tail -2
  T="$SRC/tests"
  # every result line (-v) goes to tests_full.txt, so a run cut by the timeout still says what passed
  PYTHONPATH=$PYTHONPATH:/tmp/xdist timeout "${S33_TEST_TIMEOUT:-230}" python -m pytest -v -m gpu -p no:cacheprovider \
    -n "${S33_XDIST:-8}" ${S33_TESTS:-"$T/test_kivi_buffer_read.py" "$T/test_leank_kernel.py" "$T/test_kernel_ops.py" \
    "$T/test_lowrank_lanes.py" "$T/test_kivi_lanes_buffer.py" "$T/test_kivi_lanes.py" "$T/test_scored_reads.py" \
    "$T/test_lowrank.py" "$T/test_pdl.py"} > "$OUT/tests_full.txt" 2>&1
  tail -15 "$OUT/tests_full.txt"; grep -c PASSED "$OUT/tests_full.txt"; grep -E "FAILED|ERROR" "$OUT/tests_full.txt" | head -30
  date -u | tee -a "$OUT/log.txt"
fi
[ -n "${G_RESUME:-}" ] && cp "$ROOT/$G_RESUME" "$OUT/grid.json"
timeout "${G_TIMEOUT:-330}" python -m kvcompress.kernels.benchutil --device cuda \
  --ops "sdpa,${GRID_OPS_S33:-none,lowrank,leank70-kivi2}" --resume --max-seconds "${G_SECONDS:-280}" \
  --out "$OUT/grid.json" 2>>"$OUT/grid.err" | grep '^|' | tee -a "$OUT/grid.md"
date -u | tee -a "$OUT/log.txt"
