#!/usr/bin/env bash
# Issue 19, session 27: the paged kernel's dense read (benchutil op paged-dense: PagedStore pool, 16-token pages,
# CUDA graphs, cold L2) under each launch configuration given (KVCOMPRESS_PAGED_CONFIG JSON, see
# kernels/paged/triton_kernel.py _config: pages_per_step, num_warps, num_stages, waves, table_steps, valid_late, ...),
# beside SDPA; first the paged kernel's GPU tests (every configuration case of tests/test_paged_kernel.py, natively).
#   bash benchmarks/gpu_paged_sweep.sh OUTDIR [CONFIG_JSON...]
#   PS_SHAPES: benchutil --only-shapes; PS_ROUNDS: rounds over the configs (default 1); PS_PROFILE: also
#   gpu_read_profile.py --ops $PS_PROFILE at PS_PROFILE_SHAPES.
#   Other kernels' configuration knobs (session 28): PS_VAR (the environment variable, default
#   KVCOMPRESS_PAGED_CONFIG), PS_OPS (benchutil ops beside sdpa, default paged-dense), PS_TESTS (GPU test files,
#   default tests/test_paged_kernel.py; none: no tests), e.g. PS_VAR=KVCOMPRESS_DS_CONFIG PS_OPS=ds8,ds16
#   PS_TESTS=tests/test_doublesparse_kernel.py; PS_TEST_TIMEOUT: seconds for the GPU tests (default 200; the
#   DoubleSparse file compiles many select variants: about 400 on a cold machine); PS_XDIST=N: run the GPU tests in N
#   pytest-xdist workers (compiles in parallel), installed from the wheels in PS_WHEELS (default ../.gpuwheels, carried
#   beside the exported tree: the GPU image has no internet)
set -o pipefail
OUT=$(realpath -m "${1:-out}"); shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=('{}' '{"valid_late": true}')
SHAPES=${PS_SHAPES:-llama3-8b:1:4k,llama3-8b:1:32k,llama3-8b:4:32k,llama3-8b:16:4k,llama3-8b:16:32k,llama3-8b:64:32k,smollm2-135m:1:32k,smollm2-135m:16:32k}
source "$(dirname "$0")/gpu_site.sh"  # install under /tmp/site, cd there
VAR=${PS_VAR:-KVCOMPRESS_PAGED_CONFIG}
OPS=${PS_OPS:-paged-dense}
TESTS=()
for t in ${PS_TESTS:-tests/test_paged_kernel.py}; do [ "$t" = none ] || TESTS+=("$SRC/$t"); done
XDIST=()
if [ -n "${PS_XDIST:-}" ]; then
  python -m pip install -q --no-index --no-deps --target /tmp/xdist "${PS_WHEELS:-$SRC/../.gpuwheels}"/*.whl 2>&1 | tail -2
  XDIST=(-n "$PS_XDIST")
  TEST_PATH=/tmp/xdist
fi
if [ "${PS_TESTS:-}" != none ]; then  # PS_TESTS=none: no tests (a second sweep in the same call)
  PYTHONPATH=$PYTHONPATH${TEST_PATH:+:$TEST_PATH} timeout "${PS_TEST_TIMEOUT:-200}" python -m pytest -q -m gpu \
    -p no:cacheprovider --tb=short -rfE "${XDIST[@]}" "${TESTS[@]}" 2>&1 | tee -a "$OUT/tests_full.txt" | tail -3 \
    | tee -a "$OUT/tests.txt"
fi
timeout 100 python -m kvcompress.kernels.benchutil --device cuda --ops sdpa --only-shapes "$SHAPES" \
  --out "$OUT/base.json" 2>/dev/null | grep '^|' | tee -a "$OUT/rows.md"
i=0
for r in $(seq 1 "${PS_ROUNDS:-1}"); do
  for c in "${CONFIGS[@]}"; do
    i=$((i + 1))
    echo "## round $r config $c" | tee -a "$OUT/rows.md"
    env "$VAR=$c" timeout 150 python -m kvcompress.kernels.benchutil \
      --device cuda --ops "sdpa,$OPS" --only-shapes "$SHAPES" --out "$OUT/config_$i.json" 2>/dev/null \
      | grep '^|' | grep -v '^|---\|^| op' | tee -a "$OUT/rows.md"
  done
done
if [ -n "${PS_PROFILE:-}" ]; then
  timeout 150 python "$SRC/benchmarks/gpu_read_profile.py" --ops "$PS_PROFILE" \
    --shapes "${PS_PROFILE_SHAPES:-llama3-8b:1:4k,llama3-8b:16:4k,smollm2-135m:1:4k}" --out "$OUT/profile.json" \
    2>&1 | tail -60 | tee -a "$OUT/profile.txt"
fi
python - "$OUT" <<'PY'  # one JSON of every config's rows (few files come back from a device call)
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("config_*.json"))}
(out / "configs.json").write_text(json.dumps(runs))
for p in out.glob("config_*.json"):
    p.unlink()
PY
date -u | tee -a "$OUT/log.txt"
