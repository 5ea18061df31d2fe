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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.errors import ConfigError

FORMAT = "meshforge-shards-v1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
SHARD_SUFFIXES = (".bin", ".idx", ".tmp")


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
            self._file = open(self._path(".bin.tmp"), "wb")  # noqa: SIM115 (closed in _flush)
            self._digest, self._offsets, self._tokens = hashlib.sha256(), [], 0
        data = np.ascontiguousarray(document, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._digest.update(data)
        self._offsets.append(self._tokens)
        self._tokens += len(document)

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; returns every shard's manifest entry."""
        if self._file is not None:
            self._flush()
        return self.shards

    def _path(self, suffix: str) -> Path:
        return self.folder / f"{self.split}-{len(self.shards):05d}{suffix}"

    def _flush(self) -> None:
        self._file.close()
        bin_path, idx_path = self._path(".bin"), self._path(".idx")
        offsets = np.asarray([*self._offsets, self._tokens], dtype=np.int64)
        with open(self._path(".idx.tmp"), "wb") as f:
            np.save(f, offsets)
        os.replace(self._path(".idx.tmp"), idx_path)
        os.replace(self._path(".bin.tmp"), bin_path)
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


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete shard files and temporaries of an unfinished preparation (a folder with no manifest); returns them."""
    removed = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.is_file() and path.name.startswith(SPLITS) and path.name.endswith(SHARD_SUFFIXES):
            path.unlink()
            removed.append(path)
    return removed


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json atomically (temporary file, fsync, rename)."""
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".manifest.", suffix=".tmp", delete=False) as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(f.name, 0o644)
    os.replace(f.name, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a prepared dataset; ValueError naming the folder and the fix when there is none."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"{str(folder)!r} is not a prepared dataset (no {MANIFEST}; an interrupted preparation leaves none): "
            "run `meshforge data prepare INPUT... --out DIR` first"
        )
    manifest: dict[str, Any] = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} has format {manifest.get('format')!r}, expected {FORMAT!r}: prepare it again")
    return manifest


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class PreparedSplit:
    """One split of a prepared dataset as a single virtual token stream, memory-mapped shard by shard.

    Nothing is read at open time beyond the manifest and file sizes; `read` touches only the pages of the windows
    asked for, so resident memory does not grow with the corpus.
    """

    def __init__(self, folder: Path, split: str = "train") -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if split not in self.manifest["splits"]:
            raise ConfigError(f"prepared dataset {str(folder)!r} has no {split!r} split")
        info = self.manifest["splits"][split]
        self.split, self.dtype = split, np.dtype(self.manifest["dtype"])
        self.num_tokens, self.num_documents = int(info["tokens"]), int(info["documents"])
        self.shard_names = [shard["name"] for shard in info["shards"]]
        sizes = [int(shard["tokens"]) for shard in info["shards"]]
        for name, tokens in zip(self.shard_names, sizes, strict=True):
            actual = (self.folder / name).stat().st_size if (self.folder / name).is_file() else -1
            if actual != tokens * self.dtype.itemsize:
                raise ConfigError(
                    f"shard {name} of {str(folder)!r} has {actual} bytes, the manifest says "
                    f"{tokens * self.dtype.itemsize}: the folder is damaged, prepare it again"
                )
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}
        self._index: dict[int, np.ndarray] = {}

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the tokenizer the shards were made with."""
        return str(self.manifest["tokenizer"]["fingerprint"])

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            path = self.folder / self.shard_names[i]
            self._maps[i] = np.memmap(path, dtype=self.dtype, mode="r")
        return self._maps[i]

    def _offsets(self, i: int) -> np.ndarray:
        if i not in self._index:
            self._index[i] = np.load(self.folder / self.shard_names[i].replace(".bin", ".idx"), mmap_mode="r")
        return self._index[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream as int64 (crossing shard boundaries as needed)."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        pieces, position, end = [], start, start + length
        while position < end:
            i = int(np.searchsorted(self.starts, position, side="right")) - 1
            stop = min(end, int(self.starts[i + 1]))
            pieces.append(self._shard(i)[position - self.starts[i] : stop - self.starts[i]])
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
            found.append(np.asarray(offsets[lo:hi], dtype=np.int64) + self.starts[i] - start)
            position = stop
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def document(self, d: int) -> np.ndarray:
        """Tokens of document d of the split (bos ... eos)."""
        shard_docs = np.cumsum([0] + [int(s["documents"]) for s in self.manifest["splits"][self.split]["shards"]])
        i = int(np.searchsorted(shard_docs, d, side="right")) - 1
        offsets = self._offsets(i)
        local = d - int(shard_docs[i])
        return np.asarray(self._shard(i)[offsets[local] : offsets[local + 1]], dtype=np.int64)
