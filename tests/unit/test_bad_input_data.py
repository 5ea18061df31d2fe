"""Bad input to prepared datasets (issue 36): a manifest that is not JSON or valid JSON of the wrong shape is one line
naming the file and the key (exit 2 from `meshforge data ...` and `meshforge train`); a shard whose token bytes were
flipped (same size) is named the first time the run reads it, by the default data.verify = "cheap": its sha256 is
checked on a reader thread, off the step's path, so a run that starts normally has it checked before the first batch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from meshforge.cli import main as meshforge_main
from meshforge.data.manifest import MANIFEST
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.shards import PreparedSplit
from meshforge.data.tokenizer import REPO_ROOT
from meshforge.errors import ConfigError

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """60 small documents in shards of about 120 tokens, 4 held out."""
    rows = (json.dumps({"text": f"Emma {i} was " + " ".join(["handsome"] * (1 + i % 6))}) for i in range(60))
    (tmp_path / "in.jsonl").write_text("".join(row + "\n" for row in rows))
    options = PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=120, val_docs=4)
    prepare([str(tmp_path / "in.jsonl")], tmp_path / "out", options)
    return tmp_path / "out"


def edit(folder: Path, change: Any) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps(change(manifest)))


def shard0(m: dict[str, Any]) -> dict[str, Any]:
    return dict(m["splits"]["train"]["shards"][0])


def with_shard0(m: dict[str, Any], **fields: Any) -> dict[str, Any]:
    m["splits"]["train"]["shards"][0] = {**shard0(m), **fields}
    return m


SHAPES: dict[str, tuple[Any, str]] = {
    "a list": (lambda m: [m], "holds a list, not a manifest object"),
    "a string": (lambda m: "manifest", "holds a str, not a manifest object"),
    "no dtype": (lambda m: {k: v for k, v in m.items() if k != "dtype"}, "dtype = None"),
    "float dtype": (lambda m: {**m, "dtype": "float64"}, "dtype = 'float64'"),
    "no tokenizer": (lambda m: {**m, "tokenizer": "bpe"}, "tokenizer = 'bpe'"),
    "splits a list": (lambda m: {**m, "splits": []}, "splits = []"),
    "split a number": (lambda m: {**m, "splits": {"train": 3}}, "splits.train = 3"),
    "tokens a string": (lambda m: {**m, "splits": {"train": {**m["splits"]["train"], "tokens": "9"}}}, "tokens = '9'"),
    "shard a number": (lambda m: {**m, "splits": {"train": {**m["splits"]["train"], "shards": [7]}}}, "shards[0] = 7"),
    "name a number": (lambda m: with_shard0(m, name=5), "shards[0].name = 5"),
    "name outside": (lambda m: with_shard0(m, name="../x.bin"), "shards[0].name = '../x.bin'"),
    "negative tokens": (lambda m: with_shard0(m, tokens=-1), "shards[0].tokens = -1"),
    "bool documents": (lambda m: with_shard0(m, documents=True), "shards[0].documents = True"),
    "short sha256": (lambda m: with_shard0(m, sha256="abc"), "shards[0].sha256 = 'abc'"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_manifest_of_the_wrong_shape_is_one_line_naming_it(
    shape: str, dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, says = SHAPES[shape]
    edit(dataset, change)
    with pytest.raises(ConfigError) as refused:
        PreparedSplit(dataset)
    assert str(dataset / MANIFEST) in str(refused.value) and says in str(refused.value), refused.value
    for command in ("info", "verify"):
        assert meshforge_main(["data", command, str(dataset)]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_split_totals_that_the_shards_do_not_hold_are_refused_at_open(dataset: Path) -> None:
    edit(dataset, lambda m: {**m, "splits": {**m["splits"], "train": {**m["splits"]["train"], "tokens": 10**9}}})
    with pytest.raises(ConfigError, match=r"splits\.train\.tokens = 1000000000 but its shards hold \d+"):
        PreparedSplit(dataset)


@pytest.mark.parametrize("text", ['{"format": "meshforge-shards-v1", ', "", "\udcff not utf-8"])
def test_a_manifest_that_is_not_json_names_the_file(
    text: str, dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (dataset / MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=rf"'{dataset / MANIFEST}' is not JSON"):
        PreparedSplit(dataset)
    assert meshforge_main(["data", "info", str(dataset)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"'{dataset / MANIFEST}' is not JSON" in err and len(err.splitlines()) == 1, err


def flip(dataset: Path, name: str = "train-00001.bin") -> None:
    """Flip one bit of a shard's tokens: same size, so only its sha256 tells."""
    data = bytearray((dataset / name).read_bytes())
    data[3] ^= 1
    (dataset / name).write_bytes(bytes(data))


