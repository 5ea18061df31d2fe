"""Hang diagnosis: when a collective times out, every rank writes what it was doing, then the job exits.

How it works. torch's flight recorder (enabled by ``enable_flight_recorder`` before the process group exists) keeps the
last collectives each rank issued on every group, with their Python call sites, for gloo and NCCL alike. A rank whose
collective fails (gloo raises on timeout; its peers then see "connection closed") leaves the training loop with the
exception; ``HangGuard`` catches it, writes ``<dump_folder>/hang/rank_R.txt`` and raises a flag in the job's rendezvous
store. A watchdog thread on every rank polls that flag: a rank that is stuck elsewhere (computing, sleeping, waiting in
another collective) writes its own file from the thread. Each file holds the reason, the training step, the recent
collectives (newest last) and the Python stack of every thread. Each rank then waits (bounded) until every rank has
written, rank 0 prints where the files are, and all exit with ``HANG_EXIT_CODE``.

On CUDA, NCCL's watchdog may tear the process down before Python sees an error; NCCL's own flight-recorder dump on
timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) covers that case. The raw dumps of every rank (ours, or NCCL's) land in
``<dump_folder>/hang/flight_recorder/rank_R``, where torch's analyser compares them across ranks; see
docs/observability.md.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from meshforge.threads import Worker

HANG_EXIT_CODE = 3
FLIGHT_RECORDER_ENTRIES = 2000
RECENT_COLLECTIVES = 24
POLL_SECONDS = 1.0  # one store check per rank per second while training
PEER_GRACE_SECONDS = 20.0
STACK_FRAMES = 40  # innermost frames per thread
# the words of a collective that timed out, lost its peer or was aborted: gloo raises a plain RuntimeError; NCCL's
# watchdog reports "Watchdog caught collective operation timeout" / "ran for N milliseconds before timing out", an
# aborted communicator ("NCCL communicator was aborted"), a peer that died (ncclRemoteError). Any other error that
# merely mentions NCCL (invalid usage, a CUDA fault) is a bug and keeps its traceback.
FAILURE_MARKERS = (
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "pair closure",
    "Connection reset",
    "collective operation timeout",
    "before timing out",
    "communicator was aborted",
    "ncclRemoteError",
)


def enable_flight_recorder(dump_folder: str) -> None:
    """Turn on torch's flight recorder (must run before the process group is created); values already in the
    environment win. On CUDA also ask NCCL's watchdog to dump it into ``<dump_folder>/hang/`` on a timeout."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))  # the NCCL-era name is deprecated
    if torch.cuda.is_available():
        folder = Path(dump_folder).absolute() / "hang" / "flight_recorder"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))


def is_collective_failure(exc: BaseException | None) -> bool:
    """A collective that timed out or lost a peer (a hang to diagnose), not any error a backend raised."""
    if isinstance(exc, dist.DistNetworkError | dist.DistStoreError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in FAILURE_MARKERS)


def flight_recorder_dump() -> bytes | None:
    """This rank's flight-recorder entries as torch pickles them (None if this torch build has none)."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None) if dist.get_backend() == "nccl" else None
    dump = dump or getattr(c10d, "_dump_fr_trace", None)
    return None if dump is None else bytes(dump(True, True, False))


def recent_collectives(raw: bytes | None, limit: int = RECENT_COLLECTIVES) -> list[str]:
    """The last ``limit`` entries of a flight-recorder dump, one line each (newest last)."""
    if raw is None:
        return ["(this torch build has no flight recorder)"]
    entries = pickle.loads(raw).get("entries", [])
    if not entries:
        return ["(none recorded: TORCH_FR_BUFFER_SIZE was 0 when the process group started)"]
    now = time.time_ns()
    return [format_entry(e, now) for e in entries[-limit:]]


def with_group_config(raw: bytes) -> bytes:
    """The dump with every live group's name, description and ranks: gloo leaves ``pg_config`` empty, and torch's
    analyser needs it to line the ranks' entries up."""
    from torch.distributed.distributed_c10d import _world

    data = pickle.loads(raw)
    config = {
        pg.group_name: {"name": pg.group_name, "desc": pg.group_desc, "ranks": str(dist.get_process_group_ranks(pg))}
        for pg in list(_world.pg_map)
    }
    data["pg_config"] = config | {name: c for name, c in data.get("pg_config", {}).items() if name}
    return pickle.dumps(data)


