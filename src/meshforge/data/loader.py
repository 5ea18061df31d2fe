"""Pre-training data: tokenize documents, pack them into one token stream, and serve data-parallel batches.

Packing is concat-then-split: each document becomes ``bos + tokens + eos``, all documents are concatenated into one
int32 array, and sample ``i`` is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs = the first
``seq_len`` tokens, labels = the same window shifted by one). Samples are visited in a per-epoch order that depends on
(seed, epoch) only. The loader's state is the *global* position in that order, so the batches of N data-parallel
ranks with local batch b are, call for call, exactly the batches of one rank with local batch N*b, and a checkpoint
taken under one data-parallel degree resumes under another without repeating or skipping a sample.

Tokenized corpora are cached under ``$MESHFORGE_CACHE/tokens`` (default ``~/.cache/meshforge/tokens``), keyed by the
tokenizer and the corpus contents.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from meshforge.data.fingerprint import cached_digest
from meshforge.errors import ConfigError
from meshforge.paths import REPO_ROOT, cache_root

if TYPE_CHECKING:
    from meshforge.config.schema import Training

logger = logging.getLogger(__name__)

AUSTEN_DIR = REPO_ROOT / "data" / "austen"
TEXT_SUFFIXES = (".txt", ".txt.gz")
VAL_FRACTION = 0.05
"""Share of the tokens held out for validation when a text corpus has no val/ folder."""
STREAM_MAX_TOKENS = 1 << 24
"""Tokens read from a streamed hub dataset (per split)."""
CACHE_FORMAT = "meshforge-tokens-v1"


class TokenizerLike(Protocol):
    """What packing needs from a tokenizer (`meshforge.data.tokenizer.Tokenizer` has it)."""

    bos_id: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


# ---------------------------------------------------------------------------------------------------------------------
# Corpus -> token array
# ---------------------------------------------------------------------------------------------------------------------


def pack_documents(documents: Iterable[list[int]], bos_id: int, eos_id: int) -> np.ndarray:
    """Concatenate ``bos + doc + eos`` for every document into one int32 array."""
    pieces = [np.asarray([bos_id, *doc, eos_id], dtype=np.int32) for doc in documents]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def cache_dir() -> Path:
    """Folder of cached token arrays: ``$MESHFORGE_CACHE/tokens`` or ``~/.cache/meshforge/tokens``."""
    return cache_root() / "tokens"


def cached_tokens(key_parts: list[str], tokenizer: TokenizerLike, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The array ``build()`` returns, cached on disk under a hash of key_parts and the tokenizer's fingerprint.

    A tokenizer without a ``fingerprint`` attribute is never cached. Writes go to a temporary file and are renamed
    into place, so ranks that start together never read a partial file.
    """
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if not fingerprint:
        return build()
    key = hashlib.sha256("\0".join([CACHE_FORMAT, fingerprint, *key_parts]).encode()).hexdigest()
    path = cache_dir() / f"{key}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable token cache %s (%s)", path, error)
    tokens = build()
    _atomic_save(path, tokens)
    return tokens


def _atomic_save(path: Path, array: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp", delete=False) as f:
            np.save(f, array)
        os.chmod(f.name, 0o644)
        os.replace(f.name, path)
    except OSError as error:
        logger.warning("could not write the token cache %s (%s); continuing without it", path, error)


def read_text(path: Path) -> str:
    """A .txt or .txt.gz file as text (UTF-8; undecodable bytes become U+FFFD)."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def text_files(folder: Path) -> list[Path]:
    """The *.txt and *.txt.gz files directly inside folder, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(TEXT_SUFFIXES))


def split_files(root: Path, split: str) -> tuple[list[Path], str]:
    """The files of a split of a text corpus, and how to cut their tokens: 'all', 'head' or 'tail'.

    A folder with a non-empty ``val/`` subfolder: train = its top-level files, val = the files in ``val/``. Any other
    folder or a single file: both splits read the same files; train takes the first 95% of the tokens, val the rest.
    """
    if root.is_file():
        return [root], "head" if split == "train" else "tail"
    if not root.is_dir():
        raise ConfigError(f"text dataset path {str(root)!r} is neither a file nor a folder: set training.dataset_path")
    val_dir = root / "val"
    val_files = text_files(val_dir) if val_dir.is_dir() else []
    files = text_files(root)
    if val_files:
        return (files, "all") if split == "train" else (val_files, "all")
    if not files:
        raise ConfigError(f"no *.txt or *.txt.gz files in {str(root)!r}: set training.dataset_path")
    return files, "head" if split == "train" else "tail"


