"""`meshforge data prepare`: every local input format, shards + manifest round trip, the held-out split, workers,
interrupted preparations, and mixtures of prepared datasets (shares, determinism, resharding)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.cli import main as meshforge_main
from meshforge.config.schema import Training
from meshforge.data import shards
from meshforge.data.loader import ArrayStream, PackedDataLoader, build_dataloader
from meshforge.data.manifest import file_sha256
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.shards import PreparedSplit
from meshforge.data.tokenizer import REPO_ROOT, Tokenizer, build_tokenizer

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")
TEXTS = [f"Chapter {i}. It is a truth universally acknowledged, number {i * 7}.\n" * (3 + i % 5) for i in range(30)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(TOKENIZER)


def _write_inputs(folder: Path) -> dict[str, list[str]]:
    """The same 30 documents as a folder of .txt/.txt.gz files, a .jsonl and a .jsonl.gz file."""
    (folder / "txt").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        if i % 2:
            (folder / "txt" / f"doc{i:02d}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (folder / "txt" / f"doc{i:02d}.txt").write_text(text)
    lines = "".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS))
    (folder / "docs.jsonl").write_text(lines)
    (folder / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    return {"txt": [str(folder / "txt")], "jsonl": [str(folder / "docs.jsonl")], "gz": [str(folder / "docs.jsonl.gz")]}


def _decoded(split: PreparedSplit, tokenizer: Tokenizer) -> list[str]:
    texts = []
    for d in range(split.num_documents):
        tokens = split.document(d).tolist()
        assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
        texts.append(tokenizer.decode(tokens[1:-1]))
    return texts


@pytest.mark.parametrize("kind", ["txt", "jsonl", "gz"])
def test_prepare_round_trip(kind: str, tmp_path: Path, tokenizer: Tokenizer) -> None:
    inputs = _write_inputs(tmp_path / "in")[kind]
    options = PrepareOptions(tokenizer_path=TOKENIZER, text_field="body", val_docs=3, shard_tokens=500)
    manifest = prepare(inputs, tmp_path / "out", options)
    train, val = PreparedSplit(tmp_path / "out", "train"), PreparedSplit(tmp_path / "out", "val")
    assert _decoded(val, tokenizer) == TEXTS[:3] and _decoded(train, tokenizer) == TEXTS[3:]
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    info = manifest["splits"]["train"]
    assert len(info["shards"]) > 2 and info["documents"] == 27 == train.num_documents
    assert info["tokens"] == train.num_tokens == sum(len(tokenizer.encode(t)) + 2 for t in TEXTS[3:])
    for shard in info["shards"]:
        path = tmp_path / "out" / shard["name"]
        assert shard["bytes"] == path.stat().st_size == 2 * shard["tokens"] and shard["sha256"] == file_sha256(path)
    whole = np.concatenate([np.fromfile(tmp_path / "out" / s["name"], dtype=np.uint16) for s in info["shards"]])
    start = int(train.starts[1]) - 5  # a window across a shard boundary reads as the concatenation
    assert train.read(start, 10).tolist() == whole[start : start + 10].tolist()
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp") == []


def test_val_fraction_folder_val_and_workers(tmp_path: Path) -> None:
    inputs = _write_inputs(tmp_path / "in")["txt"]
    (tmp_path / "in" / "txt" / "val").mkdir()
    (tmp_path / "in" / "txt" / "val" / "held.txt").write_text("Persuasion, held out.")
    one = prepare(inputs, tmp_path / "one", PrepareOptions(tokenizer_path=TOKENIZER, val_fraction=0.2))
    val_docs = one["splits"]["val"]["documents"]
    assert 1 + 4 <= val_docs <= 1 + 8  # the val/ file plus about 20 % of 31 documents
    two = prepare(inputs, tmp_path / "two", PrepareOptions(tokenizer_path=TOKENIZER, val_fraction=0.2, workers=2))
    assert one["splits"] == two["splits"]  # same shards, byte for byte (sha256 in the entries)


def test_interrupted_preparation_restarts_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _write_inputs(tmp_path / "in")["txt"]
    options = PrepareOptions(tokenizer_path=TOKENIZER, shard_tokens=300)
    flush = shards.ShardWriter._flush
    calls = {"n": 0}

    def crash_on_third(self: shards.ShardWriter) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        flush(self)

    monkeypatch.setattr(shards.ShardWriter, "_flush", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, tmp_path / "out", options)
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "manifest.json" not in left and any(n.endswith(".tmp") for n in left) and "train-00000.bin" in left
    with pytest.raises(ValueError, match="no manifest"):
        PreparedSplit(tmp_path / "out")
    monkeypatch.setattr(shards.ShardWriter, "_flush", flush)
    manifest = prepare(inputs, tmp_path / "out", options)
    names = {s["name"] for split in manifest["splits"].values() for s in split["shards"]}
    on_disk = {p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".bin"}
    assert names == on_disk and not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(ValueError, match="already holds"):
        prepare(inputs, tmp_path / "out", options)


def test_parquet_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # not installed: the error is one line naming the package
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow"):
            prepare([str(tmp_path / "x.parquet")], tmp_path / "out", PrepareOptions(tokenizer_path=TOKENIZER))
        return
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "x.parquet")
    prepare([str(tmp_path / "x.parquet")], tmp_path / "out", PrepareOptions(tokenizer_path=TOKENIZER))
    assert _decoded(PreparedSplit(tmp_path / "out"), tokenizer) == TEXTS


def test_input_mistakes_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_inputs(tmp_path / "in")
    assert meshforge_main(["data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    argv = ["data", "prepare", str(tmp_path / "in" / "docs.jsonl"), "--out", str(tmp_path / "o"), "--no-progress"]
    assert meshforge_main(argv) == 2 and "--text-field" in capsys.readouterr().err
    assert meshforge_main([*argv, "--text-field", "body", "--val-docs", "2"]) == 0
    assert "train 28 documents" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="datasets"):
        prepare(["hf:c4"], tmp_path / "hub", PrepareOptions(tokenizer_path=TOKENIZER))


def _mixture(degree: int, batch: int) -> list[PackedDataLoader]:
    streams = [ArrayStream(np.arange(n * 8 + 1) + 10**6 * d) for d, n in enumerate((50, 400, 90))]
    return [
        PackedDataLoader(
            streams, seq_len=8, local_batch_size=batch, dp_rank=r, dp_degree=degree, seed=7, weights=[0.5, 0.3, 0.2]
        )
        for r in range(degree)
    ]


def test_mixture_shares_determinism_and_resharding() -> None:
    ranks = _mixture(2, 10)
    tokens = np.zeros(3)
    seen = []
    for _ in range(50):  # 1,000 samples
        for loader in ranks:
            inputs, _ = loader.next_batch()
            for source, row in zip(loader.sample_sources(), inputs, strict=True):
                assert int(row[0]) // 10**6 == source  # each sample read from its own dataset
                tokens[source] += row.numel()
            seen.append((loader.sample_sources(), loader.sample_ids()))
    assert np.abs(tokens / tokens.sum() - [0.5, 0.3, 0.2]).max() < 0.01
    again = _mixture(1, 20)[0]
    for call in range(50):
        again.next_batch()
        assert again.sample_sources() == seen[2 * call][0] + seen[2 * call + 1][0]
        assert again.sample_ids() == seen[2 * call][1] + seen[2 * call + 1][1]
    resumed = _mixture(4, 5)
    for loader in resumed:
        loader.load_state_dict(ranks[0].state_dict())
    reference = _mixture(1, 20)[0]
    reference.load_state_dict(again.state_dict())
    for _ in range(5):
        batches = [loader.next_batch()[0] for loader in resumed]
        assert torch.equal(torch.cat(batches), reference.next_batch()[0])


def test_prepared_mixture_from_config(tmp_path: Path, tokenizer: Tokenizer) -> None:
    inputs = _write_inputs(tmp_path / "in")
    for name in ("a", "b"):
        prepare(inputs["txt"], tmp_path / name, PrepareOptions(tokenizer_path=TOKENIZER, val_docs=2))
    spec = f"{tmp_path / 'a'}:3,{tmp_path / 'b'}:1"
    cfg = Training(seq_len=16, local_batch_size=8, dataset="prepared", dataset_path=spec)
    loader = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1)
    loader.next_batch()
    assert loader.sample_sources().count(0) == 6 and loader.state_dict()["source0_share_ppm"] == 750_000
    listed = Training(seq_len=16, dataset_mixture=[f"{tmp_path / 'a'}:3", f"{tmp_path / 'b'}:1"])
    assert build_dataloader(listed, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1).shares.tolist() == [
        0.75,
        0.25,
    ]
    with pytest.raises(ValueError, match="not a prepared dataset"):
        build_dataloader(
            Training(dataset="prepared", dataset_path=str(tmp_path)), TOKENIZER, "", dp_rank=0, dp_degree=1
        )


def fake_hub(monkeypatch: pytest.MonkeyPatch, splits: dict[str, list[dict[str, str]]]) -> list[tuple[object, ...]]:
    """A stand-in `datasets` module serving ``splits`` as streams (the hub itself needs the network); the calls made."""
    import types

    calls: list[tuple[object, ...]] = []

    def load_dataset(repo: str, config: str | None, split: str, streaming: bool) -> list[dict[str, str]]:
        calls.append((repo, config, split, streaming))
        if split not in splits:
            raise ValueError(f"Bad split: {split}")
        return splits[split]

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def test_hub_input_streams_train_and_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer
) -> None:
    held = ["Persuasion, held out, chapter one.", "And chapter two."]
    calls = fake_hub(monkeypatch, {"train": [{"text": t} for t in TEXTS], "validation": [{"text": t} for t in held]})
    manifest = prepare(["hf:someone/tiny"], tmp_path / "out", PrepareOptions(tokenizer_path=TOKENIZER))
    assert calls == [("someone/tiny", None, "train", True), ("someone/tiny", None, "validation", True)]
    assert _decoded(PreparedSplit(tmp_path / "out"), tokenizer) == TEXTS
    assert manifest["splits"]["val"]["documents"] == len(held)
    budget = prepare(["hf:c4"], tmp_path / "c4", PrepareOptions(tokenizer_path=TOKENIZER, max_tokens=200))
    assert calls[2][:3] == ("allenai/c4", "en", "train") and budget["splits"]["train"]["tokens"] < 400


def test_hub_input_mistakes_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub(monkeypatch, {"train": [{"body": "no text field"}]})
    with pytest.raises(ValueError, match="no 'text' field: set --text-field"):
        prepare(["hf:someone/tiny"], tmp_path / "a", PrepareOptions(tokenizer_path=TOKENIZER))
    fake_hub(monkeypatch, {})
    with pytest.raises(ValueError, match="could not open hub dataset 'someone/none' split 'train'"):
        prepare(["hf:someone/none"], tmp_path / "b", PrepareOptions(tokenizer_path=TOKENIZER))
