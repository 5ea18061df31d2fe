#!/usr/bin/env bash
# Builds gpu_wheels/: the optional packages the H200 image lacks, as wheels for its python3 3.12 (x86_64), <= 20 MiB
# in all, for scripts/gpu_check.sh to install into outputs/gpu_site there. torchao per parallel/float8.py's
# TORCHAO_FOR_TORCH row for the image's torch 2.11 (0.18.0, 3.4 MB); tomli_w (7 kB). Run here, with registry access:
#   bash scripts/build_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=gpu_wheels
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --implementation cp -d "$OUT" "torchao==0.18.0" "tomli_w==1.2.0"
size=$(du -sb "$OUT" | cut -f1)
[ "$size" -le $((20 * 1024 * 1024)) ] || { echo "$OUT is $size bytes: over 20 MiB" >&2; exit 1; }
ls -l "$OUT" && echo "$OUT: $size bytes"
