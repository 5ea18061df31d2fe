"""`meshforge train --parallelism.auto`: the planner picks the layout, the exact memory run checks it, training runs it.

Training never imports the planner (docs/architecture.md: train/ is floor 5, plan/ floor 6), so the pick happens
before training starts, in the top-level command (meshforge/cli.py, floor 8): ``resolve_train_argv`` turns
``--parallelism.auto`` into the explicit flags of the layout it picks (parallel/layout.py Layout.to_train_flags), and
torchrun's ranks get those flags, never the search. The pick: plan/search/advisor.py's ranking for the world size
(``--nproc N``, else 1), the device (``--hardware NAME|FILE``: a preset, a shipped stack or a stack profile; default
``cpu`` when training runs on a CPU, else ``h100``) and the job's model, sequence and batch; then, fastest first, the
first whose exact fake-tensor peak (tools/memory_cli.py exact_memory: the real step on fake tensors as rank 0) with the
profile's allocator slack fits the device. A layout the exact run says does not fit is never picked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshforge.config.io import ConfigError, load_config
from meshforge.config.schema import JobConfig
from meshforge.plan.accuracy import stack
from meshforge.plan.hardware import GIB, HardwareProfile, auto_param_dtype
from meshforge.plan.layout import layout_from_config
from meshforge.plan.physics.estimate import Estimate
from meshforge.plan.search.advisor import search

FLAG = "--parallelism.auto"
MAX_EXACT = 4
"""At most this many of the fastest layouts get the exact memory run before the search gives up."""


@dataclass(frozen=True)
class Pick:
    """The chosen layout, its runner-up, the exact peak that admitted it, and the flags that run it."""

    chosen: Estimate
    runner_up: Estimate | None
    exact_gib: float
    usable_gib: float
    refused: tuple[tuple[str, float], ...]
    flags: tuple[str, ...]


def _take(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """``argv`` without ``flag VALUE`` (or ``flag=VALUE``), and the value."""
    out, value, skip = [], None, False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            value, skip = argv[i + 1], True
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
    return out, value


def _flags(est: Estimate) -> list[str]:
    """The layout's training flags, every degree spelled out (a degree the user gave must not survive the pick)."""
    out = est.layout.to_train_flags()
    for key in (
        "data_parallel_replicate",
        "tensor_parallel",
        "pipeline_parallel",
        "context_parallel",
        "expert_parallel",
    ):
        if f"--parallelism.{key}_degree" not in out:
            out += [f"--parallelism.{key}_degree", "1"]
    return out


def exact_peak_gib(cfg: JobConfig, world: int) -> float:
    """Rank 0's exact tensor peak (GiB) of the job's real step on fake tensors."""
    from meshforge.tools.memory_cli import exact_memory

    return exact_memory(cfg, world)[1].peak_bytes / GIB


def pick(cfg_argv: Sequence[str], config: str | None, world: int, hw: HardwareProfile) -> Pick:
    """The fastest predicted layout for ``world`` devices whose exact memory run fits ``hw`` (ConfigError if none
    of the first MAX_EXACT does)."""
    cfg = load_config(config, list(cfg_argv))
    base = layout_from_config(cfg, world, auto_dtype=auto_param_dtype(hw.spec))
    result = search(base, world, hw)
    if not result.ranked:
        raise ConfigError(
            f"{FLAG}: no layout of this model fits {world} x {hw.name}; use more devices or a smaller model"
        )
    usable = hw.spec.device_memory_gib(world) - hw.spec.runtime_gib
    eff = hw.efficiency
    refused: list[tuple[str, float]] = []
    for i, est in enumerate(result.ranked[:MAX_EXACT]):
        flags = tuple(_flags(est))
        peak = exact_peak_gib(load_config(config, [*cfg_argv, *flags]), world)
        if peak * (1 + eff.allocator_overhead) + eff.framework_gib <= usable:
            runner = next((e for e in result.ranked[i + 1 :]), None)
            return Pick(est, runner, peak, usable, tuple(refused), flags)
        refused.append((est.layout.describe(), peak))
    raise ConfigError(
        f"{FLAG}: the {len(refused)} fastest layouts do not fit by the exact memory run "
        f"({', '.join(f'{d}: {p:.2f} GiB' for d, p in refused)} of {usable:.2f} GiB usable)"
    )


def explain(p: Pick, world: int, hw: HardwareProfile) -> str:
    """Pick, runner-up and why, in a few lines."""
    c = p.chosen
    lines = [
        f"{FLAG}: {world} x {hw.name}{f' (stack {hw.stack.name})' if hw.stack else ''}: picked {c.layout.describe()}",
        f"  predicted {c.tps_per_device:,.1f} tokens/s per device, {c.peak_memory_gib:.2f} GiB; exact fake-tensor "
        f"peak {p.exact_gib:.2f} GiB of {p.usable_gib:.2f} usable",
    ]
    lines += [f"  refused by the exact memory run: {d} ({g:.2f} GiB)" for d, g in p.refused]
    if p.runner_up is not None:
        r = p.runner_up
        rel = r.tps_per_device / c.tps_per_device - 1
        parts = sorted(c.time, key=lambda k: r.time.get(k, 0.0) - c.time[k], reverse=True)
        lines.append(
            f"  runner-up {r.layout.describe()}: {rel:+.1%} tokens/s ({r.tps_per_device:,.1f}); why not: its "
            f"{parts[0].replace('_', ' ')} takes {r.time.get(parts[0], 0.0) * 1e3:.1f} ms per step vs "
            f"{c.time[parts[0]] * 1e3:.1f}"
        )
    lines.append(f"  training with: {' '.join(p.flags)}")
    return "\n".join(lines)


def resolve_train_argv(argv: list[str]) -> list[str]:
    """``meshforge train`` arguments with --parallelism.auto (and --hardware) replaced by the picked layout's flags;
    prints the pick. Arguments without the flag come back unchanged."""
    if FLAG not in argv:
        return argv
    from meshforge.train.cli import parse

    rest, hardware = _take([a for a in argv if a != FLAG], "--hardware")
    opts, overrides = parse(rest)
    if opts.dry_run:
        raise ConfigError(f"{FLAG} picks a layout to train; with --dry-run give the degrees instead")
    world = opts.nproc or 1
    cfg = load_config(opts.config, overrides)
    hw = stack.load_profile(hardware or ("cpu" if cfg.training.device == "cpu" or not _cuda() else "h100"))
    p = pick(overrides, opts.config, world, hw)
    print(explain(p, world, hw), flush=True)
    return [*rest, *p.flags]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
