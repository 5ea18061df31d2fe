"""Calibrate a stack profile (plan/accuracy/stack.py) to measured runs: fit only what the runs identify.

The runs: a bench ``results.json`` (plan/accuracy/calibrate.py reads it) or a TOML of measured runs, one ``[[run]]``
per run::

    [[run]]
    world_size = 8
    args = "--model.flavor 8B --training.seq_len 8192 --parallelism.context_parallel_degree 2 ..."
    tokens_per_s_per_device = 10153
    memory_gib = 61.0          # optional: the peak one device reserved
    source = "where the figure comes from"   # optional
    name = "nemo-8b-bf16"      # optional
    impl = "meshforge"         # optional: whose code the planner prices (meshforge or torchtitan)

What is fitted (``choose``), in order, at most one constant per run: ``compute`` (one factor on matmul and attention
efficiency: the implementation's kernels; fit.FAMILY factor of the preset), ``float8_speedup`` (only with a Float8
run), ``network`` (only when a run spans more than one node: the constant is the share of the link bandwidth the
collectives reach, one for both links, so one node's runs leave it, and every inter-node figure, at the hardware's),
``memory_bandwidth`` (element-wise work). fit.fit_time drops what the runs then cannot identify. On a CPU host the
bench's constants (calibrate.TIME_CONSTANTS) are fitted as before. Runs with a memory figure fit the memory constants
(memory_fit.py: the allocator slack and the fixed part, both only where the runs identify both).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError, load_config, read_data
from meshforge.config.schema import Parallelism
from meshforge.plan import shipped
from meshforge.plan.accuracy import calibrate
from meshforge.plan.accuracy.fit import FAMILY, Fit, MemoryFit, Observation, allocated_gib, fit_time
from meshforge.plan.accuracy.memory_fit import fit_memory_terms
from meshforge.plan.hardware import HardwareProfile, StackInfo, auto_param_dtype
from meshforge.plan.layout import IMPLEMENTATIONS, layout_from_config

COMPUTE = "compute"
"""The fitted factor on matmul and attention efficiency (fit.FAMILY + the preset's name inside the fit)."""
CANDIDATES = (COMPUTE, "float8_speedup", "network", "memory_bandwidth")
HELD_ALWAYS = ("async_tp_overlap",)
"""Never fitted from a stack's runs (the published rows do not identify it either: plan/shipped.py)."""
RUN_KEYS = {"world_size", "args", "tokens_per_s_per_device", "memory_gib", "source", "name", "impl"}


@dataclass(frozen=True)
class StackFit:
    """The calibrated profile, the fit's statistics, and each run's name, source and what it determines."""

    profile: HardwareProfile
    fit: Fit | None
    fitted: tuple[str, ...]
    held: tuple[str, ...]
    determines: dict[str, tuple[str, ...]]
    sources: dict[str, str]
    memory: MemoryFit | None = None
    """The memory constants' fit (None: no run carries a memory figure)."""


def read_runs(path: Path, hw: HardwareProfile) -> tuple[list[Observation], dict[str, str]]:
    """The ``[[run]]`` tables of a TOML file as observations on ``hw`` (and each run's source); one-line
    ConfigError naming the run and key for anything wrong."""
    tree = read_data(path, "--calibrate")
    runs = tree.get("run")
    if not isinstance(runs, list) or not runs or set(tree) - {"run"}:
        raise ConfigError(f"--calibrate {path}: expected one [[run]] table per measured run and nothing else")
    obs, sources = [], {}
    for i, run in enumerate(runs):
        where = f"--calibrate {path} run {i + 1}"
        if not isinstance(run, dict):
            raise ConfigError(f"{where}: {run!r} is not a table; write each run as a [[run]] table with keys")
        if isinstance(run.get("name"), str):
            where += f" ({run['name']})"
        o = _observation(run, where, hw, i + 1)
        if o.name in sources:
            raise ConfigError(f"--calibrate {path}: two runs are named {o.name!r}; give each its own name")
        obs.append(o)
        sources[o.name] = str(run.get("source", ""))
    return obs, sources


def _observation(run: dict[str, Any], where: str, hw: HardwareProfile, index: int) -> Observation:
    unknown = sorted(set(run) - RUN_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(RUN_KEYS))}")
    for key in ("world_size", "args", "tokens_per_s_per_device"):
        if key not in run:
            raise ConfigError(f"{where}: missing {key}")
    world, tps, mem = run["world_size"], run["tokens_per_s_per_device"], run.get("memory_gib")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ConfigError(f"{where}: world_size = {world!r} must be an integer >= 1")
    for key, value in (("tokens_per_s_per_device", tps), ("memory_gib", mem)):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if value is not None and not ok:
            raise ConfigError(f"{where}: {key} = {value!r} must be a finite number > 0")
    impl = str(run.get("impl", "meshforge"))
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"{where}: impl = {impl!r}; choose {', '.join(IMPLEMENTATIONS)}")
    if not isinstance(run["args"], str):
        raise ConfigError(f"{where}: args = {run['args']!r} must be a string of meshforge flags")
    try:
        argv = shlex.split(run["args"])
    except ValueError as exc:  # an unbalanced quote or a trailing backslash
        raise ConfigError(
            f"{where}: args = {run['args']!r} cannot be split into flags ({exc}): fix its quoting"
        ) from None
    try:
        cfg = load_config(None, argv)
    except ConfigError as exc:
        raise ConfigError(f"{where}: args: {exc}") from None
    _check_degrees(cfg.parallelism, world, where)
    try:
        layout = layout_from_config(cfg, world, impl=impl, auto_dtype=auto_param_dtype(hw.spec))
    except ConfigError as exc:
        text = str(exc).replace("--world-size", "world_size")
        raise ConfigError(f"{where}: {text} (fix the run's world_size or its args)") from None
    name = str(run.get("name", f"run {index}: {layout.describe().replace(' | ', '; ')}"))  # no '|': a table cell
    obs = Observation(name, layout, float(tps), float(mem) if mem else None)
    calibrate.check_run(obs, hw, where)  # above the peak's tokens/s, below the state's memory: refused
    return obs


