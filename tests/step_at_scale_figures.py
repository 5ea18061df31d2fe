"""The figures of docs/benchmarks/step-at-scale.md: host reads per step that does not log, per layout
(device/host_reads.py over the real train_step), and gradient-exchange bytes per optimizer step at gradient
accumulation 1 / 4 / 16 (device/collective_counter.py), FSDP 2 and HSDP 2 x 2, per gradient_sync mode.

    OMP_NUM_THREADS=1 .venv/bin/python tests/step_at_scale_figures.py [reads|bytes]   # JSON on stdout

Run from a checkout's root (tests/ on the path); the "before" figures ran the same script in a checkout of the commit
before the change with this counter copied in (every_microstep is the old behaviour there, whatever the flag)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "distributed")]

from collective_run import count_collectives  # noqa: E402
from host_read_run import count_host_reads  # noqa: E402
from launcher import run_ranks  # noqa: E402

HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]


def reads() -> dict[str, Any]:
    from test_host_reads import LAYOUTS, LB, _fault_tolerant

    out: dict[str, Any] = {}
    runs = [(name, count_host_reads, world, args) for name, (world, args) in LAYOUTS.items()]
    for name, fn, world, args in [*runs, ("fault tolerant (1 group of fsdp 2)", _fault_tolerant, 2, LB)]:
        try:
            ranks = run_ranks(fn, world, args)
        except Exception as exc:  # a layout the checkout cannot run
            out[name] = f"error: {str(exc).splitlines()[0][:120]}"
            continue
        per_step = [len(r) for rank in ranks for r in rank["reads"].values()]
        sites = sorted({r for rank in ranks for rs in rank["reads"].values() for r in rs})
        out[name] = {"max_reads_per_step_per_rank": max(per_step), "sites": sites}
    return out


def exchange_bytes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout, world, extra in (("fsdp 2", 2, []), ("hsdp 2x2", 4, HSDP)):
        for ga in (1, 4, 16):
            for mode in ("every_microstep", "once_per_step", "once_per_step keep") if ga > 1 else ("once_per_step",):
                args = ["--training.local_batch_size", "1", "--training.gradient_accumulation_steps", str(ga)]
                args += ["--training.steps", "2", *extra, "--gradient_sync.mode", mode.split()[0]]
                args += ["--gradient_sync.regather", "keep"] if mode.endswith("keep") else []
                try:
                    steps = run_ranks(count_collectives, world, args)[0]["steps"]
                except Exception as exc:
                    out[f"{layout} GA {ga} {mode}"] = f"error: {str(exc).splitlines()[0][:120]}"
                    continue
                out[f"{layout} GA {ga} {mode}"] = steps[2]  # the second step: {collective@axis: [calls, bytes]}
    return out


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "reads"
    print(json.dumps(reads() if what == "reads" else exchange_bytes(), indent=1))
