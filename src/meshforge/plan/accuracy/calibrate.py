"""Fit a hardware profile's efficiency constants to measured runs (``meshforge bench`` results.json).

The fitting is plan/accuracy/fit.py's (scipy least squares on log-multipliers, bounded, with standard errors and the
runs that determine each constant); the same code fits the shipped GPU defaults to the published rows
(plan/accuracy/loo.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError, read_data
from meshforge.model.flavors import causal_flops_per_token, get_flavor
from meshforge.plan.accuracy.fit import Fit, MemoryFit, Observation, allocated_gib, fit_time
from meshforge.plan.accuracy.memory_fit import fit_memory_terms
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout, layout_args, normalize_schedule, with_stages
from meshforge.plan.physics.estimate import estimate
from meshforge.plan.physics.memory import STATE_BYTES

TIME_CONSTANTS = ("matmul", "memory_bandwidth", "network", "intra_node_latency", "stage_overhead")
"""What --calibrate fits by default: compute, element-wise and communication efficiency, the per-step latency of
collectives inside a node (on an oversubscribed CPU host, the scheduler's, not the wire's) and the host time of a
pipeline action (zero on GPU presets, so fitting leaves it there)."""


PRIOR_WEIGHT = 1e-3
"""Weight of a pull toward the starting constants (squared log-multipliers): where the runs cannot tell two constants
apart (compute and element-wise time of one model at one size) the fit stays near the start instead of wandering
with the probe's noise; where they can, it moves the fit by well under 1 %."""


def read_results(path: Path) -> list[Observation]:
    """The successful runs of a bench results.json: a list of records, or {"runs": [...]}."""
    data: Any = read_data(path, "--calibrate", fmt="json", hint=" (meshforge bench writes DIR/results.json)")
    records = data.get("runs", data.get("records", [])) if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ConfigError(f'--calibrate {path}: expected a list of runs or {{"runs": [...]}}')
    out = [observation(r, path) for r in records if isinstance(r, dict) and r.get("status", "ok") == "ok"]
    if not out:
        raise ConfigError(f"--calibrate {path}: no run with status 'ok' to fit")
    return out


def observation(record: dict[str, Any], path: Path) -> Observation:
    """One bench record -> Observation; ConfigError naming the missing key."""
    try:
        lay, flags = record["layout"], record.get("flags", {})
        layout = Layout(
            flavor=record["flavor"],
            seq_len=int(record["seq_len"]),
            local_batch_size=int(record["local_batch_size"]),
            dp_replicate=int(lay.get("dp_replicate", 1)),
            dp_shard=int(lay.get("dp_shard", 1)),
            tp=int(lay.get("tp", 1)),
            pp=int(lay.get("pp", 1)),
            cp=int(lay.get("cp", 1)),
            schedule=normalize_schedule(str(lay.get("schedule") or "1F1B")),
            microbatch_size=int(flags.get("microbatch_size", lay.get("microbatch_size", 1))),
            ac_mode=str(flags.get("ac_mode", "selective")),
            sac_option=str(flags.get("selective_ac_option", "op")),
            compile=bool(flags.get("compile", False)),
            float8=bool(flags.get("float8", False)),
            async_tp=bool(flags.get("async_tp", False)),
            reshard_after_forward=int(lay.get("pp", 1)) == 1,
            param_dtype=str(flags.get("param_dtype", record.get("dtype", "bfloat16"))),
            grad_accum=int(flags.get("gradient_accumulation_steps", record.get("gradient_accumulation_steps", 1))),
            threads_per_rank=int(record.get("threads_per_rank") or 0),
        )
        name = str(record.get("name", layout.describe()))
        sizes = ("seq_len", "local_batch_size", "dp_replicate", "dp_shard", "tp", "pp", "cp", "microbatch_size")
        for key in (*sizes, "grad_accum"):
            if getattr(layout, key) < 1:
                raise ConfigError(
                    f"--calibrate {path}: run {name!r} has {key} = {getattr(layout, key)}; it must be >= 1"
                )
        layout = with_stages(layout, get_flavor(layout.flavor))
        memory = record.get("peak_memory_gib")
        tps, gib = float(record["tps_per_device"]), float(memory) if memory else None  # 0: not measured
        for key, value in (("tps_per_device", tps), ("peak_memory_gib", gib)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"--calibrate {path}: run {name!r} has {key} = {value}: a run with status 'ok' needs a finite "
                    "value > 0 (remove the run, or set its status to 'failed')"
                )
        return Observation(name, layout, tps, gib, bool(flags.get("float8_emulate", False)) and layout.float8)
    except ConfigError:
        raise
    except KeyError as exc:
        raise ConfigError(f"--calibrate {path}: a run lacks the key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--calibrate {path}: a run has a bad value ({exc})") from None


