"""Checks before `meshforge train --nproc N` starts any process: every mistake a rank would find, found once.

The layout is checked by the dry run (tools/dry_run.py): the real mesh, model build, parallelize and pipeline plan
(schedule name, CSV schedule, stage split, microbatches, schedule/AC/FSDP/compile compatibility) on torch's fake
process group, for the device this machine will use (so async TP or Float8 on a CPU is refused here, not in the
ranks). Then what only this machine can answer: the dump and checkpoint folders are writable, the tokenizer exists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import torch

from meshforge.config.io import ConfigError, check_writable
from meshforge.config.schema import JobConfig
from meshforge.data.tokenizer import resolve_path
from meshforge.tools.dry_run import plan


def local_device(requested: str) -> Literal["cpu", "cuda"]:
    """The device type the ranks of a local launch will pick (parallel/distributed.py's rule)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "training.device = 'cuda' but no CUDA device is visible; use training.device = 'cpu' or 'auto'"
        )
    return "cuda" if requested in ("auto", "cuda") and torch.cuda.is_available() else "cpu"


def preflight(cfg: JobConfig, world_size: int) -> None:
    """Raise `ConfigError` (one line) for the first mistake a ``world_size``-rank local launch of ``cfg`` would
    stop with."""
    local = dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, device=local_device(cfg.training.device))
    )
    plan(local, world_size)
    if not cfg.model.tokenizer_path.startswith("hf:"):
        resolve_path(cfg.model.tokenizer_path)
    check_writable(Path(cfg.job.dump_folder), "job.dump_folder")
    ck = cfg.checkpoint
    if ck.enable or ck.create_seed_checkpoint:
        check_writable(Path(cfg.job.dump_folder) / ck.folder, "checkpoint.folder")
    if ck.initial_load_path and not Path(ck.initial_load_path).exists():
        raise ConfigError(f"checkpoint.initial_load_path = {ck.initial_load_path!r} does not exist")
