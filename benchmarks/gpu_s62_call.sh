# Session 62's first device call (OUT set; run from the tree): model.generate's own compiled decode step, planned by
# kvcompress (session 62) and unplanned (generate_step.py), then the GPU prompt timing owed since session 60
# (gpu_s60_call.sh without its decode step; PREV: the tree before session 59's prompt fix). Outputs packed into one
# all.tgz (a call returns at most 8 files).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
( source benchmarks/gpu_site.sh >/dev/null
  timeout ${GS_TIMEOUT:-300} python "$SRC/benchmarks/generate_step.py" --rows ${GS_ROWS:-none leank-rope70 \
    leank-rope70@unplanned kivi2} --batch 8 --ctx 16384 --short 32 --long 160 --repeats 2 --out "$OUT/gs" \
    2> "$OUT/gs.err" | tail -8; grep -v Warning "$OUT/gs.err" | tail -5 )
if [ -n "$PREV" ]; then
  NO_STEP=1 S60_BUDGET=${S62_PROMPT_BUDGET:-200} bash benchmarks/gpu_s60_call.sh
  cat "$OUT"/prefill*.err 2>/dev/null | grep -v '^$' | tail -20
fi
echo "$G" > "$OUT/gpu.txt"
(cd "$OUT" && tar -czf /tmp/s62_all.tgz . && find . -mindepth 1 -delete && mv /tmp/s62_all.tgz all.tgz)
