#!/usr/bin/env bash
# The main job on built-in data: set up .venv if needed, then run it. Extra arguments go to it.
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/mixprec" demo "$@"
