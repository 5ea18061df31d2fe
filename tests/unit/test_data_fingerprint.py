"""Corpus files are hashed once per version: unchanged files reuse their digest, changed files are hashed again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshforge.data.fingerprint import cached_digest
from meshforge.data.shards import file_sha256 as file_digest


def test_digest_is_computed_once_per_file_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "a.txt"
    corpus.write_text("It is a truth universally acknowledged")
    calls: list[Path] = []

    def counting(path: Path) -> str:
        calls.append(path)
        return file_digest(path)

    first = cached_digest(corpus, counting)
    assert first == file_digest(corpus) and cached_digest(corpus, counting) == first and len(calls) == 1
    corpus.write_text("It is a truth universally acknowledged, that a single man")
    os.utime(corpus, ns=(1, 2))  # another version even where the clock is coarse
    second = cached_digest(corpus, counting)
    assert second == file_digest(corpus) != first and len(calls) == 2
    assert cached_digest(corpus, counting) == second and len(calls) == 2