def cut(tokens: np.ndarray, part: str) -> np.ndarray:
    """All tokens, the first (1 - VAL_FRACTION) of them ('head') or the rest ('tail')."""
    if part == "all":
        return tokens
    boundary = len(tokens) - max(1, int(len(tokens) * VAL_FRACTION))
    return tokens[:boundary] if part == "head" else tokens[boundary:]


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_text_corpus(root: Path, tokenizer: TokenizerLike, split: str) -> np.ndarray:
    """Tokens of a split of a local text corpus (one document per file), cached."""
    files, part = split_files(root, split)
    key = [f"{path.name}:{cached_digest(path, file_digest)}" for path in files]  # hashed once per file version

    def build() -> np.ndarray:
        logger.info("tokenizing %d file(s) from %s", len(files), root)
        documents = tokenizer.encode_batch([read_text(path) for path in files])
        return pack_documents(documents, tokenizer.bos_id, tokenizer.eos_id)

    return cut(cached_tokens(key, tokenizer, build), part)


def load_hub_corpus(name: str, dataset_path: str, tokenizer: TokenizerLike, split: str) -> np.ndarray:
    """The first STREAM_MAX_TOKENS tokens of a streamed hub dataset ('c4' or a repo id; network), cached."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"dataset {name!r} needs the `datasets` package: pip install -e '.[hub]' (or use dataset = 'austen'/'text')"
        ) from None
    repo, config = ("allenai/c4", "en") if name == "c4" else (name, None)
    source = dataset_path or repo
    hub_split = "train" if split == "train" else "validation"

    def build() -> np.ndarray:
        try:
            stream = datasets.load_dataset(source, config, split=hub_split, streaming=True)
        except Exception as error:
            raise ConfigError(f"could not open dataset {source!r} split {hub_split!r}: {error}") from None
        return pack_documents(_stream_documents(stream, tokenizer), tokenizer.bos_id, tokenizer.eos_id)

    return cached_tokens([f"hub:{source}:{config}:{hub_split}:{STREAM_MAX_TOKENS}"], tokenizer, build)


def _stream_documents(stream: Iterable[dict[str, object]], tokenizer: TokenizerLike) -> list[list[int]]:
    """Token lists of the stream's 'text' fields, read 256 at a time until STREAM_MAX_TOKENS are collected."""
    documents: list[list[int]] = []
    total, batch = 0, []
    for row in stream:
        if "text" not in row:
            raise ConfigError(f"dataset rows have no 'text' field (fields: {sorted(row)})")
        batch.append(str(row["text"]))
        if len(batch) == 256:
            documents += tokenizer.encode_batch(batch)
            total, batch = sum(len(d) + 2 for d in documents), []
            if total >= STREAM_MAX_TOKENS:
                return documents
    return documents + (tokenizer.encode_batch(batch) if batch else [])


def load_tokens(dataset: str, dataset_path: str, tokenizer: TokenizerLike, split: str = "train") -> np.ndarray:
    """The packed int32 token array of a dataset split ('train' or 'val').

    dataset: ``austen`` (shipped: data/austen, or dataset_path), ``text`` (dataset_path: a .txt/.txt.gz file or a
    folder of them, see `split_files`), ``c4`` or ``hf:<name>`` (streamed with `datasets`; needs network, or
    dataset_path pointing at a local copy).
    """
    split = {"validation": "val"}.get(split, split)
    if split not in ("train", "val"):
        raise ConfigError(f"unknown split {split!r}: use 'train' or 'val'")
    if dataset == "austen":
        root = _resolve(dataset_path) if dataset_path else AUSTEN_DIR
        return load_text_corpus(root, tokenizer, split)
    if dataset == "text":
        if not dataset_path:
            raise ConfigError("dataset 'text' needs training.dataset_path (a .txt/.txt.gz file or a folder)")
        return load_text_corpus(_resolve(dataset_path), tokenizer, split)
    if dataset == "c4" or dataset.startswith("hf:"):
        return load_hub_corpus(dataset.removeprefix("hf:"), dataset_path, tokenizer, split)
    raise ConfigError(f"unknown training.dataset {dataset!r}: use austen, text, c4 or hf:<name>")


