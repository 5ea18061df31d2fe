#!/usr/bin/env bash
# `make test-compat TORCH=2.11.0`: meshforge on another torch, in its own venv (.venv-torch-<version>): the parity tests
# that cover what differs between torch releases, then a `make demo`-sized smoke (tiny, 20 steps, fp32, deterministic,
# CPU) whose losses must equal CI's torch 2.13.0 run bitwise (docs/benchmarks/compat/tiny-20-steps-torch-2.13.0.jsonl;
# results in docs/benchmarks/compat.md). torch 2.14.1 lies on this machine's disk; 2.11.0 comes from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${1:?usage: scripts/compat_run.sh TORCH_VERSION}
VENV=${VENV:-.venv-torch-$TORCH}
PY=${PYTHON:-python3}
if [ ! -e "$VENV/.ready" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" numpy tokenizers tiktoken safetensors rich matplotlib scipy \
    pytest pytest-timeout tomli_w "torchao==0.18.0"
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  touch "$VENV/.ready"
fi
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD/src"
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/unit/test_optional_imports.py tests/unit/test_cp_lse_contiguous.py tests/unit/test_float8_precompute.py \
  "tests/distributed/test_fsdp_parity.py::test_fsdp_matches_single_process[2]" \
  tests/distributed/test_tp_cp_parity.py::test_tp2_without_sequence_or_loss_parallel \
  "tests/distributed/test_tp_cp_parity.py::test_cp_matches_single_process[ring-2]" \
  "tests/distributed/test_tp_cp_parity.py::test_cp_matches_single_process[allgather-2]" \
  tests/distributed/test_moe_parity.py::test_ep2_matches_single_process
OUT=outputs/compat/torch-$TORCH
rm -rf "$OUT"
"$VENV/bin/python" -m meshforge train --config configs/tiny.toml --training.steps 20 --metrics.log_freq 1 \
  --training.device cpu --training.mixed_precision_param float32 --training.deterministic --job.dump_folder "$OUT"
"$VENV/bin/python" -m meshforge compare-losses "$OUT" docs/benchmarks/compat/tiny-20-steps-torch-2.13.0.jsonl \
  --assert-equal --plot "$OUT/losses.png"
"$VENV/bin/python" -m meshforge compare-losses "$OUT" docs/benchmarks/compat/tiny-20-steps-torch-2.13.0.jsonl \
  --key grad_norm --assert-equal --plot "$OUT/grad_norms.png"
