# Session 57's device call (OUT set; run from the tree): the GPU tests of the bf16 scale-after-dot change
# (tests/test_leank_kernel.py, tests/test_kivi_lanes_buffer.py); the fp16 / bf16 lanes-read probe of this tree
# against an older tree at ../.gpusrc_prev (where present: AB_ROUNDS rounds, alternating); then on an H200 the empty
# stack's plan A/B (PART none-plan) and LeanK-70 + KIVI-2 at every grid shape (PART grid-lanes)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$G" > "$OUT/gpu.txt"
TREE=$PWD
( OUT=$OUT/tests; source benchmarks/gpu_site.sh >/dev/null
  timeout "${T_TIMEOUT:-240}" python -m pytest -q -m gpu -p no:cacheprovider -n 8 --tb=short -rfE \
    "$SRC/tests/test_leank_kernel.py" "$SRC/tests/test_kivi_lanes_buffer.py" > "$OUT/tests.txt" 2>&1
  tail -8 "$OUT/tests.txt" )
cd "$TREE" || exit 1
if [ -d ../.gpusrc_prev ]; then
  PREV=$(cat ../.gpusrc_prev/.commit 2>/dev/null || echo prev)
  python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site_prev ../.gpusrc_prev 2>&1 | tail -2
  python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site_this . 2>&1 | tail -2
  for r in $(seq "${AB_ROUNDS:-3}"); do
    for t in prev this; do
      echo "## round $r tree $t ($([ $t = prev ] && echo "$PREV" || cat .commit))"
      (cd /tmp && PYTHONPATH=/tmp/site_$t timeout 100 python "$TREE/benchmarks/gpu_bf16_lanes_probe.py" --rounds 1 \
        --ops "${AB_OPS:-leank70,leank50,none}" \
        --shapes "${AB_SHAPES:-llama3-8b:1:32k,llama3-8b:16:4k,llama3-8b:16:32k,smollm2-135m:16:32k}" 2>&1 | grep '^| 1')
    done
  done | tee "$OUT/ab.md"
fi
case "$G" in
  *H200*) PARTS="${H200_PARTS:-none-plan grid-lanes}" S35_BUDGET=${S35_BUDGET:-230} S35_MIN_LEFT=40 \
            bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1; tail -12 "$OUT/parts.log" ;;
esac
