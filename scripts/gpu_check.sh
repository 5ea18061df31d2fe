#!/usr/bin/env bash
# GPU check (one CUDA device, < 8 minutes): bf16 training of an 8B-shaped model with 4 layers, eager, compiled, and
# compiled + Float8; prints tokens/s, MFU and peak memory of each. Run from the repository root on a GPU machine:
#   bash scripts/gpu_check.sh [OUT_DIR]
# Record the printed table in docs/benchmarks/gpu-check.md with the date and the GPU.
set -euo pipefail
OUT=${1:-${OUT:-outputs/gpu_check}}
PY=${PY:-python}
if [ ! -x .venv/bin/python ] && ! $PY -c "import meshforge" 2>/dev/null; then
  $PY -m pip install -q -e . >/dev/null
fi
[ -x .venv/bin/python ] && PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
COMMON=(--model.flavor 8B_4layers --training.seq_len 8192 --training.local_batch_size 2 --training.steps 12
        --metrics.log_freq 1 --activation_checkpoint.mode selective --training.mixed_precision_param bfloat16
        --training.device cuda --lr_scheduler.warmup_steps 2)
run() {
  local name=$1; shift
  timeout 200 $PY -m meshforge train "${COMMON[@]}" --job.dump_folder "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
    || { echo "$name: FAILED (see $OUT/$name.log)"; tail -3 "$OUT/$name.log"; return 0; }
}
mkdir -p "$OUT"
run eager
run compile --compile.enable
run compile_float8 --compile.enable --quantize.dense.float8.enable
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<16}{'tokens/s':>12}{'MFU %':>8}{'peak GiB':>10}{'loss':>8}")
for name in ("eager", "compile", "compile_float8"):
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        print(f"{name:<16}{'failed':>12}")
        continue
    recs = [json.loads(line) for line in path.read_text().splitlines()][3:]  # steps after warm-up and compile
    tps = statistics.median(r["tps"] for r in recs)
    mfus = [r["mfu_pct"] for r in recs if r["mfu_pct"] is not None]
    mfu = f"{statistics.median(mfus):.1f}" if mfus else "n/a"
    print(f"{name:<16}{tps:>12.0f}{mfu:>8}{max(r['peak_memory_gib'] for r in recs):>10.1f}{recs[-1]['loss']:>8.3f}")
PY
