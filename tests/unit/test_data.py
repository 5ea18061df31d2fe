"""Packing, the data-parallel loader's global-batch contract, its state and resharding, corpora and the cache."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.config.schema import Training
from meshforge.data.corpus import prepared_root
from meshforge.data.loader import ArrayStream, PackedDataLoader, build_dataloader, document_positions
from meshforge.data.order import epoch_order, feistel_permute, order_key
from meshforge.data.prepare import encode_packed
from meshforge.data.tokenizer import REPO_ROOT, Tokenizer, build_tokenizer

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")

SEQ = 7


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(TOKENIZER)


def _tokens(num_samples: int) -> np.ndarray:
    """A stream whose token at position p is p: sample i's window starts at i*SEQ."""
    return np.arange(num_samples * SEQ + 1, dtype=np.int32)


def _loaders(tokens: np.ndarray, degree: int, batch: int, seed: int = 3) -> list[PackedDataLoader]:
    return [
        PackedDataLoader(tokens, seq_len=SEQ, local_batch_size=batch, dp_rank=r, dp_degree=degree, seed=seed)
        for r in range(degree)
    ]


def _step(loaders: list[PackedDataLoader]) -> tuple[torch.Tensor, torch.Tensor]:
    """One call on every rank, batches concatenated in rank order."""
    batches = [loader.next_batch() for loader in loaders]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def test_packing_and_shifted_labels(tokenizer: Tokenizer) -> None:
    docs = tokenizer.encode_batch(["Emma Woodhouse, handsome.", "Anne Elliot"])
    packed, lengths = encode_packed(tokenizer, ["Emma Woodhouse, handsome.", "Anne Elliot"], np.dtype(np.uint16))
    assert packed.dtype == np.uint16 and lengths.tolist() == [len(docs[0]) + 2, len(docs[1]) + 2]
    assert packed.tolist() == [0, *docs[0], 1, 0, *docs[1], 1]
    loader = PackedDataLoader(packed, seq_len=4, local_batch_size=2, dp_rank=0, dp_degree=1, seed=0, shuffle=False)
    inputs, labels = loader.next_batch()
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (2, 4)
    assert inputs.flatten().tolist() == packed[:8].tolist()
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    assert labels.flatten().tolist() == packed[1:9].tolist()


def test_samples_are_windows_of_the_stream() -> None:
    loader = _loaders(_tokens(20), 1, 5)[0]
    for _ in range(6):
        inputs, labels = loader.next_batch()
        starts = torch.tensor(loader.sample_ids()) * SEQ
        assert torch.equal(inputs, starts[:, None] + torch.arange(SEQ))
        assert torch.equal(labels, inputs + 1)


def test_epoch_order_is_a_seeded_permutation() -> None:
    first = epoch_order(50, seed=1, epoch=0)
    assert sorted(first.tolist()) == list(range(50)) and first.tolist() != list(range(50))
    assert np.array_equal(first, epoch_order(50, seed=1, epoch=0))
    assert not np.array_equal(first, epoch_order(50, seed=1, epoch=1))
    assert not np.array_equal(first, epoch_order(50, seed=2, epoch=0))
    assert epoch_order(5, seed=1, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_global_batch_equivalence(degree: int) -> None:
    tokens, batch = _tokens(50), 12 // degree  # global batch 12: the 10 calls cross two epoch boundaries
    reference = _loaders(tokens, 1, degree * batch)[0]
    ranks = _loaders(tokens, degree, batch)
    for call in range(10):
        inputs, labels = _step(ranks)
        ref_inputs, ref_labels = reference.next_batch()
        assert torch.equal(inputs, ref_inputs) and torch.equal(labels, ref_labels)
        positions = [p for loader in ranks for p in loader.sample_positions()]
        assert positions == list(range(call * degree * batch, (call + 1) * degree * batch))
    assert all(loader.state_dict() == reference.state_dict() for loader in ranks)
    assert reference.epoch == 120 // 50


def test_each_epoch_visits_every_sample_once() -> None:
    loader = _loaders(_tokens(12), 1, 4)[0]
    epochs = []
    for _ in range(2):
        ids = []
        for _ in range(3):
            loader.next_batch()
            ids += loader.sample_ids()
        epochs.append(ids)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12))
    assert epochs[0] != epochs[1]


