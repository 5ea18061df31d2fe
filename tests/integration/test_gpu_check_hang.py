"""scripts/gpu_check.py on a hung multi-rank job: a 2-rank torchrun (gloo, CPU) whose ranks hang (and ignore
SIGTERM) must be killed whole, torchrun AND both ranks, and the driver must move on within the budget + 10 s."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_check", gpu_check)
_spec.loader.exec_module(gpu_check)

HANG = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank stuck in a collective does not die on SIGTERM either
import torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
print(f"rank {dist.get_rank()} hangs", flush=True)
time.sleep(3600)
"""
BUDGET_S = 30  # the ranks wrote their pids 12.3 s after the start at load 5.5 on 2 cores; the test waits all of it
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_a_hung_torchrun_job_dies_whole_and_the_check_moves_on(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    check = gpu_check.Check("hung_ranks", [*argv, str(tmp_path)], BUDGET_S, env={"OMP_NUM_THREADS": "1"})
    result: list[object] = []
    start = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(gpu_check.run_check(check, budget_left=100)), daemon=True)
    thread.start()
    thread.join(timeout=BUDGET_S + 10)
    seconds = time.monotonic() - start
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    try:
        assert len(pids) == 2, f"the ranks did not start within {BUDGET_S} s: the test proves nothing"
        assert not thread.is_alive(), f"the driver still waits after {seconds:.0f} s (budget {BUDGET_S} s)"
        outcome = result[0]
        assert outcome.status == "timeout" and "hangs" in outcome.tail, outcome  # type: ignore[attr-defined]
        left = [p for p in pids if gpu_check_proc_alive(p)]
        assert not left, f"ranks {left} survived the timeout"
    finally:
        for pid in pids:  # whatever happened, leave no rank behind (unblocks a driver stuck on their pipe)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        thread.join(timeout=30)


def gpu_check_proc_alive(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap the orphans it inherits)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
