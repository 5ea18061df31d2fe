"""Two "nodes" on this machine, as users launch them: two torchrun launchers (``--nnodes 2``, 2 local ranks each,
c10d rendezvous on 127.0.0.1) train FSDP 2 x TP 2. Killing one node mid-run makes the other node's ranks exit within
comm.train_timeout_seconds + 60 s with a line naming the lost ranks; relaunching both (the job's store hosted by rank
0) resumes from the last checkpoint and runs to the end: every loss equals the same layout started by the forking
launcher bit for bit. Extending a finished run from its last step's checkpoint takes the same path under any launcher:
tests/distributed/test_checkpoint_extend.py proves it bit for bit (a two-node test of it here cost 2 launches more)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from launcher import free_port, run_ranks
from parity import BASE, train_records

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_TIMEOUT = 10
LAYOUT = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
LAYOUT += ["--lr_scheduler.decay_type", "constant", "--metrics.progress_bar", "false"]
LAYOUT += ["--checkpoint.enable", "--checkpoint.interval", "2", "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT)]


def start_node(port: int, dump: Path, steps: int, run_id: str, share_store: bool = False) -> subprocess.Popen[str]:
    """One node's launcher (in its own session, so that the test can end it and whatever it started). With
    ``share_store`` the job uses the rendezvous host's store (torchrun's default) instead of one hosted by rank 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    cmd += ["-m", "meshforge", "train", *BASE, *LAYOUT, "--job.dump_folder", str(dump), "--training.steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1"}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def global_ranks(launcher: int) -> dict[int, int]:
    """RANK -> pid of the worker processes a launcher started (each in its own session, as torchrun starts them)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [v.split(b"=", 1)[1] for v in env if v.startswith(b"RANK=")]
        if ppid == launcher and ranks:
            out[int(ranks[0])] = int(entry.name)
    return out


def wait_listening(port: int, node: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until the first launcher hosts the rendezvous store on ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert node.poll() is None, "the first node ended before the rendezvous"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no rendezvous store on port {port}")


def losses(dump: Path) -> dict[int, float]:
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, (line for line in lines if line.endswith("}")))}


def two_nodes(dump: Path, steps: int, run_id: str) -> list[tuple[int, str]]:
    port = free_port()
    nodes = [start_node(port, dump, steps, run_id) for _ in range(2)]
    out = []
    for node in nodes:
        _, err = node.communicate(timeout=600)
        out.append((node.returncode, err))
    return out


def reference(steps: int) -> dict[int, float]:
    records: list[dict[str, Any]] = run_ranks(train_records, 4, [*LAYOUT, "--training.steps", str(steps)])[0]
    return {r["step"]: r["loss"] for r in records}


def test_killed_node_stops_the_other_with_the_lost_ranks_and_both_resume() -> None:
    dump = Path(tempfile.mkdtemp(prefix="meshforge-2node-kill-"))
    port = free_port()
    # node 0 hosts the rendezvous (and, shared, the job's store): a launcher whose rendezvous host dies exits with
    # torchrun's own RendezvousConnectionError, so the node that dies here is the other one
    nodes = [start_node(port, dump, 12, "kill", share_store=True)]
    wait_listening(port, nodes[0])
    nodes.append(start_node(port, dump, 12, "kill", share_store=True))
    try:
        deadline = time.monotonic() + 400
        while max(losses(dump), default=0) < 3 and time.monotonic() < deadline:
            assert all(n.poll() is None for n in nodes), "a node ended before the kill"
            time.sleep(0.1)
        before = losses(dump)
        doomed, survivor = 1, 0
        workers = global_ranks(nodes[doomed].pid)
        lost = sorted(workers)
        for pid in [nodes[doomed].pid, *workers.values()]:  # the whole node: launcher and its ranks
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = nodes[survivor].communicate(timeout=TRAIN_TIMEOUT + 60)
        waited = time.monotonic() - killed
    finally:
        for node in nodes:
            if node.poll() is None:
                for pid in [node.pid, *global_ranks(node.pid).values()]:
                    os.kill(pid, signal.SIGKILL)
    assert nodes[survivor].returncode != 0 and waited < TRAIN_TIMEOUT + 60
    assert len(lost) == 2 and f"none from ranks {lost}" in err, err[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*") if "." not in p.name)
    assert saved and saved[-1] >= 2
    for code, out in two_nodes(dump, 12, "relaunch"):
        assert code == 0, out[-3000:]
    after = losses(dump)
    assert sorted(after) == list(range(1, 13))
    assert all(after[s] == before[s] for s in before if s <= saved[-1])
    assert after == reference(12)  # the resumed run is the uninterrupted one, bit for bit
