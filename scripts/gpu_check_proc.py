"""Run one GPU-check job with every wait bounded and, on a timeout, kill its whole process tree.

Why not ``os.killpg`` on the job: torchrun starts each worker with ``start_new_session=True``, so the ranks are in
sessions (and process groups) of their own and survive a kill of torchrun's group, keeping the GPU and, with a pipe,
the job's stdout open (``communicate()`` then waits for them). Here the job's output goes to a file (no pipe an
orphan can hold), and a timeout kills the tree found through ``/proc``: every descendant by parent id, plus every
process in a session one of them leads (a worker's own children, even after their parent died and they were
re-parented), first SIGTERM, then SIGKILL after a grace. Linux only (``/proc``); elsewhere it falls back to killpg.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL for a timed-out tree."""


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """(parent pid, session id, start time, state) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ... starttime
    return int(fields[1]), int(fields[3]), int(fields[19]), fields[0]


def _table() -> dict[int, tuple[int, int, int, str]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            table[int(entry)] = info
    return table


def process_tree(root: int) -> dict[int, int]:
    """Every live process under ``root`` (itself included) -> its start time: descendants by parent id, and every
    process in a session led by one of them (so workers started in new sessions and their re-parented children)."""
    table = _table()
    found: dict[int, int] = {}
    frontier = [root] if root in table else []
    while frontier:
        pid = frontier.pop()
        if pid in found:
            continue
        found[pid] = table[pid][2]
        frontier += [p for p, (ppid, _, _, _) in table.items() if ppid == pid and p not in found]
        frontier += [p for p, (_, sid, _, _) in table.items() if sid == pid and p not in found]
    return found


def alive(pid: int, start: int | None = None) -> bool:
    """The process exists, is not a zombie and (when ``start`` is given) is the same process (no pid reuse)."""
    info = _stat(pid)
    return info is not None and info[3] not in ("Z", "X") and (start is None or info[2] == start)


def kill_tree(root: int, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM ``root``'s whole tree, SIGKILL what is left after ``grace_s`` (and anything it spawned meanwhile);
    returns the pids that were found."""
    if not Path("/proc/self/stat").exists():  # not Linux: the old way, the job's own group only
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root, signal.SIGKILL)
        return [root]
    tree = process_tree(root)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in tree.items():
            if alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(alive(p, s) for p, s in tree.items()):
            time.sleep(0.05)
        for pid in list(tree):  # children started during the grace (torchrun restarting a worker, say)
            tree |= {p: s for p, s in process_tree(pid).items() if p not in tree}
    return sorted(tree)


@dataclass
class JobResult:
    returncode: int | None  # None: timed out (the tree was killed)
    text: str
    seconds: float
    killed: list[int]


def run_job(argv: list[str], timeout_s: float, log: Path, env: dict[str, str], cwd: Path) -> JobResult:
    """Run ``argv`` with stdout and stderr to ``log`` (a file: nothing can hold a pipe open), wait at most
    ``timeout_s``; on a timeout kill the whole tree. Every wait here is bounded."""
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
    killed: list[int] = []
    try:
        code: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
        killed = kill_tree(proc.pid)  # torchrun and every rank, whatever session they are in
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    text = log.read_bytes().decode(errors="replace")
    return JobResult(code, text, round(time.perf_counter() - start, 1), killed)
