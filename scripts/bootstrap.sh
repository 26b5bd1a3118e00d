#!/usr/bin/env bash
# Create .venv with PyTorch and this project (editable, all extras).
# Usage: bash scripts/bootstrap.sh [VENV_DIR]
#
# PyTorch is installed explicitly first, so that nothing pulls a multi-GB CUDA
# build onto a machine without a GPU:
#   - a local CPU wheel in $PIP_FIND_LINKS (this workplace's machines) is used as is;
#   - a machine with an NVIDIA GPU gets the default (CUDA) build from PyPI;
#   - any other machine gets the CPU build from the PyTorch CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

if python -c "import torch" 2>/dev/null; then
  echo "[bootstrap] torch $(python -c 'import torch; print(torch.__version__)') already installed"
elif ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  echo "[bootstrap] installing the local CPU wheel of torch $TORCH_VERSION"
  python -m pip install -q "torch==$TORCH_VERSION"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[bootstrap] GPU found: installing torch $TORCH_VERSION (CUDA build)"
  python -m pip install -q "torch==$TORCH_VERSION"
else
  echo "[bootstrap] no GPU: installing the CPU build of torch $TORCH_VERSION"
  python -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi

echo "[bootstrap] installing roundpipe-lightning with all extras"
# scripts/constraints.txt: the versions the tests were written against (see there)
python -m pip install -q -e ".[all]" -c scripts/constraints.txt
python -c "import torch, roundpipe_core, roundpipe_lightning; print('[bootstrap] ok: torch', torch.__version__)"
