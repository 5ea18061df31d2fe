"""Fit a hardware profile's efficiency constants to measured runs (``meshforge bench`` results.json).

Throughput constants are fitted by Nelder-Mead on the squared log error of tokens/s (the model is piecewise smooth:
overlap terms are max(0, ...)); the two memory constants by linear least squares on relative error, since the peak is
allocated x (1 + allocator_overhead) + framework_gib. The same code fitted the shipped defaults to the article.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError
from meshforge.model.flavors import get_flavor
from meshforge.plan.estimate import Estimate, estimate
from meshforge.plan.hardware import HardwareProfile
from meshforge.plan.layout import Layout, normalize_schedule, with_stages

TIME_CONSTANTS = ("matmul", "memory_bandwidth", "network", "intra_node_latency", "stage_overhead")
"""What --calibrate fits by default: compute, element-wise and communication efficiency, the per-step latency of
collectives inside a node (on an oversubscribed CPU host, the scheduler's, not the wire's) and the host time of a
pipeline action (zero on GPU presets, so fitting leaves it there)."""


PRIOR_WEIGHT = 1e-3
"""Weight of a pull toward the starting constants (squared log-multipliers): where the runs cannot tell two constants
apart (compute and element-wise time of one model at one size) the fit stays near the start instead of wandering
with the probe's noise; where they can, it moves the fit by well under 1 %."""
LOG_RANGE = math.log(100.0)
"""A fitted constant stays within 100x of its starting value either way."""


@dataclass(frozen=True)
class Observation:
    """One measured run: its layout and what it achieved."""

    name: str
    layout: Layout
    tps_per_device: float
    peak_memory_gib: float | None
    emulated: bool = False
    """Float8 emulated in high precision (a CPU run): its time is not Float8's, so it is reported but not fitted."""


def read_results(path: Path) -> list[Observation]:
    """The successful runs of a bench results.json: a list of records, or {"runs": [...]}."""
    if not path.is_file():
        raise ConfigError(f"--calibrate {path}: no such file (meshforge bench writes DIR/results.json)")
    try:
        data: Any = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--calibrate {path}: not valid JSON ({exc})") from None
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
        layout = with_stages(layout, get_flavor(layout.flavor))
        memory = record.get("peak_memory_gib")
        return Observation(
            str(record.get("name", layout.describe())),
            layout,
            float(record["tps_per_device"]),
            float(memory) if memory else None,
            bool(flags.get("float8_emulate", False)) and layout.float8,
        )
    except KeyError as exc:
        raise ConfigError(f"--calibrate {path}: a run lacks the key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--calibrate {path}: a run has a bad value ({exc})") from None


def fit(obs: Sequence[Observation], hw: HardwareProfile, names: Sequence[str] = TIME_CONSTANTS) -> HardwareProfile:
    """The profile with ``names`` fitted to the runs' throughput and the memory constants to their peaks."""
    return fit_memory(obs, fit_time([o for o in obs if not o.emulated], hw, names))


def fit_time(obs: Sequence[Observation], hw: HardwareProfile, names: Sequence[str]) -> HardwareProfile:
    """Nelder-Mead over log-multipliers of the named efficiency constants, minimising squared log TPS errors."""
    eff_names = [n for n in names if hasattr(hw.efficiency, n)]
    spec_names = [n for n in names if n not in eff_names]
    unknown = [n for n in spec_names if not isinstance(getattr(hw.spec, n, None), float)]
    if unknown:
        raise ConfigError(f"cannot fit {unknown[0]!r}: not an efficiency constant or a numeric hardware field")

    def profile_at(x: Sequence[float]) -> HardwareProfile:
        scale = {n: math.exp(max(-LOG_RANGE, min(LOG_RANGE, v))) for n, v in zip(names, x, strict=True)}
        eff = replace(hw.efficiency, **{n: getattr(hw.efficiency, n) * scale[n] for n in eff_names})
        spec = replace(hw.spec, **{n: getattr(hw.spec, n) * scale[n] for n in spec_names})
        return replace(hw, spec=spec, efficiency=eff)

    def loss(x: Sequence[float]) -> float:
        p = profile_at(x)
        misfit = sum(math.log(estimate(o.layout, p).tps_per_device / o.tps_per_device) ** 2 for o in obs)
        return misfit + PRIOR_WEIGHT * sum(v * v for v in x)

    best = nelder_mead(loss, [0.0] * len(names))
    return profile_at(best)


def fit_memory(obs: Sequence[Observation], hw: HardwareProfile, fit_slack: bool = True) -> HardwareProfile:
    """framework_gib (and, with enough distinct runs, allocator_overhead >= 0) by least squares on relative error."""
    pairs = [(allocated_gib(estimate(o.layout, hw), hw), o.peak_memory_gib) for o in obs if o.peak_memory_gib]
    if not pairs:
        return hw
    slack = hw.efficiency.allocator_overhead
    if fit_slack and len({round(a, 3) for a, _ in pairs}) > 2:
        slack = max(0.0, _relative_lstsq(pairs)[0])
    weights = [1 / m**2 for _, m in pairs]
    fixed = sum(w * (m - a * (1 + slack)) for (a, m), w in zip(pairs, weights, strict=True)) / sum(weights)
    return replace(hw, efficiency=replace(hw.efficiency, allocator_overhead=slack, framework_gib=max(0.0, fixed)))


def allocated_gib(est: Estimate, hw: HardwareProfile) -> float:
    """The model's allocated peak, before allocator slack and the fixed framework overhead."""
    eff = hw.efficiency
    return (est.peak_memory_gib - eff.framework_gib) / (1 + eff.allocator_overhead)


def _relative_lstsq(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Solve min sum ((a (1 + s) + f) / m - 1)^2 for (s, f): 2x2 normal equations."""
    rows = [(a / m, 1 / m, 1 - a / m) for a, m in pairs]  # unknowns s, f; residual target
    s11 = sum(x * x for x, _, _ in rows)
    s12 = sum(x * y for x, y, _ in rows)
    s22 = sum(y * y for _, y, _ in rows)
    b1 = sum(x * t for x, _, t in rows)
    b2 = sum(y * t for _, y, t in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-12:
        return 0.0, b2 / s22 if s22 else 0.0
    return (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det


def nelder_mead(
    f: Callable[[Sequence[float]], float], x0: list[float], step: float = 0.3, iters: int = 400, tol: float = 1e-10
) -> list[float]:
    """Minimise f from x0 with the Nelder-Mead simplex (standard coefficients)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=lambda i: values[i])]


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
