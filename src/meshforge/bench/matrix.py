"""A benchmark matrix file: TOML -> validated runs (bench/spec.py: the runs and each one's `meshforge train` command).

Every run of a matrix trains the same model (one flavor) on the same global batch with the same seed, so the loss
curves of all strategies coincide and any difference in speed or memory is the strategy's. The local batch of a run
is ``global_batch_size / (dp degree x gradient accumulation)``; a scaling sweep keeps the local batch of its base run
and adds gradient accumulation on fewer ranks, so the global batch stays the same.

File layout (see configs/bench/default.toml and docs/bench.md)::

    [bench]            name, flavor, seq_len, global_batch_size, warmup_steps, measured_steps, dtype, baseline, ...
    [bench.overrides]  dotted `meshforge train` keys applied to every run ("training.deterministic" = true)
    [[run]]            name, ranks, dp_replicate, dp_shard, tp, pp, cp, schedule, compile, float8, ac_mode, ...
    [[scaling]]        name, run (a [[run]] name), ranks = [1, 2, 4]
"""

from __future__ import annotations

import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from meshforge.bench.auto_keys import check_auto_entries
from meshforge.bench.ranks import resolve_ranks
from meshforge.bench.reference import figure
from meshforge.bench.spec import BenchMatrix, BenchRun
from meshforge.config.schema import Parallelism
from meshforge.errors import ConfigError
from meshforge.model.flavors import get_flavor
from meshforge.parallel import composability

DTYPES = ("float32", "bfloat16")
GROUPS = ("strategy", "scaling", "context", "extra")


def load_matrix(path: str | Path) -> BenchMatrix:
    """Read and validate a matrix file; ValueError naming the key, the value and the fix otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file (configs/bench/ holds the shipped matrices)")
    try:
        tree = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    try:
        source = str(file.resolve().relative_to(Path.cwd()))
    except ValueError:
        source = str(file)
    return parse_matrix(tree, source=source)


def parse_matrix(tree: dict[str, Any], source: str = "", device: str = "") -> BenchMatrix:
    """A BenchMatrix from the parsed TOML tree (sections [bench], [[run]], [[scaling]]). On ``device`` "cpu" (default:
    whatever this machine has) each run's ``cpu_overrides`` join its ``overrides``."""
    unknown = sorted(set(tree) - {"bench", "run", "scaling"})
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}] in the bench matrix; use [bench], [[run]] and [[scaling]]")
    head = dict(tree.get("bench", {}))
    check_auto_entries(tree.get("run", []))
    runs = [build_entry(BenchRun, entry, f"run[{i}]") for i, entry in enumerate(tree.get("run", []))]
    device = device or local_device()
    head, runs = resolve_ranks(head, runs, device)
    if device == "cpu":
        runs = [replace(r, overrides={**r.overrides, **r.cpu_overrides}) if r.cpu_overrides else r for r in runs]
    matrix = build_entry(BenchMatrix, {**head, "runs": runs, "source": source}, "bench")
    matrix = expand_scaling(matrix, tree.get("scaling", []))
    validate(matrix)
    return matrix


def local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_REQUIRED = {
    "BenchMatrix": {"name", "flavor", "seq_len", "global_batch_size", "warmup_steps", "measured_steps"},
    "BenchRun": {"name", "ranks"},
}
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,)}


def build_entry(cls: Any, entry: dict[str, Any], where: str) -> Any:
    """A dataclass from a TOML table: unknown keys, wrong types and missing required keys are errors naming the key."""
    known = {f.name: str(f.type) for f in fields(cls) if f.name not in ("runs", "scaling", "source")}
    for key, value in entry.items():
        if key in ("runs", "source") and cls is BenchMatrix:
            continue
        if key not in known:
            raise ConfigError(f"unknown key {where}.{key}; allowed: {', '.join(sorted(known))}")
        text = known[key]
        expected = _TYPES.get(text, (dict,) if text.startswith("dict") else ())
        if expected and (not isinstance(value, expected) or (bool not in expected and isinstance(value, bool))):
            raise ConfigError(f"{where}.{key} = {value!r} must be {text}")
    missing = sorted(k for k in _REQUIRED[cls.__name__] if k not in entry)
    if missing:
        raise ConfigError(f"{where} needs the key {missing[0]!r} (see configs/bench/default.toml)")
    return cls(**entry)


def expand_scaling(matrix: BenchMatrix, entries: list[dict[str, Any]]) -> BenchMatrix:
    """Each [[scaling]] entry -> copies of its base run at each rank count, same local batch (+ accumulation)."""
    runs = list(matrix.runs)
    series: dict[str, list[str]] = {}
    for i, entry in enumerate(entries):
        where = f"scaling[{i}]"
        unknown = sorted(set(entry) - {"name", "run", "ranks"})
        if unknown or "run" not in entry or not isinstance(entry.get("ranks"), list):
            raise ConfigError(f"{where} needs run = '<a [[run]] name>' and ranks = [1, 2, 4] (and optionally name)")
        try:
            base = matrix.run(entry["run"])
        except KeyError:
            raise ConfigError(f"{where}.run = {entry['run']!r} is not the name of a [[run]]") from None
        name = entry.get("name", f"{base.name}_scaling")
        counts = dict.fromkeys(n or matrix.ranked_ranks if isinstance(n, int) else n for n in entry["ranks"])
        series[name] = [scaled(base, n, matrix, where, runs) for n in counts]  # 0: the ranked count
    return replace(matrix, runs=runs, scaling=series)


