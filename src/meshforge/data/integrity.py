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

from meshforge.data.manifest import MANIFEST, VERIFY_HINT, file_sha256, read_manifest
from meshforge.errors import ConfigError


def idx_path(folder: Path, name: str) -> Path:
    """The ``.idx`` file of shard ``name`` (a ``.bin``)."""
    return folder / name.replace(".bin", ".idx")


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
    except (OSError, ValueError) as error:
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
    if file_sha256(bin_file) != shard["sha256"]:
        return f"{bin_file} has another sha256 than the manifest's (its bytes changed)"
    offsets = np.load(idx_path(folder, shard["name"]))
    if len(offsets) > 1 and not bool(np.all(np.diff(offsets) > 0)):
        return f"{idx_path(folder, shard['name'])} has offsets that do not increase"
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


def check_bytes(folder: Path, shard: dict[str, Any]) -> str | None:
    """What the cheap check leaves to the full one: the ``.bin``'s sha256 and the ``.idx`` offsets increasing."""
    bin_file = folder / shard["name"]
    try:
        if file_sha256(bin_file) != shard["sha256"]:
            return f"{bin_file} has another sha256 than the manifest's (its bytes changed)"
        offsets = np.load(idx_path(folder, shard["name"]), mmap_mode="r")
    except (OSError, ValueError) as error:  # removed or damaged since the check at open
        return f"{bin_file} cannot be read ({error})"
    if len(offsets) > 1 and not bool(np.all(np.diff(offsets) > 0)):
        return f"{idx_path(folder, shard['name'])} has offsets that do not increase"
    return None


class ShardChecker:
    """Each shard's sha256 checked on reader threads, off the step's path: they start when the split opens and hash
    every shard, those the run asks for first (`wait`); `wait(i)`, called when the run first opens shard i, returns at
    once when the threads are past it (start-up usually takes longer than hashing: docs/benchmarks/data-integrity.md)
    and raises a one-line ConfigError naming the file when its bytes changed, before any of them is read. Threads:
    half the cores, 1 to 4 (sha256 releases the GIL; each hashes about 1 GB/s)."""

    def __init__(self, folder: Path, entries: list[dict[str, Any]]) -> None:
        self.folder, self.entries = folder, entries
        self.results: dict[int, str | None] = {}
        self.wanted: list[int] = []
        self.busy: set[int] = set()
        self.cursor = 0
        self.pid = os.getpid()
        self.done = threading.Condition()
        workers = min(4, max(1, (os.cpu_count() or 2) // 2), max(1, len(entries)))
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
                if self.cursor == len(self.entries):
                    return None
                i = self.cursor
            self.busy.add(i)
            return i

    def _run(self) -> None:
        while (i := self._next()) is not None:
            problem = check_bytes(self.folder, self.entries[i])
            with self.done:
                self.results[i] = problem
                self.busy.discard(i)
                self.done.notify_all()

    def want(self, shards: list[int]) -> None:
        """Hash these shards next, after those a read waits for (the loader's look-ahead: its next batches')."""
        with self.done:
            self.wanted += [i for i in shards if i not in self.results and i not in self.busy]

    def wait(self, i: int) -> None:
        """Return when shard i's bytes are checked; ConfigError (one line) when they are damaged."""
        if os.getpid() != self.pid:  # a forked child has no reader thread (nor a usable lock): check here
            if i not in self.results:
                self.results[i] = check_bytes(self.folder, self.entries[i])
            problem = self.results[i]
        else:
            with self.done:
                if i not in self.results:
                    self.wanted.insert(0, i)  # a read waits: before any look-ahead
                    self.done.wait_for(lambda: i in self.results)
                problem = self.results[i]
        if problem:
            hint = VERIFY_HINT.format(folder=self.folder)
            raise ConfigError(f"prepared dataset {str(self.folder)!r} is damaged: {problem}; {hint}")
