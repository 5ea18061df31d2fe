"""Prepared token shards on disk: the writer `meshforge data prepare` uses and the memory-mapped reader training uses.

A prepared dataset is a folder::

    manifest.json        written last and atomically: format, tokenizer, dtype, per split its counts and shards
    train-00000.bin      raw tokens (uint16 when the vocabulary fits, else uint32), documents as bos + text + eos
    train-00000.idx      .npy int64 offsets of each document's first token in the shard, plus the shard's length
    val-00000.bin ...    the held-out split, same layout

Shards are written as ``*.tmp`` and renamed when complete; the manifest names only renamed shards with their sizes
and sha256, so a manifest never points at a partial shard. A folder without a manifest is an unfinished preparation.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data.integrity import ShardChecker, check_split
from meshforge.data.manifest import MANIFEST, VERIFY_HINT, read_manifest
from meshforge.data.reader import ShardFiles
from meshforge.errors import ConfigError

SPLITS = ("train", "val")
SHARD_SUFFIXES = (".bin", ".idx", ".tmp")
JOURNAL = ".prepare-written"
"""The files an unfinished preparation wrote, one name a line; a rerun deletes these and nothing else."""
MAX_OPEN_SHARDS = 32


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class ShardWriter:
    """Appends documents of one split to shards of at most ``shard_tokens`` tokens (a document never straddles two)."""

    folder: Path
    split: str
    dtype: np.dtype[Any]
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _file: Any = None
    _digest: Any = None
    _offsets: list[int] = field(default_factory=list)
    _tokens: int = 0

    def add(self, document: np.ndarray) -> None:
        """Append one packed document (bos + tokens + eos)."""
        if self._file is not None and self._tokens + len(document) > self.shard_tokens and self._tokens:
            self._flush()
        if self._file is None:
            record_written(self.folder, [self._path(s).name for s in (".bin.tmp", ".idx.tmp", ".bin", ".idx")])
            self._file = open(self._path(".bin.tmp"), "wb")  # noqa: SIM115 (closed in _flush)
            self._digest, self._offsets, self._tokens = hashlib.sha256(), [], 0
        data = np.ascontiguousarray(document, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._digest.update(data)
        self._offsets.append(self._tokens)
        self._tokens += len(document)
        crash_point()

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; returns every shard's manifest entry."""
        if self._file is not None:
            self._flush()
        return self.shards

    def _path(self, suffix: str) -> Path:
        return self.folder / f"{self.split}-{len(self.shards):05d}{suffix}"

    def _flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        bin_path, idx_path = self._path(".bin"), self._path(".idx")
        offsets = np.asarray([*self._offsets, self._tokens], dtype=np.int64)
        with open(self._path(".idx.tmp"), "wb") as f:
            np.save(f, offsets)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._path(".idx.tmp"), idx_path)
        crash_point()
        os.replace(self._path(".bin.tmp"), bin_path)
        crash_point()
        self.shards.append(
            {
                "name": bin_path.name,
                "tokens": self._tokens,
                "documents": len(self._offsets),
                "bytes": bin_path.stat().st_size,
                "sha256": self._digest.hexdigest(),
            }
        )
        self._file = None


_CRASH_COUNT = [0]


def crash_point() -> None:
    """Test hook: with MESHFORGE_PREPARE_KILL_AFTER=K set, the K-th call SIGKILLs this process (a power cut)."""
    after = os.environ.get("MESHFORGE_PREPARE_KILL_AFTER")
    if after:
        _CRASH_COUNT[0] += 1
        if _CRASH_COUNT[0] == int(after):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


def fsync_folder(folder: Path) -> None:
    """fsync a folder, so the names created or renamed in it survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_written(folder: Path, names: list[str]) -> None:
    """Append names to the journal before the files are created, so a rerun can delete exactly them.

    Not fsynced (a killed process loses no written page): after a power cut a shard whose name the journal lost is
    a file no journal names, and the rerun refuses the folder rather than delete it."""
    journal = folder / JOURNAL
    new = not journal.exists()
    with open(journal, "a") as f:
        f.write("".join(f"{name}\n" for name in names))
    if new:
        fsync_folder(folder)


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the files an unfinished preparation wrote (those its journal names, and the journal); returns them.

    Nothing else is touched: a ``train-00000.bin`` of the user's own that no journal names stays, and preparing
    into that folder is refused (`ShardWriter` would overwrite it)."""
    journal = folder / JOURNAL
    if not journal.is_file():
        return []
    removed = []
    for name in dict.fromkeys(journal.read_text().split()):
        path = folder / name
        if os.sep not in name and path.is_file():
            path.unlink()
            removed.append(path)
    journal.unlink()
    fsync_folder(folder)
    return removed


