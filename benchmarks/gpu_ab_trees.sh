#!/usr/bin/env bash
# A/B timing of the same benchutil rows from several source trees in ONE device call (so that machine-to-machine
# differences between sessions do not pass for a code change): each tree is installed under its own /tmp/site_<name>
# with its own KIVI CUDA build cache, and the rounds alternate between the trees.
#   bash benchmarks/gpu_ab_trees.sh OUTDIR TREE... (tree folders relative to the repository root, e.g. .gpusrc_old .)
# Environment: AB_OPS (default sdpa,kivi2,kivi4), AB_SHAPES (benchutil --only-shapes), AB_ROUNDS (default 2),
# AB_TESTS=1 first runs the KIVI GPU tests of the first tree (benchmarks/gpu_kivi_tests.sh; LANES_K filters).
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift
ROOT=$PWD
TREES=("$@")
OPS=${AB_OPS:-sdpa,kivi2,kivi4}
SHAPES=${AB_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,smollm2-135m:1:32k,llama3-8b:16:32k}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
for t in "${TREES[@]}"; do
  name=$(basename "$(realpath "$ROOT/$t")")
  mkdir -p "/tmp/site_$name"
  (cd "$ROOT/$t" && python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "/tmp/site_$name" . 2>&1 | tail -2)
  echo "$t -> /tmp/site_$name ($(cd "$ROOT/$t" && cat .commit 2>/dev/null))" | tee -a "$OUT/log.txt"
done
if [ "${AB_TESTS:-0}" = 1 ]; then
  name=$(basename "$(realpath "$ROOT/${TREES[0]}")")
  (export SRC=$(realpath "$ROOT/${TREES[0]}") PYTHONPATH="/tmp/site_$name" KVCOMPRESS_CACHE="/tmp/kc_$name"
   cd "/tmp/site_$name" && source "$SRC/benchmarks/gpu_kivi_tests.sh")
fi
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for t in "${TREES[@]}"; do
    name=$(basename "$(realpath "$ROOT/$t")")
    echo "== round $r: $t" | tee -a "$OUT/ab.md"
    (cd "/tmp/site_$name" && PYTHONPATH="/tmp/site_$name" KVCOMPRESS_CACHE="/tmp/kc_$name" timeout 150 \
      python -m kvcompress.kernels.benchutil --device cuda --ops "$OPS" --only-shapes "$SHAPES" \
      --out "$OUT/ab_${name}_$r.json" 2>/tmp/ab.err | grep '^|' | tee -a "$OUT/ab.md")
    tail -1 /tmp/ab.err >> "$OUT/log.txt"
    date -u | tee -a "$OUT/log.txt"
  done
done
