#!/usr/bin/env bash
# Main job: generate with the StreamingLLM window stack on the default model and print the memory report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/kvcompress generate --stack examples/stacks/window.yaml --report --sample --max-new-tokens 400 \
  "${1:-Tell me a long story about a lighthouse keeper and a storm.}"
