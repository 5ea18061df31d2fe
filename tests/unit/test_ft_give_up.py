"""When a fault-tolerant group gives up (train/ft_clock.py, issue 43 item 2): after a commit, only once
fault_tolerance.max_failed_attempts attempts in a row have failed *and* comm.train_timeout_seconds have passed since
the last commit, both restarting at each commit. The first failed attempt after a hung peer always finds the timeout
gone (torchft's all-reduce waited it out): it must retry, not end. A fake clock drives the real should_commit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshforge.config.io import load_config
from meshforge.train import fault_tolerance as ft
from meshforge.train import ft_clock

T = 10  # comm.train_timeout_seconds
FLAGS = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--comm.train_timeout_seconds", str(T)]
FLAGS += ["--comm.init_timeout_seconds", "300"]


def test_the_rule() -> None:
    cfg = load_config(None, [*FLAGS, "--fault_tolerance.max_failed_attempts", "3"])
    late = ft_clock.late
    assert not late(cfg, now=299, started=0, committed=0, failures=50)  # before the first commit: the init clock only
    assert late(cfg, now=301, started=0, committed=0, failures=1)
    assert not late(cfg, now=100 + T + 1, started=0, committed=100, failures=1)  # the first failure after a hang
    assert not late(cfg, now=100 + T + 1, started=0, committed=100, failures=2)
    assert late(cfg, now=100 + T + 1, started=0, committed=100, failures=3)
    assert not late(cfg, now=100 + T - 1, started=0, committed=100, failures=30)  # fast failures: the clock waits
    assert not late(cfg, now=100 + T + 1, started=0, committed=100 + 2, failures=3)  # the clock restarts at a commit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def group(tmp_path: Path, outcomes: list[bool], clock: Clock) -> ft.FaultTolerance:
    """A group whose manager answers should_commit from ``outcomes``; every other piece is the real one."""
    cfg = load_config(None, [*FLAGS, "--job.dump_folder", str(tmp_path)])
    loader = SimpleNamespace(state_dict=lambda: {"pos": 3}, load_state_dict=lambda s: None, sample_positions=list)
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None, state={})
    state = SimpleNamespace(model_parts=[], loader=loader, optimizer=optimizer, metrics=SimpleNamespace(console=0))
    state.step = 1
    manager = SimpleNamespace(
        should_commit=lambda: outcomes.pop(0),
        _min_replica_size=1,
        num_participants=lambda: 1,
        errored=lambda: None,
    )
    g = ft.FaultTolerance(cfg, state, manager=manager, started=clock.now)  # type: ignore[arg-type]
    g.log, g.attempts = tmp_path / "ft_steps.jsonl", tmp_path / "ft_attempts.jsonl"
    return g


def attempt(g: ft.FaultTolerance, clock: Clock, at: float) -> bool:
    clock.now = at
    committed = g.should_commit()
    g.state.step += committed
    return committed


def test_a_hang_is_retried_and_the_count_and_clock_restart_at_each_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = Clock()
    monkeypatch.setattr(ft, "time", clock)  # the module's clock only: pytest's own keeps running
    script = [(1, True), (1 + T + 1, False), (1 + T + 2, True)]  # a hang: the first failure finds T gone; retried
    script += [(30, False), (31, False), (32, True)]  # two failures, then a commit: the count restarts
    script += [(38, False), (39, False), (40, False), (41, False)]  # 4 failures within T of the commit: the clock
    g = group(tmp_path, [ok for _, ok in script] + [False], clock)
    for at, ok in script:
        assert attempt(g, clock, at) == ok, at
    with pytest.raises(SystemExit) as ended:  # 4 failures in a row and T since the last commit (at 32)
        attempt(g, clock, 32 + T + 1)
    assert ended.value.code == ft.NO_QUORUM_EXIT
    err = capsys.readouterr().err.strip()
    assert "step 4 did not commit within 5 attempts (fault_tolerance.max_failed_attempts = 3) and " in err, err
    assert "comm.train_timeout_seconds = 10 s since the last commit: a group kept voting against" in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("value", ["1", "0", "-2"])
def test_max_failed_attempts_below_two_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge import cli

    assert cli.main(["config", "show", *FLAGS, "--fault_tolerance.max_failed_attempts", value]) == 2
    err = capsys.readouterr().err.strip()
    assert f"fault_tolerance.max_failed_attempts = {value} must be >= 2" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("switch", [[], ["--fault_tolerance.params_digest"]])
def test_the_parameter_digest_is_off_by_default_and_on_log_steps_when_switched_on(
    switch: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43 item 4: the digest copies every shard to the host; training does not pay it unless asked."""
    import json

    import torch

    clock = Clock()
    monkeypatch.setattr(ft, "time", clock)
    g = group(tmp_path, [True] * 4, clock)
    g.cfg = load_config(None, [*FLAGS, "--metrics.log_freq", "2", *switch])
    g.state.model_parts = [torch.nn.Linear(3, 2)]
    for at in range(1, 5):
        assert attempt(g, clock, at)
    rows = [json.loads(line) for line in (tmp_path / "ft_steps.jsonl").read_text().splitlines()]
    digests = {r["step"]: r["params_before"] for r in rows if "params_before" in r}
    if not switch:
        assert digests == {}, digests
    else:  # steps 1, 2 and 4 log (the first and every log_freq); the digest is the parameters'
        assert sorted(digests) == [1, 2, 4] and digests[4] == ft.params_digest(g.state), digests  # type: ignore[arg-type]
