"""Packing, the data-parallel loader's global-batch contract, its state and resharding, corpora and the cache."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.config.schema import Training
from meshforge.data.loader import (
    PackedDataLoader,
    build_dataloader,
    cache_dir,
    epoch_order,
    load_tokens,
    pack_documents,
)
from meshforge.data.tokenizer import REPO_ROOT, Tokenizer, build_tokenizer

SEQ = 7


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFORGE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer(str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json"))


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
    packed = pack_documents(docs, tokenizer.bos_id, tokenizer.eos_id)
    assert packed.dtype == np.int32
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
    assert sorted(first.tolist()) == list(range(50))
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
    assert sorted(seen_ids) == sorted(epoch_order(200, seed=3, epoch=0)[:consumed].tolist())


def test_state_from_another_dataset_is_refused() -> None:
    state = _loaders(_tokens(30), 1, 2)[0].state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        _loaders(_tokens(31), 1, 2)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _loaders(_tokens(30), 1, 2, seed=4)[0].load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataLoader(np.arange(8, dtype=np.int32), seq_len=8, local_batch_size=1, dp_rank=0, dp_degree=1, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedDataLoader(_tokens(4), seq_len=SEQ, local_batch_size=1, dp_rank=2, dp_degree=2, seed=0)
    with pytest.raises(ValueError, match="split"):
        load_tokens("austen", "", None, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dataset"):
        load_tokens("wikipedia", "", None)  # type: ignore[arg-type]


def test_austen_train_and_val(tokenizer: Tokenizer) -> None:
    train, val = load_tokens("austen", "", tokenizer), load_tokens("austen", "", tokenizer, split="val")
    assert 900_000 < len(train) < 1_200_000 and 100_000 < len(val) < 200_000
    assert train.dtype == val.dtype == np.int32 and int(train.max()) < tokenizer.vocab_size
    assert (train == tokenizer.bos_id).sum() == 5 and (val == tokenizer.bos_id).sum() == 1
    assert tokenizer.decode(val[1:20].tolist()).startswith("Persuasion")
    cfg = Training(seq_len=64, local_batch_size=2)
    train_x, _ = build_dataloader(cfg, tokenizer, dp_rank=0, dp_degree=1).next_batch()
    val_x, _ = build_dataloader(cfg, tokenizer, dp_rank=0, dp_degree=1, split="val").next_batch()
    assert not torch.equal(train_x, val_x)
    assert len(list(cache_dir().glob("*.npy"))) == 2 and not list(cache_dir().glob("*.tmp"))


def test_text_corpus_splits_and_cache(tokenizer: Tokenizer, tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("The first document. " * 40)
    (folder / "b.txt").write_text("The second document! " * 40)
    whole = load_tokens("text", str(folder), tokenizer)
    val = load_tokens("text", str(folder), tokenizer, split="val")
    assert (whole == tokenizer.bos_id).sum() == 2 and 0 < len(val) < len(whole) / 10
    (folder / "val").mkdir()
    (folder / "val" / "c.txt").write_text("Held out. " * 30)
    assert load_tokens("text", str(folder), tokenizer, split="val").tolist() == [
        tokenizer.bos_id,
        *tokenizer.encode("Held out. " * 30),
        tokenizer.eos_id,
    ]
    assert len(load_tokens("text", str(folder), tokenizer)) == len(whole) + len(val)  # no 5% cut any more
    (folder / "a.txt").write_text("Changed. " * 40)  # new contents: the cache must not serve the old tokens
    assert len(load_tokens("text", str(folder), tokenizer)) < len(whole)


def test_single_file_dataloader(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("A short text. " * 100)
    cfg = Training(seq_len=16, local_batch_size=4, dataset="text", dataset_path=str(path))
    inputs, labels = build_dataloader(cfg, tokenizer, dp_rank=1, dp_degree=2).next_batch()
    assert inputs.shape == (4, 16) and torch.equal(labels[:, :-1], inputs[:, 1:])
    with pytest.raises(ValueError, match="seq_len"):
        build_dataloader(
            Training(seq_len=10_000, dataset="text", dataset_path=str(path)), tokenizer, dp_rank=0, dp_degree=1
        )


def test_hub_dataset_without_datasets_package(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed; nothing touches the network
    with pytest.raises(ValueError, match="datasets"):
        load_tokens("c4", "", tokenizer)
