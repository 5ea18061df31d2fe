"""Pre-training batches: packed samples of one or several token streams, in a global order that reshards.

Packing is concat-then-split: every document is ``bos + tokens + eos`` in one token stream (a prepared dataset's
shards read by window, `shards.PreparedSplit`, or an in-memory array), and sample ``i`` of a stream is the window
``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs = the first ``seq_len`` tokens, labels = the same window shifted
by one). Global position p of the run names one sample: a mixture gives p to a stream (`order.mixture_assign`), and the
stream's running index k is sample ``feistel_permute(k mod n, n, key(seed, epoch, stream))`` of epoch ``k // n``; no
array over the corpus is ever built. The loader's state is the global position (plus each stream's count), identical
on every rank, so the batches of N data-parallel ranks with local batch b are, call for call, exactly those of one
rank with local batch N*b, and a checkpoint taken under one data-parallel degree resumes under another.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from meshforge.data.corpus import dataset_folders
from meshforge.data.order import feistel_permute, mixture_assign, normalise_weights, order_key
from meshforge.data.shards import MAX_OPEN_SHARDS, PreparedSplit
from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.config.schema import Data, Training


ORDER_VERSION = 2
"""Saved with the position: 2 = the keyed Feistel order (1, the argsort order, resumes no more)."""


class TokenStream(Protocol):
    """What the loader reads: a token stream and where its documents start."""

    num_tokens: int

    def read(self, start: int, length: int) -> np.ndarray: ...

    def document_starts(self, start: int, length: int) -> np.ndarray: ...


class ArrayStream:
    """An in-memory token array as a stream (tests, small corpora); doc_starts = the documents' first offsets."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray | None = None) -> None:
        self.tokens = np.asarray(tokens)
        self.num_tokens = len(self.tokens)
        self.doc_starts = np.zeros(1, dtype=np.int64) if doc_starts is None else np.asarray(doc_starts, np.int64)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64."""
        return np.asarray(self.tokens[start : start + length], dtype=np.int64)

    def document_starts(self, start: int, length: int) -> np.ndarray:
        """Offsets from start of the documents beginning in [start, start + length)."""
        lo, hi = np.searchsorted(self.doc_starts, [start, start + length])
        return self.doc_starts[lo:hi] - start


def document_positions(starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Each token's position within its document (restarting at 0 at every start; the window's first token is 0)."""
    index = np.arange(seq_len, dtype=np.int64)
    marks = np.zeros(seq_len, dtype=np.int64)
    marks[starts[(starts > 0) & (starts < seq_len)]] = 1
    segment_start = np.maximum.accumulate(np.where(marks == 1, index, 0))
    return index - segment_start


LOOK_AHEAD = 4
"""Batches ahead whose shards the loader asks the reader threads to check first (data/integrity.py ShardChecker)."""


