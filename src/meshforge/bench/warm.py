"""A warm launcher for the bench: one process imports torch and meshforge's training code once, then starts each job's
ranks by fork, with the processes and environment `torchrun --standalone` gives its workers.

Why: on a small machine most of a short benchmark run is start-up (each rank importing torch, DTensor and dynamo
again: ~4 CPU s per rank, 4 ranks on 2 cores), not training. Forked ranks share the imported modules and reach their
first step in about a second. What each job gets is what torchrun gives it:

* one leader process per job (torchrun's agent), its own session, so the bench ends it and its ranks with one killpg;
* one process per rank with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_*/ROLE_* ranks and sizes,
  MASTER_ADDR/MASTER_PORT (a free port per job), TORCHELASTIC_RUN_ID / RESTART_COUNT / MAX_RESTARTS / ERROR_FILE,
  TORCH_NCCL_ASYNC_ERROR_HANDLING, the run's OMP_NUM_THREADS (applied with ``torch.set_num_threads``: the OpenMP
  runtime read the variable once, in the warm process) and ``sys.argv`` as ``python -m meshforge train`` sets it;
* a failed rank ends the job: the others get SIGTERM, then SIGKILL after a grace period, and the leader prints one line
  naming the first failed rank and its exit code (or signal) and exits 1, as torchrun does.

One difference, by design: TORCHELASTIC_USE_AGENT_STORE is False, so rank 0 hosts the rendezvous store (plain env://
initialisation) instead of the agent. The warm process imports nothing of CUDA's: if torch reports CUDA initialised
after the imports, it says so and the bench uses torchrun. Multi-node runs always use torchrun.

Protocol (one JSON object per line): the warm process writes {"ready": ...} once, then for each request on stdin
{"argv", "nproc", "env", "stdout", "stderr"} replies {"pid": leader pid} and, when the job has ended,
{"pid", "returncode"}.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError
from meshforge.train.cli import main

WARM_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "meshforge.train.cli", "meshforge.train.loop")
GRACE_S = 10.0
READY_TIMEOUT_S = 180.0


def train_entry(argv: list[str]) -> int:
    """`python -m meshforge train ARGV` in this process: the one-line config error included (meshforge/cli.py)."""
    try:
        return int(main(argv))
    except ConfigError as exc:
        print(f"meshforge train: config error: {exc}", file=sys.stderr, flush=True)
        return 2


def worker_env(rank: int, nproc: int, port: int, run_id: str, folder: Path) -> dict[str, str]:
    """What torchrun --standalone sets for worker ``rank`` of ``nproc`` on one node (checked against torchrun itself
    in tests/integration/test_warm_launcher.py)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": str(folder / "torchelastic" / str(rank) / "error.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def rank_main(request: dict[str, Any], env: dict[str, str]) -> None:
    """Become one rank: its environment, argv and threads, then the entry point; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        import torch

        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
        sys.argv = [str(Path(__file__).resolve().parents[1] / "__main__.py"), *request["argv"]]
        code = entry(request)(list(request["argv"])[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a real bug keeps its traceback, as in a fresh process
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def entry(request: dict[str, Any]) -> Any:
    """The function a rank runs: ``module:function`` or ``path/file.py:function`` from the request (tests), else
    `meshforge train`."""
    import importlib
    import importlib.util

    where, _, name = str(request.get("entry") or f"{__name__}:train_entry").rpartition(":")
    if not where.endswith(".py"):
        return getattr(importlib.import_module(where), name)
    spec = importlib.util.spec_from_file_location(Path(where).stem, where)
    assert spec is not None and spec.loader is not None, where
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def lead(request: dict[str, Any]) -> int:
    """The job's leader (torchrun's agent): its own session, the logs as stdout/stderr, one forked process per rank,
    and the first failure ends the job. Returns the leader's exit status."""
    os.setsid()
    folder = Path(request["stdout"]).parent
    with open(os.devnull) as null, open(request["stdout"], "a") as out, open(request["stderr"], "a") as err:
        os.dup2(null.fileno(), 0)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    nproc, port, run_id = int(request["nproc"]), free_port(), uuid.uuid4().hex
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        env = dict(request["env"])
        if nproc > 1:
            env |= worker_env(rank, nproc, port, run_id, folder)
        pid = os.fork()
        if pid == 0:
            rank_main(request, env)
        ranks[pid] = rank
    return supervise(ranks)


