# Session 57: on an H200 first the empty stack's plan A/B and the LeanK-70 + KIVI-2 grid row (PARTS, as
# benchmarks/gpu_s57_call.sh), then on any GPU whole decode steps at the Llama-3-8B shape (bf16, random weights):
# transformers StaticCache + compile against the empty stack, KIVI-2, LeanK-70 and LeanK-70 + KIVI-2, compiled
# (kvcompress.GraphStep and mode='reduce-overhead'), wall and GPU-busy ms per step (OUT set; run from the tree)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$G" > "$OUT/gpu.txt"
TREE=$PWD
start=$(date +%s)
case "$G" in
  *H200*) PARTS="${H200_PARTS:-none-plan grid-lanes}" S35_BUDGET=${S35_BUDGET:-230} S35_MIN_LEFT=40 \
            bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1; tail -12 "$OUT/parts.log" ;;
esac
cd "$TREE" || exit 1
left=$(( ${STEP_BUDGET:-540} - ($(date +%s) - start) ))
( OUT=$OUT/step; source benchmarks/gpu_site.sh >/dev/null
  timeout "$left" python "$SRC/benchmarks/e2e_decode.py" --compile --no-eager \
    --stack none kivi2 leank-rope70 leank-rope70-kivi2 --points "${STEP_POINTS:-1x32768,8x16384}" \
    --steps 32 --warmup 3 --time-budget $(( left - 60 )) --json "$OUT/step.json" --markdown --quiet \
    > "$OUT/step.md" 2> "$OUT/step.err"
  tail -40 "$OUT/step.md"; tail -5 "$OUT/step.err" )
