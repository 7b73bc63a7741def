#!/usr/bin/env bash
# The test command: installs everything on a fresh machine, then runs the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m pytest -q "$@"
