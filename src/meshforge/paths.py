"""Where meshforge finds its shipped files and keeps its caches: the one definition of each path."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout meshforge runs from (shipped data, configs); relative paths not found in the working folder are
looked up here."""


def cache_root() -> Path:
    """``$MESHFORGE_CACHE``, else ``~/.cache/meshforge``: token caches, the CPU probe, prepared corpora."""
    return Path(os.environ.get("MESHFORGE_CACHE") or Path.home() / ".cache" / "meshforge")
