#!/usr/bin/env bash
# Creates the virtual environment the Makefile uses: torch (a system torch >= 2.11 is reused; the local torch==2.13.0
# CPU build when the system Python has none), then meshforge itself, editable, with its dev tools. Idempotent: re-run after pyproject changes.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if "$PYTHON" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 11) else 1)' 2>/dev/null; then
  "$PYTHON" -m venv --system-site-packages "$VENV"   # reuse the system's torch (e.g. a CUDA build on a cluster)
else
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[dev]"
touch "$VENV/.ready"
