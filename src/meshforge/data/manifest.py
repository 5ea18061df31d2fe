"""The manifest of a prepared dataset (data/shards.py has the folder's layout): its format, its name, reading it and
the sha256 of the files it names. What the reader (shards.PreparedSplit), the verifier (data/integrity.py), the
preparation and the corpus cache share; writing it stays with the writer (shards.write_manifest), next to the
journal that makes it atomic."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from meshforge.errors import ConfigError

FORMAT = "meshforge-shards-v1"
MANIFEST = "manifest.json"
VERIFY_HINT = "run `meshforge data verify {folder}` for every bad file, then prepare it again"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a prepared dataset; a one-line ConfigError naming the file and the fix when there is none, it
    is not JSON, or its shape is not a manifest's."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ConfigError(
            f"{str(folder)!r} is not a prepared dataset (no {MANIFEST}; an interrupted preparation leaves none): "
            "run `meshforge data prepare INPUT... --out DIR` first"
        )
    try:
        manifest: Any = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{str(path)!r} is not JSON ({error}): prepare the dataset again") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{str(path)!r} holds a {type(manifest).__name__}, not a manifest object: prepare it again")
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{str(path)!r} has format {manifest.get('format')!r}, expected {FORMAT!r}: prepare it again")
    problem = shape_problem(manifest)
    if problem:
        raise ConfigError(f"{str(path)!r} is not a valid manifest: {problem}; prepare the dataset again")
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shape_problem(manifest: dict[str, Any]) -> str | None:
    """What of a manifest's shape the reader would trip on (None when sound): the dtype, the tokenizer's fingerprint,
    each split's counts and each shard's name (a file of the folder), counts and sha256."""
    if manifest.get("dtype") not in ("uint16", "uint32"):
        return f"dtype = {manifest.get('dtype')!r} (expected 'uint16' or 'uint32')"
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("fingerprint"), str):
        return f"tokenizer = {tokenizer!r} (expected an object with a string fingerprint)"
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        return f"splits = {splits!r} (expected an object of splits)"
    for split, info in splits.items():
        if not isinstance(info, dict) or not isinstance(info.get("shards"), list):
            return f"splits.{split} = {str(info)[:80]} (expected an object with a shards list)"
        for key in ("tokens", "documents"):
            if not _count(info.get(key)):
                return f"splits.{split}.{key} = {info.get(key)!r} (expected an integer >= 0)"
        for i, shard in enumerate(info["shards"]):
            where = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                return f"{where} = {shard!r} (expected an object)"
            name = shard.get("name")
            if not isinstance(name, str) or not name.endswith(".bin") or "/" in name or "\\" in name or name[0] == ".":
                return f"{where}.name = {name!r} (expected a .bin file name in the dataset's folder)"
            for key in ("tokens", "documents"):
                if not _count(shard.get(key)):
                    return f"{where}.{key} = {shard.get(key)!r} (expected an integer >= 0)"
            digest = shard.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
                return f"{where}.sha256 = {digest!r} (expected 64 hex digits)"
    return None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read 1 MiB at a time."""
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(f: BinaryIO) -> str:
    """sha256 of the rest of an open binary file, read 1 MiB at a time."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()
