"""Runs inside a rank: train with BASE + overrides, counting the device-to-host reads of every step that does not log
(the real ``train_step`` and the rest of the loop's iteration) with meshforge's host-read counter."""

from __future__ import annotations

import tempfile
from typing import Any

from parity import BASE

LOG_FREQ = 3  # 5 steps: steps 1, 3, 5 log; 2 and 4 must not read the device


def count_host_reads(overrides: list[str]) -> dict[str, Any]:
    """{"reads": {step: [read, ...]} for the non-log steps, "records": the logged records}."""
    from meshforge.config.io import load_config
    from meshforge.device.host_reads import HostReads
    from meshforge.train import loop

    dump = tempfile.mkdtemp(prefix="meshforge-test-")
    cfg = load_config(None, [*BASE, "--job.dump_folder", dump, "--metrics.log_freq", str(LOG_FREQ), *overrides])
    state = loop.setup(cfg)
    real = loop.train_step
    open_: list[Any] = []
    reads: dict[int, list[str]] = {}

    def close() -> None:
        if open_:
            step, counter = open_.pop()
            counter.__exit__(None, None, None)
            reads[step] = [str(r) for r in counter.reads]

    def counted(s: Any) -> Any:
        close()  # the previous non-log step's iteration ends where this step begins
        if not loop.should_log(s.step, s.cfg):
            counter = HostReads()
            counter.__enter__()
            open_.append((s.step, counter))
        return real(s)

    loop.train_step = counted  # type: ignore[assignment]
    try:
        records = loop.run_job(state)
    finally:
        close()
        loop.train_step = real  # type: ignore[assignment]
    return {"reads": reads, "records": records}
