#!/usr/bin/env bash
# The second GPU window on one H100 80 GB or H200 as its image comes (python3 3.12, torch 2.11.0+cu130, no network, no
# tomli_w, no torchao): see scripts/gpu_window.py. Here first: `bash scripts/build_gpu_wheels.sh` (gpu_wheels/,
# <= 20 MiB, travels with the tree) and `python scripts/gpu_window_memory.py expect` (the memory expectations).
# There, from the repository root, the exact command line (the `run` tool; $OUT comes back):
#   PYTHON=python3 bash scripts/gpu_window.sh --out $OUT/window2   # results.{json,md} after every check, bench/
#   (exit 0: every planned check ran and passed; 1: one failed; 3: all that ran passed, some did not run)
#   PYTHON=python3 bash scripts/gpu_window.sh --dry-run            # anywhere: the plan, its boxes, every set-up
# Extra arguments go to the driver (--budget-s, --only NAME..., --out DIR, --device cpu). The wheels go into
# outputs/gpu_site (on PYTHONPATH), never into the image's Python, as for scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPU_DRIVER=scripts/gpu_window.py  # gpu_check.sh: the same wheels, paths and environment, this driver
exec bash scripts/gpu_check.sh "$@"