def _resolve(path: str) -> Path:
    """path from the CWD, else from the repository root."""
    candidate = Path(path).expanduser()
    if candidate.exists() or candidate.is_absolute() or not (REPO_ROOT / candidate).exists():
        return candidate
    return REPO_ROOT / candidate


# ---------------------------------------------------------------------------------------------------------------------
# Token array -> batches
# ---------------------------------------------------------------------------------------------------------------------


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The sample order of an epoch: a permutation drawn from (seed, epoch) only, or the identity without shuffle.

    Uses the raw PCG64 stream (stable across NumPy versions) and a stable argsort, so the order never changes.
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    seed_sequence = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, epoch])
    keys = np.random.PCG64(seed_sequence).random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64)


class PackedDataLoader:
    """Batches of packed samples for one data-parallel rank, in a globally consistent order.

    On its k-th `next_batch` call, rank r of N with local batch b returns the samples at global positions
    ``[g + r*b, g + (r+1)*b)`` with ``g = k*N*b`` (positions continue across epochs; epoch e = position // num_samples
    uses `epoch_order`). The state (`state_dict`) is that global position, identical on every rank.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if seq_len < 1 or local_batch_size < 1 or dp_degree < 1:
            raise ValueError(
                f"seq_len={seq_len}, local_batch_size={local_batch_size}, dp_degree={dp_degree} must be >= 1"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        if tokens.ndim != 1 or len(tokens) < seq_len + 1:
            raise ConfigError(
                f"the dataset has {len(tokens)} tokens, fewer than one sample needs (seq_len + 1 = {seq_len + 1}): "
                "lower training.seq_len or use more data"
            )
        self.tokens = tokens
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle = seed, shuffle
        self.num_samples = (len(tokens) - 1) // seq_len
        self.global_position = 0
        self._orders: dict[int, np.ndarray] = {}
        self._last_ids = np.zeros(0, dtype=np.int64)
        self._last_positions = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be consumed globally."""
        return self.global_position // self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def _ids_at(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.num_samples)
        return np.array([self._order(int(e))[o] for e, o in zip(epochs, offsets, strict=True)], dtype=np.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, labels), int64 tensors of shape (local_batch_size, seq_len)."""
        b = self.local_batch_size
        start = self.global_position + self.dp_rank * b
        positions = np.arange(start, start + b, dtype=np.int64)
        ids = self._ids_at(positions)
        windows = np.asarray(self.tokens[ids[:, None] * self.seq_len + np.arange(self.seq_len + 1)], dtype=np.int64)
        self._last_ids, self._last_positions = ids, positions
        self.global_position += self.dp_degree * b
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())

    def sample_ids(self) -> list[int]:
        """Sample indices (sample i = token window starting at i*seq_len) of the last batch, in batch order."""
        return [int(i) for i in self._last_ids]

    def sample_positions(self) -> list[int]:
        """Global positions (samples consumed globally before each one, across epochs) of the last batch."""
        return [int(p) for p in self._last_positions]

    def state_dict(self) -> dict[str, int]:
        """The global position plus what must match on reload (identical on every data-parallel rank)."""
        return {
            "global_position": self.global_position,
            "epoch": self.epoch,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved global position; any data-parallel degree or local batch size may load it."""
        expected = {"num_samples": self.num_samples, "seq_len": self.seq_len, "seed": self.seed}
        expected["shuffle"] = int(self.shuffle)
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed or "global_position" not in state:
            detail = ", ".join(f"{k}: saved {old} now {new}" for k, (old, new) in changed.items()) or "no position"
            raise ConfigError(
                f"data loader state does not match this dataset/config ({detail}); the order would differ"
            )
        self.global_position = int(state["global_position"])


def build_dataloader(
    cfg: Training, tokenizer: TokenizerLike, *, dp_rank: int, dp_degree: int, split: str = "train"
) -> PackedDataLoader:
    """The loader of a data-parallel rank for cfg's dataset; the train split is shuffled, the val split is not."""
    tokens = load_tokens(cfg.dataset, cfg.dataset_path, tokenizer, split)
    return PackedDataLoader(
        tokens,
        seq_len=cfg.seq_len,
        local_batch_size=cfg.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=cfg.seed,
        shuffle=split == "train",
    )
