"""Tokenizers: the shipped Austen BPE, tiktoken files, path resolution and error messages."""

from __future__ import annotations

import base64
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshforge.data.tokenizer import REPO_ROOT, Tokenizer, build_tokenizer

SHIPPED = "data/tokenizer/austen-bpe-2048.json"
SAMPLE = (
    "It is a truth universally acknowledged, that a single man in possession\n"
    "of a good fortune, must be in want of a wife.\n\n“Mr. Bennet!” — £20,000, naïve café 12345 ☃ 日本"
)


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return build_tokenizer(str(REPO_ROOT / SHIPPED))


def test_shipped_vocab_and_specials(shipped: Tokenizer) -> None:
    assert shipped.vocab_size == 2048
    assert (shipped.bos_id, shipped.eos_id) == (0, 1)
    assert shipped.decode([shipped.bos_id, shipped.eos_id]) == "<|begin_of_text|><|end_of_text|>"


def test_shipped_round_trip(shipped: Tokenizer) -> None:
    ids = shipped.encode(SAMPLE)
    assert all(0 <= i < shipped.vocab_size for i in ids)
    assert shipped.bos_id not in ids and shipped.eos_id not in ids  # nothing added implicitly
    assert shipped.decode(ids) == SAMPLE
    assert len(ids) < len(SAMPLE.encode()) / 2  # it learned merges for English
    assert shipped.encode_batch([SAMPLE, "Emma", ""]) == [ids, shipped.encode("Emma"), []]


def test_relative_path_resolves_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer(SHIPPED).vocab_size == 2048


def test_training_is_deterministic_and_exact_size() -> None:
    script = _load_script("train_tokenizer")
    corpus = [SAMPLE * 3, "Persuasion and Emma; Northanger Abbey. " * 20, "Mansfield Park, Pride and Prejudice. " * 20]
    first, second = script.train(corpus, 300), script.train(corpus, 300)
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 300
    assert first.token_to_id("<|begin_of_text|>") == 0 and first.token_to_id("<|end_of_text|>") == 1


def _write_tiktoken(path: Path) -> None:
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"he"] = 256
    ranks[b"the"] = 257
    ranks[b" the"] = 258
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    path.write_text("\n".join(lines) + "\n")


def test_tiktoken_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    _write_tiktoken(path)
    tok = build_tokenizer(str(path))
    assert tok.vocab_size == 259 + 256  # mergeable ranks + Llama 3's 256 special tokens
    assert (tok.bos_id, tok.eos_id) == (259, 260)
    assert tok.encode("the") == [257]
    assert tok.encode(" the") == [258]
    text = "the cat saw the other one, naïve ☃\n<|end_of_text|>"
    ids = tok.encode(text)
    assert tok.eos_id not in ids  # special-token strings in text are plain text
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "the"]) == [ids, [257]]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_missing_file_error_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        build_tokenizer("no/such/tokenizer.json")
    message = str(info.value)
    assert "no/such/tokenizer.json" in message and "model.tokenizer_path" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "content",
    [b'{"version": "1.0", "model": ', b'{"not": "a tokenizer"}', b"this is not base64 !!! 7\n", b"\xff\xfe\x00"],
)
def test_corrupt_file_raises_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"broken\.json") as info:
        build_tokenizer(str(path))
    assert "\n" not in str(info.value)
