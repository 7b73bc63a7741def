# Session 58's device call (OUT set; run from the tree): ANY_PARTS (default the paged kernel's bf16 scale-in-exponent
# test and A/B, the low-rank lanes' bf16 error probe, GPU test and proj_query A/B, then every read op against the
# reference on bf16 data at the B1 / B4 grid shapes), then on an H200 the parts only an H200 answers (H200_PARTS,
# default the empty stack's plan A/B and LeanK-70 + KIVI-2 at every grid shape), all within S58_BUDGET seconds
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$G" > "$OUT/gpu.txt"
case "$G" in
  *H200*) P="${ANY_PARTS:-paged-bf16 lowrank-bf16 ops-grid} ${H200_PARTS:-none-plan grid-lanes}" ;;
  *) P="${ANY_PARTS:-paged-bf16 lowrank-bf16 ops-grid}" ;;
esac
echo "$G: $P"
OG_DTYPE=${OG_DTYPE-bfloat16} OG_TIMEOUT=${OG_TIMEOUT:-240} PARTS="$P" S35_BUDGET=${S58_BUDGET:-560} S35_MIN_LEFT=40 \
  bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1
cat "$OUT/parts/parts.txt"
for f in "$OUT"/parts/*/tests.txt "$OUT"/parts/*/rows.md "$OUT"/parts/*/lowrank_bf16.md "$OUT"/parts/*/ops_grid.txt; do
  [ -f "$f" ] && { echo "== $f"; tail -25 "$f"; }
done
