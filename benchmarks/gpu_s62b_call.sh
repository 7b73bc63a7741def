# Session 62's second device call (OUT set; run from the tree): generate_step.py at 8 x 8192 (8 x 16384 ran out of
# memory in generate's unchunked eager prefill on an H100), one process per row, each within its own time limit.
start=$(date +%s)
BUDGET=${S62_BUDGET:-560}
( source benchmarks/gpu_site.sh >/dev/null
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  for row in ${GS_ROWS:-none leank-rope70@unplanned leank-rope70 static leank-rope70@reduce-overhead}; do
    left=$(( BUDGET - ($(date +%s) - start) ))
    [ "$left" -lt 60 ] && { echo "skip $row: $left s left"; continue; }
    lim=$(( left < ${ROW_LIMIT:-140} ? left - 5 : ${ROW_LIMIT:-140} ))
    timeout $lim python "$SRC/benchmarks/generate_step.py" --rows "$row" --batch 8 --ctx ${GS_CTX:-8192} \
      --short 16 --long 112 --repeats 2 --out "$OUT/gs_${row/@/_}" 2> "$OUT/gs_${row/@/_}.err" | head -1
    echo "   ($row: $(( $(date +%s) - start )) s so far)"
  done )
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > "$OUT/gpu.txt"
(cd "$OUT" && tar -czf /tmp/s62_all.tgz . && find . -mindepth 1 -delete && mv /tmp/s62_all.tgz all.tgz)
