# Session 61's device call (OUT set; run from the tree): the GPU prompt timing owed by session 60 first (this tree and,
# when PREV names a folder with the tree before session 59's prompt fix, that tree: gpu_s60_call.sh with NO_STEP), then
# the reduce-overhead step timeline (below), then on an H200 the parts still owed (H200_PARTS, gpu_s35_session.sh) with the time left; the parts' many files are
# packed into one parts.tgz, since a call returns at most 8 files
start=$(date +%s)
BUDGET=${S61_BUDGET:-560}
NO_STEP=1 S60_BUDGET=${S61_PROMPT_BUDGET:-200} bash benchmarks/gpu_s60_call.sh
G=$(cat "$OUT/gpu.txt")
# the decode step under torch.compile(mode="reduce-overhead") with no host plan (transformers' generate compiles it
# so): wall vs host vs GPU-busy time and kernels per step (gpu_step_timeline.py), the empty stack beside LeanK-70 at
# 8 x 16k, at this tree and (TL_BASE: a folder with the tree before session 61's sink-scan skip) at that tree
TL="--rows ${TL_ROWS:-none leank-rope70} --batch 8 --ctx 16384 --steps 20"
( source benchmarks/gpu_site.sh >/dev/null
  timeout ${TL_TIMEOUT:-200} python "$SRC/benchmarks/gpu_step_timeline.py" $TL --out "$OUT/tl" 2> "$OUT/tl.err" \
    | tail -4; tail -3 "$OUT/tl.err" )
if [ -n "$TL_BASE" ] && [ -d "$TL_BASE" ]; then
  mkdir -p /tmp/site_base
  python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site_base "$TL_BASE" 2>&1 | tail -2
  (cd /tmp && PYTHONPATH=/tmp/site_base${PYTHONPATH:+:$PYTHONPATH} timeout ${TL_TIMEOUT:-200} python \
    "$TL_BASE/benchmarks/gpu_step_timeline.py" $TL --out "$OUT/tl_base" 2> "$OUT/tl_base.err" | tail -4
   tail -3 "$OUT/tl_base.err")
fi
left=$(( BUDGET - ($(date +%s) - start) ))
echo "== prompt part took $(( $(date +%s) - start )) s on $G; $left s left"
case "$G" in
  *H200*) if [ -n "$H200_PARTS" ] && [ "$left" -gt 90 ]; then
            PARTS="$H200_PARTS" S35_BUDGET=$(( left - 20 )) S35_MIN_LEFT=40 \
              bash benchmarks/gpu_s35_session.sh "$OUT/parts" > "$OUT/parts.log" 2>&1; tail -40 "$OUT/parts.log"
            for f in "$OUT"/parts/*/*.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
            tar -czf "$OUT/parts.tgz" -C "$OUT" parts parts.log && rm -rf "$OUT/parts" "$OUT/parts.log"
          fi ;;
esac
cat "$OUT"/prefill*.err 2>/dev/null | grep -v '^$' | tail -30
(cd "$OUT" && tar -czf /tmp/s61_all.tgz --exclude=parts.tgz . && find . -mindepth 1 -not -name parts.tgz -delete \
  && mv /tmp/s61_all.tgz all.tgz)
