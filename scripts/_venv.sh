# Sourced by scripts/main.sh and scripts/test.sh: make .venv ready, fast when it already is.
# Installs torch==2.13.0 first (the CPU wheel on these machines; an unpinned torch would pull
# several GB of CUDA packages), then mixprec in editable mode with every extra, then fastai without torchvision.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
PY=${PYTHON:-python3}
stamp="$VENV/.mixprec-installed"
want="$(cat pyproject.toml scripts/_venv.sh | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "Creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "Installing torch==2.13.0, then mixprec[train,tensorboard,hf,nlp,lightning,accelerate,fastai,vision,dev] into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[train,tensorboard,hf,nlp,lightning,accelerate,fastai,vision,dev]"
  # fastai without its torchvision requirement (pyproject.toml's fastai extra says why)
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "fastai>=2.8,<2.9"
  echo "$want" > "$stamp"
fi
