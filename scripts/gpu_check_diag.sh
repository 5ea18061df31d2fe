#!/usr/bin/env bash
# A diagnosis run for the GPU check's multi-rank failures on ONE GPU (docs/benchmarks/gpu/README.md): each probe's own
# output (torchrun's summary hides it), each collective alone on gloo with CUDA tensors, and the Python stack of any
# segfault (PYTHONFAULTHANDLER). Everything goes to one file, $1 (default outputs/gpu_check/diag.log).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${1:-outputs/gpu_check/diag.log}
mkdir -p "$(dirname "$LOG")" outputs/gpu_site
if compgen -G "gpu_wheels/*.whl" >/dev/null && [ ! -e outputs/gpu_site/.done ]; then
  "$PY" -m pip install -q --no-index --no-deps --target outputs/gpu_site gpu_wheels/*.whl && touch outputs/gpu_site/.done
fi
export PYTHONPATH="$PWD/src:$PWD/outputs/gpu_site" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4 PYTHONFAULTHANDLER=1
run() { echo "=== $* ===" >>"$LOG"; timeout -k 5 "${T:-45}" "$@" >>"$LOG" 2>&1; echo "=== rc $? ===" >>"$LOG"; }
: >"$LOG"
for b in nccl gloo; do
  run "$PY" -m torch.distributed.run --nproc-per-node 2 scripts/gpu_check_probes.py collectives --backend "$b"
done
for op in all_reduce broadcast all_gather_into_tensor reduce_scatter_tensor all_to_all_single batch_isend_irecv; do
  MESHFORGE_DIAG_OP=$op run "$PY" -m torch.distributed.run --nproc-per-node 2 scripts/gpu_check_diag_op.py
done
DENSE="--training.device cuda --metrics.log_freq 1 --training.steps 2 --training.mixed_precision_param float32 \
  --model.flavor debugmodel --training.seq_len 512 --training.local_batch_size 8"
MESHFORGE_CUDA_BACKEND=gloo T=90 run "$PY" -m meshforge train --nproc 2 $DENSE --parallelism.tensor_parallel_degree 2 \
  --job.dump_folder outputs/gpu_check/diag_tp2
grep -c . "$LOG"
