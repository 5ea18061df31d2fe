"""`meshforge plan --guide`: the article's strategy-selection guide, computed by the layout search.

For every (model, GPU count, sequence length) cell the search (plan/search/advisor.py) ranks every fitting layout; a
cell keeps the recommended layout, its predicted tokens/s per device and memory with intervals
(plan/accuracy/interval.py), the runner-up (the best layout of another strategy family) and whether the two are
separable, the overheads that decide between them, and the best layout of each strategy family (the throughput curves,
plan/guide/curves.py). Cells are plain dicts (JSON), computed in parallel over the cores and cached on disk keyed by the
hardware profile, the cell and the planner's source, so a second run, or one that shares cells, reuses the search.

The global batch of a cell keeps TOKENS_PER_DEVICE tokens per GPU per step (the article's table 1: local batch 2 x
8192): ``world x TOKENS_PER_DEVICE / seq_len`` sequences, at least one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError, load_config
from meshforge.plan.accuracy.interval import interval, separable
from meshforge.plan.hardware import HardwareProfile, auto_param_dtype
from meshforge.plan.layout import Layout, layout_from_config
from meshforge.plan.physics.estimate import Estimate
from meshforge.plan.search.advisor import search

DEFAULT_WORLD_SIZES = (8, 64, 256, 512, 2048)
DEFAULT_SEQ_LENS = (8192, 32768, 131072)
DEFAULT_MODELS = ("8B", "70B", "405B")
TOKENS_PER_DEVICE = 16384
FAMILIES = ("FSDP", "FSDP x TP", "3D", "4D")
"""Strategy families by the highest dimension a layout adds to FSDP: TP; PP (3D, with or without TP); CP (4D)."""
ARTICLE_IMPL = "torchtitan"
OUTPUT_PACKAGE = "guide"
"""plan/guide/: the modules that only format cells (this one, flow, cli, curves); editing them does not invalidate
the cache."""


def family_of(tp: int, pp: int, cp: int) -> str:
    """The strategy family of the degrees (HSDP counts as FSDP, expert parallel is not a family)."""
    if cp > 1:
        return "4D"
    if pp > 1:
        return "3D"
    if tp > 1:
        return "FSDP x TP"
    return "FSDP"


def family(layout: Layout) -> str:
    """The strategy family of a layout (``family_of`` its degrees)."""
    return family_of(layout.tp, layout.pp, layout.cp)


def global_sequences(world: int, seq_len: int) -> int:
    """Sequences per optimizer step of a cell: TOKENS_PER_DEVICE tokens per GPU, at least one sequence."""
    return max(1, world * TOKENS_PER_DEVICE // seq_len)


def base_overrides(model: Sequence[str], world: int, seq_len: int) -> list[str]:
    """Config overrides of one cell's base job (model + sequence + global batch; the search picks the rest)."""
    return [
        *model,
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(global_sequences(world, seq_len)),
    ]


