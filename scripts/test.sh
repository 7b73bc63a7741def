#!/usr/bin/env bash
# The test command: installs everything on a fresh machine, then runs the whole suite on the CPU.
#   bash scripts/test.sh                      the whole suite, one pytest-xdist worker per core (at most 4)
#   bash scripts/test.sh tests/test_x.py ...  the arguments go to pytest as given, in one process (add -n 2 to spread)
# Whole runs spread test files, not single tests, over the workers (--dist loadfile): a file's module fixtures (tiny
# models, calibration files, the torchrun launch of tests/test_tensor_parallel.py, the interpreter runs of the kernel
# files) are then built once, by one worker.  KVCOMPRESS_TEST_WORKERS=N sets the workers; 0 runs in one process.
# KVCOMPRESS_TEST_FULL=1 adds the exhaustive variants of opt-in kernel builds (every KIVI fold build and emulated
# fold class, every timing probe, every radix tie case and compact_block run under the interpreter) and every stack's
# compiled decode in tests/test_compiled_decode.py and tests/test_tensor_parallel.py, which CI samples to stay within
# its time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ $# -eq 0 ]; then
  cores=$(nproc)
  workers=${KVCOMPRESS_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
  if [ "$workers" -gt 1 ]; then
    set -- -n "$workers" --dist loadfile
  fi
fi
.venv/bin/python -m pytest -q "$@"