def supervise(ranks: dict[int, int]) -> int:
    """Wait for every rank; on the first failure (or a SIGTERM to the leader: the bench's timeout) stop the rest
    (TERM, then KILL after GRACE_S), reap them all, and say which failed."""
    failures: list[tuple[int, int]] = []
    alive = dict(ranks)
    deadline = 0.0
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    while alive:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            rank, code = alive.pop(pid), os.waitstatus_to_exitcode(status)
            if code != 0 and not deadline:
                failures.append((rank, code))
        if (failures or stopped) and not deadline:
            failures += [(-1, -signal.SIGTERM)] if stopped and not failures else []
            signal_all(alive, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
        if deadline and time.monotonic() > deadline:
            signal_all(alive, signal.SIGKILL)
        if not pid:
            time.sleep(0.05)
    return report(failures)


def report(failures: list[tuple[int, int]]) -> int:
    """The leader's exit status (0, or 1 as torchrun's), and one line naming the first failed rank."""
    if not failures:
        return 0
    rank, code = failures[0]
    if rank < 0:
        print("meshforge bench: warm launcher: stopped by SIGTERM; the job's ranks were stopped", file=sys.stderr)
        return 1
    how = f"was killed by signal {-code} (Signal {-code} ({signal.Signals(-code).name}))" if code < 0 else ""
    how = how or f"exited with code {code} (exitcode : {code})"
    print(f"meshforge bench: warm launcher: rank {rank} {how}; the job's other ranks were stopped", file=sys.stderr)
    return 1


def signal_all(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def serve() -> int:
    """The warm process: import once, then run one job at a time as asked on stdin."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the replies
    started = time.perf_counter()
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    import torch

    replies = os.fdopen(reply_fd, "w", buffering=1)
    ready = {"ready": True, "import_s": round(time.perf_counter() - started, 2)}
    replies.write(json.dumps(ready | {"cuda_initialized": bool(torch.cuda.is_initialized())}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            code = 1
            try:
                code = lead(request)
            finally:
                os._exit(code)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    return 0


class WarmLauncher:
    """The bench's handle on a warm process (started with the sweep's environment); ``start`` runs one job."""

    def __init__(self, env: dict[str, str]):
        cmd = [sys.executable, "-m", "meshforge.bench.warm_main"]  # its own entry: no runpy warning
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self._buffer = bytearray()
        self.ready = self._read(READY_TIMEOUT_S) or {}
        self.usable = bool(self.ready.get("ready")) and not self.ready.get("cuda_initialized")
        if not self.usable:
            self.close()

    def _read(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next reply, or None when none came within ``timeout_s`` (None: wait) or the warm process ended."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return {"returncode": -1, "ended": True}
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def start(
        self, argv: list[str], nproc: int, env: dict[str, str], stdout: Path, stderr: Path, entry: str = ""
    ) -> WarmJob:
        """Start ``python -m meshforge ARGV`` (or ``entry``) on ``nproc`` forked ranks, output into the two files."""
        assert self.proc.stdin is not None
        request = {"argv": argv, "nproc": nproc, "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        request["entry"] = entry
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read(READY_TIMEOUT_S) or {}
        if "pid" not in reply:
            self.usable = False
            raise RuntimeError(f"the warm launcher did not start the job ({reply or 'no reply'})")
        return WarmJob(self, int(reply["pid"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class WarmJob:
    """One job of the warm launcher, with the part of ``subprocess.Popen`` the bench's runner uses."""

    def __init__(self, launcher: WarmLauncher, pid: int):
        self.launcher, self.pid = launcher, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            reply = self.launcher._read(0)
            if reply is not None:
                self.returncode = int(reply["returncode"])
                self.launcher.usable = not reply.get("ended")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["meshforge-warm-job", str(self.pid)], timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode
