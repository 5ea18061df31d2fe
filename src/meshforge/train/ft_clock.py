"""When a fault-tolerant replica group stops retrying a step (train/fault_tolerance.py) and the line it ends with.

Before the first commit: once comm.init_timeout_seconds have passed since the start (the other groups are starting;
the quorum may never form). After it: once fault_tolerance.max_failed_attempts attempts in a row have failed **and**
comm.train_timeout_seconds have passed since the last commit; both the count and the clock restart at each commit.
Never on time alone: a hung (not dead) peer makes the survivors' all-reduce wait out torchft's timeout, which equals
comm.train_timeout_seconds, so the first failed attempt after a hang always finds that much time gone; the retry is
the one that runs in the smaller quorum (the Lighthouse has dropped the silent group by then). Never on the count
alone: attempts that fail at once (a quorum below min_replica_size) would end the group in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshforge.config.schema import JobConfig
from meshforge.parallel.distributed import report_once

if TYPE_CHECKING:
    from meshforge.train.fault_tolerance import FaultTolerance

NO_QUORUM_EXIT = 5  # no step could commit within the timeouts (1: a crash, 2: a config mistake, 3: a hang, 4: diverged)


def late(cfg: JobConfig, now: float, started: float, committed: float, failures: int) -> bool:
    """True when the group gives up: ``committed`` is when the last step committed (0: none yet), ``failures``
    the attempts that failed in a row since then (perf_counter seconds)."""
    comm = cfg.comm
    if not committed:
        return now - started > comm.init_timeout_seconds
    return failures >= cfg.fault_tolerance.max_failed_attempts and now - committed > comm.train_timeout_seconds


def give_up_when_stuck(ft: FaultTolerance, now: float, waiting: bool) -> None:
    """End every rank of the group (one line, exit NO_QUORUM_EXIT) when ``late``: the group's ranks decide together
    (each rank's clock differs by a retry)."""
    flag = torch.tensor([float(late(ft.cfg, now, ft.started, ft.committed, ft.failures))])
    if dist.is_initialized():
        flag = flag.to(ft.state.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    comm, most = ft.cfg.comm, ft.cfg.fault_tolerance.max_failed_attempts
    if ft.committed:
        limit = (
            f"{ft.failures} attempts (fault_tolerance.max_failed_attempts = {most}) and comm.train_timeout_seconds = "
            f"{comm.train_timeout_seconds} s since the last commit"
        )
    else:
        limit = f"comm.init_timeout_seconds = {comm.init_timeout_seconds} s"
    report_once(
        f"meshforge: fault tolerance: step {ft.state.step} did not commit within {limit}: {why(ft, waiting)}. The "
        f"last committed step is {ft.state.step - 1}"
    )
    raise SystemExit(NO_QUORUM_EXIT)


def why(ft: FaultTolerance, waiting: bool) -> str:
    """What kept the step from committing, as far as this group can tell."""
    cfg, n = ft.cfg.fault_tolerance, ft.manager.num_participants()
    if waiting:
        groups = cfg.group_size or cfg.local_replicas or 1
        return (
            f"fault_tolerance.start_together waits for all {groups} replica groups and {n} joined; start the other "
            "groups, or set fault_tolerance.start_together = false"
        )
    if n < cfg.min_replica_size:
        return (
            f"only {n} replica group(s) in the quorum, fewer than fault_tolerance.min_replica_size = "
            f"{cfg.min_replica_size}; start the missing groups or lower fault_tolerance.min_replica_size"
        )
    err = ft.manager.errored()
    failed = f"the step's all-reduce failed ({str(err.original_exception)[:160]})" if err else "a group"
    return f"{failed} kept voting against the commit; the other groups' output says why"
