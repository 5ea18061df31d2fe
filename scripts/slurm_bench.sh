#!/usr/bin/env bash
# Multi-node `meshforge bench` under SLURM: one bench driver per node; each run of the matrix is started on every node
# it needs by torchrun with a c10d rendezvous on the first node (run ids are "<matrix>-<run>", so nodes meet per run).
# Node 0 writes DIR/results.json, DIR/report.md and the plots; the output folder must be on a shared file system.
#
#   sbatch --nodes 32 scripts/slurm_bench.sh configs/bench/llama3_70b_256gpu.toml outputs/bench/llama3-70b-256gpu
#   sbatch --nodes 64 scripts/slurm_bench.sh configs/bench/llama3_405b_512gpu.toml outputs/bench/llama3-405b-512gpu
#
# PRINT_COMMANDS=1 prints each node's command (SLURM_NODEID substituted) instead of running srun: outside SLURM set
# SLURM_NNODES and HEAD (tests/integration/test_slurm_script.py runs the printed commands as two local "nodes").
#
#SBATCH --job-name=meshforge-bench
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

MATRIX=${1:?usage: sbatch --nodes N scripts/slurm_bench.sh MATRIX.toml [OUT_DIR] [extra meshforge bench options]}
OUT=${2:-outputs/bench/$(basename "$MATRIX" .toml)}
shift $(( $# >= 2 ? 2 : 1 ))
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PORT=${RDZV_PORT:-29500}
HEAD=${HEAD:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
PYTHON=${PYTHON:-.venv/bin/python}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

COMMAND="exec $PYTHON -m meshforge bench --config '$MATRIX' --out '$OUT' \
  --nnodes $SLURM_NNODES --node-rank \$SLURM_NODEID --nproc-per-node $GPUS_PER_NODE \
  --rdzv-endpoint $HEAD:$PORT --compare-with reference $*"
if [[ "${PRINT_COMMANDS:-0}" == 1 ]]; then
  for (( node = 0; node < SLURM_NNODES; node++ )); do
    echo "${COMMAND//\$SLURM_NODEID/$node}"
  done
  exit 0
fi
echo "meshforge bench: $MATRIX on $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $HEAD:$PORT, out $OUT"
# bash -c so that SLURM_NODEID is read on each node, not here.
srun --kill-on-bad-exit=0 bash -c "$COMMAND"
