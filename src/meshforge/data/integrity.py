"""Integrity of a prepared dataset: the cheap check every open runs, the full one (`meshforge data verify DIR`,
``data.verify = "full"``) that also compares every shard's sha256 with the manifest and every ``.idx`` with its
``.bin``.

The cheap check reads no token: per shard a stat of the ``.bin`` and, of the ``.idx``, its .npy header, its size
and its first and last offsets (16 bytes), so 20,000 shards open in about a second. Then `ShardChecker` hashes every
shard on a reader thread, each before the run first reads it (``data.verify = "cheap"``, the default): flipped bytes
of the same size are named before they train, off the step's path (docs/benchmarks/data-integrity.md).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.manifest import MANIFEST, VERIFY_HINT, file_sha256, read_manifest, stream_sha256
from meshforge.errors import BackgroundError, ConfigError


def idx_path(folder: Path, name: str) -> Path:
    """The ``.idx`` file of shard ``name`` (a ``.bin``)."""
    return folder / name.replace(".bin", ".idx")


DAMAGE_ERRORS = (OSError, ValueError, EOFError, TypeError, SyntaxError, KeyError, IndexError, OverflowError)
"""What reading a damaged shard file can raise: the OS (removed, unreadable), numpy's .npy reader (``ValueError`` for a
bad magic or header, ``EOFError`` for an emptied file, ``SyntaxError``/``TypeError``/``KeyError`` from a header of
garbage), a short or overflowing read. Caught wherever a shard file is read, on the main path and in the threads."""

Identity = tuple[int, int, int]
"""(inode, size, modification time in ns) of a shard file: what changes when it is replaced, truncated or rewritten."""


def identity(status: os.stat_result) -> Identity:
    """The identity of a file from its stat."""
    return (status.st_ino, status.st_size, status.st_mtime_ns)


class Damaged(Exception):
    """A shard file is not what the manifest says; the message names the file and what is wrong."""


def read_index(path: Path, documents: int, tokens: int) -> tuple[np.ndarray, Identity]:
    """A shard's ``.idx`` read whole and checked (.npy int64 vector of documents + 1 increasing offsets from 0 to
    tokens), with the identity of the file it read; `Damaged` naming the file when it is not such an index."""
    try:
        with open(path, "rb") as f:
            before = identity(os.fstat(f.fileno()))
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, idx_dtype = read_header(f)
            if shape != (documents + 1,) or fortran or np.dtype(idx_dtype) != np.dtype("<i8"):
                raise Damaged(f"{path} holds {idx_dtype}{list(shape)}, expected {documents + 1} int64 offsets")
            data = f.read(8 * (documents + 1) + 1)
    except FileNotFoundError:
        raise Damaged(f"{path} is missing") from None
    except DAMAGE_ERRORS as error:
        raise Damaged(f"{path} is not a shard index ({type(error).__name__}: {error})") from None
    if len(data) != 8 * (documents + 1):
        raise Damaged(f"{path} has {len(data)} bytes of offsets, expected {8 * (documents + 1)}")
    offsets = np.frombuffer(data, dtype="<i8").astype(np.int64)
    if int(offsets[0]) != 0 or int(offsets[-1]) != tokens:
        raise Damaged(
            f"{path} does not match its .bin (first offset {offsets[0]}, last {offsets[-1]}, expected 0 and {tokens})"
        )
    if len(offsets) > 1 and not bool(np.all(np.diff(offsets) > 0)):
        raise Damaged(f"{path} has offsets that do not increase")
    return offsets, before


def check_shard(folder: Path, shard: dict[str, Any], dtype: np.dtype[Any]) -> str | None:
    """The cheap check of one shard: None when sound, else what is wrong (naming the file)."""
    bin_file, idx_file = folder / shard["name"], idx_path(folder, shard["name"])
    tokens, documents = int(shard["tokens"]), int(shard["documents"])
    if not bin_file.is_file():
        return f"{bin_file} is missing"
    if bin_file.stat().st_size != tokens * dtype.itemsize:
        return f"{bin_file} has {bin_file.stat().st_size} bytes, the manifest says {tokens * dtype.itemsize}"
    if not idx_file.is_file():
        return f"{idx_file} is missing"
    try:
        with open(idx_file, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, idx_dtype = read_header(f)
            header = f.tell()
            first = np.frombuffer(f.read(8), dtype="<i8")
            f.seek(header + 8 * (documents))
            last = np.frombuffer(f.read(8), dtype="<i8")
            size = f.seek(0, 2)
    except DAMAGE_ERRORS as error:
        return f"{idx_file} is not a shard index ({error})"
    if shape != (documents + 1,) or fortran or np.dtype(idx_dtype) != np.dtype("<i8"):
        return f"{idx_file} holds {idx_dtype}{list(shape)}, expected {documents + 1} int64 offsets"
    if size != header + 8 * (documents + 1) or first.tolist() != [0] or last.tolist() != [tokens]:
        return f"{idx_file} does not match {bin_file.name} (length, first or last offset)"
    return None


def check_full(folder: Path, shard: dict[str, Any], dtype: np.dtype[Any]) -> str | None:
    """The full check of one shard: the cheap one, the sha256 of the ``.bin`` and every ``.idx`` offset."""
    problem = check_shard(folder, shard, dtype)
    if problem:
        return problem
    bin_file = folder / shard["name"]
    try:
        if file_sha256(bin_file) != shard["sha256"]:
            return f"{bin_file} has another sha256 than the manifest's (its bytes changed)"
        read_index(idx_path(folder, shard["name"]), int(shard["documents"]), int(shard["tokens"]))
    except Damaged as damage:
        return str(damage)
    except DAMAGE_ERRORS as error:  # changed since the cheap check
        return f"{bin_file} cannot be read ({type(error).__name__}: {error})"
    return None


def check_split(folder: Path, entries: list[dict[str, Any]], dtype: np.dtype[Any], *, full: bool = False) -> None:
    """ConfigError (one line naming the first bad file and `meshforge data verify`) unless every shard is sound."""
    check = check_full if full else check_shard
    for shard in entries:
        problem = check(folder, shard, dtype)
        if problem:
            hint = VERIFY_HINT.format(folder=folder)
            raise ConfigError(f"prepared dataset {str(folder)!r} is damaged: {problem}; {hint}")


def verify(folder: Path) -> list[str]:
    """Every problem of a prepared dataset (empty when sound): every shard fully checked, the counts summed."""
    manifest = read_manifest(folder)
    dtype = np.dtype(manifest["dtype"])
    problems = []
    for split, info in manifest["splits"].items():
        for key in ("tokens", "documents"):
            total = sum(int(s[key]) for s in info["shards"])
            if total != int(info[key]):
                problems.append(f"{folder / MANIFEST}: {split} {key} {info[key]} but its shards hold {total}")
        for shard in info["shards"]:
            problem = check_full(folder, shard, dtype)
            if problem:
                problems.append(problem)
    return problems


def check_bytes(folder: Path, shard: dict[str, Any]) -> tuple[str | None, tuple[Identity, Identity] | None]:
    """What the cheap check leaves to the full one: the ``.bin``'s sha256 and every ``.idx`` offset. Returns (the
    problem naming the file, None) or (None, the identities of the ``.bin`` and ``.idx`` that were checked); a file
    that changed while it was hashed is a problem."""
    bin_file = folder / shard["name"]
    try:
        with open(bin_file, "rb") as f:
            before = identity(os.fstat(f.fileno()))
            digest = stream_sha256(f)
            if identity(os.fstat(f.fileno())) != before:
                return f"{bin_file} changed while its sha256 was computed (rewritten under the job)", None
        if digest != shard["sha256"]:
            return f"{bin_file} has another sha256 than the manifest's (its bytes changed)", None
        _, index = read_index(idx_path(folder, shard["name"]), int(shard["documents"]), int(shard["tokens"]))
    except Damaged as damage:
        return str(damage), None
    except FileNotFoundError:
        return f"{bin_file} is missing", None
    except DAMAGE_ERRORS as error:  # removed or damaged since the check at open
        return f"{bin_file} cannot be read ({type(error).__name__}: {error})", None
    return None, (before, index)


WAIT_FLOOR_S = 120.0
"""The least a read waits for its shard's sha256 check before giving up with one line (data/integrity.py)."""
SLOWEST_HASH_BYTES_PER_S = 20e6
"""Hashing slower than this (a stalled file system) ends a wait: the bound grows with the bytes ahead of the shard."""


