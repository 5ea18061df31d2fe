"""A hung replica group (issue 43, item 2): every process of group 1 is SIGSTOPped (a hang, not a death: its sockets
stay open, so group 0's all-reduce waits out comm.train_timeout_seconds instead of failing at once, as a hung NCCL
peer makes it). Group 0 must retry that step in a smaller quorum and keep training alone, never give up on the first
failure after the hang; once group 1 is SIGCONTinued it must rejoin (live-recovered from group 0) and both groups
then hold bit-identical parameters at every joint step. The groups are stopped by the test once that is shown."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_fault_tolerance import kill_tree, retried, steps

from meshforge.train.ft_cli import descendants

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
torchft = pytest.importorskip("torchft", reason="needs torchft: pip install 'meshforge[ft]'")

TIMEOUT_S = 8  # comm.train_timeout_seconds: torchft's all-reduce timeout, what a hung peer costs the survivor
ARGS = [
    "--model.flavor", "tiny", "--training.seq_len", "128", "--training.local_batch_size", "8",
    "--training.steps", "1000", "--training.deterministic", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none", "--metrics.straggler_threshold", "0",
    "--metrics.progress_bar", "false", "--comm.train_timeout_seconds", str(TIMEOUT_S),
    "--fault_tolerance.params_digest",
]  # fmt: skip
ALONE, JOINT, TRIES = 3, 3, 3  # group 0 commits 3 steps alone, then 3 with group 1; at most 3 stops


def launch(group: int, dump: Path, lighthouse: str) -> subprocess.Popen[bytes]:
    """One group of one process (no torchrun): a group of several ranks, frozen longer than comm.train_timeout_seconds
    inside one of its own FSDP collectives, times that collective out once continued and ends (exit 3) instead of
    rejoining; the survivors' side of a hang, which this test is about, is the same at any group size."""
    cmd = [sys.executable, "-m", "meshforge", "train", *ARGS, "--job.dump_folder", str(dump)]
    cmd += ["--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group)]
    cmd += ["--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse", lighthouse]
    dump.mkdir(parents=True, exist_ok=True)
    out = (dump / "out.txt").open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def signal_tree(pid: int, sig: signal.Signals) -> None:
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def tail(dump: Path) -> str:
    """The group's output without C++ stack frames (a gloo or store error prints dozens)."""
    lines = (dump / "out.txt").read_text().splitlines()
    return "\n".join(line for line in lines if "frame #" not in line)[-4000:]


def wait_until(done: Callable[[], bool], procs: dict[Path, subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    """Poll ``done``; fail at once (with the group's output) when a group ended, e.g. gave up with exit 5."""
    deadline = time.monotonic() + timeout
    while not done():
        for dump, proc in procs.items():
            assert proc.poll() is None, f"{dump.name} ended (exit {proc.returncode}) before {what}:\n{tail(dump)}"
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        time.sleep(0.02)


def on_cpu(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    return False


def stop_inside_a_step(dump: Path, procs: dict[Path, subprocess.Popen[bytes]]) -> float:
    """SIGSTOP the group while it computes a step whose quorum it joined (so group 0's all-reduce waits for it):
    after its next committed row, 40 % of its step interval on, once it is on the CPU. A stop that still lands
    between two steps (group 0 then gets its smaller quorum without a failed attempt) is retried by the caller."""
    rows = steps(dump)
    wait_until(lambda: len(steps(dump)) > len(rows), procs, 120, "a step of group 1 to stop in")
    done = steps(dump)
    interval = (done[-1]["t"] - done[-3]["t"]) / 2 if len(done) >= 3 else 0.5
    time.sleep(0.4 * interval)
    wait_until(lambda: on_cpu(procs[dump].pid), procs, 30, "group 1 on the CPU")
    signal_tree(procs[dump].pid, signal.SIGSTOP)
    return time.time()


def rows(dump: Path, since: float, participants: int) -> list[dict[str, Any]]:
    """The group's committed steps after ``since`` with this many groups in the quorum."""
    return [r for r in steps(dump) if r["t"] > since and r["participants"] == participants]


def wait_rows(dump: Path, since: float, participants: int, n: int, procs: dict[Path, subprocess.Popen[bytes]]) -> None:
    what = f"{n} steps of {dump.name} with {participants} group(s) in the quorum"
    wait_until(lambda: len(rows(dump, since, participants)) >= n, procs, 4 * TIMEOUT_S + 60, what)


def failed_attempts(dump: Path, since: float, until: float) -> list[int]:
    return [r["step"] for r in steps(dump, 0, "ft_attempts") if not r["committed"] and since < r["t"] < until]


def test_a_hung_group_is_waited_out_then_rejoins() -> None:
    from meshforge.train.ft_cli import start_lighthouse

    server = start_lighthouse(0, 1, 1000, 1000)
    root = Path(tempfile.mkdtemp(prefix="meshforge-ft-hang-"))
    g0, g1 = root / "replica_0", root / "replica_1"
    procs: dict[Path, subprocess.Popen[bytes]] = {}
    hangs: list[tuple[float, float]] = []  # (stopped, continued) of each stop that made group 0 wait out a hang
    try:
        procs = {g0: launch(0, g0, server.address()), g1: launch(1, g1, server.address())}
        for attempt in range(1, TRIES + 1):
            stopped = stop_inside_a_step(g1, procs)
            wait_rows(g0, stopped, 1, ALONE, {g0: procs[g0]})  # group 0 goes on alone, never gives up
            signal_tree(procs[g1].pid, signal.SIGCONT)
            resumed = time.time()
            wait_rows(g1, resumed, 2, JOINT, procs)  # group 1 rejoins, both train together
            if failed_attempts(g0, stopped, resumed):
                hangs.append((stopped, resumed))
                print(f"the stop of try {attempt} made group 0 wait out the hang")
                break
    finally:
        for proc in procs.values():
            signal_tree(proc.pid, signal.SIGCONT)
            kill_tree(proc.pid)
            proc.wait()
        server.shutdown()
    assert hangs, f"none of {TRIES} stops landed inside a step: group 0 never waited for a hung peer"
    check(g0, g1, *hangs[-1])


def check(g0: Path, g1: Path, stopped: float, resumed: float) -> None:
    survivor = [r["step"] for r in steps(g0)]
    assert survivor == list(range(1, len(survivor) + 1)), survivor  # none lost, none repeated
    first_alone = min(r["step"] for r in steps(g0) if r["t"] > stopped and r["participants"] == 1)
    assert failed_attempts(g0, stopped, resumed) == [first_alone], (first_alone, retried(g0))  # retried once
    waited = next(r["t"] for r in steps(g0) if r["step"] == first_alone) - stopped
    assert waited > TIMEOUT_S / 2, f"group 0 went on {waited:.1f} s after the stop: it did not wait out a hang"
    assert "recovered step" in (g1 / "out.txt").read_text()  # group 1 was behind and received group 0's state
    theirs = {r["step"]: r["params_before"] for r in steps(g0)}
    mine = [(r["step"], r["params_before"]) for r in steps(g1) if r["t"] > resumed and r["step"] in theirs]
    assert mine and all(d == theirs[s] for s, d in mine), mine  # after the rejoin: the same parameters
