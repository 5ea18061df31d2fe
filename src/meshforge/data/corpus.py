"""Which prepared folders a training dataset name means, preparing the built-in and local ones on first use.

``austen`` (the shipped novels; Persuasion, in data/austen/val, is the held-out split) and ``text`` (a local file or
folder) are prepared once into ``<cache_root>/prepared/<key>`` and memory-mapped afterwards; the key is the tokenizer
fingerprint and each file's name, size and modification time (no file is read to check the cache). ``prepared`` is a
folder made by `meshforge data prepare`, or a mixture ``DIR:weight,DIR:weight``. ``c4`` / ``hf:<name>`` stream the
first STREAM_MAX_TOKENS tokens from the hub into the cache (network, once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from meshforge.data.manifest import FORMAT, MANIFEST
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.sources import expand_inputs
from meshforge.data.tokenizer import build_tokenizer
from meshforge.errors import ConfigError
from meshforge.paths import REPO_ROOT, cache_root

AUSTEN_DIR = REPO_ROOT / "data" / "austen"
TEXT_VAL_FRACTION = 0.05
"""Share of the documents of a local text corpus without a val/ folder held out for validation."""
STREAM_MAX_TOKENS = 1 << 24
"""Training tokens prepared from a streamed hub dataset used by name (prepare more with `meshforge data prepare`)."""


def prepared_root() -> Path:
    """``<cache_root>/prepared``: datasets prepared on first use."""
    return cache_root() / "prepared"


def resolve(path: str) -> Path:
    """path from the CWD, else from the repository root."""
    candidate = Path(path).expanduser()
    if candidate.exists() or candidate.is_absolute() or not (REPO_ROOT / candidate).exists():
        return candidate
    return REPO_ROOT / candidate


def parse_mixture(spec: str | list[str]) -> list[tuple[Path, float]]:
    """``DIR:weight,DIR:weight`` (or a list of ``DIR:weight`` / ``DIR``) -> [(folder, weight)]; weight 1 if absent."""
    items = [s for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    out = []
    for item in items:
        folder, sep, weight = item.strip().rpartition(":")
        try:
            out.append((resolve(folder), float(weight)) if sep else (resolve(item.strip()), 1.0))
        except ValueError:
            out.append((resolve(item.strip()), 1.0))  # a ':' inside the path, no weight
    if any(w < 0 for _, w in out) or sum(w for _, w in out) <= 0:
        raise ConfigError(f"mixture weights in {spec!r} must be >= 0 with a positive sum")
    if not out:
        raise ConfigError("training.dataset = 'prepared' needs training.dataset_path (DIR or DIR:weight,DIR:weight)")
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on path (ranks starting together prepare a cache entry once; the others wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_prepared(inputs: list[str], key_parts: list[str], options: PrepareOptions) -> Path:
    """The cache folder holding ``prepare(inputs, options)``, prepared now if absent (atomically: a temporary
    folder renamed into place)."""
    fingerprint = build_tokenizer(options.tokenizer_path).fingerprint
    key = hashlib.sha256("\0".join([FORMAT, fingerprint, repr(options), *key_parts]).encode()).hexdigest()
    folder = prepared_root() / key[:32]
    if (folder / MANIFEST).is_file():
        return folder
    with _locked(prepared_root() / f".{key[:32]}.lock"):
        if not (folder / MANIFEST).is_file():
            temporary = prepared_root() / f".{key[:32]}.tmp-{os.getpid()}"
            shutil.rmtree(temporary, ignore_errors=True)
            print(f"meshforge: preparing {', '.join(inputs)} into {folder} (once)", flush=True)
            prepare(inputs, temporary, options)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(temporary, folder)
    return folder


def local_corpus(root: Path, tokenizer_path: str) -> Path:
    """The prepared cache folder of a local text file or folder (a val/ folder is the held-out split; without one,
    TEXT_VAL_FRACTION of the documents)."""
    if not root.exists():
        raise ConfigError(f"text dataset path {str(root)!r} does not exist: set training.dataset_path")
    files = expand_inputs([str(root)])
    has_val = any(held for _, held in files)
    stats = [f"{name}:{os.stat(name).st_size}:{os.stat(name).st_mtime_ns}" for name, _ in files]
    options = PrepareOptions(tokenizer_path=tokenizer_path, val_fraction=0.0 if has_val else TEXT_VAL_FRACTION)
    return cached_prepared([str(root)], [str(root.resolve()), *stats], options)


def dataset_folders(
    dataset: str, dataset_path: str, mixture: list[str], tokenizer_path: str
) -> list[tuple[Path, float]]:
    """The prepared folders and weights of a training dataset (see the module docstring)."""
    if mixture:
        return parse_mixture(mixture)
    if dataset == "austen":
        return [(local_corpus(resolve(dataset_path) if dataset_path else AUSTEN_DIR, tokenizer_path), 1.0)]
    if dataset == "text":
        if not dataset_path:
            raise ConfigError("dataset 'text' needs training.dataset_path (a .txt/.txt.gz/.jsonl file or a folder)")
        return [(local_corpus(resolve(dataset_path), tokenizer_path), 1.0)]
    if dataset == "prepared":
        return parse_mixture(dataset_path)
    if dataset == "c4" or dataset.startswith("hf:"):
        name = dataset_path or dataset.removeprefix("hf:")
        options = PrepareOptions(tokenizer_path=tokenizer_path, max_tokens=STREAM_MAX_TOKENS)
        return [(cached_prepared([f"hf:{name}"], [f"hub:{name}"], options), 1.0)]
    raise ConfigError(f"unknown training.dataset {dataset!r}: use austen, text, prepared, c4 or hf:<name>")
