"""A prepared dataset damaged while a job reads it (issue 48): every kind of change to a shard file after the split
opened ends in one ConfigError line naming the file and `meshforge data verify`, within seconds: never a traceback
(numpy's EOFError), never SIGBUS (a truncated memory map), never a wait without end (a reader thread that died)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshforge.data import integrity, reader
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.shards import PreparedSplit
from meshforge.data.tokenizer import REPO_ROOT
from meshforge.errors import BackgroundError, ConfigError

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")
BOUND_S = 30.0  # each case ends within this (issue 48's bar)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 documents, shards of <= 120 tokens (5 train shards), as in the issue."""
    root = tmp_path_factory.mktemp("damage")
    rows = "".join(f'{{"text": "Emma {i} was {" ".join(["handsome"] * (1 + i % 6))}"}}\n' for i in range(60))
    (root / "in.jsonl").write_text(rows)
    prepare(
        [str(root / "in.jsonl")], root / "out", PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=120, val_docs=4)
    )
    return root / "out"


@pytest.fixture
def dataset(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "out")
    return tmp_path / "out"


def one_line(call: Callable[[], object], names: str) -> str:
    """The ConfigError call raises, checked: one line, names the file, gives the verify hint, within the bound."""
    began = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        call()
    message = str(caught.value)
    assert time.monotonic() - began < BOUND_S, message
    assert "\n" not in message and names in message and "meshforge data verify" in message, message
    return message


def rewrite(path: Path, data: bytes) -> None:
    """Rewrite a file in place (same inode, as `open(path, "wb")` does), its modification time past the coarse
    file-system clock of the check's (a few ms), as any rewrite after a job started is."""
    time.sleep(0.02)
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def test_every_index_emptied_in_place_is_one_line(dataset: Path) -> None:
    split = PreparedSplit(dataset)
    for path in dataset.glob("train-*.idx"):
        rewrite(path, b"")
    one_line(lambda: split.document_starts(0, 10), "train-00000.idx")  # was EOFError from np.load


def test_index_garbage_of_every_kind_is_one_line(dataset: Path) -> None:
    good = (dataset / "train-00001.idx").read_bytes()
    header = good[: len(good) - 8 * (len(np.load(dataset / "train-00001.idx")))]
    kinds = {
        "empty": b"",
        "magic only": good[:8],
        "header cut": good[:20],
        "bad magic": b"\x00" * len(good),
        "random bytes": np.random.default_rng(0).bytes(len(good)),
        "header of garbage": header.replace(b"descr", b"dXscr"),
        "header not a dict": header[:10] + b"[1, 2]".ljust(len(header) - 11) + b"\n",
        "offsets cut": good[:-8],
        "offsets scrambled": header + np.arange(len(good) - len(header), dtype="<i1").tobytes(),
        "int32 offsets": header.replace(b"<i8", b"<i4"),
    }
    for kind, data in kinds.items():
        split = PreparedSplit(dataset, verify="sizes")
        rewrite(dataset / "train-00001.idx", data)
        message = one_line(lambda s=split: s.document_starts(int(s.starts[1]), 10), "train-00001.idx")
        assert "train-00001.idx" in message, (kind, message)
        (dataset / "train-00001.idx").write_bytes(good)
        for shard in (0, 1):  # every check of it too: the full one, and the reader thread's
            assert (
                integrity.check_full(dataset, split.manifest["splits"]["train"]["shards"][shard], split.dtype) is None
            )
        assert integrity.verify(dataset) == []


TRUNCATE_AFTER_A_READ = """
import os, sys
from meshforge.data.shards import PreparedSplit
from meshforge.errors import ConfigError
split = PreparedSplit(sys.argv[1])
start = int(split.starts[2])
split.read(start, 4)
os.truncate(sys.argv[1] + "/train-00002.bin", 0)
try:
    split.read(start + 4, 4)
except ConfigError as error:
    print(error)
    sys.exit(2)
"""


def test_bin_truncated_after_a_read_is_one_line_not_a_bus_error(dataset: Path) -> None:
    """In a child process: a memory-mapped read of the truncated file is SIGBUS (-7), which would end the suite."""
    began = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATE_AFTER_A_READ, str(dataset)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2 and not proc.stderr, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "train-00002.bin has 0 bytes" in lines[0] and "meshforge data verify" in lines[0]
    assert time.monotonic() - began < BOUND_S