class PackedDataLoader:
    """Batches of packed samples for one data-parallel rank, in a globally consistent order.

    On its k-th `next_batch` call, rank r of N with local batch b returns the samples at global positions
    ``[g + r*b, g + (r+1)*b)`` with ``g = k*N*b``. ``sources`` is one stream (or array) or several mixed by
    ``weights``. With ``with_positions``, `positions` gives the last batch's in-document token positions.
    """

    def __init__(
        self,
        sources: np.ndarray | TokenStream | list[TokenStream],
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool = True,
        weights: list[float] | None = None,
        with_positions: bool = False,
    ) -> None:
        if seq_len < 1 or local_batch_size < 1 or dp_degree < 1:
            raise ValueError(
                f"seq_len={seq_len}, local_batch_size={local_batch_size}, dp_degree={dp_degree} must be >= 1"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        if isinstance(sources, np.ndarray):
            if sources.ndim != 1:
                raise ValueError("a token array must be one-dimensional")
            sources = ArrayStream(sources)
        self.streams: list[TokenStream] = list(sources) if isinstance(sources, list) else [sources]
        for stream in self.streams:
            if stream.num_tokens < seq_len + 1:
                raise ConfigError(
                    f"the dataset has {stream.num_tokens} tokens, fewer than one sample needs (seq_len + 1 = "
                    f"{seq_len + 1}): lower training.seq_len or use more data"
                )
        self.shares = normalise_weights(weights or [1.0] * len(self.streams))
        if len(self.shares) != len(self.streams):
            raise ValueError(f"{len(self.shares)} weights for {len(self.streams)} datasets")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seed, self.shuffle, self.with_positions = seed, shuffle, with_positions
        self.sizes = [(s.num_tokens - 1) // seq_len for s in self.streams]
        self.num_samples = sum(self.sizes)
        self.counts = np.zeros(len(self.streams), dtype=np.int64)
        self._last = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._positions: torch.Tensor | None = None
        for ahead in range(LOOK_AHEAD + 1):  # the first batches' shards are checked first (data/integrity.py)
            self.look_ahead(ahead)

    @property
    def global_position(self) -> int:
        """Samples consumed globally (all ranks together)."""
        return int(self.counts.sum())

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be consumed globally (of the first stream, in a mixture)."""
        return int(self.counts[0]) // self.sizes[0]

    def _sample(self, stream: int, index: int) -> int:
        n = self.sizes[stream]
        epoch, offset = divmod(index, n)
        if not self.shuffle:
            return offset
        return int(feistel_permute(np.asarray([offset]), n, order_key(self.seed, epoch, stream))[0])

    def _assign(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.streams) == 1:
            return np.zeros(n, dtype=np.int64), self.counts[0] + np.arange(n, dtype=np.int64)
        return mixture_assign(self.shares, self.counts, n)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, labels), int64 tensors of shape (local_batch_size, seq_len)."""
        b, total = self.local_batch_size, self.dp_degree * self.local_batch_size
        streams, indices = self._assign(total)
        mine = slice(self.dp_rank * b, (self.dp_rank + 1) * b)
        ids = np.asarray([self._sample(int(s), int(i)) for s, i in zip(streams[mine], indices[mine], strict=True)])
        windows = np.stack(
            [
                self.streams[int(s)].read(int(i) * self.seq_len, self.seq_len + 1)
                for s, i in zip(streams[mine], ids, strict=True)
            ]
        )
        if self.with_positions:
            positions = [
                document_positions(
                    self.streams[int(s)].document_starts(int(i) * self.seq_len, self.seq_len), self.seq_len
                )
                for s, i in zip(streams[mine], ids, strict=True)
            ]
            self._positions = torch.from_numpy(np.stack(positions))
        position = self.global_position
        self._last = (ids, streams[mine], np.arange(position, position + total, dtype=np.int64)[mine])
        self.counts += np.bincount(streams, minlength=len(self.streams))
        self.look_ahead(LOOK_AHEAD)
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())

    def look_ahead(self, batches: int) -> None:
        """Ask the prepared streams to check the shards of this rank's batch ``batches`` after the next one before
        it is read (their sha256 runs on reader threads, off the step's path)."""
        wants = [
            getattr(stream, "want", None) if getattr(stream, "checking", False) else None for stream in self.streams
        ]
        if not any(wants):  # nothing left to check: no cost at all
            return
        b, total = self.local_batch_size, self.dp_degree * self.local_batch_size
        streams, indices = self._assign((batches + 1) * total)
        mine = slice(batches * total + self.dp_rank * b, batches * total + (self.dp_rank + 1) * b)
        for s, i in zip(streams[mine], indices[mine], strict=True):
            want = wants[int(s)]
            if want is not None:
                want([self._sample(int(s), int(i)) * self.seq_len])

    def positions(self) -> torch.Tensor:
        """In-document positions (local_batch_size, seq_len) of the last batch (needs with_positions)."""
        assert self._positions is not None, "build the loader with with_positions=True"
        return self._positions

    def sample_ids(self) -> list[int]:
        """Sample indices within their stream (sample i = token window at i*seq_len) of the last batch."""
        return [int(i) for i in self._last[0]]

    def sample_sources(self) -> list[int]:
        """The stream (mixture member) of each sample of the last batch."""
        return [int(s) for s in self._last[1]]

    def sample_positions(self) -> list[int]:
        """Global positions (samples consumed globally before each one, across epochs) of the last batch."""
        return [int(p) for p in self._last[2]]

    def reset(self) -> None:
        """Back to global position 0 (validation replays the same batches each time)."""
        self.counts[:] = 0

    def state_dict(self) -> dict[str, int]:
        """The global position plus what must match on reload (identical on every data-parallel rank)."""
        state = {
            "global_position": self.global_position,
            "epoch": self.epoch,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "order_version": ORDER_VERSION,
        }
        if len(self.streams) > 1:
            for d, (count, size, share) in enumerate(zip(self.counts, self.sizes, self.shares, strict=True)):
                state |= {f"source{d}_count": int(count), f"source{d}_samples": size}
                state[f"source{d}_share_ppm"] = round(float(share) * 1e6)
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved global position; any data-parallel degree or local batch size may load it."""
        expected = {k: v for k, v in self.state_dict().items() if k not in ("global_position", "epoch")}
        expected = {k: v for k, v in expected.items() if not k.endswith("_count")}
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed or "global_position" not in state:
            detail = ", ".join(f"{k}: saved {old} now {new}" for k, (old, new) in changed.items()) or "no position"
            raise ConfigError(
                f"data loader state does not match this dataset/config ({detail}); the order would differ"
            )
        if len(self.streams) == 1:
            self.counts[0] = int(state["global_position"])
        else:
            self.counts[:] = [int(state[f"source{d}_count"]) for d in range(len(self.streams))]


def open_splits(
    cfg: Training, tokenizer_path: str, split: str, data: Data | None = None
) -> tuple[list[PreparedSplit], list[float]]:
    """The prepared streams and weights of cfg's dataset split ('train' or 'val'), each shard checked."""
    max_open, verify = (data.max_open_shards, data.verify) if data else (MAX_OPEN_SHARDS, "cheap")
    folders = dataset_folders(cfg.dataset, cfg.dataset_path, cfg.dataset_mixture, tokenizer_path)
    opened = [PreparedSplit(Path(folder), split, max_open_shards=max_open, verify=verify) for folder, _ in folders]
    return opened, [w for _, w in folders]


def build_dataloader(
    cfg: Training,
    tokenizer_path: str,
    fingerprint: str,
    *,
    dp_rank: int,
    dp_degree: int,
    split: str = "train",
    local_batch_size: int = 0,
    data: Data | None = None,
) -> PackedDataLoader:
    """The loader of a data-parallel rank for cfg's dataset; the train split is shuffled, the val split is not.

    fingerprint: the model's tokenizer's; a dataset prepared with another tokenizer is refused.
    data: the data section (open maps, start-up verification); its defaults when None.
    """
    if split not in ("train", "val"):
        raise ConfigError(f"unknown split {split!r}: use 'train' or 'val'")
    streams, weights = open_splits(cfg, tokenizer_path, split, data)
    for stream in streams:
        if stream.fingerprint != fingerprint:
            raise ConfigError(
                f"prepared dataset {str(stream.folder)!r} was tokenized with another tokenizer than "
                f"model.tokenizer_path: prepare it again with --tokenizer {tokenizer_path}"
            )
        if stream.num_tokens == 0:
            raise ConfigError(
                f"prepared dataset {str(stream.folder)!r} has no {split!r} tokens (--val-docs at prepare)"
            )
    return PackedDataLoader(
        list(streams),
        seq_len=cfg.seq_len,
        local_batch_size=local_batch_size or cfg.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=cfg.seed,
        shuffle=split == "train",
        weights=weights,
        with_positions=cfg.document_mask,
    )
