#!/usr/bin/env python3
"""Train the shipped byte-level BPE tokenizer (vocab 2048) on the Austen training novels.

Usage (from the repository root)::

    python scripts/train_tokenizer.py            # writes data/tokenizer/austen-bpe-2048.json

The tokenizer splits text with the Llama 3 pre-tokenization pattern, maps bytes to printable characters (GPT-2 byte
level: every byte string is encodable, nothing is unknown) and learns merges with the `tokenizers` library's BPE
trainer. Special tokens ``<|begin_of_text|>`` and ``<|end_of_text|>`` take ids 0 and 1; they are never added
automatically (the data pipeline inserts them around each document). Training is deterministic: a rerun on the same
corpus writes the same file.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>"]
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_untrained(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """An empty byte-level BPE tokenizer with the Llama 3 pre-tokenizer, and its trainer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tokenizer, trainer


def read_corpus(folder: Path) -> list[str]:
    """The training novels: every *.txt.gz directly in folder (the held-out val/ subfolder is not read), sorted."""
    files = sorted(folder.glob("*.txt.gz"))
    if not files:
        raise SystemExit(f"no *.txt.gz in {folder}: run scripts/extract_austen.py first")
    return [gzip.decompress(path.read_bytes()).decode("utf-8") for path in files]


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train the BPE on texts and check it reached exactly vocab_size tokens."""
    tokenizer, trainer = build_untrained(vocab_size)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(f"trained vocab has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """Train and save the tokenizer; print its path and size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=REPO_ROOT / "data" / "austen", help="folder of *.txt.gz")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")
    args = parser.parse_args(argv)
    tokenizer = train(read_corpus(args.corpus), args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out), pretty=True)
    print(f"{args.out}: vocab {tokenizer.get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
