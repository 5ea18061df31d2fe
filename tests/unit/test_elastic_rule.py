"""Elastic resume's rules (train/elastic.py) without processes: the gradient-accumulation factor that keeps the
checkpoint's global batch, and the wall-time save clock. The distributed proof is tests/distributed/
test_elastic_resume.py (~80 s); these fail in well under a second on the same bugs."""

from __future__ import annotations

import pytest

from meshforge.config.io import load_config
from meshforge.errors import ConfigError
from meshforge.parallel.dims import ParallelDims
from meshforge.train import elastic


def _dims(dp: int) -> ParallelDims:
    return ParallelDims(pp=1, dp_replicate=1, dp_shard=dp, cp=1, tp=1)


def test_fewer_ranks_raise_accumulation_to_keep_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "1"])
    saved = elastic.global_batch(cfg, _dims(8))  # 16 sequences under dp 8
    assert saved == 16
    for dp, accum in ((4, 2), (2, 4), (1, 8)):
        resumed = elastic.keep_global_batch(cfg, _dims(dp), saved, console=True)
        got = resumed.training.gradient_accumulation_steps
        assert got == accum, f"dp {dp}: accumulation {got}, expected {accum} (the global batch of 16 is not kept)"
        assert elastic.global_batch(resumed, _dims(dp)) == saved
        assert f"-> {accum} keeps it" in capsys.readouterr().out
    # more ranks lower it; the same global batch, no checkpoint's batch or the option off: unchanged
    raised = load_config(None, ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "4"])
    assert elastic.keep_global_batch(raised, _dims(4), 8, console=False).training.gradient_accumulation_steps == 1
    assert elastic.keep_global_batch(cfg, _dims(8), saved, console=False) is cfg
    assert elastic.keep_global_batch(cfg, _dims(4), None, console=False) is cfg
    off = load_config(None, ["--training.local_batch_size", "2", "--checkpoint.keep_global_batch", "false"])
    assert elastic.keep_global_batch(off, _dims(4), saved, console=False) is off


def test_a_global_batch_that_does_not_divide_is_one_line() -> None:
    cfg = load_config(None, ["--training.local_batch_size", "3"])
    with pytest.raises(ConfigError, match=r"global batch of 16 sequences is not a multiple of dp 2 x local batch"):
        elastic.keep_global_batch(cfg, _dims(2), 16, console=False)


def test_save_clock_is_due_after_the_interval_and_restarts_on_a_save(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(elastic.time, "monotonic", lambda: now[0])
    clock = elastic.SaveClock(60.0)
    now[0] = 159.0
    assert clock.flag() == 0.0
    now[0] = 160.0
    assert clock.flag() == 1.0, "checkpoint.interval_seconds = 60 passed but no save is due"
    clock.after(step=7, interval=10, forced=False)  # neither forced nor on the interval: the clock runs on
    assert clock.flag() == 1.0
    clock.after(step=8, interval=10, forced=True)  # the due save happened: restart
    assert clock.flag() == 0.0, "the wall-time clock did not restart after a forced save"
    now[0] = 230.0
    clock.after(step=10, interval=10, forced=False)  # a save on the step interval restarts it too
    assert clock.flag() == 0.0, "the wall-time clock did not restart after a save on the step interval"
    assert elastic.SaveClock(0.0).flag() == 0.0  # 0: off