def foreign_shard_files(folder: Path) -> list[str]:
    """Files in folder with the names of shards or their temporaries (which a preparation would overwrite)."""
    return [
        path.name
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name.startswith(SPLITS) and path.name.endswith(SHARD_SUFFIXES)
    ]


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json atomically (folder fsynced so every shard is durable, temporary file, fsync, rename)."""
    temporary = folder / f".{MANIFEST}.tmp"
    if (folder / JOURNAL).exists():
        record_written(folder, [temporary.name])
    fsync_folder(folder)
    crash_point()
    with open(temporary, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MANIFEST)
    fsync_folder(folder)
    crash_point()
    (folder / JOURNAL).unlink(missing_ok=True)


class PreparedSplit:
    """One split of a prepared dataset as a single virtual token stream, read shard by shard.

    Opening reads the manifest and checks every shard cheaply (`integrity.check_split`: sizes, ``.idx`` headers and
    ends; ``verify="full"`` also every sha256, ``"cheap"`` each sha256 on a reader thread before the shard's first
    read, ``"sizes"`` no sha256); `read` reads only the windows asked for (`reader.ShardFiles`: pread, no maps, so a
    file changed under the job is one line, never SIGBUS) and keeps at most ``max_open_shards`` files and indexes
    open, so resident memory and open files do not grow with the corpus.
    """

    def __init__(
        self, folder: Path, split: str = "train", *, max_open_shards: int = MAX_OPEN_SHARDS, verify: str = "cheap"
    ) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if split not in self.manifest["splits"]:
            raise ConfigError(f"prepared dataset {str(folder)!r} has no {split!r} split")
        info = self.manifest["splits"][split]
        self.split, self.dtype = split, np.dtype(self.manifest["dtype"])
        self.num_tokens, self.num_documents = int(info["tokens"]), int(info["documents"])
        self.shard_names = [shard["name"] for shard in info["shards"]]
        check_split(self.folder, info["shards"], self.dtype, full=verify == "full")
        self._checker = ShardChecker(self.folder, info["shards"]) if verify == "cheap" else None  # sha256 off-path
        sizes = [int(shard["tokens"]) for shard in info["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        if int(self.starts[-1]) != self.num_tokens:  # reads would run past the last shard
            raise ConfigError(
                f"{str(self.folder / MANIFEST)!r}: splits.{split}.tokens = {self.num_tokens} but its shards hold "
                f"{int(self.starts[-1])}; {VERIFY_HINT.format(folder=self.folder)}"
            )
        self._files = ShardFiles(self.folder, info["shards"], self.dtype, max_open_shards, self._checker)

    @property
    def checking(self) -> bool:
        """True while the reader threads have shards left to hash."""
        return self._checker is not None and len(self._checker.results) < len(self.shard_names)

    def want(self, starts: list[int]) -> None:
        """Check the shards holding these token positions next (the loader's look-ahead; nothing without checks)."""
        if self._checker is not None:
            self._checker.want([int(np.searchsorted(self.starts, s, side="right")) - 1 for s in starts])

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the tokenizer the shards were made with."""
        return str(self.manifest["tokenizer"]["fingerprint"])

    def _offsets(self, i: int) -> np.ndarray:
        return self._files.offsets(i)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream as int64 (crossing shard boundaries as needed)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        pieces, position, end = [], start, start + length
        while position < end:
            i = int(np.searchsorted(self.starts, position, side="right")) - 1
            stop = min(end, int(self.starts[i + 1]))
            pieces.append(self._files.tokens(i, int(position - self.starts[i]), int(stop - self.starts[i])))
            position = stop
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)

    def document_starts(self, start: int, length: int) -> np.ndarray:
        """Offsets (from ``start``) of the documents that begin inside tokens [start, start + length)."""
        found, position, end = [], start, start + length
        while position < end:
            i = int(np.searchsorted(self.starts, position, side="right")) - 1
            stop = min(end, int(self.starts[i + 1]))
            offsets = self._offsets(i)
            lo, hi = np.searchsorted(offsets, [position - self.starts[i], stop - self.starts[i]])
            found.append(np.array(offsets[lo:hi], dtype=np.int64) + self.starts[i] - start)
            position = stop
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def document(self, d: int) -> np.ndarray:
        """Tokens of document d of the split (bos ... eos)."""
        shard_docs = np.cumsum([0] + [int(s["documents"]) for s in self.manifest["splits"][self.split]["shards"]])
        i = int(np.searchsorted(shard_docs, d, side="right")) - 1
        offsets = self._offsets(i)
        local = d - int(shard_docs[i])
        return self._files.tokens(i, int(offsets[local]), int(offsets[local + 1])).astype(np.int64)