def _summary(est: Estimate, hw: HardwareProfile, model: Sequence[str]) -> dict[str, Any]:
    iv = interval(est, hw)
    return {
        "layout": est.layout.describe(),
        "family": family(est.layout),
        "degrees": {k: getattr(est.layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")},
        "schedule": est.layout.schedule if est.layout.pp > 1 else "",
        "ac_mode": est.layout.ac_mode,
        "float8": est.layout.float8,
        "tps": est.tps_per_device,
        "tps_low": iv.tps_low,
        "tps_high": iv.tps_high,
        "memory_gib": est.peak_memory_gib,
        "memory_low": iv.memory_low,
        "memory_high": iv.memory_high,
        "usable_gib": iv.usable_gib,
        "mfu_pct": est.mfu_pct,
        "time_per_token": {k: v / est.layout.tokens_per_device_step for k, v in est.time.items()},
        "overrides": [*model, *est.layout.to_train_flags()],
    }


def deciding_overheads(best: dict[str, Any], other: dict[str, Any], top: int = 2) -> list[str]:
    """The step-time components (per token) where ``other`` pays most over ``best``: what decides between them."""
    a, b = best["time_per_token"], other["time_per_token"]
    diffs = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
    total = sum(b.values()) - sum(a.values())
    out = [f"{k} {d / max(sum(b.values()), 1e-30):+.0%}" for d, k in diffs[:top] if d > 0]
    return out or [f"total {total / max(sum(b.values()), 1e-30):+.0%}"]


def compute_cell(hw: HardwareProfile, model: tuple[str, ...], world: int, seq_len: int, impl: str) -> dict[str, Any]:
    """Search one cell: recommended, runner-up (best of another family), separability, overheads, family bests."""
    cfg = load_config(None, base_overrides(model, world, seq_len))
    base = layout_from_config(cfg, 1, impl=impl, auto_dtype=auto_param_dtype(hw.spec))
    cell: dict[str, Any] = {"model": base.flavor, "world": world, "seq_len": seq_len, "impl": impl}
    try:
        result = search(base, world, hw, prune_by=family)
    except ConfigError as exc:
        return cell | {"best": None, "reason": str(exc)}
    best = result.best
    by_speed = sorted(result.ranked, key=lambda e: -e.tps_per_device)
    families: dict[str, Estimate] = {}
    for est in by_speed:
        families.setdefault(family(est.layout), est)
    others = [e for e in result.ranked if family(e.layout) != family(best.layout)]
    runner = others[0] if others else next((e for e in result.ranked[1:] if e.layout != best.layout), None)
    cell["best"] = _summary(best, hw, model)
    cell["families"] = {f: _summary(e, hw, model) for f, e in families.items()}
    cell["tried"], cell["fitting"], cell["pruned"] = result.tried, result.fitting, result.pruned
    if runner is not None:
        cell["runner_up"] = _summary(runner, hw, model)
        cell["separable"] = separable(best, runner, interval(best, hw))
        cell["deciding"] = deciding_overheads(cell["best"], cell["runner_up"])
    return cell


def _planner_digest() -> str:
    """Hash of the planner's and the model's sources: a cached cell is stale once either changes."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    sources = [*root.glob("plan/**/*.py"), *root.glob("model/*.py"), *root.glob("parallel/**/*.py")]
    for path in sorted(p for p in sources if p.relative_to(root).parts[:2] != ("plan", OUTPUT_PACKAGE)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("MESHFORGE_CACHE", Path.home() / ".cache" / "meshforge")) / "guide"


def _cell_key(hw: HardwareProfile, model: tuple[str, ...], world: int, seq: int, impl: str, digest: str) -> str:
    text = json.dumps([asdict(hw.spec), asdict(hw.efficiency), hw.name, model, world, seq, impl, digest], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _compute_group(jobs: Sequence[tuple[HardwareProfile, tuple[str, ...], int, int, str]]) -> list[dict[str, Any]]:
    """Cells searched one after the other in one process, so the search's memos (the pipeline simulations,
    plan/physics/schedules.py; layer times; the interval's estimates) carry over from one cell to the next."""
    return [compute_cell(*job) for job in jobs]


def groups(todo: Sequence[int], jobs: Sequence[tuple[Any, ...]]) -> list[list[int]]:
    """The cells to compute, grouped by (model, sequence length, implementation): the GPU counts of one model and
    sequence share most simulations (the same local batch per structure). Slowest groups first, so the cores finish
    together: the smallest models first (nearly every layout fits them, and each that fits is checked on every
    pipeline rank)."""
    by: dict[tuple[Any, ...], list[int]] = {}
    for i in todo:
        _, model, _, seq, impl = jobs[i]
        by.setdefault((model, seq, impl), []).append(i)
    return sorted(by.values(), key=lambda g: (_group_weight(jobs[g[0]][1]), -len(g)))


def _group_weight(model: tuple[str, ...]) -> float:
    """A flavor's size from its name (8B, 70B, 405B, 16B-A2B...), 0 when the name says none: only orders groups."""
    for word in reversed(model):
        head = word.upper().split("-")[0].removesuffix("B")
        try:
            return float(head)
        except ValueError:
            continue
    return 0.0


def compute_guide(
    hw: HardwareProfile,
    models: Sequence[Sequence[str]],
    worlds: Sequence[int],
    seqs: Sequence[int],
    *,
    impl: str = "meshforge",
    use_cache: bool = True,
    workers: int = 0,
) -> list[dict[str, Any]]:
    """Every cell of the grid (models x worlds x seqs), from the disk cache where present, else searched in parallel
    over the cores, one group of cells (a model and sequence length at every GPU count) per task."""
    digest = _planner_digest()
    jobs = [(hw, tuple(m), w, s, impl) for m in models for w in worlds for s in seqs]
    keys = [_cell_key(*job, digest) for job in jobs]
    folder = cache_dir()
    cells: dict[int, dict[str, Any]] = {}
    if use_cache:
        for i, key in enumerate(keys):
            path = folder / f"{key}.json"
            if path.exists():
                cells[i] = json.loads(path.read_text())
    todo = groups([i for i in range(len(jobs)) if i not in cells], jobs)
    if len(todo) < (workers or os.cpu_count() or 1):  # too few groups to keep the cores busy: one cell per task
        todo = [[i] for group in todo for i in group]
    tasks = [[jobs[i] for i in group] for group in todo]
    n = workers or min(len(tasks), os.cpu_count() or 1)
    if n > 1:
        with ProcessPoolExecutor(n) as pool:
            done = list(pool.map(_compute_group, tasks))
    else:
        done = [_compute_group(task) for task in tasks]
    for group, group_cells in zip(todo, done, strict=True):
        for i, cell in zip(group, group_cells, strict=True):
            cells[i] = cell
            if use_cache:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{keys[i]}.json").write_text(json.dumps(cell))
    return [cells[i] for i in range(len(jobs))]