def test_state_round_trip() -> None:
    tokens = _tokens(30)
    original = _loaders(tokens, 2, 4)
    for _ in range(5):
        _step(original)
    states = [loader.state_dict() for loader in original]
    assert states[0] == states[1] and states[0]["global_position"] == 40
    restored = _loaders(tokens, 2, 4)
    for loader, state in zip(restored, states, strict=True):
        loader.load_state_dict(state)
    for _ in range(6):
        expected, got = _step(original), _step(restored)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_resharding_4_to_2_neither_repeats_nor_skips() -> None:
    tokens = _tokens(200)
    before = _loaders(tokens, 4, 2)
    seen_ids, seen_positions = [], []
    for _ in range(5):
        for loader in before:
            loader.next_batch()
            seen_ids += loader.sample_ids()
            seen_positions += loader.sample_positions()
    after = _loaders(tokens, 2, 3)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    for _ in range(7):
        for loader in after:
            loader.next_batch()
            seen_ids += loader.sample_ids()
            seen_positions += loader.sample_positions()
    consumed = 5 * 4 * 2 + 7 * 2 * 3
    assert sorted(seen_positions) == list(range(consumed))
    assert len(set(seen_ids)) == consumed  # all within epoch 0: distinct samples
    assert sorted(seen_ids) == sorted(epoch_order(200, seed=3, epoch=0, stream=0)[:consumed].tolist())


def test_state_from_another_dataset_is_refused() -> None:
    state = _loaders(_tokens(30), 1, 2)[0].state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        _loaders(_tokens(31), 1, 2)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _loaders(_tokens(30), 1, 2, seed=4)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="order_version"):  # a checkpoint of the old argsort order
        _loaders(_tokens(30), 1, 2)[0].load_state_dict({**state, "order_version": 1})


def test_feistel_is_a_permutation_of_any_size() -> None:
    for n in (1, 2, 3, 7, 64, 1000, 12_345):
        image = feistel_permute(np.arange(n), n, order_key(5, 0))
        assert sorted(image.tolist()) == list(range(n))
    big = 10**12  # no array over the domain: a few positions of a huge corpus cost nothing
    some = feistel_permute(np.arange(5), big, order_key(1, 2))
    assert len(set(some.tolist())) == 5 and (some < big).all() and some.max() > 10**9


def test_order_key_separates_seed_epoch_and_stream() -> None:
    keys = {order_key(s, e, d) for s in range(3) for e in range(3) for d in range(3)}
    assert len(keys) == 27


def test_document_positions_restart_at_each_start() -> None:
    assert document_positions(np.array([0, 3]), 6).tolist() == [0, 1, 2, 0, 1, 2]
    assert document_positions(np.array([2, 5]), 7).tolist() == [0, 1, 0, 1, 2, 0, 1]
    assert document_positions(np.zeros(0, dtype=np.int64), 4).tolist() == [0, 1, 2, 3]
    stream = ArrayStream(np.arange(20), doc_starts=np.array([0, 5, 13]))
    loader = PackedDataLoader(
        stream, seq_len=9, local_batch_size=2, dp_rank=0, dp_degree=1, seed=0, shuffle=False, with_positions=True
    )
    loader.next_batch()
    assert loader.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3, 4]]


