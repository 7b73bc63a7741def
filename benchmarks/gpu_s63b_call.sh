# Session 63's second device call (OUT set; run from the tree), within S63B_BUDGET seconds:
# 1. the prompt time of PagedEviction on a static cache after the host replay of its page boundaries (8 layers,
#    8 x 16384 tokens in 2048-token chunks; before: paged-1024 8.1-9.3 s against 2.05 s uncompressed, H100);
# 2. generate's step split into wall and GPU work (generate_step.py --busy) for GS_ROWS at 8 x 8192, one process per
#    row (session 63's first call: KIVI-2 11.23 ms per step through kvcompress graphs, the empty stack 11.14 in s62).
# NO_PREFILL=1 skips 1; GS_CTX / GS_CHUNK set the prompt length and generate's prefill_chunk_size, e.g. 8 x 16k (whose
# unchunked prefill ran out of memory on an H100 in session 62):
#   NO_PREFILL=1 GS_CTX=16384 GS_CHUNK=2048 GS_ROWS="static none kivi2 leank-rope70" OUT=$OUT bash benchmarks/gpu_s63b_call.sh
start=$(date +%s)
BUDGET=${S63B_BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
( source benchmarks/gpu_site.sh >/dev/null
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  [ -z "$NO_PREFILL" ] && timeout 120 python "$SRC/benchmarks/prefill_time.py" --device cuda --layers 8 --batch 8 --prompt 16384 --chunk 2048 \
    --stack none paged-1024 paged-1024-kivi2 --json "$OUT/prefill_paged.json" > "$OUT/prefill_paged.md" \
    2> "$OUT/prefill_paged.err" && { tail -6 "$OUT/prefill_paged.md"; tail -3 "$OUT/prefill_paged.err"; }
  for row in ${GS_ROWS:-none kivi2}; do
    l=$(left)
    [ "$l" -lt 60 ] && { echo "skip $row: $l s left"; continue; }
    lim=$(( l < ${ROW_LIMIT:-300} ? l - 5 : ${ROW_LIMIT:-300} ))
    timeout $lim python "$SRC/benchmarks/generate_step.py" --rows "$row" --batch 8 --ctx ${GS_CTX:-8192} \
      --short 16 --long 112 --repeats 2 --busy --prefill-chunk ${GS_CHUNK:-0} --out "$OUT/gs_${row/@/_}" 2> "$OUT/gs_${row/@/_}.err" | tail -2
    echo "   ($row: $(( $(date +%s) - start )) s so far)"
  done )
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > "$OUT/gpu.txt"
(cd "$OUT" && tar -czf /tmp/s63b_all.tgz . && find . -mindepth 1 -delete && mv /tmp/s63b_all.tgz all.tgz)
