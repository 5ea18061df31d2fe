"""One collective (MESHFORGE_DIAG_OP) on CUDA tensors with gloo, 2 ranks on one GPU: prints before and after, so a
segfault's place is in the log (scripts/gpu_check_diag.sh)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_probes import COLLECTIVES, init

op = os.environ["MESHFORGE_DIAG_OP"]
rank, world, device = init("gloo")
print(f"rank {rank}: {op} start", flush=True)
try:
    print(f"rank {rank}: {op} {'ok' if COLLECTIVES[op](rank, world, device) else 'WRONG VALUES'}", flush=True)
except Exception as exc:  # the finding is which ops gloo has on CUDA
    print(f"rank {rank}: {op} {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
