"""Integrity of a prepared dataset: the cheap check every open runs, the full one (`meshforge data verify DIR`,
``data.verify = "full"``) that also compares every shard's sha256 with the manifest and every ``.idx`` with its
``.bin``.

The cheap check reads no token: per shard a stat of the ``.bin`` and, of the ``.idx``, its .npy header, its size
and its first and last offsets (16 bytes), so 20,000 shards open in about a second.
"""

from __future__ import annotations

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
