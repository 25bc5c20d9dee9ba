#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest. Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh"
exec "$VENV/bin/python" -m pytest "$@"
