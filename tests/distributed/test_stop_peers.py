"""A rank that stops the job with a one-line error (a damaged shard only it reads, issue 48) takes the ranks that wait
for it in a collective along within seconds, not after the collective timeout: their hang watchdogs see the stop key
(parallel/distributed.py stop_key) and leave with the same code, printing nothing (the error was printed once)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

TIMEOUT_S = 120  # the collective timeout of this job: the waiting rank must leave long before it


def rank_main(rank: int, port: int, folder: str, stopper: int) -> None:
    err = open(Path(folder) / f"stderr-{rank}.txt", "w", buffering=1)  # noqa: SIM115 (the process ends by os._exit)
    os.dup2(err.fileno(), 2)
    sys.stderr = err  # pytest's capture replaced it
    import torch
    import torch.distributed as dist

    from meshforge.errors import ConfigError
    from meshforge.observability.hang import HangGuard
    from meshforge.parallel.distributed import finish, report_once

    dist.init_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    dist.barrier()
    try:
        with HangGuard(folder, rank, 2, status=lambda: "step 3"):
            if rank == stopper:
                raise ConfigError("shard 'train-00001.bin' is damaged")
            dist.all_reduce(torch.ones(4))  # waits for the stopper, which never comes
    except ConfigError as exc:
        (Path(folder) / "stopped-at").write_text(str(time.time()))
        report_once(f"meshforge train: error: {exc}", stop_code=2)
        finish(ok=False, code=2)
    sys.exit(5)  # the waiting rank must not get here: the all-reduce never completes


@pytest.mark.parametrize("stopper", [0, 1])  # rank 0 hosts the store: it waits for the other's report before leaving
def test_the_ranks_waiting_for_a_stopped_rank_leave_in_seconds(tmp_path: Path, stopper: int) -> None:
    from launcher import free_port

    ctx = mp.get_context("fork")
    port = free_port()
    began = time.monotonic()
    ranks = [ctx.Process(target=rank_main, args=(r, port, str(tmp_path), stopper)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=60)
    took, since_stop = time.monotonic() - began, time.time() - float((tmp_path / "stopped-at").read_text())
    alive = [p.is_alive() for p in ranks]
    for p in ranks:
        p.kill()
    errors = [(tmp_path / f"stderr-{r}.txt").read_text() for r in range(2)]
    assert not any(alive) and [p.exitcode for p in ranks] == [2, 2], (alive, [p.exitcode for p in ranks], errors)
    # the waiting rank's watchdog polls once a second; without it rank 0 (the store's host) waits its 5 s for a report
    assert took < 60 and since_stop < 4, (took, since_stop)
    lines = [line for text in errors for line in text.splitlines() if line.strip()]
    assert lines == ["meshforge train: error: shard 'train-00001.bin' is damaged"], errors
    assert not (tmp_path / "hang").exists()  # not a hang: no hang report
