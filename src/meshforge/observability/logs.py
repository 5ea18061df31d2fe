"""Per-rank output: which ranks print to the console (``job.log_rank``), and a log file per rank
(``job.log_to_files``: ``<dump_folder>/logs/rank_R.log``).

Inside ``rank_logging`` a rank outside ``job.log_rank`` prints nothing to the console on stdout; stderr (warnings,
errors, tracebacks) always reaches the console, so a failure on any rank stays visible. When several ranks print, each
console line starts with ``[rank R]``. With ``log_to_files`` each rank's stdout and stderr also go, unprefixed and
complete, to its own file. Output written by C++ straight to the file descriptors (NCCL, gloo, kineto) bypasses both.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from meshforge.config.schema import Job
from meshforge.observability.metrics import logging_ranks


class RankStream(io.TextIOBase):
    """A text stream that writes to the console (optionally prefixing each line) and/or a file."""

    def __init__(self, console: TextIO | None, file: TextIO | None, prefix: str) -> None:
        super().__init__()
        self.console, self.file, self.prefix = console, file, prefix
        self.at_line_start = True

    def write(self, text: str) -> int:
        if self.console is not None:
            self.console.write(self._prefixed(text) if self.prefix else text)
        if self.file is not None:
            self.file.write(text)
        return len(text)

    def _prefixed(self, text: str) -> str:
        out = []
        for line in text.splitlines(keepends=True):
            out.append(self.prefix + line if self.at_line_start else line)
            self.at_line_start = line.endswith("\n")
        return "".join(out)

    def flush(self) -> None:
        for stream in (self.console, self.file):
            if stream is not None:
                stream.flush()

    def isatty(self) -> bool:  # not with a log file: a live progress bar would fill it with redraws
        return self.console is not None and self.file is None and self.console.isatty()

    def fileno(self) -> int:  # faulthandler and subprocesses need a real descriptor
        if self.console is None:
            raise io.UnsupportedOperation("this rank does not print to the console")
        return self.console.fileno()

    def writable(self) -> bool:
        return True


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them for this process; (0, 1) without it. Known before the process group
    exists, so a rank's log file covers start-up too."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def log_file_path(dump_folder: str, rank: int) -> Path:
    return Path(dump_folder) / "logs" / f"rank_{rank}.log"


@contextlib.contextmanager
def rank_logging(job: Job, rank: int, world_size: int) -> Iterator[bool]:
    """Route this rank's stdout/stderr for the duration; yields whether this rank prints to the console."""
    console_ranks = logging_ranks(job.log_rank, world_size)
    console = rank in console_ranks
    prefix = f"[rank {rank}] " if len(console_ranks & set(range(world_size))) > 1 else ""
    file: TextIO | None = None
    if job.log_to_files:
        path = log_file_path(job.dump_folder, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path.open("a", buffering=1)  # line-buffered: a crash loses at most a partial line
        file.write(f"=== meshforge rank {rank} of {world_size}, {datetime.datetime.now().isoformat()} ===\n")
    saved = sys.stdout, sys.stderr
    sys.stdout = RankStream(saved[0] if console else None, file, prefix)
    sys.stderr = RankStream(saved[1], file, prefix)
    try:
        yield console
    except BaseException:
        if file is not None:  # the caller reports it on the console once the streams are restored
            file.write(traceback.format_exc())
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
        if file is not None:
            file.close()
