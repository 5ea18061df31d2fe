"""Tokenizers: a `tokenizers`-library tokenizer.json, a tiktoken BPE file (Llama 3 ``tokenizer.model``) or a hub repo.

`build_tokenizer` picks the format from the path; every kind answers the same small interface (`Tokenizer`). No kind
adds special tokens on its own: the data pipeline wraps each document in ``bos_id`` ... ``eos_id`` itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

from meshforge.errors import ConfigError
from meshforge.paths import REPO_ROOT

BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"
# Fallback (bos, eos) names for hub tokenizers of other families.
SPECIAL_TOKEN_CANDIDATES = ((BOS_TOKEN, EOS_TOKEN), ("<s>", "</s>"), ("<|endoftext|>", "<|endoftext|>"))
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
FIX_HINT = (
    "set model.tokenizer_path to a tokenizer.json, a tiktoken BPE file (Llama 3 tokenizer.model) or hf:<repo>, "
    "or rebuild the shipped one with scripts/train_tokenizer.py"
)


class Tokenizer(ABC):
    """What the rest of meshforge needs from a tokenizer.

    Attributes:
        vocab_size: number of token ids (the model's embedding rows), special tokens included.
        bos_id / eos_id: ids of the begin- and end-of-text tokens.
        fingerprint: a hex digest that changes whenever the tokenizer's behaviour may change (used as a cache key).
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    fingerprint: str

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of text, with no special tokens added (special-token strings in text are not special)."""

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens included as their strings)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


class HFTokenizer(Tokenizer):
    """A `tokenizers`-library tokenizer (a tokenizer.json file or a hub repo)."""

    def __init__(self, tokenizer: RustTokenizer, source: str) -> None:
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_id, self.eos_id = self._special_ids(source)
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    def _special_ids(self, source: str) -> tuple[int, int]:
        for bos, eos in SPECIAL_TOKEN_CANDIDATES:
            bos_id, eos_id = self._tok.token_to_id(bos), self._tok.token_to_id(eos)
            if bos_id is not None and eos_id is not None:
                return int(bos_id), int(eos_id)
        raise ConfigError(f"tokenizer {source!r} has no {BOS_TOKEN}/{EOS_TOKEN} (nor <s>/</s>) tokens; {FIX_HINT}")

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Token ids of each text (encoded in parallel by the Rust library)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(encoding.ids) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (one ``base64-token rank`` per line, as Llama 3's tokenizer.model), with Llama 3's
    pre-tokenization pattern and its 256 special tokens numbered after the mergeable ranks."""

    def __init__(self, ranks: dict[bytes, int], name: str, fingerprint: str) -> None:
        import tiktoken

        num_base = len(ranks)
        specials = llama3_special_tokens()
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={token: num_base + i for i, token in enumerate(specials)},
        )
        self.vocab_size = num_base + len(specials)
        self.bos_id, self.eos_id = num_base, num_base + 1
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special-token strings are encoded as ordinary text."""
        return list(self._enc.encode_ordinary(text))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Token ids of each text (encoded on tiktoken's thread pool)."""
        return [list(ids) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (invalid UTF-8 byte sequences become U+FFFD)."""
        return str(self._enc.decode(list(ids)))


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (begin_of_text first, end_of_text second)."""
    named = [
        BOS_TOKEN,
        EOS_TOKEN,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL_TOKENS - 5)]
    return named + reserved


def resolve_path(path: str) -> Path:
    """path as given (absolute, or relative to the CWD), else relative to the repository root; ValueError if none."""
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return candidate
    if not candidate.is_absolute() and (REPO_ROOT / candidate).is_file():
        return REPO_ROOT / candidate
    looked = str(candidate) if candidate.is_absolute() else f"{Path.cwd()} and {REPO_ROOT}"
    raise ConfigError(f"tokenizer file {path!r} not found (looked in {looked}); {FIX_HINT}")


def read_tiktoken_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: ``base64-token rank`` per non-empty line; ValueError naming the first bad line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"tokenizer file {str(path)!r} is neither a tokenizer.json nor a tiktoken BPE file "
                f"(line {number}: {line[:40]!r}); {FIX_HINT}"
            ) from None
    if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"tokenizer file {str(path)!r} has no tokens or non-contiguous ranks; {FIX_HINT}")
    return ranks


def _load_json(path: Path, data: bytes) -> Tokenizer:
    try:
        json.loads(data)
        tokenizer = RustTokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # json, UTF-8 or the library's own parse errors
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"tokenizer file {str(path)!r} is not a valid tokenizer.json ({message}); {FIX_HINT}"
        ) from None
    return HFTokenizer(tokenizer, str(path))


def _load_hub(repo_id: str) -> Tokenizer:
    try:
        tokenizer = RustTokenizer.from_pretrained(repo_id)
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"tokenizer 'hf:{repo_id}' could not be fetched ({message}); {FIX_HINT}") from None
    return HFTokenizer(tokenizer, f"hf:{repo_id}")


def build_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at path: ``hf:<repo_id>`` (hub, needs network), a tokenizer.json, or a tiktoken BPE file.

    A relative path is looked up from the CWD, then from the repository root. A missing or unreadable file raises
    ValueError with one line naming the path and the fix.
    """
    if path.startswith("hf:"):
        return _load_hub(path.removeprefix("hf:"))
    resolved = resolve_path(path)
    data = resolved.read_bytes()
    if data.lstrip()[:1] == b"{":
        return _load_json(resolved, data)
    ranks = read_tiktoken_ranks(data, resolved)
    return TiktokenTokenizer(ranks, name=resolved.name, fingerprint=hashlib.sha256(data).hexdigest())
