"""Documents of the inputs `meshforge data prepare` accepts, streamed one at a time.

Local ``.txt`` / ``.txt.gz`` files (one document per file; a folder = its text files, recursively, sorted, with a
``val/`` subfolder marking held-out documents), ``.jsonl`` / ``.jsonl.gz`` (one document per line, in a text field),
``.parquet`` (a text column; needs pyarrow), or ``hf:<dataset id>`` (streamed with `datasets`, needs the network).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshforge.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


@dataclass(frozen=True)
class Document:
    """One document's text, where it came from, and whether its source marks it held out (a ``val/`` folder)."""

    text: str
    source: str
    held_out: bool = False


def read_text(path: Path) -> str:
    """A .txt or .txt.gz file as text (UTF-8; undecodable bytes become U+FFFD)."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def expand_inputs(inputs: list[str]) -> list[tuple[str, bool]]:
    """Each input as (file path or hub id, held out): folders become their supported files, sorted; files under a
    ``val`` folder of an input folder are held out. ValueError for a missing path or an unsupported file."""
    out: list[tuple[str, bool]] = []
    for item in inputs:
        if item.startswith("hf:"):
            out.append((item, False))
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUPPORTED))
            if not files:
                raise ConfigError(f"input folder {item!r} holds no {', '.join(SUPPORTED)} files")
            out += [(str(p), "val" in p.relative_to(path).parts[:-1]) for p in files]
        elif path.is_file():
            if not path.name.endswith(SUPPORTED):
                raise ConfigError(f"input {item!r}: unsupported file type; use {', '.join(SUPPORTED)} or hf:<dataset>")
            out.append((str(path), False))
        else:
            raise ConfigError(f"input {item!r} does not exist (a file, a folder, or hf:<dataset id>)")
    return out


def iter_documents(inputs: list[str], text_field: str = "text") -> Iterator[Document]:
    """Every document of the inputs, in order, one at a time."""
    for source, held_out in expand_inputs(inputs):
        if source.startswith("hf:"):
            yield from _hub_documents(source.removeprefix("hf:"), text_field)
        elif source.endswith(TEXT_SUFFIXES):
            yield Document(read_text(Path(source)), source, held_out)
        elif source.endswith(JSONL_SUFFIXES):
            yield from (Document(t, source, held_out) for t in _jsonl_texts(Path(source), text_field))
        else:
            yield from (Document(t, source, held_out) for t in _parquet_texts(Path(source), text_field))


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number} is not valid JSON ({error.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ConfigError(f"{path}:{number} has no {text_field!r} field ({keys}): set --text-field")
            yield str(row[text_field])


def _parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    file = pq.ParquetFile(path)
    if text_field not in file.schema_arrow.names:
        raise ConfigError(f"{path} has no {text_field!r} column ({file.schema_arrow.names}): set --text-field")
    for batch in file.iter_batches(columns=[text_field], batch_size=1024):
        yield from (str(t) for t in batch.column(0).to_pylist())


def _hub_documents(name: str, text_field: str) -> Iterator[Document]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"hub dataset {name!r} needs the `datasets` package: pip install -e '.[hub]'") from None
    repo, config = ("allenai/c4", "en") if name == "c4" else (name, None)
    for split, held_out in (("train", False), ("validation", True)):
        try:
            stream = datasets.load_dataset(repo, config, split=split, streaming=True)
        except Exception as error:
            if split == "validation":  # many hub datasets have no validation split
                return
            raise ConfigError(f"could not open hub dataset {repo!r} split {split!r} (needs network): {error}") from None
        for row in stream:
            if text_field not in row:
                raise ConfigError(f"hub dataset {repo!r} rows have no {text_field!r} field: set --text-field")
            yield Document(str(row[text_field]), f"hf:{repo}:{split}", held_out)