def test_shuffled_document_positions_restart_at_each_bos() -> None:
    """With shuffle, each row's positions belong to the sample it holds: 0 exactly at a BOS (and at the window's
    first token), +1 everywhere else."""
    rng, bos, seq = np.random.default_rng(0), 1, 8
    lengths = rng.integers(2, 13, size=40)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = rng.integers(2, 100, size=int(lengths.sum()))
    tokens[starts] = bos
    stream = ArrayStream(tokens, doc_starts=starts)
    loader = PackedDataLoader(
        stream, seq_len=seq, local_batch_size=4, dp_rank=0, dp_degree=1, seed=5, shuffle=True, with_positions=True
    )
    ids = []
    for _ in range(6):
        inputs, _ = loader.next_batch()
        ids += loader.sample_ids()
        positions = loader.positions()
        expected_zero = (inputs == bos) | (torch.arange(seq) == 0)
        assert torch.equal(positions == 0, expected_zero), (
            f"positions {positions.tolist()} do not restart at the BOS of inputs {inputs.tolist()}: document positions"
            " of other samples than the shuffled ids"
        )
        steps = positions[:, 1:] - positions[:, :-1]
        assert bool(((steps == 1) | (positions[:, 1:] == 0)).all())
    assert ids != sorted(ids)  # shuffled: the running index and the sample ids differ


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataLoader(np.arange(8, dtype=np.int32), seq_len=8, local_batch_size=1, dp_rank=0, dp_degree=1, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedDataLoader(_tokens(4), seq_len=SEQ, local_batch_size=1, dp_rank=2, dp_degree=2, seed=0)
    cfg = Training()
    with pytest.raises(ValueError, match="split"):
        build_dataloader(cfg, TOKENIZER, "", dp_rank=0, dp_degree=1, split="test")
    with pytest.raises(ValueError, match="dataset"):
        build_dataloader(Training(dataset="wikipedia"), TOKENIZER, "", dp_rank=0, dp_degree=1)


def test_austen_is_prepared_once_and_read_by_windows(tokenizer: Tokenizer) -> None:
    cfg = Training(seq_len=64, local_batch_size=2)
    train = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1)
    val = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1, split="val")
    (folder,) = [p for p in prepared_root().iterdir() if p.is_dir()]
    train_stream, val_stream = train.streams[0], val.streams[0]
    assert 900_000 < train_stream.num_tokens < 1_200_000 and 100_000 < val_stream.num_tokens < 200_000
    assert isinstance(train_stream.read(0, 4), np.ndarray)
    assert train_stream._files.tokens(0, 0, 4).tolist() == train_stream.read(0, 4).tolist()  # type: ignore[attr-defined]
    assert train_stream.num_documents == 5 and val_stream.num_documents == 1  # type: ignore[attr-defined]
    assert tokenizer.decode(val_stream.read(1, 20).tolist()).startswith("Persuasion")
    train_x, _ = train.next_batch()
    val_x, _ = val.next_batch()
    assert not torch.equal(train_x, val_x) and int(train_x.max()) < tokenizer.vocab_size
    mtime = (folder / "manifest.json").stat().st_mtime_ns
    build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=1, dp_degree=2)  # cached: not prepared again
    assert (folder / "manifest.json").stat().st_mtime_ns == mtime
    assert not [p for p in prepared_root().iterdir() if ".tmp" in p.name]
    with pytest.raises(ValueError, match="another tokenizer"):
        build_dataloader(cfg, TOKENIZER, "0" * 64, dp_rank=0, dp_degree=1)


def test_text_corpus_splits_and_cache(tokenizer: Tokenizer, tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(40):
        (folder / f"d{i:02d}.txt").write_text(f"Document number {i}. " * 20)
    cfg = Training(seq_len=16, local_batch_size=4, dataset="text", dataset_path=str(folder))
    train = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1)
    val = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1, split="val")
    assert train.streams[0].num_documents + val.streams[0].num_documents == 40  # type: ignore[attr-defined]
    assert 1 <= val.streams[0].num_documents <= 4  # type: ignore[attr-defined]  # 5 % of the documents
    (folder / "val").mkdir()
    (folder / "val" / "c.txt").write_text("Held out. " * 30)
    val = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1, split="val")
    stream = val.streams[0]
    assert stream.read(0, stream.num_tokens).tolist() == [tokenizer.bos_id, *tokenizer.encode("Held out. " * 30), 1]
    (folder / "d00.txt").write_text("Changed. " * 400)  # new contents: the cache must not serve the old tokens
    again = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1)
    assert again.streams[0].num_tokens > train.streams[0].num_tokens


def test_single_file_dataloader(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("A short text. " * 100)
    cfg = Training(seq_len=16, local_batch_size=4, dataset="text", dataset_path=str(path))
    inputs, labels = build_dataloader(cfg, TOKENIZER, tokenizer.fingerprint, dp_rank=1, dp_degree=2).next_batch()
    assert inputs.shape == (4, 16) and torch.equal(labels[:, :-1], inputs[:, 1:])
    with pytest.raises(ValueError, match="seq_len"):
        build_dataloader(
            Training(seq_len=10_000, dataset="text", dataset_path=str(path)),
            TOKENIZER,
            tokenizer.fingerprint,
            dp_rank=0,
            dp_degree=1,
        )


def test_hub_dataset_without_datasets_package(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed; nothing touches the network
    with pytest.raises(ValueError, match="datasets"):
        build_dataloader(Training(dataset="c4"), TOKENIZER, tokenizer.fingerprint, dp_rank=0, dp_degree=1)
