#!/usr/bin/env bash
# `make test-fake-cuda`: the venv of the fake-CUDA check (.venv-fake-cuda: torch 2.14.1+cu130, the CUDA build on this
# machine's disk, ~110 s to install under load), then tests/unit/test_fake_cuda.py with it (--venv-only: the venv alone).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-fake-cuda}
PY=${PYTHON:-python3}
if [ ! -e "$VENV/.ready" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.14.1" numpy tokenizers tiktoken safetensors rich matplotlib scipy tomli_w
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  touch "$VENV/.ready"
fi
"$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else "torch " + torch.__version__ + " is no CUDA build")'
[ "${1:-}" = "--venv-only" ] && exit 0   # .ci/run: make the venv; `make test` then runs tests/unit/test_fake_cuda.py
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MESHFORGE_FAKE_CUDA_PYTHON="$PWD/$VENV/bin/python"
exec "${PYTEST_PYTHON:-.venv/bin/python}" -m pytest -q tests/unit/test_fake_cuda.py
