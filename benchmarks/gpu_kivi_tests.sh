# Sourced (after gpu_site.sh: OUT and SRC set, cwd /tmp/site) by the device scripts that check the KIVI CUDA kernels:
# every KIVI CUDA library the tests load compiled in parallel (benchmarks/gpu_prebuild_kivi.py), then
# tests/test_kivi_cuda.py -m gpu and tests/test_kivi_lanes.py -m gpu (LANES_K: a pytest -k filter for the latter).
timeout 120 python "$SRC/benchmarks/gpu_prebuild_kivi.py" 2>&1 | tail -3 | tee -a "$OUT/log.txt"
timeout 200 python -m pytest -q -m gpu "$SRC/tests/test_kivi_cuda.py" -p no:cacheprovider -p no:logging 2>&1 \
  | grep -v DEBUG | tail -15 | tee "$OUT/pytest_cuda.log"
date -u | tee -a "$OUT/log.txt"
timeout 260 python -m pytest -q -m gpu "$SRC/tests/test_kivi_lanes.py" -p no:cacheprovider -p no:logging \
  ${LANES_K:+-k "$LANES_K"} 2>&1 | grep -v DEBUG | tail -25 | tee "$OUT/pytest_lanes.log"
date -u | tee -a "$OUT/log.txt"
