# Session 57's device call (OUT set; run from the tree): the GPU tests of the bf16 scale-after-dot change
# (tests/test_leank_kernel.py, tests/test_kivi_lanes_buffer.py), the fp16 / bf16 lanes-read probe, then on an H200
# the empty stack's plan A/B (PART none-plan) and LeanK-70 + KIVI-2 at every grid shape (PART grid-lanes)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$G" > "$OUT/gpu.txt"
TREE=$PWD
( OUT=$OUT/tests; source benchmarks/gpu_site.sh >/dev/null
  timeout "${T_TIMEOUT:-240}" python -m pytest -q -m gpu -p no:cacheprovider -n 8 --tb=short -rfE \
    "$SRC/tests/test_leank_kernel.py" "$SRC/tests/test_kivi_lanes_buffer.py" > "$OUT/tests.txt" 2>&1
  tail -8 "$OUT/tests.txt"
  timeout "${P_TIMEOUT:-150}" python "$SRC/benchmarks/gpu_bf16_lanes_probe.py" > "$OUT/bf16_probe.md" 2> "$OUT/bf16_probe.err"
  cat "$OUT/bf16_probe.md"; tail -3 "$OUT/bf16_probe.err" )
cd "$TREE" || exit 1
case "$G" in
  *H200*) PARTS="${H200_PARTS:-none-plan grid-lanes}" S35_BUDGET=${S35_BUDGET:-230} S35_MIN_LEFT=40 \
            bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1; tail -12 "$OUT/parts.log" ;;
esac
