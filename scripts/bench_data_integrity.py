#!/usr/bin/env python3
"""The cost of checking shard checksums off the step's path (issue 36, docs/benchmarks/data-integrity.md).

Usage (from the repository root)::

    .venv/bin/python scripts/bench_data_integrity.py make /tmp/integrity --gigabytes 1   # seeded synthetic tokens
    .venv/bin/python scripts/bench_data_integrity.py measure /tmp/integrity --steps 60 --repeats 2
    rm -rf /tmp/integrity

`make` writes random token ids (the shipped 2048-token tokenizer's range, documents of 64-4096 tokens) with the
project's own shard writer (data/shards.py: ShardWriter, write_manifest), so the folder is a prepared dataset.
`measure` times opening the train split with data.verify = sizes / cheap / full, how long the reader thread of
cheap takes to hash every shard, and `meshforge train` (tiny model) with data.verify = cheap vs sizes, alternating:
the median step time, the data-loading share and the first step's time (where a wait for a shard's hash would show).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = str(REPO / "data" / "tokenizer" / "austen-bpe-2048.json")


def make(folder: Path, gigabytes: float, seed: int = 36) -> None:
    """A prepared dataset of ``gigabytes`` GB of uint16 tokens in shards of 2^26 tokens (128 MB), one val shard."""
    from meshforge.data.manifest import FORMAT
    from meshforge.data.shards import ShardWriter, token_dtype, write_manifest
    from meshforge.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER)
    folder.mkdir(parents=True, exist_ok=True)
    rng, dtype = np.random.default_rng(seed), token_dtype(tokenizer.vocab_size)
    budget = {"train": int(gigabytes * 1e9) // dtype.itemsize, "val": 1 << 20}
    splits = {}
    for split, tokens in budget.items():
        writer, written = ShardWriter(folder, split, dtype, 1 << 26), 0
        while written < tokens:
            n = int(min(rng.integers(64, 4097), tokens - written))
            writer.add(rng.integers(0, tokenizer.vocab_size, n, dtype=np.int64))
            written += n
        entries = writer.close()
        splits[split] = {
            "tokens": sum(s["tokens"] for s in entries),
            "documents": sum(s["documents"] for s in entries),
            "shards": entries,
        }
    manifest = {
        "format": FORMAT,
        "tokenizer": {"source": TOKENIZER, "fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size},
        "dtype": dtype.name,
        "sources": [f"synthetic seed {seed}"],
        "splits": splits,
    }
    write_manifest(folder, manifest)
    size = sum(p.stat().st_size for p in folder.glob("*.bin"))
    print(f"{folder}: {size / 1e9:.2f} GB in {len(splits['train']['shards'])} train shards (seed {seed})")


def open_times(folder: Path) -> dict[str, float]:
    """Seconds to open the train split per data.verify, and for cheap the reader thread's time to hash every shard."""
    from meshforge.data.shards import PreparedSplit

    out = {}
    for mode in ("sizes", "cheap", "full"):
        began = time.perf_counter()
        split = PreparedSplit(folder, verify=mode)
        out[f"open_{mode}_s"] = time.perf_counter() - began
        if mode == "cheap":
            assert split._checker is not None
            for thread in split._checker.threads:
                thread.join()
            out["cheap_thread_all_hashed_s"] = time.perf_counter() - began
            assert not any(split._checker.results.values()), split._checker.results
    return out


def train_once(folder: Path, verify: str, steps: int, dump: Path) -> dict[str, float]:
    """One `meshforge train` (tiny, one process) on ``folder``; its step times from metrics.jsonl."""
    args = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "8"]
    args += ["--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.progress_bar", "false"]
    args += ["--training.dataset", "prepared", "--training.dataset_path", str(folder), "--data.verify", verify]
    args += ["--model.tokenizer_path", TOKENIZER, "--job.dump_folder", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "meshforge", "train", *args], check=True, env=env, capture_output=True)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in rows if r["step"] > 2]
    return {
        "wall_s": wall,
        "first_step_s": rows[0]["step_time_s"],
        "median_step_s": statistics.median(steady),
        "data_pct": statistics.median(r["data_loading_pct"] for r in rows if r["step"] > 2),
    }


def measure(folder: Path, steps: int, repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = open_times(folder)
    runs: dict[str, list[dict[str, float]]] = {"sizes": [], "cheap": []}
    for r in range(repeats):  # alternating, so a change in the machine's load hits both
        for verify in ("sizes", "cheap"):
            runs[verify].append(train_once(folder, verify, steps, folder.parent / f"run-{verify}-{r}"))
    for verify, rows in runs.items():
        result[f"train_{verify}"] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    result["gigabytes"] = sum(p.stat().st_size for p in folder.glob("train-*.bin")) / 1e9
    print(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("folder", type=Path)
    made.add_argument("--gigabytes", type=float, default=1.0)
    measured = sub.add_parser("measure")
    measured.add_argument("folder", type=Path)
    measured.add_argument("--steps", type=int, default=60)
    measured.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.command == "make":
        make(args.folder, args.gigabytes)
    else:
        measure(args.folder, args.steps, args.repeats)


if __name__ == "__main__":
    main()
