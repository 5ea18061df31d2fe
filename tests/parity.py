"""Loss parity against a single process: same seed, same global batch, fp32, deterministic."""

from __future__ import annotations

import functools
import tempfile
from typing import Any

from launcher import run_ranks

GLOBAL_BATCH = 8
BASE = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "64",
    "--training.steps",
    "5",
    "--training.deterministic",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
    "--optimizer.lr",
    "3e-3",
]


def train_records(overrides: list[str]) -> list[dict[str, Any]]:
    """Runs inside a rank: train with BASE + overrides, return the logged records."""
    from meshforge.config.io import load_config
    from meshforge.train.loop import train

    dump = tempfile.mkdtemp(prefix="meshforge-test-")
    return train(load_config(None, [*BASE, "--job.dump_folder", dump, *overrides]))


def losses(world_size: int, overrides: list[str], rank: int = 0) -> list[float]:
    records = run_ranks(train_records, world_size, overrides)[rank]
    return [r["loss"] for r in records]


@functools.cache
def reference(extra: tuple[str, ...] = ()) -> tuple[float, ...]:
    """The single-process losses for the global batch (cached per extra overrides)."""
    return tuple(losses(1, ["--training.local_batch_size", str(GLOBAL_BATCH), *extra]))


def assert_parity(got: list[float], want: tuple[float, ...] | list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= rtol * abs(w), f"step {step}: {g} vs single process {w} (rtol {rtol})\n{got}\n{want}"
