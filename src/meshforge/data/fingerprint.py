"""Content digests of corpus files, computed once per file version: every run of a sweep (and every rank) that
reads the same unchanged file reuses the digest instead of hashing the whole file again.

A file version is its resolved path, size and modification time (nanoseconds); a file rewritten in place changes
its mtime and is hashed afresh. The digests live in ``$MESHFORGE_CACHE/digests/`` (one small file per version, written
atomically, so concurrent ranks never see half a digest).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from meshforge.paths import cache_root


def digest_dir() -> Path:
    return cache_root() / "digests"


def version_key(path: Path) -> str:
    """sha256 of (resolved path, size, mtime_ns): names one version of the file."""
    stat = path.stat()
    text = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_digest(path: Path, digest: Callable[[Path], str]) -> str:
    """``digest(path)``, read back from the cache when this version of the file was hashed before."""
    entry = digest_dir() / version_key(path)
    try:
        value = entry.read_text().strip()
        if value:
            return value
    except OSError:
        pass
    value = digest(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".digest-")
        with os.fdopen(fd, "w") as f:
            f.write(value)
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache only costs the hashing next time
    return value
