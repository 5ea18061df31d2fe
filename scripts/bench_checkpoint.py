#!/usr/bin/env python3
"""Checkpoint save / load time and size for CPU flavors, sync vs async save (one process, local disk).

Usage (from the repository root)::

    python scripts/bench_checkpoint.py --flavors debugmodel 100m --repeats 3 --out /tmp/ckpt-bench

For each flavor it builds the model and an AdamW state (one step with random gradients), then measures, median over
``--repeats``: a sync save (blocking = total), an async save (blocking = staging copy; total = until committed),
a full load (integrity check + DCP read + applying the state), and the final model-only bf16 export. Sizes are the
committed folders on disk. Prints a Markdown table (the one in docs/benchmarks/checkpoint.md).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshforge.checkpoint.dcp import Checkpointer
from meshforge.config.schema import Checkpoint, LRScheduler, Optimizer
from meshforge.data.loader import PackedDataLoader
from meshforge.model.flavors import get_flavor, param_counts
from meshforge.model.llama import build_model
from meshforge.parallel.distributed import DistContext
from meshforge.train.loop import TrainState, checkpoint_states
from meshforge.train.optim import build_lr_scheduler, build_optimizer


def make_state(flavor: str) -> TrainState:
    args = get_flavor(flavor).with_seq_len(256)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = build_optimizer([model], Optimizer())
    scheduler = build_lr_scheduler(optimizer, LRScheduler(), 100)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    scheduler.step()
    loader = PackedDataLoader(
        np.zeros(10_000, np.int32), seq_len=256, local_batch_size=8, dp_rank=0, dp_degree=1, seed=0
    )
    none: Any = None
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    return TrainState(none, ctx, none, None, args, [model], optimizer, scheduler, loader, none, step=1)


def checkpointer(folder: Path, **cfg: Any) -> Checkpointer:
    return Checkpointer(
        Checkpoint(**{"enable": True, "interval": 1, **cfg}),
        dump_folder=str(folder),
        total_steps=100,
        info={"layout": "one process"},
        device=torch.device("cpu"),
        timeout_s=600,
        console=False,
    )


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 2**20


def measure(flavor: str, root: Path) -> dict[str, float]:
    state = make_state(flavor)
    times: dict[str, list[float]] = {"sync": [], "async_block": [], "async_total": [], "load": [], "export": []}
    for _ in range(ARGS.repeats):
        shutil.rmtree(root, ignore_errors=True)
        ck = checkpointer(root)
        start = time.perf_counter()
        ck.save(checkpoint_states(state), state.step)
        times["sync"].append(time.perf_counter() - start)
        ck = checkpointer(root, async_mode="async")
        state.step = 2
        start = time.perf_counter()
        ck.save(checkpoint_states(state), state.step)
        times["async_block"].append(time.perf_counter() - start)
        ck.close()
        times["async_total"].append(time.perf_counter() - start)
        fresh = make_state(flavor)
        start = time.perf_counter()
        fresh.step = checkpointer(root, load_step=2).load(checkpoint_states(fresh))
        times["load"].append(time.perf_counter() - start)
        assert fresh.step == 2
        ck = checkpointer(root, export_dtype="bfloat16")
        state.step = 100
        start = time.perf_counter()
        ck.save(checkpoint_states(state), state.step, model_only=True, export=True)
        times["export"].append(time.perf_counter() - start)
        state.step = 1
    out = {k: statistics.median(v) for k, v in times.items()}
    out["full_mib"] = folder_mib(root / "checkpoint/step-2")
    out["export_mib"] = folder_mib(root / "checkpoint/export/step-100")
    out["params_m"] = param_counts(get_flavor(flavor)).total / 1e6
    return out


def main() -> None:
    rows = ["| flavor | params | full checkpoint | sync save | async save: blocking / total | load | bf16 export |"]
    rows.append("|---|---|---|---|---|---|---|")
    for flavor in ARGS.flavors:
        r = measure(flavor, Path(ARGS.out) / flavor)
        rows.append(
            f"| {flavor} | {r['params_m']:.1f} M | {r['full_mib']:.0f} MiB | {r['sync']:.2f} s | "
            f"{r['async_block']:.2f} s / {r['async_total']:.2f} s | {r['load']:.2f} s | "
            f"{r['export_mib']:.0f} MiB, {r['export']:.2f} s |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "100m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="meshforge-ckpt-bench-"))
    ARGS = parser.parse_args()
    torch.set_num_threads(1)
    main()
