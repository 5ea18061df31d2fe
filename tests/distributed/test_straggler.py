"""Straggler detection on 2 gloo ranks: rank 1's data loading is slowed with a sleep (the test's hook on its
loader); rank 1 is named in metrics and nobody else; the gather happens on log steps only."""

from __future__ import annotations

import tempfile
import time
from typing import Any

import pytest
from launcher import run_ranks
from parity import BASE

pytestmark = pytest.mark.distributed

STEPS, LOG_FREQ, DELAY = 10, 2, 1.0  # 2 ranks: the median halves the excess, so it must beat 0.2 x a loaded step


def slowed_run(dump: str) -> dict[str, Any]:
    """Runs inside a rank: rank 1 sleeps DELAY s in each next_batch; counts the all_gather calls per step."""
    import torch.distributed as dist

    from meshforge.config.io import load_config
    from meshforge.train.loop import run_steps, setup

    cfg = load_config(
        None,
        [*BASE, "--job.dump_folder", dump, "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ)],
    )
    state = setup(cfg)
    if dist.get_rank() == 1:
        slow = state.loader.next_batch

        def next_batch() -> Any:
            time.sleep(DELAY)
            return slow()

        state.loader.next_batch = next_batch  # type: ignore[method-assign]
    gathers: list[int] = []
    real = dist.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(state.step)
        return real(*args, **kwargs)

    dist.all_gather = counted
    try:
        records = list(run_steps(state))
    finally:
        dist.all_gather = real
    return {"records": records, "gathers": gathers}


def test_the_slowed_rank_is_named_and_gathers_only_on_log_steps() -> None:
    rank0 = run_ranks(slowed_run, 2, tempfile.mkdtemp(prefix="meshforge-straggler-"))[0]
    records = rank0["records"]
    logged = [r["step"] for r in records]
    assert logged == [1, 2, 4, 6, 8, 10]
    assert rank0["gathers"] == logged  # one gather per log step, none on other steps
    named = {r["step"]: r.get("stragglers") for r in records}
    # named from the 3rd consecutive slow interval on (step 1's interval is dominated by the first step's warm-up,
    # so the count may start at step 2), and rank 0 never
    assert named[1] is None and named[2] is None, named
    assert all(named[s] == [1] for s in (8, 10)) and named[4] in (None, [1]) and named[6] in (None, [1]), named
    assert all(r["wait_max_s"] >= 0 for r in records)
