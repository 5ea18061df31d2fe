#!/usr/bin/env bash
# The GPU check (one CUDA device, < 8 minutes on one H200): see scripts/gpu_check.py for what it covers.
# Run from the repository root on a GPU machine:
#   bash scripts/gpu_check.sh            # writes docs/benchmarks/gpu/results.json and results.md
#   bash scripts/gpu_check.sh --dry-run  # anywhere: validates every check without a GPU
# Extra arguments go to the driver (--budget-s, --only NAME..., --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! PYTHONPATH=src $PY -c "import meshforge" 2>/dev/null; then
  $PY -m pip install -q -e . >/dev/null
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
exec $PY scripts/gpu_check.py "$@"
