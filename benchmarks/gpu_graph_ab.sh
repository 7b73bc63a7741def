#!/usr/bin/env bash
# GraphStep decode rows (benchmarks/gpu_graph_rows.py, compiled + CUDA graph, Llama-3-8B shape) from several source
# trees in ONE device call, so a code change is not confused with a different machine start.  Each run is
# TREE:STACKS:POINTS (stacks and points comma-separated); each tree is installed once under /tmp/site_<name>, and every
# run uses the current tree's gpu_graph_rows.py (older trees' e2e.measure_row takes the same arguments).
#   bash benchmarks/gpu_graph_ab.sh OUTDIR  (from the repository root; trees relative to it)
#   .gpusrc:kivi2,none:1x32768 .gpusrc_old:kivi2,none:1x32768
# Environment: GRAPH_TESTS=1 first runs tests/test_graph_step.py -m gpu of the first run's tree; GRAPH_TIMEOUT
# (seconds per run, default 300); GRAPH_ARGS: more gpu_graph_rows.py arguments (e.g. "--device cpu --shape tiny").
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift
ROOT=$PWD
SCRIPT=$(dirname "$(realpath "$0")")/gpu_graph_rows.py  # this tree's
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
declare -A DONE
for run in "$@"; do
  t=${run%%:*}
  name=$(basename "$(realpath "$ROOT/$t")")
  [ -n "${DONE[$name]}" ] && continue
  DONE[$name]=1
  mkdir -p "/tmp/site_$name"
  (cd "$ROOT/$t" && python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "/tmp/site_$name" . 2>&1 | tail -2)
  echo "$t -> /tmp/site_$name ($(cd "$ROOT/$t" && cat .commit 2>/dev/null))" | tee -a "$OUT/log.txt"
done
if [ "${GRAPH_TESTS:-0}" = 1 ]; then
  t=${1%%:*}
  name=$(basename "$(realpath "$ROOT/$t")")
  (cd "/tmp/site_$name" && PYTHONPATH="/tmp/site_$name:$ROOT/$t/tests" KVCOMPRESS_CACHE="/tmp/kc_$name" timeout 240 \
    python -m pytest -q -m gpu "$ROOT/$t/tests/test_graph_step.py" -p no:cacheprovider -p no:logging 2>&1 \
    | grep -v DEBUG | tail -15 | tee "$OUT/pytest_graph_step.log")
  date -u | tee -a "$OUT/log.txt"
fi
i=0
for run in "$@"; do
  IFS=: read -r t stacks points <<<"$run"
  name=$(basename "$(realpath "$ROOT/$t")")
  echo "== $run ($(cd "$ROOT/$t" && cat .commit 2>/dev/null))" | tee -a "$OUT/log.txt"
  n=$(tr ',' '\n' <<<"$stacks" | wc -l)
  (cd "/tmp/site_$name" && PYTHONPATH="/tmp/site_$name" KVCOMPRESS_CACHE="/tmp/kc_$name" timeout "${GRAPH_TIMEOUT:-300}" \
    python "$SCRIPT" --kind graph --stack ${stacks//,/ } --points ${points//,/ } --jobs "$n" \
    --out "$OUT/graph_${i}_$name" ${GRAPH_ARGS:-} 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/log.txt")
  date -u | tee -a "$OUT/log.txt"
  i=$((i + 1))
done