def _check_degrees(par: Parallelism, world: int, where: str) -> None:
    """The run's degrees against its world_size: a ConfigError naming the run, the degrees that do not divide it and
    the fix (instead of the planner's message about --world-size, which a runs file does not have)."""
    keys = ["data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree"]
    keys += ["pipeline_parallel_degree"] + (
        ["data_parallel_shard_degree"] if par.data_parallel_shard_degree != -1 else []
    )
    degrees = {k: getattr(par, k) for k in keys}
    product = math.prod(degrees.values())
    named = " x ".join(f"{k} {v}" for k, v in degrees.items() if v != 1) or "every degree 1"
    if par.data_parallel_shard_degree == -1 and world % product:
        raise ConfigError(
            f"{where}: world_size {world} is not divisible by {named}: fix the run's world_size or its args"
        )
    if par.data_parallel_shard_degree != -1 and product != world:
        raise ConfigError(f"{where}: {named} = {product}, not world_size {world}: fix the run's world_size or its args")


def spans_nodes(obs: Sequence[Observation], hw: HardwareProfile) -> bool:
    """Whether any run is wider than one node (its collectives then cross the inter-node links)."""
    return any(o.layout.world_size > hw.spec.devices_per_node for o in obs)


def choose(obs: Sequence[Observation], hw: HardwareProfile) -> tuple[list[str], list[str]]:
    """(what to fit, what to hold at ``hw``'s): CANDIDATES in order, those the runs can move, at most one per run."""
    timed = [o for o in obs if not o.emulated]
    movable = {
        COMPUTE: bool(timed),
        "float8_speedup": any(o.layout.float8 for o in timed) and hw.spec.peak_fp8_flops > 0,
        "memory_bandwidth": True,
        "network": spans_nodes(timed, hw),
    }
    fitted = [n for n in CANDIDATES if movable[n]][: len(timed)]
    held = [n for n in CANDIDATES if n not in fitted] + list(HELD_ALWAYS)
    return fitted, held


