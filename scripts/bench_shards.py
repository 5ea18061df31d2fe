#!/usr/bin/env python3
"""Prepared shards at scale (issue 23, docs/benchmarks/data.md): a reproducible synthetic corpus, `data prepare`
throughput with 1 and 2 workers beside the tokenizer's single-thread encode speed, the loader's tokens/s, and the cost
of `data verify` per GB.

Usage (from the repository root, PYTHONPATH=src)::

    python scripts/bench_shards.py corpus /tmp/corpus --megabytes 200     # seeded: the same bytes every time
    RAYON_NUM_THREADS=1 python scripts/bench_shards.py prepare /tmp/corpus --work /tmp/prep --workers 1 2
    python scripts/bench_shards.py loader /tmp/prep/w1 --batches 400         # run once per code version, alternating
    python scripts/bench_shards.py read /tmp/prep/w1 --max-open 512         # microseconds per read window
    python scripts/bench_shards.py verify /tmp/prep/w1

The corpus is Austen's paragraphs drawn with a seeded generator into .jsonl files of about 64 MB; it is not shipped
(generate it into /tmp and delete it after).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = str(REPO / "data" / "tokenizer" / "austen-bpe-2048.json")


def paragraphs() -> list[str]:
    """The paragraphs of the shipped Austen novels."""
    found = []
    for path in sorted((REPO / "data" / "austen").glob("*.txt.gz")):
        text = gzip.decompress(path.read_bytes()).decode()
        found += [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
    return found


def make_corpus(folder: Path, megabytes: int, seed: int = 23) -> None:
    """Documents of 2-40 random paragraphs, written as .jsonl files of about 64 MB, until ``megabytes`` MB."""
    rng, pool = random.Random(seed), paragraphs()
    folder.mkdir(parents=True, exist_ok=True)
    written, part = 0, 0
    while written < megabytes * 1_000_000:
        with open(folder / f"part-{part:04d}.jsonl", "w") as f:
            size = 0
            while size < 64_000_000 and written + size < megabytes * 1_000_000:
                text = "\n\n".join(rng.choice(pool) for _ in range(rng.randint(2, 40)))
                size += f.write(json.dumps({"text": text}) + "\n")
        written, part = written + size, part + 1
    print(f"{folder}: {written / 1e6:.1f} MB in {part} files (seed {seed})")


def encode_speed(folder: Path, megabytes: float = 4.0) -> tuple[float, float]:
    """(MB/s, tokens/s) of the tokenizer's own single-thread encode on the first ``megabytes`` of the corpus."""
    from meshforge.data.tokenizer import build_tokenizer

    tokenizer, texts, size = build_tokenizer(TOKENIZER), [], 0
    with open(sorted(folder.glob("*.jsonl"))[0]) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= megabytes * 1e6:
                break
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    seconds = time.perf_counter() - start
    return size / 1e6 / seconds, tokens / seconds


def prepare_run(corpus: Path, out: Path, workers: int) -> dict[str, float]:
    """`meshforge data prepare` in a fresh process: seconds, tokens, MB of input and the largest process's peak RSS."""
    entry = "import sys; from meshforge.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", entry, "data", "prepare", str(corpus), "--out", str(out)]
    command += ["--workers", str(workers), "--val-docs", "100", "--no-progress", "--tokenizer", TOKENIZER]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "RAYON_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    manifest = json.loads((out / "manifest.json").read_text())
    megabytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "tokens": manifest["stats"]["tokens"], "mb": megabytes, "peak_rss_mib": peak}


def loader_speed(
    folder: Path, batches: int, max_open: int = 0, seq_len: int = 2048, batch: int = 8
) -> dict[str, float]:
    """Tokens/s of the training loader alone (shuffled, document positions), the open files at the end and the peak
    resident memory of this process (VmHWM, MiB)."""
    from meshforge.data.loader import PackedDataLoader
    from meshforge.data.shards import PreparedSplit

    split = PreparedSplit(folder, max_open_shards=max_open) if max_open else PreparedSplit(folder)
    loader = PackedDataLoader(
        [split], seq_len=seq_len, local_batch_size=batch, dp_rank=0, dp_degree=1, seed=1, with_positions=True
    )
    loader.next_batch()
    start = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
        loader.positions()
    seconds = time.perf_counter() - start
    shards = len(split.shard_names)
    fds = len(os.listdir("/proc/self/fd"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "tokens_per_s": batches * batch * seq_len / seconds,
        "shards": shards,
        "open_fds": fds,
        "peak_rss_mib": peak,
    }


def read_cost(folder: Path, windows: int = 4000, max_open: int = 512, length: int = 2049) -> dict[str, float]:
    """Microseconds per `PreparedSplit.read` and `document_starts` of random windows (after 500 warm-up windows)."""
    import numpy as np

    from meshforge.data.shards import PreparedSplit

    split = PreparedSplit(folder, max_open_shards=max_open)
    starts = np.random.default_rng(0).integers(0, split.num_tokens - length, size=windows)
    for start in starts[:500]:
        split.read(int(start), length), split.document_starts(int(start), length - 1)
    began = time.perf_counter()
    for start in starts:
        split.read(int(start), length)
    read = time.perf_counter() - began
    began = time.perf_counter()
    for start in starts:
        split.document_starts(int(start), length - 1)
    found = time.perf_counter() - began
    return {"read_us": read / windows * 1e6, "document_starts_us": found / windows * 1e6}


def verify_cost(folder: Path) -> dict[str, float]:
    """Seconds per GB of `data verify` (every sha256 and .idx; the page cache as it is)."""
    from meshforge.data import integrity

    size = sum(p.stat().st_size for p in folder.glob("*.bin")) / 1e9
    start = time.perf_counter()
    problems = integrity.verify(folder)
    seconds = time.perf_counter() - start
    return {"gb": size, "seconds": seconds, "seconds_per_gb": seconds / size, "problems": len(problems)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("corpus")
    c.add_argument("folder", type=Path)
    c.add_argument("--megabytes", type=int, default=1000)
    p = commands.add_parser("prepare")
    p.add_argument("corpus", type=Path)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    lo = commands.add_parser("loader")
    lo.add_argument("folder", type=Path)
    lo.add_argument("--batches", type=int, default=400)
    lo.add_argument("--max-open", type=int, default=0, help="data.max_open_shards (0: the default; old code: none)")
    r = commands.add_parser("read")
    r.add_argument("folder", type=Path)
    r.add_argument("--max-open", type=int, default=512)
    v = commands.add_parser("verify")
    v.add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "corpus":
        make_corpus(args.folder, args.megabytes)
    elif args.command == "prepare":
        mb_s, tok_s = encode_speed(args.corpus)
        print(json.dumps({"encode_one_thread": {"mb_per_s": round(mb_s, 3), "tokens_per_s": round(tok_s)}}))
        for workers in args.workers:
            r = prepare_run(args.corpus, args.work / f"w{workers}", workers)
            r |= {"tokens_per_s": r["tokens"] / r["seconds"], "gb_per_hour": r["mb"] / 1e3 / r["seconds"] * 3600}
            print(json.dumps({f"prepare_{workers}_workers": {k: round(x, 3) for k, x in r.items()}}), flush=True)
    elif args.command == "loader":
        print(json.dumps({k: round(x, 1) for k, x in loader_speed(args.folder, args.batches, args.max_open).items()}))
    elif args.command == "read":
        print(json.dumps({k: round(x, 1) for k, x in read_cost(args.folder, max_open=args.max_open).items()}))
    else:
        print(json.dumps({k: round(x, 3) for k, x in verify_cost(args.folder).items()}))


if __name__ == "__main__":
    main()
