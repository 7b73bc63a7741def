# Sourced (with OUT set) by the device scripts: installs the tree (the current folder) under /tmp/site and moves there,
# so the checkout's kvcompress/ (without kernels/ and plugins/) does not shadow the installed package; SRC is the tree.
mkdir -p "$OUT" /tmp/site
python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . 2>&1 | tail -2
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SRC=$PWD
cd /tmp/site
date -u | tee -a "$OUT/log.txt"
