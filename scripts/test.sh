#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest on 2 workers (pytest-xdist; each test file stays on one
# worker). Extra arguments go to pytest; -n 0 runs in this one process (for -s, --pdb).
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile "$@"
