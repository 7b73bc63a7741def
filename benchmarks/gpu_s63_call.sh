# Owed after session 62 (OUT set; run from the tree; one call): the GPU test of generate's graph route in its kept
# form (one GraphStep per generate call), then KIVI-2 through model.generate (kvcompress graphs, then unplanned) at
# 8 x 8192, one process per row, within S63_BUDGET seconds. The prompt timing stays a call of its own:
#   PREV=$PWD/../.gpusrc_prev NO_STEP=1 S60_BUDGET=560 OUT=$OUT bash benchmarks/gpu_s60_call.sh
start=$(date +%s)
BUDGET=${S63_BUDGET:-570}
( source benchmarks/gpu_site.sh >/dev/null
  timeout ${GT_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider -m gpu "$SRC/tests/test_graph_step.py" \
    -k "cuda_generate" --rootdir "$SRC" > "$OUT/gputest.txt" 2>&1; tail -3 "$OUT/gputest.txt" )
left=$(( BUDGET - ($(date +%s) - start) ))
S62_BUDGET=$left ROW_LIMIT=${ROW_LIMIT:-280} GS_ROWS="${GS_ROWS:-kivi2 kivi2@unplanned}" OUT=$OUT \
  bash benchmarks/gpu_s62b_call.sh
