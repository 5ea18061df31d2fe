#!/usr/bin/env bash
# The GPU check on one H200 as its image comes (python3 3.12, torch 2.11.0+cu130, no tomli_w, no torchao): see
# scripts/gpu_check.py. Here first: `bash scripts/build_gpu_wheels.sh` (gpu_wheels/, <= 20 MiB, travels with the tree).
# There, from the repository root, the exact command line:
#   PYTHON=python3 bash scripts/gpu_check.sh            # writes docs/benchmarks/gpu/results.json and results.md
#   (exit 0: every planned check ran and passed; 1: one failed; 3: all that ran passed, some did not run)
#   PYTHON=python3 bash scripts/gpu_check.sh --dry-run  # anywhere: validates every check's set-up without a GPU
# Extra arguments go to the driver (--budget-s, --only NAME..., --out DIR). The project is not pip-installed: src/ is
# on PYTHONPATH; the brought wheels go into outputs/gpu_site (also on PYTHONPATH), never into the image's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=outputs/gpu_site
if [ -d gpu_wheels ] && compgen -G "gpu_wheels/*.whl" >/dev/null && [ ! -e "$SITE/.done" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" gpu_wheels/*.whl && touch "$SITE/.done"
fi
export PYTHONPATH="$PWD/src:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec "$PY" "${GPU_DRIVER:-scripts/gpu_check.py}" "$@"  # scripts/gpu_window.sh sets its own driver
