"""Bad input to the fault-tolerance features (issue 36): each mistake is one line naming the key, the value and the
fix, exit 2, found where it enters (the [fault_tolerance] section, `meshforge ft lighthouse`'s flags); a quorum that
can never commit a step ends the group within its timeout with one line naming why (exit NO_QUORUM_EXIT) instead of
retrying forever; the local launcher names a group's config error and a missing quorum as such."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshforge import cli
from meshforge.config.io import load_config
from meshforge.train import cli as train_cli
from meshforge.train import fault_tolerance as ft
from meshforge.train import ft_cli

FT = ["--fault_tolerance.enable"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["--fault_tolerance.local_replicas", "-1"], "fault_tolerance.local_replicas = -1 must be >= 0"),
        (["--fault_tolerance.group_size", "-2"], "fault_tolerance.group_size = -2 must be >= 0"),
        (
            ["--fault_tolerance.local_replicas", "2", "--fault_tolerance.min_replica_size", "3"],
            "fault_tolerance.min_replica_size = 3 exceeds the 2 replica group(s) (fault_tolerance.local_replicas = 2)",
        ),
        (
            ["--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "3"],
            "fault_tolerance.min_replica_size = 3 exceeds the 2 replica group(s) (fault_tolerance.group_size = 2)",
        ),
        (["--fault_tolerance.min_replica_size", "2"], "fault_tolerance.min_replica_size = 2 exceeds the 1 replica"),
        (["--fault_tolerance.lighthouse", "http://127.0.0.1:99999"], "'http://127.0.0.1:99999' has no valid port"),
        (["--fault_tolerance.lighthouse", "http://127.0.0.1:0"], "'http://127.0.0.1:0' has no valid port"),
        (["--fault_tolerance.lighthouse", "127.0.0.1:abc"], "'127.0.0.1:abc' has no valid port"),
        (["--fault_tolerance.lighthouse", "ftp://host:5"], "'ftp://host:5' is not an address"),
    ],
)
def test_fault_tolerance_values_are_refused_as_themselves(
    overrides: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["config", "show", *FT, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert "replica_id" not in err, err  # a value the user never set is not blamed


def test_fault_tolerance_values_that_fit_are_accepted() -> None:
    cfg = load_config(None, [*FT, "--fault_tolerance.local_replicas", "2", "--fault_tolerance.min_replica_size", "2"])
    assert cfg.fault_tolerance.min_replica_size == 2
    load_config(None, [*FT, "--fault_tolerance.lighthouse", "127.0.0.1"])  # the port defaults to 29510


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "99999"], "--port 99999 is not a TCP port"),
        (["--port", "-1"], "--port -1 is not a TCP port"),
        (["--port", "0", "--min-replicas", "0"], "--min-replicas 0 must be >= 1"),
        (["--port", "0", "--join-timeout-ms", "-1"], "--join-timeout-ms -1 must be >= 0"),
        (["--port", "0", "--heartbeat-timeout-ms", "0"], "--heartbeat-timeout-ms 0 must be >= 1"),
    ],
)
def test_lighthouse_flags_are_refused_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchft")
    assert cli.main(["ft", "lighthouse", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_a_lighthouse_on_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchft")
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["ft", "lighthouse", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--port {port}: the Lighthouse cannot listen there" in err and len(err.splitlines()) == 1, err


def stuck_group(min_replica_size: int, init_timeout: int, participants: int) -> ft.FaultTolerance:
    """A group whose commits are always refused (fewer groups than its minimum in the quorum)."""
    cfg = load_config(
        None,
        [
            *FT,
            *["--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", str(min_replica_size)],
            *["--comm.init_timeout_seconds", str(init_timeout), "--comm.train_timeout_seconds", str(init_timeout)],
        ],
    )
    loader = SimpleNamespace(state_dict=lambda: {"pos": 3}, load_state_dict=lambda s: None)
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None, state={})
    state = SimpleNamespace(model_parts=[], loader=loader, optimizer=optimizer, metrics=SimpleNamespace(console=0))
    state.step = 1
    manager = SimpleNamespace(
        start_quorum=lambda: None,
        should_commit=lambda: False,
        _min_replica_size=min_replica_size,
        num_participants=lambda: participants,
        errored=lambda: None,
    )
    return ft.FaultTolerance(cfg, state, manager=manager)  # type: ignore[arg-type]


def test_a_quorum_that_cannot_commit_ends_within_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    group = stuck_group(min_replica_size=2, init_timeout=1, participants=1)
    began = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        while time.monotonic() - began < 10:  # the old code retried for ever: this bound makes it fail, not hang
            group.start_step()
            assert not group.should_commit()
    assert stopped.value.code == ft.NO_QUORUM_EXIT
    assert time.monotonic() - began < 3
    err = capsys.readouterr().err.strip()
    assert "step 1 did not commit within comm.init_timeout_seconds = 1 s" in err, err
    assert "only 1 replica group(s) in the quorum, fewer than fault_tolerance.min_replica_size = 2" in err, err
    assert len(err.splitlines()) == 1, err


def test_a_group_that_keeps_failing_after_a_commit_ends_within_the_train_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    group = stuck_group(min_replica_size=1, init_timeout=1, participants=2)
    group.committed = time.perf_counter()  # a step committed: from now on max_failed_attempts and the train timeout
    group.state.step = 7
    with pytest.raises(SystemExit):
        for _ in range(100):
            assert not group.should_commit()
            time.sleep(0.05)
    err = capsys.readouterr().err.strip()
    assert "step 7 did not commit within " in err and " attempts (fault_tolerance.max_failed_attempts = 3)" in err, err
    assert "and comm.train_timeout_seconds = 1 s since the last commit: a group kept voting against" in err, err


@pytest.mark.parametrize(
    ("codes", "says"),
    [
        ([2, 1], "replica group 0 stopped on a configuration error"),
        ([1, 2], "replica group 1 stopped on a configuration error"),
        ([ft.NO_QUORUM_EXIT] * 2, "replica group 0 found no quorum that could commit a step"),
        ([1, -9], "all 2 replica groups lost"),
    ],
)
def test_the_launcher_names_why_the_groups_ended(
    codes: list[int], says: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, [*FT, "--fault_tolerance.local_replicas", "2", "--job.dump_folder", str(tmp_path)])
    ft_cli.say_why(cfg, codes)
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    if "lost" not in says:
        assert "run the same command again" not in err, err


def test_the_launcher_refuses_a_layout_no_group_can_run(capsys: pytest.CaptureFixture[str]) -> None:
    """What each group's ranks would stop on is found once, before the Lighthouse or any group starts."""
    argv = ["train", "--nproc", "2", *FT, "--fault_tolerance.local_replicas", "2", "--model.flavor", "tiny"]
    argv += ["--parallelism.tensor_parallel_degree", "2"]

    def no_lighthouse(*args: object) -> None:
        raise AssertionError("a Lighthouse started despite the mistake")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ft_cli, "start_lighthouse", no_lighthouse)
        assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "world size 1 is not divisible" in err and len(err.splitlines()) == 1, err


