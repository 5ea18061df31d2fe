"""Corpus preparation: documents -> tokens (N worker processes) -> shards of a train and a held-out val split.

Memory stays bounded: documents are read one at a time, grouped into batches of at most ``BATCH_CHARS`` characters,
at most ``2 x workers`` batches are in flight, and tokens go straight to the open shard file. The manifest is written
last (`shards.write_manifest`), after every shard and the folder are fsynced, so an interrupted preparation leaves
no manifest; running it again removes the files its journal (`shards.JOURNAL`) names, and nothing else, and starts
over.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshforge.data import shards
from meshforge.data.manifest import FORMAT, MANIFEST
from meshforge.data.sources import Document, iter_documents
from meshforge.data.tokenizer import Tokenizer, build_tokenizer
from meshforge.errors import ConfigError
from meshforge.threads import result

BATCH_CHARS = 1 << 20
BATCH_DOCS = 512
GOLDEN = 0.6180339887498949


@dataclass
class PrepareOptions:
    """How to prepare: tokenizer, workers, text field, held-out split, shard size, an optional token budget."""

    tokenizer_path: str = "data/tokenizer/austen-bpe-2048.json"
    workers: int = 1
    text_field: str = "text"
    val_docs: int = 0
    """The first val_docs documents are held out."""
    val_fraction: float = 0.0
    """Document i (from 0) is held out when frac((i + 1) x golden ratio) < val_fraction: an even, seedless spread."""
    shard_tokens: int = 1 << 26
    max_tokens: int = 0
    """Stop after this many training tokens (0: read every input; needed for endless hub streams)."""

    def validate(self) -> None:
        if self.workers < 1 or self.shard_tokens < 1 or self.val_docs < 0 or self.max_tokens < 0:
            raise ConfigError("--workers and --shard-tokens must be >= 1, --val-docs and --max-tokens >= 0")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"--val-fraction {self.val_fraction} must be in [0, 1)")


def held_out(index: int, document: Document, options: PrepareOptions) -> bool:
    """Whether document number ``index`` goes to the validation split."""
    spread = ((index + 1) * GOLDEN) % 1.0 < options.val_fraction
    return document.held_out or index < options.val_docs or spread


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one encoder thread per worker process: no oversubscription
    _WORKER_TOKENIZER = build_tokenizer(tokenizer_path)


def encode_packed(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``bos + tokens + eos`` of each text, concatenated, and each document's length (batch-encoded)."""
    encoded = tokenizer.encode_batch(texts)
    lengths = np.asarray([len(ids) + 2 for ids in encoded], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    position = 0
    for ids in encoded:
        flat[position] = tokenizer.bos_id
        flat[position + 1 : position + 1 + len(ids)] = ids
        flat[position + 1 + len(ids)] = tokenizer.eos_id
        position += len(ids) + 2
    return flat, lengths


def _encode_in_worker(texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return encode_packed(_WORKER_TOKENIZER, texts, np.dtype(dtype))


def batches(documents: Iterable[Document], options: PrepareOptions) -> Iterator[tuple[list[str], list[bool]]]:
    """(texts, held out) groups of at most BATCH_DOCS documents or BATCH_CHARS characters."""
    texts: list[str] = []
    flags: list[bool] = []
    chars = 0
    for index, document in enumerate(documents):
        texts.append(document.text)
        flags.append(held_out(index, document, options))
        chars += len(document.text)
        if len(texts) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield texts, flags
            texts, flags, chars = [], [], 0
    if texts:
        yield texts, flags


def encoded_batches(
    groups: Iterable[tuple[list[str], list[bool]]], tokenizer: Tokenizer, options: PrepareOptions, dtype: np.dtype[Any]
) -> Iterator[tuple[np.ndarray, np.ndarray, list[bool], int]]:
    """(tokens, lengths, held out, characters) per group, in input order; in this process for one worker, else in a
    spawned pool with at most 2 x workers groups in flight."""
    if options.workers == 1:
        for texts, flags in groups:
            yield (*encode_packed(tokenizer, texts, dtype), flags, sum(map(len, texts)))
        return
    ctx = mp.get_context("spawn")  # no fork of a process whose tokenizer thread pool may be running
    # an executor, not mp.Pool: a worker that dies (killed, out of memory) breaks it and every pending result raises,
    # where mp.Pool replaces the worker and waits for its lost result forever
    what = f"a `data prepare` encoder process (one of {options.workers})"
    with ProcessPoolExecutor(
        options.workers, ctx, initializer=_init_worker, initargs=(options.tokenizer_path,)
    ) as pool:
        pending: deque[tuple[Future[tuple[np.ndarray, np.ndarray]], list[bool], int]] = deque()
        for texts, flags in groups:
            pending.append((pool.submit(_encode_in_worker, texts, dtype.str), flags, sum(map(len, texts))))
            if len(pending) >= 2 * options.workers:
                future, f, c = pending.popleft()
                yield (*result(future, what), f, c)
        while pending:
            future, f, c = pending.popleft()
            yield (*result(future, what), f, c)


def prepare(inputs: list[str], out: Path, options: PrepareOptions, *, progress: bool = False) -> dict[str, Any]:
    """Tokenize the inputs into a prepared dataset at out; returns the manifest. Refuses a folder that already holds
    a manifest; removes what an interrupted preparation left behind."""
    options.validate()
    if not inputs:
        raise ConfigError("no inputs: give .txt/.jsonl/.parquet files or folders, or hf:<dataset id>")
    out = Path(out)
    if (out / MANIFEST).exists():
        raise ConfigError(f"{str(out)!r} already holds a prepared dataset: choose another --out or delete it")
    out.mkdir(parents=True, exist_ok=True)
    shards.remove_leftovers(out)
    foreign = shards.foreign_shard_files(out)
    if foreign:
        raise ConfigError(
            f"{str(out)!r} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} that no preparation "
            "of meshforge wrote (it deletes only what it wrote): choose another --out or move them away"
        )
    tokenizer = build_tokenizer(options.tokenizer_path)
    dtype = shards.token_dtype(tokenizer.vocab_size)
    writers = {split: shards.ShardWriter(out, split, dtype, options.shard_tokens) for split in shards.SPLITS}
    start = time.perf_counter()
    counts = _write_documents(inputs, tokenizer, options, writers, progress)
    manifest = _manifest(inputs, tokenizer, options, dtype, {s: w.close() for s, w in writers.items()})
    manifest["stats"] = {**counts, "seconds": round(time.perf_counter() - start, 3)}
    shards.write_manifest(out, manifest)
    return manifest


def _write_documents(
    inputs: list[str],
    tokenizer: Tokenizer,
    options: PrepareOptions,
    writers: dict[str, shards.ShardWriter],
    progress: bool,
) -> dict[str, int]:
    """Encode and write every document; the counts. The last training document is written last of all: when
    --val-fraction held out none of >= 2 documents, it goes to validation instead (with a warning)."""
    counts = {"documents": 0, "characters": 0, "tokens": 0, "train_tokens": 0}
    dtype, held, last = writers["train"].dtype, 0, None
    with ProgressLine(progress) as update:
        groups = batches(iter_documents(inputs, options.text_field), options)
        for flat, lengths, flags, chars in encoded_batches(groups, tokenizer, options, dtype):
            for document, is_val in zip(np.split(flat, np.cumsum(lengths)[:-1]), flags, strict=True):
                if is_val:
                    writers["val"].add(document)
                    held += 1
                else:
                    if last is not None:
                        writers["train"].add(last)
                    last = document
                counts["documents"] += 1
                counts["tokens"] += len(document)
                counts["train_tokens"] += 0 if is_val else len(document)
                if options.max_tokens and counts["train_tokens"] >= options.max_tokens:
                    break  # the budget counts every training document written, the open shard's included
            counts["characters"] += chars
            update(counts["tokens"], chars)
            if options.max_tokens and counts["train_tokens"] >= options.max_tokens:
                break
    if last is not None and options.val_fraction > 0 and held == 0 and counts["documents"] >= 2:
        print(
            f"meshforge: --val-fraction {options.val_fraction} of {counts['documents']} documents rounds to none: "
            "holding out the last document (--val-docs N to choose)",
            file=sys.stderr,
        )
        writers["val"].add(last)
        counts["train_tokens"] -= len(last)
    elif last is not None:
        writers["train"].add(last)
    return counts


def _manifest(
    inputs: list[str],
    tokenizer: Tokenizer,
    options: PrepareOptions,
    dtype: np.dtype[Any],
    split_shards: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    splits = {
        split: {
            "tokens": sum(s["tokens"] for s in entries),
            "documents": sum(s["documents"] for s in entries),
            "shards": entries,
        }
        for split, entries in split_shards.items()
    }
    return {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "tokenizer": {
            "source": options.tokenizer_path,
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": dtype.name,
        "sources": inputs,
        "options": asdict(options),
        "splits": splits,
    }


class ProgressLine:
    """A rich progress line with tokens, tokens/s and characters/s (nothing when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.start, self.chars = enabled, time.perf_counter(), 0
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if self.enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            self.bar.start()
            self.task = self.bar.add_task("tokenizing")
        return self.update

    def update(self, tokens: int, chars: int) -> None:
        self.chars += chars
        if self.bar is None:
            return
        seconds = max(time.perf_counter() - self.start, 1e-9)
        text = f"{tokens:,} tokens  {tokens / seconds:,.0f} tokens/s  {self.chars / seconds / 1e6:.2f} M chars/s"
        self.bar.update(self.task, description=text)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
