"""Reads of shard files that a file changed under the job cannot turn into a signal, a traceback or a hang.

A memory map of a file that shrinks under it kills the process with SIGBUS (exit 135, no file named) at the next touch
of a page past the new end, and numpy's ``.npy`` reader raises ``EOFError`` on an emptied file. So the reader maps
nothing: a window of tokens is one ``os.pread`` on an open descriptor (a short read is a shorter file), and an
``.idx`` is read whole and checked (`integrity.read_index`). Each file's identity (inode, size, modification time) is
taken when its bytes are checked (the reader thread's sha256, else its first open) and compared with the open
file's fstat before every read and with its path's stat at most once a second (`PATH_CHECK_S`): a file truncated,
emptied, rewritten in place, replaced (another ``data prepare`` into the folder) or removed since gives the one-line
ConfigError naming it and ``meshforge data verify``. Cost: one fstat per window (docs/benchmarks/data.md). A file
removed or renamed over is still read as it was checked (the open file keeps its bytes) until the next path check.
Not seen: bytes rewritten in place at the same size within the file system's timestamp granularity (a few ms) of
the check.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from meshforge.data.integrity import DAMAGE_ERRORS, Damaged, Identity, ShardChecker, identity, read_index
from meshforge.data.manifest import VERIFY_HINT
from meshforge.errors import ConfigError

V = TypeVar("V")
PATH_CHECK_S = 1.0
"""Seconds between two stats of a shard file's path (a file removed or renamed over); the open file is fstat'ed at
every read (truncated, grown, rewritten in place). A stat costs 10-15 us here, one per window would be 5-10 % of the
loader's time with 2,048-token shards (docs/benchmarks/data.md)."""


class MapCache(Generic[V]):
    """The most recently used ``capacity`` open values (descriptors, indexes) of shard files; opening one more closes
    the oldest (``closer``), so open files and resident memory stay bounded whatever the shard count."""

    def __init__(self, capacity: int, opener: Callable[[int], V], closer: Callable[[V], None] | None = None) -> None:
        self.capacity, self.opener, self.closer = capacity, opener, closer
        self.maps: OrderedDict[int, V] = OrderedDict()

    def get(self, key: int) -> V:
        """The value of shard key, opened (and the least recently used closed) when not open."""
        if key in self.maps:
            self.maps.move_to_end(key)
            return self.maps[key]
        value = self.opener(key)
        self.maps[key] = value
        while len(self.maps) > self.capacity:
            _, old = self.maps.popitem(last=False)
            if self.closer is not None:
                self.closer(old)
        return value

    def drop(self, key: int) -> None:
        """Close shard key's value (it changed under the job)."""
        old = self.maps.pop(key, None)
        if old is not None and self.closer is not None:
            self.closer(old)


