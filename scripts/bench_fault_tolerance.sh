#!/bin/bash
# HSDP 2x2 vs 2 fault-tolerant groups x FSDP 2, same model/batch, 20 steps; mean step time of steps 6-20 from metrics.jsonl
# usage: PYTHON=.venv/bin/python bash scripts/bench_fault_tolerance.sh [OUT]   (docs/fault-tolerance.md)
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 RUST_LOG=warn
A="--model.flavor tiny --training.seq_len 128 --training.local_batch_size 16 --training.steps 20 --training.mixed_precision_param float32 --metrics.log_freq 1 --activation_checkpoint.mode none"
PY=${PYTHON:-python}
O=${1:-/tmp/ftcost}; rm -rf "$O"; mkdir -p "$O"
$PY -m meshforge train --nproc 4 $A --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --job.dump_folder $O/hsdp > $O/hsdp.out 2>&1
$PY -m meshforge train --nproc 4 $A --fault_tolerance.enable --fault_tolerance.local_replicas 2 --job.dump_folder $O/ft > $O/ft.out 2>&1
for f in $O/hsdp/metrics.jsonl $O/ft/replica_0/metrics.jsonl $O/ft/replica_1/metrics.jsonl; do
  $PY -c "
import json,sys
r=[json.loads(l) for l in open('$f')]
t=[x['step_time_s'] for x in r if x['step']>5]
print('$f', 'mean step s (6-20):', round(sum(t)/len(t),3), 'loss@20', round(r[-1]['loss'],4))"
done
