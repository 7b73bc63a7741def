# Session 60's device call (OUT set; run from the tree): prompt (prefill) time of every stack on the GPU, at the Llama-3-8B
# shape (4 layers, bf16, 8 x 16384 tokens in 2048-token chunks) with this tree and with the tree before the prompt-read
# fix (PREV, a folder with that tree, when given), then LeanK-70 alone as a compiled whole decode step at 8 x 16k beside
# the empty stack (STEP_STACKS), all within S60_BUDGET seconds; on an H200 H200_PARTS first (gpu_s35_session.sh parts)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$G" > "$OUT/gpu.txt"
start=$(date +%s)
BUDGET=${S60_BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
case "$G" in
  *H200*) if [ -n "$H200_PARTS" ]; then
            PARTS="$H200_PARTS" S35_BUDGET=${S35_BUDGET:-230} S35_MIN_LEFT=40 \
              bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1; tail -12 "$OUT/parts.log"
          fi ;;
esac
PF="--device cuda --layers ${PF_LAYERS:-8} --batch 8 --prompt 16384 --chunk 2048"
if [ -n "$PREV" ] && [ -d "$PREV" ]; then
  mkdir -p /tmp/site_prev
  python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site_prev "$PREV" 2>&1 | tail -2
  (cd /tmp && PYTHONPATH=/tmp/site_prev${PYTHONPATH:+:$PYTHONPATH} timeout $(( $(left) / 4 )) python \
    "$PREV/benchmarks/prefill_time.py" $PF --stack none kivi2 leank-rope70 leank-rope70-kivi2 \
    --json "$OUT/prefill_prev.json" > "$OUT/prefill_prev.md" 2> "$OUT/prefill_prev.err"); tail -8 "$OUT/prefill_prev.md"
fi
TREE=$PWD
( OUT=$OUT; source benchmarks/gpu_site.sh >/dev/null
  timeout $(( $(left) / 3 )) python "$SRC/benchmarks/prefill_time.py" $PF --stack ${PF_STACKS:-none kivi2 kivi4 \
    leank-rope70 leank-rope70-kivi2 lowrank32-random lowrank32-random-kivi2 paged-1024 ds-shared-random-1024} \
    --json "$OUT/prefill.json" > "$OUT/prefill.md" 2> "$OUT/prefill.err"; tail -14 "$OUT/prefill.md"; tail -3 "$OUT/prefill.err"
  l=$(left)
  [ -z "$NO_STEP" ] && [ "$l" -gt 150 ] && timeout "$l" python "$SRC/benchmarks/e2e_decode.py" --compile --no-eager \
    --stack ${STEP_STACKS:-none leank-rope70} --points "${STEP_POINTS:-8x16384}" \
    --steps 32 --warmup 3 --time-budget $(( l - 50 )) --json "$OUT/step.json" --markdown --quiet \
    > "$OUT/step.md" 2> "$OUT/step.err"
  tail -30 "$OUT/step.md"; tail -5 "$OUT/step.err" )
