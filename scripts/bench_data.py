#!/usr/bin/env python3
"""Data pipeline figures: preparation throughput, a training rank's resident memory against corpus size, and the
data-loading share of the step time (docs/benchmarks/data.md).

Usage (from the repository root)::

    RAYON_NUM_THREADS=1 python scripts/bench_data.py --out /tmp/data-bench [--repeat 2] [--steps 10]

1. The tokenizer's own single-thread ``encode`` speed on the Austen text, then ``prepare`` of the same text (repeated
   ``--repeat`` times) with 1 and 2 workers (RAYON_NUM_THREADS=1: one encoder thread per worker).
2. Two prepared corpora synthesised from the Austen documents' tokens, repeated in shuffled order to about 10 MB and
   200 MB of shards; for each, a fresh process trains the tiny flavor ``--steps`` steps on it and reports its peak
   resident memory (VmHWM) and, at the end, anonymous vs file-backed resident memory (RssAnon / RssFile).
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from meshforge.data import shards
from meshforge.data.manifest import MANIFEST
from meshforge.data.prepare import PrepareOptions, prepare
from meshforge.data.shards import PreparedSplit
from meshforge.data.sources import iter_documents
from meshforge.data.tokenizer import build_tokenizer
from meshforge.paths import REPO_ROOT

TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "austen-bpe-2048.json")
AUSTEN = REPO_ROOT / "data" / "austen"


def encode_speed(texts: list[str]) -> tuple[float, float]:
    """(MB/s, tokens/s) of single-thread ``encode`` over texts."""
    tokenizer = build_tokenizer(TOKENIZER)
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    seconds = time.perf_counter() - start
    return sum(len(t.encode()) for t in texts) / seconds / 1e6, tokens / seconds


def prepare_speed(out: Path, repeat: int, workers: int) -> tuple[float, float, int]:
    """(MB/s, tokens/s, tokens) of `prepare` on the Austen files repeated ``repeat`` times."""
    inputs = [str(AUSTEN)] * repeat
    target = out / f"prep-w{workers}"
    if target.exists():
        for path in target.iterdir():
            path.unlink()
        target.rmdir()
    size = sum(len(d.text.encode()) for d in iter_documents(inputs))
    start = time.perf_counter()
    manifest = prepare(inputs, target, PrepareOptions(tokenizer_path=TOKENIZER, workers=workers))
    seconds = time.perf_counter() - start
    tokens = manifest["stats"]["tokens"]
    return size / seconds / 1e6, tokens / seconds, tokens


def synthesise(out: Path, megabytes: int) -> Path:
    """A prepared corpus of about ``megabytes`` MB of shards: the Austen train documents, repeated, shuffled."""
    folder = out / f"corpus-{megabytes}mb"
    if (folder / MANIFEST).is_file():
        return folder
    source = PreparedSplit(prepare_source(out), "train")
    val = PreparedSplit(prepare_source(out), "val")
    documents = [source.document(d) for d in range(source.num_documents)]
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16)
    writers = {s: shards.ShardWriter(folder, s, dtype, 1 << 25) for s in shards.SPLITS}
    written = 0
    while written < megabytes * 1e6:
        doc = documents[rng.randrange(len(documents))]
        cut = rng.randrange(len(doc) // 2)  # a shuffled slice, so repeats are not aligned
        piece = np.concatenate([[doc[0]], doc[1 + cut :]])
        writers["train"].add(piece)
        written += 2 * len(piece)
    writers["val"].add(val.document(0))
    manifest = json.loads((prepare_source(out) / MANIFEST).read_text())
    manifest["splits"] = {}
    for split, writer in writers.items():
        entries = writer.close()
        manifest["splits"][split] = {
            "tokens": sum(e["tokens"] for e in entries),
            "documents": sum(e["documents"] for e in entries),
            "shards": entries,
        }
    manifest["sources"] = [f"synthetic: Austen train documents repeated to {megabytes} MB"]
    shards.write_manifest(folder, manifest)
    return folder


def prepare_source(out: Path) -> Path:
    folder = out / "austen"
    if not (folder / MANIFEST).is_file():
        prepare([str(AUSTEN)], folder, PrepareOptions(tokenizer_path=TOKENIZER))
    return folder


RANK = """
import json, sys
from meshforge.config.io import load_config
from meshforge.train.loop import train
records = train(load_config(None, sys.argv[1:]))
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda k: int(status[k].split()[0])
print(json.dumps({"hwm": kib("VmHWM"), "anon": kib("RssAnon"), "file": kib("RssFile"),
                  "data_pct": sum(r["data_loading_pct"] for r in records[1:]) / max(1, len(records) - 1)}))
"""


def rank_memory(folder: Path, steps: int, dump: Path) -> dict[str, float]:
    """Peak and final resident memory (MiB) and mean data-loading share of one training process on folder."""
    args = ["--model.flavor", "tiny", "--training.dataset", "prepared", "--training.dataset_path", str(folder)]
    args += ["--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", str(dump)]
    args += ["--training.mixed_precision_param", "float32", "--validation.enable", "--validation.freq", str(steps)]
    result = subprocess.run([sys.executable, "-c", RANK, *args], capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return {k: (v / 1024 if k != "data_pct" else v) for k, v in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}")
    texts = [d.text for d in iter_documents([str(AUSTEN)] * args.repeat)]
    mbs, tps = encode_speed(texts)
    print("| what | MB/s | tokens/s | tokens/s per worker |\n|---|---|---|---|")
    print(f"| tokenizer `encode`, one thread | {mbs:.2f} | {tps:,.0f} | {tps:,.0f} |")
    for workers in (1, 2):
        mbs, tps, tokens = prepare_speed(args.out, args.repeat, workers)
        print(f"| `prepare`, {workers} worker(s), {tokens:,} tokens | {mbs:.2f} | {tps:,.0f} | {tps / workers:,.0f} |")
    print("\n| prepared corpus | shard MB | peak RSS MiB | RssAnon MiB | RssFile MiB | data loading % of step |")
    print("|---|---|---|---|---|---|")
    for megabytes in (10, 200):
        folder = synthesise(args.out, megabytes)
        size = sum(p.stat().st_size for p in folder.glob("*.bin")) / 1e6
        m = rank_memory(folder, args.steps, args.out / f"run-{megabytes}")
        row = f"{m['hwm']:.0f} | {m['anon']:.0f} | {m['file']:.0f} | {m['data_pct']:.2f}"
        print(f"| {megabytes} MB | {size:.0f} | {row} |")


if __name__ == "__main__":
    main()
