#!/usr/bin/env bash
# The main job on built-in data: set up .venv if needed, then train the digits task under FP32, bf16
# and fp16 and print them side by side. Extra arguments go to `mixprec compare digits`.
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/mixprec" compare digits "$@"
