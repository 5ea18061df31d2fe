"""`meshforge data prepare INPUT... --out DIR` (token shards + manifest), `data info DIR`, `data verify DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshforge.data import integrity
from meshforge.data.manifest import read_manifest
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="meshforge data", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize inputs into token shards with a held-out split")
    p.add_argument("inputs", nargs="+", help=".txt/.txt.gz files or folders, .jsonl(.gz), .parquet, hf:<dataset id>")
    p.add_argument("--out", required=True, help="output folder (must not already hold a prepared dataset)")
    p.add_argument(
        "--tokenizer", default=PrepareOptions.tokenizer_path, help="tokenizer.json, tiktoken file, hf:<repo>"
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: in this process)")
    p.add_argument("--text-field", default="text", help="field of .jsonl / .parquet / hub rows holding the text")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--val-docs", type=int, default=None, help="hold out the first N documents")
    held.add_argument("--val-fraction", type=float, default=None, help="hold out this share of documents (0.01)")
    p.add_argument("--shard-tokens", type=int, default=PrepareOptions.shard_tokens, help="tokens per shard at most")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many training tokens (0: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    info = commands.add_parser("info", help="print a prepared dataset's counts")
    info.add_argument("folder")
    check = commands.add_parser("verify", help="check every shard's sha256, every .idx and the manifest's counts")
    check.add_argument("folder")
    return top


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "info":
            manifest = read_manifest(Path(args.folder))
            print(json.dumps({k: manifest[k] for k in ("tokenizer", "dtype", "sources", "stats") if k in manifest}))
            for split, info in manifest["splits"].items():
                print(
                    f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {len(info['shards'])} shards"
                )
            return 0
        if args.command == "verify":
            return verify(Path(args.folder))
        fraction = args.val_fraction if args.val_fraction is not None else (0.0 if args.val_docs else 0.01)
        options = PrepareOptions(
            tokenizer_path=args.tokenizer,
            workers=args.workers,
            text_field=args.text_field,
            val_docs=args.val_docs or 0,
            val_fraction=fraction,
            shard_tokens=args.shard_tokens,
            max_tokens=args.max_tokens,
        )
        manifest = prepare(args.inputs, Path(args.out), options, progress=not args.no_progress and sys.stderr.isatty())
    except ValueError as error:
        raise ConfigError(str(error)) from None
    stats, splits = manifest["stats"], manifest["splits"]
    rate = stats["tokens"] / max(stats["seconds"], 1e-9)
    print(
        f"prepared {args.out}: train {splits['train']['documents']:,} documents / {splits['train']['tokens']:,} tokens,"
        f" val {splits['val']['documents']:,} / {splits['val']['tokens']:,}; {rate:,.0f} tokens/s"
    )
    return 0


def verify(folder: Path) -> int:
    """Print each bad file of a prepared dataset (exit 1) or that it is sound (exit 0)."""
    problems = integrity.verify(folder)
    for problem in problems:
        print(f"bad: {problem}", file=sys.stderr)
    if problems:
        print(f"{folder}: {len(problems)} bad file(s); prepare it again", file=sys.stderr)
        return 1
    manifest = read_manifest(folder)
    count = sum(len(info["shards"]) for info in manifest["splits"].values())
    print(f"{folder}: {count} shards verified (sha256, .idx, counts)")
    return 0
