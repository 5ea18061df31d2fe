"""``gradient_sync.mode = auto`` under gradient accumulation, decided by memory after the run's first step, by the
rule the planner prices (parallel/accumulation.py ``resolve_mode``).

The first step exchanges every micro-step (FSDP's default: sharded gradients only) and is measured; then every rank
puts its own figures into the rule, and the ranks take one exchange per step from the next step only if it fits on
all of them (one MIN all-reduce, once per run). Pipeline parallel and single micro-steps are decided by the rule
without memory, from the first step. This rank's figures:

- unsharded gradients: every FSDP-managed parameter's all-gathered size (tensor / expert parallel shards stay) in the
  accumulation dtype (gradient_sync.accumulate_dtype; fp32 parameters: fp32);
- CUDA: the rest is the first step's ``max_memory_allocated``; the capacity the device's total memory; the reserve
  what the device holds outside this process's caching allocator (total - free - reserved: the CUDA context,
  NCCL's communicators, workspaces, any other process); the slack the step's ``max_memory_reserved`` over
  ``max_memory_allocated`` (its fragmentation);
- a CPU: the rest is this process's peak resident memory (``getrusage``: the interpreter and libraries too, which the
  planner's CPU profile counts in its framework_gib); the capacity the host's memory divided among its ranks
  (LOCAL_WORLD_SIZE, else the world size: the planner's CPU profile divides it the same way); no reserve, no slack
  (resident memory already holds what the allocator keeps). The host's memory is shared with everything else on it:
  the rule keeps the run from swapping, not from other programs.

A fresh run's optimizer creates its state at the end of the first step, after that step's backward peak: its bytes
are added to the rest (a resumed run loaded them before the step: not added).

Then ``gradient_sync.regather = auto`` (train/regather.py) is decided after the first step that ran once per step.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshforge.device.dtypes import DTYPES
from meshforge.parallel.accumulation import ONCE, Budget, Need, describe, resolve_mode
from meshforge.parallel.gradient_sync import once_per_step
from meshforge.train.regather import agree, auto_keep, unsharded_numel

if TYPE_CHECKING:
    from meshforge.config.schema import JobConfig
    from meshforge.train.loop import TrainState


def decided_later(cfg: JobConfig, pipeline: bool) -> bool:
    """Whether the mode waits for the first step's measurement: auto, accumulation, no pipeline."""
    return cfg.gradient_sync.mode == "auto" and cfg.training.gradient_accumulation_steps > 1 and not pipeline


def step_once(state: TrainState) -> bool:
    """Whether this step's micro-steps before the last skip the exchange (the first step of an undecided auto: no)."""
    if state.sync_once is not None:
        return state.sync_once
    if decided_later(state.cfg, state.pipeline is not None):
        return False
    return once_per_step(state.cfg.gradient_sync, state.cfg.training.gradient_accumulation_steps)


def settle(state: TrainState, first_step: int, *, logged: bool) -> None:
    """After each step (every rank): at the first, an auto mode's decision; at the first step run once per step,
    regather auto's (train/regather.py), and while kept again at each ``logged`` step."""
    cfg, later = state.cfg, decided_later(state.cfg, state.pipeline is not None)
    if later and state.step == first_step:
        once, why = decide(state, fresh=first_step == 1)
        state.sync_once = once
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"meshforge: {why}", flush=True)
    fsdp_only = state.pipeline is None and state.dims.fsdp_enabled
    if state.step == first_step + later and step_once(state):
        state.regather_keep = auto_keep(cfg, state.model_parts, state.ctx.device, fsdp_without_pp=fsdp_only)
    elif state.regather_keep and logged:  # while kept: again on every log step (train/regather.py)
        state.regather_keep = auto_keep(cfg, state.model_parts, state.ctx.device, fsdp_without_pp=fsdp_only, kept=True)


def decide(state: TrainState, *, fresh: bool) -> tuple[bool, str]:
    """Once per step from the next step (True) where it fits every rank, and a line saying why. A collective."""
    cfg, device = state.cfg, state.ctx.device
    dtype = accumulation_dtype(cfg.training.mixed_precision_param, cfg.gradient_sync.accumulate_dtype)
    gradients = gradient_bytes(state.model_parts, dtype) if state.dims.fsdp_enabled else 0
    states = optimizer_state_bytes(state.optimizer) if fresh else 0
    need, budget = measured(device, gradients, states)
    accum = cfg.training.gradient_accumulation_steps
    mine = resolve_mode("auto", accum, pipeline=False, need=need, budget=budget) == ONCE
    once = agree(mine, device)
    verdict = "once per step from the next step" if once else "every micro-step (once per step does not fit every rank)"
    return once, f"gradient_sync.mode auto: {verdict}; this rank: {describe(need, budget)}"


def accumulation_dtype(param_dtype: str, accumulate_dtype: str) -> torch.dtype:
    """What the unsharded gradients are summed in (parallel/fsdp.py ``accumulate_in``)."""
    return torch.float32 if param_dtype == "float32" else DTYPES[accumulate_dtype]


def gradient_bytes(model_parts: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """Bytes of this rank's trainable parameters' unsharded gradients in ``dtype``."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(unsharded_numel(p) * item for part in model_parts for p in part.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (their local shards)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def measured(device: torch.device, gradients: int, states: int) -> tuple[Need, Budget]:
    """This rank's inputs to the rule (module docstring), the first step just run."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        reserve = total - free - torch.cuda.memory_reserved(device)
        slack = torch.cuda.max_memory_reserved(device) / max(1, peak) - 1
        return Need(gradients, peak + states), Budget(total, reserve, slack)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return Need(gradients, rss + states), Budget(host_memory() / host_ranks())


def host_memory() -> int:
    """The host's memory (MemTotal), bytes; the plan's CPU profile reads the same."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_ranks() -> int:
    """Ranks sharing this host: LOCAL_WORLD_SIZE (torchrun, meshforge's launcher), else the world size."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    return dist.get_world_size() if dist.is_initialized() else 1