def test_local_replicas_without_nproc_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --nproc no launcher starts the other group: the run would wait for it until the timeout."""
    assert cli.main(["train", *FT, "--fault_tolerance.local_replicas", "2", "--model.flavor", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fault_tolerance.local_replicas = 2 starts local groups and needs --nproc N" in err, err
    assert len(err.splitlines()) == 1, err


def test_the_groups_never_launch_groups_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """local_replicas from a --config file reaches each group's command too: the launcher sets it to 0 there."""
    (tmp_path / "ft.toml").write_text("[fault_tolerance]\nenable = true\nlocal_replicas = 2\n")
    commands: list[list[str]] = []

    def popen(cmd: list[str], env: object) -> SimpleNamespace:
        commands.append(cmd)
        return SimpleNamespace(poll=lambda: 0, wait=lambda: 0, pid=0)

    lighthouse = SimpleNamespace(address=lambda: "http://127.0.0.1:1", shutdown=lambda: None)
    monkeypatch.setattr(ft_cli, "start_lighthouse", lambda *a: lighthouse)
    monkeypatch.setattr(ft_cli.subprocess, "Popen", popen)
    monkeypatch.setattr(ft_cli, "reap_on_signals", lambda groups: None)
    argv = ["train", "--config", str(tmp_path / "ft.toml"), "--nproc", "2", "--model.flavor", "tiny"]
    argv += ["--job.dump_folder", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert len(commands) == 2
    for cmd in commands:
        args, overrides = train_cli.parse(cmd[cmd.index("train") + 1 :])
        config = load_config(args.config, overrides)
        assert config.fault_tolerance.local_replicas == 0 and config.fault_tolerance.group_size == 2, cmd


@pytest.mark.parametrize(
    ("key", "value"),
    [("checkpoint.interval_seconds", "nan"), ("checkpoint.interval_seconds", "inf"), ("optimizer.lr", "nan")],
)
def test_a_non_finite_number_is_refused_from_the_command_line_and_toml(
    key: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nan passes every `< 0` check (elastic resume's interval_seconds = nan never saved): refused where it enters."""
    assert cli.main(["config", "show", f"--{key}", value]) == 2
    section, name = key.split(".")
    (tmp_path / "c.toml").write_text(f"[{section}]\n{name} = {value}\n")
    assert cli.main(["config", "show", "--config", str(tmp_path / "c.toml")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"meshforge config: config error: {key} = {value} must be a finite number"] * 2, lines


def test_a_lighthouse_that_never_answers_a_quorum_is_named_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    """The first quorum timing out is not 'every group lost' (nothing was): one line naming the Lighthouse, exit 5."""
    group = stuck_group(min_replica_size=1, init_timeout=3, participants=0)

    def times_out() -> None:
        raise TimeoutError("status: Cancelled, message: Timeout expired")

    group.manager.start_quorum = times_out
    with pytest.raises(SystemExit) as stopped:
        group.start_step()
    assert stopped.value.code == ft.NO_QUORUM_EXIT
    err = capsys.readouterr().err.strip()
    assert "no quorum formed within comm.init_timeout_seconds = 3 s" in err and "127.0.0.1:29510" in err, err
    assert "lost" not in err and len(err.splitlines()) == 1, err
    group.committed = time.perf_counter()  # after a commit, a failing quorum is a lost group: the resume line
    with pytest.raises(SystemExit, match="The last committed step is 0; resume by relaunching the groups"):
        group.start_step()


def test_regather_keep_without_once_per_step_is_refused_in_one_line() -> None:
    """keep only acts between micro-steps that skip the exchange: with every_microstep it would be silently ignored."""
    from meshforge.config.io import load_config
    from meshforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"regather = 'keep' has no effect.*set gradient_sync.mode = 'once_per_step'"):
        load_config(None, ["--gradient_sync.regather", "keep", "--gradient_sync.mode", "every_microstep"])
    load_config(None, ["--gradient_sync.regather", "keep", "--gradient_sync.mode", "once_per_step"])  # accepted
