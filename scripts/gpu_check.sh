#!/usr/bin/env bash
# Check every GPU claim of mixprec in one command (docs/gpu.md); arguments go to benchmarks/gpu:
#   bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--parts tests,syncs,gpt,fp8,bert]
# Uses the Python at hand ($PYTHON, else python3) with mixprec from src/: on the GPU machine nothing is
# installed and there is no network.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu "$@"
