# Sourced (with OUT set) by the session-21 DoubleSparse device scripts: gpu_select_session.sh, gpu_grid_session.sh,
# gpu_gather_splits.sh.  Installs the tree under /tmp/site and moves there (gpu_site.sh), then the DoubleSparse
# kernels' GPU tests, logged to OUT/pytest_ds.log.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_site.sh"
timeout 150 python -m pytest -q -m gpu "$SRC/tests/test_doublesparse_kernel.py" -p no:cacheprovider -p no:logging 2>&1 \
  | grep -v DEBUG | tail -15 | tee "$OUT/pytest_ds.log"