class ShardFiles:
    """The ``.bin`` and ``.idx`` files of one split's shards, read without maps (see the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        entries: list[dict[str, Any]],
        dtype: np.dtype[Any],
        capacity: int,
        checker: ShardChecker | None,
    ) -> None:
        self.folder, self.entries, self.dtype, self.checker = folder, entries, dtype, checker
        self.checked: dict[Path, Identity] = {}  # each file's identity when checked (or first opened)
        self.path_checks: dict[Path, float] = {}  # when each path is stat'ed next (time.monotonic)
        self.descriptors: MapCache[tuple[Any, Path, Identity]] = MapCache(capacity, self._open_bin, _close)
        self.indexes: MapCache[tuple[np.ndarray, Path, Identity]] = MapCache(capacity, self._open_idx)

    def path(self, i: int, suffix: str) -> Path:
        """Shard i's ``.bin`` or ``.idx``."""
        return self.folder / self.entries[i]["name"].replace(".bin", suffix)

    def tokens(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of shard i, in the file's dtype."""
        file, path, known = self.descriptors.get(i)
        fd = file.fileno()
        self._unchanged(i, path, known, self.descriptors, fd)
        size = self.dtype.itemsize
        try:
            data = os.pread(fd, (hi - lo) * size, lo * size)
        except OSError as error:
            raise self.damaged(f"{path} cannot be read ({error})") from None
        if len(data) != (hi - lo) * size:  # truncated between the stat and the read
            raise self.damaged(f"{path} ended at byte {lo * size + len(data)}: it was truncated while the job read it")
        return np.frombuffer(data, dtype=self.dtype)

    def offsets(self, i: int) -> np.ndarray:
        """Shard i's document offsets (documents + 1 int64, checked)."""
        offsets, path, known = self.indexes.get(i)
        self._unchanged(i, path, known, self.indexes)
        return offsets

    def damaged(self, problem: str) -> ConfigError:
        """The one line of a damaged shard file."""
        return ConfigError(
            f"prepared dataset {str(self.folder)!r} is damaged: {problem}; {VERIFY_HINT.format(folder=self.folder)}"
        )

    def _reference(self, i: int, path: Path, suffix: str) -> Identity | None:
        """The identity the file had when its bytes were checked (the reader thread's, once it is past shard i)."""
        if self.checker is not None:
            checked = self.checker.wait(i)  # its bytes checked before the first read (at once when past it)
            self.checked.setdefault(path, checked[0 if suffix == ".bin" else 1])
        return self.checked.get(path)

    def _open_bin(self, i: int) -> tuple[Any, Path, Identity]:
        path = self.path(i, ".bin")
        reference = self._reference(i, path, ".bin")
        try:
            file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed on eviction, or with the split)
        except OSError as error:
            raise self.damaged(f"{path} cannot be opened ({_why(error)})") from None
        now = identity(os.fstat(file.fileno()))
        expected = int(self.entries[i]["tokens"]) * self.dtype.itemsize
        if reference is not None and now != reference:
            file.close()
            raise self.damaged(_changed(path, reference, now))
        if now[1] != expected:
            file.close()
            raise self.damaged(f"{path} has {now[1]} bytes, the manifest says {expected}")
        self.checked.setdefault(path, now)
        return file, path, now

    def _open_idx(self, i: int) -> tuple[np.ndarray, Path, Identity]:
        path = self.path(i, ".idx")
        reference = self._reference(i, path, ".idx")
        try:
            offsets, now = read_index(path, int(self.entries[i]["documents"]), int(self.entries[i]["tokens"]))
        except Damaged as damage:
            raise self.damaged(str(damage)) from None
        if reference is not None and now != reference:
            raise self.damaged(_changed(path, reference, now))
        self.checked.setdefault(path, now)
        return offsets, path, now

    def _unchanged(self, i: int, path: Path, known: Identity, cache: MapCache[Any], fd: int | None = None) -> None:
        """A one-line ConfigError when the file is no longer the one that was opened and checked: the open file's
        fstat on every read (truncated, grown, rewritten in place), its path's stat at most every PATH_CHECK_S
        (removed, or replaced by a rename)."""
        try:
            if fd is not None:
                self._same(i, path, known, cache, identity(os.fstat(fd)))
            clock = time.monotonic()
            if clock >= self.path_checks.get(path, 0.0):
                self._same(i, path, known, cache, identity(os.stat(path)))
                self.path_checks[path] = clock + PATH_CHECK_S
        except ConfigError:
            raise
        except DAMAGE_ERRORS as error:
            cache.drop(i)
            raise self.damaged(f"{path} cannot be read ({_why(error)}): removed while the job read it") from None

    def _same(self, i: int, path: Path, known: Identity, cache: MapCache[Any], now: Identity) -> None:
        if now != known:
            cache.drop(i)
            raise self.damaged(_changed(path, known, now))


def _why(error: BaseException) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


def _changed(path: Path, before: Identity, now: Identity) -> str:
    """What changed in a shard file since it was checked, in words."""
    if now[0] != before[0]:
        return f"{path} was replaced by another file since the job checked it"
    if now[1] != before[1]:
        return f"{path} has {now[1]} bytes, {before[1]} when the job checked it (truncated or rewritten under the job)"
    return f"{path} was rewritten in place since the job checked it (same size, new modification time)"


def _close(value: tuple[Any, Path, Identity]) -> None:
    value[0].close()