def test_flipped_bytes_are_named_at_the_first_read_of_their_shard(dataset: Path) -> None:
    flip(dataset)
    split = PreparedSplit(dataset)  # opens: the cheap check cannot tell
    split.read(0, 4)  # shard 0 is sound
    with pytest.raises(ConfigError, match=r"train-00001\.bin has another sha256.*meshforge data verify"):
        split.read(int(split.starts[1]), 4)
    with pytest.raises(ConfigError, match=r"train-00001\.bin has another sha256"):
        split.read(int(split.starts[1]), 4)  # every later read too, not only the first
    PreparedSplit(dataset, verify="sizes").read(int(split.starts[1]), 4)  # the explicit opt-out reads it


def test_the_checksums_run_on_a_reader_thread_before_any_read(dataset: Path) -> None:
    """Off the step's path: the reader thread hashes every shard while the run is still starting."""
    flip(dataset, "train-00003.bin")
    split = PreparedSplit(dataset)
    checker = split._checker
    assert checker is not None and all(t.name == "meshforge-shard-check" for t in checker.threads)
    deadline = time.monotonic() + 10
    while len(checker.results) < len(split.shard_names) and time.monotonic() < deadline:
        time.sleep(0.01)  # no read: only the thread can fill the results
    assert len(checker.results) == len(split.shard_names)
    assert [i for i, problem in checker.results.items() if problem] == [3]


def test_training_on_a_flipped_shard_ends_in_one_line(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in sorted(p.name for p in dataset.glob("train-*.bin")):
        flip(dataset, name)  # every shard: the first batch reads a damaged one whatever the order
    argv = ["train", "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
    argv += ["--training.steps", "2", "--metrics.progress_bar", "false", "--training.dataset", "prepared"]
    argv += ["--training.dataset_path", str(dataset), "--model.tokenizer_path", TOKENIZER]
    argv += ["--job.dump_folder", str(dataset.parent / "run"), "--training.mixed_precision_param", "float32"]
    assert meshforge_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has another sha256 than the manifest's" in err[0], err


def test_the_loader_asks_for_its_next_batches_shards_first() -> None:
    """The loader's look-ahead: at construction the first LOOK_AHEAD + 1 batches' windows, then after each batch the
    one LOOK_AHEAD further, are handed to the stream to check first; nothing once the stream has nothing to check."""
    import numpy as np

    from meshforge.data.loader import LOOK_AHEAD, ArrayStream, PackedDataLoader

    class Checked(ArrayStream):
        checking = True

        def want(self, starts: list[int]) -> None:
            self.asked += starts

    stream = Checked(np.arange(10_000) % 97)
    stream.asked = []
    loader = PackedDataLoader(stream, seq_len=16, local_batch_size=3, dp_rank=1, dp_degree=2, seed=5)
    read: list[int] = []
    for _ in range(LOOK_AHEAD + 3):
        loader.next_batch()
        read += [int(i) * 16 for i in loader.sample_ids()]
    # asked: every batch read, in order, and the LOOK_AHEAD + 1 after the last one read (the next and L more)
    assert stream.asked[: len(read)] == read and len(stream.asked) == len(read) + (LOOK_AHEAD + 1) * 3
    stream.checking = False
    before = len(stream.asked)
    loader.next_batch()
    assert len(stream.asked) == before
