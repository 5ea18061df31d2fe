"""The bench's warm launcher (bench/warm.py) gives each rank what torchrun gives it, and ends a job as torchrun does:
the same environment (checked against a real torchrun job), threads and argv; a failed rank stops the others and is
named in one line; the bench's timeout ends the leader and every rank with one killpg."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshforge.bench.runner import stop_group
from meshforge.bench.warm import WarmLauncher

ENTRIES = Path(__file__).with_name("warm_entries.py")
# values that differ by design: a free port and a run id per job, where torchrun keeps its error files, and who
# hosts the rendezvous store (torchrun's agent; rank 0 under the warm launcher)
DIFFERENT_VALUES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def launcher() -> WarmLauncher:
    warm = WarmLauncher({**os.environ, "OMP_NUM_THREADS": "1"})
    assert warm.usable, warm.ready
    yield warm
    warm.close()


def start(warm: WarmLauncher, tmp: Path, what: str, nproc: int = 2, threads: int = 1):  # type: ignore[no-untyped-def]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    logs = tmp / "stdout.log", tmp / "stderr.log"
    return warm.start([what, str(tmp)], nproc, env, *logs, entry=f"{ENTRIES}:{what}")


def test_each_rank_gets_what_torchrun_gives_it(launcher: WarmLauncher, tmp_path: Path) -> None:
    cold, warm = tmp_path / "torchrun", tmp_path / "warm"
    cold.mkdir(), warm.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ENTRIES), "dump"]
    subprocess.run([*cmd, str(cold)], env=env, check=True, capture_output=True, timeout=120)
    assert start(launcher, warm, "dump", threads=2).wait(timeout=120) == 0, (warm / "stderr.log").read_text()
    for rank in range(2):
        a, b = (json.loads((folder / f"rank{rank}.json").read_text()) for folder in (cold, warm))
        assert set(a["env"]) == set(b["env"]), set(a["env"]) ^ set(b["env"])
        differ = {key for key in a["env"] if a["env"][key] != b["env"][key]}
        assert differ <= DIFFERENT_VALUES, {key: (a["env"][key], b["env"][key]) for key in differ - DIFFERENT_VALUES}
        assert a["argv"][0] == b["argv"][0] == "dump" and len(a["argv"]) == len(b["argv"])
        assert a["threads"] == b["threads"] == 2
    parents = {json.loads((warm / f"rank{r}.json").read_text())["ppid"] for r in range(2)}
    assert len(parents) == 1  # one leader per job, as torchrun has one agent


def test_a_failed_rank_ends_the_job_and_is_named(launcher: WarmLauncher, tmp_path: Path) -> None:
    began = time.monotonic()
    assert start(launcher, tmp_path, "fail").wait(timeout=60) == 1
    assert time.monotonic() - began < 30  # the sleeping rank was stopped, not waited for
    assert "rank 1 exited with code 3" in (tmp_path / "stderr.log").read_text()


def test_the_bench_timeout_ends_leader_and_ranks(launcher: WarmLauncher, tmp_path: Path) -> None:
    job = start(launcher, tmp_path, "hang")
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2 and job.poll() is None
    stop_group(job)
    assert job.returncode is not None  # the leader has reaped its ranks before it ended
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert start(launcher, tmp_path, "dump", nproc=1).wait(timeout=60) == 0  # and the launcher goes on
