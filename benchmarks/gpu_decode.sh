#!/usr/bin/env bash
# Issue 16 on the GPU machine (H200 image: torch 2.11, triton 3.6, transformers 5.17), from the repository root:
#   bash benchmarks/gpu_decode.sh OUTDIR PHASE
# PHASE: check  - compiled decode (reduce-overhead, CUDA graphs) of every built-in stack on a tiny model vs eager
#        e2e1   - Llama-3-8B-shaped random model, B1/32k: plain eager, StaticCache + compile, STACKS eager/static/compiled
#        e2e8   - the same at B8/16k
#        timeline - host / GPU / busy split, top kernels, guard-free wall and cProfile of a compiled step per row
#                   (gpu_step_timeline.py; STACKS may name "static")
#        graph  - GraphStep tests on the GPU, then kvcompress CUDA-graph rows (gpu_graph_rows.py; POINTS, STACKS)
#        ops    - benchmarks/gpu_ops_check.py (every registered op and impl compiled, vs the reference)
# STACKS (env, default "none kivi2") names kvcompress.evaluation.e2e.BUILTIN_STACKS entries.
set -o pipefail
OUT=${1:-out}; PHASE=${2:-check}; STACKS=${STACKS:-none kivi2}; BUDGET=${BUDGET:-400}
mkdir -p "$OUT" /tmp/site
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KVCOMPRESS_CACHE=/tmp/kvc
python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
  > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/log.txt"
case "$PHASE" in
  check)
    timeout "${CHECK_S:-300}" python benchmarks/gpu_compiled_check.py --out "$OUT" --steps "${STEPS:-128}" ${ONLY:+--only $ONLY} 2>&1 \
      | grep -v "Warning\|warn(" | tee -a "$OUT/log.txt" | tail -40
    ;;
  e2e1|e2e8)
    P=$([ "$PHASE" = e2e1 ] && echo 1x32768 || echo 8x16384)
    timeout 560 python benchmarks/e2e_decode.py --compile --stack $STACKS --points $P --time-budget "$BUDGET" \
      --json "$OUT/$PHASE.json" --markdown > "$OUT/$PHASE.md" 2> "$OUT/$PHASE.log"
    echo "rc=$?"; cat "$OUT/$PHASE.md"; grep -v "Warn\|warn(" "$OUT/$PHASE.log" | tail -15
    ;;
  timeline)
    timeout "${TL_S:-560}" python benchmarks/gpu_step_timeline.py --rows ${STACKS} --batch "${B:-1}" --ctx "${CTX:-32768}" \
      --out "$OUT" 2>&1 | grep -v "Warning\|warn(\|USDT" | tail -40
    ;;
  graph)
    # GraphStep replay vs eager on a tiny model (pytest from /tmp/site: the source tree must not shadow the install),
    # then "STACK + compile + CUDA graph" rows of the Llama-3-8B shape
    (cd /tmp/site && timeout 200 python -m pytest -q -m gpu "$OLDPWD/tests/test_graph_step.py" -p no:cacheprovider 2>&1 \
      | tail -8) | tee -a "$OUT/log.txt"
    timeout "${GR_S:-380}" python benchmarks/gpu_graph_rows.py --stack ${STACKS} --points ${POINTS:-1x32768 8x16384} \
      --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tail -20
    ;;
  ops)
    timeout 500 python benchmarks/gpu_ops_check.py --out "$OUT" 2>&1 | tail -40
    ;;
esac