def fit(
    obs: Sequence[Observation], hw: HardwareProfile, names: Sequence[str] = TIME_CONSTANTS, spread: bool = True
) -> HardwareProfile:
    """The profile with ``names`` fitted to the runs' throughput and the memory constants to their peaks (``spread``:
    also measure its leave-one-out spread, n more fits; predictions do not depend on it)."""
    return fit_with_statistics(obs, hw, names, spread)[0]


def fit_with_statistics(
    obs: Sequence[Observation], hw: HardwareProfile, names: Sequence[str] = TIME_CONSTANTS, spread: bool = True
) -> tuple[HardwareProfile, Fit, MemoryFit | None]:
    """The profile with ``names`` fitted to the runs' throughput and the memory constants to their peaks, and the
    statistics of both fits (memory: None without a measured peak; memory_fit.py fits only the memory constants the
    runs identify). The profile's spreads are the leave-one-out RMS log errors of tokens/s and of the peak."""
    runs = [o for o in obs if not o.emulated]
    time_fit = fit_time(runs, hw, names, prior=PRIOR_WEIGHT)
    profile = time_fit.apply(hw)
    if spread:
        sd = loo_spread(runs, hw, names)
        profile = replace(profile, efficiency=replace(profile.efficiency, tps_log_sd=sd))
    pairs = [(allocated_gib(o, profile), o.peak_memory_gib) for o in obs if o.peak_memory_gib]
    if not pairs:
        return profile, time_fit, None
    mem = fit_memory_terms(pairs, profile)
    profile = mem.apply(profile)
    return replace(profile, efficiency=replace(profile.efficiency, memory_log_sd=mem.residual_sd)), time_fit, mem


def loo_spread(runs: Sequence[Observation], hw: HardwareProfile, names: Sequence[str] = TIME_CONSTANTS) -> float:
    """RMS log error of each run's tokens/s predicted by the fit to the others: each fold the same fit as the full
    one (from ``hw``'s constants, the same PRIOR_WEIGHT), so the spread is the error of the method that is shipped."""
    timed = [o for o in runs if o.tps_per_device]
    if len(timed) < 2:
        return hw.efficiency.tps_log_sd
    errors = []
    for i, o in enumerate(timed):
        rest = [r for j, r in enumerate(timed) if j != i]
        profile = fit_time(rest, hw, names, prior=PRIOR_WEIGHT).apply(hw)
        errors.append(math.log(estimate(o.layout, profile).tps_per_device / o.tps_per_device) ** 2)
    return math.sqrt(sum(errors) / len(errors))


def compare(obs: Sequence[Observation], hw: HardwareProfile) -> list[dict[str, Any]]:
    """Predicted vs measured for every run (relative errors)."""
    out = []
    for o in obs:
        est = estimate(o.layout, hw)
        row: dict[str, Any] = {
            "name": o.name,
            "layout": o.layout.describe(),
            "tps_measured": o.tps_per_device,
            "tps_predicted": est.tps_per_device,
            "tps_error": est.tps_per_device / o.tps_per_device - 1,
            "emulated": o.emulated,
        }
        if o.peak_memory_gib:
            row |= {
                "memory_measured_gib": o.peak_memory_gib,
                "memory_predicted_gib": est.peak_memory_gib,
                "memory_error": est.peak_memory_gib / o.peak_memory_gib - 1,
            }
        out.append(row)
    return out


