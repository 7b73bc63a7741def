# Session 62's device call (OUT set; run from the tree): the GPU test of generate's compiled step replaying
# kvcompress' graphs, then model.generate's own decode step timed (generate_step.py: kvcompress' graphs, planned
# reduce-overhead, unplanned, transformers' StaticCache), then with the time left the GPU prompt timing owed since
# session 60 (gpu_s60_call.sh without its decode step; PREV: the tree before session 59's prompt fix). Outputs packed
# into one all.tgz (a call returns at most 8 files).
start=$(date +%s)
BUDGET=${S62_BUDGET:-570}
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
( source benchmarks/gpu_site.sh >/dev/null
  timeout ${GT_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider -m gpu "$SRC/tests/test_graph_step.py" \
    -k "cuda_generate" --rootdir "$SRC" > "$OUT/gputest.txt" 2>&1; tail -3 "$OUT/gputest.txt"
  timeout ${GS_TIMEOUT:-330} python "$SRC/benchmarks/generate_step.py" --rows ${GS_ROWS:-none leank-rope70 \
    leank-rope70@unplanned static leank-rope70@reduce-overhead} --batch 8 --ctx 16384 --short 32 --long 160 \
    --repeats 2 --out "$OUT/gs" 2> "$OUT/gs.err" | tail -8; grep -v Warning "$OUT/gs.err" | tail -5 )
left=$(( BUDGET - ($(date +%s) - start) ))
echo "== $(( $(date +%s) - start )) s so far on $G; $left s left"
if [ -n "$PREV" ] && [ "$left" -gt 150 ]; then
  NO_STEP=1 S60_BUDGET=$(( left - 10 )) bash benchmarks/gpu_s60_call.sh
  cat "$OUT"/prefill*.err 2>/dev/null | grep -v '^$' | tail -20
fi
echo "$G" > "$OUT/gpu.txt"
(cd "$OUT" && tar -czf /tmp/s62_all.tgz . && find . -mindepth 1 -delete && mv /tmp/s62_all.tgz all.tgz)
