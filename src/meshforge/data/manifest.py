"""The manifest of a prepared dataset (data/shards.py has the folder's layout): its format, its name, reading it and
the sha256 of the files it names. What the reader (shards.PreparedSplit), the verifier (data/integrity.py), the
preparation and the corpus cache share; writing it stays with the writer (shards.write_manifest), next to the
journal that makes it atomic."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError

FORMAT = "meshforge-shards-v1"
MANIFEST = "manifest.json"
VERIFY_HINT = "run `meshforge data verify {folder}` for every bad file, then prepare it again"


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
