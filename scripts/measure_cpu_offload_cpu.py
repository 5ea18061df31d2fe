"""FSDP 2 on this CPU with and without training.enable_cpu_offload, alternating: the median step time of steps 3..N.

On a CPU-only machine the policy moves no memory (the shards are on the host already), so this measures only what the
offload path itself costs here: FSDP's extra copies (a host-to-"device" copy of each shard before its all-gather,
synchronous gradient copies) and nothing else. Usage: PYTHONPATH=src python scripts/measure_cpu_offload_cpu.py [pairs]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from launcher import run_ranks

BASE = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "4"]
BASE += ["--training.steps", "12", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]


def step_times(overrides: list[str]) -> list[float]:
    from meshforge.config.io import load_config
    from meshforge.train.loop import train

    dump = tempfile.mkdtemp(prefix="meshforge-offload-")
    records: list[dict[str, Any]] = train(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))
    return [r["step_time_s"] for r in records[2:]]


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for _ in range(pairs):
        for label, extra in (("off", []), ("on", ["--training.enable_cpu_offload"])):
            times = run_ranks(step_times, 2, extra)[0]
            print(f"cpu_offload {label}: median step {statistics.median(times):.4f} s over {len(times)} steps")


if __name__ == "__main__":
    main()