def format_entry(entry: dict[str, Any], now_ns: int) -> str:
    group = entry.get("process_group", ("?", "?"))
    age = (now_ns - int(entry.get("time_created_ns", now_ns))) / 1e9
    frames = entry.get("frames", [])
    site = next((f for f in frames if "/torch/" not in f["filename"]), frames[0] if frames else None)
    where = f"{site['name']} ({site['filename']}:{site['line']})" if site else "?"
    return (
        f"seq {entry.get('collective_seq_id', '?'):>5}  group {group[0]} ({group[1]})  {entry.get('profiling_name')}  "
        f"in {entry.get('input_sizes')} {entry.get('input_dtypes')}  state {entry.get('state')}  "
        f"timeout {entry.get('timeout_ms', 0) / 1000:.0f}s  issued {age:.1f}s ago from {where}"
    )


def thread_stacks(skip: int | None = None) -> list[str]:
    """The Python stack of every thread but ``skip`` (a thread id)."""
    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is None or thread.ident == skip:
            continue
        out.append(f"--- thread {thread.name} (id {thread.ident}, daemon {thread.daemon}) ---")
        out.append("".join(traceback.format_stack(frame, limit=STACK_FRAMES)).rstrip())
    return out


class HangGuard:
    """Context manager around the training steps; a no-op without a process group."""

    def __init__(self, dump_folder: str, rank: int, world_size: int, status: Callable[[], str]) -> None:
        self.folder = Path(dump_folder) / "hang"
        self.rank, self.world_size, self.status = rank, world_size, status
        self.store: dist.Store | None = None
        self.job_store: dist.Store | None = None
        self.stop = threading.Event()
        self.lock = threading.Lock()  # the first path to report (main thread or watchdog) owns the exit
        self.watchdog: Worker | None = None

    def __enter__(self) -> HangGuard:
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            # one key space per torchrun attempt: a restarted job must not see the dead attempt's failure flag
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self.job_store = _get_default_store()
            self.store = dist.PrefixStore(f"meshforge/hang/{attempt}/", self.job_store)
            what = f"rank {self.rank}'s hang watchdog"
            self.watchdog = Worker(self._watch, name="meshforge-hang-watchdog", what=what)
            self.watchdog.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop.set()
        if self.store is not None and is_collective_failure(exc):
            assert exc is not None
            with contextlib.suppress(Exception):  # the store is gone: report as a hang
                self._leave_if_stopped()  # the peer it waited for ended the job with its own line: not a hang
            reason = f"rank {self.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._report(reason, "".join(traceback.format_exception(exc)))
        if self.watchdog is not None:  # one poll, or a report in progress (which ends the process)
            bound = POLL_SECONDS + 2 * PEER_GRACE_SECONDS
            if exc is None:  # its failure (a dead watchdog diagnosed nothing) as one line; never hides the loop's
                self.watchdog.finish(bound)
            else:
                self.watchdog.join(bound)

    def _watch(self) -> None:
        assert self.store is not None
        while not self.stop.wait(POLL_SECONDS):
            try:
                self._leave_if_stopped()
                if not self.store.check(["flag"]):
                    continue
                reason = self.store.get("flag").decode()
            except Exception:  # the store is gone: the job is ending anyway
                return
            self._report(reason, None)

    def _leave_if_stopped(self) -> None:
        """Another rank reported an error and ends the job (parallel/distributed.py stop_key): leave with its code, no
        message (it printed the one line), counted as reported so that rank 0 stops waiting. Never returns if so."""
        from meshforge.parallel.distributed import stop_key

        assert self.job_store is not None
        if not self.job_store.check([stop_key()]):
            return
        code = int(self.job_store.get(stop_key()).decode())
        self.job_store.add("meshforge/reports", 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _report(self, reason: str, failure: str | None) -> None:
        """Write this rank's file, flag the others, wait for theirs, exit. Never returns."""
        if not self.lock.acquire(timeout=PEER_GRACE_SECONDS * 2):
            os._exit(HANG_EXIT_CODE)
        origin = self._raise_flag(reason) if failure is not None else reason
        path = self.write(origin, failure)
        written = self._wait_for_peers()
        if self.rank == 0 or failure is not None:
            self._announce(origin, path, written)
        self._leave_after_rank_0()

    def _announce(self, origin: str, path: Path, written: set[int] | None) -> None:
        """The one line that says what happened and where to look."""
        if written is None:
            wrote = "the other ranks could not be asked: the store is gone"
        else:
            missing = sorted(set(range(self.world_size)) - written)
            wrote = f"{len(written)} of {self.world_size} ranks wrote theirs"
            wrote += f"; none from ranks {missing} (crashed or unresponsive: see their logs)" if missing else ""
        print(
            f"meshforge: collective failure ({origin}). What each rank was waiting for (its recent collectives "
            f"and the Python stack of every thread): {path.parent}/rank_<R>.txt ({wrote}). Exiting with "
            f"{HANG_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )

    def _leave_after_rank_0(self) -> None:
        """Exit; other ranks first wait (bounded) for rank 0 to have printed, since a launcher such as torchrun stops
        every rank as soon as one exits. Never returns."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            assert self.store is not None
            if self.rank == 0:
                self.store.set("announced", "1")
            deadline = time.monotonic() + PEER_GRACE_SECONDS / 4
            while self.rank != 0 and time.monotonic() < deadline and not self.store.check(["announced"]):
                time.sleep(POLL_SECONDS / 4)
        except Exception:  # rank 0 hosted the store and is gone: it has printed
            pass
        os._exit(HANG_EXIT_CODE)

    def _raise_flag(self, reason: str) -> str:
        """Publish this failure unless another rank did first; returns the reason every rank reports."""
        try:
            assert self.store is not None
            return self.store.compare_set("flag", "", reason).decode()
        except Exception:
            return reason

    def write(self, origin: str, failure: str | None) -> Path:
        """This rank's report: ``<dump_folder>/hang/rank_R.txt``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank_{self.rank}.txt"
        try:
            raw = flight_recorder_dump()
            collectives = recent_collectives(raw)
            self._save_raw(raw)
        except Exception as exc:  # a report without them beats no report
            collectives = [f"(flight recorder unreadable: {exc})"]
        lines = [
            f"meshforge hang report: rank {self.rank} of {self.world_size}, host {socket.gethostname()}, "
            f"pid {os.getpid()}, {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"reason: collective failure reported by {origin}",
            f"this rank: {self.status()}; "
            + ("its collective failed (traceback below)" if failure else "its own collectives had not failed"),
            "",
            "== recent collectives (flight recorder, newest last; the last on a group is what it waited for) ==",
            *collectives,
            "",
            *(["== the failed collective ==", failure.rstrip(), ""] if failure else []),
            "== Python threads ==",
            *thread_stacks(skip=threading.get_ident() if failure is None else None),
            "",
        ]
        path.write_text("\n".join(lines))
        return path

    def _save_raw(self, raw: bytes | None) -> None:
        """The whole dump, for torch's cross-rank analyser (docs/observability.md); NCCL's own dump wins."""
        path = self.folder / "flight_recorder" / f"rank_{self.rank}"
        if raw is not None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(with_group_config(raw))

    def _wait_for_peers(self) -> set[int] | None:
        """Mark this rank done and wait (bounded) for the others; returns the ranks that wrote (None: unknown)."""
        deadline = time.monotonic() + PEER_GRACE_SECONDS
        try:
            assert self.store is not None
            self.store.set(f"done/{self.rank}", "1")
            count = self.store.add("done_count", 1)
            while count < self.world_size and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS / 2)
                count = self.store.add("done_count", 0)
            if count >= self.world_size:
                return set(range(self.world_size))
            return {r for r in range(self.world_size) if self.store.check([f"done/{r}"])}
        except Exception:  # the store went away (its host exited): the others' state is unknown
            return None