def fit_stack(
    obs: Sequence[Observation], hw: HardwareProfile, name: str, sources: dict[str, str] | None = None
) -> StackFit:
    """The stack profile ``name`` fitted to the runs on ``hw`` (a GPU preset's datasheet; a CPU host keeps
    calibrate.py's bench constants), with what each run determines."""
    sources = sources or {}
    if not hw.spec.is_gpu:
        return _fit_cpu(obs, hw, name, sources)
    fitted, held = choose(obs, hw)
    family = FAMILY + hw.spec.name
    names = [family if n == COMPUTE else n for n in fitted]
    result = fit_time(obs, hw, names, prior=calibrate.PRIOR_WEIGHT)
    kept = tuple(COMPUTE if c.name == family else c.name for c in result.constants)
    held = [*held, *(COMPUTE if d == family else d for d, _ in result.dropped)]
    profile = result.apply(hw)
    mem = _fit_memory(obs, profile)
    profile = mem.apply(profile) if mem else profile
    timed = [o for o in obs if not o.emulated]
    if len(timed) > len(kept) >= 1:
        sd = calibrate.loo_spread(timed, hw, names)
    else:  # as many constants as runs: no run is left to measure the spread; the one-node split's is used
        sd = max(hw.efficiency.tps_log_sd, shipped.SPLIT_LOG_SD)
    eff = replace(
        profile.efficiency, tps_log_sd=sd, memory_log_sd=mem.residual_sd if mem else hw.efficiency.memory_log_sd
    )
    determines = {
        o.name: tuple(_label(c.name, family) for c in result.constants if o.name in c.determined_by) for o in obs
    }
    info = _info(name, hw, kept, tuple(held), obs, sources)
    return StackFit(replace(profile, efficiency=eff, stack=info), result, kept, tuple(held), determines, sources, mem)


def _fit_memory(obs: Sequence[Observation], profile: HardwareProfile) -> MemoryFit | None:
    pairs = [(allocated_gib(o, profile), o.peak_memory_gib) for o in obs if o.peak_memory_gib]
    return fit_memory_terms(pairs, profile) if pairs else None


def _label(name: str, family: str) -> str:
    return COMPUTE if name == family else name


def _fit_cpu(obs: Sequence[Observation], hw: HardwareProfile, name: str, sources: dict[str, str]) -> StackFit:
    profile, result, mem = calibrate.fit_with_statistics(obs, hw)
    kept = tuple(c.name for c in result.constants)
    held = tuple(n for n in calibrate.TIME_CONSTANTS if n not in kept)
    determines = {o.name: tuple(c.name for c in result.constants if o.name in c.determined_by) for o in obs}
    info = _info(name, hw, kept, held, obs, sources)
    return StackFit(replace(profile, stack=info), result, kept, held, determines, sources, mem)


def _info(
    name: str,
    hw: HardwareProfile,
    fitted: tuple[str, ...],
    held: tuple[str, ...],
    obs: Sequence[Observation],
    sources: dict[str, str],
) -> StackInfo:
    worlds = tuple(sorted({o.layout.world_size for o in obs}))
    srcs = tuple(dict.fromkeys(s for s in sources.values() if s))
    base = hw.stack.name if hw.stack is not None else hw.spec.name  # whose constants the held ones are
    return StackInfo(name, base, fitted, held, worlds, srcs)


def one_node(info: StackInfo, hw: HardwareProfile) -> bool:
    """Whether the stack's runs all fit in one node of ``hw`` (its inter-node constants are then the hardware's)."""
    return bool(info.world_sizes) and max(info.world_sizes) <= hw.spec.devices_per_node
