"""Fault-tolerant groups never spin and never outlive their launcher (issue 36), as a user meets them: a quorum that
cannot commit ends the group within comm.init_timeout_seconds with one line and exit NO_QUORUM_EXIT; a config error
inside a group launched by `meshforge train --nproc N --fault_tolerance.local_replicas R` is reported as one, exit 2
(not as lost groups to relaunch); SIGTERM to that launcher leaves no process of any group behind. Short timeouts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshforge.train.ft_cli import descendants

pytestmark = [pytest.mark.distributed]
pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")

TINY = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "4"]
TINY += ["--metrics.progress_bar", "false", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
TINY += ["--comm.init_timeout_seconds", "6", "--comm.train_timeout_seconds", "10"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}


def train(args: list[str], dump: Path) -> subprocess.Popen[str]:
    """The command with its output in files (a full pipe would stall the groups): ``finish`` reads them."""
    cmd = [sys.executable, "-m", "meshforge", "train", *TINY, "--job.dump_folder", str(dump), *args]
    out = (dump.parent / f"{dump.name}.out").open("w")
    err = (dump.parent / f"{dump.name}.err").open("w")
    return subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=ENV)


def finish(proc: subprocess.Popen[str], dump: Path, timeout: float) -> str:
    """Wait for ``proc`` (at most ``timeout`` s), kill whatever of its tree is left, return its stderr."""
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_all(descendants(proc.pid))
    return (dump.parent / f"{dump.name}.err").read_text()


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its parent's wait counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_quorum_below_the_minimum_ends_the_group_in_one_line(tmp_path: Path) -> None:
    from meshforge.train.fault_tolerance import NO_QUORUM_EXIT
    from meshforge.train.ft_cli import start_lighthouse

    server = start_lighthouse(0, 1, 100, 1000)
    args = ["--training.steps", "3", "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    args += ["--fault_tolerance.min_replica_size", "2", "--fault_tolerance.lighthouse", server.address()]
    began = time.monotonic()
    proc = train(args, tmp_path / "run")  # group 1 never starts: a quorum of 1 < 2 can never commit
    try:
        err = finish(proc, tmp_path / "run", 90)
    finally:
        server.shutdown()
    assert proc.returncode == NO_QUORUM_EXIT, err[-3000:]
    mine = [line for line in err.splitlines() if line.startswith("meshforge: fault tolerance: step 1 did not")]
    assert len(mine) == 1 and "fewer than fault_tolerance.min_replica_size = 2" in mine[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert time.monotonic() - began < 60


def test_a_config_error_inside_a_group_is_named_as_one(tmp_path: Path) -> None:
    """A prepared dataset that is not there: only the ranks open it; the launcher must not call the groups lost."""
    args = ["--nproc", "2", "--fault_tolerance.enable", "--fault_tolerance.local_replicas", "2"]
    args += ["--training.steps", "2", "--training.dataset", "prepared", "--training.dataset_path", str(tmp_path / "x")]
    proc = train(args, tmp_path / "run")
    err = finish(proc, tmp_path / "run", 120)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "stopped on a configuration error" in last and "run the same command again" not in err, err[-3000:]


def test_sigterm_to_the_launcher_reaps_every_group(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--fault_tolerance.enable", "--fault_tolerance.local_replicas", "2"]
    args += ["--training.steps", "100000"]
    dump = tmp_path / "run"
    proc = train(args, dump)
    tree: list[int] = []
    try:
        log = dump / "replica_0" / "ft_steps.rank0.jsonl"
        deadline = time.monotonic() + 150
        while not (log.is_file() and log.read_text().strip()):  # the groups train (a step committed)
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.err").read_text()[-3000:]
            time.sleep(0.2)
        assert json.loads(log.read_text().splitlines()[0])["step"] >= 1
        tree = descendants(proc.pid)
        assert len(tree) >= 5  # the launcher, 2 torchruns, 2 ranks
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as a scheduler or `kill` sends it
        proc.wait(timeout=30)
        time.sleep(1.0)
        left = [pid for pid in tree if alive(pid)]
        assert not left, f"left behind: {left} of {tree}"
        err = (tmp_path / "run.err").read_text()
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    finally:
        kill_all(tree or descendants(proc.pid))