def test_index_rewritten_while_the_reader_thread_hashes_is_one_line(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread reads the .idx after hashing the .bin: empty it in between (its EOFError killed the thread)."""
    hash_bin = integrity.stream_sha256

    def hash_then_empty(f: object) -> str:
        digest = hash_bin(f)  # type: ignore[arg-type]
        if "train-00003" in str(getattr(f, "name", "")):
            (dataset / "train-00003.idx").write_bytes(b"")
        return digest

    monkeypatch.setattr(integrity, "stream_sha256", hash_then_empty)
    split = PreparedSplit(dataset)
    one_line(lambda: split.read(int(split.starts[3]), 4), "train-00003.idx")
    assert split._checker is not None and split._checker.failure is None  # a shard's problem, not a dead thread


def test_bin_changed_while_the_reader_thread_hashes_is_one_line(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hash_bin = integrity.stream_sha256

    def hash_then_append(f: object) -> str:
        digest = hash_bin(f)  # type: ignore[arg-type]
        if "train-00004" in str(getattr(f, "name", "")):
            with open(dataset / "train-00004.bin", "ab") as out:
                out.write(b"\x01\x00")
        return digest

    monkeypatch.setattr(integrity, "stream_sha256", hash_then_append)
    split = PreparedSplit(dataset)
    one_line(lambda: split.read(int(split.starts[4]), 4), "train-00004.bin changed while its sha256 was computed")


@pytest.mark.parametrize("verify", ["cheap", "sizes"])
def test_bin_rewritten_in_place_after_a_read_is_one_line(dataset: Path, verify: str) -> None:
    """Same size, other bytes, after the check and a read: the modification time tells (no hashing per read)."""
    split = PreparedSplit(dataset, verify=verify)
    start = int(split.starts[1])
    split.read(start, 4)
    data = bytearray((dataset / "train-00001.bin").read_bytes())
    data[4] ^= 1
    rewrite(dataset / "train-00001.bin", bytes(data))
    one_line(lambda: split.read(start, 4), "train-00001.bin was rewritten in place")


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_files_removed_after_a_read_are_one_line(dataset: Path, suffix: str) -> None:
    split = PreparedSplit(dataset)
    start = int(split.starts[2])
    split.read(start, 4), split.document_starts(start, 4)
    (dataset / f"train-00002{suffix}").unlink()
    time.sleep(reader.PATH_CHECK_S)  # the open file keeps its bytes: the next stat of its path tells
    read = split.read if suffix == ".bin" else split.document_starts
    one_line(lambda: read(start, 4), f"train-00002{suffix} cannot be read (No such file or directory)")
    (dataset / "train-00004.bin").unlink()  # and one never read before
    one_line(lambda: split.read(int(split.starts[4]), 4), "train-00004.bin")


def test_bin_replaced_or_grown_after_a_read_is_one_line(dataset: Path) -> None:
    """Another `data prepare` into the folder renames new files over the old ones; a partial copy appends."""
    split = PreparedSplit(dataset)
    split.read(int(split.starts[0]), 4), split.read(int(split.starts[1]), 4)
    (dataset / "new.bin").write_bytes((dataset / "train-00000.bin").read_bytes())
    os.replace(dataset / "new.bin", dataset / "train-00000.bin")
    time.sleep(reader.PATH_CHECK_S)  # the open file keeps its bytes: the next stat of its path tells
    one_line(lambda: split.read(0, 4), "train-00000.bin was replaced by another file")
    with open(dataset / "train-00001.bin", "ab") as f:
        f.write(b"\x00\x00")
    one_line(lambda: split.read(int(split.starts[1]), 4), "train-00001.bin has")


def test_a_sound_dataset_reads_the_same_tokens(dataset: Path) -> None:
    """The reads without maps give the file's tokens, across shard boundaries and by document."""
    split = PreparedSplit(dataset)
    every = np.concatenate([np.fromfile(dataset / name, dtype=np.uint16) for name in split.shard_names])
    assert split.read(0, split.num_tokens).tolist() == every.astype(np.int64).tolist()
    assert split.read(int(split.starts[1]) - 3, 7).tolist() == every[int(split.starts[1]) - 3 :][:7].tolist()
    offsets = np.load(dataset / "train-00001.idx")
    assert (
        split.document(int(len(np.load(dataset / "train-00000.idx")) - 1)).tolist()
        == every[int(split.starts[1]) : int(split.starts[1]) + int(offsets[1])].tolist()
    )


def test_a_dead_reader_thread_is_one_line_not_a_hang(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the thread (not a damaged file) is kept and raised to the read that waits, at once."""

    def broken(folder: Path, shard: dict[str, object]) -> object:
        raise RuntimeError("injected")

    monkeypatch.setattr(integrity, "check_bytes", broken)
    split = PreparedSplit(dataset)
    began = time.monotonic()
    with pytest.raises(BackgroundError, match=r"^the shard-check thread on .*train-0000\d\.bin failed: RuntimeError"):
        split.read(int(split.starts[2]), 4)
    assert time.monotonic() - began < 5


def test_a_stalled_check_ends_within_its_bound_naming_the_shard(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = integrity.check_bytes

    def slow(folder: Path, shard: dict[str, object]) -> object:
        if shard["name"] == "train-00002.bin":
            time.sleep(3)
        return check(folder, shard)  # type: ignore[arg-type]

    monkeypatch.setattr(integrity, "check_bytes", slow)
    monkeypatch.setattr(integrity, "WAIT_FLOOR_S", 0.5)
    split = PreparedSplit(dataset)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"waited \d+ s for the sha256 check of \S+train-00002\.bin") as caught:
        split.read(int(split.starts[2]), 4)
    assert "\n" not in str(caught.value) and time.monotonic() - began < 2.5, str(caught.value)
    assert split._checker is not None
    for thread in split._checker.threads:
        thread.join(10)  # no thread outlives the test


def test_an_index_of_another_shard_is_refused_at_open(dataset: Path) -> None:
    """The same number of documents but another end (a stale index of an equal-length shard): the cheap check at
    open compares the last offset with the manifest's tokens, before any read."""
    offsets = np.load(dataset / "train-00003.idx")
    offsets[-1] += 7
    with open(dataset / "train-00003.idx", "wb") as f:
        np.save(f, offsets)
    one_line(lambda: PreparedSplit(dataset, verify="sizes"), "train-00003.idx does not match train-00003.bin")