def scaled(base: BenchRun, ranks: Any, matrix: BenchMatrix, where: str, runs: list[BenchRun]) -> str:
    """The name of ``base`` at ``ranks`` ranks (appended to ``runs`` unless it is the base itself)."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"{where}.ranks holds {ranks!r}; use positive integers")
    if ranks == base.ranks:
        return base.name
    others = base.dp_replicate * base.tp * base.pp * base.cp
    if ranks % others:
        raise ConfigError(f"{where}: {ranks} ranks cannot hold the non-FSDP degrees of {base.name} ({others})")
    run = replace(
        base,
        name=f"{base.name}_r{ranks}",
        ranks=ranks,
        dp_shard=ranks // others,
        group="scaling",
        label="",
        reference="",
    )
    base_local = matrix.local_batch_size(base)
    if base_local < 1 or matrix.global_batch_of(base) % (run.dp * base_local):
        raise ConfigError(
            f"{where}: global_batch_size {matrix.global_batch_of(base)} is not a multiple of {run.dp} ranks x local "
            f"batch {base_local}; choose ranks that divide it"
        )
    run = replace(run, gradient_accumulation_steps=matrix.global_batch_of(base) // (run.dp * base_local))
    if all(r.name != run.name for r in runs):
        runs.append(run)
    return run.name


def validate(matrix: BenchMatrix) -> None:
    """Cross-checks: names unique, degrees multiply to ranks, batches divide, dtype known, baseline exists."""
    get_flavor(matrix.flavor)
    if matrix.dtype not in DTYPES:
        raise ConfigError(f"bench.dtype = {matrix.dtype!r}; choose one of {', '.join(DTYPES)}")
    if matrix.warmup_steps < 0 or matrix.measured_steps < 1:
        raise ConfigError("bench.warmup_steps must be >= 0 and bench.measured_steps >= 1")
    if matrix.repeat < 1 or not 0.5 <= matrix.confidence < 1 or min(matrix.max_repeat, matrix.time_budget_s) < 0:
        raise ConfigError(
            f"bench.repeat = {matrix.repeat}, confidence = {matrix.confidence}, max_repeat = {matrix.max_repeat}, "
            f"time_budget_s = {matrix.time_budget_s}: need repeat >= 1, 0.5 <= confidence < 1, the others >= 0"
        )
    names = [r.name for r in matrix.runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"run names must be unique; {sorted(n for n in names if names.count(n) > 1)[0]!r} repeats")
    if matrix.baseline and matrix.baseline not in names:
        raise ConfigError(f"bench.baseline = {matrix.baseline!r} is not the name of a [[run]]")
    for run in matrix.runs:
        validate_run(matrix, run)


def validate_run(matrix: BenchMatrix, run: BenchRun) -> None:
    where = f"run {run.name!r}"
    if not run.name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{where}: names may hold letters, digits, '_' and '-' only (it names a folder)")
    if run.group not in GROUPS:
        raise ConfigError(f"{where}: group = {run.group!r}; choose one of {', '.join(GROUPS)}")
    degrees = run.dp_replicate * run.resolved_dp_shard * run.tp * run.pp * run.cp
    if run.ranks < 1 or degrees != run.ranks or min(run.dp_replicate, run.tp, run.pp, run.cp) < 1:
        raise ConfigError(
            f"{where}: dp_replicate {run.dp_replicate} x dp_shard {run.resolved_dp_shard} x tp {run.tp} x pp {run.pp} "
            f"x cp {run.cp} must equal ranks = {run.ranks}; fix a degree (dp_shard = -1 fills in the rest)"
        )
    if run.reference:
        figure(run.reference)
    if run.fault_tolerance and run.dp_replicate < 2:
        raise ConfigError(
            f"{where}: fault_tolerance = true needs dp_replicate >= 2 (the number of torchft replica groups)"
        )
    check_composable(matrix, run)
    share = run.dp * run.gradient_accumulation_steps
    if matrix.global_batch_of(run) % share:
        raise ConfigError(
            f"{where}: global_batch_size = {matrix.global_batch_of(run)} is not divisible by dp {run.dp} x "
            f"gradient accumulation {run.gradient_accumulation_steps}; every run must train the same global batch"
        )


def check_composable(matrix: BenchMatrix, run: BenchRun) -> None:
    """A run the composability table refuses is a matrix error, not a crashed run (parallel/composability.py)."""
    keys = {**matrix.overrides, **run.overrides}
    rows = composability.active_parallelisms(
        Parallelism(
            disable_loss_parallel=bool(keys.get("parallelism.disable_loss_parallel", False)),
            enable_async_tensor_parallel=run.async_tp,
            pipeline_parallel_schedule=run.schedule,
            pipeline_parallel_schedule_csv=str(keys.get("parallelism.pipeline_parallel_schedule_csv", "")),
        ),
        dp_replicate=run.dp_replicate,
        dp_shard=run.resolved_dp_shard,
        tp=run.tp,
        pp=run.pp,
        cp=run.cp,
        ep=int(keys.get("parallelism.expert_parallel_degree", 1)),
        cp_impl=str(keys.get("parallelism.context_parallel_impl", "auto")),
    )
    features = composability.active_features(
        ac_mode=run.ac_mode or matrix.ac_mode,
        ac_option=str(keys.get("activation_checkpoint.selective_ac_option", "op")),
        compile_enabled=run.compile,
        float8_recipe=str(keys.get("quantize.dense.float8.recipe_name", "tensorwise")) if run.float8 else "",
    )
    error = composability.refusal(rows, features)
    if error is not None:
        raise ConfigError(f"run {run.name!r}: {error}")