class ShardChecker:
    """Each shard's sha256 checked on reader threads, off the step's path: they start when the split opens and hash
    every shard, those the run asks for first (`wait`); `wait(i)`, called when the run first opens shard i, returns at
    once when the threads are past it (start-up usually takes longer than hashing: docs/benchmarks/data-integrity.md)
    and raises a one-line ConfigError naming the file when its bytes changed, before any of them is read. Threads:
    half the cores, 1 to 4 (sha256 releases the GIL; each hashes about 1 GB/s).

    Never silent, never unbounded: a thread that dies (a bug: every error of a damaged file is a shard's problem)
    keeps its exception in ``failure`` and every `wait` raises it as one line; a wait longer than
    ``wait_floor_s`` + (the shard's bytes and the largest shard's per thread) / 20 MB/s ends in one line naming the
    shard and what it waited for."""

    def __init__(self, folder: Path, entries: list[dict[str, Any]], *, wait_floor_s: float | None = None) -> None:
        self.folder, self.entries = folder, entries
        self.results: dict[int, str | None] = {}
        self.identities: dict[int, tuple[Identity, Identity]] = {}
        self.failure: BaseException | None = None
        self.failed_on: int | None = None
        self.wanted: list[int] = []
        self.busy: set[int] = set()
        self.cursor = 0
        self.pid = os.getpid()
        self.done = threading.Condition()
        workers = min(4, max(1, (os.cpu_count() or 2) // 2), max(1, len(entries)))
        self.floor_s = WAIT_FLOOR_S if wait_floor_s is None else wait_floor_s
        self.ahead = workers * max((int(e.get("bytes", 0)) for e in entries), default=0)  # the threads' shards
        self.threads = [
            threading.Thread(target=self._run, name="meshforge-shard-check", daemon=True) for _ in range(workers)
        ]
        for thread in self.threads:
            thread.start()

    def _next(self) -> int | None:
        """The next shard to hash (a wanted one first, else the lowest not started), marked busy; None when done."""
        with self.done:
            while self.wanted and (self.wanted[0] in self.results or self.wanted[0] in self.busy):
                self.wanted.pop(0)
            if self.wanted:
                i = self.wanted.pop(0)
            else:
                while self.cursor < len(self.entries) and (self.cursor in self.results or self.cursor in self.busy):
                    self.cursor += 1
                if self.cursor == len(self.entries) or self.failure is not None:
                    return None
                i = self.cursor
            self.busy.add(i)
            return i

    def _run(self) -> None:
        i: int | None = None
        try:
            while (i := self._next()) is not None:
                self._record(i, *check_bytes(self.folder, self.entries[i]))
        except BaseException as error:  # a bug, not a damaged file: kept for every wait, which raises it
            with self.done:
                self.failure, self.failed_on = error, i
                self.done.notify_all()

    def _record(self, i: int, problem: str | None, identities: tuple[Identity, Identity] | None) -> None:
        with self.done:
            self.results[i] = problem
            if identities is not None:
                self.identities[i] = identities
            self.busy.discard(i)
            self.done.notify_all()

    def bound(self, i: int) -> float:
        """Seconds a read waits for shard i's check at most: the floor, and the bytes ahead of it at the slowest
        hashing speed tolerated (its own, and one of the largest shards per thread)."""
        return self.floor_s + (int(self.entries[i].get("bytes", 0)) + self.ahead) / SLOWEST_HASH_BYTES_PER_S

    def want(self, shards: list[int]) -> None:
        """Hash these shards next, after those a read waits for (the loader's look-ahead: its next batches')."""
        with self.done:
            self.wanted += [i for i in shards if i not in self.results and i not in self.busy]

    def wait(self, i: int) -> tuple[Identity, Identity]:
        """Return when shard i's bytes are checked, with the identities of its ``.bin`` and ``.idx`` as checked;
        a one-line ConfigError when they are damaged or the check took longer than its bound, a one-line
        BackgroundError when a reader thread failed."""
        if os.getpid() != self.pid:  # a forked child: no reader thread, and the lock may be held by a lost one
            self.pid, self.done, self.threads = os.getpid(), threading.Condition(), []
            self.busy.clear()
        if not self.threads:  # check here, on the reading thread
            if i not in self.results:
                self._record(i, *check_bytes(self.folder, self.entries[i]))
        else:
            with self.done:
                if i not in self.results and self.failure is None:
                    self.wanted.insert(0, i)  # a read waits: before any look-ahead
                    bound = self.bound(i)
                    if not self.done.wait_for(lambda: i in self.results or self.failure is not None, bound):
                        raise self._stalled(i, bound)
                if i not in self.results and self.failure is not None:
                    where = (
                        "" if self.failed_on is None else f" on {self.folder / self.entries[self.failed_on]['name']}"
                    )
                    raise BackgroundError.of(f"the shard-check thread{where}", self.failure) from self.failure
        problem = self.results[i]
        if problem:
            raise ConfigError(f"prepared dataset {str(self.folder)!r} is damaged: {problem}; {self.hint}")
        return self.identities[i]

    def _stalled(self, i: int, bound: float) -> ConfigError:
        alive = sum(thread.is_alive() for thread in self.threads)
        busy = ", ".join(self.entries[b]["name"] for b in sorted(self.busy)) or "none"
        return ConfigError(
            f"prepared dataset {str(self.folder)!r}: waited {bound:.0f} s for the sha256 check of "
            f"{self.folder / self.entries[i]['name']} before its first read ({alive} of {len(self.threads)} reader "
            f"threads alive, hashing {busy}): the file system stalled or is far slower than "
            f"{SLOWEST_HASH_BYTES_PER_S / 1e6:.0f} MB/s; check it, or skip the check with --data.verify sizes"
        )

    @property
    def hint(self) -> str:
        return VERIFY_HINT.format(folder=self.folder)