# Physical checks of a measured run before a fit (issue 38's review).
# A run the fit must refuse (one-line ConfigError naming the run, the bound and the fix):
#
# * tokens/s per device above what the device's peak allows at 100 % MFU. The bound is the datasheet's nominal peak
#   (the Float8 peak for a Float8 run, where the device has one; no clock derate) over the fewest FLOPs a token needs:
#   6 x the (active, non-embedding) parameters plus the causal half of model/flavors.flops_per_token's attention term
#   (a causal kernel skips the masked half of the score matrix). Real runs also recompute activations, communicate
#   and run element-wise work, so no run reaches it; a figure above it is a typo or the wrong unit (per node, global).
#   Only on GPUs: a CPU host's peaks are a probe's, per probe thread, not a datasheet's ceiling.
# * a memory figure below what the layout must hold on the device whatever the implementation: the planner's sharded
#   fp32 parameters, gradients and AdamW state of the pipeline rank it prices (physics/memory.py STATE_BYTES; CPU
#   offload's host share excluded). Activations, buffers and allocator slack come on top; they are the
#   implementation's and are not part of the floor.
#
# A run to keep but flag (``run_warnings``): one whose layout the planner's memory model says does not fit the device.
# The run ran, so the memory model or the run's args (its AC, offload, degrees) are wrong.


def min_flops_per_token(obs: Observation) -> float:
    """The fewest training FLOPs a token of the run's model needs: flops_per_token with causal attention."""
    return causal_flops_per_token(layout_args(obs.layout), obs.layout.seq_len)


def max_tps_per_device(obs: Observation, hw: HardwareProfile) -> float:
    """Tokens/s per device at 100 % of the datasheet's nominal peak (the Float8 one for a Float8 run)."""
    spec = hw.spec
    peak = max(spec.peak_bf16_flops, spec.peak_fp8_flops if obs.layout.float8 else 0.0)
    return peak / min_flops_per_token(obs)


def memory_floor_gib(obs: Observation, hw: HardwareProfile) -> float:
    """The sharded fp32 parameters, gradients and optimizer state the planner puts on the priced pipeline rank."""
    mem = estimate(obs.layout, hw).memory
    return mem.parameters * (1 + STATE_BYTES["grads"] / STATE_BYTES["params"]) + mem.optimizer


def check_run(obs: Observation, hw: HardwareProfile, where: str) -> None:
    """Refuse a run whose throughput or memory figure is physically impossible (module docstring)."""
    if hw.spec.is_gpu:
        bound = max_tps_per_device(obs, hw)
        if obs.tps_per_device > bound:
            peak = "Float8" if obs.layout.float8 and hw.spec.peak_fp8_flops else "BF16"
            raise ConfigError(
                f"{where}: tokens_per_s_per_device = {obs.tps_per_device:,.0f} is above {bound:,.0f}, what "
                f"{obs.layout.flavor} reaches at 100 % of {hw.spec.name}'s {peak} peak "
                f"({min_flops_per_token(obs) / 1e9:.1f} GFLOP per token): give tokens/s per device (not per node "
                "or in total), or fix the run's args"
            )
    if obs.peak_memory_gib is not None:
        floor = memory_floor_gib(obs, hw)
        if obs.peak_memory_gib < floor:
            raise ConfigError(
                f"{where}: memory_gib = {obs.peak_memory_gib:g} is below {floor:.1f} GiB, the fp32 parameters, "
                f"gradients and AdamW state its layout ({obs.layout.describe().replace(' | ', '; ')}) holds per "
                "device: give the peak of one device in GiB, or fix the run's args"
            )


def run_warnings(obs: Sequence[Observation], hw: HardwareProfile) -> list[str]:
    """One line per run whose layout the planner's memory model says does not fit ``hw``'s device."""
    out = []
    for o in obs:
        est = estimate(o.layout, hw)
        if not est.fits:
            need, have = est.peak_memory_gib + est.runtime_gib, est.capacity_gib
            out.append(
                f"warning: run {o.name!r} ran, but the planner predicts {need:.1f} GiB per device for its layout "
                f"(device {have:.0f} GiB): its memory model or the run's args (AC, offload, degrees) are wrong"
            )
    return out
