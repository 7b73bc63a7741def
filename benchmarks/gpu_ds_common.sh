# Sourced (with OUT set) by the session-21 DoubleSparse device scripts: gpu_select_session.sh, gpu_grid_session.sh,
# gpu_gather_splits.sh.  Installs the tree (the current folder) under /tmp/site and moves there, so the checkout's
# kvcompress/ (without kernels/ and plugins/) does not shadow the installed package; SRC is the tree.  Then the
# DoubleSparse kernels' GPU tests, logged to OUT/pytest_ds.log.
mkdir -p "$OUT" /tmp/site
python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 | tail -2
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SRC=$PWD
cd /tmp/site
date -u | tee -a "$OUT/log.txt"
timeout 150 python -m pytest -q -m gpu "$SRC/tests/test_doublesparse_kernel.py" -p no:cacheprovider -p no:logging 2>&1 \
  | grep -v DEBUG | tail -15 | tee "$OUT/pytest_ds.log"
